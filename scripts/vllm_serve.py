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
  ``attached-cold``: the page cache dropped and a fresh daemon before the engine. The daemon's
  own start is recorded too: its first start (every file hashed), the warm one that trusts the
  record the first left (``--verify auto``), the cold one, and the disk's cold sequential read
  of the sidecar's files (the floor under a cold start);
- on the same weights in AutoFP8's form (``quant_method: fp8``, benchutil.FORMS_8B), the only
  format vLLM's own weight-cache daemon takes: ``autofp8`` (vLLM's ordinary load),
  ``ipc_cache`` (``vllm preload``, then two engines with ``--load-format ipc_cache``; an engine
  that fell back to the disk is an error) and ``autofp8-attached`` (an ``mpack serve`` daemon of
  the ``w8a16`` sidecar, then two attached engines).

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
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # PYTHONSAFEPATH=1 on the device
from benchutil import (  # noqa: E402
    drop_caches,
    exit_on_signals,
    marlin_8b,
    mpack_spawn,
    proc_status_bytes,
    read_files,
)
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
    "autofp8",
    "ipc_cache",
    "autofp8-attached",
)
#: vLLM's log lines that mark the parts of a start, in the order they come: label -> pattern (its
#: first number, where it has one, is vLLM's own figure in seconds, GiB for the KV cache, a count
#: for the weight cache's tensors).
MARKERS = {
    "engine_core": r"\(EngineCore pid=[0-9]+\)",  # the engine core process's first line
    "engine_setup": r"Initializing a V1 LLM engine",
    "load_start": r"Loading model from scratch",
    "model_init": r"Initializing model took ([0-9.]+) seconds",
    "weights": r"Loading weights took ([0-9.]+) seconds",
    "mpack_attach": r"mpack: rank [0-9]+ attached zero-copy",
    "mpack_passthrough": r"mpack pass-through: [0-9]+ tensors",
    "mpack_phases": r"mpack: load phases \(s\): (.*)$",  # kept as text
    "load": r"Model loading took [0-9.]+ GiB memory and ([0-9.]+) seconds",
    "dynamo": r"Dynamo bytecode transform time: ([0-9.]+) s",
    "compile_cache_hit": r"Directly load the compiled graph",
    "compile_miss": r"Compiling a graph for compile range",
    "compile": r"torch\.compile took ([0-9.]+) s in total",
    "profiling": r"Memory profiling takes ([0-9.]+) seconds",
    "kv_cache": r"Available KV cache memory: ([0-9.]+) GiB"  # profiled, or set by the bytes:
    r"|reserved ([0-9.]+) GiB memory for KV Cache",
    "cuda_graphs": r"Graph capturing finished in ([0-9.]+) secs",
    "engine_init": r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+)",
    "server_up": r"Application startup complete",
    # vLLM's weight-cache daemon (``vllm preload``) and its loader in the engine
    "ipc_daemon_ready": r"Weight cache daemon READY",
    "ipc_mapped": r"Mapped ([0-9]+) tensors from the weight cache daemon",
    "ipc_fallback": r"Weight cache unusable",
}
#: Where a start's time goes (issue 40 item 5): each part runs from one marker's line to the
#: next's; "spawn" is the process's start, "first_line" vLLM's first log line, "answer" the first
#: completion. Their sum is the time to the first completion.
PARTS = (
    ("imports", "spawn", "first_line"),  # interpreter, vLLM's imports, argument parsing
    ("config_and_engine_process", "first_line", "engine_core"),  # config, engine core's imports
    ("engine_setup", "engine_core", "load_start"),  # distributed init, worker, model runner
    ("load", "load_start", "load"),  # model init, weights, their processing
    ("compile", "load", "compile"),  # torch.compile (Dynamo, the compiled graph or its cache)
    ("profiling_kv_cache", "compile", "kv_cache"),  # warm-up run, memory, the KV cache
    ("cuda_graphs", "kv_cache", "cuda_graphs"),
    ("engine_ready", "cuda_graphs", "engine_init"),
    ("server_start", "engine_init", "server_up"),
    ("first_request", "server_up", "answer"),
)


def see_line(marks: dict[str, dict[str, float]], t: float, line: str) -> None:
    """Record in ``marks`` each marker ``line`` (seen ``t`` s after the spawn) is the first of."""
    if "first_line" not in marks and line.strip():
        marks["first_line"] = {"at_s": t}
    for label, pat in MARKERS.items():
        m = re.search(pat, line)
        if m and label not in marks:
            marks[label] = {"at_s": t}
            found = next((g for g in m.groups() if g is not None), None)
            if found is not None:
                try:
                    marks[label]["vllm"] = float(found)
                except ValueError:
                    marks[label]["text"] = found.strip()


def marks_of_log(path: Path) -> dict[str, dict[str, float]]:
    """The markers of a ``serve-<name>.log`` this script wrote (each line ``[  t] ...``)."""
    marks: dict[str, dict[str, float]] = {}
    for line in path.read_text(errors="replace").splitlines():
        m = re.match(r"\[\s*([0-9.]+)\] (.*)", line)
        if m:
            see_line(marks, float(m[1]), m[2])
    return marks


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


#: Every server this run started: a run ended by a signal (the device call's time limit) kills
#: them, so that none outlives it holding GPU memory.
LIVE: list[Server] = []


class Server:
    """One ``vllm serve`` process (``preload``: ``vllm preload``, vLLM's weight-cache daemon,
    which serves no HTTP): its output read line by line, each marker's wall time."""

    def __init__(
        self, name: str, args: list[str], env: dict[str, str], out: Path, preload: bool = False
    ) -> None:
        self.name, self.port = name, free_port()
        self.t0 = time.time()
        sub = ["preload", "--model", *args] if preload else [
            "serve", *args, "--port", str(self.port), "--host", "127.0.0.1"]  # fmt: skip
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", *sub]
        # line-buffered: a run ended by its time limit still leaves every line it saw
        self.log = open(out / f"serve-{name}.log", "w", buffering=1)  # noqa: SIM115 (stop)
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        self.marks: dict[str, dict[str, float]] = {}
        LIVE.append(self)
        self.answer: dict[str, Any] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            t = round(time.time() - self.t0, 3)
            self.log.write(f"[{t:8.3f}] {line}")
            see_line(self.marks, t, line)

    def _until(self, probe: Callable[[], float | None], what: str, pause: float) -> float:
        """``probe()``'s first answer that is not None, asked every ``pause`` s until the process
        exits or ``READY_TIMEOUT_S`` from its spawn has passed (each a ``RuntimeError``)."""
        deadline = self.t0 + READY_TIMEOUT_S
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: exited {self.proc.returncode} before {what}")
            got = probe()
            if got is not None:
                return got
            time.sleep(pause)
        raise RuntimeError(f"{self.name}: no {what} in {READY_TIMEOUT_S} s")

    def first_completion(self) -> float:
        """Seconds from the spawn to the first completion answered over HTTP."""
        url = f"http://127.0.0.1:{self.port}/v1/completions"
        body = json.dumps(
            {"model": "m", "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0}
        ).encode()

        def ask() -> float | None:
            req = urllib.request.Request(
                url, data=body, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    self.answer = json.loads(r.read())["choices"][0]
            except (OSError, ValueError):
                return None
            return round(time.time() - self.t0, 3)

        return self._until(ask, "a completion", 0.1)

    def wait_mark(self, label: str) -> float:
        """Seconds from the spawn to ``label``'s line (a daemon's readiness)."""
        return self._until(lambda: self.marks.get(label, {}).get("at_s"), label, 0.05)

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


def parts(marks: dict[str, dict[str, float]], ttfc: float | None) -> dict[str, Any]:
    """The start broken into :data:`PARTS` (s; ``ttfc`` None: no answer came, and the parts seen
    before the failure are kept), vLLM's own figures, whether the compile cache hit, and each
    marker's wall time."""
    at = {"spawn": 0.0, **{k: v["at_s"] for k, v in marks.items()}}
    if ttfc is not None:
        at["answer"] = ttfc
    got: dict[str, Any] = {"parts": {}}
    for name, a, b in PARTS:
        if a in at and b in at:
            got["parts"][name] = round(at[b] - at[a], 3)
    got["vllm"] = {k: v["vllm"] for k, v in marks.items() if "vllm" in v}
    got["compile_cache"] = (
        "hit" if "compile_cache_hit" in at else "miss" if "compile_miss" in at else None
    )
    got["marks"] = {k: v for k, v in at.items() if k not in ("spawn", "answer")}
    return got


def serve_args(model: Path, loader: str, sc: Path) -> list[str]:
    args = [str(model), "--served-model-name", "m", "--dtype", "bfloat16",
            "--max-model-len", "1024", "--kv-cache-memory-bytes", str(KV_BYTES),
            "--gpu-memory-utilization", "0.3", "--linear-backend", "marlin",
            "--skip-tokenizer-init", "--seed", "0"]  # fmt: skip
    if loader in ("fastsafetensors", "runai_streamer", "ipc_cache"):
        args += ["--load-format", loader]
    elif loader in ("private", "attached"):
        extra = {"sidecar": str(sc), "attach": "never" if loader == "private" else "require"}
        args += ["--load-format", "mpack", "--model-loader-extra-config", json.dumps(extra)]
    return args


def table(rec: dict[str, Any], logs: list[Path]) -> str:
    """A Markdown table of where each answered start's time went (:data:`PARTS`), with vLLM's
    load figure, the compile cache and the engine's GPU memory. A start recorded before the
    marks were (no ``marks``) takes them from its log in one of ``logs``."""
    names = [name for name, _, _ in PARTS]
    head = ["start", "first completion", *names, "vLLM load", "compile cache", "GPU MiB"]
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for start, r in rec.items():
        if not isinstance(r, dict) or "first_completion_s" not in r:
            continue
        got = r
        if "marks" not in r:
            found = [d / f"serve-{start}.log" for d in logs if (d / f"serve-{start}.log").is_file()]
            if not found:
                continue
            got = parts(marks_of_log(found[0]), r["first_completion_s"])
        cells = [start, f"{r['first_completion_s']:.1f}"]
        cells += [f"{got['parts'][n]:.1f}" if n in got["parts"] else "" for n in names]
        load = got["vllm"].get("load")
        cells += [f"{load:.2f}" if load is not None else "", got["compile_cache"] or "",
                  str(r.get("memory", {}).get("gpu_mib", ""))]  # fmt: skip
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


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
    ap.add_argument(
        "--table", type=Path, metavar="JSON",
        help="print where each start's time went, from a serve-starts.json (no run)",
    )  # fmt: skip
    ap.add_argument(
        "--logs", type=Path, nargs="*", default=[],
        help="with --table: folders of the serve-<start>.log files, for a record without marks",
    )  # fmt: skip
    a = ap.parse_args()
    if a.table is not None:
        print(table(json.loads(a.table.read_text()), a.logs))
        return 0
    exit_on_signals()
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
    if {"autofp8", "ipc_cache", "autofp8-attached"} & set(starts):
        fp8_ck, fp8_sc = marlin_8b(a.work, a.layers, menv, quant="autofp8")
    print(f"8B-shaped checkpoint(s) and sidecar(s): {time.time() - t:.0f} s", flush=True)
    rec: dict[str, Any] = json.loads(a.record.read_text()) if a.record.exists() else {}
    rec.setdefault("layers", a.layers)
    sp = mpack_spawn(a.mpack_env)

    def save() -> None:
        a.record.write_text(json.dumps(rec, indent=1))
        (a.out / "serve-starts.json").write_text(json.dumps(rec, indent=1))

    def one(
        name: str, loader: str, cold: bool = False, keep: bool = False, fp8: bool = False
    ) -> Server:
        dropped = drop_caches() if cold else None
        model, sidecar = (fp8_ck, fp8_sc) if fp8 else (ck, sc)
        s = Server(name, serve_args(model, loader, sidecar), venv, a.out)
        try:
            ttfc = s.first_completion()
            if loader == "ipc_cache" and ("ipc_mapped" not in s.marks or "ipc_fallback" in s.marks):
                raise RuntimeError("the engine loaded from the disk, not from the weight cache")
            r = {"first_completion_s": ttfc, "dropped_caches": dropped, **parts(s.marks, ttfc),
                 "memory": s.memory(), "answer": s.answer.get("text")}  # fmt: skip
        except Exception as e:  # noqa: BLE001  (recorded; the next start goes on)
            r = {"error": f"{type(e).__name__}: {e}"[:500], **parts(s.marks, None)}
            keep = False
        rec[name] = r
        save()
        print(f"{name}: {json.dumps({k: r.get(k) for k in ('first_completion_s', 'error')})}",
              flush=True)  # fmt: skip
        if not keep:
            s.stop()
        return s

    def two_engines(name: str, loader: str, fp8: bool, restart: bool) -> None:
        """Two engines on one daemon (memory of each and in total); ``restart``: the first
        SIGKILLed and started again while the second serves."""
        e1 = one(name, loader, keep=True, fp8=fp8)
        e2 = one(f"{name}-2", loader, keep=True, fp8=fp8)
        rec[f"two-{name}-gpu"] = gpu_memory()
        engines = [e1, e2]
        if restart:
            e1.kill()
            engines.append(one(f"{name}-restart", loader, keep=True, fp8=fp8))
            rec[f"{name}-2-alive-after-kill"] = e2.proc.poll() is None
        for e in engines:
            e.stop()

    def mpack_daemon(sidecar: Path, verify: str = "auto") -> Any:
        return sp.DaemonHandle(sidecar, device="cuda:0", env=menv, cwd=a.work, log_dir=a.work,
                               args=("--verify", verify), timeout=READY_TIMEOUT_S)  # fmt: skip

    def daemon_start(d: Any, dropped: bool | None, label: str) -> dict[str, Any]:
        """The daemon's READY, its GPU memory, and a copy of its log so far in OUT (the text log's
        ready line carries the phases of its start: ``startup.*``)."""
        ready = d.wait_ready()
        for src in (d.out_path, d.err_path):
            if src is not None and Path(src).is_file():
                shutil.copyfile(src, a.out / f"{label}{Path(src).suffix}")
        return {"ready_s": round(d.ready_s, 3), "load_s": ready.load_s, "bytes": ready.bytes,
                "dropped_caches": dropped, "gpu": gpu_memory()}  # fmt: skip

    try:
        for name in starts:
            if name in ("first", "ordinary"):
                one(name, "ordinary")
            elif name == "ordinary-cold":
                one(name, "ordinary", cold=True)
            elif name in ("fastsafetensors", "runai_streamer", "private"):
                one(name, name)
            elif name == "attached":
                # a start that hashes every file (as the first one does), then the one timed, which
                # trusts the record it left (serve --verify auto)
                with mpack_daemon(sc, verify="always") as d:
                    rec["attached-daemon-first"] = daemon_start(d, None, "attached-daemon-first")
                with mpack_daemon(sc) as d:
                    rec["attached-daemon"] = daemon_start(d, None, "attached-daemon")
                    two_engines("attached", "attached", fp8=False, restart=True)
            elif name == "attached-cold":
                files = sorted(sc.glob("*.safetensors"))
                if drop_caches():
                    seconds = round(read_files(files), 3)
                    size = sum(f.stat().st_size for f in files)
                    rec["sidecar-cold-read"] = {"seconds": seconds, "bytes": size}
                dropped = drop_caches()
                with mpack_daemon(sc) as d:
                    rec["attached-cold-daemon"] = daemon_start(d, dropped, "attached-cold-daemon")
                    one(name, "attached")
            elif name == "autofp8":
                one(name, "ordinary", fp8=True)
            elif name == "ipc_cache":
                args = serve_args(fp8_ck, "ordinary", fp8_sc)
                daemon = Server("ipc_cache-daemon", args, venv, a.out, preload=True)
                try:
                    rec["ipc_cache-daemon"] = {"ready_s": daemon.wait_mark("ipc_daemon_ready"),
                                               "gpu": gpu_memory()}  # fmt: skip
                    two_engines("ipc_cache", "ipc_cache", fp8=True, restart=False)
                except Exception as e:  # noqa: BLE001  (recorded; the next start goes on)
                    rec["ipc_cache-daemon"] = {"error": f"{type(e).__name__}: {e}"[:500]}
                finally:
                    daemon.stop()
            elif name == "autofp8-attached":
                with mpack_daemon(fp8_sc) as d:
                    rec["autofp8-attached-daemon"] = daemon_start(
                        d, None, "autofp8-attached-daemon"
                    )
                    two_engines("autofp8-attached", "attached", fp8=True, restart=False)
            save()
    finally:
        for server in LIVE:
            server.kill()
    print(json.dumps({k: v.get("first_completion_s") if isinstance(v, dict) else v
                      for k, v in rec.items()}, indent=1), flush=True)  # fmt: skip
    return 0 if all("error" not in v for v in rec.values() if isinstance(v, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
