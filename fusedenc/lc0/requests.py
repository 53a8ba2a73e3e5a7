"""What an ``Evaluator`` queues: the positions of one call, and how they are answered.

Every ``submit`` / ``submit_many`` call queues one ``Submission`` (its positions, each with
its own ``concurrent.futures.Future``), every ``submit_batch`` call one ``Minibatch`` (its
positions and one future for their list).  A batch takes positions from the front of the
queue, whole calls or slices of them (``Submission.start`` / ``Minibatch.start`` give a
``Part``), and answers each part at once: ``Part.finish(results)``, ``Part.fail(exc)``,
``Part.fail_one(j, exc)``.

All of it runs in the process that drives the GPU, so it must cost that process well under
a microsecond a position: at 34,000 positions a second, 30 microseconds a position is all
the time there is, for everything.  A plain ``Future`` costs 3-4 us to make, set and read
(a ``threading.Condition`` of its own, with its lock, five bound methods and a deque: a
dozen objects for the garbage collector, which then runs often, stopping every thread).
The futures of one ``submit_many`` call therefore share one condition (``PositionFuture``:
a ``Future`` subclass; its ``result`` and ``exception`` wait in a loop, since a wake-up may be
meant for a sibling), and a part is started and finished under that condition once, not
once a position.  Where ``Future``'s private layout is not the one this relies on (another
Python), plain futures and their public calls are used instead.  ``submit_batch`` costs no
object per position at all: an engine's search that gathers its positions into
minibatches, as lc0's does, should use it.
"""

from __future__ import annotations

import bisect
import threading
import time
from concurrent.futures import CancelledError, Future, _base
from typing import Any, Callable, Optional, Sequence

__all__ = ["Minibatch", "Part", "PositionFuture", "Submission", "locate"]

_PENDING, _RUNNING, _FINISHED = _base.PENDING, _base.RUNNING, _base.FINISHED
_CANCELLED, _NOTIFIED = _base.CANCELLED, _base.CANCELLED_AND_NOTIFIED
_DONE_STATES = (_CANCELLED, _NOTIFIED, _FINISHED)
_LAYOUT = ("_condition", "_state", "_result", "_exception", "_waiters", "_done_callbacks")


def _layout_known() -> bool:
    """Whether ``Future`` keeps its state in the attributes ``PositionFuture`` sets and reads
    (true of CPython 3.8-3.13)."""
    return sorted(vars(Future())) == sorted(_LAYOUT) and callable(getattr(Future, "_invoke_callbacks", None))


FAST = _layout_known()


class PositionFuture(Future):
    """A ``Future`` of one position's ``Evaluation`` whose condition it shares with the other
    positions of its ``submit_many`` call.  Everything ``Future`` offers works as it does
    (``result``, ``exception``, ``cancel``, ``add_done_callback``, ``concurrent.futures.wait``,
    ``as_completed``, ``asyncio.wrap_future``)."""

    def __init__(self, condition: threading.Condition) -> None:  # noqa: D107 - Future.__init__'s state, lighter
        self._condition = condition
        self._state = _PENDING
        self._result = None
        self._exception = None
        self._waiters: list = []
        self._done_callbacks: list = []

    def result(self, timeout: Optional[float] = None) -> Any:
        # Set under the condition with the result first: a finished future needs no lock.
        if self._state == _FINISHED and self._exception is None:
            return self._result
        self._wait(timeout)
        return Future.result(self, 0)

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        if self._state == _FINISHED:
            return self._exception
        self._wait(timeout)
        return Future.exception(self, 0)

    def _wait(self, timeout: Optional[float]) -> None:
        """Until this future is done (or ``timeout`` passes): a notification of the shared
        condition may be a sibling's."""
        with self._condition:
            if timeout is None:
                while self._state not in _DONE_STATES:
                    self._condition.wait()
                return
            end = time.monotonic() + timeout
            while self._state not in _DONE_STATES:
                left = end - time.monotonic()
                if left <= 0:
                    return
                self._condition.wait(left)


class Part:
    """The positions of one ``Submission`` or ``Minibatch`` that one batch holds
    (``positions``), and how to answer them."""

    __slots__ = ("group", "lo", "positions", "futures")

    def __init__(self, group: Any, lo: int, positions: list[Any], futures: Optional[list[Future]]) -> None:
        self.group, self.lo, self.positions, self.futures = group, lo, positions, futures

    def __len__(self) -> int:
        return len(self.positions)

    def finish(self, results: Sequence[Any]) -> None:
        """Give position ``j`` its result ``results[j]`` (None: it already failed)."""
        self.group._finish(self, results)

    def fail(self, exc: BaseException) -> int:
        """Fail every position still unanswered; how many there were."""
        return self.group._fail(self, exc)

    def fail_one(self, j: int, exc: BaseException) -> None:
        """Position ``j`` was refused (a bad FEN, an illegal move)."""
        self.group._fail_one(self, j, exc)


class Submission:
    """The positions of one ``submit`` / ``submit_many`` call, each with its own future;
    ``taken`` of them have left the queue."""

    __slots__ = ("positions", "futures", "condition", "taken")

    def __init__(self, positions: list[Any]) -> None:
        self.positions = positions
        self.taken = 0
        if FAST:
            self.condition = c = threading.Condition()
            self.futures: list[Future] = [PositionFuture(c) for _ in positions]
        else:
            self.condition = None
            self.futures = [Future() for _ in positions]

    def start(self, lo: int, hi: int) -> Optional[Part]:
        """Positions ``lo:hi`` go into a batch: their futures start running; those the caller
        cancelled are dropped (None if all were)."""
        futures = self.futures[lo:hi]
        if FAST:
            with self.condition:
                started = True
                for f in futures:
                    if f._state == _PENDING:
                        f._state = _RUNNING
                    else:
                        started = False
                if started:
                    return Part(self, lo, self.positions[lo:hi], futures)
                keep = [j for j, f in enumerate(futures) if f._state == _RUNNING]
                for f in futures:
                    if f._state == _CANCELLED:  # what set_running_or_notify_cancel does for a cancelled one
                        f._state = _NOTIFIED
                        for waiter in f._waiters:
                            waiter.add_cancelled(f)
        else:
            keep = [j for j, f in enumerate(futures) if f.set_running_or_notify_cancel()]
            if len(keep) == len(futures):
                return Part(self, lo, self.positions[lo:hi], futures)
        if not keep:
            return None
        return Part(self, lo, [self.positions[lo + j] for j in keep], [futures[j] for j in keep])

    def cancel_rest(self) -> None:
        """``close(cancel_pending=True)``: the futures not taken yet are cancelled."""
        for f in self.futures[self.taken:]:
            f.cancel()

    def _finish(self, part: Part, results: Sequence[Any]) -> None:
        if not FAST:
            for f, r in zip(part.futures, results, strict=True):
                if r is not None and not f.done():
                    f.set_result(r)
            return
        callbacks = []
        with self.condition:
            for f, r in zip(part.futures, results, strict=True):
                if f._state != _RUNNING:  # failed already (or not ours to set)
                    continue
                f._result = r
                f._state = _FINISHED
                if f._waiters:
                    for waiter in f._waiters:
                        waiter.add_result(f)
                if f._done_callbacks:
                    callbacks.append(f)
            self.condition.notify_all()
        for f in callbacks:
            f._invoke_callbacks()

    def _fail(self, part: Part, exc: BaseException) -> int:
        n = 0
        for f in part.futures:
            if not f.done():
                try:
                    f.set_exception(exc)
                    n += 1
                except _base.InvalidStateError:  # answered in between
                    pass
        return n

    def _fail_one(self, part: Part, j: int, exc: BaseException) -> None:
        f = part.futures[j]
        if not f.done():
            f.set_exception(exc)


class Minibatch:
    """Positions submitted together: one future, whose result is the list of their results in
    order, or the first exception one of them raised (the others are still evaluated, as
    ``Evaluator.evaluate`` does)."""

    __slots__ = ("positions", "future", "results", "left", "lock", "state", "taken")

    def __init__(self, positions: list[Any]) -> None:
        n = len(positions)
        self.positions = positions
        self.future: Future = Future()
        self.results: list[Any] = [None] * n
        self.left = n
        self.lock = threading.Lock()
        self.state = 0  # 0: nothing taken yet, 1: running, 2: cancelled before it ran
        self.taken = 0
        if n == 0:
            self.future.set_running_or_notify_cancel()
            self.future.set_result([])

    def start(self, lo: int, hi: int) -> Optional[Part]:
        with self.lock:
            if self.state == 0:
                self.state = 1 if self.future.set_running_or_notify_cancel() else 2
            if self.state != 1:
                return None
        return Part(self, lo, self.positions[lo:hi], None)

    def cancel_rest(self) -> None:
        """Before any position ran: the future is cancelled; after: it fails with
        CancelledError (the positions still queued are dropped, so it could never complete)."""
        if not self.future.cancel():
            self._fail_future(CancelledError("the Evaluator was closed with cancel_pending=True"))

    def _finish(self, part: Part, results: Sequence[Any]) -> None:
        with self.lock:  # set under the lock: a concurrent fail must not slip in between
            if self.future.done():
                return
            lo = part.lo
            self.results[lo:lo + len(results)] = results
            self.left -= len(results)
            if self.left == 0:
                self.future.set_result(self.results)

    def _fail(self, part: Part, exc: BaseException) -> int:
        return len(part) if self._fail_future(exc) else 0

    def _fail_one(self, part: Part, j: int, exc: BaseException) -> None:
        self._fail_future(exc)

    def _fail_future(self, exc: BaseException) -> bool:
        with self.lock:
            if self.future.done():
                return False
            self.future.set_exception(exc)
            return True


def locate(parts: Sequence[Part]) -> Callable[[int], tuple[Part, int]]:
    """``where(i) -> (part, j)``: which of a batch's parts holds its position ``i``, and where."""
    starts, lo = [], 0
    for part in parts:
        starts.append(lo)
        lo += len(part)

    def where(i: int) -> tuple[Part, int]:
        k = bisect.bisect_right(starts, i) - 1
        return parts[k], i - starts[k]

    return where
