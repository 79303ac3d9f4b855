"""Where a conversion spends its time: spans per lane (one lane per thread role), cheap to record.

A span is ``(lane, what, start, end)`` in seconds from the start of the run. The stages record one
span per piece of work (a unit read, a piece written, a file hashed); neighbouring spans of the
same lane and kind closer than ``MERGE_GAP_S`` are merged, so a 9 GB conversion keeps a few
hundred spans, enough to see which stage waited for which (``scripts/bench_convert.py`` plots
them).
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
        self._lock = threading.Lock()

    def add(self, lane: str, what: str, start: float, end: float) -> float:
        """Record a span given in ``time.perf_counter()`` seconds; return ``end``."""
        a, b = start - self.t0, end - self.t0
        with self._lock:
            last = self._last.get((lane, what))
            if last is not None and a - last[3] < MERGE_GAP_S:
                last[3] = max(last[3], b)
                return end
            span = [lane, what, a, b]
            self._spans.append(span)
            self._last[(lane, what)] = span
        return end

    @contextmanager
    def span(self, lane: str, what: str = "") -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(lane, what, t, time.perf_counter())

    def spans(self) -> list[tuple[str, str, float, float]]:
        """Every span, by start time, rounded to 0.1 ms (JSON-friendly)."""
        with self._lock:
            rows = sorted(self._spans, key=lambda s: s[2])
            return [(lane, what, round(a, 4), round(b, 4)) for lane, what, a, b in rows]
