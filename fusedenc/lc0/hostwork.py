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
``start_pool`` starts them.
"""

from __future__ import annotations

import multiprocessing
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .encoding import encode_masks
from .policy import policy_indices
from .positions import Position, as_history, prepare

__all__ = ["HostBatch", "pack", "portable", "prepare_batch", "start_pool", "unpack"]


@dataclass
class HostBatch:
    """A batch ready for the GPU: ``kept`` (which of the submitted positions it holds; the
    others are in ``errors`` with the exception each raised), ``masks`` / ``values`` /
    ``transforms`` (``encode_masks``), and the legal ``moves`` with their policy
    ``indices``, ``counts[b]`` of them for kept position ``b``."""

    kept: np.ndarray
    masks: np.ndarray
    values: np.ndarray
    transforms: np.ndarray
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
    lines = []
    try:
        for p in positions:
            if type(p) is str:
                lines.append(p)
            elif type(p) is tuple and len(p) == 2 and type(p[0]) is str and type(p[1]) in (list, tuple):
                moves = " ".join(p[1])
                if moves.count(" ") != max(len(p[1]) - 1, 0):  # a "move" with a space: keep it as it is
                    raise TypeError
                lines.append(f"{p[0]}\t{moves}")
            else:
                raise TypeError
    except TypeError:
        return [portable(p) for p in positions]
    text = "\n".join(lines)
    if text.count("\n") != len(lines) - 1 or text.count("\t") > len(lines):  # separators inside a FEN
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


def prepare_batch(positions: Any, input_format: Any) -> HostBatch:
    """Prepare, encode and list the legal moves of ``positions`` (a list, or ``pack``'s
    string); a position that ``prepare`` refuses is left out with its exception (found by
    splitting the batch in halves)."""
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
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
        for f in [pool.submit(warm_up) for _ in range(workers)]:
            f.result()
    return pool
