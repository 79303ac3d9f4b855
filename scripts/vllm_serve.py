"""`vllm serve` as users start it, timed to the first completion over HTTP (issue 40).

The 8B-shaped checkpoint and its ``w8a8-marlin`` sidecar (benchutil.marlin_8b), and vLLM
0.33.0's OpenAI server with its defaults: torch.compile and CUDA graphs on (no
``--enforce-eager``), a fixed KV cache (``--kv-cache-memory-bytes``) so that memory compares
across engines, ``--linear-backend marlin``, no tokenizer (the synthetic checkpoint has none:
``--skip-tokenizer-init``, prompts are token ids). Each start is its own ``vllm serve``
process, timed from its spawn to the first successful ``/v1/completions`` answer, in this order
(``--starts`` picks some):

- ``first``: the ordinary load with vLLM's compile cache empty (what the first start of a
  model on a machine pays);
- ``ordinary`` (warm page cache) and ``ordinary-cold`` (page cache dropped);
- ``fastsafetensors`` and ``runai_streamer`` (``--load-format``, their wheels from
  .vllmdev/serve): what a user would pick instead;
- ``private``: ``--load-format mpack``, the sidecar loaded by the engine itself;
- ``attached``: one ``mpack serve`` daemon, then two attached engines at once (memory of each
  process and in total), then one SIGKILLed and started again (``attached-restart``), and
  ``attached-cold``: the page cache dropped and a fresh daemon before the engine.

Each start records: the seconds to the first completion, vLLM's own figures (load, compile,
memory profiling, CUDA graphs, engine init) and the wall-clock time of each marker line, the
compile cache hit or miss, GPU memory per process (nvidia-smi, the engine core included) and
in total, and host memory (RSS of the process tree). Results accumulate in
``OUT/serve-starts.json`` across calls (``--starts`` split over several device calls).

    python3 scripts/vllm_serve.py --mpack-env P --vllm-env P --out DIR [--starts a,b] [--layers N]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # PYTHONSAFEPATH=1 on the device
from benchutil import drop_caches, marlin_8b, mpack_spawn, proc_status_bytes  # noqa: E402
from vllm_engine import READY_TIMEOUT_S, _env, gpu_memory  # noqa: E402

STARTS = (
    "first",
    "ordinary",
    "ordinary-cold",
    "fastsafetensors",
    "runai_streamer",
    "private",
    "attached",
    "attached-cold",
)
#: vLLM's log lines that mark the parts of a start: label -> pattern (its first number, where it
#: has one, is vLLM's own figure in seconds, or GiB for the KV cache).
MARKERS = {
    "engine_setup": r"Initializing a V1 LLM engine",
    "load_start": r"Starting to load model",
    "weights": r"Loading weights took ([0-9.]+) seconds",
    "load": r"Model loading took [0-9.]+ GiB memory and ([0-9.]+) seconds",
    "dynamo": r"Dynamo bytecode transform time: ([0-9.]+) s",
    "compile_cache_hit": r"Directly load the compiled graph",
    "compile_miss": r"Compiling a graph for compile range",
    "compile": r"torch\.compile took ([0-9.]+) s in total",
    "profiling": r"Memory profiling takes ([0-9.]+) seconds",
    "kv_cache": r"Available KV cache memory: ([0-9.]+) GiB",
    "cuda_graphs": r"Graph capturing finished in ([0-9.]+) secs",
    "engine_init": r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+)",
    "server_up": r"Application startup complete",
}
PROMPT = [128000, 791, 6864, 315, 9822, 374]  # token ids: no tokenizer here
KV_BYTES = 2 << 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_pids(root: int) -> list[int]:
    """``root`` and its descendants (the engine core is a child of the API server)."""
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, todo = [root], [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        found += kids
        todo += kids
    return found


class Server:
    """One ``vllm serve`` process: its output read line by line, each marker's wall time."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], out: Path) -> None:
        self.name, self.port = name, free_port()
        self.t0 = time.time()
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", *args,
               "--port", str(self.port), "--host", "127.0.0.1"]  # fmt: skip
        self.log = open(out / f"serve-{name}.log", "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        self.marks: dict[str, dict[str, float]] = {}
        self.answer: dict[str, Any] = {}
        self.first_line: float | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            t = round(time.time() - self.t0, 3)
            self.log.write(f"[{t:8.3f}] {line}")
            if self.first_line is None:
                self.first_line = t
            for label, pat in MARKERS.items():
                m = re.search(pat, line)
                if m and label not in self.marks:
                    self.marks[label] = {"at_s": t}
                    if m.groups():
                        self.marks[label]["vllm"] = float(m[1])

    def first_completion(self) -> float:
        """Seconds from the spawn to the first completion answered over HTTP."""
        url = f"http://127.0.0.1:{self.port}/v1/completions"
        body = json.dumps(
            {"model": "m", "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0}
        ).encode()
        deadline = self.t0 + READY_TIMEOUT_S
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: vllm serve exited {self.proc.returncode}")
            try:
                req = urllib.request.Request(
                    url, data=body, headers={"Content-Type": "application/json"}
                )
                with urllib.request.urlopen(req, timeout=30) as r:
                    answer = json.loads(r.read())
                self.answer = answer["choices"][0]
                return round(time.time() - self.t0, 3)
            except (OSError, ValueError):
                time.sleep(0.1)
        raise RuntimeError(f"{self.name}: no completion in {READY_TIMEOUT_S} s")

    def memory(self) -> dict[str, Any]:
        pids = tree_pids(self.proc.pid)
        smi = gpu_memory()
        gpu = {p: smi["per_pid_mib"][str(p)] for p in pids if str(p) in smi["per_pid_mib"]}
        rss = sum(proc_status_bytes(p, ("VmRSS:",)) for p in pids)
        return {"gpu_mib": sum(v for v in gpu.values() if isinstance(v, int)),
                "gpu_per_pid_mib": gpu, "host_rss_mib": rss >> 20,
                "gpu_used_total_mib": smi["used_mib"]}  # fmt: skip

    def kill(self) -> None:
        """SIGKILL to the whole process group: no shutdown, no detach."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()
        self._reader.join(timeout=5)
        self.log.close()


def parts(s: Server, ttfc: float | None) -> dict[str, Any]:
    """The start broken into parts (s): before vLLM's first line (interpreter, imports, argument
    parsing), engine set-up, model init, load, compile, profiling and KV cache, CUDA graphs, the
    server's own start, and the first request (``ttfc`` None: no answer came; the parts seen
    before the failure are kept)."""
    at = {k: v["at_s"] for k, v in s.marks.items()}
    own = {k: v.get("vllm") for k, v in s.marks.items()}
    got: dict[str, Any] = {"first_line": s.first_line}
    chain = [("setup", "engine_setup", "load_start"), ("load_wall", "load_start", "load"),
             ("after_load_to_engine_ready", "load", "engine_init"),
             ("server_start", "engine_init", "server_up")]  # fmt: skip
    for name, a, b in chain:
        if a in at and b in at:
            got[name] = round(at[b] - at[a], 3)
    if "server_up" in at and ttfc is not None:
        got["first_request"] = round(ttfc - at["server_up"], 3)
    got["vllm"] = {k: v for k, v in own.items() if v is not None}
    got["compile_cache"] = (
        "hit" if "compile_cache_hit" in at else "miss" if "compile_miss" in at else None
    )
    return got


def serve_args(model: Path, loader: str, sc: Path) -> list[str]:
    args = [str(model), "--served-model-name", "m", "--dtype", "bfloat16",
            "--max-model-len", "1024", "--kv-cache-memory-bytes", str(KV_BYTES),
            "--gpu-memory-utilization", "0.3", "--linear-backend", "marlin",
            "--skip-tokenizer-init", "--seed", "0"]  # fmt: skip
    if loader in ("fastsafetensors", "runai_streamer"):
        args += ["--load-format", loader]
    elif loader in ("private", "attached"):
        extra = {"sidecar": str(sc), "attach": "never" if loader == "private" else "require"}
        args += ["--load-format", "mpack", "--model-loader-extra-config", json.dumps(extra)]
    return args


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/mpack-engine"))
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/mpack-out")))
    ap.add_argument("--mpack-env", default="", help="PYTHONPATH of mpack's environment")
    ap.add_argument("--vllm-env", default="", help="PYTHONPATH of vLLM's environment")
    ap.add_argument("--layers", type=int, default=32, help="layers of the 8B shape")
    ap.add_argument(
        "--starts", default=",".join(STARTS), help="comma list of: " + ", ".join(STARTS)
    )
    ap.add_argument("--record", type=Path, default=Path("/tmp/mpack-serve-starts.json"))
    a = ap.parse_args()
    starts = [s for s in a.starts.split(",") if s]
    unknown = set(starts) - set(STARTS)
    if unknown:
        print(f"--starts: unknown {sorted(unknown)}; choose from {', '.join(STARTS)}")
        return 2
    a.work.mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)
    menv, venv = _env(a.mpack_env), _env(a.vllm_env, VLLM_ENABLE_V1_MULTIPROCESSING="1")
    # the server's imports first: a missing package fails here in seconds, not after an engine
    probe = subprocess.run(
        [sys.executable, "-c", "import vllm.entrypoints.openai.api_server"],
        env=venv, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if probe.returncode != 0:
        print("vLLM's API server does not import:\n" + probe.stderr[-3000:], flush=True)
        return 2
    t = time.time()
    ck, sc = marlin_8b(a.work, a.layers, menv)
    print(f"8B-shaped checkpoint and sidecar: {time.time() - t:.0f} s", flush=True)
    rec: dict[str, Any] = json.loads(a.record.read_text()) if a.record.exists() else {}
    rec.setdefault("layers", a.layers)
    sp = mpack_spawn(a.mpack_env)

    def save() -> None:
        a.record.write_text(json.dumps(rec, indent=1))
        (a.out / "serve-starts.json").write_text(json.dumps(rec, indent=1))

    def one(name: str, loader: str, cold: bool = False, keep: bool = False) -> Server:
        dropped = drop_caches() if cold else None
        s = Server(name, serve_args(ck, loader, sc), venv, a.out)
        try:
            ttfc = s.first_completion()
            r = {"first_completion_s": ttfc, "dropped_caches": dropped, **parts(s, ttfc),
                 "memory": s.memory(), "answer": s.answer.get("text")}  # fmt: skip
        except Exception as e:  # noqa: BLE001  (recorded; the next start goes on)
            r = {"error": f"{type(e).__name__}: {e}"[:500], **parts(s, None)}
            keep = False
        rec[name] = r
        save()
        print(f"{name}: {json.dumps({k: r.get(k) for k in ('first_completion_s', 'error')})}",
              flush=True)  # fmt: skip
        if not keep:
            s.stop()
        return s

    for name in starts:
        if name in ("first", "ordinary"):
            one(name, "ordinary")
        elif name == "ordinary-cold":
            one(name, "ordinary", cold=True)
        elif name in ("fastsafetensors", "runai_streamer", "private"):
            one(name, name)
        elif name in ("attached", "attached-cold"):
            cold = name == "attached-cold"
            dropped = drop_caches() if cold else None
            with sp.DaemonHandle(sc, device="cuda:0", env=menv, cwd=a.work, log_dir=a.work,
                                 timeout=READY_TIMEOUT_S) as d:  # fmt: skip
                ready = d.wait_ready()
                rec[f"{name}-daemon"] = {"ready_s": round(d.ready_s, 3), "load_s": ready.load_s,
                                         "bytes": ready.bytes, "dropped_caches": dropped,
                                         "gpu": gpu_memory()}  # fmt: skip
                if cold:
                    one(name, "attached")
                else:
                    e1 = one("attached", "attached", keep=True)
                    e2 = one("attached-2", "attached", keep=True)
                    rec["two-attached-gpu"] = gpu_memory()
                    e1.kill()
                    e3 = one("attached-restart", "attached", keep=True)
                    rec["attached-2-alive-after-kill"] = e2.proc.poll() is None
                    for e in (e1, e2, e3):
                        e.stop()
                save()
    print(json.dumps({k: v.get("first_completion_s") if isinstance(v, dict) else v
                      for k, v in rec.items()}, indent=1), flush=True)  # fmt: skip
    return 0 if all("error" not in v for v in rec.values() if isinstance(v, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
