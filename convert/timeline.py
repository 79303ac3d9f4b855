"""Where a conversion spends its time: spans per lane (one lane per thread role), cheap to record.

A span is ``(lane, what, start, end)`` in seconds from the start of the run. The stages record one
span per piece of work (a unit read, a piece written, a file hashed); neighbouring spans of the
same lane and kind closer than ``MERGE_GAP_S`` are merged, so a 9 GB conversion keeps a few
hundred spans, enough to see which stage waited for which (``scripts/bench_convert.py`` plots
them). The seconds spent in each ``(lane, what)`` are summed exactly as they are recorded, before
any merging (:meth:`Timeline.total`): they are the run's phase and busy times, so a conversion
measures its time in this one place.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

MERGE_GAP_S = 0.002


class Timeline:
    def __init__(self, t0: float | None = None) -> None:
        self.t0 = time.perf_counter() if t0 is None else t0
        self._spans: list[list] = []
        self._last: dict[tuple[str, str], list] = {}
        self._seconds: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def add(self, lane: str, what: str, start: float, end: float) -> float:
        """Record a span given in ``time.perf_counter()`` seconds; return ``end``."""
        a, b = start - self.t0, end - self.t0
        with self._lock:
            key = (lane, what)
            self._seconds[key] = self._seconds.get(key, 0.0) + (end - start)
            last = self._last.get(key)
            if last is not None and a - last[3] < MERGE_GAP_S:
                last[3] = max(last[3], b)
                return end
            span = [lane, what, a, b]
            self._spans.append(span)
            self._last[key] = span
        return end

    @contextmanager
    def span(self, lane: str, what: str = "", start: float | None = None) -> Iterator[None]:
        """Record the time the ``with`` block takes; ``start``: a ``time.perf_counter()`` time
        the span begins at instead (:attr:`t0`: from the start of the run)."""
        t = time.perf_counter() if start is None else start
        try:
            yield
        finally:
            self.add(lane, what, t, time.perf_counter())

    def total(self, lane: str, what: str | None = None) -> float | None:
        """Seconds recorded for ``(lane, what)``, summed span by span; ``what`` None: every kind
        of the lane but its waits (``wait*``). None when no such span was recorded."""
        with self._lock:
            got = [
                s
                for (ln, w), s in self._seconds.items()
                if ln == lane and (w == what if what is not None else not w.startswith("wait"))
            ]
        return sum(got) if got else None

    def elapsed(self) -> float:
        """Seconds since the start of the run."""
        return time.perf_counter() - self.t0

    def spans(self) -> list[tuple[str, str, float, float]]:
        """Every span, by start time, rounded to 0.1 ms (JSON-friendly)."""
        with self._lock:
            rows = sorted(self._spans, key=lambda s: s[2])
            return [(lane, what, round(a, 4), round(b, 4)) for lane, what, a, b in rows]
