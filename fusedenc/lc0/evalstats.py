"""What an ``Evaluator`` counts (``EvaluatorStats``) and where a batch's time goes (``Trips``).

The stage totals (``Evaluator.stats()["devices"][d]["seconds"]``) say which thread waits
most, not why: a launch stage that waits for encodings most of the run may wait for a worker
still busy with an earlier batch, for a worker's slow work, or for its own turn at the GIL
after the answer arrived.  Each batch's trip is stamped at every hand-over instead, and the
medians per hop show which one holds it up:

* ``to_worker``: sent to a host worker -> the worker starts it (the pipe, and the worker's
  earlier batches);
* ``worker``: the worker's own work (``hostwork.prepare_batch``);
* ``to_launch``: the worker done -> the launch stage has the answer (earlier slots it waited
  on first, the answer's unpickling, the GIL);
* ``launch``: the answer -> the GPU work issued (the rows' copy, the launch calls);
* ``to_finish``: issued -> the finish stage sees the GPU done (the GPU's queue and run, and
  the finish stage's earlier batches);
* ``decode``: softmax, Evaluations, futures.

The worker's stamps are ``time.perf_counter()`` in another process: one clock for every
process of a machine (CLOCK_MONOTONIC on Linux, as on macOS and Windows' QPC).
"""

from __future__ import annotations

import collections
import statistics
import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["HOPS", "EvaluatorStats", "Trips"]

HOPS = ("to_worker", "worker", "to_launch", "launch", "to_finish", "decode")


@dataclass
class EvaluatorStats:
    """Counts since the Evaluator started: positions evaluated (futures given a result),
    positions failed (futures given an exception), batches run, and their mean size; per
    device the same."""

    positions: int = 0
    failed: int = 0
    batches: int = 0

    @property
    def mean_batch(self) -> float:
        return self.positions / self.batches if self.batches else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"positions": self.positions, "failed": self.failed, "batches": self.batches,
                "mean_batch": self.mean_batch}  # fmt: skip


class Trips:
    """The per-hop times of the last ``keep`` batches; ``medians_ms()`` summarises them."""

    def __init__(self, keep: int = 4096) -> None:
        self._rows: "collections.deque[tuple[float, ...]]" = collections.deque(maxlen=keep)
        self._lock = threading.Lock()

    def record(self, sent: float, started: float, worked: float, read: float, launched: float, done: float,
               decoded: float) -> None:
        """One batch's stamps (``time.perf_counter()``), in the order of ``HOPS``' ends."""
        row = (started - sent, worked - started, read - worked, launched - read, done - launched, decoded - done)
        with self._lock:
            self._rows.append(row)

    def medians_ms(self) -> dict[str, float]:
        """``{hop: median ms, ..., "trip": median ms of the whole trip, "batches": how many}``;
        empty before the first batch."""
        with self._lock:
            rows = list(self._rows)
        if not rows:
            return {}
        out = {hop: round(statistics.median(r[i] for r in rows) * 1e3, 3) for i, hop in enumerate(HOPS)}
        out["trip"] = round(statistics.median(sum(r) for r in rows) * 1e3, 3)
        out["batches"] = len(rows)
        return out
