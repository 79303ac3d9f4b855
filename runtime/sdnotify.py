"""Tell a service manager how ``mpack serve`` is doing: systemd's ``sd_notify`` protocol.

Under a unit with ``Type=notify`` (docs/RUNTIME.md, "systemd"), systemd sets ``$NOTIFY_SOCKET``
and waits for ``READY=1`` before it starts the units ordered after this one; ``STATUS=`` is the
line ``systemctl status`` shows. The daemon sends ``STATUS=`` lines while it loads,
``READY=1`` once its socket listens (the load verified), ``STOPPING=1`` when a stop signal
arrives. Without ``$NOTIFY_SOCKET`` every call is a no-op.

Note [sd_notify without a library]: the protocol is one datagram of ``KEY=VALUE`` lines sent to
the ``AF_UNIX`` socket named by ``$NOTIFY_SOCKET`` (a path, or ``@name`` for a Linux abstract
socket); sd_notify(3), "Notes", states it is a stable interface that may be reimplemented, and
shows a reference implementation of about 40 lines, which this follows. The libraries were
weighed: ``sdnotify`` (PyPI, last release 0.3.2 in 2017) drops every error unless asked not to,
and ``systemd-python`` links libsystemd, a C build for one ``sendto``. The standard library's
``socket`` does it in a few lines, with the errors kept: a failed send is reported to the caller
(the daemon logs it as ``notify-failed`` and serves on: a manager that misses ``READY=1`` times
the unit out itself, which is the visible failure). Other address families systemd may name
(``vsock:``) are refused with a reason, not guessed at.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping

ENV = "NOTIFY_SOCKET"
#: sd_notify(3): a datagram of at most this many bytes is always accepted.
MAX_MESSAGE_BYTES = 4096


def address(value: str) -> str:
    """The ``AF_UNIX`` address a ``$NOTIFY_SOCKET`` value names: an absolute path as it is,
    ``@name`` as the abstract socket ``\\0name``.

    Raises:
        ValueError: anything else (empty, a relative path, ``vsock:...``), with the value named.
    """
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    raise ValueError(
        f"${ENV}={value!r} is neither an absolute path nor an abstract socket (@name); "
        "mpack speaks sd_notify over AF_UNIX only"
    )


def notify(state: str, *, environ: Mapping[str, str] | None = None) -> bool:
    """Send ``state`` (``"READY=1\\nSTATUS=..."``) to ``$NOTIFY_SOCKET``; whether it was sent
    (False: the variable is not set, so nobody listens).

    Raises:
        ValueError: a ``$NOTIFY_SOCKET`` that is no ``AF_UNIX`` address (:func:`address`).
        OSError: the send failed (no such socket, permission denied, a message too long).
    """
    value = (os.environ if environ is None else environ).get(ENV)
    if not value:
        return False
    data = state.encode("utf-8", "backslashreplace")[:MAX_MESSAGE_BYTES]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.sendto(data, address(value))
    return True


def status_line(text: str) -> str:
    """``STATUS=text`` on one line (a newline would start another ``KEY=``)."""
    return "STATUS=" + " ".join(text.split())


class Notifier:
    """:func:`notify` for a daemon: ``$NOTIFY_SOCKET`` read once, and a failure reported to
    ``on_error`` (once per distinct message) instead of raised: Note [sd_notify without a
    library]."""

    def __init__(
        self,
        on_error: Callable[[str], None] | None = None,
        *,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        self.environ = {ENV: env[ENV]} if env.get(ENV) else {}
        self._on_error = on_error
        self._reported: set[str] = set()

    @property
    def enabled(self) -> bool:
        return bool(self.environ)

    def send(self, *lines: str) -> bool:
        """Send ``lines`` (``"READY=1"``, ``status_line(...)``) as one datagram; whether it went."""
        if not self.environ:
            return False
        try:
            return notify("\n".join(lines), environ=self.environ)
        except (OSError, ValueError) as e:
            why = f"{self.environ[ENV]}: {e.strerror or e}" if isinstance(e, OSError) else str(e)
            if why not in self._reported and self._on_error is not None:
                self._reported.add(why)
                self._on_error(why)
            return False


__all__ = ["ENV", "Notifier", "address", "notify", "status_line"]
