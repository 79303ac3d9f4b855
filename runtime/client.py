"""The client side: ``attach`` to a daemon's allocation, and ``query_status`` for ``mpack status``."""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpack.errors import DaemonError, ProtocolError
from mpack.runtime import protocol as P
from mpack.runtime.layout import check_rank, tensors_from_wire
from mpack.sidecar import load_manifest

if TYPE_CHECKING:
    from mpack.runtime.weights import SharedWeights


def _connect(path: Path, what: str, start_hint: str, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError) as e:
        sock.close()
        stale = (
            " (a stale socket: its daemon died)" if isinstance(e, ConnectionRefusedError) else ""
        )
        serves = f" serves {what}" if what else ""
        raise DaemonError(f"no daemon{serves} at {path}{stale}", hint=start_hint) from None
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


def _request(
    sock: socket.socket, msg: dict[str, Any], path: Path
) -> tuple[dict[str, Any], list[int]]:
    try:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            # A daemon that refuses us replies at once and closes; its reply is still queued.
            P.send_message(sock, msg)
        reply, fds = P.recv_message(sock, P.MAX_REPLY_BYTES)
    except TimeoutError:
        raise DaemonError(
            f"the daemon at {path} did not answer within {sock.gettimeout():g} s"
        ) from None
    except (BrokenPipeError, ConnectionResetError):
        raise DaemonError(f"the daemon at {path} closed the connection") from None
    if reply["type"] == P.ERROR:
        for fd in fds:
            os.close(fd)
        raise DaemonError(f"the daemon at {path} refused: {reply.get('message')!s:.500}")
    return reply, fds


def attach(
    sidecar: str | os.PathLike,
    *,
    rank: int = 0,
    device: str = "cpu",
    socket: str | os.PathLike | None = None,
    timeout: float = P.CLIENT_TIMEOUT_S,
) -> SharedWeights:
    """Zero-copy, read-only views of the memory of the daemon serving ``sidecar``'s ``rank``.

    The daemon's socket is found from the sidecar's manifest digest, the rank and the device
    (the rule ``mpack serve`` uses) unless ``socket`` is given. The daemon must serve the same
    manifest digest, rank and device (a GPU is compared by UUID). Tensors are views into one
    mapping (host: ``mmap`` PROT_READ of a sealed memfd; CUDA: a PROT_READ VMM mapping); see
    Note [lifetime of a mapping] in weights.py for when it is released.

    Raises:
        DaemonError: no daemon there, or one that serves something else or refused us.
        ProtocolError: a daemon that broke the protocol.
        FormatVersionError, CorruptFileError, UsageError: the sidecar or arguments.
    """
    from mpack.runtime.weights import SharedWeights

    manifest, digest = load_manifest(sidecar)
    check_rank(manifest, rank)
    dev = P.resolve_device(device)
    path = Path(socket) if socket is not None else P.socket_path(digest, rank, dev.key)
    what = f"{sidecar} rank {rank} on {dev.label}"
    hint = f"start one: mpack serve {sidecar} --rank {rank} --device {dev.label}"
    sock = _connect(path, what, hint, timeout)
    try:
        hello = {"type": P.ATTACH, "digest": digest, "rank": rank, "device": dev.key,
                 "pid": os.getpid()}  # fmt: skip
        reply, fds = _request(sock, hello, path)
        try:
            size, tensors = _check_attached(reply, fds, path, (digest, rank, dev), what)
            base = _map(fds[0], size, dev)
        finally:
            for fd in fds:
                os.close(fd)
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)  # from here on the connection is only the lease
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
    )


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
        raise ProtocolError(f"the daemon at {path} sent sizes {size!r}, {data_size!r}")
    tensors = tensors_from_wire(reply.get("tensors"), data_size)
    if len(fds) != 1:
        raise ProtocolError(f"the daemon at {path} sent {len(fds)} descriptors, not 1")
    if reply.get("backend") != _backend(dev):
        raise ProtocolError(f"the daemon at {path} serves backend {reply.get('backend')!r}")
    return size, tensors


def _map(fd: int, size: int, dev: P.Device) -> Any:
    """Map the daemon's memory read-only in this process: host ``mmap`` or CUDA VMM."""
    if dev.kind == "cpu":
        from mpack.runtime.host import map_readonly

        return map_readonly(fd, size)
    from mpack.runtime.cuda_vmm import map_readonly as map_device

    assert dev.ordinal is not None
    return map_device(fd, size, dev.ordinal)


def status_of(path: Path, *, timeout: float = 5.0) -> dict[str, Any]:
    """The status document of the daemon at ``path`` (see Daemon.status)."""
    sock = _connect(path, "", "start one with: mpack serve SIDECAR", timeout)
    with contextlib.closing(sock):
        reply, fds = _request(sock, {"type": P.STATUS}, path)
    for fd in fds:
        os.close(fd)
    if reply["type"] != P.STATUS:
        raise ProtocolError(f"the daemon at {path} answered status with {reply['type']!r}")
    return {"state": "serving", **{k: v for k, v in reply.items() if k not in ("v", "type")}}


def query_status(
    sidecar: str | os.PathLike | None = None, socket: str | os.PathLike | None = None
) -> list[dict[str, Any]]:
    """What ``mpack status`` shows: one document per daemon.

    With ``socket``: that daemon. With ``sidecar``: every daemon serving it (any rank, any
    device) that this user's runtime directory knows of. With neither: every such daemon. A
    daemon is known by its socket there, or, when it was started with ``serve --socket PATH``,
    by the pointer it wrote there (Note [pointers to --socket daemons] in protocol.py); its
    document then has ``"pointer"``. Sockets whose daemon died, and pointers that lead to no
    such daemon, are listed as ``{"state": "stale", "socket": ...}`` (a pointer's also with
    ``"pointer"`` and ``"reason"``).

    Raises:
        DaemonError: ``socket`` or ``sidecar`` given and no live daemon found.
    """
    if socket is not None:
        return [status_of(Path(socket))]
    prefix = ""
    if sidecar is not None:
        _, digest = load_manifest(sidecar)
        prefix = digest[:16] + "-"
    d = P.runtime_dir()
    paths = sorted(d.glob(f"{prefix}*{P.SOCKET_SUFFIX}")) if d.is_dir() else []
    pointers = sorted(d.glob(f"{prefix}*{P.POINTER_SUFFIX}")) if d.is_dir() else []
    docs = []
    for p in paths:
        try:
            docs.append(status_of(p))
        except DaemonError:
            docs.append({"state": "stale", "socket": str(p)})
    seen = {doc["socket"] for doc in docs}
    for ptr in pointers:
        doc = _follow_pointer(ptr)
        if doc["socket"] not in seen or doc["state"] != "serving":
            docs.append(doc)
            seen.add(doc["socket"])
    if sidecar is not None and not any(doc["state"] == "serving" for doc in docs):
        raise DaemonError(
            f"no daemon serves {sidecar} (looked in {d})",
            hint=f"start one: mpack serve {sidecar} --rank 0 --device cpu",
        )
    return docs


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
    except (DaemonError, ProtocolError) as e:
        return {**stale, "reason": f"no daemon answers there ({e})"[:300]}
    if doc.get("socket") != sock or doc.get("pid") != pid:
        return {**stale, "reason": f"the daemon there is pid {doc.get('pid')}, not {pid}"}
    return {**doc, "pointer": str(ptr)}
