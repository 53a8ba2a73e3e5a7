"""Weight layers: ``Weights.Layer`` messages to float32 tensors, and back.

A layer is ``params`` (little-endian bytes), an ``encoding`` (absent = LINEAR16) and,
for LINEAR16, the ``min_val``/``max_val`` its uint16 codes map onto.  Decoding follows
lc0's reader: ``theta = u / 65535`` and ``v = min * (1 - theta) + max * theta`` in float32;
FLOAT16/BFLOAT16 widen exactly to float32.  Dense weights are stored ``[out][in]``.

Everything is vectorised over whole layers (a BT4-sized net holds ~190 M values).
Errors name the layer's path, e.g. ``weights.encoder[3].mha.q_w``.
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from .errors import Lc0FileError, Lc0FormatError
from .protobuf import SCALAR_KINDS, UNKNOWN_FIELDS, Schema
from .schema import LAYER, SCHEMA, LayerEncoding

__all__ = [
    "ELEMENT_BYTES",
    "decode_layer",
    "decode_weight_tree",
    "encode_layer",
    "expect_shape",
    "layer_encoding",
]

#: Bytes per stored value of each encoding.
ELEMENT_BYTES: dict[LayerEncoding, int] = {
    LayerEncoding.LINEAR16: 2,
    LayerEncoding.FLOAT16: 2,
    LayerEncoding.BFLOAT16: 2,
    LayerEncoding.FLOAT32: 4,
}

#: The torch dtype each encoding's bytes are read as.
_STORED_DTYPE = {
    LayerEncoding.LINEAR16: torch.uint16,
    LayerEncoding.FLOAT16: torch.float16,
    LayerEncoding.BFLOAT16: torch.bfloat16,
    LayerEncoding.FLOAT32: torch.float32,
}

_KNOWN = ", ".join(f"{e.name} {int(e)}" for e in ELEMENT_BYTES)


def layer_encoding(layer: Mapping[str, Any], where: str) -> LayerEncoding:
    """The layer's encoding; LINEAR16 when the field is absent, as lc0 reads it."""
    value = layer.get("encoding", LayerEncoding.LINEAR16)
    if value not in ELEMENT_BYTES.keys():
        name = LayerEncoding(value).name if value in {int(e) for e in LayerEncoding} else "not in net.proto"
        raise Lc0FileError(f"{where}: unknown layer encoding {value} ({name}); known: {_KNOWN}")
    return LayerEncoding(value)


def _swap_bytes(t: torch.Tensor) -> torch.Tensor:
    """Reverse each element's bytes (for a big-endian host: the file is little-endian)."""
    size = t.element_size()
    if size == 1 or t.numel() == 0:
        return t
    return t.contiguous().view(torch.uint8).view(-1, size).flip(1).contiguous().view(t.dtype).view(t.shape)


def _from_le_bytes(data: Any, dtype: torch.dtype) -> torch.Tensor:
    # A private writable copy: torch.frombuffer wants a writable buffer, and the copy frees the
    # file's buffer from this tensor's lifetime (FLOAT32 layers would otherwise pin it).
    t = torch.frombuffer(bytearray(data), dtype=dtype)
    return t if sys.byteorder == "little" else _swap_bytes(t)


def _to_le_bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return b""
    if sys.byteorder != "little":
        t = _swap_bytes(t)
    out = bytearray(t.numel() * t.element_size())
    torch.frombuffer(out, dtype=t.dtype).copy_(t)
    return bytes(out)


def decode_layer(layer: Mapping[str, Any], where: str) -> torch.Tensor:
    """A decoded ``Weights.Layer`` (as ``protobuf.decode`` returns it) as a float32 tensor:
    shaped by ``dims`` when the layer has them, else 1-D.

    Raises ``Lc0FileError`` naming ``where`` for an unknown encoding, a byte count that is
    not a whole number of values, a LINEAR16 layer with values but no ``min_val``/``max_val``
    (lc0 would silently read 0 for both), ``dims`` that do not hold the values, and
    non-finite values.
    """
    encoding = layer_encoding(layer, where)
    params = layer.get("params", b"")
    nbytes = memoryview(params).nbytes
    size = ELEMENT_BYTES[encoding]
    if nbytes % size:
        raise Lc0FileError(
            f"{where}: {nbytes} bytes of {encoding.name} data is not a whole number of {size}-byte values"
        )
    count = nbytes // size
    dims = [int(d) for d in layer.get("dims", ())]
    if dims and math.prod(dims) != count:
        raise Lc0FileError(
            f"{where}: dims {dims} hold {math.prod(dims)} values, but params has {nbytes} bytes "
            f"= {count} {encoding.name} values"
        )
    shape = tuple(dims) if dims else (count,)
    if count == 0:
        return torch.zeros(shape, dtype=torch.float32)

    raw = _from_le_bytes(params, _STORED_DTYPE[encoding])
    if encoding == LayerEncoding.LINEAR16:
        missing = [name for name in ("min_val", "max_val") if name not in layer]
        if missing:
            raise Lc0FileError(f"{where}: LINEAR16 layer with {count} values but no {' or '.join(missing)}")
        lo, hi = float(layer["min_val"]), float(layer["max_val"])
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise Lc0FileError(f"{where}: LINEAR16 range [{lo}, {hi}] is not finite")
        # lc0's formula, min * (1 - theta) + max * theta with theta = u / 65535, step by step
        # in float32 (in place: a layer can be 25 M values).
        theta = raw.to(torch.float32).div_(65535.0)
        values = torch.mul(theta, hi)
        values.add_(theta.neg_().add_(1.0).mul_(lo))
    else:
        values = raw.to(torch.float32)
        bad = int((~torch.isfinite(values)).sum())
        if bad:
            raise Lc0FileError(f"{where}: {bad} of {count} {encoding.name} values are NaN or infinite")
    return values.view(shape)


def encode_layer(
    values: torch.Tensor,
    encoding: Union[LayerEncoding, int, str] = LayerEncoding.LINEAR16,
    *,
    dims: bool = False,
) -> dict[str, Any]:
    """A ``Weights.Layer`` dict (for ``protobuf.encode``) holding ``values``, flattened in
    row-major order.  ``dims=True`` also records the shape.  LINEAR16 maps ``[min, max]``
    onto the 65536 codes, rounding each value to the nearest code; the encoding field is
    left out for LINEAR16 (its default) and written for the others.
    """
    if isinstance(encoding, str):
        encoding = LayerEncoding[encoding]
    encoding = LayerEncoding(encoding)
    if encoding not in ELEMENT_BYTES:
        raise ValueError(f"cannot encode as {encoding.name}; known: {_KNOWN}")
    shape = list(values.shape)
    flat = values.detach().to(device="cpu", dtype=torch.float32).contiguous().reshape(-1)
    if flat.numel() and not bool(torch.isfinite(flat).all()):
        raise ValueError("values must be finite")
    layer: dict[str, Any] = {}
    if encoding == LayerEncoding.LINEAR16:
        lo = float(flat.min()) if flat.numel() else 0.0
        hi = float(flat.max()) if flat.numel() else 0.0
        if hi > lo:
            # float64: the nearest code even where float32 would misround a value near a half step
            codes = torch.round((flat.double() - lo) * (65535.0 / (hi - lo))).clamp_(0, 65535).to(torch.int32)
        else:
            codes = torch.zeros(flat.shape, dtype=torch.int32)
        layer.update(min_val=lo, max_val=hi, params=_to_le_bytes(codes.to(torch.uint16)))
    else:
        stored = flat.to(_STORED_DTYPE[encoding])
        if not bool(torch.isfinite(stored).all()):
            raise ValueError(f"values overflow {encoding.name}")
        layer.update(params=_to_le_bytes(stored), encoding=int(encoding))
    if dims:
        layer["dims"] = shape or [1]
    return layer


def expect_shape(tensor: torch.Tensor, shape: Sequence[int], where: str) -> torch.Tensor:
    """``tensor`` viewed as ``shape``, or ``Lc0FormatError`` naming ``where``.

    Only the element count must agree, as in lc0 (which reads every layer as a flat array
    in ``[out][in]`` order whatever its ``dims`` say).
    """
    shape = tuple(int(s) for s in shape)
    expected = math.prod(shape)
    if tensor.numel() != expected:
        raise Lc0FormatError(
            f"{where}: has {tensor.numel()} values (shape {tuple(tensor.shape)}), "
            f"expected shape {shape} = {expected} values"
        )
    return tensor.reshape(shape)


def decode_weight_tree(
    tree: Mapping[str, Any],
    message: str = "Weights",
    *,
    path: str = "weights",
    schema: Schema = SCHEMA,
    encodings: Optional[Counter] = None,
    unknown: Optional[list[str]] = None,
) -> dict[str, Any]:
    """A copy of a decoded message tree with every ``Weights.Layer`` replaced by its float32
    tensor (each decoded once).  Scalars and nested messages keep their shape; the field
    numbers the schema did not know are dropped from the tree and appended to ``unknown``
    as ``"path#number"``; ``encodings`` counts the layers per encoding name.
    """
    fields = {f.name: f for f in schema[message].values()}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if key == UNKNOWN_FIELDS:
            if unknown is not None:
                unknown.extend(f"{path}#{number}" for number in value)
            continue
        field = fields[key]
        fpath = f"{path}.{key}"
        if field.kind in SCALAR_KINDS:
            out[key] = value
            continue
        items = value if field.repeated else [value]
        decoded = []
        for i, item in enumerate(items):
            ipath = f"{fpath}[{i}]" if field.repeated else fpath
            if field.kind == LAYER:
                if unknown is not None and UNKNOWN_FIELDS in item:
                    unknown.extend(f"{ipath}#{number}" for number in item[UNKNOWN_FIELDS])
                decoded.append(decode_layer(item, ipath))
                if encodings is not None:
                    encodings[layer_encoding(item, ipath).name] += 1
            else:
                decoded.append(
                    decode_weight_tree(
                        item, field.kind, path=ipath, schema=schema, encodings=encodings, unknown=unknown
                    )
                )
        out[key] = decoded if field.repeated else decoded[0]
    return out
