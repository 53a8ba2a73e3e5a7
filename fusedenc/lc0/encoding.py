"""lc0's 112 input planes from positions with history: ``encode_planes``.

The planes are lc0's (``src/neural/encoder.cc``; the layout is a public fact of every lc0
network): for each of up to 8 history steps, 13 planes (the side to move's pawns, knights,
bishops, rooks, queens, king; the opponent's; "this position occurred before"), always
seen from the side to move (the board mirrored top to bottom when Black moves), then 8
auxiliary planes whose meaning depends on the network's input format:

====  ==========================================  =========================================
plane classical (1)                                castling-plane and canonical formats
====  ==========================================  =========================================
104   we can castle queenside (all ones)          squares of the rooks that may castle
105   we can castle kingside                      queenside / kingside (both colours)
106   they can castle queenside                   zeros
107   they can castle kingside                    zeros
108   all ones when Black is to move              canonical: the en-passant file (on rank 8)
109   rule-50 halfmoves                           hectoplies formats: halfmoves / 100
110   zeros                                       armageddon formats: all ones for Black
111   all ones                                    all ones
====  ==========================================  =========================================

The canonical formats (3, 4, 5, 132, 133) stop the history at the last irreversible
change (capture or pawn move, lost castling right, en-passant chance) and, with no
castling rights left, turn the board so the side to move's king sits on the e-h files
(and, without pawns, on ranks 1-4, below the a8-h1 diagonal): ``transforms`` says which
turn each position got, and ``policy`` maps the moves through the same turn.  The v2
formats (5, 133) keep only history positions that are repetitions.  Positions before a
FEN's own (the history a FEN cannot tell) are filled with copies of the FEN's position, as
lc0 does by default (``FillEmptyHistory::FEN_ONLY``), except after the standard start.

Where lc0 itself misbehaves, we differ on purpose: lc0 909a408's v2 formats loop without
end when the walk back through history reaches a FEN's position with a non-zero rule-50
count and no repetition (see ``tests/data/lc0_positions/README.md``); here the walk stops
there, as it stops at any point before which no repetition can be found.

The work is vectorized: ``encode_masks`` makes lc0's compact form (one 64-bit mask and one
value per plane) for the whole batch with numpy; ``expand_planes`` turns masks into the
``[B, 112, 8, 8]`` tensor with torch, on the CPU or on the GPU after a copy of the masks
(1.3 KB a position instead of 14-29 KB of planes).
"""

from __future__ import annotations

import enum
from typing import Any, Optional, Union

import numpy as np
import torch

from . import board as B
from .errors import Lc0FormatError
from .positions import STARTPOS_FEN, PositionBatch, parse_fens, prepare
from .schema import InputFormat

__all__ = ["SUPPORTED_INPUT_FORMATS", "encode_masks", "encode_planes", "expand_planes", "resolve_input_format"]

#: The input formats encoded here: every format of lc0's encoder.
SUPPORTED_INPUT_FORMATS = (
    InputFormat.CLASSICAL_112_PLANE,
    InputFormat.WITH_CASTLING_PLANE,
    InputFormat.WITH_CANONICALIZATION,
    InputFormat.WITH_CANONICALIZATION_HECTOPLIES,
    InputFormat.WITH_CANONICALIZATION_V2,
    InputFormat.WITH_CANONICALIZATION_HECTOPLIES_ARMAGEDDON,
    InputFormat.WITH_CANONICALIZATION_V2_ARMAGEDDON,
)
CANONICAL_FORMATS = {InputFormat.WITH_CANONICALIZATION, InputFormat.WITH_CANONICALIZATION_HECTOPLIES,
              InputFormat.WITH_CANONICALIZATION_V2, InputFormat.WITH_CANONICALIZATION_HECTOPLIES_ARMAGEDDON,
              InputFormat.WITH_CANONICALIZATION_V2_ARMAGEDDON}
_HECTOPLIES = {InputFormat.WITH_CANONICALIZATION_HECTOPLIES, InputFormat.WITH_CANONICALIZATION_V2,
               InputFormat.WITH_CANONICALIZATION_HECTOPLIES_ARMAGEDDON, InputFormat.WITH_CANONICALIZATION_V2_ARMAGEDDON}
_ARMAGEDDON = {InputFormat.WITH_CANONICALIZATION_HECTOPLIES_ARMAGEDDON, InputFormat.WITH_CANONICALIZATION_V2_ARMAGEDDON}
_V2 = {InputFormat.WITH_CANONICALIZATION_V2, InputFormat.WITH_CANONICALIZATION_V2_ARMAGEDDON}

PLANES = 112
_AUX = 104
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)

#: Board turns of the canonical formats (bits, applied in this order to every square).
FLIP, MIRROR, TRANSPOSE = 1, 2, 4


class HistoryFill(enum.Enum):
    """What fills history steps before a FEN's position (lc0's ``FillEmptyHistory``)."""

    NO = "no"  # nothing (zeros), except the step an en-passant square proves
    FEN_ONLY = "fen_only"  # copies of the FEN's position, unless it is the standard start (lc0's default)
    ALWAYS = "always"  # copies, always


def resolve_input_format(value: Any) -> InputFormat:
    """An input format given as an ``InputFormat``, its number or its name -> the enum
    member; ``Lc0FormatError`` for a format that is not encoded here, named."""
    try:
        if isinstance(value, str):
            fmt = InputFormat[value.upper().removeprefix("INPUT_")]
        else:
            fmt = InputFormat(int(value))
    except (KeyError, ValueError, TypeError):
        raise Lc0FormatError(f"input format {value!r} is not one of lc0's ({', '.join(f.name for f in InputFormat)})") from None
    if fmt not in SUPPORTED_INPUT_FORMATS:
        raise Lc0FormatError(
            f"input format {fmt.name} ({int(fmt)}) is not encoded by fusedenc "
            f"(supported: {', '.join(f'{f.name} ({int(f)})' for f in SUPPORTED_INPUT_FORMATS)})"
        )
    return fmt


_BYTE_REVERSED = np.array([int(f"{b:08b}"[::-1], 2) for b in range(256)], np.uint8)


def _flip_files(x: np.ndarray) -> np.ndarray:
    """Mirror left to right (file a <-> h): reverse the bits of each byte."""
    x = np.ascontiguousarray(x, dtype="<u8")
    return _BYTE_REVERSED[x.view(np.uint8)].view("<u8").reshape(x.shape)


def _square_map(transform: int) -> np.ndarray:
    """Where each square goes under ``transform``: flip files, mirror ranks, then transpose
    across the a8-h1 diagonal ((file, rank) -> (7 - rank, 7 - file)), as lc0 applies them."""
    dest = np.arange(64)
    f, r = dest % 8, dest // 8
    if transform & FLIP:
        f = 7 - f
    if transform & MIRROR:
        r = 7 - r
    if transform & TRANSPOSE:
        f, r = 7 - r, 7 - f
    return 8 * r + f


#: ``SQUARE_MAP[t, s]``: square ``s`` under transform ``t``; ``GATHER[t]``: its inverse, the
#: index that gathers the transformed board's squares from the original's.
SQUARE_MAP = np.stack([_square_map(t) for t in range(8)])
GATHER = np.stack([np.argsort(m) for m in SQUARE_MAP])


def _transform_int(value: int, transform: int) -> int:
    out = 0
    for s in range(64):
        if value >> s & 1:
            out |= 1 << int(SQUARE_MAP[transform, s])
    return out


def _break_diagonal_tie(pieces: list[int], transform: int) -> int:
    """lc0's choice for a king on the long diagonal: compare each piece set (already in the
    side to move's view) with its transpose, in a fixed order, until one differs."""
    for value in pieces:
        value = _transform_int(value, transform)
        alternative = _transform_int(value, TRANSPOSE)
        if value < alternative:
            return transform
        if value > alternative:
            return transform | TRANSPOSE
    return transform


def choose_transforms(current: B.Boards) -> np.ndarray:
    """Per position, the canonical formats' board turn (``FLIP | MIRROR | TRANSPOSE`` bits)."""
    n = len(current)
    turn = current.turn.astype(np.int64)
    black = turn == B.BLACK
    view = np.where(black[:, None], current.bb.byteswap(), current.bb)  # side to move's view
    ours = np.where(black[:, None], view[:, 6:], view[:, :6])
    theirs = np.where(black[:, None], view[:, :6], view[:, 6:])
    king = ours[:, B.KING]
    transform = np.zeros(n, np.int64)
    free = current.castling == 0
    flip = free & ((king & np.uint64(0x0F0F0F0F0F0F0F0F)) != 0)
    transform[flip] |= FLIP
    king = np.where(flip, _flip_files(king), king)
    pawnless = free & ((current.bb[:, B.PAWN] | current.bb[:, 6 + B.PAWN]) == 0)
    mirror = pawnless & ((king & np.uint64(0xFFFFFFFF00000000)) != 0)
    transform[mirror] |= MIRROR
    king = np.where(mirror, king.byteswap(), king)
    above = pawnless & ((king & np.uint64(0xE0C08000)) != 0)
    transform[above] |= TRANSPOSE
    on_diagonal = pawnless & ~above & ((king & np.uint64(0x10204080)) != 0)
    for i in np.nonzero(on_diagonal)[0]:
        o = [int(v) for v in ours[i]]
        t = [int(v) for v in theirs[i]]
        both = [o[p] | t[p] for p in range(6)]
        ours_all = o[0] | o[1] | o[2] | o[3] | o[4] | o[5]
        theirs_all = t[0] | t[1] | t[2] | t[3] | t[4] | t[5]
        order = [ours_all | theirs_all, ours_all, both[B.KING], both[B.QUEEN], both[B.ROOK], both[B.KNIGHT], both[B.BISHOP]]
        transform[i] = _break_diagonal_tie(order, int(transform[i]))
    return transform


_STARTPOS_KEY = parse_fens([STARTPOS_FEN]).key()[0]


def _history_slots(batch: PositionBatch, fmt: InputFormat, fill: HistoryFill):
    """Which state of its history fills each of a position's 8 history steps (-1: none),
    whether that step is a copy from before the FEN, and its repetition flag."""
    n = len(batch)
    states, reps = batch.states, batch.repetitions
    first, length = batch.offsets[:-1], np.diff(batch.offsets)
    current = first + length - 1
    stop_early, v2 = fmt in CANONICAL_FORMATS, fmt in _V2
    castling_now = states.castling[current]
    standard_start = (states.key()[first] == _STARTPOS_KEY).all(axis=1)
    source = np.full((n, 8), -1, np.int64)
    copy = np.zeros((n, 8), bool)
    repeated = np.zeros((n, 8), bool)
    back = length - 1  # index into the history being looked at (negative: before the FEN)
    slot = np.zeros(n, np.int64)
    done = np.zeros(n, bool)
    while True:
        act = np.nonzero(~done & (slot < 8))[0]
        if act.size == 0:
            break
        h = back[act]
        s = first[act] + np.maximum(h, 0)
        stop = np.zeros(act.size, bool)
        if stop_early:
            stop |= states.castling[s] != castling_now[act]
            stop |= (h != length[act] - 1) & (states.ep[s] >= 0)
        if fill is HistoryFill.NO:
            stop |= (h < -1) | ((h == -1) & (states.ep[s] < 0))
        elif fill is HistoryFill.FEN_ONLY:
            stop |= (h < 0) & standard_start[act]
        skip = np.zeros(act.size, bool)
        if v2:
            skip = ~stop & (reps[s] == 0) & (slot[act] > 0)
            stop |= skip & ((states.rule50[s] == 0) | (h < 0))
        write = ~stop & ~skip
        w = act[write]
        source[w, slot[w]] = s[write]
        copy[w, slot[w]] = h[write] < 0
        repeated[w, slot[w]] = reps[s[write]] >= 1
        slot[w] += 1
        if stop_early:
            stop |= write & (states.rule50[s] == 0)
        done[act[stop]] = True
        back[act] -= 1
    return source, copy, repeated


def encode_masks(
    positions: Any, input_format_: Any, *, history_fill: Union[str, HistoryFill] = HistoryFill.FEN_ONLY
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """lc0's compact planes: ``masks`` uint64 ``[B, 112]`` (bit s = square s, in the side to
    move's view, before the canonical turn), ``values`` float32 ``[B, 112]`` (each plane is
    ``value`` on its mask's squares) and ``transforms`` int64 ``[B]`` (the canonical turn of
    each position, 0 for the other formats)."""
    fmt = resolve_input_format(input_format_)
    fill = HistoryFill(history_fill)
    batch = prepare(positions)
    n = len(batch)
    states = batch.states
    current_index = batch.offsets[1:] - 1
    current = states.take(current_index)
    color = current.turn.astype(np.int64)
    black = color == B.BLACK
    masks = np.zeros((n, PLANES), np.uint64)
    values = np.ones((n, PLANES), np.float32)

    source, copy, repeated = _history_slots(batch, fmt, fill)
    filled = source >= 0
    bb = states.bb[np.maximum(source, 0)]  # [n, 8, 12]
    bb[~filled] = 0
    # Copies of a FEN's position with an en-passant square show the pawn before its push.
    undo = copy & filled & (states.ep[np.maximum(source, 0)] >= 0)
    if undo.any():
        r, k = np.nonzero(undo)
        s = source[r, k]
        ep = states.ep[s].astype(np.int64)
        white_moves = states.turn[s] == B.WHITE  # so Black made the double push
        pushed = np.where(white_moves, ep - 8, ep + 8)
        origin = np.where(white_moves, ep + 8, ep - 8)
        col = np.where(white_moves, 6, 0) + B.PAWN
        bb[r, k, col] = (bb[r, k, col] & ~B.SQUARE_BB[pushed]) | B.SQUARE_BB[origin]
    ours = np.where(black[:, None, None], bb[:, :, 6:], bb[:, :, :6])
    theirs = np.where(black[:, None, None], bb[:, :, :6], bb[:, :, 6:])
    steps = np.concatenate([ours, theirs], axis=2)  # [n, 8, 12]
    steps = np.where(black[:, None, None], steps.byteswap(), steps)
    history = np.zeros((n, 8, 13), np.uint64)
    history[:, :, :12] = steps
    history[:, :, 12] = np.where(repeated, _ALL, np.uint64(0))
    masks[:, :_AUX] = history.reshape(n, _AUX)

    rights = current.castling.astype(np.int64)
    we_k = np.where(black, rights & B.BLACK_KINGSIDE, rights & B.WHITE_KINGSIDE) != 0
    we_q = np.where(black, rights & B.BLACK_QUEENSIDE, rights & B.WHITE_QUEENSIDE) != 0
    they_k = np.where(black, rights & B.WHITE_KINGSIDE, rights & B.BLACK_KINGSIDE) != 0
    they_q = np.where(black, rights & B.WHITE_QUEENSIDE, rights & B.BLACK_QUEENSIDE) != 0
    zero = np.uint64(0)
    if fmt == InputFormat.CLASSICAL_112_PLANE:
        for plane, flag in enumerate((we_q, we_k, they_q, they_k)):
            masks[:, _AUX + plane] = np.where(flag, _ALL, zero)
        masks[:, _AUX + 4] = np.where(black, _ALL, zero)
    else:
        bit = lambda s: np.uint64(1 << s)  # noqa: E731
        masks[:, _AUX] = np.where(we_q, bit(0), zero) | np.where(they_q, bit(56), zero)
        masks[:, _AUX + 1] = np.where(we_k, bit(7), zero) | np.where(they_k, bit(63), zero)
        if fmt in CANONICAL_FORMATS:
            ep = current.ep.astype(np.int64)
            masks[:, _AUX + 4] = np.where(ep >= 0, B.SQUARE_BB[56 + np.maximum(ep, 0) % 8], zero)
        else:
            masks[:, _AUX + 4] = np.where(black, _ALL, zero)
    masks[:, _AUX + 5] = _ALL
    rule50 = current.rule50.astype(np.float32)
    values[:, _AUX + 5] = rule50 / np.float32(100.0) if fmt in _HECTOPLIES else rule50
    if fmt in _ARMAGEDDON:
        masks[:, _AUX + 6] = np.where(black, _ALL, zero)
    masks[:, _AUX + 7] = _ALL
    transforms = choose_transforms(current) if fmt in CANONICAL_FORMATS else np.zeros(n, np.int64)
    return masks, values, transforms


_SHIFTS: dict[torch.device, torch.Tensor] = {}
_GATHERS: dict[torch.device, torch.Tensor] = {}


def expand_planes(
    masks: Union[np.ndarray, torch.Tensor],
    values: Union[np.ndarray, torch.Tensor],
    transforms: Union[np.ndarray, torch.Tensor],
    *,
    out: Optional[torch.Tensor] = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``encode_masks``' output -> planes ``[B, 112, 8, 8]`` (row = rank 1..8, column = file
    a..h), on the device the masks are on (numpy arrays: the CPU) or into ``out``.  The
    canonical turn is applied to planes 0-108, as lc0 does (109-111 are uniform).  On the
    CPU the bits are unpacked by numpy; on a GPU by shifts of the int64 masks there."""
    n = masks.shape[0]
    if isinstance(masks, np.ndarray):
        bits = np.unpackbits(np.ascontiguousarray(masks, "<u8").view(np.uint8).reshape(n, PLANES, 8), axis=2,
                             bitorder="little")
        turned = np.nonzero(np.asarray(transforms) != 0)[0]
        if turned.size:
            index = GATHER[np.asarray(transforms)[turned]][:, None, :]
            bits[turned, : _AUX + 5] = np.take_along_axis(bits[turned, : _AUX + 5], index, axis=2)
        planes = torch.from_numpy(bits).to(torch.float32)
        v = torch.from_numpy(np.asarray(values, np.float32))
    else:
        # On the GPU nothing may wait for the device (the caller's threads would stall with
        # the GIL held): the canonical turn is gathered for every row (turn 0 is the
        # identity) and every plane scaled by its value, both cheap there.
        device = masks.device
        shifts = _SHIFTS.get(device)
        if shifts is None:
            shifts = _SHIFTS[device] = torch.arange(64, device=device, dtype=torch.int64)
            _GATHERS[device] = torch.as_tensor(GATHER, device=device)
        planes = (masks.unsqueeze(-1) >> shifts).bitwise_and_(1).to(torch.float32)  # bit 63 survives the sign
        t = torch.as_tensor(transforms, device=device)
        index = _GATHERS[device][t].unsqueeze(1).expand(-1, _AUX + 5, -1)
        planes[:, : _AUX + 5] = planes[:, : _AUX + 5].gather(2, index)
        planes.mul_(torch.as_tensor(values, device=device, dtype=torch.float32).unsqueeze(-1))
        planes = planes.view(n, PLANES, 8, 8)
        if out is not None:
            if tuple(out.shape) != tuple(planes.shape):
                raise ValueError(f"out must have shape {list(planes.shape)}, got {list(out.shape)}")
            return out.copy_(planes)
        return planes.to(dtype)
    scaled = np.nonzero((np.asarray(values) != 1).any(axis=0))[0].tolist() if n else []
    for p in scaled:  # in practice only the rule-50 plane
        planes[:, p] *= v[:, p].unsqueeze(-1)
    planes = planes.view(n, PLANES, 8, 8)
    if out is not None:
        if tuple(out.shape) != tuple(planes.shape):
            raise ValueError(f"out must have shape {list(planes.shape)}, got {list(out.shape)}")
        out.copy_(planes)
        return out
    return planes.to(dtype)


def encode_planes(
    positions: Any,
    input_format: Any,
    *,
    out: Optional[torch.Tensor] = None,
    dtype: torch.dtype = torch.float32,
    history_fill: Union[str, HistoryFill] = HistoryFill.FEN_ONLY,
) -> torch.Tensor:
    """lc0's input planes ``[B, 112, 8, 8]`` for positions (FENs, ``(fen, moves)`` pairs,
    ``Position`` objects, ``chess.Board`` objects, or a ``PositionBatch``) in a network's
    input format (an ``InputFormat``, its number or name).  Float32 on the CPU unless
    ``dtype`` / ``out`` say otherwise.  Raises ``ValueError`` naming a bad position, and
    ``Lc0FormatError`` for a format that is not encoded here, before any work."""
    masks, values, transforms = encode_masks(positions, input_format, history_fill=history_fill)
    return expand_planes(masks, values, transforms, out=out, dtype=dtype)
