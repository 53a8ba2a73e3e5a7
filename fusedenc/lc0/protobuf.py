"""A small, schema-driven reader and writer of the protobuf wire format.

Lc0 network files are protobuf messages; reading them needs only the wire format
(https://protobuf.dev/programming-guides/encoding/), not the ``protobuf`` package or
generated code.  A *schema* maps each message name to ``{field number: Field}``
(``schema.py`` holds Lc0's); ``decode`` turns bytes into nested dicts keyed by field
name, ``encode`` does the reverse.

Decoded values:

* varint kinds (``uint32``, ``uint64``, ``int32``, ``int64``, ``enum``, ``bool``) -> int / bool;
* ``float``, ``double`` -> float; ``fixed32``, ``fixed64`` -> int;
* ``string`` -> str; ``bytes`` -> a zero-copy ``memoryview`` into the input buffer
  (weight layers are hundreds of megabytes: they are not copied here);
* a message kind -> dict; a repeated field -> list (packed or not: both are read).

An absent field is absent from the dict, so ``"x" in d`` is proto2's ``has_x()``.
Fields the schema does not know are skipped, as protobuf readers do, and their
numbers listed under ``UNKNOWN_FIELDS`` so a caller can report them.  Every malformed
input raises ``Lc0FileError`` naming the field path and the byte offset.

Hostile input is bounded (files come from anywhere): one ``decode`` reads at most
``MAX_FIELDS`` fields (keys and packed values: a real BT4-sized net has ~3,000), a repeated
field holds at most its ``Field.limit`` entries (``DEFAULT_REPEATED_LIMIT`` unless the schema
says), a string at most ``MAX_STRING_BYTES``, and a 32-bit varint (``uint32``, ``int32``,
``enum``) that does not fit 32 bits is refused instead of cut to its low 32 bits.  Work is
linear in the input (a singular message seen twice is merged in place).  ``StructureScan``
checks the same structure incrementally while a file is still being decompressed, so a
damaged or hostile file is refused before all of it is inflated.
"""

from __future__ import annotations

import struct
from typing import Any, Mapping, NamedTuple, Optional, Union

from .errors import Lc0FileError

__all__ = [
    "DEFAULT_REPEATED_LIMIT",
    "MAX_FIELDS",
    "MAX_STRING_BYTES",
    "Field",
    "Schema",
    "SCALAR_KINDS",
    "StructureScan",
    "UNKNOWN_FIELDS",
    "WIRE_NAMES",
    "decode",
    "encode",
    "encode_varint",
]

#: Wire types (the low 3 bits of a field's key).  3 and 4 are the deprecated groups.
WIRE_VARINT, WIRE_64BIT, WIRE_LEN, WIRE_32BIT = 0, 1, 2, 5
WIRE_NAMES = {0: "varint", 1: "64-bit", 2: "length-delimited", 3: "group start", 4: "group end", 5: "32-bit"}

#: Scalar kind -> the wire type it travels as.  Any other kind names a message of the schema.
SCALAR_KINDS: dict[str, int] = {
    "uint32": WIRE_VARINT,
    "uint64": WIRE_VARINT,
    "int32": WIRE_VARINT,
    "int64": WIRE_VARINT,
    "enum": WIRE_VARINT,
    "bool": WIRE_VARINT,
    "float": WIRE_32BIT,
    "fixed32": WIRE_32BIT,
    "double": WIRE_64BIT,
    "fixed64": WIRE_64BIT,
    "bytes": WIRE_LEN,
    "string": WIRE_LEN,
}

#: Key of a decoded message listing the field numbers the schema did not know.
UNKNOWN_FIELDS = "unknown_fields"

#: The most fields (keys, known or not, plus packed values) one ``decode`` reads.  A BT4-sized
#: net has ~3,000; the limit keeps a small file of millions of tiny fields from costing
#: minutes of pure-Python decoding (it is reached in well under a second).
MAX_FIELDS = 1 << 18
#: Entries of a repeated field whose ``Field.limit`` is None (real nets: tens of encoder layers).
DEFAULT_REPEATED_LIMIT = 1024
#: The longest ``string`` field (a license, training parameters): strings are copied and decoded.
MAX_STRING_BYTES = 1 << 20


class Field(NamedTuple):
    """One field of a message: its name, kind (a ``SCALAR_KINDS`` key or a message name),
    whether it repeats, for enums the ``IntEnum`` that names its values, and for a repeated
    field the most entries a message may hold (None: ``DEFAULT_REPEATED_LIMIT``)."""

    name: str
    kind: str
    repeated: bool = False
    enum: Optional[type] = None
    limit: Optional[int] = None

    @property
    def max_count(self) -> int:
        return DEFAULT_REPEATED_LIMIT if self.limit is None else self.limit


Schema = Mapping[str, Mapping[int, Field]]
Buffer = Union[bytes, bytearray, memoryview]


def _where(path: str, message: str) -> str:
    return path or f"the {message} message"


def _read_varint(view: memoryview, pos: int, end: int, path: str) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it.  At most 10 bytes (64 bits)."""
    found = _try_varint(view, pos, end, path)
    if found is None:
        raise Lc0FileError(f"{path}: truncated varint at byte {pos} (the data ends at byte {end})")
    return found


def _signed(value: int, bits: int) -> int:
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


_NEGATIVE_INT32 = (1 << 64) - (1 << 31)  # the smallest sign-extended negative int32


def _varint_value(kind: str, raw: int, path: str = "") -> Any:
    """A varint's value as ``kind``.  A 32-bit kind whose varint does not fit 32 bits is an
    ``Lc0FileError`` (protobuf would keep its low 32 bits: ``moves_left = 2**40`` would read
    as NONE without a word); negative ``int32``/``enum`` values travel sign-extended."""
    if kind == "bool":
        return raw != 0
    if kind == "uint32":
        if raw > 0xFFFFFFFF:
            raise Lc0FileError(_too_wide(path, kind, raw))
        return raw
    if kind in ("int32", "enum"):  # negative ones travel as 10-byte two's complement
        if 0xFFFFFFFF < raw < _NEGATIVE_INT32:
            raise Lc0FileError(_too_wide(path, kind, raw))
        return _signed(raw, 32)
    if kind == "int64":
        return _signed(raw, 64)
    return raw & 0xFFFFFFFFFFFFFFFF


def _too_wide(path: str, kind: str, raw: int) -> str:
    return (f"{path}: {kind} value {raw} does not fit 32 bits (protobuf would keep only its low 32 bits, "
            f"{raw & 0xFFFFFFFF}): a damaged file")


def _too_many_fields(where: str, at: int, limit: int) -> str:
    return (f"{where}: more than {limit} fields in the file (at byte {at}): far more than any Lc0 network "
            f"has (a BT4-sized net has ~3,000); a damaged or hostile file")


def _too_many_entries(path: str, limit: int, at: int) -> str:
    return (f"{path}: more than {limit} entries (at byte {at}), the most fusedenc reads for this field; "
            f"real nets have far fewer")


def _too_long_string(path: str, length: int, at: int) -> str:
    return f"{path}: a string of {length} bytes at byte {at}, more than the {MAX_STRING_BYTES} bytes fusedenc reads"


_FIXED_FORMATS = {"float": "<f", "fixed32": "<I", "double": "<d", "fixed64": "<Q"}


def _merge(old: dict, new: dict, message: str, schema: "Schema", path: str, at: int) -> dict:
    """Protobuf's rule for a singular message field seen twice: merge, the later scalar wins,
    repeated fields concatenate (in place: linear however often the field repeats, and held
    to each field's entry limit)."""
    fields = {f.name: f for f in schema[message].values()}
    for key, value in new.items():
        if key == UNKNOWN_FIELDS and key in old:
            old[key] = sorted(set(old[key]) | set(value))
        elif key in old and isinstance(value, list):
            old[key].extend(value)
            field = fields.get(key)
            if field is not None and len(old[key]) > field.max_count:
                raise Lc0FileError(_too_many_entries(f"{path}.{key}" if path else key, field.max_count, at))
        elif key in old and isinstance(value, dict) and isinstance(old[key], dict):
            sub = fields[key]
            old[key] = _merge(old[key], value, sub.kind, schema, f"{path}.{key}" if path else key, at)
        else:
            old[key] = value
    return old


def _decode_packed(view: memoryview, start: int, end: int, field: Field, path: str, budget: list) -> list:
    kind = field.kind
    limit = field.max_count
    if SCALAR_KINDS[kind] == WIRE_VARINT:
        if end - start > 10 * limit:  # every varint is 1 to 10 bytes
            raise Lc0FileError(_too_many_entries(path, limit, start))
        values = []
        pos = start
        while pos < end:
            raw, pos = _read_varint(view, pos, end, path)
            values.append(_varint_value(kind, raw, path))
        budget[0] -= len(values)
        return values
    fmt = _FIXED_FORMATS[kind]
    size = struct.calcsize(fmt)
    if (end - start) % size:
        raise Lc0FileError(f"{path}: packed {kind} data of {end - start} bytes is not a multiple of {size}")
    if (end - start) // size > limit:
        raise Lc0FileError(_too_many_entries(path, limit, start))
    budget[0] -= (end - start) // size
    return [v for (v,) in struct.iter_unpack(fmt, view[start:end])]


def _decode_message(
    view: memoryview, start: int, end: int, message: str, schema: Schema, path: str, budget: list
) -> dict:
    try:
        fields = schema[message]
    except KeyError:
        raise KeyError(f"message {message!r} is not in the schema") from None
    out: dict[str, Any] = {}
    unknown: list[int] = []
    pos = start
    where = _where(path, message)
    while pos < end:
        key_at = pos
        budget[0] -= 1
        if budget[0] < 0:
            raise Lc0FileError(_too_many_fields(where, key_at, budget[1]))
        key, pos = _read_varint(view, pos, end, where)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise Lc0FileError(f"{where}: field number 0 at byte {key_at} (not valid protobuf)")
        field = fields.get(number)
        if field is None:
            fpath = fpath_item = f"{where}, field {number}"
        else:
            fpath = f"{path}.{field.name}" if path else field.name
            fpath_item = f"{fpath}[{len(out.get(field.name, []))}]" if field.repeated else fpath
        if wire == WIRE_VARINT:
            raw, pos = _read_varint(view, pos, end, fpath_item)
            payload: Any = raw
        elif wire in (WIRE_64BIT, WIRE_32BIT):
            size = 8 if wire == WIRE_64BIT else 4
            if pos + size > end:
                raise Lc0FileError(f"{fpath_item}: {size}-byte value at byte {pos} runs past the end (byte {end})")
            payload = (pos, pos + size)
            pos += size
        elif wire == WIRE_LEN:
            length, pos = _read_varint(view, pos, end, fpath_item)
            if pos + length > end:
                raise Lc0FileError(
                    f"{fpath_item}: says {length} bytes at byte {pos}, past the end of its data "
                    f"(byte {end}): the file is truncated or corrupt"
                )
            payload = (pos, pos + length)
            pos += length
        else:
            name = WIRE_NAMES.get(wire, "no such wire type")
            raise Lc0FileError(f"{fpath_item}: wire type {wire} ({name}) at byte {key_at}, which Lc0 files never use")

        if field is None:  # skipped, but remembered: the caller may want to say so
            unknown.append(number)
            continue
        expected = SCALAR_KINDS.get(field.kind, WIRE_LEN)
        packable = field.repeated and expected != WIRE_LEN
        if wire != expected and not (packable and wire == WIRE_LEN):
            raise Lc0FileError(
                f"{fpath}: wire type {wire} ({WIRE_NAMES[wire]}) at byte {key_at}, but a {field.kind} field "
                f"travels as wire type {expected} ({WIRE_NAMES[expected]})"
            )
        if packable and wire == WIRE_LEN:
            values = out.setdefault(field.name, [])
            values.extend(_decode_packed(view, payload[0], payload[1], field, fpath, budget))
            if len(values) > field.max_count:
                raise Lc0FileError(_too_many_entries(fpath, field.max_count, key_at))
            if budget[0] < 0:
                raise Lc0FileError(_too_many_fields(where, key_at, budget[1]))
            continue
        if wire == WIRE_VARINT:
            value: Any = _varint_value(field.kind, payload, fpath_item)
        elif wire != WIRE_LEN:
            (value,) = struct.unpack_from(_FIXED_FORMATS[field.kind], view, payload[0])
        elif field.kind == "bytes":
            value = view[payload[0] : payload[1]]
        elif field.kind == "string":
            if payload[1] - payload[0] > MAX_STRING_BYTES:
                raise Lc0FileError(_too_long_string(fpath_item, payload[1] - payload[0], key_at))
            value = bytes(view[payload[0] : payload[1]]).decode("utf-8", errors="replace")
        else:
            value = _decode_message(view, payload[0], payload[1], field.kind, schema, fpath_item, budget)
        if field.repeated:
            items = out.setdefault(field.name, [])
            if len(items) >= field.max_count:
                raise Lc0FileError(_too_many_entries(fpath, field.max_count, key_at))
            items.append(value)
        elif isinstance(value, dict) and isinstance(out.get(field.name), dict):
            out[field.name] = _merge(out[field.name], value, field.kind, schema, fpath, key_at)
        else:
            out[field.name] = value
    if unknown:
        out[UNKNOWN_FIELDS] = sorted(set(unknown))
    return out


def decode(
    buf: Buffer, message: str, schema: Schema, *, path: str = "", max_fields: int = MAX_FIELDS
) -> dict[str, Any]:
    """Decode ``buf`` as ``message`` of ``schema`` into nested dicts (see the module doc).

    ``path`` prefixes the field paths in error messages (empty: fields are named from the
    top, e.g. ``weights.encoder[3].mha.q_w``).  Raises ``Lc0FileError`` on malformed data
    and past the limits (``max_fields`` fields in all; see the module doc).
    """
    view = memoryview(buf)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    return _decode_message(view, 0, len(view), message, schema, path, [max_fields, max_fields])


class _Frame:
    """A message being scanned: its name, where it ends (None: where the data ends), its path
    and how many entries each of its repeated message fields has had so far."""

    __slots__ = ("message", "fields", "end", "path", "counts")

    def __init__(self, message: str, fields: Mapping[int, Field], end: Optional[int], path: str) -> None:
        self.message, self.fields, self.end, self.path = message, fields, end, path
        self.counts: dict[int, int] = {}


def _try_varint(buf: Any, pos: int, limit: int, path: str) -> Optional[tuple[int, int]]:
    """The varint at ``pos`` if its bytes are all before ``limit``, else None."""
    result = 0
    shift = 0
    start = pos
    while pos < limit:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise Lc0FileError(f"{path}: varint at byte {start} is longer than 10 bytes")
    return None


class StructureScan:
    """The structure of a ``message`` checked as its bytes arrive (``feed`` after each piece of
    a streaming decompression): keys, wire types, lengths, field and entry counts, skipping
    ``bytes`` payloads (weights) unread.  It raises ``Lc0FileError`` as soon as the data so far
    is certainly bad: a field number 0, a wire type Lc0 files never use, a field whose length
    runs past its message or past ``max_bytes`` (the whole file's limit), more than
    ``MAX_FIELDS`` fields or a repeated field past its limit; so a hostile file (a gzip bomb
    of zeros, millions of tiny fields) is refused after its first megabytes, not after
    inflating all of it.  It never reports a file as good: ``decode`` of the whole data does.
    ``limit_hint`` ends the message of a length past ``max_bytes`` (how to raise it).
    """

    def __init__(self, message: str, schema: Schema, *, max_bytes: int, max_fields: int = MAX_FIELDS,
                 limit_hint: str = "") -> None:  # fmt: skip
        self.schema = schema
        self.stack = [_Frame(message, schema[message], None, "")]
        self.pos = 0
        self.fields = 0
        self.max_bytes = max_bytes
        self.max_fields = max_fields
        self.limit_hint = limit_hint

    def feed(self, buf: Any) -> None:
        """Scan what ``buf`` (all the data so far: a bytearray that only grows) holds past the
        previous call's position."""
        avail = len(buf)
        stack = self.stack
        pos = self.pos
        try:
            while True:
                frame = stack[-1]
                end = frame.end
                if end is not None and pos >= end:
                    stack.pop()
                    continue
                limit = avail if end is None else min(end, avail)
                if pos >= limit:
                    return
                bounded = end is not None and end <= avail  # the message's bytes are all here
                where = _where(frame.path, frame.message)
                key_at = pos
                got = _try_varint(buf, pos, limit, where)
                if got is None:
                    if bounded:
                        raise Lc0FileError(f"{where}: truncated varint at byte {key_at} (the data ends at byte {end})")
                    return
                key, at = got
                number, wire = key >> 3, key & 7
                if number == 0:
                    raise Lc0FileError(f"{where}: field number 0 at byte {key_at} (not valid protobuf)")
                self.fields += 1
                if self.fields > self.max_fields:
                    raise Lc0FileError(_too_many_fields(where, key_at, self.max_fields))
                field = frame.fields.get(number)
                if field is None:
                    fpath = fpath_item = f"{where}, field {number}"
                else:
                    fpath = f"{frame.path}.{field.name}" if frame.path else field.name
                    fpath_item = f"{fpath}[{frame.counts.get(number, 0)}]" if field.repeated else fpath
                if wire == WIRE_VARINT:
                    got = _try_varint(buf, at, limit, fpath_item)
                    if got is None:
                        if bounded:
                            raise Lc0FileError(f"{fpath_item}: truncated varint at byte {at} (the data ends at byte {end})")
                        return
                    at = got[1]
                elif wire in (WIRE_64BIT, WIRE_32BIT):
                    size = 8 if wire == WIRE_64BIT else 4
                    if end is not None and at + size > end:
                        raise Lc0FileError(f"{fpath_item}: {size}-byte value at byte {at} runs past the end (byte {end})")
                    if at + size > avail:
                        return
                    at += size
                elif wire == WIRE_LEN:
                    got = _try_varint(buf, at, limit, fpath_item)
                    if got is None:
                        if bounded:
                            raise Lc0FileError(f"{fpath_item}: truncated varint at byte {at} (the data ends at byte {end})")
                        return
                    length, at = got
                    if end is not None and at + length > end:
                        raise Lc0FileError(
                            f"{fpath_item}: says {length} bytes at byte {at}, past the end of its data "
                            f"(byte {end}): the file is truncated or corrupt"
                        )
                    if at + length > self.max_bytes:
                        raise Lc0FileError(
                            f"{fpath_item}: says {length} bytes at byte {at}, which runs past the "
                            f"{self.max_bytes}-byte limit on the decompressed file{self.limit_hint}"
                        )
                else:
                    name = WIRE_NAMES.get(wire, "no such wire type")
                    raise Lc0FileError(f"{fpath_item}: wire type {wire} ({name}) at byte {key_at}, which Lc0 files never use")
                if field is not None:
                    expected = SCALAR_KINDS.get(field.kind, WIRE_LEN)
                    packable = field.repeated and expected != WIRE_LEN
                    if wire != expected and not (packable and wire == WIRE_LEN):
                        raise Lc0FileError(
                            f"{fpath}: wire type {wire} ({WIRE_NAMES[wire]}) at byte {key_at}, but a {field.kind} "
                            f"field travels as wire type {expected} ({WIRE_NAMES[expected]})"
                        )
                    if field.repeated:
                        count = frame.counts.get(number, 0) + (1 if wire != WIRE_LEN or not packable else 0)
                        if packable and wire == WIRE_LEN and length > 10 * field.max_count:
                            raise Lc0FileError(_too_many_entries(fpath, field.max_count, key_at))
                        if count > field.max_count:
                            raise Lc0FileError(_too_many_entries(fpath, field.max_count, key_at))
                        frame.counts[number] = count
                    if field.kind == "string" and length > MAX_STRING_BYTES:
                        raise Lc0FileError(_too_long_string(fpath_item, length, key_at))
                    if wire == WIRE_LEN and field.kind not in SCALAR_KINDS:
                        stack.append(_Frame(field.kind, self.schema[field.kind], at + length, fpath_item))
                        pos = at
                        continue
                pos = at + length if wire == WIRE_LEN else at
        finally:
            self.pos = pos


def encode_varint(value: int) -> bytes:
    """The varint of ``value``; a negative one is its 64-bit two's complement (10 bytes)."""
    if value < 0:
        value &= 0xFFFFFFFFFFFFFFFF
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _encode_scalar(kind: str, value: Any) -> bytes:
    """A varint or fixed-size scalar, without its key."""
    if SCALAR_KINDS[kind] == WIRE_VARINT:
        return encode_varint(int(value))
    return struct.pack(_FIXED_FORMATS[kind], value)


def _encode_parts(value: Mapping[str, Any], message: str, schema: Schema, path: str, packed: bool, parts: list) -> None:
    """Append the encoding of ``value`` to ``parts`` (a list of bytes-like pieces joined once:
    big weight layers are referenced, never copied piece by piece)."""
    fields = schema[message]
    by_name = {f.name: (n, f) for n, f in fields.items()}
    extra = set(value) - set(by_name) - {UNKNOWN_FIELDS}
    if extra:
        raise KeyError(f"{_where(path, message)}: {sorted(extra)} are not fields of {message}")
    for number in sorted(fields):
        field = fields[number]
        if field.name not in value or value[field.name] is None:
            continue
        fpath = f"{path}.{field.name}" if path else field.name
        items = value[field.name]
        if not field.repeated:
            items = [items]
        elif not isinstance(items, (list, tuple)):
            raise TypeError(f"{fpath}: a repeated field takes a list, got {type(items).__name__}")
        wire = SCALAR_KINDS.get(field.kind, WIRE_LEN)
        if field.repeated and packed and wire != WIRE_LEN:
            body = b"".join(_encode_scalar(field.kind, item) for item in items)
            parts += [encode_varint(number << 3 | WIRE_LEN), encode_varint(len(body)), body]
            continue
        for i, item in enumerate(items):
            ipath = f"{fpath}[{i}]" if field.repeated else fpath
            key = encode_varint(number << 3 | wire)
            if field.kind in SCALAR_KINDS and wire != WIRE_LEN:
                parts += [key, _encode_scalar(field.kind, item)]
            elif field.kind in SCALAR_KINDS:
                data = item.encode("utf-8") if field.kind == "string" else item
                if not isinstance(data, (bytes, bytearray, memoryview)):
                    raise TypeError(f"{ipath}: a {field.kind} field takes bytes, got {type(item).__name__}")
                parts += [key, encode_varint(memoryview(data).nbytes), data]
            else:
                sub: list = []
                _encode_parts(item, field.kind, schema, ipath, packed, sub)
                parts += [key, encode_varint(sum(memoryview(p).nbytes for p in sub))]
                parts += sub


def encode(value: Mapping[str, Any], message: str, schema: Schema, *, packed: bool = False) -> bytes:
    """Encode nested dicts (as ``decode`` returns them) as ``message`` of ``schema``.

    Fields are written in field-number order; ``packed`` writes repeated numeric fields
    packed (proto3 style) instead of one key per element (proto2's default).  A key that is not a field of its message raises ``KeyError``.
    """
    parts: list = []
    _encode_parts(value, message, schema, "", packed, parts)
    return b"".join(parts)
