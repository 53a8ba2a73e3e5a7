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
``start_pool`` starts them.  Where they are forked, a worker writes a batch's packed encoding
(``encoded.ROW_BYTES`` a position, 1.3 KB) straight into a buffer of shared memory that the
``Evaluator`` made before forking them (``SharedRows``), and sends back only the legal moves:
sent through the pool's pipe and unpickled, the encoding cost the receiving process ~2.5 us a
position (its pipe is read 64 KB at a time, each read a thread wake-up), a tenth of what it
has for everything.
"""

from __future__ import annotations

import itertools
import mmap
import multiprocessing
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from .encoding import encode_masks
from .policy import policy_indices
from .positions import Position, as_history, prepare

__all__ = ["HostBatch", "SharedRows", "pack", "portable", "prepare_batch", "start_pool", "unpack"]


@dataclass
class HostBatch:
    """A batch ready for the GPU: ``kept`` (which of the submitted positions it holds; the
    others are in ``errors`` with the exception each raised), ``masks`` / ``values`` /
    ``transforms`` (``encode_masks``; all three None where they were written into shared
    rows instead), and the legal ``moves`` with their policy ``indices``, ``counts[b]`` of
    them for kept position ``b``."""

    kept: np.ndarray
    masks: Optional[np.ndarray]
    values: Optional[np.ndarray]
    transforms: Optional[np.ndarray]
    moves: np.ndarray
    indices: np.ndarray
    counts: np.ndarray
    errors: list[tuple[int, BaseException]] = field(default_factory=list)


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
                         empty, errors)
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
                     counts.astype(np.int32), errors)


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
    """Whether ``start_pool`` forks its workers (they then see ``SharedRows`` made before)."""
    return _start_method() == "fork"


def _start_method() -> str:
    return "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"


def warm_up() -> int:
    """Nothing: run once in each worker so that its imports happen before the first batch."""
    return 0


def start_pool(workers: int) -> ProcessPoolExecutor:
    """Worker processes for the host work, started now (not on the first batch).

    Forked where the platform can (as PyTorch's DataLoader does): a spawned worker re-runs
    the user's main script, which then needs an ``if __name__ == "__main__"`` guard, and pays
    the imports again.  The workers run numpy code only; they never touch CUDA, which a forked
    child may not use.  Python 3.12 warns about forking a process that has threads (torch's
    own): the warning is about children that take locks those threads might hold, which these
    do not (numpy arrays in, numpy arrays out)."""
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(_start_method()))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
        for f in [pool.submit(warm_up) for _ in range(workers)]:
            f.result()
    return pool
