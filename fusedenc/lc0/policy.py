"""From a network's 1858 policy logits back to moves on the real board: ``decode_policy``.

A network scores moves in its own frame: the side to move's view (ranks mirrored when
Black moves), castling written as the king taking its rook (e1h1), and, in the canonical
input formats, the board turned as the planes were (``encoding.choose_transforms``).  So
each legal move of the real position is carried into that frame and looked up in lc0's
move order (``moves.POLICY_MOVES``); the logits of the legal moves are gathered and a
softmax over them alone gives the probabilities.  Moves come back in UCI on the real board
(castling as e1g1), most probable first.

One place where we follow the planes rather than lc0 909a408: with the board transposed
(pawnless positions without castling rights whose king sits above the diagonal), lc0's
``MoveToNNIndex`` turns moves by 180 degrees while its planes are transposed across the
a8-h1 diagonal; here moves are transposed like the planes, so that a network sees its moves
where it sees its pieces (see ``tests/data/lc0_positions/README.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from . import board as B
from .encoding import CANONICAL_FORMATS, SQUARE_MAP, choose_transforms, resolve_input_format
from .moves import NUM_POLICY_MOVES, POLICY_MOVES
from .positions import prepare

__all__ = ["DecodedPolicies", "MovePolicy", "decode_arrays", "decode_policy", "policy_indices"]


def _index_table() -> np.ndarray:
    """``TABLE[from, to, promotion]``: lc0's policy index of a move in the network's frame
    (promotion 0 none, 1..4 knight..queen; a knight promotion is the plain move), -1 where
    there is none."""
    table = np.full((64, 64, 5), -1, np.int64)
    for i, move in enumerate(POLICY_MOVES):
        frm = B.move_code(move[:4]) & 63
        to = (B.move_code(move[:4]) >> 6) & 63
        if len(move) == 4:
            table[frm, to, 0] = i
            if move[1] == "7" and move[3] == "8" and abs(ord(move[0]) - ord(move[2])) <= 1:
                table[frm, to, B.KNIGHT] = i
        else:
            table[frm, to, {"q": B.QUEEN, "r": B.ROOK, "b": B.BISHOP}[move[4]]] = i
    return table


_TABLE = _index_table()
_UCI_TEXT = np.array(B.UCI_TEXT, dtype=object)  # move code -> UCI text, by one fancy index


@dataclass
class MovePolicy:
    """One position's legal moves (UCI on the real board) with their probabilities, most
    probable first; ``indices`` are their places in the 1858 policy logits."""

    moves: list[str]
    probs: np.ndarray
    indices: np.ndarray

    def __len__(self) -> int:
        return len(self.moves)

    def top(self, n: int) -> list[tuple[str, float]]:
        return [(m, float(p)) for m, p in zip(self.moves[:n], self.probs[:n])]


def policy_indices(positions: Any, input_format: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every legal move of every position with its policy index in the network's frame:
    ``(moves, indices, starts, counts)`` (position ``b``'s at ``starts[b]:starts[b]+counts[b]``)."""
    fmt = resolve_input_format(input_format)
    batch = prepare(positions)
    moves, starts, counts = batch.legal_moves()
    current = batch.current
    rows = np.repeat(np.arange(len(batch)), counts)
    frm, to, promotion = moves & 63, (moves >> 6) & 63, moves >> 12
    king = (current.pieces(current.turn.astype(np.int64), B.KING)[rows] & B.SQUARE_BB[frm]) != 0
    castle = king & (np.abs(to - frm) == 2)
    to = np.where(castle, np.where(to > frm, frm + 3, frm - 4), to)  # the king takes its rook
    black = current.turn[rows] == B.BLACK
    frm, to = np.where(black, frm ^ 56, frm), np.where(black, to ^ 56, to)
    if fmt in CANONICAL_FORMATS:
        turn = choose_transforms(current)[rows]
        frm, to = SQUARE_MAP[turn, frm], SQUARE_MAP[turn, to]
    indices = _TABLE[frm, to, promotion]
    if (indices < 0).any():  # cannot happen for a legal move; a broken table must not pass silently
        raise AssertionError("a legal move has no policy index")
    return moves, indices, starts, counts


def decode_policy(
    logits: Any, positions: Any, input_format: Any, *, temperature: float = 1.0
) -> list[MovePolicy]:
    """Per position, its legal moves and their probabilities: the softmax of the network's
    logits (``[B, 1858]``, a tensor on any device or an array) over the legal moves only,
    divided by ``temperature`` first; sorted, most probable first.  A position without legal
    moves (mate, stalemate) gets an empty ``MovePolicy``."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    batch = prepare(positions)
    values = logits.detach().float().cpu().numpy() if isinstance(logits, torch.Tensor) else np.asarray(logits, np.float32)
    if values.ndim != 2 or values.shape != (len(batch), NUM_POLICY_MOVES):
        raise ValueError(f"logits must be [{len(batch)}, {NUM_POLICY_MOVES}] for {len(batch)} positions, got {list(values.shape)}")
    moves, indices, _, counts = policy_indices(batch, input_format)
    return list(decode_arrays(values, moves, indices, counts, temperature))


class DecodedPolicies:
    """A batch's policies, decoded with array operations only; ``policies[b]`` makes
    position ``b``'s ``MovePolicy`` (its move texts, probabilities and indices) when asked.
    An engine's process that owns the GPU then spends no per-move Python work on a batch:
    each search thread pays for the positions it reads."""

    __slots__ = ("moves", "probs", "indices", "starts", "counts")

    def __init__(self, moves: np.ndarray, probs: np.ndarray, indices: np.ndarray, starts: np.ndarray,
                 counts: np.ndarray) -> None:
        self.moves, self.probs, self.indices, self.starts, self.counts = moves, probs, indices, starts, counts

    def __len__(self) -> int:
        return len(self.counts)

    def __getitem__(self, b: int) -> MovePolicy:
        s, c = int(self.starts[b]), int(self.counts[b])
        return MovePolicy(_UCI_TEXT[self.moves[s: s + c]].tolist(), self.probs[s: s + c], self.indices[s: s + c])

    def __iter__(self):
        return (self[b] for b in range(len(self)))

    def flat_top(self, rows: np.ndarray, top: Optional[int] = None) -> tuple[list[str], list[float], list[int]]:
        """The ``top`` most probable moves (all if None) of positions ``rows``, flattened by
        array operations: their UCI texts, their probabilities (Python floats) and the offsets
        (``len(rows) + 1``) at which each position's moves begin."""
        starts, counts = self.starts[rows], self.counts[rows]
        k = counts if top is None else np.minimum(counts, top)
        offsets = np.zeros(len(k) + 1, np.int64)
        np.cumsum(k, out=offsets[1:])
        picked = np.repeat(starts - offsets[:-1], k) + np.arange(offsets[-1])
        return _UCI_TEXT[self.moves[picked]].tolist(), self.probs[picked].tolist(), offsets.tolist()

    def top_arrays(self, rows: np.ndarray, top: Optional[int] = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``flat_top`` as arrays: the moves' UCI texts (an object array), their probabilities
        (float32) and how many each position of ``rows`` has."""
        starts, counts = self.starts[rows], self.counts[rows]
        k = counts if top is None else np.minimum(counts, top)
        ends = np.cumsum(k)
        picked = np.repeat(starts - (ends - k), k) + np.arange(int(ends[-1]) if len(ends) else 0)
        return _UCI_TEXT[self.moves[picked]], self.probs[picked], k


def decode_arrays(
    logits: np.ndarray, moves: np.ndarray, indices: np.ndarray, counts: np.ndarray, temperature: float = 1.0
) -> DecodedPolicies:
    """``decode_policy`` from ``policy_indices``' arrays (position ``b``'s moves are the next
    ``counts[b]`` of ``moves`` / ``indices``) and logits ``[B, 1858]`` as an array (a view of
    a wider array will do: the ``Evaluator`` passes the policy columns of its packed heads):
    the form in which the ``Evaluator``'s host workers hand a batch over.  Array operations
    only, about a microsecond a position (the ``Evaluator`` runs it in the process that
    drives the GPU)."""
    n = len(counts)
    counts = np.asarray(counts)
    starts = np.zeros(n, np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    rows = np.repeat(np.arange(n), counts)
    chosen = _gather(logits, rows, indices).astype(np.float64)
    if temperature != 1.0:
        chosen /= temperature
    probs = np.zeros(chosen.shape, np.float64)
    has = counts > 0
    if chosen.size:
        first = starts[has]
        repeat = counts[has]
        top = np.maximum.reduceat(chosen, first)
        e = np.exp(chosen - np.repeat(top, repeat))
        total = np.add.reduceat(e, first)
        probs = e / np.repeat(total, repeat)
    probs = probs.astype(np.float32)
    return DecodedPolicies(*_by_probability(moves, probs, indices, rows, starts, counts), starts, counts)


#: Sort keys (``_by_probability``): row, then the probability's bits, then the move's place in its row.
_PLACE_BITS, _PROB_BITS = 8, 31


def _by_probability(moves: np.ndarray, probs: np.ndarray, indices: np.ndarray, rows: np.ndarray, starts: np.ndarray,
                    counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each position's moves most probable first (ties in their given order): one sort of
    int64 keys (row, the float32 probability's bits downwards, the move's place in its row),
    the order read back from the keys' low bits; a stable argsort of floats costs 3-4 times
    as much."""
    if (len(counts) and int(counts.max()) >= 1 << _PLACE_BITS) or len(counts) >= 1 << (63 - _PLACE_BITS - _PROB_BITS):
        order = np.lexsort((-probs, rows))  # beyond the keys' room (no chess position has 256 legal moves)
        return moves[order], probs[order], indices[order]
    place = np.arange(len(rows), dtype=np.int64) - np.repeat(starts, counts)
    # probs >= 0: their float32 bits grow with them; 0x7FFFFFFF - bits puts the most probable
    # first (the sign bit masked: a NaN's may be set, and must not reach the row's bits).
    key = rows.astype(np.int64) << (_PROB_BITS + _PLACE_BITS)
    key |= (0x7FFFFFFF - (probs.view(np.int32) & 0x7FFFFFFF).astype(np.int64)) << _PLACE_BITS
    key |= place
    key.sort()
    order = starts[key >> (_PROB_BITS + _PLACE_BITS)] + (key & ((1 << _PLACE_BITS) - 1))
    return moves[order], probs[order], indices[order]


def _gather(logits: np.ndarray, rows: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """``logits[rows, indices]``, by one flat take where the rows are evenly strided (a fancy
    index over two axes costs six times as much)."""
    logits = np.asarray(logits)
    item = logits.itemsize
    if (logits.ndim != 2 or not len(rows) or logits.strides[1] != item or logits.strides[0] < item * logits.shape[1]
            or logits.strides[0] % item):
        return logits[rows, indices]
    step = logits.strides[0] // item
    flat = np.lib.stride_tricks.as_strided(logits, shape=((logits.shape[0] - 1) * step + logits.shape[1],),
                                           strides=(item,), writeable=False)
    return flat[rows * step + indices]
