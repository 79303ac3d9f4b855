"""``mpack serve --metrics-port PORT``: the daemon's Prometheus endpoint (``prometheus_client``).

Off by default. When on, an HTTP server on a thread of its own answers ``GET /metrics`` from
before the load (``mpack_ready`` is 0 until the daemon serves) until the daemon exits. Every
metric is a fact of this one daemon (one sidecar rank on one device); ``mpack_serve_info``
carries what it serves as labels, to join on:

* ``mpack_serve_info`` (info): sidecar, digest, rank, tp_size, device, backend, engine,
  engine_version, mpack_version;
* ``mpack_ready`` (gauge): 1 once the rank is loaded, verified, and the socket listens;
* ``mpack_served_bytes`` (gauge): bytes of the rank's allocation the daemon holds and hands out;
* ``mpack_load_seconds`` (gauge): the verified fill (the ``load_s`` of the READY line);
* ``mpack_attached_clients`` (gauge): clients holding a lease now;
* ``mpack_attaches_total`` (counter): leases handed out;
* ``mpack_attach_failures_total`` (counter): connections refused or failed before a lease, by
  ``reason``;

plus ``prometheus_client``'s own ``process_*`` (memory, CPU, open fds) and ``python_*`` series.
A ``reason`` is the protocol's error code (``mismatch``, ``bad-message``, ``too-large``,
``version``, ``unknown-type``, ``refused``: another uid, ``busy``), ``timeout`` (no request
within the deadline, or a reply not taken), ``dropped`` (data sent after the request), or
``internal-error``.

The counters are fed from the serving thread (:meth:`ServeMetrics.observe`, called for every
daemon event before the event goes to the log queue, so a log that drops lines never loses a
count); ``prometheus_client``'s updates take a lock for a few instructions and never block on
the HTTP side. ``prometheus_client`` is imported only when the endpoint is asked for.
"""

from __future__ import annotations

import errno
from typing import Any

from mpack.errors import DaemonError, UsageError

#: The connection failures counted from the start (every reason is shown as 0 until it happens).
REASONS = (
    "mismatch",
    "bad-message",
    "too-large",
    "version",
    "unknown-type",
    "refused",
    "busy",
    "timeout",
    "dropped",
    "internal-error",
)
#: Events that end a connection without a lease and count under their own name as the reason
#: (a ``bad-request`` counts under its protocol error code).
_FAILURES = ("refused", "busy")


def check_port(port: int) -> int:
    """``port`` as ``--metrics-port`` takes it: 0 (any free port; the READY line names it) to
    65535.

    Raises:
        UsageError: a port outside that range.
    """
    if not 0 <= port <= 65535:
        raise UsageError(
            f"--metrics-port {port}: not a TCP port", hint="give 1..65535, or 0 for any free port"
        )
    return port


class ServeMetrics:
    """The metrics of one daemon in a registry of their own, and the HTTP server that shows
    them (:meth:`start`)."""

    def __init__(self) -> None:
        from prometheus_client import (
            CollectorRegistry,
            Counter,
            Gauge,
            Info,
            disable_created_metrics,
            gc_collector,
            platform_collector,
            process_collector,
        )

        disable_created_metrics()  # no ``*_created`` twin of each counter: this process's own

        self.registry = reg = CollectorRegistry(auto_describe=True)
        process_collector.ProcessCollector(registry=reg)
        platform_collector.PlatformCollector(registry=reg)
        gc_collector.GCCollector(registry=reg)
        self.info = Info("mpack_serve", "What this mpack daemon serves", registry=reg)
        self.ready = Gauge("mpack_ready", "1 once the rank is loaded and served", registry=reg)
        self.served_bytes = Gauge(
            "mpack_served_bytes", "Bytes of the rank's allocation held and handed out", registry=reg
        )
        self.load_seconds = Gauge(
            "mpack_load_seconds", "Seconds the verified fill of the rank took", registry=reg
        )
        self.clients = Gauge("mpack_attached_clients", "Clients holding a lease now", registry=reg)
        self.attaches = Counter("mpack_attaches", "Leases handed out", registry=reg)
        self.failures = Counter(
            "mpack_attach_failures",
            "Connections refused or failed before a lease",
            ["reason"],
            registry=reg,
        )
        for reason in REASONS:
            self.failures.labels(reason=reason)
        self._server: Any = None
        self.url: str | None = None

    def start(self, port: int, addr: str = "127.0.0.1") -> str:
        """Listen on ``addr:port`` (port 0: any free one); the URL of the endpoint.

        Raises:
            DaemonError: the address cannot be bound (in use, not an address of this machine).
        """
        from prometheus_client import start_http_server

        try:
            server, _ = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as e:
            why = "in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
            raise DaemonError(
                f"cannot serve metrics on {addr}:{port}: {why}",
                hint="pick another --metrics-port (0 for any free one) or --metrics-addr",
            ) from None
        except UnicodeError as e:  # socket.getaddrinfo on a malformed host name
            raise UsageError(f"--metrics-addr {addr!r}: {e}") from None
        self._server = server
        host, real_port = server.server_address[:2]
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{real_port}/metrics"
        return self.url

    def loaded(self, status: dict[str, Any]) -> None:
        """The rank is loaded and about to be served: ``status`` is ``Served.status()``."""
        keys = ("sidecar", "digest", "rank", "tp_size", "device", "backend", "engine")
        self.info.info(
            {
                **{k: str(status.get(k, "")) for k in keys},
                "engine_version": str(status.get("engine_version", "")),
                "mpack_version": str(status.get("mpack_version", "")),
            }
        )
        self.served_bytes.set(status["bytes"])
        self.load_seconds.set(status["load_s"])

    def observe(self, event: dict[str, Any]) -> None:
        """Count one daemon event (any thread; never blocks)."""
        kind = event.get("event")
        if kind == "ready":
            self.ready.set(1)
        elif kind == "stopping":
            self.ready.set(0)
        elif kind == "attached":
            self.attaches.inc()
            self.clients.set(event.get("clients", 0))
        elif kind == "detached":
            self.clients.set(event.get("clients", 0))
        elif kind == "bad-request":
            self.failures.labels(reason=str(event.get("code", "bad-message"))[:32]).inc()
        elif kind == "dropped":  # the deadline passed, or it spoke out of turn
            late = "within" in str(event.get("reason", ""))
            self.failures.labels(reason="timeout" if late else "dropped").inc()
        elif kind == "internal-error":
            self.failures.labels(reason="internal-error").inc()
        elif kind in _FAILURES:
            self.failures.labels(reason=kind).inc()

    def close(self) -> None:
        """Stop answering (the port is free again)."""
        if self._server is not None:
            server, self._server = self._server, None
            server.shutdown()
            server.server_close()


__all__ = ["REASONS", "ServeMetrics", "check_port"]
