"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: scripts/synth_checkpoint.py's defaults (its LLAMA_8B; that module imports torch).
LLAMA_8B_LAYERS, LLAMA_8B_VOCAB = 32, 128256


def drop_caches() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches`` (root only); False when not allowed."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def read_files(files: list[Path], chunk: int = 16 * 1024 * 1024) -> float:
    """Read every file front to back with plain sequential I/O; the seconds it took."""
    t = time.perf_counter()
    buf = bytearray(chunk)
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t


def write_bytes(path: Path, nbytes: int, behind: bool = False) -> float:
    """Seconds to write ``nbytes`` to ``path`` sequentially, in 16 MiB writes, and fsync them
    (the file is removed afterwards). ``behind``: also ask the kernel to start writing every
    32 MiB as soon as it is written (as mpack's page-cache writer does), so that the disk works
    during the writes instead of in the final fsync."""
    from mpack.iokit import start_writeback

    chunk = 16 * 1024 * 1024
    buf = memoryview(os.urandom(chunk))  # slices of a memoryview copy nothing
    t = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left, pos, flushed = nbytes, 0, 0
        while left > 0:
            n = f.write(buf[: min(chunk, left)])
            left, pos = left - n, pos + n
            if behind and pos - flushed >= 2 * chunk:
                start_writeback(f.fileno(), flushed, pos - flushed)
                flushed = pos
        os.fsync(f.fileno())
    dt = time.perf_counter() - t
    path.unlink()
    return dt


def fresh(path: Path) -> None:
    """Remove ``path`` and write every dirty page back: no measurement inherits the previous
    one's writeback."""
    shutil.rmtree(path, ignore_errors=True)
    os.sync()


def proc_status_bytes(pid: int, keys: tuple[str, ...]) -> int:
    """The sum of ``keys`` (e.g. ``("VmHWM:",)``, kB values) in /proc/<pid>/status, in bytes;
    0 once the process is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return 0
    return sum(int(line.split()[1]) * 1024 for line in lines if line.startswith(keys))


@dataclass(frozen=True)
class Timed:
    """One finished process: its wall time (s), the peak RSS seen (bytes), exit code, stderr's end
    (and its stdout, when kept)."""

    wall: float
    peak_rss: int
    returncode: int
    stderr: str
    stdout: str = ""


def run_timed(
    cmd: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    keep_stdout: bool = False,
) -> Timed:
    """Run ``cmd`` to its end, stdout discarded unless ``keep_stdout``; its wall time from start
    to exit and its peak RSS, ``VmHWM`` read from /proc every 20 ms by a thread while it runs
    (wait4's ``ru_maxrss`` would include the pages this parent had when it forked). Interrupted,
    the child is killed."""
    with tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as out:
        t = time.perf_counter()
        stdout = out if keep_stdout else subprocess.DEVNULL
        p = subprocess.Popen(cmd, stdout=stdout, stderr=err, env=env, cwd=cwd)
        peak, done = [0], threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], proc_status_bytes(p.pid, ("VmHWM:",)))
                done.wait(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            code = p.wait()
        except BaseException:
            p.kill()
            p.wait()
            raise
        finally:
            wall = time.perf_counter() - t
            done.set()
            sampler.join()
        err.seek(0)
        tail = err.read()[-4000:].decode(errors="replace")
        out.seek(0)
        text = out.read().decode(errors="replace")
    return Timed(wall, peak[0], code, tail, text)


def exit_on_signals() -> None:
    """SIGTERM and SIGHUP raise ``SystemExit(128 + signal)``: ``finally`` blocks then end the
    benchmark's children, as they do on Ctrl-C."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _: sys.exit(128 + signum))
    signal.signal(signal.SIGINT, signal.default_int_handler)


def scratch_dir(prefix: str) -> tuple[Path, dict[str, str]]:
    """A fresh directory under /tmp (a short path: a Unix socket can live there) for children to
    run in, and their environment: a private ``XDG_RUNTIME_DIR`` inside it, unbuffered Python.

    The children's working directory is not the checkout: a ``mpack/`` folder there would
    shadow an editable install's ``mpack`` for ``python -m mpack``.
    """
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    (tmp / "xdg").mkdir(mode=0o700)
    return tmp, {**os.environ, "XDG_RUNTIME_DIR": str(tmp / "xdg"), "PYTHONUNBUFFERED": "1"}


def synth_present(path: Path, layers: int, vocab: int) -> bool:
    """Whether ``path`` holds a checkpoint (its ``config.json``); one of other dimensions than
    ``layers`` and ``vocab`` ends the run."""
    cfg = path / "config.json"
    if not cfg.is_file():
        return False
    c = json.loads(cfg.read_text())
    if (c["num_hidden_layers"], c["vocab_size"]) != (layers, vocab):
        raise SystemExit(
            f"{path} has {c['num_hidden_layers']} layers and vocab "
            f"{c['vocab_size']}, not {layers} and {vocab}: use another "
            "--workdir"
        )
    return True


def synth(
    path: Path,
    layers: int,
    vocab: int | None,
    env: dict[str, str],
    cwd: Path,
    quiet: bool = False,
    quant: str = "compressed-tensors",
    model: str = "llama-8b",
) -> None:
    """``scripts/synth_checkpoint.py PATH --model M --layers L [--vocab V] --quant Q`` in a child
    process (``vocab`` None: the model's; ``quiet``: its stdout discarded); says how long it
    took."""
    t = time.perf_counter()
    script = str(Path(__file__).resolve().parent / "synth_checkpoint.py")
    cmd = [sys.executable, script, str(path), "--model", model, "--layers", str(layers),
           "--quant", quant, *(["--vocab", str(vocab)] if vocab is not None else [])]  # fmt: skip
    subprocess.run(cmd, check=True, env=env, cwd=cwd, stdout=subprocess.DEVNULL if quiet else None)
    print(f"generated {path} in {time.perf_counter() - t:.1f} s", flush=True)


def timed_run(
    cmd: list[str], env: dict[str, str], cold: bool, json_out: bool = False
) -> dict[str, Any]:
    """``cmd`` (a shell line for a string) after the page cache is dropped when ``cold`` (and
    this process may): its seconds, and whether the cache was dropped; ``json_out``: the JSON
    document it prints too (``doc``)."""
    dropped = drop_caches() if cold else False
    t = time.perf_counter()
    r = subprocess.run(
        cmd,
        env=env,
        check=True,
        shell=isinstance(cmd, str),
        stdout=subprocess.PIPE if json_out else None,
        text=True,
    )
    res: dict[str, Any] = {"seconds": round(time.perf_counter() - t, 3), "cold": dropped}
    if json_out:
        res["doc"] = json.loads(r.stdout)
    return res


def moe_30b(work: Path, layers: int, env: dict[str, str]) -> tuple[Path, Path, dict[str, Any]]:
    """The Qwen3-30B-A3B-shaped checkpoint ``work/ck-30b`` (``layers`` decoder layers, made when
    missing) and its ``w8a8-marlin`` sidecar ``work/sc-30b``, converted on CUDA now; with the
    conversion's time beside ``cp -r && sync`` of the checkpoint, each from a cold page cache
    where this process may drop it (the copy is removed after)."""
    ck, sc, copy = work / "ck-30b", work / "sc-30b", work / "ck-30b-copy"
    if not (ck / "config.json").is_file():
        synth(ck, layers, None, env, work, quiet=True, model="qwen3-30b-a3b")
    shutil.rmtree(copy, ignore_errors=True)
    shutil.rmtree(sc, ignore_errors=True)
    res: dict[str, Any] = {"layers": layers, "checkpoint_bytes": dir_bytes(ck)}
    res["cp_r_sync"] = timed_run(f"cp -r '{ck}' '{copy}' && sync", env, cold=True)
    shutil.rmtree(copy)
    convert = [sys.executable, "-m", "mpack", "convert", str(ck), "-o", str(sc), "--json"]
    run = timed_run(
        [*convert, "--profile", "w8a8-marlin", "--device", "cuda"], env, cold=True, json_out=True
    )
    doc = run.pop("doc")
    # where the time went: the run's phases (ConvertResult.seconds: busy and wait seconds of the
    # read, transform, write and pass-through lanes, the main thread's steps), the process's
    # start outside them, and the backend that ran
    run["phases"] = doc["seconds"]
    run["outside_run_s"] = round(run["seconds"] - doc["seconds"].get("total", 0.0), 3)
    run["backend"] = {k: doc["backend"][k] for k in ("name", "device", "detail")}
    res["convert_cuda"] = run
    res["convert_vs_cp"] = round(run["seconds"] / res["cp_r_sync"]["seconds"], 3)
    res["sidecar_bytes"] = dir_bytes(sc)
    print(json.dumps(res), flush=True)
    return ck, sc, res


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


#: The 8B-shaped checkpoint's two forms: directory suffix and the sidecar's profile (AutoFP8 is
#: weight-only on Marlin: mpack/target.py).
FORMS_8B = {"compressed-tensors": ("", "w8a8-marlin"), "autofp8": ("-autofp8", "w8a16")}


def marlin_8b(
    work: Path, layers: int, env: dict[str, str], quant: str = "compressed-tensors"
) -> tuple[Path, Path]:
    """The 8B-shaped checkpoint ``work/ck-8b`` (``layers`` decoder layers; ``quant="autofp8"``:
    the same weights in AutoFP8's form, ``work/ck-8b-autofp8``) and its sidecar ``work/sc-8b``
    (``-autofp8``) converted on CUDA with :data:`FORMS_8B`'s profile, each made only when missing
    (vLLM's GPU runs)."""
    suffix, profile = FORMS_8B[quant]
    ck, sc = work / f"ck-8b{suffix}", work / f"sc-8b{suffix}"
    if not synth_present(ck, layers, LLAMA_8B_VOCAB):
        synth(ck, layers, LLAMA_8B_VOCAB, env, work, quant=quant)
    if not (sc / "mpack.json").is_file():
        convert = [sys.executable, "-m", "mpack", "convert", str(ck), "-o", str(sc), "-q"]
        subprocess.run([*convert, "--profile", profile, "--device", "cuda"], env=env, check=True)
    return ck, sc


def mpack_spawn(mpack_env: str) -> object:
    """``mpack.runtime.spawn`` from mpack's environment (``mpack_env``: its PYTHONPATH), for a
    script that runs under another one."""
    for p in filter(None, mpack_env.split(os.pathsep)):
        if p not in sys.path:
            sys.path.append(p)
    from mpack.runtime import spawn

    return spawn
