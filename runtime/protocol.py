"""The serve/attach wire protocol, and where its socket lives (docs/RUNTIME.md "Protocol").

Every message, in both directions, is one frame::

    b"MPAK"  u32 little-endian N  N bytes of UTF-8 JSON (an object)

with ``"v": PROTOCOL_VERSION`` and a ``"type"`` in every object. A connection carries exactly one
request and its reply; an ``attach`` connection then stays open as the *lease* (the daemon lists
its peer as an attached client until it closes). The reply to ``attach`` carries one file
descriptor (SCM_RIGHTS) attached to its first byte. Nothing is pickled; requests are capped at
``MAX_REQUEST_BYTES`` and checked against a schema before the daemon acts on them.

The socket is named from what it serves, so ``serve`` and ``attach`` find each other from the
sidecar, rank and device alone: ``<runtime dir>/<digest[:16]>-r<rank>-<device key>.sock`` in a
per-user 0700 directory (``$XDG_RUNTIME_DIR/mpack``, else ``/tmp/mpack-$UID``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
import stat
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpack import fsutil
from mpack.arch import Stage
from mpack.device import KEY, DeviceSpec
from mpack.errors import DaemonError, MpackError, ProtocolError, UsageError, arg

PROTOCOL_VERSION = 1
MAGIC = b"MPAK"
HEADER = struct.Struct("<4sI")  # magic, payload length
MAX_REQUEST_BYTES = 64 * 1024  # what the daemon accepts: requests are a few hundred bytes
# What a client accepts (Note [what a client takes from its peer] in client.py): a rank of a
# Llama 405B has a few thousand tensors, well under 1 MiB on the wire; the caps leave room for
# ten times that, and bound what a hostile peer can make a client parse (16 MiB of tiny entries
# cost about 1 s and 200 MB before their count is checked).
MAX_REPLY_BYTES = 16 * 1024 * 1024
MAX_TENSORS = 65536  # entries in an ``attached`` reply's tensor list
MAX_FDS = 4  # ancillary slots a client reads (one is used)
HELLO_TIMEOUT_S = 5.0  # a connection must deliver its request (and take its reply) within this
CLIENT_TIMEOUT_S = 30.0  # how long a client waits for the daemon's whole reply
MAX_CONNECTIONS = 4096  # open connections (leases included) one daemon keeps
MAX_STAGES = 1024  # pipeline stages in a split a client accepts from a peer
SOCKET_SUFFIX = ".sock"
LOCK_SUFFIX = ".lock"
POINTER_SUFFIX = ".ptr"  # Note [pointers to --socket daemons]
MAX_POINTER_BYTES = 8192
RUNTIME_SUBDIR = "mpack"

# Message types: requests (client -> daemon) and replies (daemon -> client).
ATTACH = "attach"
STATUS = "status"
ATTACHED = "attached"
ERROR = "error"
REQUESTS = (ATTACH, STATUS)

# Error codes carried by an "error" reply.
BAD_MESSAGE = "bad-message"  # not a frame, not JSON, or fails the schema
TOO_LARGE = "too-large"  # a length prefix over MAX_REQUEST_BYTES
VERSION = "version"  # another protocol version
UNKNOWN_TYPE = "unknown-type"  # a "type" the daemon does not know
MISMATCH = "mismatch"  # asks for another sidecar digest, rank or device
REFUSED = "refused"  # peer uid is not the daemon's
BUSY = "busy"  # MAX_CONNECTIONS reached
TIMEOUT = "timeout"  # no complete request within HELLO_TIMEOUT_S

_DIGEST = re.compile(r"[0-9a-f]{64}")


class WireError(ProtocolError):
    """A frame or message that breaks the protocol; ``code`` is one of the error codes above."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


# --- frames ------------------------------------------------------------------------------------


def encode(msg: dict[str, Any]) -> bytes:
    """One frame: header + compact JSON of ``msg`` (which gets ``"v"`` if it lacks one)."""
    body = json.dumps({"v": PROTOCOL_VERSION, **msg}, separators=(",", ":")).encode()
    return HEADER.pack(MAGIC, len(body)) + body


def error_message(code: str, message: str) -> dict[str, Any]:
    return {"type": ERROR, "code": code, "message": message}


def frame_length(buf: bytes | bytearray, cap: int) -> int | None:
    """The payload length announced by the header at the start of ``buf`` (None: need more).

    Raises:
        WireError: bad magic (``bad-message``), or a length of 0 or over ``cap`` (``too-large``).
    """
    if len(buf) < HEADER.size:
        return None
    magic, n = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise WireError(BAD_MESSAGE, f"not an mpack frame (starts with {bytes(buf[:4])!r})")
    if n == 0:
        raise WireError(BAD_MESSAGE, "empty message")
    if n > cap:
        raise WireError(TOO_LARGE, f"message of {n} bytes exceeds the limit of {cap} bytes")
    return n


def take_message(buf: bytearray, cap: int) -> dict[str, Any] | None:
    """Remove one complete frame from the front of ``buf`` and decode it (None: incomplete)."""
    n = frame_length(buf, cap)
    if n is None or len(buf) < HEADER.size + n:
        return None
    payload = bytes(buf[HEADER.size : HEADER.size + n])
    del buf[: HEADER.size + n]
    return decode(payload)


def decode(payload: bytes) -> dict[str, Any]:
    """Parse one message body: a JSON object with our version and a string ``type``."""
    try:
        msg = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise WireError(BAD_MESSAGE, f"message is not UTF-8 JSON ({type(e).__name__})") from None
    if not isinstance(msg, dict):
        raise WireError(BAD_MESSAGE, f"message is a JSON {type(msg).__name__}, not an object")
    v = msg.get("v")
    if type(v) is not int:
        raise WireError(BAD_MESSAGE, 'message lacks an integer "v" (protocol version)')
    if v != PROTOCOL_VERSION:
        raise WireError(VERSION, f"protocol version {v}; this mpack speaks {PROTOCOL_VERSION}")
    if not isinstance(msg.get("type"), str):
        raise WireError(BAD_MESSAGE, 'message lacks a string "type"')
    return msg


def check_request(msg: dict[str, Any]) -> dict[str, Any]:
    """Schema of a request (``attach`` or ``status``); return it unchanged."""
    kind = msg["type"]
    if kind not in REQUESTS:
        raise WireError(UNKNOWN_TYPE, f"unknown message type {kind[:40]!r}")
    if kind == ATTACH:
        digest, rank, device = msg.get("digest"), msg.get("rank"), msg.get("device")
        if not (isinstance(digest, str) and _DIGEST.fullmatch(digest)):
            raise WireError(BAD_MESSAGE, 'attach needs "digest": 64 lowercase hex digits')
        if type(rank) is not int or rank < 0:
            raise WireError(BAD_MESSAGE, 'attach needs "rank": a non-negative integer')
        if not (isinstance(device, str) and 0 < len(device) <= 128):
            raise WireError(BAD_MESSAGE, 'attach needs "device": a string like "cpu"')
    return msg


#: The fields of a ``status`` reply that ``mpack status`` reads, and their types.
STATUS_FIELDS: dict[str, type | tuple[type, ...]] = {
    "sidecar": str,
    "digest": str,
    "rank": int,
    "tp_size": int,
    "device": str,
    "device_label": str,
    "backend": str,
    "bytes": int,
    "socket": str,
    "pid": int,
    "uptime_s": (int, float),
    "clients": list,
}


def check_status(msg: dict[str, Any]) -> dict[str, Any]:
    """Schema of a ``status`` reply (the fields ``STATUS_FIELDS`` names; more are allowed);
    return it unchanged.

    Raises:
        WireError: a field missing or of another type, or a client without an integer pid.
    """
    for key, kind in STATUS_FIELDS.items():
        value = msg.get(key)
        if isinstance(value, bool) or not isinstance(value, kind):
            got = "no" if key not in msg else f"{_json_kind(value)} as"
            raise WireError(BAD_MESSAGE, f'status reply has {got} "{key}"')
    for c in msg["clients"]:
        if not (isinstance(c, dict) and type(c.get("pid")) is int):
            raise WireError(BAD_MESSAGE, 'status reply lists a client without an integer "pid"')
    stage_from_wire(msg.get("stage"))  # null or absent: the whole rank
    return msg


def _json_kind(value: Any) -> str:
    kinds = {
        bool: "a boolean",
        int: "a number",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }
    return kinds.get(type(value), "null")


# --- blocking client side ----------------------------------------------------------------------


def send_message(sock: socket.socket, msg: dict[str, Any]) -> None:
    sock.sendall(encode(msg))


def recv_message(
    sock: socket.socket, cap: int = MAX_REPLY_BYTES, *, deadline: float | None = None
) -> tuple[dict[str, Any], list[int]]:
    """Read exactly one frame (and any fds sent with it) from a blocking socket.

    ``deadline`` (a ``time.monotonic()`` value) bounds the whole frame, not each ``recv``: a peer
    that drips a byte at a time cannot hold the reader past it. The caller owns (and must close)
    the returned fds, except when this raises: they are closed then.

    Raises:
        WireError: a bad frame, a length over ``cap``, too many fds, or a closed connection.
        TimeoutError: ``deadline`` passed (or the socket's own timeout, without a deadline).
    """
    buf = bytearray()
    fds: list[int] = []
    try:
        need = HEADER.size
        while len(buf) < need:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no complete reply after {len(buf)} bytes")
                sock.settimeout(left)
            data, got, flags, _ = socket.recv_fds(sock, min(need - len(buf), 1 << 20), MAX_FDS)
            fds.extend(got)
            if flags & socket.MSG_CTRUNC:
                raise WireError(BAD_MESSAGE, "too many file descriptors in one message")
            if not data:
                raise WireError(BAD_MESSAGE, f"connection closed after {len(buf)} bytes")
            buf += data
            if need == HEADER.size and len(buf) >= HEADER.size:
                need = HEADER.size + (frame_length(buf, cap) or 0)
        return decode(bytes(buf[HEADER.size :])), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


# --- devices -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    """Where a rank is served. ``key`` names the socket and is compared on attach: ``cpu``, or
    ``cuda:GPU-<uuid>`` so that processes with different CUDA_VISIBLE_DEVICES agree."""

    kind: str  # "cpu" | "cuda"
    ordinal: int | None  # CUDA device ordinal in this process; None for cpu
    key: str

    @property
    def label(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.ordinal}"


def checked_device(spec: str) -> DeviceSpec:
    """``spec`` read as a ``--device`` value (:data:`mpack.device.SERVE`), and for CUDA a check
    that torch sees that device (asked through NVML where torch can: no CUDA context is created).

    Raises:
        UsageError: a bad spec, or a CUDA device this machine does not have (no GPU, no driver,
            a CPU-only torch, or an index past the last device).
    """
    d = DeviceSpec.parse(spec)
    if d.kind == "cuda":
        import torch

        # 0 without a driver or a CUDA build; never raises
        _check_count(spec, d.ordinal, torch.cuda.device_count(), "torch")
    return d


def _check_count(spec: str, ordinal: int, n: int, who: str) -> None:
    """Refuse ``cuda:<ordinal>`` where ``who`` counts ``n`` CUDA devices."""
    if ordinal < n:
        return
    given = arg("device", str(spec).strip())  # Note [API wording] in mpack/errors.py
    if n == 0:
        raise UsageError(
            f"{given}: no CUDA device here ({who} reports none)",
            hint=f"use {arg('device', 'cpu')} (or run on a machine with a GPU and its driver)",
        )
    raise UsageError(
        f"{given}: no such CUDA device here ({who} reports {n}: cuda:0 to cuda:{n - 1})",
        hint=f"use {arg('device', 'cuda:0')} .. cuda:{n - 1}, or {arg('device', 'cpu')}",
    )


def resolve_device(spec: str) -> Device:
    """``spec`` checked as :func:`checked_device` checks it, but counting the GPUs with the CUDA
    driver (cuda-bindings), not torch: the daemon and ``attach`` use the driver anyway, and the
    daemon imports no torch (Note [torch-free daemon fill] in :mod:`mpack.runtime.cuda_vmm`);
    and for CUDA the GPU's UUID from the driver (initialises it).

    Raises:
        UsageError: a bad spec, a CUDA device that is not here, or no cuda-bindings (its hint).
    """
    d = DeviceSpec.parse(spec)
    if d.kind == "cpu":
        return Device("cpu", None, "cpu")
    from mpack import cudadrv
    from mpack.device import no_cuda_here

    if no_cuda_here():
        _check_count(spec, d.ordinal, 0, "the CUDA driver")
    cudadrv.driver()  # cuda-bindings missing: its install hint
    _check_count(spec, d.ordinal, cudadrv.device_count(), "the CUDA driver")
    from mpack.runtime import cuda_vmm

    key = DeviceSpec("cuda", uuid=cuda_vmm.device_uuid(d.ordinal))
    return Device("cuda", d.ordinal, str(key))


# --- rendezvous --------------------------------------------------------------------------------


def runtime_dir(*, create: bool = False) -> Path:
    """The per-user socket directory: ``$XDG_RUNTIME_DIR/mpack``, else ``/tmp/mpack-$UID``.

    Raises:
        DaemonError: the directory exists but is not a 0700 directory owned by this user (someone
            else could then swap sockets under us).
    """
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base):
        d = Path(base) / RUNTIME_SUBDIR
    else:
        d = Path(f"/tmp/mpack-{os.getuid()}")
    if create:
        with contextlib.suppress(FileExistsError):
            d.mkdir(mode=0o700)
    if os.path.lexists(d):
        check_private_dir(d)
    return d


def check_private_dir(d: Path) -> None:
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise DaemonError(
            f"refusing to use {d}: it must be a directory owned by uid {os.getuid()} with mode "
            f"0700 (it is uid {st.st_uid}, mode {stat.filemode(st.st_mode)})",
            hint=f"remove {d}, or set XDG_RUNTIME_DIR to a private directory",
        )


def socket_name(digest: str, rank: int, device_key: str, pp_rank: int | None = None) -> str:
    """``<digest[:16]>-r<rank>-<dev>.sock``, or ``<digest[:16]>-r<rank>-p<pp_rank>-<dev>.sock``
    for the daemon of one pipeline stage (Note [the daemon of a stage]); ``dev`` is ``cpu`` or
    ``gpu-`` + the GPU UUID's first 12 hex digits (short enough that deep runtime directories
    stay under sun_path's 107 bytes)."""
    d = DeviceSpec.parse(device_key, KEY, "device key")
    dev = d.kind if d.uuid is None else "gpu-" + d.uuid[len("GPU-") :].replace("-", "")[:12]
    stage = "" if pp_rank is None else f"p{pp_rank}-"
    return f"{digest[:16]}-r{rank}-{stage}{dev}{SOCKET_SUFFIX}"


def socket_path(
    digest: str, rank: int, device_key: str, *, create: bool = False, pp_rank: int | None = None
) -> Path:
    """Where the daemon serving (digest, rank, device) listens; with ``pp_rank``, the daemon of
    that pipeline stage of the rank (Note [the daemon of a stage])."""
    return runtime_dir(create=create) / socket_name(digest, rank, device_key, pp_rank)


# Note [the daemon of a stage]: `mpack serve SIDECAR --rank R --pp-rank P --pp-size N` holds
# only what pipeline stage P of N builds of rank R (Note [a stage's allocation] in
# allocation.py). It listens at a socket named from the stage's index, not from its split
# (``-r<R>-p<P>-``): an engine's stage P finds the daemon of stage P on its device whatever
# split either was started with, and the split the daemon serves (``stage`` in its ``attached``
# and ``status`` replies: :func:`stage_to_wire`) is compared with the engine's on attach, which
# refuses another one naming both (``StageMismatchError``) rather than serving the wrong layers
# or quietly loading privately. One daemon per (sidecar, rank, stage index, device): its lock
# is that socket's. A daemon of the whole rank (no ``--pp-rank``) keeps the plain name and
# serves any stage of it; its replies carry no ``stage``.


def stage_to_wire(stage: Stage | None) -> dict[str, Any] | None:
    """``{"pp_rank": P, "split": [n0, n1, ...]}`` of a stage daemon; None for the whole rank."""
    stage = Stage.partial(stage)
    if stage is None:
        return None
    return {"pp_rank": stage.rank, "split": list(stage.split)}


def stage_fields(stage: Stage | None) -> dict[str, Any]:
    """The pipeline stage a daemon serves, as its ``status`` and READY say it: ``pp_rank`` and
    ``pp_size`` (0 and 1 for the whole rank), ``layers`` (``[start, stop)`` of its decoder
    layers; null for the whole rank) and ``stage`` (:func:`stage_to_wire`)."""
    stage = Stage.partial(stage)
    if stage is None:
        return {"pp_rank": 0, "pp_size": 1, "layers": None, "stage": None}
    span = stage.layers
    return {
        "pp_rank": stage.rank,
        "pp_size": stage.size,
        "layers": [span.start, span.stop],
        "stage": stage_to_wire(stage),
    }


def stage_from_wire(doc: Any) -> Stage | None:
    """The stage a daemon's reply says it serves (:func:`stage_to_wire`); None: the whole rank.

    Raises:
        WireError: anything but such an object or null.
    """
    if doc is None:
        return None
    split = doc.get("split") if isinstance(doc, dict) else None
    pp_rank = doc.get("pp_rank") if isinstance(doc, dict) else None
    if not (
        isinstance(split, list)
        and 1 <= len(split) <= MAX_STAGES
        and all(type(n) is int and n >= 0 for n in split)
        and type(pp_rank) is int
        and 0 <= pp_rank < len(split)
    ):
        raise WireError(BAD_MESSAGE, f"a malformed stage {str(doc)[:200]}")
    return Stage(pp_rank, tuple(split))


def check_socket_path(path: Path) -> None:
    if len(os.fsencode(path)) > 107:  # sun_path is 108 bytes with the NUL
        raise DaemonError(
            f"socket path {path} is longer than 107 bytes",
            hint="pass a shorter one with --socket (or set XDG_RUNTIME_DIR)",
        )


# --- pointers to daemons listening elsewhere -----------------------------------------------------

# Note [pointers to --socket daemons]: ``mpack status`` finds daemons by listing the per-user
# runtime directory, but ``serve --socket PATH`` listens wherever PATH is. Such a daemon also
# writes a *pointer* there: a small JSON file ``<digest[:16]>-r<rank>-<dev>-at-<h>.ptr`` (``h``:
# 12 hex digits of the sha256 of PATH, so daemons at different paths never share one) holding
# ``socket``, ``pid``, ``digest``, ``rank`` and ``device``. It is written under a fresh temporary
# name (``tempfile.mkstemp``: O_EXCL, mode 0600) and renamed into place whole (a reader never
# sees half of it; a rename replaces a symlink itself, never what it points at), replaces only
# a regular file of ours (the pointer a killed daemon at the same PATH left: we hold PATH's
# lock), and is removed when the daemon stops cleanly. ``status``
# reads a pointer only if it is a regular file of ours with mode 0600 (no symlink followed),
# connects to the socket it names (the client's uid check applies) and lists the daemon only if
# it reports the same socket and pid; otherwise the pointer is listed as stale. A pointer is a
# convenience for ``status``: a daemon that cannot write one serves all the same.


def pointer_name(
    digest: str, rank: int, device_key: str, socket: Path, pp_rank: int | None = None
) -> str:
    """The pointer file name of a daemon listening at ``socket`` (absolute)."""
    base = socket_name(digest, rank, device_key, pp_rank)[: -len(SOCKET_SUFFIX)]
    h = hashlib.sha256(os.fsencode(socket)).hexdigest()[:12]
    return f"{base}-at-{h}{POINTER_SUFFIX}"


def write_pointer(pointer: Path, doc: dict[str, Any]) -> int:
    """Write ``doc`` at ``pointer`` (Note [pointers to --socket daemons]); return its inode.

    Raises:
        DaemonError: something that is not a regular file of ours is in the way.
        OSError: the directory refused.
    """
    data = json.dumps(doc, separators=(",", ":")).encode()
    fd, tmp = tempfile.mkstemp(dir=pointer.parent, prefix=f".{pointer.name}.tmp-")
    try:
        try:
            os.fchmod(fd, 0o600)  # mkstemp's 0600 less the umask: exactly what status accepts
            os.write(fd, data)
            ino = os.fstat(fd).st_ino
        finally:
            os.close(fd)
        try:
            st = os.lstat(pointer)
        except FileNotFoundError:
            pass
        else:  # a killed daemon's, at the same socket path (we hold its lock), or in the way
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise DaemonError(
                    f"{pointer} is in the way (uid {st.st_uid}, mode "
                    f"{stat.filemode(st.st_mode)}); not replacing it"
                )
        os.replace(tmp, pointer)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return ino


def remove_pointer(pointer: Path, ino: int) -> None:
    """Remove ``pointer`` if it is still the file written (inode ``ino``)."""
    with contextlib.suppress(OSError):
        if os.lstat(pointer).st_ino == ino:
            os.unlink(pointer)


def read_pointer(pointer: Path) -> dict[str, Any]:
    """A pointer's ``{"socket": str, "pid": int, ...}``.

    Raises:
        ValueError: not a regular file of ours with mode 0600 (a symlink is not followed), too
            large, or not a pointer document; the message says which.
    """
    try:
        with fsutil.open_regular_file(pointer, what="pointer", buffering=0) as f:
            st = os.fstat(f.fileno())
            if not fsutil.is_private(st, 0o600):
                raise ValueError(
                    f"not ours with mode 0600 (uid {st.st_uid}, mode {stat.filemode(st.st_mode)})"
                )
            data = f.read(MAX_POINTER_BYTES + 1)
    except MpackError as e:  # a symlink (not followed), a FIFO, a directory, ... gone
        raise ValueError(str(e)) from None
    if len(data) > MAX_POINTER_BYTES:
        raise ValueError(f"larger than {MAX_POINTER_BYTES} bytes")
    try:
        doc = fsutil.parse_json(data, pointer, "pointer")
    except MpackError:
        raise ValueError("not JSON") from None
    if not (
        isinstance(doc, dict)
        and isinstance(doc.get("socket"), str)
        and os.path.isabs(doc["socket"])
        and type(doc.get("pid")) is int
    ):
        raise ValueError("not a pointer document (socket, pid)")
    return doc
