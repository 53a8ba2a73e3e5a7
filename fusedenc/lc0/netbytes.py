"""The bytes of an Lc0 network file, read in bounded memory: ``load_bytes``.

A net file comes from anywhere, so its gzip stream is inflated in pieces up to a limit
(``max_bytes``) and the protobuf structure is checked as the bytes arrive
(``protobuf.StructureScan``): a gzip bomb, a truncated download or random bytes are refused
after the first piece, naming the size reached and how to read a genuinely larger net.
An uncompressed net (lc0 reads those too) is refused by its size before it is read.  The
same limit bounds the float32 tensors the layers decode to (``check_decoded_size``, before
any is decoded).
"""

from __future__ import annotations

import os
import zlib
from typing import Any, Optional, Union

from .errors import Lc0FileError
from .protobuf import StructureScan
from .schema import LC0_MAGIC, SCHEMA

__all__ = [
    "DECODED_VALUE_BYTES",
    "DEFAULT_MAX_BYTES",
    "MAX_BYTES_ENV",
    "Source",
    "check_decoded_size",
    "load_bytes",
    "max_bytes_limit",
    "not_a_net",
]

Source = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview]

GZIP_MAGIC = b"\x1f\x8b"
#: An uncompressed Net begins with field 1 (key 0x0d: fixed32) holding the magic; lc0's
#: reader goes through zlib, which passes such a file through, so lc0 reads these too.
RAW_NET_PREFIX = b"\x0d" + LC0_MAGIC.to_bytes(4, "little")

#: The most bytes ``read_net`` decompresses by default: 2 GiB.  A BT4-sized net is ~370 MB
#: (LINEAR16 or FLOAT16; ~740 MB stored FLOAT32), and 2 GiB is also the most a protobuf
#: message may hold in Google's implementations, so no standard tool writes a larger net.
#: The same limit bounds the float32 tensors decoded from the file (``check_decoded_size``:
#: a BT4-sized net's are ~760 MB), so reading a net costs at most about twice the limit: the
#: file, then its tensors (a 16-bit file just under the limit would otherwise need twice the
#: limit again).  Raise it with ``read_net(..., max_bytes=...)`` /
#: ``load_network(..., max_bytes=...)`` or the ``FUSEDENC_LC0_MAX_BYTES`` environment variable
#: (bytes).
DEFAULT_MAX_BYTES = 2 << 30
MAX_BYTES_ENV = "FUSEDENC_LC0_MAX_BYTES"
#: Compressed bytes read from a file at a time, and decompressed bytes per inflate step.
_READ_CHUNK = 1 << 22
_INFLATE_CHUNK = 1 << 24


def _size(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


_READ_LARGER = (
    "unless it is a genuinely larger net, which read_net(path, max_bytes=...) / load_network(..., max_bytes=...) "
    f"or the {MAX_BYTES_ENV} environment variable reads"
)
_RAISE_HINT = f"; a BT4-sized net is ~370 MB, so this is a damaged or hostile file {_READ_LARGER}"
#: Bytes per value of the tensors ``read_net`` decodes every layer into (float32).
DECODED_VALUE_BYTES = 4


def max_bytes_limit(max_bytes: Optional[int]) -> int:
    """The limit in force: ``max_bytes``, else the environment variable, else the default."""
    if max_bytes is None:
        env = os.environ.get(MAX_BYTES_ENV, "").strip()
        if not env:
            return DEFAULT_MAX_BYTES
        try:
            max_bytes = int(env)
        except ValueError:
            raise ValueError(f"{MAX_BYTES_ENV}={env!r} is not a whole number of bytes") from None
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
        raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
    return max_bytes


class _Input:
    """The compressed bytes in pieces, from an open file or a buffer already in memory."""

    def __init__(self, file: Any = None, data: Any = None, start: int = 0) -> None:
        self.file, self.data, self.pos = file, data, start

    def read(self) -> Any:
        if self.file is not None:
            return self.file.read(_READ_CHUNK)
        piece = self.data[self.pos : self.pos + _READ_CHUNK]
        self.pos += len(piece)
        return piece


def _gunzip(source: _Input, first: Any, name: str, max_bytes: int) -> bytearray:
    """Every gzip member of the input, inflated in pieces of at most ``_INFLATE_CHUNK`` bytes
    into one buffer of at most ``max_bytes`` (zlib checks each header and CRC), the protobuf
    structure checked as it arrives (``StructureScan``).  After the last member, bytes that
    do not start another one are ignored, as zlib's gzread (lc0's reader) ignores them."""
    out = bytearray()
    scan = StructureScan("Net", SCHEMA, max_bytes=max_bytes, limit_hint=_RAISE_HINT)
    pending: Any = first
    while True:  # one gzip member per turn
        stream = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)  # 16+: gzip framing
        while not stream.eof:
            if not pending:
                pending = source.read()
                if not pending:
                    raise Lc0FileError(
                        f"{name}: truncated gzip: the compressed data ends before its end marker "
                        "(an incomplete download?)"
                    )
            room = max_bytes - len(out) + 1  # one byte more than allowed tells that the limit is passed
            try:
                piece = stream.decompress(pending, min(_INFLATE_CHUNK, room))
            except zlib.error as exc:
                raise Lc0FileError(f"{name}: corrupt gzip data ({exc})") from None
            pending = stream.unconsumed_tail
            if not piece:
                continue
            if len(out) + len(piece) > max_bytes:
                raise Lc0FileError(
                    f"{name}: decompresses to more than {max_bytes} bytes ({_size(max_bytes)}, the max_bytes "
                    f"limit): stopped there{_RAISE_HINT}"
                )
            before = len(out)
            out += piece
            if before < 2 <= len(out) and bytes(out[:2]) in (b"1\n", b"2\n"):
                raise Lc0FileError(f"{name}: an old text-format weights file (version {chr(out[0])}), "
                                   "which lc0 itself no longer reads")
            try:
                scan.feed(out)
            except Lc0FileError as exc:
                raise not_a_net(name, out, exc) from None
        pending = stream.unused_data
        if len(pending) < 2:
            pending = bytes(pending) + bytes(source.read())
        if bytes(pending[:2]) != GZIP_MAGIC:
            return out


def check_decoded_size(name: str, values: int, largest: tuple[str, int], max_bytes: int) -> None:
    """Refuse, before any layer is decoded, a net whose float32 tensors (``values`` in all;
    ``largest``: the path and count of its largest layer) would take more than ``max_bytes``:
    the limit on the decompressed file bounds the decoded tensors too (``DEFAULT_MAX_BYTES``)."""
    need = values * DECODED_VALUE_BYTES
    if need > max_bytes:
        where, count = largest
        raise Lc0FileError(
            f"{name}: its weight layers hold {values} values (the largest: {where}, {count} values): decoding "
            f"them needs {need} bytes ({_size(need)}) of float32 tensors, more than the max_bytes limit "
            f"({max_bytes} bytes, {_size(max_bytes)}), which bounds the decoded tensors as it bounds the "
            f"decompressed file; a BT4-sized net decodes to ~760 MB, so this is a damaged or hostile file "
            f"{_READ_LARGER}"
        )


def not_a_net(name: str, raw: Any, exc: Lc0FileError) -> Lc0FileError:
    """A protobuf error, said as 'not an Lc0 network' where the data does not start like one."""
    if bytes(raw[:5]) != RAW_NET_PREFIX:
        return Lc0FileError(f"{name}: not an Lc0 network (it does not start with magic {LC0_MAGIC:#x}): {exc}")
    return Lc0FileError(f"{name}: {exc}")


def load_bytes(source: Source, name: str, max_bytes: int) -> Any:
    """The decompressed bytes of ``source`` (a path or a buffer), at most ``max_bytes``."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = memoryview(source).cast("B") if memoryview(source).ndim != 1 else memoryview(source)
        head = bytes(data[:5])
        if head[:2] == GZIP_MAGIC:
            return _gunzip(_Input(data=data), b"", name, max_bytes)
        if head == RAW_NET_PREFIX:
            if len(data) > max_bytes:
                raise Lc0FileError(f"{name}: {len(data)} bytes, more than the max_bytes limit "
                                   f"({max_bytes} bytes){_RAISE_HINT}")
            return data
        raise _not_gzip(name, head)
    with open(name, "rb") as f:
        head = f.read(5)
        if head[:2] == GZIP_MAGIC:
            return _gunzip(_Input(file=f), head, name, max_bytes)
        if head == RAW_NET_PREFIX:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                raise Lc0FileError(f"{name}: {size} bytes, more than the max_bytes limit "
                                   f"({max_bytes} bytes){_RAISE_HINT}")
            f.seek(0)
            return f.read()
        raise _not_gzip(name, head)


def _not_gzip(name: str, head: bytes) -> Lc0FileError:
    return Lc0FileError(
        f"{name}: not a gzip file (it starts with {head[:4].hex(' ') or 'nothing'}; a .pb.gz starts with 1f 8b) "
        "and not an uncompressed Lc0 network either"
    )
