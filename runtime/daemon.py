"""``mpack serve``: load one rank once, then hand read-only mappings of it to local processes.

One serving thread (and one that writes the log: Note [logging never blocks serving]), one
``selectors`` loop, non-blocking sockets: no client can block the daemon by
connecting and hanging, by sending half a frame, or by not reading its reply (each connection
has ``HELLO_TIMEOUT_S`` to finish its request and take the reply). Every request is bounded
and schema-checked before anything acts on it (protocol.py), and answered with an ``error``
reply when it breaks a rule; only that connection is closed.

Note [one daemon per (sidecar, rank, device)]: the daemon holds an exclusive ``flock`` on
``<socket>.lock`` for its whole life; the kernel drops it when the process dies, however it
dies. So while the lock is held any socket file is live, and when it can be taken any socket
file left at the path is stale (a daemon killed with SIGKILL) and is replaced. The lock is
taken for what is served, not only for the path: every daemon, ``--socket PATH`` or not, holds
the lock of the *default* socket of its (manifest digest, rank, device key; and pipeline stage
index for the daemon of one stage: Note [the daemon of a stage] in protocol.py) in the per-user
runtime directory (a ``--socket`` daemon holds ``PATH.lock`` as well), so a second daemon of
the same rank at another path is refused too, naming the first one's pid and socket, instead
of mapping the sidecar a second time. A daemon that stops cleanly removes the socket and the
lock files (after checking the path still names the file it locked, so a racing starter never
ends up holding an unlinked lock).

Note [trust model for the socket directory]: the default directory is private (0700, ours:
protocol.check_private_dir). A ``--socket`` directory must be one that other users cannot write,
or a sticky one (``/tmp``), where they cannot remove or rename what is ours
(fsutil.check_safe_dir). Even so, another user may have planted files there first, so: the lock
file is opened with ``O_NOFOLLOW`` and must be a regular file of ours with mode 0600
(fsutil.LockFile), else the daemon refuses to start, without writing to it or printing the pid
it holds; a file at the socket path is removed only if ``lstat`` shows a socket of ours; the new
socket is made 0600 by the umask, not by a ``chmod`` that would follow a planted symlink.

Note [logging never blocks serving]: the serving thread never writes a log line itself. It
hands each event to a bounded queue (``LOG_QUEUE_EVENTS``) without waiting, and a thread of its
own calls the log callback. A reader that stops reading (``mpack serve S 2>&1 >/dev/null |
sleep 600``: once the 64 KiB pipe is full, ``write(2)`` blocks) then blocks only that thread;
while the queue is full, events are dropped and counted, and the count is logged as a
``log-dropped`` event once there is room again (the total also in ``stopped``, as
``log_dropped``). A callback that raises (its reader went away, a full disk) costs that line and the
later ones. A stopping daemon waits at most ``LOG_DRAIN_S`` for its log. The callback
``mpack serve`` uses writes to the descriptor directly (``ui.emit_event``), not through
``sys.stderr``'s buffer, whose lock a thread blocked in ``write`` would hold through the
interpreter's exit.

Note [the daemon's events]: everything the daemon has to say is an event, a dict ``{"event":
NAME, ...fields}`` handed to the ``on_event`` callback with its time (``ts``, seconds since the
epoch, taken when it happened, not when the log thread wrote it). In order of a life:
``loading`` (what, how many bytes), ``progress`` (every ``progress_every`` seconds of a load
that takes longer than a second), ``ready`` (the READY fields), ``attached`` / ``detached``
(one per lease), the refusals (:data:`EVENT_LEVELS`), ``stopping`` (the signal) and ``stopped``.
``mpack serve`` writes each as one log line on stderr (text or JSON, with its level) and, under
``--json``, as one JSON line on stdout; the metrics endpoint (runtime/metrics.py) counts them
before they are queued, and a service manager hears of ``loading``, ``progress``, ``ready`` and
``stopping`` through ``sd_notify`` (runtime/sdnotify.py).
"""

from __future__ import annotations

import contextlib
import os
import queue
import resource
import selectors
import signal
import socket
import stat
import threading
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpack import __version__, fsutil
from mpack.arch import Stage
from mpack.env import PROGRESS_EVERY_S
from mpack.errors import DaemonError, UsageError, arg
from mpack.periodic import Periodic
from mpack.runtime import protocol as P
from mpack.runtime.allocation import Allocation, plan_rank, tensors_to_wire
from mpack.runtime.sdnotify import Notifier, status_line

if TYPE_CHECKING:
    from mpack.runtime.metrics import ServeMetrics

Callback = Callable[[dict[str, Any]], None]
# Each stops the daemon cleanly (socket and lock removed, exit 0). SIGHUP too: a closed terminal
# or a `nohup`-less start must not leave a stale socket behind.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
LOG_QUEUE_EVENTS = 1024  # events waiting for the log thread before more are dropped
LOG_DRAIN_S = 2.0  # how long a stopping daemon waits for its log to be written
FIRST_PROGRESS_S = 1.0  # a load that takes less than this says nothing between loading and ready

#: The level of each event in the log (Note [the daemon's events]); any other is ``INFO``.
EVENT_LEVELS = {
    "refused": "WARNING",
    "busy": "WARNING",
    "bad-request": "WARNING",
    "dropped": "WARNING",
    "accept-failed": "WARNING",
    "no-pointer": "WARNING",
    "no-rank-lock": "WARNING",
    "log-dropped": "WARNING",
    "notify-failed": "WARNING",
    "internal-error": "ERROR",
}


def level_of(event: dict[str, Any]) -> str:
    """``INFO``, ``WARNING`` or ``ERROR``: how much an event matters (:data:`EVENT_LEVELS`)."""
    return EVENT_LEVELS.get(str(event.get("event")), "INFO")


class EventLog:
    """Calls ``callback(event)`` on a thread of its own, fed through a bounded queue, so that a
    slow or stalled log never blocks the caller (Note [logging never blocks serving])."""

    def __init__(self, callback: Callback, capacity: int = LOG_QUEUE_EVENTS) -> None:
        self._callback: Callback | None = callback
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(capacity)
        self.dropped = 0  # events dropped since the last ``log-dropped`` event was queued
        self.dropped_total = 0
        self._thread = threading.Thread(target=self._run, name="mpack-serve-log", daemon=True)
        self._thread.start()

    def __call__(self, event: dict[str, Any]) -> None:
        """Queue ``event`` (after a ``log-dropped`` event, if some were dropped); never waits."""
        try:
            if self.dropped:
                lost = {"event": "log-dropped", "lines": self.dropped, "ts": time.time()}
                self._queue.put_nowait(lost)
                self.dropped = 0
            self._queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1
            self.dropped_total += 1

    def _run(self) -> None:
        while (event := self._queue.get()) is not None:
            if self._callback is None:
                continue
            try:
                self._callback(event)
            except Exception:  # noqa: BLE001 - any failure of the log, which has nowhere to go
                self._callback = None

    def close(self, timeout: float = LOG_DRAIN_S) -> bool:
        """Let the thread write what is queued and end, waiting up to ``timeout`` seconds;
        whether it did (if not, it stays blocked in the callback: a daemon thread, it does not
        hold up the exit)."""
        deadline = time.monotonic() + timeout
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return False
        self._thread.join(max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive()


@dataclass
class Served:
    """What a daemon serves: one rank of one sidecar, in one exported allocation."""

    plan: Allocation
    device: P.Device
    export: Any  # host.HostExport | cuda_vmm.DeviceExport: .fd, .size, .backend, .stats, .close()
    started: float = field(default_factory=time.time)
    startup: Startup | None = None  # where the start went (the ready event's ``startup``)

    def status(self) -> dict[str, Any]:
        target = self.plan.manifest.get("target", {})
        return {
            "sidecar": str(self.plan.sidecar.resolve()),
            "digest": self.plan.digest,
            "rank": self.plan.rank,
            "tp_size": self.plan.tp_size,
            **P.stage_fields(self.plan.stage),
            "engine": target.get("engine"),  # the engine the sidecar was made for (vllm)
            "engine_version": target.get("engine_version"),
            "device": self.device.key,
            "device_label": self.device.label,
            "backend": self.export.backend,
            "bytes": self.export.size,
            "tensors": len(self.plan.tensors),
            "load_s": round(self.export.stats.seconds, 3),
        }


class _Conn:
    """One accepted connection: its peer, buffers, deadline and (once attached) lease start."""

    def __init__(self, sock: socket.socket, pid: int, deadline: float) -> None:
        self.sock, self.pid = sock, pid
        self.inbuf = bytearray()
        self.out = memoryview(b"")
        self.out_fds: list[int] = []
        self.deadline: float | None = deadline
        self.answered = False  # one request per connection
        self.close_after_send = False
        self.lease_pending = False
        self.lease_since: float | None = None


class Daemon:
    """The accept/serve loop over one ``Served`` allocation at ``path``.

    ``owner_uid`` is the only uid allowed to connect (default: this process's own).
    ``on_event`` receives ``{"event": ..., ...}`` dicts for the log (Note [the daemon's
    events]); while ``run`` runs, it is called on a thread of its own (Note [logging never
    blocks serving]). ``metrics`` counts every event first, on the serving thread; ``notifier``
    tells a service manager ``READY=1`` once the socket listens and ``STOPPING=1`` on a signal.
    """

    def __init__(
        self,
        served: Served,
        path: Path,
        *,
        owner_uid: int | None = None,
        on_event: Callback | None = None,
        advertise: bool = False,
        metrics: ServeMetrics | None = None,
        notifier: Notifier | None = None,
    ) -> None:
        self.served, self.path = served, path
        self.metrics, self.notifier = metrics, notifier
        self.metrics_url = metrics.url if metrics is not None else None
        self.advertise = advertise  # write a pointer for `mpack status` (a --socket daemon)
        self.owner_uid = os.getuid() if owner_uid is None else owner_uid
        self._log = on_event
        self._event_log: EventLog | None = None  # while run() runs
        self.hello_timeout = P.HELLO_TIMEOUT_S
        self.conns: dict[int, _Conn] = {}
        self.sel = selectors.DefaultSelector()
        self._stop = False
        self._signal: int | None = None  # the stop signal that came
        self._attached: bytes | None = None  # the encoded ATTACHED reply
        self._listener: socket.socket | None = None

    # --- lifecycle ------------------------------------------------------------------------

    def run(self, on_ready: Callback | None = None) -> None:
        """Bind, print READY (through ``on_ready``), serve until a ``STOP_SIGNALS``, clean up."""
        if self._log is not None:
            self._event_log = EventLog(self._log)
        try:
            self._run(on_ready)
        finally:
            if self._event_log is not None:
                log, self._event_log = self._event_log, None
                if self._listener is not None:  # it served: say it stopped
                    lost = {"log_dropped": log.dropped_total} if log.dropped_total else {}
                    log({"event": "stopped", "pid": os.getpid(), **lost, "ts": time.time()})
                log.close()

    def _run(self, on_ready: Callback | None) -> None:
        self._listener = _bind(self.path)
        ino = os.lstat(self.path).st_ino
        pointer = self._advertise()
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        old = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        old_wakeup = signal.set_wakeup_fd(wake_w)
        try:
            self.sel.register(self._listener, selectors.EVENT_READ, "listen")
            self.sel.register(wake_r, selectors.EVENT_READ, "wake")
            info = {"socket": str(self.path), "pid": os.getpid(), **self.served.status()}
            if self.metrics_url is not None:
                info["metrics"] = self.metrics_url
            if self.metrics is not None:
                self.metrics.loaded(self.status())
            if on_ready:
                on_ready(info)
            startup = self.served.startup
            more = {} if startup is None else {"startup": startup.done(self.served.export)}
            self.on_event({"event": "ready", **info, **more})
            if self.notifier is not None:
                self.notifier.send("READY=1", status_line(self._serving_line()))
            while not self._stop:
                for key, events in self.sel.select(self._timeout()):
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        with contextlib.suppress(OSError):
                            os.read(wake_r, 512)
                    else:
                        self._serve_conn(key.data, events)
                self._expire()
            name = signal.Signals(self._signal).name if self._signal else "?"
            self.on_event({"event": "stopping", "signal": name, "clients": self._n_clients()})
            if self.notifier is not None:
                self.notifier.send("STOPPING=1", status_line(f"stopping ({name})"))
        finally:
            for conn in list(self.conns.values()):
                self._drop(conn, None)
            self.sel.close()
            signal.set_wakeup_fd(old_wakeup)
            for s, h in old.items():
                signal.signal(s, h)
            os.close(wake_r)
            os.close(wake_w)
            self._listener.close()
            if pointer is not None:
                P.remove_pointer(*pointer)
            _unlink_if_ours(self.path, ino)

    def _advertise(self) -> tuple[Path, int] | None:
        """Write the pointer ``mpack status`` follows to a ``--socket`` daemon (Note [pointers to
        --socket daemons] in protocol.py); its path and inode, or None: none needed, or it failed
        (logged as ``no-pointer``; the daemon serves all the same, ``status --socket`` finds it).
        """
        if not self.advertise:
            return None
        plan, dev = self.served.plan, self.served.device
        doc = {
            "socket": str(self.path),
            "pid": os.getpid(),
            "digest": plan.digest,
            "rank": plan.rank,
            "pp_rank": plan.pp_rank,
            "device": dev.key,
        }
        try:
            pointer = _pointer_path(plan.digest, plan.rank, dev.key, self.path, plan.pp_rank)
            return None if pointer is None else (pointer, P.write_pointer(pointer, doc))
        except (OSError, DaemonError) as e:
            self.on_event({"event": "no-pointer", "error": str(e)[:300]})
            return None

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._stop = True
        if self._signal is None:
            self._signal = signum

    def _serving_line(self) -> str:
        """What ``systemctl status`` shows while the daemon serves."""
        s = self.served
        return (
            f"serving rank {s.plan.rank}{Stage.label(s.plan.stage)} of {s.plan.sidecar} "
            f"on {s.device.label} "
            f"({s.export.size} bytes, loaded in {s.export.stats.seconds:.2f} s)"
        )

    def on_event(self, event: dict[str, Any]) -> None:
        """Count ``event`` (metrics) and hand it to the log, stamped with its time; never waits
        for the log (Note [logging never blocks serving])."""
        event.setdefault("ts", time.time())
        if self.metrics is not None:
            self.metrics.observe(event)
        if self._event_log is not None:
            self._event_log(event)

    # --- connections ----------------------------------------------------------------------

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and friends: keep serving the ones we have
                self.on_event({"event": "accept-failed", "error": e.strerror})
                return
            sock.setblocking(False)
            try:
                pid, uid, _ = P.peer_credentials(sock)
            except OSError:
                sock.close()
                continue
            if uid != self.owner_uid:
                self.on_event({"event": "refused", "pid": pid, "uid": uid})
                _send_and_close(
                    sock, P.REFUSED, f"uid {uid} may not use a daemon of uid {self.owner_uid}"
                )
                continue
            if len(self.conns) >= P.MAX_CONNECTIONS:
                self.on_event({"event": "busy", "pid": pid})
                _send_and_close(sock, P.BUSY, f"daemon has {len(self.conns)} connections open")
                continue
            conn = _Conn(sock, pid, time.monotonic() + self.hello_timeout)
            self.conns[sock.fileno()] = conn
            self.sel.register(sock, selectors.EVENT_READ, conn)

    def _serve_conn(self, conn: _Conn, events: int) -> None:
        try:
            if events & selectors.EVENT_WRITE:
                self._flush(conn)
            if events & selectors.EVENT_READ and conn.sock.fileno() >= 0:
                self._on_readable(conn)
        except Exception as e:  # noqa: BLE001 - a bug must cost one connection, not the daemon
            self.on_event({"event": "internal-error", "pid": conn.pid, "error": repr(e)[:300]})
            self._drop(conn, None)

    def _on_readable(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(65536)  # plain recv: fds a peer sends us are discarded
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn, None)
            return
        if not data:
            self._drop(conn, None)
            return
        if conn.answered:  # a lease (or a connection awaiting its reply) must stay quiet
            self._drop(conn, "sent data after its request")
            return
        conn.inbuf += data
        try:
            msg = P.take_message(conn.inbuf, P.MAX_REQUEST_BYTES)
            if msg is None:
                return
            P.check_request(msg)
        except P.WireError as e:
            self._reply_error(conn, e.code, str(e))
            return
        conn.answered = True
        if msg["type"] == P.STATUS:
            conn.close_after_send = True  # before _send: it may flush the whole reply at once
            self._send(conn, {"type": P.STATUS, **self.status()})
        else:
            self._attach(conn, msg)

    def _attach(self, conn: _Conn, msg: dict[str, Any]) -> None:
        s = self.served
        want = (s.plan.digest, s.plan.rank, s.device.key)
        got = (msg["digest"], msg["rank"], msg["device"])
        if got != want:
            self._reply_error(
                conn,
                P.MISMATCH,
                f"this daemon serves digest {want[0][:16]}... rank {want[1]} on {want[2]}; "
                f"asked for digest {got[0][:16]}... rank {got[1]} on {got[2][:64]}",
            )
            return
        conn.lease_pending = True
        self._send(conn, self._attached_reply(), [s.export.fd])

    def _attached_reply(self) -> bytes:
        """The ``attached`` frame: the same for every client, so encoded once."""
        if self._attached is None:
            s = self.served
            self._attached = P.encode(
                {
                    "type": P.ATTACHED,
                    "digest": s.plan.digest,
                    "rank": s.plan.rank,
                    "device": s.device.key,
                    "backend": s.export.backend,
                    "size": s.export.size,
                    "data_size": s.plan.size,
                    "tensors": tensors_to_wire(s.plan.tensors),
                    **(
                        {"stage": P.stage_to_wire(s.plan.stage)} if s.plan.stage is not None else {}
                    ),
                }
            )
        return self._attached

    def _reply_error(self, conn: _Conn, code: str, message: str) -> None:
        self.on_event({"event": "bad-request", "pid": conn.pid, "code": code, "message": message})
        conn.answered = True
        conn.close_after_send = True
        self._send(conn, P.error_message(code, message))

    def _send(self, conn: _Conn, msg: dict[str, Any] | bytes, fds: list[int] | None = None) -> None:
        conn.out = memoryview(msg if isinstance(msg, bytes) else P.encode(msg))
        conn.out_fds = list(fds or [])
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        try:
            while conn.out:
                if conn.out_fds:  # the fds ride on the first byte of the reply
                    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array("i", conn.out_fds))]
                    n = conn.sock.sendmsg([conn.out], anc)
                    conn.out_fds = []
                else:
                    n = conn.sock.send(conn.out)
                conn.out = conn.out[n:]
        except (BlockingIOError, InterruptedError):
            self.sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
            return
        except OSError:
            self._drop(conn, None)
            return
        if conn.close_after_send:
            self._drop(conn, None)
            return
        self.sel.modify(conn.sock, selectors.EVENT_READ, conn)
        if conn.lease_pending:
            conn.lease_pending = False
            conn.lease_since = time.time()
            conn.deadline = None
            self.on_event({"event": "attached", "pid": conn.pid, "clients": self._n_clients()})

    def _drop(self, conn: _Conn, reason: str | None) -> None:
        fd = conn.sock.fileno()
        if fd < 0:
            return
        self.sel.unregister(conn.sock)
        del self.conns[fd]
        conn.sock.close()
        if conn.lease_since is not None:
            self.on_event({"event": "detached", "pid": conn.pid, "clients": self._n_clients()})
        elif reason:
            self.on_event({"event": "dropped", "pid": conn.pid, "reason": reason})

    def _timeout(self) -> float:
        deadlines = [c.deadline for c in self.conns.values() if c.deadline is not None]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else 3600.0

    def _expire(self) -> None:
        now = time.monotonic()
        for conn in list(self.conns.values()):
            if conn.deadline is not None and conn.deadline <= now:
                why = f"no complete request and reply within {self.hello_timeout:g} s"
                if not conn.answered:
                    with contextlib.suppress(OSError):
                        conn.sock.send(P.encode(P.error_message(P.TIMEOUT, why)))
                self._drop(conn, why)

    def _n_clients(self) -> int:
        return sum(c.lease_since is not None for c in self.conns.values())

    def status(self) -> dict[str, Any]:
        now = time.time()
        clients = [
            {"pid": c.pid, "attached_s": round(now - c.lease_since, 3)}
            for c in self.conns.values()
            if c.lease_since is not None
        ]
        return {
            **self.served.status(),
            "socket": str(self.path),
            "pid": os.getpid(),
            "uptime_s": round(now - self.served.started, 3),
            "mpack_version": __version__,
            "protocol": P.PROTOCOL_VERSION,
            "clients": sorted(clients, key=lambda c: c["pid"]),
        }


def _send_and_close(sock: socket.socket, code: str, message: str) -> None:
    with contextlib.suppress(OSError):
        sock.send(P.encode(P.error_message(code, message)))
    sock.close()


# --- socket file and lock ----------------------------------------------------------------------


def _bind(path: Path) -> socket.socket:
    """A listening, non-blocking socket at ``path`` with mode 0600 (replacing a stale one).

    Only a stale *socket of ours* is removed, and the new one is created 0600 by the umask, never
    by a ``chmod`` of the path (which would follow a symlink planted in its place); ``bind``
    itself never follows a symlink. It is checked afterwards with ``lstat``.
    """
    P.check_socket_path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        _check_ours(path, st)
        os.unlink(path)  # stale: Note [one daemon per (sidecar, rank, device)]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    except OSError as e:
        sock.close()
        raise DaemonError(f"cannot listen on {path}: {e.strerror}") from None
    finally:
        os.umask(old)
    try:
        _check_ours(path, os.lstat(path), mode=0o600)
    except BaseException:
        sock.close()
        raise
    sock.listen(128)
    sock.setblocking(False)
    return sock


def _check_ours(path: Path, st: os.stat_result, mode: int | None = None) -> None:
    """``st``, an ``lstat`` of ``path``, must be a socket of ours (with exactly ``mode``)."""
    me = os.geteuid()
    kind = fsutil.kind_of(st.st_mode)
    if kind != "a socket" or st.st_uid != me or (mode is not None and st.st_mode & 0o777 != mode):
        raise DaemonError(
            f"{path} is {kind} of uid {st.st_uid} with mode {stat.filemode(st.st_mode)}; the "
            f"daemon only replaces a stale socket of its own (uid {me}), so it refuses to use or "
            "remove it",
            hint="remove it if you trust it, or pick another --socket in a directory only you "
            "can write",
        )


def _unlink_if_ours(path: Path, ino: int) -> None:
    with contextlib.suppress(OSError):
        if os.lstat(path).st_ino == ino:
            os.unlink(path)


def _lock_of(path: Path) -> Path:
    return path.with_name(path.name + P.LOCK_SUFFIX)


@contextlib.contextmanager
def _locked(
    path: Path,
    served: tuple[str, int, str, int | None],
    what: str,
    on_event: Callback | None,
) -> Iterator[None]:
    """The exclusive locks of Note [one daemon per (sidecar, rank, device)]: the one of what is
    served (``served``: digest, rank, device key, pipeline stage index or None: Note [the daemon
    of a stage] in protocol.py), the lock of the default socket in the
    runtime directory, and for a ``--socket`` daemon also ``<socket>.lock``; each taken through
    ``fsutil.LockFile``: no symlink followed, ours and 0600 or refused, and the pid it reports
    read only from such a file. A ``--socket`` daemon serves where the runtime directory cannot
    be used (as it does without its pointer), with its own lock alone: ``on_event`` gets a
    ``no-rank-lock`` event saying why."""
    try:
        digest, rank, key, pp_rank = served
        default: Path | None = P.socket_path(digest, rank, key, create=True, pp_rank=pp_rank)
    except (OSError, DaemonError) as e:  # the default socket's daemon failed on it already
        if on_event is not None:
            on_event({"event": "no-rank-lock", "error": str(e)[:300]})
        default = None
    with contextlib.ExitStack() as stack:
        for sock in dict.fromkeys(p for p in (default, path) if p is not None):
            try:
                stack.enter_context(fsutil.LockFile(_lock_of(sock)))
            except fsutil.LockHeld as held:
                at = _socket_of(held.pid, served, sock) if sock == default else path
                kill = f"kill {held.pid}" if held.pid != "?" else "kill it"
                raise DaemonError(
                    f"another daemon (pid {held.pid}{f', at {at}' if at else ''}) already serves "
                    f"{what}",
                    hint=f"attach to it, check it with `mpack status`, or stop it ({kill})",
                ) from None
        yield


def _socket_of(pid: str, served: tuple[str, int, str, int | None], default: Path) -> Path | None:
    """Where the daemon ``pid`` holding the lock of ``served`` listens: the socket its pointer
    names (a ``--socket`` daemon: Note [pointers to --socket daemons] in protocol.py), else the
    default socket if there is one; None if neither says."""
    stem = default.name[: -len(P.SOCKET_SUFFIX)]
    for ptr in sorted(default.parent.glob(f"{stem}-at-*{P.POINTER_SUFFIX}")):
        with contextlib.suppress(ValueError):
            doc = P.read_pointer(ptr)
            if str(doc["pid"]) == pid:
                return Path(doc["socket"])
    return default if os.path.lexists(default) else None


# --- entry point -------------------------------------------------------------------------------


def serve(
    sidecar: str | os.PathLike,
    *,
    rank: int = 0,
    device: str = "cpu",
    socket_path: str | os.PathLike | None = None,
    on_ready: Callback | None = None,
    on_event: Callback | None = None,
    progress_every: float = PROGRESS_EVERY_S,
    metrics_port: int | None = None,
    metrics_addr: str = "127.0.0.1",
    stage: Stage | None = None,
    verify: str = "auto",
) -> None:
    """Serve one rank of ``sidecar`` until SIGTERM/SIGINT/SIGHUP (the ``mpack serve`` command):
    only what pipeline ``stage`` of it builds, if given (Note [the daemon of a stage] in
    protocol.py; a stage of a one-stage split is the whole rank).

    Order: manifest and headers checked (format version, rank; a layout that fits in a reply
    a client takes) -> socket path -> lock -> (``metrics_port`` given) the metrics endpoint ->
    fill while verifying checksums -> listen -> (``socket_path`` given) a pointer for ``mpack
    status`` in the runtime directory -> ``on_ready`` -> serve. Any failure before listening
    raises (nothing is served and no socket is left behind). The pointer is best effort (Note
    [pointers to --socket daemons] in protocol.py): an ``on_event`` ``no-pointer`` says why
    there is none; a clean stop removes it with the socket.

    ``on_event`` gets every event of Note [the daemon's events], ``progress`` ones every
    ``progress_every`` seconds of the load. With ``$NOTIFY_SOCKET`` set (systemd's
    ``Type=notify``), the service manager gets ``STATUS=`` lines while loading, ``READY=1``
    once the socket listens and ``STOPPING=1`` on a stop signal (runtime/sdnotify.py; a failed
    send is a ``notify-failed`` event). ``metrics_port`` (0: any free port) serves Prometheus
    metrics at ``http://metrics_addr:PORT/metrics`` (runtime/metrics.py); the ready event and
    READY line name it as ``metrics``. ``verify`` (:data:`VERIFY_MODES`): ``auto`` hashes only
    the files an earlier start did not verify as they are now, ``always`` hashes every file
    (Note [verified files] in mpack/cache.py); either way the files hashed are recorded. The
    ready event's ``startup`` says where the start went (:class:`Startup`).

    Raises:
        FormatVersionError, CorruptFileError, VerificationError: an unusable sidecar.
        UsageError: a bad rank or device (a CUDA device this machine does not have), a bad
            ``metrics_port`` or ``metrics_addr``.
        InputError: a ``--socket`` directory others can write, or a lock file that is a symlink,
            not ours or not mode 0600 (Note [trust model for the socket directory]).
        DaemonError: another daemon serves the same thing, the socket cannot be made (a
            file in its place that is not a socket of ours), the rank has more tensors than
            a client takes (``protocol.MAX_TENSORS``), or the metrics port cannot be bound.
    """
    startup = Startup()
    check_verify(verify)
    _prestart(device)  # Note [early device start] in cuda_vmm.py
    if metrics_port is not None:
        from mpack.runtime.metrics import check_port

        check_port(metrics_port)
    plan = plan_rank(sidecar, rank, stage)
    if plan.size == 0:
        raise UsageError(
            f"{sidecar}: rank {rank} {plan.stage} holds no tensors: there is nothing to serve",
            hint="serve the stages that have layers (or the whole rank: leave out --pp-rank)",
        )
    _check_reply_fits(plan)
    pp_rank = plan.pp_rank
    startup.mark("plan_s")
    dev = P.resolve_device(device)
    startup.mark("device_s")
    if socket_path is None:
        path = P.socket_path(plan.digest, rank, dev.key, create=True, pp_rank=pp_rank)
    else:
        path = Path(socket_path).absolute()
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fsutil.check_safe_dir(path.parent, purpose=f"the daemon's socket {path.name}")
    P.check_socket_path(path)
    _raise_fd_limit()
    emit = _stamped(on_event)
    notifier = Notifier(lambda why: emit({"event": "notify-failed", "error": why[:300]}))
    of = Stage.label(plan.stage)
    what = f"{sidecar} rank {rank}{of} on {dev.label}"
    with contextlib.ExitStack() as stack:
        stack.enter_context(_locked(path, (plan.digest, rank, dev.key, pp_rank), what, emit))
        metrics = None
        if metrics_port is not None:
            from mpack.runtime.metrics import ServeMetrics

            metrics = ServeMetrics()
            metrics.start(metrics_port, metrics_addr)
            stack.callback(metrics.close)
        loading = {
            "event": "loading",
            "sidecar": str(plan.sidecar.resolve()),
            "rank": rank,
            "tp_size": plan.tp_size,
            **P.stage_fields(plan.stage),
            "device": dev.label,
            "bytes": plan.size,
            "files": len(plan.regions),
        }
        emit(loading)
        notifier.send(status_line(f"loading rank {rank}{of} of {plan.sidecar} on {dev.label}"))
        from mpack.cache import VerifiedFiles

        verified = VerifiedFiles(plan.digest, trust=verify == "auto")
        startup.mark("lock_s")
        with _LoadProgress(plan.size, progress_every, emit, notifier) as progress:
            if dev.kind == "cpu":
                from mpack.runtime.memfd import HostExport

                memfd = f"{plan.digest[:16]}-r{rank}" + ("" if pp_rank is None else f"-p{pp_rank}")
                export: Any = HostExport.create(plan, memfd, progress, verified)
            else:
                from mpack.runtime.cuda_vmm import DeviceExport

                assert dev.ordinal is not None
                export = DeviceExport.create(plan, dev.ordinal, progress, verified)
        startup.mark("export_s")
        startup.verify = verify
        stack.callback(export.close)
        daemon = Daemon(
            Served(plan, dev, export, startup=startup),
            path,
            on_event=on_event,
            advertise=socket_path is not None,
            metrics=metrics,
            notifier=notifier,
        )
        daemon.run(on_ready)


#: ``serve(verify=...)``: ``auto`` trusts the record of files verified by an earlier start (Note
#: [verified files] in mpack/cache.py), ``always`` hashes every file.
VERIFY_MODES = ("auto", "always")


def check_verify(verify: str) -> None:
    """Refuse a ``verify`` that is not one of :data:`VERIFY_MODES` (``UsageError``, in the
    caller's words: Note [API wording] in mpack/errors.py)."""
    if verify not in VERIFY_MODES:
        raise UsageError(
            f"{arg('verify', verify)}: not one of {', '.join(VERIFY_MODES)}",
            hint=f"{arg('verify', 'auto')} (the default: hash what an earlier start did not "
            f"verify) or {arg('verify', 'always')}",
        )


def _prestart(device: str) -> None:
    """For a CUDA device, start the driver, its context and the fill's ring on a thread now
    (Note [early device start] in cuda_vmm.py); a bad spec is left for ``resolve_device``."""
    try:
        spec = P.DeviceSpec.parse(device)
    except UsageError:
        return
    if spec.kind == "cuda" and spec.ordinal is not None:
        from mpack.runtime import cuda_vmm

        cuda_vmm.prestart(spec.ordinal)


def _process_age() -> float | None:
    """Seconds since this process was started (Linux ``/proc``, 10 ms ticks); None elsewhere."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rpartition(")")[2].split()
        start = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime, since boot
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class Startup:
    """Where a daemon's start went, for the ready event's ``startup`` field (seconds, 4 places):
    ``imports_s`` (process start to ``serve``: the interpreter, imports, the CLI; null where the
    process's start time is unknown), ``plan_s`` (manifest, headers, plan), ``device_s`` (the
    device checked: for CUDA the driver's start, or the wait for :func:`_prestart`'s thread),
    ``lock_s`` (socket path, locks, metrics endpoint), ``alloc_s`` (the allocation mapped and,
    for CUDA, the ring taken), ``fill_s`` (the verified fill), ``seal_s`` (sealed or unmapped and
    exported), ``listen_s`` (up to READY), ``ready_s`` (process start to READY); ``verify`` (the
    mode), ``hashed_bytes`` and ``trusted_bytes`` (read without hashing: Note [verified
    files] in mpack/cache.py)."""

    def __init__(self) -> None:
        self.imports_s = _process_age()
        self.verify = "auto"
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        """The time since the last mark is phase ``name``'s."""
        now = time.perf_counter()
        self.phases[name], self._last = now - self._last, now

    def done(self, export: Any) -> dict[str, Any]:
        """The ``startup`` field, ``export`` the filled allocation (its ``stats``, ``alloc_s``)."""
        self.mark("listen_s")
        p = dict(self.phases)
        stats = export.stats
        alloc = getattr(export, "alloc_s", 0.0)
        fill = stats.seconds
        p["alloc_s"], p["fill_s"] = alloc, fill
        p["seal_s"] = max(0.0, p.pop("export_s", 0.0) - alloc - fill)
        age = _process_age()
        out: dict[str, Any] = {"imports_s": self.imports_s, **p, "ready_s": age}
        out = {k: None if v is None else round(v, 4) for k, v in out.items()}
        return {
            **out,
            "verify": self.verify,
            "hashed_bytes": stats.hashed,
            "trusted_bytes": stats.trusted,
        }


def _stamped(on_event: Callback | None) -> Callback:
    """``on_event`` for the events of a daemon not yet serving (no log thread yet): each
    stamped with its time, as ``Daemon.on_event`` does; a no-op without a callback."""

    def emit(event: dict[str, Any]) -> None:
        event.setdefault("ts", time.time())
        if on_event is not None:
            on_event(event)

    return emit


class _LoadProgress(Periodic):
    """The load's ``progress`` events: the fill calls it with each piece's byte count (from its
    worker threads), and a thread of its own reports the count after ``FIRST_PROGRESS_S``, then
    every ``every`` seconds, to the log and as a ``STATUS=`` line. A reader that stalls the log
    stalls this thread, never the fill; it is not waited for past ``LOG_DRAIN_S``."""

    def __init__(self, total: int, every: float, emit: Callback, notifier: Notifier) -> None:
        super().__init__(every, FIRST_PROGRESS_S, name="mpack-serve-progress", join_s=LOG_DRAIN_S)
        self.total, self.emit, self.notifier = total, emit, notifier
        self.done = 0
        self._lock = threading.Lock()
        self._t0 = time.monotonic()

    def __call__(self, n: int) -> None:
        with self._lock:
            self.done += n

    def event(self) -> dict[str, Any]:
        with self._lock:
            done = self.done
        elapsed = time.monotonic() - self._t0
        return {
            "event": "progress",
            "bytes": done,
            "total": self.total,
            "percent": round(100 * done / max(self.total, 1), 1),
            "elapsed_s": round(elapsed, 1),
            "mb_per_s": round(done / 1e6 / elapsed, 1) if elapsed > 0 else 0.0,
        }

    def tick(self) -> None:
        ev = self.event()
        self.emit(ev)
        self.notifier.send(status_line(f"loading: {ev['percent']:.0f}% of {self.total} bytes"))


def _check_reply_fits(plan: Allocation) -> None:
    """Refuse, before the fill, a rank whose ``attached`` reply no client would take
    (``MAX_TENSORS``, ``MAX_REPLY_BYTES``; the other fields add well under 1 KiB)."""
    n = len(plan.tensors)
    wire = len(P.encode({"tensors": tensors_to_wire(plan.tensors)})) + 1024
    if n > P.MAX_TENSORS or wire > P.MAX_REPLY_BYTES:
        raise DaemonError(
            f"{plan.sidecar}: rank {plan.rank} has {n} tensors ({wire} bytes on the wire); a "
            f"client accepts at most {P.MAX_TENSORS} tensors in {P.MAX_REPLY_BYTES} bytes",
            hint="load it privately with mpack.runtime.load()",
        )


def _pointer_path(
    digest: str, rank: int, device_key: str, path: Path, pp_rank: int | None = None
) -> Path | None:
    """Where a ``--socket`` daemon's pointer goes: the per-user runtime directory (Note
    [pointers to --socket daemons] in protocol.py); None where ``status`` finds the socket
    itself (a ``*.sock`` in that directory).

    Raises:
        DaemonError, OSError: the runtime directory cannot be made or is not private.
    """
    rdir = P.runtime_dir(create=True)
    if path.name.endswith(P.SOCKET_SUFFIX) and path.parent.resolve() == rdir.resolve():
        return None
    return rdir / P.pointer_name(digest, rank, device_key, path, pp_rank)


def _raise_fd_limit() -> None:
    """Each attached client holds one connection: allow as many as the hard limit does."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
