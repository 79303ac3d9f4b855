"""Demo of serve/attach on the host backend: one daemon, two readers, one writer that is refused.

    python scripts/demo_runtime.py SIDECAR [--rank R]

Starts ``mpack serve SIDECAR --device cpu`` (in a private runtime directory, so it never clashes
with a daemon you already run), attaches from two processes, shows that both see identical
bytes from the same memory, lets a third process try to write into a shared tensor, and stops
the daemon. Exits non-zero if anything is not as promised.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from mpack.errors import DaemonError
from mpack.runtime.spawn import DaemonHandle


def _client(sidecar: str, rank: int, write: bool) -> int:
    """One attached process: report what it sees (and, with ``write``, try to write)."""
    import torch

    from mpack.runtime import attach

    with attach(sidecar, rank=rank, device="cpu") as w:
        h = hashlib.sha256()
        for name in sorted(w):
            h.update(w[name].reshape(-1).view(torch.uint8).numpy())
        maps = Path("/proc/self/maps").read_text().splitlines()
        inode = next(int(line.split()[4]) for line in maps if "memfd:mpack:" in line)
        print(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "tensors": len(w),
                    "bytes": w.nbytes,
                    "sha256": h.hexdigest(),
                    "inode": inode,
                }
            ),
            flush=True,
        )
        if write:
            name = sorted(k for k in w if k.endswith(".weight"))[0]
            w[name].view(-1)[0] += 1  # a store into a read-only page: SIGSEGV, this process only
            print(json.dumps({"pid": os.getpid(), "wrote": name}), flush=True)
        else:
            sys.stdin.readline()  # stay attached until the demo says so
    return 0


def _readers(py: str, me: str, a: argparse.Namespace, env: dict) -> list[subprocess.Popen]:
    """Two attached processes; what each sees is printed. They stay attached until released."""
    print("== two processes attach")
    return [
        subprocess.Popen(
            [py, me, a.sidecar, "--rank", str(a.rank), "--client", "read"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]


def _same(readers: list[subprocess.Popen]) -> bool:
    seen = [json.loads(p.stdout.readline()) for p in readers]  # type: ignore[union-attr]
    for s in seen:
        print(
            f"client {s['pid']}: {s['tensors']} tensors, {s['bytes']} bytes, "
            f"sha256 of all tensor bytes {s['sha256'][:16]}..., memfd inode {s['inode']}"
        )
    same = seen[0]["sha256"] == seen[1]["sha256"] and seen[0]["inode"] == seen[1]["inode"]
    print(f"both see identical bytes, from the same memory: {'yes' if same else 'NO'}")
    return same


def _write_refused(py: str, me: str, a: argparse.Namespace, env: dict) -> bool:
    print("== a third process writes into a shared tensor")
    w = subprocess.run(
        [py, me, a.sidecar, "--rank", str(a.rank), "--client", "write"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    refused = w.returncode < 0 and '"wrote"' not in w.stdout
    how = (
        f"killed by {signal.Signals(-w.returncode).name}"
        if w.returncode < 0
        else f"exit {w.returncode}"
    )
    print(f"writer: {how}: the write was {'refused' if refused else 'NOT refused'}")
    return refused


def _still_serving(serve: DaemonHandle, py: str, a: argparse.Namespace, env: dict) -> bool:
    # This daemon (one rank): `status SIDECAR` is ready only once every rank is served.
    alive = serve.alive()
    sock = str(serve.wait_ready().socket)
    st = subprocess.run(
        [py, "-m", "mpack.cli", "status", "--socket", sock], capture_output=True, text=True, env=env
    )
    print(st.stdout.rstrip())
    print(f"daemon still serving: {'yes' if alive and st.returncode == 0 else 'NO'}")
    return alive and st.returncode == 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sidecar")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--client", choices=["read", "write"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.client:
        return _client(a.sidecar, a.rank, a.client == "write")

    py = sys.executable
    me = str(Path(__file__).resolve())
    run_dir = tempfile.mkdtemp(prefix="mpack-demo-")
    env = {**os.environ, "XDG_RUNTIME_DIR": run_dir, "PYTHONUNBUFFERED": "1"}
    print(f"== mpack serve {a.sidecar} --rank {a.rank} --device cpu")
    serve = DaemonHandle(a.sidecar, rank=a.rank, device="cpu", env=env)
    readers: list[subprocess.Popen] = []
    ok = False
    try:
        try:
            serve.wait_ready()
        except DaemonError:  # it exited (or hangs: stopped below); its own words say why
            print(serve.stderr(), file=sys.stderr)
            return 1
        print(serve.stdout().strip())
        readers = _readers(py, me, a, env)
        same = _same(readers)
        refused = _write_refused(py, me, a, env)
        ok = same and refused and _still_serving(serve, py, a, env)
    finally:
        for p in readers:
            if p.poll() is None:
                p.communicate("\n", timeout=30)
        if serve.alive():
            code = serve.stop(signal.SIGTERM, 30)
            print(f"== daemon stopped (SIGTERM): exit {code}")
        serve.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
