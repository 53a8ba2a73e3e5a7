"""Chess rules on bitboards, vectorized over a batch of boards with numpy.

An engine evaluates thousands of positions a second; the host side (parsing, replaying
histories, generating legal moves, encoding planes) must keep up with the GPU.  So every
rule here works on whole arrays of boards at once: a board is a row of twelve 64-bit
bitboards plus a few small fields, and each step (a move applied, the squares a side
attacks, the legal moves) is a handful of numpy operations over all rows, whatever the
batch size.  The rules are the standard ones (FIDE), written from the public definition of
chess; castling is standard chess's (king on e1/e8, rooks on the a and h files).

Squares are ``8 * rank + file`` (a1 = 0, h1 = 7, a8 = 56, h8 = 63); bit ``s`` of a
bitboard is square ``s``.  A move is one int32: ``from | to << 6 | promotion << 12`` with
the promotion piece's index (``KNIGHT``, ``BISHOP``, ``ROOK``, ``QUEEN``; 0 for none).
Castling is the king's move two squares (e1g1, e1c1, e8g8, e8c8).

The en-passant field follows lc0 (so that positions compare and encode as lc0's do): after
a double pawn push it holds the square passed over only when an enemy pawn stands next to
the pushed pawn (could capture it, ignoring pins); a FEN's en-passant square is kept as
written once it is consistent with the board.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = [
    "BISHOP",
    "BLACK",
    "Boards",
    "KING",
    "KNIGHT",
    "PAWN",
    "PIECE_LETTERS",
    "QUEEN",
    "ROOK",
    "WHITE",
    "apply_moves",
    "checkers",
    "in_check",
    "is_legal",
    "legal_moves",
    "move_code",
    "move_uci",
    "perft",
    "square_bits",
]

PAWN, KNIGHT, BISHOP, ROOK, QUEEN, KING = range(6)
WHITE, BLACK = 0, 1
#: FEN letters of the white pieces in index order; black's are the lower-case ones.
PIECE_LETTERS = "PNBRQK"
#: Castling-right bits of ``Boards.castling``.
WHITE_KINGSIDE, WHITE_QUEENSIDE, BLACK_KINGSIDE, BLACK_QUEENSIDE = 1, 2, 4, 8

_U = np.uint64
_ALL = _U(0xFFFFFFFFFFFFFFFF)
_FILE_A = _U(0x0101010101010101)
_NOT_A = ~_FILE_A
_NOT_H = ~(_FILE_A << _U(7))
_NOT_AB = ~(_FILE_A | (_FILE_A << _U(1)))
_NOT_GH = ~((_FILE_A << _U(6)) | (_FILE_A << _U(7)))
RANK_1 = _U(0xFF)
_RANK_3 = RANK_1 << _U(16)
_RANK_6 = RANK_1 << _U(40)
RANK_8 = RANK_1 << _U(56)
#: One bit per square.
SQUARE_BB = np.array([1 << s for s in range(64)], dtype=np.uint64)


def _shl(b: np.ndarray, n: int) -> np.ndarray:
    return np.left_shift(b, _U(n))


def _shr(b: np.ndarray, n: int) -> np.ndarray:
    return np.right_shift(b, _U(n))


# The eight directions: (shift left?, amount, mask of the squares a shifted bit may land on
# without having wrapped around the board's edge).
_NORTH, _SOUTH = (True, 8, _ALL), (False, 8, _ALL)
_EAST, _WEST = (True, 1, _NOT_A), (False, 1, _NOT_H)
_NORTH_EAST, _NORTH_WEST = (True, 9, _NOT_A), (True, 7, _NOT_H)
_SOUTH_EAST, _SOUTH_WEST = (False, 7, _NOT_A), (False, 9, _NOT_H)
_ROOK_DIRECTIONS = (_NORTH, _SOUTH, _EAST, _WEST)
_BISHOP_DIRECTIONS = (_NORTH_EAST, _NORTH_WEST, _SOUTH_EAST, _SOUTH_WEST)


def _step(b: np.ndarray, direction: tuple) -> np.ndarray:
    left, n, mask = direction
    return (_shl(b, n) if left else _shr(b, n)) & mask


def _ray_attacks(gen: np.ndarray, empty: np.ndarray, direction: tuple) -> np.ndarray:
    """Squares attacked along ``direction`` by sliders on ``gen``, stopped by the first
    occupied square (which is attacked): the Kogge-Stone occluded fill, three doublings."""
    left, n, mask = direction
    shift = _shl if left else _shr
    propagate = empty & mask
    gen = gen | (propagate & shift(gen, n))
    propagate = propagate & shift(propagate, n)
    gen = gen | (propagate & shift(gen, 2 * n))
    propagate = propagate & shift(propagate, 2 * n)
    gen = gen | (propagate & shift(gen, 4 * n))
    return shift(gen, n) & mask


def _slider_attacks(gen: np.ndarray, occupied: np.ndarray, directions) -> np.ndarray:
    empty = ~occupied
    out = _ray_attacks(gen, empty, directions[0])
    for d in directions[1:]:
        out |= _ray_attacks(gen, empty, d)
    return out


def rook_attacks(gen: np.ndarray, occupied: np.ndarray) -> np.ndarray:
    return _slider_attacks(gen, occupied, _ROOK_DIRECTIONS)


def bishop_attacks(gen: np.ndarray, occupied: np.ndarray) -> np.ndarray:
    return _slider_attacks(gen, occupied, _BISHOP_DIRECTIONS)


def knight_attacks(b: np.ndarray) -> np.ndarray:
    one = (_shr(b, 1) & _NOT_H) | (_shl(b, 1) & _NOT_A)
    two = (_shr(b, 2) & _NOT_GH) | (_shl(b, 2) & _NOT_AB)
    return _shl(one, 16) | _shr(one, 16) | _shl(two, 8) | _shr(two, 8)


def king_attacks(b: np.ndarray) -> np.ndarray:
    side = _step(b, _EAST) | _step(b, _WEST)
    row = b | side
    return side | _shl(row, 8) | _shr(row, 8)


def pawn_attacks(b: np.ndarray, color: np.ndarray) -> np.ndarray:
    """Squares attacked by pawns on ``b`` of ``color`` (per row: WHITE attacks upwards)."""
    white = _step(b, _NORTH_EAST) | _step(b, _NORTH_WEST)
    black = _step(b, _SOUTH_EAST) | _step(b, _SOUTH_WEST)
    return np.where(color == WHITE, white, black)


_KNIGHT_TABLE = knight_attacks(SQUARE_BB)
_KING_TABLE = king_attacks(SQUARE_BB)


def square_bits(bb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The set bits of a uint64 array ``[N]``: ``(row, square)`` int64 arrays, row-major."""
    bb = np.ascontiguousarray(bb, dtype="<u8")
    bits = np.unpackbits(bb.view(np.uint8).reshape(-1, 8), axis=1, bitorder="little")
    rows, squares = np.nonzero(bits)
    return rows, squares


class Boards:
    """A batch of chess boards as arrays (struct of arrays).

    ``bb``: uint64 ``[N, 12]``, column ``6 * color + piece``; ``turn``: uint8 (WHITE/BLACK to
    move); ``castling``: uint8 bits (1 K, 2 Q, 4 k, 8 q); ``ep``: int8, the en-passant
    square or -1 (see the module doc); ``rule50``: int32 halfmoves since a capture or pawn
    move; ``ply``: int32 plies since the game's start (0 = White's first move).
    """

    __slots__ = ("bb", "turn", "castling", "ep", "rule50", "ply")

    def __init__(self, bb, turn, castling, ep, rule50, ply) -> None:
        self.bb = bb
        self.turn = turn
        self.castling = castling
        self.ep = ep
        self.rule50 = rule50
        self.ply = ply

    @classmethod
    def empty(cls, n: int) -> "Boards":
        return cls(
            np.zeros((n, 12), np.uint64), np.zeros(n, np.uint8), np.zeros(n, np.uint8),
            np.full(n, -1, np.int8), np.zeros(n, np.int32), np.zeros(n, np.int32),
        )

    def __len__(self) -> int:
        return self.bb.shape[0]

    def take(self, index) -> "Boards":
        return Boards(*(getattr(self, f)[index] for f in self.__slots__))

    @classmethod
    def concat(cls, parts: Sequence["Boards"]) -> "Boards":
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in cls.__slots__))

    def put(self, index, other: "Boards") -> None:
        """Rows ``index`` of this batch become ``other``'s rows."""
        for f in self.__slots__:
            getattr(self, f)[index] = getattr(other, f)

    def pieces(self, color, piece: int) -> np.ndarray:
        """Per row, the bitboard of ``piece`` of ``color`` (a scalar or a per-row array)."""
        return self.bb[np.arange(len(self)), np.asarray(color, dtype=np.int64) * 6 + piece]

    def side(self, color) -> np.ndarray:
        """Per row, all pieces of ``color`` (a scalar or a per-row array)."""
        color = np.asarray(color)
        white = np.bitwise_or.reduce(self.bb[:, :6], axis=1)
        black = np.bitwise_or.reduce(self.bb[:, 6:], axis=1)
        return np.where(color == WHITE, white, black)

    def occupied(self) -> np.ndarray:
        return np.bitwise_or.reduce(self.bb, axis=1)

    def key(self) -> np.ndarray:
        """uint64 ``[N, 15]``: everything two positions must share to be the same position
        for repetitions (lc0's board equality: pieces, side to move, castling rights, the
        en-passant field)."""
        extra = np.stack([self.turn, self.castling, self.ep.astype(np.int64) & 0xFF], axis=1).astype(np.uint64)
        return np.concatenate([self.bb, extra], axis=1)


def attacked(boards: Boards, targets: np.ndarray, by: np.ndarray) -> np.ndarray:
    """Per row, whether any square of ``targets`` (a set of squares, usually one king) is
    attacked by side ``by`` (per-row array)."""
    by = np.asarray(by, dtype=np.int64)
    occupied = boards.occupied()
    piece = lambda p: boards.pieces(by, p)  # noqa: E731
    hits = knight_attacks(targets) & piece(KNIGHT)
    hits |= king_attacks(targets) & piece(KING)
    hits |= pawn_attacks(targets, 1 - by) & piece(PAWN)  # where a `by` pawn would attack from
    queens = piece(QUEEN)
    hits |= rook_attacks(targets, occupied) & (piece(ROOK) | queens)
    hits |= bishop_attacks(targets, occupied) & (piece(BISHOP) | queens)
    return hits != 0


def checkers(boards: Boards) -> np.ndarray:
    """Per row, the set of pieces giving check to the side to move."""
    us = boards.turn.astype(np.int64)
    them = 1 - us
    king = boards.pieces(us, KING)
    occupied = boards.occupied()
    queens = boards.pieces(them, QUEEN)
    return (
        (knight_attacks(king) & boards.pieces(them, KNIGHT))
        | (pawn_attacks(king, us) & boards.pieces(them, PAWN))
        | (rook_attacks(king, occupied) & (boards.pieces(them, ROOK) | queens))
        | (bishop_attacks(king, occupied) & (boards.pieces(them, BISHOP) | queens))
    )


def in_check(boards: Boards) -> np.ndarray:
    """Per row, whether the side to move is in check."""
    turn = boards.turn.astype(np.int64)
    return attacked(boards, boards.pieces(turn, KING), 1 - turn)


# Castling rights lost when a move starts or ends on a square (king or rook squares).
_RIGHTS_LOST = np.zeros(64, np.uint8)
_RIGHTS_LOST[[0, 7, 4, 56, 63, 60]] = [
    WHITE_QUEENSIDE, WHITE_KINGSIDE, WHITE_KINGSIDE | WHITE_QUEENSIDE,
    BLACK_QUEENSIDE, BLACK_KINGSIDE, BLACK_KINGSIDE | BLACK_QUEENSIDE,
]


def apply_moves(boards: Boards, moves: np.ndarray) -> Boards:
    """The boards after one move each (``moves`` int32 ``[N]``, one per row).  The moves
    must be pseudo-legal (a piece of the side to move on the from-square); legality is the
    caller's (``legal_moves``, or ``Positions`` checking a history)."""
    n = len(boards)
    rows = np.arange(n)
    moves = np.asarray(moves, dtype=np.int64)
    frm, to, promotion = moves & 63, (moves >> 6) & 63, moves >> 12
    us = boards.turn.astype(np.int64)
    them = 1 - us
    from_bb, to_bb = SQUARE_BB[frm], SQUARE_BB[to]
    bb = boards.bb.copy()

    own = bb.reshape(n, 2, 6)[rows, us]  # [N, 6]
    piece = np.argmax((own & from_bb[:, None]) != 0, axis=1)
    enemy = bb.reshape(n, 2, 6)[rows, them]
    captured = ((enemy & to_bb[:, None]) != 0).any(axis=1)
    is_pawn = piece == PAWN

    bb &= ~to_bb[:, None]  # whatever stood on the target is gone
    en_passant = is_pawn & (to == boards.ep)
    if en_passant.any():
        r = rows[en_passant]
        victim = np.where(us[r] == WHITE, to[r] - 8, to[r] + 8)
        bb[r, them[r] * 6 + PAWN] &= ~SQUARE_BB[victim]
    bb[rows, us * 6 + piece] &= ~from_bb
    bb[rows, us * 6 + np.where(promotion > 0, promotion, piece)] |= to_bb

    castles = (piece == KING) & (np.abs(to - frm) == 2)
    if castles.any():
        r = rows[castles]
        kingside = to[r] > frm[r]
        rook_from = np.where(kingside, frm[r] + 3, frm[r] - 4)
        rook_to = np.where(kingside, frm[r] + 1, frm[r] - 1)
        col = us[r] * 6 + ROOK
        bb[r, col] = (bb[r, col] & ~SQUARE_BB[rook_from]) | SQUARE_BB[rook_to]

    castling = boards.castling & ~(_RIGHTS_LOST[frm] | _RIGHTS_LOST[to])
    ep = np.full(n, -1, np.int8)
    double = is_pawn & (np.abs(to - frm) == 16)
    if double.any():
        r = rows[double]
        passed = (frm[r] + to[r]) // 2
        capturers = pawn_attacks(SQUARE_BB[passed], us[r]) & bb[r, them[r] * 6 + PAWN]
        ep[r] = np.where(capturers != 0, passed, -1)
    rule50 = np.where(captured | is_pawn, 0, boards.rule50 + 1).astype(np.int32)
    return Boards(bb, (boards.turn ^ 1).astype(np.uint8), castling.astype(np.uint8), ep, rule50,
                  (boards.ply + 1).astype(np.int32))


def _expand(rows: np.ndarray, frm: np.ndarray, targets: np.ndarray, promotion: int = 0):
    """One move per set bit of ``targets[i]``, from ``frm[i]`` in row ``rows[i]``."""
    i, to = square_bits(targets)
    return rows[i], frm[i] | (to << 6) | (promotion << 12)


def _pawn_moves(boards: Boards, rows_out: list, moves_out: list) -> None:
    us = boards.turn.astype(np.int64)
    white = us == WHITE
    pawns = boards.pieces(us, PAWN)
    empty = ~boards.occupied()
    prey = boards.side(1 - us) | np.where(boards.ep >= 0, SQUARE_BB[np.maximum(boards.ep, 0)], _U(0))
    one = np.where(white, _shl(pawns, 8), _shr(pawns, 8)) & empty
    two = np.where(white, _shl(one & _RANK_3, 8), _shr(one & _RANK_6, 8)) & empty
    left = np.where(white, _step(pawns, _NORTH_WEST), _step(pawns, _SOUTH_WEST)) & prey
    right = np.where(white, _step(pawns, _NORTH_EAST), _step(pawns, _SOUTH_EAST)) & prey
    # All four target sets in one pass; the from-square is the target minus the kind's step.
    i, to = square_bits(np.stack([one, two, left, right], axis=1).reshape(-1))
    r, kind = i // 4, i % 4
    step = np.array([[-8, 8], [-16, 16], [-7, 9], [-9, 7]])  # [kind, colour]: white, black
    frm = to + step[kind, us[r]]
    last_rank = (to >= 56) | (to < 8)
    plain = ~last_rank
    rows_out.append(r[plain])
    moves_out.append(frm[plain] | (to[plain] << 6))
    if last_rank.any():
        for piece in (QUEEN, ROOK, BISHOP, KNIGHT):
            rows_out.append(r[last_rank])
            moves_out.append(frm[last_rank] | (to[last_rank] << 6) | (piece << 12))


def _castling_moves(boards: Boards, rows_out: list, moves_out: list) -> None:
    if not boards.castling.any():
        return
    occupied = boards.occupied()
    us = boards.turn.astype(np.int64)
    checked = None
    # (right, color, king from, king to, squares that must be empty, square crossed)
    for right, color, king, dest, between, crossed in (
        (WHITE_KINGSIDE, WHITE, 4, 6, (5, 6), 5),
        (WHITE_QUEENSIDE, WHITE, 4, 2, (1, 2, 3), 3),
        (BLACK_KINGSIDE, BLACK, 60, 62, (61, 62), 61),
        (BLACK_QUEENSIDE, BLACK, 60, 58, (57, 58, 59), 59),
    ):
        between_bb = _U(sum(1 << s for s in between))
        ok = ((boards.castling & right) != 0) & (us == color) & ((occupied & between_bb) == 0)
        if not ok.any():
            continue
        if checked is None:
            checked = in_check(boards)
        r = np.nonzero(ok & ~checked)[0]
        if r.size == 0:
            continue
        safe = ~attacked(boards.take(r), np.full(r.size, SQUARE_BB[crossed]), np.full(r.size, 1 - color))
        r = r[safe]
        rows_out.append(r)
        moves_out.append(np.full(r.size, king | (dest << 6), np.int64))


def _line_table() -> tuple[np.ndarray, np.ndarray]:
    """``BETWEEN[a, b]``: the squares strictly between two squares on a common rank, file or
    diagonal (0 otherwise); ``LINE[a, b]``: the whole line through both (0 otherwise)."""
    between = np.zeros((64, 64), np.uint64)
    line = np.zeros((64, 64), np.uint64)
    for a in range(64):
        for df, dr in ((1, 0), (-1, 0), (0, 1), (0, -1), (1, 1), (1, -1), (-1, 1), (-1, -1)):
            f, r, seen = a % 8 + df, a // 8 + dr, 0
            ray = 0
            while 0 <= f < 8 and 0 <= r < 8:
                b = 8 * r + f
                between[a, b] = seen
                seen |= 1 << b
                f, r = f + df, r + dr
            ray = seen
            for b in range(64):
                if ray >> b & 1:
                    back = 0
                    f, r = a % 8 - df, a // 8 - dr
                    while 0 <= f < 8 and 0 <= r < 8:
                        back |= 1 << (8 * r + f)
                        f, r = f - df, r - dr
                    line[a, b] = ray | back | (1 << a)
    return between, line


BETWEEN, LINE = _line_table()


def _bit_index(bb: np.ndarray) -> np.ndarray:
    """The square of the (single) set bit of each entry."""
    _, squares = square_bits(bb)
    return squares


def pinned_pieces(boards: Boards) -> np.ndarray:
    """Per row, the side to move's pieces pinned to its king (the only piece between the
    king and an enemy rook, bishop or queen on a common line)."""
    n = len(boards)
    us = boards.turn.astype(np.int64)
    them = 1 - us
    king = boards.pieces(us, KING)
    king_sq = _bit_index(king)
    enemy = boards.side(them)
    own = boards.side(us)
    queens = boards.pieces(them, QUEEN)
    snipers = (rook_attacks(king, enemy) & (boards.pieces(them, ROOK) | queens)) | (
        bishop_attacks(king, enemy) & (boards.pieces(them, BISHOP) | queens))
    pinned = np.zeros(n, np.uint64)
    rows, squares = square_bits(snipers)
    if rows.size:
        blockers = BETWEEN[king_sq[rows], squares] & (own[rows] | enemy[rows])
        only_one = (blockers != 0) & ((blockers & (blockers - np.uint64(1))) == 0) & ((blockers & own[rows]) != 0)
        np.bitwise_or.at(pinned, rows[only_one], blockers[only_one])
    return pinned


def _safe(boards: Boards, rows: np.ndarray, moves: np.ndarray) -> np.ndarray:
    """Whether each move (of board ``rows[i]``) leaves its side's king unattacked."""
    if rows.size == 0:
        return np.zeros(0, bool)
    after = apply_moves(boards.take(rows), moves)
    mover = 1 - after.turn.astype(np.int64)
    return ~attacked(after, after.pieces(mover, KING), after.turn)


def legal_moves(boards: Boards) -> tuple[np.ndarray, np.ndarray]:
    """Every legal move of every board: ``(rows, moves)``, int64 arrays sorted by row (the
    order of moves within a row is by generator: pieces, pawns, castling)."""
    us = boards.turn.astype(np.int64)
    own = boards.side(us)
    occupied = boards.occupied()
    n = len(boards)
    # Every non-pawn piece of the side to move in one pass: (row, piece, square).
    own_pieces = boards.bb.reshape(n, 2, 6)[np.arange(n), us][:, KNIGHT:]  # [n, 5]: N B R Q K
    i, sq = square_bits(own_pieces.reshape(-1))
    r, piece = i // 5, i % 5 + KNIGHT
    targets = np.where(piece == KNIGHT, _KNIGHT_TABLE[sq], _U(0))
    targets = np.where(piece == KING, _KING_TABLE[sq], targets)
    straight = np.nonzero((piece == ROOK) | (piece == QUEEN))[0]
    diagonal = np.nonzero((piece == BISHOP) | (piece == QUEEN))[0]
    if straight.size:
        targets[straight] |= rook_attacks(SQUARE_BB[sq[straight]], occupied[r[straight]])
    if diagonal.size:
        targets[diagonal] |= bishop_attacks(SQUARE_BB[sq[diagonal]], occupied[r[diagonal]])
    rr, mm = _expand(r, sq, targets & ~own[r])
    rows_out: list[np.ndarray] = [rr]
    moves_out: list[np.ndarray] = [mm]
    _pawn_moves(boards, rows_out, moves_out)
    castling_start = sum(r.size for r in rows_out)  # castling moves still need the destination tested
    _castling_moves(boards, rows_out, moves_out)
    rows = np.concatenate(rows_out) if rows_out else np.zeros(0, np.int64)
    moves = np.concatenate(moves_out) if moves_out else np.zeros(0, np.int64)
    if rows.size == 0:
        return rows, moves
    # Only moves that can expose the king need the full test: all moves of a side in check,
    # king moves (castling too), en-passant captures and moves of pinned pieces.
    frm, to = moves & 63, (moves >> 6) & 63
    king_from = (boards.pieces(us, KING)[rows] & SQUARE_BB[frm]) != 0
    pawn_from = (boards.pieces(us, PAWN)[rows] & SQUARE_BB[frm]) != 0
    doubtful = in_check(boards)[rows] | king_from | ((pinned_pieces(boards)[rows] & SQUARE_BB[frm]) != 0)
    doubtful |= pawn_from & (to == boards.ep[rows])
    doubtful[castling_start:] = True
    legal = np.ones(rows.size, bool)
    check = np.nonzero(doubtful)[0]
    legal[check] = _safe(boards, rows[check], moves[check])
    rows, moves = rows[legal], moves[legal]
    order = np.argsort(rows, kind="stable")
    return rows[order], moves[order]


def is_legal(boards: Boards, moves: np.ndarray) -> np.ndarray:
    """Per row, whether ``moves[i]`` is a legal move of board ``i`` (castling as the king's
    two-square move); cheaper than generating every legal move."""
    n = len(boards)
    moves = np.asarray(moves, dtype=np.int64)
    frm, to, promotion = moves & 63, (moves >> 6) & 63, moves >> 12
    us = boards.turn.astype(np.int64)
    own, enemy = boards.side(us), boards.side(1 - us)
    occupied = own | enemy
    from_bb, to_bb = SQUARE_BB[frm], SQUARE_BB[to]
    mine = (boards.bb.reshape(n, 2, 6)[np.arange(n), us] & from_bb[:, None]) != 0  # [n, 6]
    piece = np.where(mine.any(axis=1), np.argmax(mine, axis=1), -1)
    targets = np.zeros(n, np.uint64)
    targets = np.where(piece == KNIGHT, _KNIGHT_TABLE[frm], targets)
    targets = np.where(piece == KING, _KING_TABLE[frm], targets)
    straight = (piece == ROOK) | (piece == QUEEN)
    diagonal = (piece == BISHOP) | (piece == QUEEN)
    targets = np.where(straight, targets | rook_attacks(from_bb, occupied), targets)
    targets = np.where(diagonal, targets | bishop_attacks(from_bb, occupied), targets)
    pawn = piece == PAWN
    if pawn.any():
        white = us == WHITE
        empty = ~occupied
        one = np.where(white, _shl(from_bb, 8), _shr(from_bb, 8)) & empty
        two = np.where(white, _shl(one & _RANK_3, 8), _shr(one & _RANK_6, 8)) & empty
        ep_bb = np.where(boards.ep >= 0, SQUARE_BB[np.maximum(boards.ep, 0)], np.uint64(0))
        captures = pawn_attacks(from_bb, us) & (enemy | ep_bb)
        targets = np.where(pawn, one | two | captures, targets)
    ok = (piece >= 0) & ((targets & ~own & to_bb) != 0)
    last_rank = (to >= 56) | (to < 8)
    ok &= np.where(pawn & last_rank, (promotion >= KNIGHT) & (promotion <= QUEEN), promotion == 0)
    castle = (piece == KING) & (np.abs(to - frm) == 2) & (promotion == 0)
    if castle.any():
        r = np.nonzero(castle)[0]
        sub = boards.take(r)
        c_rows, c_moves = [], []
        _castling_moves(sub, c_rows, c_moves)
        if c_rows:
            allowed = np.isin(r * 8192 + moves[r], r[np.concatenate(c_rows)] * 8192 + np.concatenate(c_moves))
        else:
            allowed = np.zeros(r.size, bool)
        ok[r] = allowed
    candidates = np.nonzero(ok & ~castle)[0]
    ok[candidates] = _safe(boards, candidates, moves[candidates])
    return ok


def perft(boards: Boards, depth: int) -> np.ndarray:
    """Leaf counts of the legal-move tree to ``depth`` plies, per board (int64 ``[N]``); the
    tree is expanded a whole level at a time, so each level is one batch."""
    n = len(boards)
    owner = np.arange(n)
    if depth == 0:
        return np.ones(n, np.int64)
    for _ in range(depth - 1):
        rows, moves = legal_moves(boards)
        boards = apply_moves(boards.take(rows), moves)
        owner = owner[rows]
    rows, _ = legal_moves(boards)
    return np.bincount(owner[rows], minlength=n).astype(np.int64)


_FILES = "abcdefgh"
_PROMOTION_LETTERS = {"n": KNIGHT, "b": BISHOP, "r": ROOK, "q": QUEEN}


def move_code(uci: str) -> int:
    """``"e7e8q"`` -> the int32 move code (no legality check); raises ValueError."""
    ok = (
        len(uci) in (4, 5) and uci[0] in _FILES and uci[2] in _FILES and uci[1] in "12345678"
        and uci[3] in "12345678" and (len(uci) == 4 or uci[4] in _PROMOTION_LETTERS)
    )
    if not ok:
        raise ValueError(f"{uci!r} is not a move in UCI notation (e.g. 'e2e4', 'e7e8q')")
    frm = _FILES.index(uci[0]) + 8 * (int(uci[1]) - 1)
    to = _FILES.index(uci[2]) + 8 * (int(uci[3]) - 1)
    return frm | to << 6 | (_PROMOTION_LETTERS[uci[4]] << 12 if len(uci) == 5 else 0)


def move_uci(code: int) -> str:
    """The int32 move code -> ``"e7e8q"``."""
    frm, to, promotion = code & 63, (code >> 6) & 63, code >> 12
    text = f"{_FILES[frm % 8]}{frm // 8 + 1}{_FILES[to % 8]}{to // 8 + 1}"
    return text + ("nbrq"[promotion - 1] if promotion else "")


#: Every move code's UCI text (index = code; promotions 1..4), and the reverse map: move
#: text is converted by table look-up, never parsed per move.
UCI_TEXT: list[str] = [move_uci(c) if (c >> 12) <= 4 else "" for c in range(5 << 12)]
UCI_CODE: dict[str, int] = {t: c for c, t in enumerate(UCI_TEXT) if t}
