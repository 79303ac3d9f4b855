"""A real trained model in vLLM's engine on a GPU (issue 41): the same tokens, three ways.

SmolLM2-135M-Instruct's checkpoints of scripts/real_checkpoints.py (``make real-checkpoints``:
``fp8-dynamic``, per-channel weights and dynamic activations; ``fp8-static``, per-tensor weights
and calibrated static activations; and the ``bf16`` model they were quantized from) travel to
the device in pieces (scripts/device_vllm.sh PHASE=data) and are unpacked in ``--real``. Then:

1. in mpack's environment, each FP8 checkpoint is converted to a TP-1 sidecar for the profile
   vLLM runs it under on this GPU with ``linear_backend="marlin"`` (``w8a8-marlin``: the
   checkpoints keep their input activations), and the chat prompts of
   ``real_checkpoints.CHAT_PROMPTS`` go through the model's chat template into token ids;
2. one ``mpack serve`` per sidecar, on the GPU;
3. one engine process (scripts/vllm_engine.py engine-many) builds, one after another, for each
   FP8 checkpoint the ordinary engine (vLLM's own Marlin path), the sidecar loaded privately
   and the sidecar attached to its daemon, each generating 32 greedy tokens per prompt with the
   top-5 logprobs of every step; then the bf16 model (vLLM's unquantized path), for the text
   FP8 changed; and a control: the ``fp8-dynamic`` checkpoint with the ``fp8-static``
   sidecar, whose logprobs must differ (the comparison can fail).

Pass: for each FP8 checkpoint the private and attached token ids and logprobs equal the
ordinary engine's exactly, and the control differs. The record (``engine-real.json``) holds the
texts of every engine beside the bf16 model's.

    python3 scripts/vllm_real.py run --real DIR --mpack-env P --vllm-env P --out DIR
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # PYTHONSAFEPATH=1 on the device
from real_checkpoints import BF16, CHAT_PROMPTS, CHAT_STEPS, FP8_CHECKPOINTS, chat_ids  # noqa: E402
from vllm_engine import MODES, _env, compare, run_plan  # noqa: E402

#: vLLM's profile for these checkpoints on a GPU with native FP8 and ``linear_backend="marlin"``:
#: they keep their input activations, so CompressedTensorsW8A8Fp8 on Marlin.
PROFILE = "w8a8-marlin"
#: The control: this checkpoint's engine with the other checkpoint's sidecar.
CONTROL = ("fp8-dynamic", "fp8-static")


def sidecar_of(work: Path, name: str) -> Path:
    return work / f"sc-{name}"


def prepare(real: Path, work: Path) -> None:
    """Sidecars and prompt ids (mpack's environment): ``work/prompts.json``."""
    from transformers import AutoTokenizer

    from mpack.convert import convert

    for name in FP8_CHECKPOINTS:
        sc = sidecar_of(work, name)
        if not (sc / "mpack.json").is_file():
            convert(real / name, sc, profile=PROFILE, device="auto")
    ids = chat_ids(AutoTokenizer.from_pretrained(real / FP8_CHECKPOINTS[0]))  # the three share it
    (work / "prompts.json").write_text(json.dumps(ids))
    print(f"prepared {len(FP8_CHECKPOINTS)} sidecars and {len(ids)} prompts in {work}", flush=True)


def plan(real: Path, work: Path) -> list[dict[str, Any]]:
    """Every engine of the run, in order (scripts/vllm_engine.py engine-many)."""
    common = {
        "dtype": "bfloat16",
        "vocab": 0,
        "prompt_ids": json.loads((work / "prompts.json").read_text()),
        "max_tokens": CHAT_STEPS,
        "tokenizer": str(real / FP8_CHECKPOINTS[0]),
        "max_model_len": 512,
    }
    runs = [
        {
            **common,
            "key": f"{name}/{mode}",
            "mode": mode,
            "model": str(real / name),
            "sidecar": str(sidecar_of(work, name)),
        }
        for name in FP8_CHECKPOINTS
        for mode in MODES
    ]
    if (real / BF16 / "config.json").is_file():  # optional: the reference of what FP8 changed
        bf16 = {"key": BF16, "mode": "ordinary", "model": str(real / BF16), "unquantized": True}
        runs.append({**common, **bf16})
    ck, other = CONTROL
    runs.append(
        {
            **common,
            "key": "control",
            "mode": "private",
            "model": str(real / ck),
            "sidecar": str(sidecar_of(work, other)),
            "check_source": False,  # bound to the other checkpoint, on purpose
        }
    )
    return runs


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Each checkpoint's private and attached engines against its ordinary one, the control
    against ``fp8-dynamic``'s, and every engine's texts beside the bf16 model's."""
    missing = {"error": "missing"}
    rows: dict[str, Any] = {}
    for name in FP8_CHECKPOINTS:
        got = {m: results.get(f"{name}/{m}", missing) for m in MODES}
        row: dict[str, Any] = {m: compare(got["ordinary"], got[m]) for m in MODES[1:]}
        row["texts"] = {m: got[m].get("texts") for m in MODES}
        row["facts"] = {m: got[m].get("facts") for m in MODES}
        errors = {m: r["error"] for m, r in got.items() if "error" in r}
        if errors:
            row["errors"] = errors
        rows[name] = row
    ctl = compare(results.get(f"{CONTROL[0]}/ordinary", missing), results.get("control", missing))
    bf16 = results.get(BF16, missing)
    ok = all(
        r[m]["tokens_equal"] and r[m]["max_logprob_diff"] == 0.0
        for r in rows.values()
        for m in MODES[1:]
    )
    return {
        "all_equal": ok,
        "control_differs": ctl["max_logprob_diff"] not in (None, 0.0),
        "control": ctl,
        "prompts": list(CHAT_PROMPTS),
        "bf16_texts": bf16.get("texts"),
        "bf16_error": bf16.get("error"),
        "checkpoints": rows,
    }


def text_table(summary: dict[str, Any]) -> str:
    """The texts, prompt by prompt: bf16, then each FP8 checkpoint (one line when its three
    engines agree, which the run requires)."""

    def at(texts: list[str] | None, i: int) -> str | None:  # None: that engine failed
        return texts[i] if texts and i < len(texts) else None

    lines = []
    for i, p in enumerate(summary["prompts"]):
        lines.append(f"## {p}")
        lines.append(f"  bf16        : {at(summary['bf16_texts'], i)!r}")
        for name, row in summary["checkpoints"].items():
            texts = {m: at(t, i) for m, t in row["texts"].items()}
            same = len(set(texts.values())) == 1 and None not in texts.values()
            label = "all three" if same else "DIFFER"
            lines.append(f"  {name:<12}: {texts['ordinary']!r} ({label})")
    return "\n".join(lines)


def run(a: argparse.Namespace) -> int:
    me = [sys.executable, str(Path(__file__).resolve())]
    work = a.work
    missing = [n for n in FP8_CHECKPOINTS if not (a.real / n / "config.json").is_file()]
    if missing:
        print(f"{a.real}: no {', '.join(missing)}; send them with PHASE=data", file=sys.stderr)
        return 2
    t = time.time()
    subprocess.run([*me, "prepare", "--real", str(a.real), "--work", str(work)],
                   env=_env(a.mpack_env), check=True)  # fmt: skip
    sidecars = [sidecar_of(work, n) for n in FP8_CHECKPOINTS]
    rc, results = run_plan(a, plan(a.real, work), sidecars, "engine-real", t)
    summary = {"engine_rc": rc, "runs": len(results), **summarize(results)}
    (a.out / "engine-real.json").write_text(json.dumps(summary, indent=1))
    table = text_table(summary)
    (a.out / "engine-real-texts.md").write_text(table + "\n")
    print(table)
    brief = {k: summary[k] for k in ("engine_rc", "runs", "all_equal", "control_differs")}
    brief["equal"] = {n: {m: r[m] for m in MODES[1:]} for n, r in summary["checkpoints"].items()}
    print(json.dumps(brief, indent=1), flush=True)
    return 0 if summary["all_equal"] and summary["control_differs"] else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["run", "prepare"])
    ap.add_argument("--real", type=Path, default=Path("/tmp/real"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/mpack-real"))
    ap.add_argument("--out", type=Path, default=Path("/tmp/mpack-out"))
    ap.add_argument("--mpack-env", default="", help="PYTHONPATH of mpack's environment")
    ap.add_argument("--vllm-env", default="", help="PYTHONPATH of vLLM's environment")
    ap.add_argument("--timeout", type=float, default=480, help="the engine process")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    if a.mode == "prepare":
        prepare(a.real, a.work)
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
