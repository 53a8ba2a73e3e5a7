"""The 1858 policy moves of Leela Chess Zero (lc0), and the attention policy head's layout.

An lc0 network scores moves, not positions of pieces: its policy output is 1858 logits, one
for every move that some piece could make on an empty board, seen from the side to move.
This module builds that list, and the map from the attention policy head's raw output to it,
from the rules below; nothing here is a copied table (``tests/test_lc0_moves.py`` checks
the result against a digest of lc0's own tables).

Squares
    Numbered ``0..63`` as ``8 * rank + file`` with files a..h and ranks 1..8 counted from
    zero: a1 = 0, b1 = 1, ..., h1 = 7, a2 = 8, ..., h8 = 63.  Moves are written as two
    square names, plus a promotion letter where there is one ("a1b1", "b7c8q").

The order of the 1858 moves
    1. Plain moves, 1792 of them: for each from-square in order a1, b1, ..., h8, each
       to-square in the same order that a queen could reach from it (same rank, same file or
       same diagonal) or that a knight could jump to, on an empty board.
    2. Promotions to queen, rook and bishop, 66 of them: for each pawn on the seventh rank,
       files a to h, each square on the eighth rank it could reach (diagonally left, straight
       on, diagonally right, in that order, where the board has it), and for each square the
       pieces in the order queen, rook, bishop ("a7a8q", "a7a8r", "a7a8b", "a7b8q", ...).

    A promotion to a knight has no entry of its own: lc0 scores it as the plain move with
    the same squares ("a7a8n" is "a7a8"), so :func:`move_index` accepts either spelling.

Whose point of view
    Moves are always from White's side of the board.  With Black to move lc0 mirrors the
    ranks (rank 1 <-> rank 8, files unchanged) before it looks the move up; ``mirror=True``
    in :func:`move_index` and :func:`move_at` does that.  lc0 also writes castling as the king
    taking its own rook (e1h1, e1a1 rather than e1g1, e1c1): translate castling moves
    before asking for their index.

The attention policy head's raw output
    The head ends in ``64 * 64 + 8 * 24 = 4288`` numbers per position (the layout of lc0's
    ONNX converter; :func:`attention_policy_logits` builds it):

    * slot ``64 * from + to``: the scaled query-key product of the two squares, which is the
      logit of the plain move from -> to (only the 1792 pairs of plain moves are used);
    * slot ``4096 + 24 * from_file + 3 * to_file + piece``, for a pawn on the seventh rank
      promoting on the eighth, ``piece`` 0, 1, 2 for queen, rook, bishop: the logit of that
      promotion, which is the plain a7->a8-style logit plus a per-square promotion bias
      (66 of the 192 slots are used; the others pair files more than one apart).

    :func:`attention_policy_map` gives, for each of the 4288 slots, its move's index in the
    1858 (or -1), and :func:`gather_policy` picks the 1858 logits out with one gather.
"""

from __future__ import annotations

import functools

import torch

__all__ = [
    "ATTENTION_POLICY_SIZE",
    "NUM_POLICY_MOVES",
    "POLICY_MOVES",
    "PROMOTION_PIECES",
    "attention_policy_logits",
    "attention_policy_map",
    "gather_policy",
    "move_at",
    "move_index",
    "square_index",
    "square_name",
]

FILES = "abcdefgh"
RANKS = "12345678"
#: The promotion pieces with entries of their own, in the order lc0 lists them.
PROMOTION_PIECES = "qrb"
#: Number of policy moves.
NUM_POLICY_MOVES = 1858
#: Length of the attention policy head's raw output: 64 x 64 square pairs, then 8 x 24
#: promotion slots (from-file x (to-file x piece)).
ATTENTION_POLICY_SIZE = 64 * 64 + 8 * 24
_PROMOTION_BASE = 64 * 64


def square_name(square: int) -> str:
    """``0 -> "a1"``, ``63 -> "h8"``."""
    if not 0 <= square < 64:
        raise ValueError(f"square index {square} is outside 0..63")
    return FILES[square % 8] + RANKS[square // 8]


def square_index(name: str) -> int:
    """``"a1" -> 0``, ``"h8" -> 63``."""
    if len(name) != 2 or name[0] not in FILES or name[1] not in RANKS:
        raise ValueError(f"{name!r} is not a square name (a1..h8)")
    return 8 * RANKS.index(name[1]) + FILES.index(name[0])


def _reachable(source: int, target: int) -> bool:
    """Whether a queen or a knight on ``source`` reaches ``target`` on an empty board."""
    df = abs(target % 8 - source % 8)
    dr = abs(target // 8 - source // 8)
    if df == dr == 0:
        return False
    queen = df == 0 or dr == 0 or df == dr
    knight = {df, dr} == {1, 2}
    return queen or knight


def _build() -> tuple[str, ...]:
    moves = [
        square_name(source) + square_name(target)
        for source in range(64)
        for target in range(64)
        if _reachable(source, target)
    ]
    for from_file in range(8):
        for to_file in range(from_file - 1, from_file + 2):
            if 0 <= to_file < 8:
                for piece in PROMOTION_PIECES:
                    moves.append(f"{FILES[from_file]}7{FILES[to_file]}8{piece}")
    return tuple(moves)


#: The 1858 moves in lc0's policy order (see the module docstring for the rules).
POLICY_MOVES: tuple[str, ...] = _build()
_INDEX = {move: i for i, move in enumerate(POLICY_MOVES)}
assert len(POLICY_MOVES) == len(_INDEX) == NUM_POLICY_MOVES


def _mirror(move: str) -> str:
    """The move with ranks mirrored (rank 1 <-> 8, ...), files and promotion unchanged."""
    flip = RANKS[::-1]
    return move[0] + flip[RANKS.index(move[1])] + move[2] + flip[RANKS.index(move[3])] + move[4:]


def move_index(uci: str, *, mirror: bool = False) -> int:
    """The policy index of a move written as lc0 encodes it ("e2e4", "b7c8r").

    ``mirror=True`` mirrors the ranks first, as lc0 does with Black to move.  A knight
    promotion ("a7a8n") is the plain move with the same squares; a queen, rook or bishop
    promotion has its own index.  Raises ``ValueError`` for a move with no index.
    """
    move = uci.strip().lower()
    squares_ok = len(move) in (4, 5) and move[0] in FILES and move[2] in FILES and move[1] in RANKS and move[3] in RANKS
    if not squares_ok:
        raise ValueError(f"{uci!r} is not a move in coordinate notation (e.g. 'e2e4', 'a7a8q')")
    if mirror:
        move = _mirror(move)
    if len(move) == 5 and move[4] == "n":
        promotes = move[1] == "7" and move[3] == "8" and abs(FILES.index(move[0]) - FILES.index(move[2])) <= 1
        if promotes:
            move = move[:4]
    try:
        return _INDEX[move]
    except KeyError:
        raise ValueError(f"{uci!r} is not one of lc0's {NUM_POLICY_MOVES} policy moves") from None


def move_at(index: int, *, mirror: bool = False) -> str:
    """The move at a policy index (the inverse of :func:`move_index`); ``mirror=True`` gives
    it back in Black's frame (ranks mirrored)."""
    if not 0 <= index < NUM_POLICY_MOVES:
        raise IndexError(f"policy index {index} is outside 0..{NUM_POLICY_MOVES - 1}")
    move = POLICY_MOVES[index]
    return _mirror(move) if mirror else move


@functools.cache
def _attention_map() -> torch.Tensor:
    table = torch.full((ATTENTION_POLICY_SIZE,), -1, dtype=torch.int64)
    for i, move in enumerate(POLICY_MOVES):
        source, target = square_index(move[0:2]), square_index(move[2:4])
        if len(move) == 4:
            slot = 64 * source + target
        else:
            slot = _PROMOTION_BASE + 24 * (source % 8) + 3 * (target % 8) + PROMOTION_PIECES.index(move[4])
        table[slot] = i
    return table


def attention_policy_map() -> torch.Tensor:
    """int64 ``[4288]``: for each slot of the attention policy head's raw output, the policy
    index of its move, or -1 for a slot that is no policy move (same meaning as lc0's
    ``kAttnPolicyMap``).  A fresh copy each call."""
    return _attention_map().clone()


def _build_gather_index() -> torch.Tensor:
    table = _attention_map()
    slots = torch.nonzero(table >= 0).flatten()
    index = torch.empty(NUM_POLICY_MOVES, dtype=torch.int64)
    index[table[slots]] = slots
    return index


#: The gather index on the CPU, built once at import, and its copies per device.  A plain
#: dict rather than functools.cache: torch.compile traces through a cached function into
#: ``nonzero`` (a data-dependent shape) and breaks the graph on every call, where a dict
#: lookup of a ready tensor traces as a constant.
_GATHER_INDEX_CPU = _build_gather_index()
_GATHER_INDEX: dict[torch.device, torch.Tensor] = {torch.device("cpu"): _GATHER_INDEX_CPU}


def _gather_index(device: torch.device) -> torch.Tensor:
    index = _GATHER_INDEX.get(device)
    if index is None:
        index = _GATHER_INDEX_CPU.to(device)
        if not torch.compiler.is_compiling():  # kept only when made eagerly (not in a trace)
            _GATHER_INDEX[device] = index
    return index


def gather_policy(attn_logits: torch.Tensor) -> torch.Tensor:
    """The 1858 policy logits ``[..., 1858]`` from the attention policy head's raw output
    ``[..., 4288]`` (layout in the module docstring): logit ``i`` is the slot whose
    :func:`attention_policy_map` entry is ``i``.  One gather; works on any device and dtype
    and keeps autograd."""
    if attn_logits.shape[-1] != ATTENTION_POLICY_SIZE:
        raise ValueError(
            f"attention policy output has {attn_logits.shape[-1]} entries in its last dimension, "
            f"expected {ATTENTION_POLICY_SIZE} (64*64 + 8*24)"
        )
    return attn_logits.index_select(-1, _gather_index(attn_logits.device))


def attention_policy_logits(square_logits: torch.Tensor, promotion_keys: torch.Tensor) -> torch.Tensor:
    """The attention policy head's raw ``[B, 4288]`` output, assembled as lc0's converter does.

    ``square_logits`` ``[B, 64, 64]``: the query-key products, already scaled by
    ``1/sqrt(d)``, row = from-square, column = to-square.  ``promotion_keys`` ``[B, 8, 4]``:
    the keys of the eighth-rank squares a8..h8 times the head's promotion weight (a
    ``d x 4`` matrix, no bias, no scaling).  For a promotion from file ``f`` to file ``g``
    with piece ``p`` (0, 1, 2 = queen, rook, bishop) the logit is
    ``square_logits[:, 48 + f, 56 + g] + promotion_keys[:, g, p] + promotion_keys[:, g, 3]``,
    stored at slot ``4096 + 24 f + 3 g + p``; a knight promotion is the plain move's logit.
    """
    if square_logits.dim() != 3 or tuple(square_logits.shape[1:]) != (64, 64):
        raise ValueError(f"square_logits must be [B, 64, 64], got {list(square_logits.shape)}")
    batch = square_logits.shape[0]
    if tuple(promotion_keys.shape) != (batch, 8, 4):
        raise ValueError(f"promotion_keys must be [{batch}, 8, 4], got {list(promotion_keys.shape)}")
    bias = promotion_keys[:, :, :3] + promotion_keys[:, :, 3:]  # [B, to_file, piece]
    seventh_to_eighth = square_logits[:, 48:56, 56:64]  # [B, from_file, to_file]
    promotions = seventh_to_eighth.unsqueeze(-1) + bias.unsqueeze(1)  # [B, from_file, to_file, piece]
    return torch.cat([square_logits.reshape(batch, 64 * 64), promotions.reshape(batch, 8 * 24)], dim=1)
