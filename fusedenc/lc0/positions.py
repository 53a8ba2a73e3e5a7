"""Chess positions with their history: FEN parsing, moves, repetitions, and batches.

A network sees more than the board: the last eight positions, whether each repeated an
earlier one, castling rights, the en-passant square and the rule-50 count.  So a position
here is always a game history (a start FEN and the moves since), and ``prepare`` turns a
list of them into one ``PositionBatch``: every history replayed at once (``board``'s
vectorized rules), every move checked for legality, repetitions counted as lc0 counts
them.  ``encoding.encode_planes`` and ``policy.decode_policy`` read that batch.

What counts as a position (everywhere in ``fusedenc.lc0``):

* a FEN string (``"startpos"`` is the initial position);
* a ``(start_fen, [uci moves])`` pair (moves in UCI: ``e2e4``, ``e7e8q``; castling as the
  king's two-square move ``e1g1`` or, as lc0 writes it, the king taking its rook ``e1h1``);
* a ``Position`` (this module's small position type, built move by move with ``push``);
* a python-chess ``chess.Board`` with its move stack, where that package is installed
  (it is never imported here: the object is read through its public attributes).

Only standard chess is supported (castling with the king on e1/e8 and rooks in the
corners); a Chess960 castling right is refused by name.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Iterable, Optional, Sequence, Union

import numpy as np

from . import board as B
from .board import Boards

__all__ = ["Position", "PositionBatch", "STARTPOS_FEN", "board_fen", "board_fens", "parse_fens", "prepare"]

STARTPOS_FEN = "rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1"

_LETTERS = B.PIECE_LETTERS + B.PIECE_LETTERS.lower()  # bb column order
_EXPAND = str.maketrans({str(n): "." * n for n in range(1, 9)})
_CASTLING_BITS = {"K": B.WHITE_KINGSIDE, "Q": B.WHITE_QUEENSIDE, "k": B.BLACK_KINGSIDE, "q": B.BLACK_QUEENSIDE}
_FILES = "abcdefgh"


_KNOWN = str.maketrans({c: None for c in _LETTERS + "./"})  # deletes every character a placement may hold


def _explain_placement(placement: str) -> None:
    """Raise the ValueError that says what is wrong with a FEN's board field."""
    ranks = placement.split("/")
    if len(ranks) != 8:
        raise ValueError(f"the board has {len(ranks)} ranks, not 8")
    for i, r in enumerate(ranks):
        expanded = r.translate(_EXPAND)
        bad = set(expanded) - set(_LETTERS + ".")
        if bad:
            raise ValueError(f"rank {8 - i} ({r!r}) has characters that are no piece: {''.join(sorted(bad))}")
        if len(expanded) != 8:
            raise ValueError(f"rank {8 - i} ({r!r}) has {len(expanded)} squares, not 8")
    raise ValueError(f"the board field {placement!r} is malformed")


def _popcount(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype="<u8")
    return np.unpackbits(x.view(np.uint8).reshape(*x.shape, 8), axis=-1).sum(axis=-1)


def _split_fen(fen: str) -> tuple[str, int, int, int, int, int]:
    """One FEN's fields: (64 squares rank 1 first, turn, castling bits, ep, rule50, ply).
    Raises ValueError saying what is wrong; board legality is checked later, vectorized."""
    if not isinstance(fen, str):
        raise ValueError(f"a FEN must be a string, got {type(fen).__name__}")
    if fen.strip() == "startpos":
        fen = STARTPOS_FEN
    parts = fen.split()
    if not 4 <= len(parts) <= 6:
        raise ValueError(f"has {len(parts)} fields, a FEN has 6 (or 4, as in EPD)")
    placement, turn, castling, ep = parts[:4]
    expanded = placement.translate(_EXPAND)
    # The common case in three C calls: 8 ranks of 8 known characters; else say what is wrong.
    if len(expanded) != 71 or expanded[8::9] != "///////" or expanded.translate(_KNOWN):
        _explain_placement(placement)
    squares = "".join(expanded.split("/")[::-1])
    if turn not in ("w", "b"):
        raise ValueError(f"side to move is {turn!r}, not 'w' or 'b'")
    bits = 0
    if castling != "-":
        for c in castling:
            if c not in _CASTLING_BITS:
                raise ValueError(f"castling field {castling!r}: {c!r} is not one of KQkq (Chess960 castling is not supported)")
            if bits & _CASTLING_BITS[c]:
                raise ValueError(f"castling field {castling!r} repeats {c!r}")
            bits |= _CASTLING_BITS[c]
    if ep == "-":
        ep_square = -1
    else:
        if len(ep) != 2 or ep[0] not in _FILES or ep[1] not in "36":
            raise ValueError(f"en-passant field {ep!r} is not '-' or a square on rank 3 or 6")
        if (ep[1] == "6") != (turn == "w"):
            raise ValueError(f"en-passant square {ep} is on the wrong rank for {'white' if turn == 'w' else 'black'} to move")
        ep_square = _FILES.index(ep[0]) + 8 * (int(ep[1]) - 1)
    try:
        rule50 = int(parts[4]) if len(parts) > 4 else 0
        fullmove = int(parts[5]) if len(parts) > 5 else 1
    except ValueError:
        raise ValueError(f"halfmove clock and move number must be integers, got {' '.join(parts[4:])!r}") from None
    if not 0 <= rule50 <= 10_000:
        raise ValueError(f"halfmove clock {rule50} is outside 0..10000")
    if not 1 <= fullmove <= 100_000:
        raise ValueError(f"move number {fullmove} is outside 1..100000")
    ply = 2 * (fullmove - 1) + (turn == "b")
    return squares, int(turn == "b"), bits, ep_square, rule50, ply


def _check_boards(boards: Boards) -> list[Optional[str]]:
    """Per board, what makes it an impossible position (or None)."""
    n = len(boards)
    problems: list[Optional[str]] = [None] * n

    def flag(mask: np.ndarray, message) -> None:
        for i in np.nonzero(mask)[0]:
            if problems[i] is None:
                problems[i] = message(i) if callable(message) else message

    bb = boards.bb
    kings_w, kings_b = _popcount(bb[:, B.KING]), _popcount(bb[:, 6 + B.KING])
    flag(kings_w != 1, lambda i: f"white has {kings_w[i]} kings, not 1")
    flag(kings_b != 1, lambda i: f"black has {kings_b[i]} kings, not 1")
    pawns = bb[:, B.PAWN] | bb[:, 6 + B.PAWN]
    flag((pawns & (B.RANK_1 | B.RANK_8)) != 0, "a pawn stands on the first or last rank")
    for color, name in ((0, "white"), (1, "black")):
        count = _popcount(np.bitwise_or.reduce(bb[:, 6 * color: 6 * color + 6], axis=1))
        flag(count > 16, lambda i, c=count, nm=name: f"{nm} has {c[i]} pieces (at most 16)")
        pc = _popcount(bb[:, 6 * color + B.PAWN])
        flag(pc > 8, lambda i, c=pc, nm=name: f"{nm} has {c[i]} pawns (at most 8)")
    overlap = np.zeros(n, bool)
    seen = np.zeros(n, np.uint64)
    for col in range(12):
        overlap |= (seen & bb[:, col]) != 0
        seen |= bb[:, col]
    flag(overlap, "two pieces on one square")
    if all(p is not None for p in problems):
        return problems
    # Castling rights need the king and that rook on their starting squares.
    for right, king_col, king_sq, rook_sq, text in (
        (B.WHITE_KINGSIDE, B.KING, 4, 7, "K (white king on e1, rook on h1)"),
        (B.WHITE_QUEENSIDE, B.KING, 4, 0, "Q (white king on e1, rook on a1)"),
        (B.BLACK_KINGSIDE, 6 + B.KING, 60, 63, "k (black king on e8, rook on h8)"),
        (B.BLACK_QUEENSIDE, 6 + B.KING, 60, 56, "q (black king on e8, rook on a8)"),
    ):
        rook_col = king_col - B.KING + B.ROOK
        has = (boards.castling & right) != 0
        fits = ((bb[:, king_col] & B.SQUARE_BB[king_sq]) != 0) & ((bb[:, rook_col] & B.SQUARE_BB[rook_sq]) != 0)
        flag(has & ~fits, f"castling right {text} contradicts the board")
    # En passant: the pawn that just moved two squares is there, and the squares it crossed are empty.
    has_ep = boards.ep >= 0
    if has_ep.any():
        ep = np.maximum(boards.ep.astype(np.int64), 0)
        white_to_move = boards.turn == B.WHITE
        pushed = np.where(white_to_move, ep - 8, ep + 8)
        origin = np.where(white_to_move, ep + 8, ep - 8)
        mover_pawns = np.where(white_to_move, bb[:, 6 + B.PAWN], bb[:, B.PAWN])
        occupied = boards.occupied()
        fits = ((mover_pawns & B.SQUARE_BB[pushed]) != 0) & ((occupied & (B.SQUARE_BB[ep] | B.SQUARE_BB[origin])) == 0)
        flag(has_ep & ~fits, lambda i: f"en-passant square {B.move_uci(int(ep[i]))[:2]} but no pawn has just moved two squares past it")
    ok = np.array([p is None for p in problems])
    if ok.any():
        idx = np.nonzero(ok)[0]
        sub = boards.take(idx)
        mover = sub.turn.astype(np.int64)
        exposed = B.attacked(sub, sub.pieces(1 - mover, B.KING), mover)
        flag(np.isin(np.arange(n), idx[exposed]), "the side not to move is in check")
        givers = np.zeros(n, np.int64)
        givers[idx] = _popcount(B.checkers(sub))
        flag(givers > 2, lambda i: f"the side to move is in check from {givers[i]} pieces (at most 2 after a real move)")
    return problems


_split_cached = functools.lru_cache(maxsize=65536)(lambda fen: _split_fen(fen))  # engines repeat start FENs
_LETTER_CODES = np.frombuffer(_LETTERS.encode(), np.uint8)


def parse_fens(fens: Sequence[str], *, labels: Optional[Sequence[str]] = None) -> Boards:
    """FENs (or ``"startpos"``) -> ``Boards``.  Raises ValueError naming the first FEN that
    is malformed or an impossible position (``labels[i]`` names FEN ``i`` in the message).
    The text of each FEN is split in Python; its squares become bitboards for the whole batch
    at once."""
    n = len(fens)
    rows = []
    for i, fen in enumerate(fens):
        try:
            rows.append(_split_cached(fen))
        except ValueError as exc:
            raise ValueError(f"{_label(labels, i, fen)}: bad FEN: {exc}") from None
        except TypeError:
            raise ValueError(f"{_label(labels, i, fen)}: a FEN must be a string, got {type(fen).__name__}") from None
    boards = Boards.empty(n)
    if n:
        squares = np.frombuffer("".join(r[0] for r in rows).encode(), np.uint8).reshape(n, 64)
        for col, code in enumerate(_LETTER_CODES):
            boards.bb[:, col] = np.packbits(squares == code, axis=1, bitorder="little").view("<u8").reshape(n)
        fields = np.array([r[1:] for r in rows], dtype=np.int64)
        boards.turn[:] = fields[:, 0]
        boards.castling[:] = fields[:, 1]
        boards.ep[:] = fields[:, 2]
        boards.rule50[:] = fields[:, 3]
        boards.ply[:] = fields[:, 4]
        for i, problem in enumerate(_check_boards(boards)):
            if problem is not None:
                raise ValueError(f"{_label(labels, i, fens[i])}: impossible position: {problem}")
    return boards


def _label(labels: Optional[Sequence[str]], i: int, fen: Any) -> str:
    return labels[i] if labels is not None else f"position {i} ({fen!r})"


def board_fen(boards: Boards, i: int) -> str:
    """Row ``i`` as a FEN."""
    return board_fens(boards.take([i]))[0]


_FEN_LETTERS = np.frombuffer(_LETTERS.encode(), np.uint8)
_RUN_OF_EMPTY = re.compile(r"\.+")


def board_fens(boards: Boards) -> list[str]:
    """Every row as a FEN, the board part built with array operations (``board_fen`` does
    one row square by square)."""
    n = len(boards)
    if n == 0:
        return []
    bits = np.unpackbits(np.ascontiguousarray(boards.bb, "<u8").view(np.uint8).reshape(n, 12, 8), axis=2,
                         bitorder="little")  # [n, 12, 64]
    chars = np.full((n, 64), ord("."), np.uint8)
    for col in range(12):
        chars[bits[:, col].astype(bool)] = _FEN_LETTERS[col]
    ranks = chars.reshape(n, 8, 8)[:, ::-1]  # rank 8 first
    slash = np.full((n, 8, 1), ord("/"), np.uint8)
    slash[:, -1] = ord("|")  # between positions: one pass of the run counter over the batch
    text = np.concatenate([ranks, slash], axis=2).reshape(n * 72).tobytes().decode()
    placements = _RUN_OF_EMPTY.sub(lambda m: str(len(m.group())), text).split("|")
    return [
        f"{p} {'wb'[t]} {_CASTLING_TEXT[c]} {_EP_TEXT[e]} {r} {ply // 2 + 1}"
        for p, t, c, e, r, ply in zip(placements, boards.turn.tolist(), boards.castling.tolist(),
                                      boards.ep.tolist(), boards.rule50.tolist(), boards.ply.tolist())
    ]


_CASTLING_TEXT = ["".join(c for c, bit in _CASTLING_BITS.items() if v & bit) or "-" for v in range(16)]
_EP_TEXT = {-1: "-", **{s: B.move_uci(s)[:2] for s in range(64)}}


def _move_codes(moves: Sequence[str], label: str) -> list[int]:
    codes = []
    for k, m in enumerate(moves):
        code = B.UCI_CODE.get(m) if isinstance(m, str) else None
        if code is None:
            text = m.strip().lower() if isinstance(m, str) else None
            code = B.UCI_CODE.get(text) if text else None
            if code is None:
                raise ValueError(f"{label}: move {k + 1} {m!r} is not a move in UCI notation (e.g. 'e2e4', 'e7e8q')")
        codes.append(code)
    return codes


def _castling_as_king_move(boards: Boards, codes: np.ndarray) -> np.ndarray:
    """lc0 writes castling as the king taking its own rook (e1h1); make it e1g1."""
    frm, to = codes & 63, (codes >> 6) & 63
    us = boards.turn.astype(np.int64)
    king = (boards.pieces(us, B.KING) & B.SQUARE_BB[frm]) != 0
    own_rook = (boards.pieces(us, B.ROOK) & B.SQUARE_BB[to]) != 0
    home = np.where(us == B.WHITE, 4, 60)
    rook_castle = king & own_rook & (frm == home) & ((to == home + 3) | (to == home - 4)) & (codes >> 12 == 0)
    return np.where(rook_castle, frm | (np.where(to > frm, frm + 2, frm - 2) << 6), codes)


def _replay(starts: Boards, move_lists: Sequence[Sequence[int]], labels: Sequence[str]):
    """Play each start board's moves, checking each is legal.  Returns all positions of all
    histories (history ``b``'s at ``offsets[b]:offsets[b+1]``, start first), the offsets,
    and the moves as codes ``[n, longest]`` (castling as the king's two-square move)."""
    n = len(starts)
    lengths = np.array([len(m) for m in move_lists], dtype=np.int64) + 1
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    states = Boards.empty(int(offsets[-1]))
    states.put(offsets[:-1], starts)
    longest = int(lengths.max(initial=1)) - 1
    if longest:
        padded = np.zeros((n, longest), np.int64)
        for b, moves in enumerate(move_lists):
            padded[b, : len(moves)] = moves
    else:
        padded = np.zeros((n, 0), np.int64)
    for k in range(longest):
        active = np.nonzero(lengths - 1 > k)[0]
        boards = states.take(offsets[active] + k)
        codes = _castling_as_king_move(boards, padded[active, k])
        ok = B.is_legal(boards, codes)
        if not ok.all():
            i = int(np.nonzero(~ok)[0][0])
            b = int(active[i])
            raise ValueError(
                f"{labels[b]}: move {k + 1} ({B.UCI_TEXT[int(padded[b, k])]}) is illegal in {board_fen(boards, i)}"
            )
        padded[active, k] = codes
        states.put(offsets[active] + k + 1, B.apply_moves(boards, codes))
    return states, offsets, padded


def _repetitions(states: Boards, offsets: np.ndarray) -> np.ndarray:
    """Per position, how many earlier positions of its history are the same position (same
    pieces, side to move, castling rights and en-passant field) -- lc0's repetition count:
    its chain of ``1 + repetitions of the last occurrence`` counts exactly these, since a
    position cannot recur across a capture, pawn move or lost castling right."""
    s = len(states)
    if s == 0:
        return np.zeros(0, np.int16)
    history = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    key = np.concatenate([history[:, None].astype(np.uint64), states.key()], axis=1)
    _, group = np.unique(key, axis=0, return_inverse=True)
    group = group.reshape(-1)
    order = np.lexsort((np.arange(s), group))
    sorted_group = group[order]
    starts = np.r_[0, np.nonzero(np.diff(sorted_group))[0] + 1]
    first = np.repeat(starts, np.diff(np.r_[starts, s]))
    reps = np.empty(s, np.int16)
    reps[order] = np.arange(s) - first
    return reps


class PositionBatch:
    """Positions with their histories, parsed, replayed and checked once (``prepare``).

    ``states`` holds every position of every history; history ``b`` is
    ``states[offsets[b]:offsets[b+1]]`` (its start first, the position itself last) and
    ``repetitions[i]`` counts earlier occurrences of state ``i`` in its history.
    """

    def __init__(self, states: Boards, offsets: np.ndarray, repetitions: np.ndarray, labels: Any):
        self.states = states
        self.offsets = offsets
        self.repetitions = repetitions
        self.labels = labels
        self.played: Optional[np.ndarray] = None  # the moves as codes, where prepare replayed them
        self._legal: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def current(self) -> Boards:
        """The positions themselves (the last state of each history)."""
        return self.states.take(self.offsets[1:] - 1)

    def legal_moves(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(moves, starts, counts)``: all legal move codes, position ``b``'s being
        ``moves[starts[b]:starts[b] + counts[b]]``."""
        if self._legal is None:
            rows, moves = B.legal_moves(self.current)
            counts = np.bincount(rows, minlength=len(self)).astype(np.int64)
            starts = np.zeros(len(self), np.int64)
            np.cumsum(counts[:-1], out=starts[1:])
            self._legal = (moves, starts, counts)
        return self._legal


def as_history(item: Any) -> tuple[str, Sequence[Any]]:
    """(start FEN, moves) of one position given in any accepted form."""
    if isinstance(item, str):
        return item, ()
    if isinstance(item, Position):
        return item.start_fen, item.moves
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
        moves = item[1]
        if isinstance(moves, str):
            moves = moves.split()
        return item[0], list(moves)
    if type(item).__module__.split(".")[0] == "chess" and hasattr(item, "move_stack") and hasattr(item, "root"):
        if getattr(item, "chess960", False):
            raise ValueError("Chess960 boards are not supported")
        return item.root().fen(en_passant="fen"), [m.uci() for m in item.move_stack]
    raise ValueError(
        f"a position is a FEN string, a (start_fen, [uci moves]) pair, a Position or a chess.Board; "
        f"got {type(item).__name__}"
    )


def prepare(positions: Union[Iterable[Any], "PositionBatch"]) -> PositionBatch:
    """Parse, replay and check positions (see the module doc for the accepted forms).
    Raises ValueError naming the first bad position and what is wrong with it."""
    if isinstance(positions, PositionBatch):
        return positions
    if isinstance(positions, (str, Position)) or (isinstance(positions, tuple) and len(positions) == 2
                                                  and isinstance(positions[0], str) and not isinstance(positions[1], str)):
        raise ValueError("prepare() takes a list of positions; wrap a single position in a list")
    items = list(positions)
    ready = [p for p in items if isinstance(p, Position)]
    if ready and len(ready) == len(items):
        return _from_positions(items)
    fens, move_texts = [], []
    for i, item in enumerate(items):
        try:
            fen, moves = as_history(item)
        except ValueError as exc:
            raise ValueError(f"position {i}: {exc}") from None
        fens.append(fen)
        move_texts.append(moves)
    labels = _Labels(fens, move_texts)
    starts = parse_fens(fens, labels=labels)
    codes = [_move_codes(m, labels[i]) if m else () for i, m in enumerate(move_texts)]
    states, offsets, played = _replay(starts, codes, labels)
    batch = PositionBatch(states, offsets, _repetitions(states, offsets), labels)
    batch.played = played
    return batch


class _Labels:
    """``labels[i]``: how error messages name position ``i``; made only when one is needed."""

    def __init__(self, fens: list, move_lists: list) -> None:
        self.fens, self.move_lists = fens, move_lists

    def __getitem__(self, i: int) -> str:
        n = len(self.move_lists[i])
        return f"position {i} ({self.fens[i]!r}{f' + {n} moves' if n else ''})"


def _from_positions(items: Sequence["Position"]) -> PositionBatch:
    lengths = np.array([len(p._states) for p in items], np.int64)
    offsets = np.zeros(len(items) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    states = Boards.concat([p._states for p in items]) if items else Boards.empty(0)
    reps = np.concatenate([p._repetitions for p in items]) if items else np.zeros(0, np.int16)
    labels = _Labels([p.start_fen for p in items], [p.moves for p in items])
    return PositionBatch(states, offsets, reps, labels)


class Position:
    """A chess position with its history: a start FEN and the moves played since.

    Immutable: ``push`` returns a new position.  ``Position.from_fen(fen)``,
    ``Position.startpos()``; ``legal_moves()`` in UCI; ``fen()``; ``push("e2e4")``.
    """

    __slots__ = ("start_fen", "moves", "_states", "_repetitions", "_legal")

    def __init__(self, start_fen: str = STARTPOS_FEN, moves: Sequence[str] = ()) -> None:
        batch = prepare([(start_fen, list(moves))])
        self.start_fen = start_fen
        self.moves = tuple(B.UCI_TEXT[int(c)] for c in batch.played[0, : len(moves)])
        self._states = batch.states
        self._repetitions = batch.repetitions
        self._legal: Optional[list[str]] = None

    @classmethod
    def from_fen(cls, fen: str) -> "Position":
        return cls(fen)

    @classmethod
    def startpos(cls) -> "Position":
        return cls(STARTPOS_FEN)

    @property
    def _board(self) -> Boards:
        return self._states.take([len(self._states) - 1])

    @property
    def turn(self) -> str:
        """``"w"`` or ``"b"``: the side to move."""
        return "wb"[int(self._states.turn[-1])]

    @property
    def repetitions(self) -> int:
        """How many times this position occurred before in its history."""
        return int(self._repetitions[-1])

    @property
    def rule50(self) -> int:
        return int(self._states.rule50[-1])

    def fen(self) -> str:
        return board_fen(self._states, len(self._states) - 1)

    def legal_moves(self) -> list[str]:
        """The legal moves in UCI (castling as e1g1), sorted."""
        if self._legal is None:
            _, moves = B.legal_moves(self._board)
            self._legal = sorted(B.UCI_TEXT[int(c)] for c in moves)
        return list(self._legal)

    def is_check(self) -> bool:
        return bool(B.in_check(self._board)[0])

    def piece_at(self, square: str) -> Optional[str]:
        """The FEN letter of the piece on ``square`` ("e1"), or None."""
        if len(square) != 2 or square[0] not in _FILES or square[1] not in "12345678":
            raise ValueError(f"{square!r} is not a square name (a1..h8)")
        bit = np.uint64(1 << (_FILES.index(square[0]) + 8 * (int(square[1]) - 1)))
        cols = np.nonzero(self._states.bb[-1] & bit)[0]
        return _LETTERS[int(cols[0])] if cols.size else None

    def push(self, uci: str) -> "Position":
        """The position after ``uci`` (ValueError if it is not a legal move here)."""
        if not isinstance(uci, str):
            raise ValueError(f"a move must be a UCI string, got {type(uci).__name__}")
        label = f"position {self.fen()!r}"
        code = np.array(_move_codes([uci], label), np.int64)
        board = self._board
        code = _castling_as_king_move(board, code)
        if not B.is_legal(board, code)[0]:
            raise ValueError(f"{label}: {uci!r} is not a legal move here")
        after = B.apply_moves(board, code)
        new = object.__new__(Position)
        new.start_fen = self.start_fen
        new.moves = self.moves + (B.UCI_TEXT[int(code[0])],)
        new._states = Boards.concat([self._states, after])
        same = (self._states.key() == after.key()[0]).all(axis=1).sum()
        new._repetitions = np.append(self._repetitions, np.int16(same))
        new._legal = None
        return new

    push_uci = push

    def __repr__(self) -> str:
        return f"Position({self.fen()!r}, {len(self.moves)} moves of history)"
