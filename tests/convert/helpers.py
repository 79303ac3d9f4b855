"""Shared helpers of the convert CLI tests: run `mpack` in subprocesses, mutate real checkpoints.

Every CLI run is a real ``sys.executable -m mpack.cli ...`` subprocess. A run costs ~3 s of
imports (torch, compressed-tensors), so modules start their runs early through :class:`CliPool`
and let them overlap; each test then waits for its own run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from mpack.iokit import sha256_file
from mpack.sidecar import read_file_map

Proc = subprocess.CompletedProcess

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


# --- running the CLI ------------------------------------------------------------------------


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a CLI run: no debug tracebacks, no Hub token, the Hub offline."""
    # no COLUMNS: output to a pipe is rendered as CI sees it (mpack.ui.PIPE_WIDTH)
    env = {k: v for k, v in os.environ.items() if k not in ("MPACK_DEBUG", "HF_TOKEN", "COLUMNS")}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", OMP_NUM_THREADS="1")
    env.update(extra or {})
    return env


def cli(*args: str | os.PathLike, env: dict[str, str] | None = None, timeout: float = 180) -> Proc:
    """Run ``python -m mpack.cli ARGS`` to completion and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "mpack.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env=cli_env(env),
        timeout=timeout,
    )


def python_c(
    code: str, *args: str | os.PathLike, env: dict[str, str] | None = None, timeout: float = 300
) -> str:
    """Run ``python -c CODE ARGS`` in a fresh interpreter (``env``: default this one's); assert it
    succeeded and return its stdout."""
    r = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def default_signals() -> None:
    """In the child: SIGINT and SIGTERM as a terminal's foreground job has them. A test suite
    run as a background job (`make test &`, some CI runners) starts with SIGINT ignored, and
    mpack keeps an ignored signal ignored (Note [interrupts]), so a test that interrupts a
    command must not inherit that."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def cli_popen(*args: str | os.PathLike, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``python -m mpack.cli ARGS`` without waiting (output captured to pipes)."""
    return subprocess.Popen(
        [sys.executable, "-m", "mpack.cli", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(env),
        preexec_fn=default_signals,
    )


class CliPool:
    """Runs CLI subprocesses in the background, a few at a time, so a module's runs overlap."""

    def __init__(self, workers: int | None = None) -> None:
        n = workers or min(8, (os.cpu_count() or 2) + 1)
        self._pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="mpack-cli")

    def submit(self, *args: str | os.PathLike, env: dict[str, str] | None = None) -> Future[Proc]:
        """Queue one run; ``.result()`` gives its ``CompletedProcess``."""
        return self._pool.submit(cli, *args, env=env)

    def then(self, fn: Callable[[], Any]) -> Future[Any]:
        """Queue any callable (e.g. a run that needs files prepared by an earlier run)."""
        return self._pool.submit(fn)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def selected_params(request: pytest.FixtureRequest, argname: str) -> list[Any]:
    """Values of parameter ``argname`` of this module's tests that were collected (honours -k)."""
    out = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if (
            item.module is request.module
            and callspec
            and argname in callspec.params
            and callspec.params[argname] not in out
        ):
            out.append(callspec.params[argname])
    return out


def explain(r: Proc) -> str:
    """A failure message showing a run's exit code and output."""
    return f"exit {r.returncode}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"


def tmp_dirs(out: Path) -> list[Path]:
    """Hidden work (and old-sidecar) directories of runs for ``out`` (either naming)."""
    from mpack.convert.output import work_dirs

    return work_dirs(out)


def messages(stderr: str) -> str:
    """``stderr`` without the progress lines a run prints when stderr is not a terminal
    (``convert: ...``, ``verify: ...``)."""
    progress = ("convert: ", "verify: ")
    return "".join(line for line in stderr.splitlines(True) if not line.startswith(progress))


def assert_refused(r: Proc, out: Path, *expect: str, exists: bool = False) -> None:
    """Exit 2, one clean message holding every ``expect`` substring, no output and no work dir."""
    assert r.returncode == 2, explain(r)
    assert "Traceback" not in r.stderr, r.stderr
    assert messages(r.stderr).startswith("error: "), r.stderr
    for s in expect:
        assert s in r.stderr, f"{s!r} not in stderr:\n{r.stderr}"
    if not exists:
        assert not out.exists(), f"{out} exists after a refused run"
    assert tmp_dirs(out) == [], f"work dirs left behind: {tmp_dirs(out)}"


def manifest(sidecar: Path) -> dict[str, Any]:
    """The parsed ``mpack.json`` of ``sidecar``."""
    return json.loads((sidecar / "mpack.json").read_text())


# --- files ----------------------------------------------------------------------------------


sha256 = sha256_file  # hex sha256 of a file's bytes


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (relative path -> bytes), to show nothing was touched."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def safetensors_bytes(sidecar: Path) -> dict[str, bytes]:
    """The bytes of each ``*.safetensors`` file of a sidecar, by name (what two conversions
    must agree on byte for byte; ``mpack.json`` names its own directory)."""
    return {p.name: p.read_bytes() for p in sorted(sidecar.glob("*.safetensors"))}


def tensor_range(path: Path, name: str) -> tuple[int, int]:
    """Absolute byte range ``[start, end)`` of tensor ``name`` in safetensors file ``path``."""
    e = read_file_map(path).entry(name)
    return e.offset, e.offset + e.nbytes


# --- checkpoints ----------------------------------------------------------------------------

#: Small checkpoints of every kind the host and driver paths take (tests/convert/test_host.py,
#: test_driver.py): per-tensor and per-channel scales, float16, a bias in bf16 and in float32.
HOST_MODELS: dict[str, dict[str, Any]] = {
    "tensor": dict(arch="llama", scheme="FP8", hidden=192, intermediate=320),
    "channel-f16": dict(arch="llama", scheme="FP8_DYNAMIC", dtype="float16"),
    "bias": dict(arch="qwen2", scheme="FP8", hidden=256, heads=4, kv_heads=2),
    "bias-f32": dict(
        arch="qwen2", scheme="FP8_DYNAMIC", dtype="float32", hidden=256, heads=4, kv_heads=2
    ),
}


def plan_of(ck: Path, profile: str = "w8a16", tp: int = 1, act: str = "bfloat16") -> Any:
    """The conversion plan of checkpoint ``ck`` (headers only), with vLLM's fusion."""
    from mpack.convert.checkpoint import find_layers, open_checkpoint
    from mpack.convert.plan import make_plan

    c = open_checkpoint(ck)
    find_layers(c)
    return make_plan(c, profile=profile, act_dtype=act, tp=tp, fusion="vllm")


def edit_config(ck: Path, fn: Callable[[dict[str, Any]], None]) -> None:
    """Apply ``fn`` to ``ck/config.json`` in place."""
    path = ck / "config.json"
    cfg = json.loads(path.read_text())
    fn(cfg)
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def weight_args(cfg: dict[str, Any]) -> dict[str, Any]:
    """The weights args of the (single) config group of a fixture's quantization_config."""
    (group,) = cfg["quantization_config"]["config_groups"].values()
    return group["weights"]


def shard_of(ck: Path, name: str) -> str:
    """The shard file holding tensor ``name`` (through the index when there is one)."""
    if (ck / INDEX).is_file():
        return json.loads((ck / INDEX).read_text())["weight_map"][name]
    return SINGLE


def rewrite_shard(ck: Path, shard: str, fn: Callable[[dict[str, Any]], None]) -> None:
    """Load every tensor of one shard, let ``fn`` change the dict, save it back (others kept)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(ck / shard), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a dict
    fn(tensors)
    save_file(tensors, str(ck / shard), metadata={"format": "pt"})


def read_tensor(ck: Path, name: str) -> Any:
    """Tensor ``name`` of checkpoint ``ck``, from whichever shard holds it."""
    from safetensors import safe_open

    with safe_open(str(ck / shard_of(ck, name)), framework="pt") as f:
        return f.get_tensor(name)


def set_tensors(ck: Path, tensors: dict[str, Any], drop: Iterable[str] = ()) -> None:
    """Replace or add tensors (new ones go to the shard of the first replaced one), drop others.

    The index's ``weight_map`` is kept in step when there is one.
    """
    drop = list(drop)
    anchor = next((n for n in [*tensors, *drop] if _has(ck, n)), None)
    assert anchor is not None, "set_tensors needs one existing tensor to place new ones next to"
    shard = shard_of(ck, anchor)
    touched = {shard_of(ck, n) for n in drop} | {shard}

    for fname in touched:

        def change(d: dict[str, Any], fname: str = fname) -> None:
            for n in drop:
                d.pop(n, None)
            if fname == shard:
                d.update(tensors)

        rewrite_shard(ck, fname, change)
    if (ck / INDEX).is_file():
        index = json.loads((ck / INDEX).read_text())
        for n in drop:
            index["weight_map"].pop(n, None)
        for n in tensors:
            index["weight_map"][n] = shard
        (ck / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _has(ck: Path, name: str) -> bool:
    """Whether checkpoint ``ck`` holds tensor ``name``."""
    from safetensors import safe_open

    if (ck / INDEX).is_file():
        return name in json.loads((ck / INDEX).read_text())["weight_map"]
    with safe_open(str(ck / SINGLE), framework="pt") as f:
        return name in f.keys()  # noqa: SIM118 - not a dict


def tensors(path: Path) -> dict[str, Any]:
    """Every tensor of a safetensors file, as torch tensors."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a dict


def same_bytes(a: Any, b: Any) -> bool:
    """Two torch tensors of the same dtype, shape and bytes."""
    import torch

    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
        )
    )
