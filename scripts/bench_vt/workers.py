"""The measuring processes: scripts/bench_vs_tools.py run with ``--_worker KIND --_args JSON`` in a
fresh process, reporting JSON lines on stdout (``emit``) and taking commands on stdin.

- ``load``: ``mpack.runtime.load`` of one rank, timed after the imports and CUDA init;
- ``attach``: one client: imports, CUDA init (bench_rt's ``client_start``), says ready, waits
  for ``go`` (the barrier), then times ``attach`` and the first touch of one tensor; holds the
  mapping until stdin closes;
- ``first-attach``: one client as an engine's worker is when it first attaches (torch imported,
  ``mpack.runtime.warm`` called or not, CUDA initialised), the same barrier, then the first
  ``attach`` of the process and a second one timed apart (scripts/bench_first_attach.py runs it
  too).

Note [first touch]: the first touch of a tensor is ``w[name].data_ptr()`` and its first element
read back with ``.item()`` (a device-to-host copy, which waits for the device): proof that the
bytes are reachable, and no kernel. A kernel (a sum, say) would be loaded on its first launch
(CUDA loads kernels lazily), a cost of any first use of that kernel in the process, not of
reaching the weights. Start-up is reported apart: ``import_s`` (torch and mpack's client
modules) and ``cuda_s`` (bench_runtime's ``_cuda_init``: CUDA init, a first allocation, a
first kernel and copy back).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

from bench_rt.workers import _cuda_init, client_start, emit


def w_load(a: dict[str, Any]) -> None:
    """``mpack.runtime.load(sidecar, rank, device)`` timed up to a synchronize, after CUDA init."""
    t0 = time.perf_counter()
    import torch

    import mpack.runtime.loader  # noqa: F401 - imports are not load time
    import mpack.runtime.weights  # noqa: F401
    from mpack.runtime import load

    dev = a["device"]
    t1 = time.perf_counter()
    if dev != "cpu":
        _cuda_init(torch, dev)
    t2 = time.perf_counter()
    w = load(a["sidecar"], rank=a["rank"], device=dev)
    if dev != "cpu":
        torch.cuda.synchronize(dev)
    dt = time.perf_counter() - t2
    emit(
        {
            "load": {
                "seconds": dt,
                "tensors": len(w),
                "bytes": w.nbytes,
                "import_s": t1 - t0,
                "cuda_s": t2 - t1,
            }
        }
    )
    w.close()


#: The steps of ``attach`` (module-level functions of mpack.runtime.client), timed apart.
ATTACH_PHASES = ("load_manifest", "_connect", "_request", "_map")
#: Inside ``_map`` on a GPU (mpack.runtime.cuda_vmm): the whole import-and-map, the VMM
#: reserve/map/access part of it and the torch view; the rest of ``map_readonly`` is
#: ``torch.cuda.init``, the context push and ``cuMemImportFromShareableHandle``.
CUDA_PHASES = ("map_readonly", "_map", "DeviceMapping.tensor")


def _wrap(owner: Any, attr: str, label: str, phases: Any) -> None:
    """Replace ``owner.attr`` with a wrapper adding its milliseconds to ``phases()[label]``
    (``phases`` returns the dict of the attach being timed)."""
    real = getattr(owner, attr)

    def timed(*args: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return real(*args, **kw)
        finally:
            got = phases()
            got[label] = got.get(label, 0.0) + (time.perf_counter() - t) * 1e3

    setattr(owner, attr, timed)


def _time_phases(phases: dict[str, float] | Any, cuda: bool = False) -> None:
    """Wrap each of ``ATTACH_PHASES`` in mpack.runtime.client (and, with ``cuda``, each of
    ``CUDA_PHASES`` in mpack.runtime.cuda_vmm, as ``vmm.<name>``) so that its milliseconds add
    up in ``phases`` (a dict, or a callable returning the dict of the attach being timed):
    where an attach's time goes (the rest is checks and building the result)."""
    from mpack.runtime import client

    get = phases if callable(phases) else (lambda: phases)
    for fn in ATTACH_PHASES:
        _wrap(client, fn, fn, get)
    if cuda:
        from mpack.runtime import cuda_vmm

        for fn in CUDA_PHASES:
            owner, _, attr = fn.rpartition(".")
            _wrap(getattr(cuda_vmm, owner) if owner else cuda_vmm, attr, f"vmm.{fn}", get)


def w_attach(a: dict[str, Any]) -> None:
    """Start up, say ready, wait for ``go``; then time ``attach`` (and its steps) and the first
    touch."""
    dev, name = a["device"], a["tensor"]
    attach, import_s, cuda_s = client_start(dev)
    phases: dict[str, float] = {}
    _time_phases(phases)
    emit({"ready": os.getpid(), "import_s": import_s, "cuda_s": cuda_s})
    if sys.stdin.readline().strip() != "go":
        return
    t0 = time.perf_counter()
    w = attach(a["sidecar"], rank=a["rank"], device=dev, socket=a["socket"])
    t1 = time.perf_counter()
    t = w[name]
    t.data_ptr()
    seen = t.flatten()[0].item()  # a view, then a copy to the host that waits for the device
    t2 = time.perf_counter()
    emit(
        {
            "attach_ms": (t1 - t0) * 1e3,
            "touch_ms": (t2 - t1) * 1e3,
            "total_ms": (t2 - t0) * 1e3,
            "tensors": len(w),
            "seen": float(seen),
            "phases_ms": phases,
        }
    )
    sys.stdin.read()  # hold the mapping until the round ends (stdin closed)
    w.close()


def w_first_attach(a: dict[str, Any]) -> None:
    """Import torch and ``mpack.runtime`` (the package alone: no client module), call
    ``warm(dev)`` when ``a["warm"]`` (the vLLM plugin calls it at registration, Note [warm
    attach]), initialise CUDA on a GPU; say ready (with those start-up seconds), wait for
    ``go``; then time the process's first ``attach`` and a second one (the peer: what any later
    attach costs). Both mappings are held until stdin closes. ``a["socket"]`` None: the
    default socket, found from the manifest as an engine finds it."""
    dev = a["device"]
    t0 = time.perf_counter()
    import torch

    from mpack.runtime import attach, warm

    t1 = time.perf_counter()
    if a["warm"]:
        warm(dev)
    t2 = time.perf_counter()
    if dev != "cpu":
        _cuda_init(torch, dev)
    t3 = time.perf_counter()
    emit(
        {
            "ready": os.getpid(),
            "warm": a["warm"],
            "import_s": t1 - t0,
            "warm_s": t2 - t1,
            "cuda_s": t3 - t2,
        }
    )
    if sys.stdin.readline().strip() != "go":
        return
    where = {"rank": a["rank"], "device": dev, "socket": a["socket"]}
    first_steps: dict[str, float] = {}
    second_steps: dict[str, float] = {}
    timing = [first_steps]  # the steps of the attach being timed
    if a.get("steps"):
        _time_phases(lambda: timing[0], cuda=dev != "cpu")
    t0 = time.perf_counter()
    first = attach(a["sidecar"], **where)
    t1 = time.perf_counter()
    timing[0] = second_steps
    second = attach(a["sidecar"], **where)
    t2 = time.perf_counter()
    emit(
        {
            "first_ms": (t1 - t0) * 1e3,
            "second_ms": (t2 - t1) * 1e3,
            "tensors": len(first),
            "same": first.digest == second.digest and len(first) == len(second),
            **(
                {"first_steps_ms": first_steps, "second_steps_ms": second_steps}
                if a.get("steps")
                else {}
            ),
        }
    )
    sys.stdin.read()  # hold the mappings until the round ends (stdin closed)
    second.close()
    first.close()


WORKERS: dict[str, Callable[[dict[str, Any]], None]] = {
    "load": w_load,
    "attach": w_attach,
    "first-attach": w_first_attach,
}
