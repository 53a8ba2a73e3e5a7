"""The host side of evaluating a batch of positions, as plain arrays: ``prepare_batch``.

Parsing, history replay, plane encoding and legal-move generation are numpy work that
holds the GIL for much of its time, so threads of one process take turns at it: on an
H200 host a GPU running a T82 net at 34k positions/s got 7-13k positions/s of decoded moves
from three pipeline threads.  The ``Evaluator`` therefore runs this function in worker
processes (one batch each, several at once) and gets back only arrays: lc0's compact planes
(``encoding.encode_masks``) and every legal move with its policy index
(``policy.policy_indices``).  What is left for the process that owns the GPU is the
network, a softmax over the gathered logits and the futures.

Everything a worker runs is picklable and free of CUDA, so the workers never touch a GPU;
``Workers`` starts them.  Where they are forked, a worker writes a batch's packed encoding
(``encoded.ROW_BYTES`` a position, 1.3 KB) straight into a buffer of shared memory that the
``Evaluator`` made before forking them (``SharedRows``), and sends back only the legal moves:
sent through the pipe and unpickled, the encoding cost the receiving process ~2.5 us a
position (its pipe is read 64 KB at a time, each read a thread wake-up), a tenth of what it
has for everything.
"""

from __future__ import annotations

import collections
import itertools
import mmap
import multiprocessing
import pickle
import signal
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from .encoding import encode_masks
from .policy import policy_indices
from .positions import Position, as_history, prepare

__all__ = ["HostBatch", "Job", "SharedRows", "Workers", "pack", "portable", "prepare_batch", "unpack"]


@dataclass
class HostBatch:
    """A batch ready for the GPU: ``kept`` (which of the submitted positions it holds; the
    others are in ``errors`` with the exception each raised), ``masks`` / ``values`` /
    ``transforms`` (``encode_masks``; all three None where they were written into shared
    rows instead), and the legal ``moves`` with their policy ``indices``, ``counts[b]`` of
    them for kept position ``b``; ``work``: ``time.perf_counter()`` when the work began and
    ended (``evalstats.Trips``)."""

    kept: np.ndarray
    masks: Optional[np.ndarray]
    values: Optional[np.ndarray]
    transforms: Optional[np.ndarray]
    moves: np.ndarray
    indices: np.ndarray
    counts: np.ndarray
    errors: list[tuple[int, BaseException]] = field(default_factory=list)
    work: tuple[float, float] = (0.0, 0.0)


def portable(position: Any) -> Any:
    """A position in a form that pickles small and needs no third-party package in the
    worker: FENs, ``(fen, moves)`` pairs and ``Position`` objects as they are; a python-chess
    board as its ``(root fen, moves)``; anything else as it is (the worker names the error)."""
    if isinstance(position, (str, tuple, Position)):
        return position
    try:
        return as_history(position)
    except ValueError:
        return position


def pack(positions: list[Any]) -> Any:
    """A batch as the worker gets it: FENs and ``(fen, [uci moves])`` pairs as one string
    (``fen TAB moves`` lines: pickling it is a copy, where a list of tuples of strings costs
    the GPU process microseconds a position); any other batch as a list of ``portable``s."""
    lines: list[str] = []
    append = lines.append
    pairs = 0
    try:
        for p in positions:
            if type(p) is str:
                append(p)
                continue
            if type(p) is not tuple or len(p) != 2:
                raise TypeError
            fen, moves = p
            if type(fen) is not str or (type(moves) is not list and type(moves) is not tuple):
                raise TypeError
            pairs += 1
            if moves:
                text = " ".join(moves)  # TypeError for a move that is not a str
                if text.count(" ") != len(moves) - 1:  # a "move" with a space: keep it as it is
                    raise TypeError
                append(fen + "\t" + text)
            else:
                append(fen + "\t")
    except TypeError:
        return [portable(p) for p in positions]
    text = "\n".join(lines)
    if text.count("\n") != len(lines) - 1 or text.count("\t") != pairs:  # separators inside a FEN
        return [portable(p) for p in positions]
    return text


def unpack(payload: Any) -> list[Any]:
    """``pack``'s inverse."""
    if not isinstance(payload, str):
        return payload
    out: list[Any] = []
    for line in payload.split("\n"):
        fen, tab, moves = line.partition("\t")
        out.append((fen, moves.split(" ") if moves else []) if tab else fen)
    return out


def prepare_batch(positions: Any, input_format: Any, rows: Optional[tuple[int, int]] = None) -> HostBatch:
    """Prepare, encode and list the legal moves of ``positions`` (a list, or ``pack``'s
    string); a position that ``prepare`` refuses is left out with its exception (found by
    splitting the batch in halves).  ``rows``: ``(token, index)`` of a ``SharedRows`` buffer
    to write the packed encoding into (one row a kept position, in order) instead of
    returning it."""
    began = time.perf_counter()
    positions = unpack(positions)
    errors: list[tuple[int, BaseException]] = []
    try:
        batch = prepare(positions)
        kept = np.arange(len(positions))
    except ValueError:
        good: list[int] = []

        def split(lo: int, hi: int) -> None:
            try:
                prepare(positions[lo:hi])
                good.extend(range(lo, hi))
            except ValueError as exc:
                if hi - lo == 1:
                    errors.append((lo, _renamed(exc, lo)))
                    return
                split(lo, (lo + hi) // 2)
                split((lo + hi) // 2, hi)

        split(0, len(positions))
        kept = np.array(good, np.int64)
        batch = prepare([positions[i] for i in good]) if good else None
    if batch is None:
        empty = np.zeros(0, np.int64)
        return HostBatch(kept, np.zeros((0, 112), np.uint64), np.zeros((0, 112), np.float32), empty, empty, empty,
                         empty, errors, (began, time.perf_counter()))
    masks, values, transforms = encode_masks(batch, input_format)
    if rows is not None:
        from .encoded import input_views

        token, index = rows
        m, v, t = input_views(_SHARED[token][index])
        n = len(masks)
        m[:n], v[:n], t[:n] = masks, values, transforms
        masks = values = transforms = None
    moves, indices, _, counts = policy_indices(batch, input_format)
    return HostBatch(kept, masks, values, transforms, moves.astype(np.int32), indices.astype(np.int16),
                     counts.astype(np.int32), errors, (began, time.perf_counter()))


def _renamed(exc: ValueError, index: int) -> ValueError:
    """The message of a one-position batch says "position 0": the request's own error needs
    no index at all."""
    text = str(exc)
    if text.startswith("position 0"):
        text = "position" + text[len("position 0"):]
    return ValueError(text)


#: ``SharedRows`` buffers by token: a forked worker finds its parent's here.
_SHARED: dict[int, list[np.ndarray]] = {}
_TOKENS = itertools.count()


class SharedRows:
    """``count`` buffers of ``rows`` packed encodings (uint8 ``[rows, ROW_BYTES]``) in
    anonymous shared memory, for workers forked after it is made to write into
    (``prepare_batch(..., rows=(token, i))``).  ``close()`` forgets them (the memory goes with
    the last array that views it)."""

    def __init__(self, count: int, rows: int) -> None:
        from .encoded import ROW_BYTES  # here: a spawned worker need not import the network's modules

        self.token = next(_TOKENS)
        self.buffers = [np.frombuffer(mmap.mmap(-1, rows * ROW_BYTES), np.uint8).reshape(rows, ROW_BYTES)
                        for _ in range(count)]
        _SHARED[self.token] = self.buffers

    def close(self) -> None:
        _SHARED.pop(self.token, None)
        self.buffers = []


def forked() -> bool:
    """Whether ``Workers`` forks its workers (they then see ``SharedRows`` made before)."""
    return _start_method() == "fork"


def _start_method() -> str:
    return "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"


class Job:
    """One batch sent to a worker: ``result()`` waits for its ``HostBatch`` (or raises the
    exception the worker raised, or why the worker could not answer).  Results come back in
    the order a worker got its batches, so a worker's jobs must be waited on in that order
    (``Workers.submit``)."""

    __slots__ = ("_workers", "_k", "_answer")

    def __init__(self, workers: "Workers", k: int, answer: Optional[tuple[bool, Any]] = None) -> None:
        self._workers, self._k, self._answer = workers, k, answer

    @classmethod
    def here(cls, *args: Any) -> "Job":
        """``prepare_batch(*args)`` run now, in this process, as a finished job."""
        try:
            return cls(None, 0, (True, prepare_batch(*args)))  # type: ignore[arg-type]
        except BaseException as exc:  # noqa: BLE001 - goes to the batch's futures
            return cls(None, 0, (False, exc))  # type: ignore[arg-type]

    def result(self) -> HostBatch:
        if self._answer is None:
            self._answer = self._workers._receive(self._k)
        ok, value = self._answer
        if ok:
            return value
        raise value


class Workers:
    """``count`` worker processes for ``prepare_batch``, each behind its own pipe, started now.

    Not a ``ProcessPoolExecutor``: its hand-over runs through two threads of its own (a
    queue-feeding thread and a result-reading one), each of which must win the GIL from the
    threads that keep the GPU busy; measured on this project's CPU box with one busy Python
    thread beside it, a round trip took ~21 ms median (0.45 ms idle), against ~5 ms for a
    pipe written and read by the calling threads (two busy threads: 84 against 26 ms).  Here
    the thread that submits writes the batch to the pipe, and the thread that waits reads the
    answer (the GIL released while it blocks).  ``submit`` deals batches out in turn; a
    worker answers in the order it got them, so the batches must be waited on in the order
    they were submitted (the Evaluator's launch stage does: one ``Workers`` per replica).

    Forked where the platform can (as PyTorch's DataLoader does): a spawned worker re-runs
    the user's main script, which then needs an ``if __name__ == "__main__"`` guard, and pays
    the imports again.  The workers run numpy code only; they never touch CUDA, which a forked
    child may not use.  Python 3.12 warns about forking a process that has threads (torch's
    own): the warning is about children that take locks those threads might hold, which these
    do not (numpy arrays in, numpy arrays out).  A worker ignores Ctrl-C (the parent stops it)."""

    #: Deaths of one worker in a row (no answer between them) after which the batch at the head
    #: of its queue, the likeliest cause, fails instead of being sent to a new worker again.
    MAX_DEATHS_IN_A_ROW = 3

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        self._ctx = multiprocessing.get_context(_start_method())
        self._conns: list[Any] = []
        self._procs: list[Any] = []
        self._turn = itertools.cycle(range(count))
        # Per worker: the messages sent and not yet answered, in order (sent again to the
        # worker that replaces one that died), the lock that orders sending against a
        # replacement, and its deaths since its last answer.
        self._pending: list[collections.deque] = [collections.deque() for _ in range(count)]
        self._locks = [threading.Lock() for _ in range(count)]
        self._deaths = [0] * count
        self.restarts = 0  # workers replaced after dying
        try:
            for _ in range(count):
                conn, proc = self._start()
                self._conns.append(conn)
                self._procs.append(proc)
            for k in range(count):  # each worker's imports done before the first batch
                self._conns[k].send_bytes(pickle.dumps(("warm_up", ())))
            for k in range(count):  # and a worker that cannot answer fails the Evaluator's start, not a batch
                ok, value = pickle.loads(self._conns[k].recv_bytes())
                if not ok:
                    raise value
        except BaseException:
            self.close()
            raise

    def _start(self) -> tuple[Any, Any]:
        mine, theirs = self._ctx.Pipe(duplex=True)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
            proc = self._ctx.Process(target=_serve, args=(theirs,), name="fusedenc-host-worker", daemon=True)
            proc.start()
        theirs.close()
        return mine, proc

    def __len__(self) -> int:
        return len(self._procs)

    def submit(self, *args: Any) -> Job:
        """Send ``prepare_batch(*args)`` to the next worker in turn (no wait for the answer)."""
        k = next(self._turn)
        message = pickle.dumps(("prepare_batch", args), pickle.HIGHEST_PROTOCOL)
        with self._locks[k]:
            if not self._conns:
                return Job(self, k, (False, RuntimeError("fusedenc host workers are closed")))
            self._pending[k].append(message)
            try:
                self._conns[k].send_bytes(message)
            except (OSError, ValueError):
                pass  # the worker is gone: the thread waiting on it starts another and sends this again
        return Job(self, k)

    def _receive(self, k: int) -> tuple[bool, Any]:
        """The answer to worker ``k``'s oldest batch.  A worker that died (killed, out of
        memory) is replaced and sent again every batch it held, in order; only a batch during
        which workers die ``MAX_DEATHS_IN_A_ROW`` times in a row fails, with the reason."""
        while True:
            conn = self._conns[k] if self._conns else None
            if conn is None:
                return False, RuntimeError("fusedenc host workers are closed")
            try:
                answer = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError, ValueError) as exc:
                failed = self._replace(k, conn, exc)
                if failed is not None:
                    return False, failed
                continue
            with self._locks[k]:
                if self._pending[k]:
                    self._pending[k].popleft()
                self._deaths[k] = 0
            return answer

    def _replace(self, k: int, dead: Any, exc: BaseException) -> Optional[RuntimeError]:
        """Start a new worker ``k`` in place of the one behind pipe ``dead`` and send it the
        batches that one held; the error of the batch that failed instead, if workers kept
        dying on it."""
        with self._locks[k]:
            if not self._conns:
                return RuntimeError("fusedenc host workers are closed")
            if self._conns[k] is not dead:  # replaced meanwhile
                return None
            proc = self._procs[k]
            proc.join(timeout=5)
            code = proc.exitcode
            self._deaths[k] += 1
            failed = None
            if self._deaths[k] >= self.MAX_DEATHS_IN_A_ROW and self._pending[k]:
                self._pending[k].popleft()
                self._deaths[k] = 0
                failed = RuntimeError(
                    f"fusedenc host worker {k} died {self.MAX_DEATHS_IN_A_ROW} times in a row on this batch (last exit "
                    f"code {code}; {type(exc).__name__}): the batch failed; the other batches go on")  # fmt: skip
            dead.close()
            self._conns[k], self._procs[k] = self._start()
            self.restarts += 1
            for message in self._pending[k]:
                self._conns[k].send_bytes(message)
            return failed

    def close(self) -> None:
        """Stop the workers (each finishes the batch it holds) and wait for them."""
        for lock in self._locks:  # no replacement starts while they stop
            lock.acquire()
        try:
            self._stop()
        finally:
            for lock in self._locks:
                lock.release()

    def _stop(self) -> None:
        for conn in self._conns:
            try:
                conn.send_bytes(b"")
            except (OSError, ValueError):
                pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []


_TASKS = {"prepare_batch": prepare_batch, "warm_up": lambda: 0}


def _serve(conn: Any) -> None:
    """A worker's loop: a pickled ``(task, args)`` in, ``(True, result)`` or ``(False,
    exception)`` out, until an empty message or a closed pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            return
        if not message:
            return
        try:
            task, args = pickle.loads(message)
            answer = pickle.dumps((True, _TASKS[task](*args)), pickle.HIGHEST_PROTOCOL)
        except BaseException as exc:  # noqa: BLE001 - goes back to the batch's futures
            try:
                answer = pickle.dumps((False, exc), pickle.HIGHEST_PROTOCOL)
            except Exception:  # noqa: BLE001 - an exception that does not pickle: its text
                answer = pickle.dumps((False, RuntimeError(f"{type(exc).__name__}: {exc}")))
        try:
            conn.send_bytes(answer)
        except (OSError, ValueError):
            return
