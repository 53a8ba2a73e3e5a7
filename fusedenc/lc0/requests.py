"""What a position queued in an ``Evaluator`` answers to: its own future, or a minibatch's.

``Evaluator.submit`` gives every position a ``concurrent.futures.Future``.  A future costs its
caller and the Evaluator's threads a few microseconds each (a condition variable made,
started, set, waited on), all of it under the GIL of the process that drives the GPU; at
30,000 positions a second that is a good part of a core.  An engine's search that gathers
its positions into minibatches, as lc0's does, can use ``submit_batch`` instead: one future
for the whole list, the positions still batched with everyone else's.  The Evaluator's
stages handle both through the same four calls (``start``, ``done``, ``fail``, ``pending``).
"""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError, Future
from typing import Any

__all__ = ["Minibatch", "Request"]


class Request:
    """One position and its own future."""

    __slots__ = ("position", "future")

    def __init__(self, position: Any, future: Future) -> None:
        self.position, self.future = position, future

    def start(self) -> bool:
        """False if the caller cancelled it before it was taken (then it is dropped)."""
        return self.future.set_running_or_notify_cancel()

    def done(self, result: Any) -> None:
        self.future.set_result(result)

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)

    def pending(self) -> bool:
        return not self.future.done()

    def cancel(self) -> None:
        self.future.cancel()


class Minibatch:
    """Positions submitted together: one future, whose result is the list of their results in
    order, or the first exception one of them raised (the others are still evaluated, as
    ``Evaluator.evaluate`` does).  ``members()`` are what the queue holds."""

    __slots__ = ("future", "results", "left", "lock", "state")

    def __init__(self, n: int) -> None:
        self.future: Future = Future()
        self.results: list[Any] = [None] * n
        self.left = n
        self.lock = threading.Lock()
        self.state = 0  # 0: nothing taken yet, 1: running, 2: cancelled before it ran
        if n == 0:
            self.future.set_running_or_notify_cancel()
            self.future.set_result([])

    def members(self, positions: list[Any]) -> list["_Member"]:
        return [_Member(p, self, i) for i, p in enumerate(positions)]

    def start(self) -> bool:
        with self.lock:
            if self.state == 0:
                self.state = 1 if self.future.set_running_or_notify_cancel() else 2
            return self.state == 1

    def done(self, index: int, result: Any) -> None:
        with self.lock:  # set under the lock: a concurrent fail() must not slip in between
            self.results[index] = result
            self.left -= 1
            if self.left == 0 and not self.future.done():
                self.future.set_result(self.results)

    def fail(self, exc: BaseException) -> None:
        with self.lock:
            if self.future.done():
                return
            self.future.set_exception(exc)

    def cancel(self) -> None:
        """Before any member ran: the future is cancelled; after: it fails with CancelledError
        (members still queued are dropped, so it could never complete)."""
        if not self.future.cancel():
            self.fail(CancelledError("the Evaluator was closed with cancel_pending=True"))


class _Member:
    __slots__ = ("position", "batch", "index")

    def __init__(self, position: Any, batch: Minibatch, index: int) -> None:
        self.position, self.batch, self.index = position, batch, index

    def start(self) -> bool:
        return self.batch.start()

    def done(self, result: Any) -> None:
        self.batch.done(self.index, result)

    def fail(self, exc: BaseException) -> None:
        self.batch.fail(exc)

    def pending(self) -> bool:
        return not self.batch.future.done()

    def cancel(self) -> None:
        self.batch.cancel()
