"""lc0's self-play training data: frames in, input planes and targets out (``read_frames``,
``frames_to_planes``, ``frame_targets``), and a small writer (``write_frames``).

lc0 writes one game per gzip file, one fixed-size binary frame per position; the training
pipeline reads ``.tar`` files of such ``.gz`` files.  Two frame layouts are read here, both
little-endian and packed (no padding), written from the field list of lc0's
``src/trainingdata/trainingdata_v6.h`` / ``trainingdata_v7.h`` (lc0 909a408):

* V6, 8356 bytes: ``version`` u32 (6), ``input_format`` u32 (the net's ``InputFormat``),
  ``probabilities`` f32[1858] (the search's visit shares in lc0's policy order, in the
  net's frame; -1 for illegal moves), ``planes`` u64[104] (the 8 history steps x 13 planes),
  eight bytes that rebuild the last 8 planes (``castling_us_ooo``, ``castling_us_oo``,
  ``castling_them_ooo``, ``castling_them_oo``, ``side_to_move_or_enpassant``,
  ``rule50_count``, ``invariance_info``, ``dummy``), 15 f32 evaluations (``root_q``,
  ``best_q``, ``root_d``, ``best_d``, ``root_m``, ``best_m``, ``plies_left``, ``result_q``,
  ``result_d``, ``played_q``, ``played_d``, ``played_m``, ``orig_q``, ``orig_d``,
  ``orig_m``), ``visits`` u32, ``played_idx`` u16, ``best_idx`` u16, ``policy_kld`` f32,
  ``q_st`` f32.
* V7, 8396 bytes: V6, then ``d_st`` f32, ``opp_played_idx`` u16, ``next_played_idx`` u16,
  ``reserved`` f32[8].  lc0's self-play writes only V6 (its writer takes V6 frames; its
  rescorer is also built for V7); lczero-training's loader (7c5d756) upgrades V6 chunks to
  V7 in memory, with version 7 and the two look-ahead indices 65535 where the game has no
  such move.  No V7 file made by lc0's tools was at hand to check against.

How the bytes become the net's planes (lc0's ``PlanesFromTrainingData``, src/trainingdata/reader.cc):

* ``planes`` are lc0's 64-bit plane masks with the bits of each byte reversed: byte ``r``
  is rank ``r + 1`` and its most significant bit is file a (so numpy's big-endian
  ``unpackbits`` gives squares a1, b1, ..., h8).  They are already in the side to move's
  view and, in the canonical formats, already turned (``encoding.choose_transforms``).
* planes 104-107: format 1 fills each with ones where its castling byte is non-zero; the
  other formats hold one bit per rook that may castle: the byte is a file mask (bit ``f`` =
  file ``f``, *not* reversed) put on rank 1 for ``us`` and rank 8 for ``them``, in planes 104
  (queenside) and 105 (kingside); 106 and 107 are zeros.
* plane 108: canonical formats (>= 3): the en-passant file mask on rank 8 (stored already
  flipped when the board was); formats 1-2: ones when the byte is non-zero (Black to move).
* plane 109: ``rule50_count``, divided by 100 in the hectoplies formats (>= 4, armageddon too).
* plane 110: ones only in the armageddon formats (132, 133) when bit 7 of ``invariance_info``
  (Black to move) is set; plane 111: ones.

``invariance_info`` holds, in the canonical formats, the board turn in bits 0-2 (flip,
mirror, transpose: ``encoding.FLIP`` etc.) and the side to move in bit 7; bits 3-5 are flags
(best Q proven, game adjudicated, game length exceeded), bit 6 a rescorer's delete mark.

Where lc0's sources leave a choice, it is made here on purpose, and said:

* lc0's reader *undoes* the canonical turn before it returns planes (its rescorer wants the
  real board; its loop also reads one plane past the end).  The net, and lczero-training's
  loader, see the turned planes, which is what ``encoding.encode_planes`` gives:
  ``frames_to_planes`` returns those by default, and lc0's unturned planes with
  ``undo_transform=True``.
* lczero-training's newer loader (csrc/loader/stages/tensor_generator.cc, 7c5d756) does not
  follow lc0's reader for planes 104-110: it fills each with its byte's value as a uniform
  plane and divides rule-50 by 99.  That is a convention of that trainer, not of the frame
  format, and it is not followed here.
* Frames of versions 3-5 (which lc0's reader upgrades in memory) are refused: only 6 and 7
  are read.  The version field decides the frame size (lczero-training takes it from its
  configuration instead); a file's frames must all share it, and so must a tar's members.
* ``probabilities`` and the move indices are stored as given: the policy index of a move in
  a *transposed* canonical position is where fusedenc and lc0 909a408's ``MoveToNNIndex``
  differ (``policy.py``), so ``write_frames``' default policy follows fusedenc's frame and
  frames from lc0 carry lc0's.
* After a gzip stream, bytes that start no further gzip member are ignored, as zlib's
  ``gzread`` (lc0's reader) ignores them.

Decompression is bounded: a file or tar member that inflates to more than ``max_bytes``
(1 GiB by default, ~128k frames; a game is a few hundred) is refused when the limit is
passed, so a gzip bomb costs at most the limit.  Every refusal of a file's content is an
``Lc0FileError`` naming the file (and the tar member, and the frame where one is at fault).
"""

from __future__ import annotations

import gzip
import os
import tarfile
import zlib
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional, Union

import numpy as np

from . import board as B
from .encoding import (
    CANONICAL_FORMATS,
    FLIP,
    SQUARE_MAP,
    SUPPORTED_INPUT_FORMATS,
    encode_masks,
    expand_planes,
    resolve_input_format,
)
from .errors import Lc0FileError, Lc0FormatError
from .moves import NUM_POLICY_MOVES
from .policy import policy_indices
from .positions import prepare
from .schema import InputFormat

__all__ = [
    "DEFAULT_MAX_BYTES",
    "FRAME_DTYPES",
    "FRAME_SIZES",
    "FrameChunk",
    "V6_FRAME",
    "V7_FRAME",
    "frame_targets",
    "frames_to_planes",
    "read_frames",
    "write_frames",
]

_F32, _U8, _U16, _U32, _U64 = "<f4", "u1", "<u2", "<u4", "<u8"

#: The V6 frame, field by field in file order (numpy packs a structured dtype: no padding).
V6_FRAME = np.dtype(
    [
        ("version", _U32),
        ("input_format", _U32),
        ("probabilities", _F32, (NUM_POLICY_MOVES,)),
        ("planes", _U64, (104,)),
        ("castling_us_ooo", _U8),
        ("castling_us_oo", _U8),
        ("castling_them_ooo", _U8),
        ("castling_them_oo", _U8),
        ("side_to_move_or_enpassant", _U8),
        ("rule50_count", _U8),
        ("invariance_info", _U8),
        ("dummy", _U8),  # the game result as an int8 before V6; unused since
        ("root_q", _F32),
        ("best_q", _F32),
        ("root_d", _F32),
        ("best_d", _F32),
        ("root_m", _F32),
        ("best_m", _F32),
        ("plies_left", _F32),
        ("result_q", _F32),
        ("result_d", _F32),
        ("played_q", _F32),
        ("played_d", _F32),
        ("played_m", _F32),
        ("orig_q", _F32),  # the net's own eval; NaN where lc0 had none cached
        ("orig_d", _F32),
        ("orig_m", _F32),
        ("visits", _U32),
        ("played_idx", _U16),
        ("best_idx", _U16),
        ("policy_kld", _F32),
        ("q_st", _F32),
    ]
)
#: The V7 frame: V6's fields, then four more.
V7_FRAME = np.dtype(
    V6_FRAME.descr
    + [
        ("d_st", _F32),
        ("opp_played_idx", _U16),
        ("next_played_idx", _U16),
        ("reserved", _F32, (8,)),
    ]
)
# The sizes lc0's headers assert: a field wrong by a byte anywhere shows here, at import.
assert V6_FRAME.itemsize == 8356, V6_FRAME.itemsize
assert V7_FRAME.itemsize == 8396, V7_FRAME.itemsize

FRAME_DTYPES = {6: V6_FRAME, 7: V7_FRAME}
FRAME_SIZES = {version: dtype.itemsize for version, dtype in FRAME_DTYPES.items()}

#: The most bytes one file (or tar member) may decompress to: 1 GiB, ~128k V6 frames.
DEFAULT_MAX_BYTES = 1 << 30
_GZIP_MAGIC = b"\x1f\x8b"
_READ_CHUNK = 1 << 20
_INFLATE_CHUNK = 1 << 22

# lc0's numbering rules for the input formats (src/neural/encoder.cc), kept apart from the
# encoder's own sets so that the two are checked against each other by the tests.
_CASTLING_RIGHTS_FROM = InputFormat.WITH_CASTLING_PLANE  # >= 2: rook file masks
_CANONICAL_FROM = InputFormat.WITH_CANONICALIZATION  # >= 3: en-passant plane, board turns
_HECTOPLIES_FROM = InputFormat.WITH_CANONICALIZATION_HECTOPLIES  # >= 4: rule-50 / 100
_ARMAGEDDON = (InputFormat.WITH_CANONICALIZATION_HECTOPLIES_ARMAGEDDON, InputFormat.WITH_CANONICALIZATION_V2_ARMAGEDDON)
_BLACK_TO_MOVE_BIT = 0x80
_TRANSFORM_BITS = 0x07

_REVERSED_BYTE = np.array([int(f"{b:08b}"[::-1], 2) for b in range(256)], np.uint8)


@dataclass
class FrameChunk:
    """The frames of one file or tar member: ``frames`` (a structured array of
    ``FRAME_DTYPES[version]``), ``version`` (6 or 7) and ``source`` (the file, and the member
    for a tar), which error messages name."""

    frames: np.ndarray
    version: int
    source: str

    def __len__(self) -> int:
        return len(self.frames)


# --- reading -------------------------------------------------------------------------------


def _size(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def _limit(max_bytes: Optional[int]) -> int:
    if max_bytes is None:
        return DEFAULT_MAX_BYTES
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
        raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
    return max_bytes


def _too_large(name: str, max_bytes: int) -> Lc0FileError:
    return Lc0FileError(
        f"{name}: holds more than {max_bytes} bytes of frames ({_size(max_bytes)}, the max_bytes limit): stopped "
        "there; a game is a few MB at most, so this is a damaged or hostile file unless read_frames(..., "
        "max_bytes=...) is raised for it"
    )


def _gunzip(read: Any, first: bytes, name: str, max_bytes: int) -> bytearray:
    """Every gzip member of a stream (``read()`` gives the next compressed piece, ``first``
    the bytes already read), inflated in bounded pieces into one buffer of at most
    ``max_bytes``; zlib checks each member's header and CRC."""
    out = bytearray()
    pending = first
    while True:  # one gzip member per turn, as gzread reads concatenated members
        stream = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        while not stream.eof:
            if not pending:
                pending = read()
                if not pending:
                    raise Lc0FileError(f"{name}: truncated gzip: the compressed data ends before its end marker")
            room = max_bytes - len(out) + 1  # one byte past the limit says it is passed
            try:
                piece = stream.decompress(pending, min(_INFLATE_CHUNK, room))
            except zlib.error as exc:
                raise Lc0FileError(f"{name}: corrupt gzip data ({exc})") from None
            pending = stream.unconsumed_tail
            if len(out) + len(piece) > max_bytes:
                raise _too_large(name, max_bytes)
            out += piece
        pending = stream.unused_data
        if len(pending) < 2:
            pending = bytes(pending) + bytes(read() or b"")
        if bytes(pending[:2]) != _GZIP_MAGIC:
            return out


def _is_tar_header(head: bytes) -> bool:
    # POSIX and GNU tars carry "ustar" at byte 257 of every header.
    return len(head) >= 262 and head[257:262] == b"ustar"


def _version_of(head: bytes) -> Optional[int]:
    return int.from_bytes(head[:4], "little") if len(head) >= 4 else None


def _frames(data: Union[bytes, bytearray], name: str) -> FrameChunk:
    """Decompressed bytes -> frames, or the ``Lc0FileError`` that says what is wrong."""
    if len(data) == 0:
        raise Lc0FileError(f"{name}: holds no frames (0 bytes)")
    if _is_tar_header(bytes(data[:512])):
        raise Lc0FileError(f"{name}: a tar inside gzip (.tar.gz); read_frames reads a .tar of .gz files: "
                           "gunzip it first")
    version = _version_of(bytes(data[:4]))
    if version not in FRAME_DTYPES:
        shown = "less than 4 bytes" if version is None else f"version {version}"
        raise Lc0FileError(
            f"{name}: frame 0 has {shown}: not a training-data frame fusedenc reads (versions "
            f"{', '.join(map(str, FRAME_DTYPES))}: {', '.join(f'{s} bytes' for s in FRAME_SIZES.values())}; "
            "lc0 upgrades versions 3-5 itself)"
        )
    size = FRAME_SIZES[version]
    whole, extra = divmod(len(data), size)
    if extra:
        raise Lc0FileError(
            f"{name}: truncated: {len(data)} bytes are not a whole number of V{version} frames ({size} bytes "
            f"each): {whole} frames and {extra} bytes over"
        )
    frames = np.frombuffer(data, dtype=FRAME_DTYPES[version])  # shares the buffer: no copy
    wrong = np.nonzero(frames["version"] != version)[0]
    if wrong.size:
        i = int(wrong[0])
        raise Lc0FileError(
            f"{name}: frame {i} has version {int(frames['version'][i])} where frame 0 has {version}: mixed versions "
            f"(or frames of another size: {len(wrong)} of {whole} frames disagree)"
        )
    return FrameChunk(frames, version, name)


def _read_stream(f: Any, head: bytes, name: str, size: Optional[int], max_bytes: int) -> FrameChunk:
    """One gzip or raw stream of frames (a file or a tar member), ``head`` already read."""
    if head[:2] == _GZIP_MAGIC:
        return _frames(_gunzip(lambda: f.read(_READ_CHUNK), head, name, max_bytes), name)
    if _version_of(head) in FRAME_DTYPES:  # uncompressed frames
        if size is not None and size > max_bytes:
            raise _too_large(name, max_bytes)
        data = bytearray(head)
        while len(data) <= max_bytes:
            piece = f.read(_READ_CHUNK)
            if not piece:
                return _frames(data, name)
            data += piece
        raise _too_large(name, max_bytes)
    raise Lc0FileError(
        f"{name}: not gzip (it starts with {head[:4].hex(' ') or 'nothing'}; gzip starts with 1f 8b), not a tar, "
        f"and not uncompressed frames either (those start with version {' or '.join(map(str, FRAME_DTYPES))})"
    )


def _tar_chunks(path: str, max_bytes: int) -> Iterator[FrameChunk]:
    version = None
    found = 0
    last = None  # the member read last, to say where a damaged tar ends
    try:
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                # Directories and links hold no frames; lc0's training tars may carry a LICENSE.
                if not member.isfile() or os.path.basename(member.name) == "LICENSE":
                    continue
                name = f"{path} member {member.name!r}"
                last = member.name
                f = tar.extractfile(member)
                try:
                    chunk = _read_stream(f, f.read(512), name, member.size, max_bytes)
                except (tarfile.TarError, OSError, EOFError) as exc:
                    raise Lc0FileError(f"{name}: the tar ends inside this member ({exc})") from None
                if version is not None and chunk.version != version:
                    raise Lc0FileError(f"{name}: V{chunk.version} frames where the tar's first member has V{version}")
                version = chunk.version
                found += 1
                yield chunk
    except tarfile.TarError as exc:
        where = "" if last is None else f" after member {last!r}"
        raise Lc0FileError(f"{path}: a damaged tar{where} ({exc})") from None
    if not found:
        raise Lc0FileError(f"{path}: a tar with no member holding frames")


def read_frames(path: Union[str, "os.PathLike[str]"], *, max_bytes: Optional[int] = None
                ) -> Union[FrameChunk, Iterator[FrameChunk]]:
    """The training frames of a file: a ``FrameChunk`` for a ``.gz`` of frames (or an
    uncompressed file of them), an iterator of ``FrameChunk``, one per member, for a ``.tar``
    of such files (each member is read and checked as the iterator reaches it).

    Refused with ``Lc0FileError`` naming the file (and member, and frame): not gzip, tar or
    frames; truncated gzip; a size that is not a whole number of frames; a version other than
    6 or 7; frames (or members) of different versions; more than ``max_bytes`` (default
    ``DEFAULT_MAX_BYTES``) once decompressed."""
    max_bytes = _limit(max_bytes)
    name = os.fspath(path)
    with open(name, "rb") as f:
        head = f.read(512)
        if head[:2] != _GZIP_MAGIC and _version_of(head) not in FRAME_DTYPES:
            is_tar = _is_tar_header(head)
            if not is_tar:
                f.seek(0)
                is_tar = len(head) >= 512 and tarfile.is_tarfile(f)  # an old (pre-POSIX) tar
            if is_tar:
                return _tar_chunks(name, max_bytes)
        return _read_stream(f, head, name, os.fstat(f.fileno()).st_size, max_bytes)


# --- frames -> planes and targets ------------------------------------------------------------


def _as_frames(frames: Any) -> tuple[np.ndarray, str]:
    if isinstance(frames, FrameChunk):
        return frames.frames, frames.source
    frames = np.asarray(frames)
    if frames.dtype not in FRAME_DTYPES.values() or frames.ndim != 1:
        raise TypeError(f"frames must be a FrameChunk or a 1-d array of V6_FRAME / V7_FRAME, got {frames.dtype} "
                        f"with shape {frames.shape}")
    return frames, "frames"


def _file_bits(byte: np.ndarray) -> np.ndarray:
    """uint8 file masks (bit f = file f) -> ``[n, 8]`` 0/1, file a first."""
    return np.unpackbits(np.asarray(byte, np.uint8)[:, None], axis=1, bitorder="little")


def frames_to_planes(frames: Any, *, undo_transform: bool = False) -> np.ndarray:
    """The net's 112 input planes ``[n, 112, 8, 8]`` float32 (row = rank 1..8, column = file
    a..h) from frames (a ``FrameChunk`` or a structured array of either version), as lc0's
    reader builds them (see the module docstring).  They equal ``encoding.encode_planes`` of
    the same positions in the frames' input format; ``undo_transform=True`` turns the
    canonical formats' boards back, as lc0's reader does.  ``Lc0FormatError`` names a frame
    whose input format is not one of lc0's."""
    frames, source = _as_frames(frames)
    n = len(frames)
    fmt = frames["input_format"].astype(np.int64)
    bad = np.nonzero(~np.isin(fmt, [int(f) for f in SUPPORTED_INPUT_FORMATS]))[0]
    if bad.size:
        i = int(bad[0])
        raise Lc0FormatError(
            f"{source}: frame {i}: input format {int(fmt[i])} is not one lc0 encodes "
            f"({', '.join(str(int(f)) for f in SUPPORTED_INPUT_FORMATS)}; {bad.size} frames have such formats)"
        )
    planes = np.zeros((n, 112, 8, 8), np.float32)
    packed = np.ascontiguousarray(frames["planes"], dtype="<u8").view(np.uint8).reshape(n, 104, 8)
    planes[:, :104] = np.unpackbits(packed, axis=2, bitorder="big").reshape(n, 104, 8, 8)

    castling = [frames[k] for k in ("castling_us_ooo", "castling_us_oo", "castling_them_ooo", "castling_them_oo")]
    classical = fmt < _CASTLING_RIGHTS_FROM
    for k, byte in enumerate(castling):  # format 1: one uniform plane per castling right
        planes[classical, 104 + k] = (byte[classical] != 0)[:, None, None]
    rooks = ~classical
    for k, (ours, theirs) in enumerate(((castling[0], castling[2]), (castling[1], castling[3]))):
        planes[rooks, 104 + k, 0] = _file_bits(ours[rooks])  # our rooks on rank 1
        planes[rooks, 104 + k, 7] = _file_bits(theirs[rooks])  # theirs on rank 8

    side_or_ep = frames["side_to_move_or_enpassant"]
    canonical = fmt >= _CANONICAL_FROM
    planes[canonical, 108, 7] = _file_bits(side_or_ep[canonical])  # the en-passant file, rank 8
    planes[~canonical, 108] = (side_or_ep[~canonical] != 0)[:, None, None]
    rule50 = frames["rule50_count"].astype(np.float32)
    planes[:, 109] = np.where(fmt >= _HECTOPLIES_FROM, rule50 / np.float32(100.0), rule50)[:, None, None]
    info = frames["invariance_info"]
    armageddon_black = np.isin(fmt, [int(f) for f in _ARMAGEDDON]) & ((info & _BLACK_TO_MOVE_BIT) != 0)
    planes[armageddon_black, 110] = 1.0
    planes[:, 111] = 1.0

    if undo_transform:
        transform = np.where(canonical, info & _TRANSFORM_BITS, 0).astype(np.int64)
        turned = np.nonzero(transform)[0]
        if turned.size:
            # A turned plane holds square SQUARE_MAP[t, s] where the real board has s; planes
            # 109-111 are uniform, so only 0-108 move (lc0 turns every non-uniform plane).
            flat = planes[turned, :109].reshape(turned.size, 109, 64)
            index = SQUARE_MAP[transform[turned]][:, None, :]
            planes[turned, :109] = np.take_along_axis(flat, index, axis=2).reshape(turned.size, 109, 8, 8)
    return planes


def frame_targets(frames: Any) -> dict[str, np.ndarray]:
    """Everything in the frames besides the planes, as arrays (copies, native byte order):
    ``probabilities`` ``[n, 1858]`` and every scalar field of the layout (``result_q``,
    ``result_d``, ``best_q``, ``best_d``, ``played_idx``, ``best_idx``, ``plies_left``, ...;
    V7 adds ``q_st``'s partner ``d_st`` and the look-ahead indices), plus three read off them:
    ``result_wdl`` ``[n, 3]`` (win, draw, loss for the side to move, from ``result_q`` /
    ``result_d``), ``black_to_move`` (bit 7 of ``invariance_info`` in canonical formats,
    the side-to-move byte otherwise, as lc0 decides) and ``transform`` (the canonical board
    turn, 0 for other formats)."""
    frames, _ = _as_frames(frames)
    out = {name: frames[name].astype(frames.dtype[name].base.newbyteorder("=")) for name in frames.dtype.names
           if name != "planes"}
    q, d = out["result_q"], out["result_d"]
    out["result_wdl"] = np.stack([(1 - d + q) / 2, d, (1 - d - q) / 2], axis=1).astype(np.float32)
    canonical = frames["input_format"] >= _CANONICAL_FROM
    info = frames["invariance_info"]
    side = frames["side_to_move_or_enpassant"] != 0
    out["black_to_move"] = np.where(canonical, (info & _BLACK_TO_MOVE_BIT) != 0, side)
    out["transform"] = np.where(canonical, info & _TRANSFORM_BITS, 0).astype(np.int64)
    return out


# --- writing -------------------------------------------------------------------------------

#: Fields ``write_frames`` fills from the positions (and ``policies``): ``results`` may not set them.
_FROM_POSITIONS = {"version", "input_format", "probabilities", "planes", "castling_us_ooo", "castling_us_oo",
                   "castling_them_ooo", "castling_them_oo", "side_to_move_or_enpassant", "rule50_count",
                   "invariance_info", "dummy"}
_NO_MOVE = 0xFFFF  # lczero-training's "no such move" in V7's look-ahead indices


def _set_results(frames: np.ndarray, results: Any) -> None:
    n = len(frames)
    if isinstance(results, Mapping):
        items = dict(results)
    else:
        values = np.asarray(results, np.float32)
        if values.shape != (n, 2):
            raise ValueError(f"results must be [{n}, 2] (result_q, result_d) or a mapping of field names to values, "
                             f"got shape {list(values.shape)}")
        items = {"result_q": values[:, 0], "result_d": values[:, 1]}
    for name, value in items.items():
        if name not in frames.dtype.names or name in _FROM_POSITIONS:
            settable = sorted(set(frames.dtype.names) - _FROM_POSITIONS)
            raise ValueError(f"results cannot set {name!r}; the fields it sets: {', '.join(settable)}")
        field = frames.dtype[name]
        shape = (n,) + field.shape
        value = np.asarray(value)
        if value.shape != shape:
            raise ValueError(f"results[{name!r}] must have shape {list(shape)}, got {list(value.shape)}")
        if field.base.kind == "u":
            info = np.iinfo(field.base)
            if value.dtype.kind not in "iu" or (value.size and (value.min() < info.min or value.max() > info.max)):
                raise ValueError(f"results[{name!r}] must be integers in {info.min}..{info.max}")
        frames[name] = value


def write_frames(
    path: Union[str, "os.PathLike[str]"],
    positions: Any,
    input_format: Any,
    policies: Any = None,
    results: Any = None,
    version: int = 6,
) -> np.ndarray:
    """Write one gzip file of training frames for positions (anything ``prepare`` takes:
    FENs, ``(fen, moves)`` pairs, ``Position`` objects ...) in a net's input format, and
    return the frames written.

    The planes and the eight bytes after them are made from ``encoding.encode_masks``, as lc0
    makes them from its encoder.  ``policies``: ``[n, 1858]`` float32, stored as given
    (default: a uniform share over each position's legal moves, -1 for the others, as lc0
    marks illegal moves); ``results``: ``[n, 2]`` (``result_q``, ``result_d``) or a mapping of
    field names to per-position values for any other field (``best_q``, ``played_idx``,
    ``plies_left``, ...; default: an undecided game, q 0 and d 1, as lc0 writes before the
    game ends; ``orig_*`` NaN; ``best_idx`` and ``played_idx`` the policy's argmax; V7's
    look-ahead indices 65535).  ``version``: 6 or 7."""
    if version not in FRAME_DTYPES:
        raise ValueError(f"version must be one of {sorted(FRAME_DTYPES)}, got {version!r}")
    fmt = resolve_input_format(input_format)
    batch = prepare(positions)
    n = len(batch)
    masks, values, transforms = encode_masks(batch, fmt)
    current = batch.current
    black = current.turn == B.BLACK
    rule50 = current.rule50.astype(np.int64)
    if n and rule50.max() > 255:
        i = int(np.argmax(rule50))
        raise ValueError(f"position {i}: rule-50 count {int(rule50[i])} does not fit the frame's byte (0..255)")

    frames = np.zeros(n, FRAME_DTYPES[version])
    frames["version"] = version
    frames["input_format"] = int(fmt)
    planes = expand_planes(masks, values, transforms).numpy()[:, :104]  # turned, as the net sees them
    bits = (planes.reshape(n, 104, 64) != 0).astype(np.uint8)
    frames["planes"] = np.packbits(bits, axis=2, bitorder="big").reshape(n, 104 * 8).view("<u8")

    if fmt == InputFormat.CLASSICAL_112_PLANE:
        for k, name in enumerate(("castling_us_ooo", "castling_us_oo", "castling_them_ooo", "castling_them_oo")):
            frames[name] = masks[:, 104 + k] != 0
        frames["side_to_move_or_enpassant"] = black
    else:
        # One bit per rook that may castle, at its file: ours on rank 1, theirs on rank 8.
        frames["castling_us_ooo"] = masks[:, 104] & np.uint64(0xFF)
        frames["castling_them_ooo"] = masks[:, 104] >> np.uint64(56)
        frames["castling_us_oo"] = masks[:, 105] & np.uint64(0xFF)
        frames["castling_them_oo"] = masks[:, 105] >> np.uint64(56)
        if fmt in CANONICAL_FORMATS:
            ep = (masks[:, 108] >> np.uint64(56)).astype(np.uint8)
            # Stored as the net sees it: flipped with the board (the only turn a board with a pawn gets).
            frames["side_to_move_or_enpassant"] = np.where((transforms & FLIP) != 0, _REVERSED_BYTE[ep], ep)
            frames["invariance_info"] = transforms.astype(np.uint8) | np.where(black, _BLACK_TO_MOVE_BIT, 0)
        else:
            frames["side_to_move_or_enpassant"] = black
    frames["rule50_count"] = rule50

    if policies is None:
        probabilities = np.full((n, NUM_POLICY_MOVES), -1.0, np.float32)
        _, indices, starts, counts = policy_indices(batch, fmt)
        rows = np.repeat(np.arange(n), counts)
        probabilities[rows, indices] = (1.0 / np.maximum(counts, 1))[rows]
    else:
        probabilities = np.asarray(policies)
        if probabilities.shape != (n, NUM_POLICY_MOVES):
            raise ValueError(f"policies must be [{n}, {NUM_POLICY_MOVES}], got {list(probabilities.shape)}")
    frames["probabilities"] = probabilities
    frames["result_d"] = 1.0
    for name in ("orig_q", "orig_d", "orig_m"):
        frames[name] = np.nan
    best = np.argmax(frames["probabilities"], axis=1) if n else np.zeros(0, np.int64)
    frames["best_idx"] = best
    frames["played_idx"] = best
    if version == 7:
        frames["opp_played_idx"] = _NO_MOVE
        frames["next_played_idx"] = _NO_MOVE
    if results is not None:
        _set_results(frames, results)

    # mtime 0: the same frames make the same file.
    with open(os.fspath(path), "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        f.write(frames.tobytes())
    return frames
