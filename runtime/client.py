"""The client side: ``attach`` to a daemon's allocation, and ``query_status`` for ``mpack status``.

Note [what a client takes from its peer]: the other end of the socket is a process of our own
uid (``_connect`` checks), but not necessarily a healthy ``mpack serve``: a wedged process, an
older or newer mpack, or a hostile program may listen there. So a client bounds and checks
everything before acting on it: the whole reply must arrive within ``timeout`` (one deadline,
not one per ``recv``: a peer dripping a byte at a time cannot hold it), at most
``MAX_REPLY_BYTES`` and ``MAX_TENSORS`` entries, each entry inside the allocation, and, on the
host backend, the descriptor must be a sealed memfd of exactly the announced size
(``host.memfd_problem``) before it is mapped. Every way such a peer can fail us is a
``DaemonError`` (``ProtocolError`` is one): what ``attach: auto`` in the vLLM loader falls back
from, and for ``mpack status`` a report about that socket, never a crash.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpack import arch, fsutil
from mpack.arch import Stage
from mpack.errors import (
    CudaError,
    DaemonError,
    ProtocolError,
    StageMismatchError,
    UsageError,
    quote,
    shown,
)
from mpack.runtime import protocol as P
from mpack.runtime.allocation import check_rank, sidecar_stage, tensors_from_wire
from mpack.sidecar import load_manifest

if TYPE_CHECKING:
    from mpack.runtime.weights import SharedWeights


class _NoDaemon(DaemonError):
    """Nothing listens at the path: no socket, or a stale one whose daemon died."""


def _connect(path: Path, what: str, start_hint: str, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError) as e:
        sock.close()
        not_socket = _not_a_socket(path)
        if not_socket is not None:
            raise DaemonError(
                f"{path} is {not_socket}, not a socket: no daemon listens there",
                hint="pass the socket a daemon listens on (its READY line's socket=, or "
                "`mpack status` lists them)",
            ) from None
        stale = (
            " (a stale socket: its daemon died)" if isinstance(e, ConnectionRefusedError) else ""
        )
        serves = f" serves {what}" if what else ""
        raise _NoDaemon(f"no daemon{serves} at {path}{stale}", hint=start_hint) from None
    except OSError as e:
        sock.close()
        raise DaemonError(f"cannot connect to {path}: {e.strerror}", hint=start_hint) from None
    # The other end must be our own user, too: a socket planted by someone else could hand us
    # bytes of their choosing.
    _, uid, _ = P.peer_credentials(sock)
    if uid != os.getuid():
        sock.close()
        raise DaemonError(
            f"the daemon at {path} runs as uid {uid}, not as uid {os.getuid()}; refusing it"
        )
    return sock


def _not_a_socket(path: Path) -> str | None:
    """What ``path`` is when it is there but is not a socket (``"a FIFO"``, ``"a regular
    file"``, ``"a directory"``, ``"a symbolic link to a regular file"``), else None."""
    try:
        st = os.stat(path)  # as connect() does, through a symlink
        link = stat.S_ISLNK(os.lstat(path).st_mode)
    except (OSError, ValueError):
        return None
    if stat.S_ISSOCK(st.st_mode):
        return None
    kind = fsutil.kind_of(st.st_mode)
    return f"a symbolic link to {kind}" if link else kind


def _request(
    sock: socket.socket, msg: dict[str, Any], path: Path, timeout: float
) -> tuple[dict[str, Any], list[int]]:
    """Send ``msg``; the peer's reply and fds, all of it within ``timeout`` seconds (Note [what a
    client takes from its peer]).

    Raises:
        DaemonError: no reply in time, the connection broke, or an ``error`` reply.
        ProtocolError: a reply that is not a frame of our protocol version.
    """
    try:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            # A daemon that refuses us replies at once and closes; its reply is still queued.
            P.send_message(sock, msg)
        reply, fds = P.recv_message(sock, P.MAX_REPLY_BYTES, deadline=time.monotonic() + timeout)
    except P.WireError as e:
        raise ProtocolError(f"the daemon at {path} broke the protocol: {e}") from None
    except TimeoutError:
        raise DaemonError(f"the daemon at {path} did not answer within {timeout:g} s") from None
    except (BrokenPipeError, ConnectionResetError):
        raise DaemonError(f"the daemon at {path} closed the connection") from None
    except OSError as e:
        raise DaemonError(f"cannot read the reply of the daemon at {path}: {e.strerror}") from None
    if reply["type"] == P.ERROR:
        for fd in fds:
            os.close(fd)
        raise DaemonError(f"the daemon at {path} refused: {shown(reply.get('message'), 500)}")
    return reply, fds


def attach(
    sidecar: str | os.PathLike,
    *,
    rank: int = 0,
    device: str = "cpu",
    socket: str | os.PathLike | None = None,
    timeout: float = P.CLIENT_TIMEOUT_S,
    stage: Stage | None = None,
) -> SharedWeights:
    """Zero-copy, read-only views of the memory of the daemon serving ``sidecar``'s ``rank``
    (of pipeline ``stage`` of it, if given).

    The daemon's socket is found from the sidecar's manifest digest, the rank and the device
    (the rule ``mpack serve`` uses) unless ``socket`` is given. With ``stage`` (a split of more
    than one stage), the daemon of that stage (``serve --pp-rank``: Note [the daemon of a stage]
    in protocol.py) is tried first, then the daemon of the whole rank. The daemon must serve the
    same manifest digest, rank and device (a GPU is compared by UUID), and the whole rank or
    exactly ``stage`` (the same index of the same split). Tensors are views into one mapping
    (host: ``mmap`` PROT_READ of a sealed memfd; CUDA: a PROT_READ VMM mapping); see Note
    [lifetime of a mapping] in weights.py for when it is released.

    ``timeout`` bounds the connect and, separately, the whole reply.

    Raises:
        StageMismatchError: the daemon serves another stage or split than ``stage`` (or, without
            ``stage``, one stage only); the message names both.
        DaemonError: no daemon there, one that serves something else or refused us, or a peer
            that does not answer in time or sends what cannot be mapped (Note [what a client
            takes from its peer]).
        ProtocolError: a peer that broke the protocol (a ``DaemonError`` too).
        FormatVersionError, CorruptFileError, UsageError: the sidecar or arguments.
    """
    from mpack.runtime.weights import SharedWeights

    manifest, digest = load_manifest(sidecar)
    check_rank(manifest, rank)
    stage = Stage.partial(stage)
    dev = P.resolve_device(device)
    of = Stage.label(stage)
    what = f"{sidecar} rank {rank}{of} on {dev.label}"
    hint = "start one: " + serve_command(sidecar, rank, stage, dev.label)
    if socket is not None:
        path = Path(socket)
        sock = _connect(path, what, hint, timeout)
    else:
        path, sock = _connect_first(_sockets(digest, rank, dev, stage), what, hint, timeout)
    try:
        size, tensors, base, served = _request_mapping(
            sock, path, (digest, rank, dev), what, timeout, stage, sidecar
        )
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)  # from here on the connection is only the lease
    daemon_pid, _, _ = P.peer_credentials(sock)  # 0: in a PID namespace we cannot see
    return SharedWeights(
        base,
        tensors,
        manifest=manifest,
        digest=digest,
        rank=rank,
        device=dev.label,
        backend=_backend(dev),
        nbytes=size,
        lease=sock,
        daemon_pid=daemon_pid or None,
        stage=served,
    )


def _sockets(digest: str, rank: int, dev: P.Device, stage: Stage | None) -> list[Path]:
    """Where a daemon for ``stage`` of ``rank`` may listen, in the order tried: the daemon of
    that stage, then the daemon of the whole rank (Note [the daemon of a stage])."""
    whole = P.socket_path(digest, rank, dev.key)
    if stage is None:
        return [whole]
    return [P.socket_path(digest, rank, dev.key, pp_rank=stage.rank), whole]


def _connect_first(
    paths: list[Path], what: str, hint: str, timeout: float
) -> tuple[Path, socket.socket]:
    """The first of ``paths`` where a daemon listens, and the connection; a ``_NoDaemon``
    naming every path when none does."""
    for path in paths[:-1]:
        try:
            return path, _connect(path, what, hint, timeout)
        except _NoDaemon:
            continue
    try:
        return paths[-1], _connect(paths[-1], what, hint, timeout)
    except _NoDaemon as e:
        if len(paths) == 1:
            raise
        tried = ", ".join(str(p) for p in paths)
        raise _NoDaemon(f"no daemon serves {what} (tried {tried})", hint=e.hint) from None


def _request_mapping(
    sock: socket.socket,
    path: Path,
    asked: tuple[str, int, P.Device],
    what: str,
    timeout: float,
    stage: Stage | None = None,
    sidecar: Any = "SIDECAR",
) -> tuple[int, list[Any], Any, Stage | None]:
    """Say hello on ``sock`` for ``asked`` (digest, rank, device) and ``stage``; the mapping the
    daemon sends: its size, its tensors, the mapping itself and the stage it holds (None: the
    whole rank). The descriptors it came with are closed."""
    digest, rank, dev = asked
    hello = {
        "type": P.ATTACH,
        "digest": digest,
        "rank": rank,
        "device": dev.key,
        "pid": os.getpid(),
    }
    reply, fds = _request(sock, hello, path, timeout)
    try:
        size, tensors = _check_attached(reply, fds, path, asked, what)
        served = _check_stage(reply, path, stage, sidecar, dev.label)
        return size, tensors, _map(fds[0], size, dev, path), served
    finally:
        for fd in fds:
            os.close(fd)


def _check_stage(
    reply: dict[str, Any],
    path: Path,
    stage: Stage | None,
    sidecar: Any = "SIDECAR",
    device: str = "DEVICE",
) -> Stage | None:
    """The stage the daemon's ``attached`` reply says it holds (None: the whole rank), which
    must be the whole rank or exactly ``stage`` (Note [the daemon of a stage]).

    Raises:
        StageMismatchError: another stage index or another split, naming both; or a stage
            daemon where the whole rank was asked for.
        ProtocolError: a malformed ``stage``.
    """
    try:
        served = P.stage_from_wire(reply.get("stage"))
    except P.WireError as e:
        raise ProtocolError(f"the daemon at {path} broke the protocol: {e}") from None
    if served is None or served == stage:
        return served
    served_rank = reply.get("rank")
    if stage is None:
        raise StageMismatchError(
            f"the daemon at {path} serves pipeline {served} only, not the whole rank",
            hint="attach with the stage it serves, or serve the whole rank (leave out --pp-rank)",
        )
    same = "the same split" if served.split == stage.split else "another split"
    raise StageMismatchError(
        f"the daemon at {path} serves pipeline {served}; this engine runs {stage} ({same} of "
        "the decoder layers)",
        hint="restart it as the engine's stage: "
        + serve_command(sidecar, served_rank, stage, device)
        + " (or serve the whole rank: no --pp-rank)",
    )


def serve_command(sidecar: Any, rank: int, stage: Stage | None, device: str) -> str:
    """The command that starts the daemon of ``rank`` (``stage`` of it) on ``device``: with
    the partition variable before it where the split is not vLLM's default one."""
    if stage is None:
        return f"mpack serve {sidecar} --rank {rank} --device {device}"
    default = tuple(arch.pp_partition(sum(stage.split), stage.size))
    env = "" if stage.split == default else f"{arch.PP_PARTITION_ENV}={_split_text(stage)} "
    pp = f"--pp-rank {stage.rank} --pp-size {stage.size}"
    return f"{env}mpack serve {sidecar} --rank {rank} {pp} --device {device}"


def _split_text(stage: Stage) -> str:
    return ",".join(map(str, stage.split))


def _backend(dev: P.Device) -> str:
    return "host" if dev.kind == "cpu" else "cuda"


def _check_attached(
    reply: dict[str, Any], fds: list[int], path: Path, asked: tuple[str, int, P.Device], what: str
) -> tuple[int, list[Any]]:
    """The daemon's ``attached`` reply, checked against what was asked for: the mapping's size
    and its tensors."""
    digest, rank, dev = asked
    if reply["type"] != P.ATTACHED:
        raise ProtocolError(f"the daemon at {path} answered attach with {reply['type']!r}")
    got = (reply.get("digest"), reply.get("rank"), reply.get("device"))
    if got != (digest, rank, dev.key):
        raise DaemonError(
            f"the daemon at {path} serves digest {str(got[0])[:16]}... rank {got[1]} on "
            f"{got[2]}, not {what} (digest {digest[:16]}..., {dev.key})",
            hint="pass the right --socket, or none to use the default",
        )
    size, data_size = reply.get("size"), reply.get("data_size")
    if not (type(size) is int and type(data_size) is int and 0 < data_size <= size):
        raise ProtocolError(f"the daemon at {path} sent sizes {quote(size)}, {quote(data_size)}")
    if len(fds) != 1:
        raise ProtocolError(f"the daemon at {path} sent {len(fds)} descriptors, not 1")
    if reply.get("backend") != _backend(dev):
        raise ProtocolError(f"the daemon at {path} serves backend {quote(reply.get('backend'))}")
    items = reply.get("tensors")
    if isinstance(items, list) and len(items) > P.MAX_TENSORS:
        raise ProtocolError(
            f"the daemon at {path} lists {len(items)} tensors; a client accepts at most "
            f"{P.MAX_TENSORS}"
        )
    try:
        tensors = tensors_from_wire(items, data_size)
    except ProtocolError as e:
        raise ProtocolError(f"the daemon at {path} sent a bad tensor table: {e}") from None
    return size, tensors


def _map(fd: int, size: int, dev: P.Device, path: Path) -> Any:
    """Map the daemon's memory read-only in this process: host ``mmap`` or CUDA VMM, once the
    descriptor passed the checks of Note [what a client takes from its peer].

    Raises:
        ProtocolError: a descriptor that cannot be what the daemon serves.
        DaemonError: the mapping failed.
    """
    problem = _fd_problem(fd, size, dev)
    if problem is not None:
        raise ProtocolError(f"the daemon at {path} sent {problem}")
    try:
        if dev.kind == "cpu":
            from mpack.runtime.memfd import map_readonly

            return map_readonly(fd, size)
        from mpack.runtime.cuda_vmm import map_readonly as map_device

        assert dev.ordinal is not None
        return map_device(fd, size, dev.ordinal)
    except (OSError, ValueError, CudaError) as e:
        raise DaemonError(f"cannot map the memory the daemon at {path} sent: {e}") from None


def _fd_problem(fd: int, size: int, dev: P.Device) -> str | None:
    """What rules ``fd`` out as the allocation of ``size`` bytes on ``dev``, or None.

    Host: a sealed memfd of exactly ``size`` bytes (``host.memfd_problem``). CUDA: no FIFO,
    socket or directory (the driver's handle is none of these); the driver checks the rest when
    it imports the handle, and a failure there is a ``DaemonError`` (``_map``).
    """
    if dev.kind == "cpu":
        from mpack.runtime.memfd import memfd_problem

        return memfd_problem(fd, size)
    mode = os.fstat(fd).st_mode
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISDIR(mode):
        return f"{fsutil.kind_of(mode)}, not a CUDA memory handle"
    return None


def status_of(path: Path, *, timeout: float = 5.0) -> dict[str, Any]:
    """The status document of the daemon at ``path`` (see Daemon.status), its fields checked
    (``protocol.check_status``), with ``"state": "serving"``.

    Raises:
        DaemonError: nothing listens there, or the peer did not answer in time or refused us.
        ProtocolError: the peer answered, but not with a status reply of our protocol.
    """
    sock = _connect(path, "", "start one with: mpack serve SIDECAR", timeout)
    with contextlib.closing(sock):
        reply, fds = _request(sock, {"type": P.STATUS}, path, timeout)
    for fd in fds:
        os.close(fd)
    if reply["type"] != P.STATUS:
        raise ProtocolError(f"the daemon at {path} answered status with {quote(reply['type'])}")
    try:
        P.check_status(reply)
    except P.WireError as e:
        raise ProtocolError(f"the daemon at {path} broke the protocol: {e}") from None
    doc = {"state": "serving", **{k: v for k, v in reply.items() if k not in ("v", "type")}}
    # the stage fields of Note [the daemon of a stage], the same whatever the peer wrote
    doc.update(P.stage_fields(P.stage_from_wire(doc.get("stage"))))  # checked above
    return doc


def served_bytes(
    sidecar: str | os.PathLike,
    *,
    rank: int = 0,
    device: str = "cpu",
    socket: str | os.PathLike | None = None,
    stage: Stage | None = None,
) -> int:
    """The bytes the daemon serving ``sidecar``'s ``rank`` (``stage`` of it, if given) on
    ``device`` holds (the daemon :func:`attach` would use, or the one at ``socket``), or 0 when
    no daemon of that sidecar, and of the whole rank or that stage, answers there: what an
    engine that attaches will find outside its own memory."""
    manifest, digest = load_manifest(sidecar)
    check_rank(manifest, rank)
    stage = Stage.partial(stage)
    dev = P.resolve_device(device)
    paths = [Path(socket)] if socket is not None else _sockets(digest, rank, dev, stage)
    for path in paths:
        doc = probe(path)
        if doc["state"] != "serving" or doc["digest"] != digest or doc["rank"] != rank:
            continue
        try:
            served = P.stage_from_wire(doc.get("stage"))
        except P.WireError:
            continue
        if served is None or served == stage:
            return int(doc["bytes"])
    return 0


def probe(path: Path) -> dict[str, Any]:
    """``status_of(path)``, or a document saying why not: ``{"state": "stale", "socket"}``
    when nothing listens (its daemon died), ``{"state": "error", "socket", "reason"}`` when
    something answers but not as a daemon of ours should (Note [what a client takes from its
    peer]: a wedged process, another protocol version, garbage, another uid)."""
    try:
        return status_of(path)
    except _NoDaemon:
        return {"state": "stale", "socket": str(path)}
    except DaemonError as e:
        return {"state": "error", "socket": str(path), "reason": str(e)[:500]}


def query_status(
    sidecar: str | os.PathLike | None = None,
    socket: str | os.PathLike | None = None,
    *,
    devices: Sequence[str] = (),
    rank: int | None = None,
    pp_size: int | None = None,
    pp_rank: int | None = None,
    partition: str | None = None,
) -> list[dict[str, Any]]:
    """What ``mpack status`` shows: one document per daemon.

    With ``socket``: that daemon. With ``sidecar``: every daemon serving it (any rank, stage or
    device) that this user's runtime directory knows of, and only once the sidecar is *ready*
    (Note [ready]): every one of its ranks served, whole or stage by stage, on ``devices`` if
    given (one device for every rank, or one per rank in rank order). With ``pp_size`` (a grid
    of TP ranks x pipeline stages, as an engine at ``--pipeline-parallel-size`` attaches it):
    every stage of vLLM's split of the decoder layers over ``pp_size`` stages (``partition``:
    ``VLLM_PP_LAYER_PARTITION``'s value) of every rank, each by the daemon of that stage or of
    the whole rank, on ``devices`` if given (one for all, or one per (stage, rank) in vLLM's
    rank order: stage 0's ranks, then stage 1's, ...). With ``rank`` (and ``pp_rank``) too: the
    daemons of that rank (and stage) only, ready once it is served (on the one device of
    ``devices``, if given). With neither: every such daemon. A daemon is known by its socket
    there (under any name: one started with ``serve --socket`` in that directory too), or, when
    it was started with ``serve --socket PATH`` elsewhere, by the pointer it wrote there (Note
    [pointers to --socket daemons] in protocol.py); its document then has ``"pointer"``.
    Whether a daemon serves ``sidecar`` is what it reports (its manifest digest), not its
    socket's name. Every serving daemon's document has ``pp_rank`` and ``pp_size`` (0 and 1 for
    a daemon of the whole rank) and ``layers``. Sockets whose daemon died, and pointers that
    lead to no such daemon, are listed as ``{"state": "stale", "socket": ...}`` (a pointer's
    also with ``"pointer"`` and ``"reason"``); a socket where something answers but not as a
    daemon should, as ``{"state": "error", "socket": ..., "reason": ...}`` (:func:`probe`).
    With ``sidecar``, those are listed only for sockets named after its digest.

    Raises:
        DaemonError: ``socket`` given and no live daemon found there (``ProtocolError`` for a
            peer that broke the protocol), or ``sidecar`` given and not ready: the message names
            each rank (and stage) no daemon serves (on the device asked for).
        UsageError: ``devices``, ``rank`` or ``pp_size`` without ``sidecar``, ``pp_rank``
            without ``pp_size``, as many ``devices`` as neither 1 nor the ranks (or the (stage,
            rank) pairs asked for), one that is not a device here, a ``rank`` the sidecar does
            not have, a ``pp_rank`` outside the stages, or a ``partition`` that does not fit.
    """
    if devices and sidecar is None:
        raise UsageError("--device needs a SIDECAR: it says where its ranks must be served")
    if rank is not None and sidecar is None:
        raise UsageError(
            f"--rank {rank} needs a SIDECAR: it asks whether that rank of it is served",
            hint=f"mpack status SIDECAR --rank {rank}",
        )
    if pp_size is not None and sidecar is None:
        raise UsageError(
            f"--pp-size {pp_size} needs a SIDECAR: it asks whether every stage of it is served",
            hint=f"mpack status SIDECAR --pp-size {pp_size}",
        )
    if pp_rank is not None and pp_size is None:
        raise UsageError(
            f"--pp-rank {pp_rank} needs --pp-size: a stage is one of a split",
            hint=f"mpack status SIDECAR --pp-rank {pp_rank} --pp-size N",
        )
    if socket is not None:
        return [status_of(Path(socket))]
    digest = prefix = ""
    units: list[tuple[int, Stage | None]] = []  # what must be served: (rank, stage or None)
    on: list[P.Device] | None = None  # where each unit must be served (None: anywhere)
    if sidecar is not None:
        manifest, digest = load_manifest(sidecar)
        prefix = digest[:16] + "-"
        tp = manifest["target"]["tp_size"]
        ranks = list(range(tp))
        if rank is not None:
            check_rank(manifest, rank)
            ranks = [rank]
        stages: list[Stage | None] = [None]
        if pp_size is not None:
            stages = list(_grid_stages(manifest, sidecar, pp_size, pp_rank, partition))
        units = [(r, st) for st in stages for r in ranks]
        on = _wanted_devices(devices, units, tp, rank)
    d = P.runtime_dir()
    paths = sorted(d.glob(f"*{P.SOCKET_SUFFIX}")) if d.is_dir() else []
    pointers = sorted(d.glob(f"{prefix}*{P.POINTER_SUFFIX}")) if d.is_dir() else []

    def wanted(doc: dict[str, Any], name: str) -> bool:
        if doc["state"] == "serving":
            return not digest or doc["digest"] == digest
        return name.startswith(prefix)

    docs = [doc for p in paths if wanted(doc := probe(p), p.name)]
    seen = {doc["socket"] for doc in docs}
    for ptr in pointers:
        doc = _follow_pointer(ptr)
        if not wanted(doc, ptr.name):
            continue
        if doc["socket"] not in seen or doc["state"] != "serving":
            docs.append(doc)
            seen.add(doc["socket"])
    if sidecar is not None:
        _check_ready(sidecar, manifest["target"]["tp_size"], docs, on, d, units)
        if rank is not None or pp_rank is not None:  # those daemons (and failed sockets)
            asked = {(r, st) for r, st in units}
            docs = [doc for doc in docs if doc["state"] != "serving" or _serves_any(doc, asked)]
    return docs


def _serves_any(doc: dict[str, Any], units: set[tuple[int, Stage | None]]) -> bool:
    """Whether a serving daemon's ``doc`` serves one of ``units`` (rank, stage or None: the
    rank whole or in any stage), whole or as that stage."""
    served = P.stage_from_wire(doc.get("stage"))
    return any(
        doc["rank"] == r and (served is None or st is None or served == st) for r, st in units
    )


def _grid_stages(
    manifest: dict[str, Any],
    sidecar: str | os.PathLike,
    pp_size: int,
    pp_rank: int | None,
    partition: str | None,
) -> list[Stage]:
    """The stages of the grid ``status --pp-size`` asks about: every stage of vLLM's split of
    the model's decoder layers, or stage ``pp_rank`` alone."""
    wanted = range(pp_size) if pp_rank is None else [pp_rank]
    return [sidecar_stage(manifest, sidecar, p, pp_size, partition) for p in wanted]


# Note [ready]: `mpack status SIDECAR` is a readiness probe (`until mpack status SC; do sleep
# 0.5; done`, a Kubernetes exec probe), and what waits on it is an engine that attaches every
# rank. So the sidecar is ready only when every rank 0 .. tp_size-1 of it has its tensors
# served by daemons of its manifest digest answering status, on the device asked for
# (``--device``: one for all ranks or one per rank; without it, any device): a daemon of the
# whole rank, or daemons of every stage of one split of it (Note [the daemon of a stage] in
# protocol.py). Until then status exits 2, naming each rank that is missing and what serves
# the others; one daemon of a TP-2 sidecar is not "ready", nor are the daemons of stage 0 of a
# rank whose stage 1 has none. An engine at `--pipeline-parallel-size N` asks for its grid,
# `--pp-size N`: every (rank, stage) of vLLM's split must be served, by the daemon of exactly
# that stage (the same split: VLLM_PP_LAYER_PARTITION is read as vLLM reads it) or of the whole
# rank. The probe of one daemon (the readinessProbe of the container serving rank R, stage P)
# asks for its rank alone: `mpack status SIDECAR --rank R [--pp-rank P --pp-size N]
# [--device D]`.


def _wanted_devices(
    specs: Sequence[str], units: list[tuple[int, Stage | None]], tp: int, rank: int | None
) -> list[P.Device] | None:
    """The device each of ``units`` must be served on (``specs``: one for all, or one per
    unit: per rank when there is no grid), as daemons name them
    (:func:`protocol.resolve_device`); None: any device."""
    if not specs:
        return None
    n = len(units)
    if len(specs) not in (1, n):
        grid = any(st is not None for _, st in units)
        if rank is not None and not grid:
            raise UsageError(
                f"{len(specs)} --device values for --rank {rank}",
                hint="with --rank, give the one --device that rank must be served on",
            )
        what = f"{n} (rank, stage) pairs" if grid else f"a sidecar of {tp} ranks"
        order = "in vLLM's rank order (stage 0's ranks, then stage 1's, ...)" if grid else ""
        raise UsageError(
            f"{len(specs)} --device values for {what}",
            hint=f"give one --device for every one, or {n} of them, " + (order or "in rank order"),
        )
    devs = [P.resolve_device(spec) for spec in specs]
    return devs * n if len(devs) == 1 else devs


def _unit_name(r: int, st: Stage | None) -> str:
    return f"rank {r}" + (f" {st}" if st is not None else "")


def _check_ready(
    sidecar: str | os.PathLike,
    tp: int,
    docs: list[dict[str, Any]],
    wanted: list[P.Device] | None,
    where: Path,
    units: Sequence[tuple[int, Stage | None]],
) -> None:
    """Raise unless each of ``units`` (rank, stage or None: the rank, whole or stage by stage
    of one split) of ``sidecar`` is served (on ``wanted``): Note [ready]."""
    serving = []
    for doc in docs:
        if doc["state"] == "serving":
            with contextlib.suppress(P.WireError):  # a bad stage: serves nothing we can count
                serving.append((doc, P.stage_from_wire(doc.get("stage"))))
    missing: list[str] = []
    starts: list[str] = []
    for k, (r, st) in enumerate(units):
        want = wanted[k] if wanted is not None else None

        def here(doc: dict[str, Any], r: int = r, want: P.Device | None = want) -> bool:
            return doc["rank"] == r and (want is None or doc["device"] == want.key)

        if any(here(doc) and served is None for doc, served in serving):
            continue  # the whole rank
        if st is not None:
            if any(here(doc) and served == st for doc, served in serving):
                continue
        else:  # every stage of one split, each on the device asked for
            splits: dict[tuple[int, ...], set[int]] = {}
            for doc, served in serving:
                if here(doc) and served is not None:
                    splits.setdefault(served.split, set()).add(served.rank)
            if any(len(idx) == len(split) for split, idx in splits.items()):
                continue
        label = want.label if want is not None else "cpu"
        missing.append(_unit_name(r, st) + (f" on {want.label}" if want is not None else ""))
        starts.append(serve_command(sidecar, r, st, label))
    if not missing:
        return
    served_by = [
        f"{_unit_name(doc['rank'], st)} by pid {doc['pid']} on {shown(doc['device_label'])}"
        for doc, st in sorted(serving, key=lambda x: (x[0]["rank"], x[0]["pp_rank"], x[0]["pid"]))
    ]
    grid = any(st is not None for _, st in units)
    raise DaemonError(
        f"{sidecar} is not ready: no daemon serves {', '.join(missing)}"
        + (f" (of ranks 0..{tp - 1})" if tp > 1 and not grid else "")
        + (
            " (the whole rank, or every stage of one split)"
            if not grid and any(st is not None for _, st in serving)
            else ""
        )
        + (f"; served: {', '.join(served_by)}" if served_by else "")
        + f" (looked in {where})",
        hint="start " + ("it" if len(starts) == 1 else "them") + ": " + "; ".join(starts),
    )


def _follow_pointer(ptr: Path) -> dict[str, Any]:
    """The status of the daemon a pointer names, or a ``stale`` document saying why not."""
    try:
        where = P.read_pointer(ptr)
    except ValueError as e:
        return {"state": "stale", "socket": "?", "pointer": str(ptr), "reason": str(e)[:300]}
    sock, pid = where["socket"], where["pid"]
    stale = {"state": "stale", "socket": sock, "pointer": str(ptr)}
    try:
        doc = status_of(Path(sock))
    except DaemonError as e:  # ProtocolError too
        return {**stale, "reason": f"no daemon answers there ({e})"[:300]}
    if doc.get("socket") != sock or doc.get("pid") != pid:
        return {**stale, "reason": f"the daemon there is pid {doc.get('pid')}, not {pid}"}
    return {**doc, "pointer": str(ptr)}
