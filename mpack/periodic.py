"""A thread that reports now and then while a ``with`` block runs: the progress lines that
``convert``, ``push`` and ``verify`` write to a log (mpack/ui.py), and the load progress of
``mpack serve`` (runtime/daemon.py).

:class:`Periodic` calls its :meth:`~Periodic.tick` once ``first`` seconds have passed (at most
``every``: a run that ends sooner says nothing between its start and its end), then every
``every`` seconds, on a daemon thread of its own, until the block ends. The work that reports
never waits for it: a tick that stalls (a reader that stopped reading the log) stalls only this
thread, and the block's end waits for it at most ``join_s`` seconds (``None``: until it ends).
"""

from __future__ import annotations

import threading
from typing import TypeVar

_P = TypeVar("_P", bound="Periodic")


class Periodic:
    """Subclass it and define :meth:`tick`; use it as a context manager."""

    def __init__(
        self, every: float, first: float, *, name: str, join_s: float | None = None
    ) -> None:
        self.every, self.first, self.join_s = every, first, join_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def tick(self) -> None:
        """Report once (called on the thread of this object)."""
        raise NotImplementedError

    def _run(self) -> None:
        wait = min(self.every, self.first)
        while not self._stop.wait(wait):
            self.tick()
            wait = self.every

    def __enter__(self: _P) -> _P:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(self.join_s)


__all__ = ["Periodic"]
