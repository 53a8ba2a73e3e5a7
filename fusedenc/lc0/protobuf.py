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
"""

from __future__ import annotations

import struct
from typing import Any, Mapping, NamedTuple, Optional, Union

from .errors import Lc0FileError

__all__ = [
    "Field",
    "Schema",
    "SCALAR_KINDS",
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


class Field(NamedTuple):
    """One field of a message: its name, kind (a ``SCALAR_KINDS`` key or a message name),
    whether it repeats, and for enums the ``IntEnum`` that names its values."""

    name: str
    kind: str
    repeated: bool = False
    enum: Optional[type] = None


Schema = Mapping[str, Mapping[int, Field]]
Buffer = Union[bytes, bytearray, memoryview]


def _where(path: str, message: str) -> str:
    return path or f"the {message} message"


def _read_varint(view: memoryview, pos: int, end: int, path: str) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it.  At most 10 bytes (64 bits)."""
    result = 0
    shift = 0
    start = pos
    while True:
        if pos >= end:
            raise Lc0FileError(f"{path}: truncated varint at byte {start} (the data ends at byte {end})")
        byte = view[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise Lc0FileError(f"{path}: varint at byte {start} is longer than 10 bytes")


def _signed(value: int, bits: int) -> int:
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


def _varint_value(kind: str, raw: int) -> Any:
    """A varint's value as ``kind``: 32-bit kinds keep the low 32 bits, as protobuf does."""
    if kind == "bool":
        return raw != 0
    if kind == "uint32":
        return raw & 0xFFFFFFFF
    if kind in ("int32", "enum"):  # negative ones travel as 10-byte two's complement
        return _signed(raw, 32)
    if kind == "int64":
        return _signed(raw, 64)
    return raw & 0xFFFFFFFFFFFFFFFF


_FIXED_FORMATS = {"float": "<f", "fixed32": "<I", "double": "<d", "fixed64": "<Q"}


def _merge(old: dict, new: dict) -> dict:
    """Protobuf's rule for a singular message field seen twice: merge, the later scalar wins,
    repeated fields concatenate."""
    for key, value in new.items():
        if key in old and isinstance(value, list):
            old[key] = old[key] + value
        elif key in old and isinstance(value, dict) and isinstance(old[key], dict):
            old[key] = _merge(old[key], value)
        else:
            old[key] = value
    return old


def _decode_packed(view: memoryview, start: int, end: int, field: Field, path: str) -> list:
    kind = field.kind
    if SCALAR_KINDS[kind] == WIRE_VARINT:
        values = []
        pos = start
        while pos < end:
            raw, pos = _read_varint(view, pos, end, path)
            values.append(_varint_value(kind, raw))
        return values
    fmt = _FIXED_FORMATS[kind]
    size = struct.calcsize(fmt)
    if (end - start) % size:
        raise Lc0FileError(f"{path}: packed {kind} data of {end - start} bytes is not a multiple of {size}")
    return [v for (v,) in struct.iter_unpack(fmt, view[start:end])]


def _decode_message(view: memoryview, start: int, end: int, message: str, schema: Schema, path: str) -> dict:
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
            out.setdefault(field.name, []).extend(_decode_packed(view, payload[0], payload[1], field, fpath))
            continue
        if wire == WIRE_VARINT:
            value: Any = _varint_value(field.kind, payload)
        elif wire != WIRE_LEN:
            (value,) = struct.unpack_from(_FIXED_FORMATS[field.kind], view, payload[0])
        elif field.kind == "bytes":
            value = view[payload[0] : payload[1]]
        elif field.kind == "string":
            value = bytes(view[payload[0] : payload[1]]).decode("utf-8", errors="replace")
        else:
            value = _decode_message(view, payload[0], payload[1], field.kind, schema, fpath_item)
        if field.repeated:
            out.setdefault(field.name, []).append(value)
        elif isinstance(value, dict) and isinstance(out.get(field.name), dict):
            out[field.name] = _merge(out[field.name], value)
        else:
            out[field.name] = value
    if unknown:
        out[UNKNOWN_FIELDS] = sorted(set(unknown))
    return out


def decode(buf: Buffer, message: str, schema: Schema, *, path: str = "") -> dict[str, Any]:
    """Decode ``buf`` as ``message`` of ``schema`` into nested dicts (see the module doc).

    ``path`` prefixes the field paths in error messages (empty: fields are named from the
    top, e.g. ``weights.encoder[3].mha.q_w``).  Raises ``Lc0FileError`` on malformed data.
    """
    view = memoryview(buf)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    return _decode_message(view, 0, len(view), message, schema, path)


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
