"""Weight layers: ``Weights.Layer`` messages to float32 tensors, and back.

A layer is ``params`` (little-endian bytes), an ``encoding`` (absent = LINEAR16) and,
for LINEAR16, the ``min_val``/``max_val`` its uint16 codes map onto.  Decoding follows
lc0's reader: ``theta = u / 65535`` and ``v = min * (1 - theta) + max * theta`` in float32;
FLOAT16/BFLOAT16 widen exactly to float32.  Dense weights are stored ``[out][in]``.

Everything is vectorised over whole layers (a BT4-sized net holds ~190 M values).
Errors name the layer's path, e.g. ``weights.encoder[3].mha.q_w``.

Decoding is in two steps, so that a net's sizes can be checked before any layer costs
float32 memory (``read_net`` does): ``plan_layer`` checks everything about a layer that needs
no value of it (encoding, byte count, dims, LINEAR16 range) and counts its values from the
byte length (a ``LayerPlan``); ``decode_planned`` then decodes it.  Every decoded layer is
checked for values that are not finite in float32 (NaN, inf; a LINEAR16 range whose formula
overflows) with one ``aminmax`` pass, and its smallest and largest value are recorded
(``ranges``) so that a network can tell, once it knows its dtype, which layers overflow it
(``support.check_supported(net, dtype=...)``).
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from typing import Any, Mapping, NamedTuple, Optional, Sequence, Union

import torch

from .errors import Lc0FileError, Lc0FormatError
from .protobuf import SCALAR_KINDS, UNKNOWN_FIELDS, Schema
from .schema import LAYER, MAX_DIMS, SCHEMA, LayerEncoding

__all__ = [
    "ELEMENT_BYTES",
    "LayerPlan",
    "decode_layer",
    "decode_planned",
    "decode_planned_tree",
    "decode_weight_tree",
    "encode_layer",
    "expect_shape",
    "layer_encoding",
    "plan_layer",
    "plan_weight_tree",
    "planned_layers",
    "present",
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

#: Bound on the product of a layer's dims (far above any layer a file can hold): products
#: are computed against it, never as huge integers.
_MAX_DIMS_PRODUCT = 1 << 48


def _dims_product(dims: Sequence[int]) -> Optional[int]:
    """The product of ``dims`` (0 if one is 0), or None where the nonzero ones pass ``_MAX_DIMS_PRODUCT``."""
    if 0 in dims:
        return 0
    product = 1
    for d in dims:
        if d:
            product *= d
            if product > _MAX_DIMS_PRODUCT:
                return None
    return product


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


def _from_le_bytes(data: Any, dtype: torch.dtype, *, copy: bool = True) -> torch.Tensor:
    """The values of ``data`` (little-endian).  ``copy=False``: a view of ``data`` where it is a
    writable buffer (``read_net``'s decompressed file), for a caller that converts it at once
    (16-bit layers: ``.to(float32)`` is the copy); else a private writable copy (torch.frombuffer
    wants a writable buffer, and the copy frees the file's buffer from this tensor's lifetime)."""
    view = memoryview(data)
    if copy or view.readonly or sys.byteorder != "little":
        view = bytearray(view)
    t = torch.frombuffer(view, dtype=dtype)
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


class LayerPlan(NamedTuple):
    """A ``Weights.Layer`` checked but not decoded: all that its encoded bytes and ``dims`` say
    (``plan_layer``), so that a net's sizes can be checked before any layer costs float32
    memory.  ``numel()`` and ``shape`` are the decoded tensor's; ``layer`` is the message
    (its ``params`` still a view of the file's bytes) that ``decode_planned`` decodes."""

    where: str
    encoding: LayerEncoding
    shape: tuple[int, ...]
    count: int
    layer: Mapping[str, Any]

    def numel(self) -> int:
        return self.count


def plan_layer(layer: Mapping[str, Any], where: str) -> LayerPlan:
    """Every check of a ``Weights.Layer`` that needs no value of it, and its element count
    from the byte length.  Raises ``Lc0FileError`` naming ``where`` for an unknown encoding,
    a byte count that is not a whole number of values, ``dims`` that do not hold the values
    (or more than ``schema.MAX_DIMS`` of them), and a LINEAR16 layer with values but no finite
    ``min_val``/``max_val`` (lc0 would silently read 0 for a missing one)."""
    encoding = layer_encoding(layer, where)
    nbytes = memoryview(layer.get("params", b"")).nbytes
    size = ELEMENT_BYTES[encoding]
    if nbytes % size:
        raise Lc0FileError(
            f"{where}: {nbytes} bytes of {encoding.name} data is not a whole number of {size}-byte values"
        )
    count = nbytes // size
    dims = list(layer.get("dims", ()))
    if len(dims) > MAX_DIMS:
        raise Lc0FileError(f"{where}: {len(dims)} dims, more than the {MAX_DIMS} fusedenc reads")
    dims = [int(d) for d in dims]
    if any(d < 0 or d > 0xFFFFFFFF for d in dims):
        raise Lc0FileError(f"{where}: dims {dims} are not all uint32 values")
    if dims:
        product = _dims_product(dims)
        if product != count:
            held = f"{product}" if product is not None else f"more than {_MAX_DIMS_PRODUCT}"
            raise Lc0FileError(
                f"{where}: dims {dims} hold {held} values, but params has {nbytes} bytes "
                f"= {count} {encoding.name} values"
            )
        if count == 0 and _dims_product([d or 1 for d in dims]) is None:
            raise Lc0FileError(f"{where}: dims {dims} describe an empty tensor too large to shape")
    if encoding == LayerEncoding.LINEAR16 and count:
        missing = [name for name in ("min_val", "max_val") if name not in layer]
        if missing:
            raise Lc0FileError(f"{where}: LINEAR16 layer with {count} values but no {' or '.join(missing)}")
        lo, hi = float(layer["min_val"]), float(layer["max_val"])
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise Lc0FileError(f"{where}: LINEAR16 range [{lo}, {hi}] is not finite")
    return LayerPlan(where, encoding, tuple(dims) if dims else (count,), count, layer)


def decode_planned(plan: LayerPlan, *, ranges: Optional[dict] = None) -> torch.Tensor:
    """The float32 tensor of a planned layer (``plan_layer``), shaped ``plan.shape``.  Raises
    ``Lc0FileError`` naming the layer for values that are not finite in float32; ``ranges``,
    when given, gets ``ranges[where] = (smallest, largest)`` for a layer with values."""
    where, encoding, shape, count, layer = plan
    if count == 0:
        return torch.zeros(shape, dtype=torch.float32)

    # FLOAT32 is copied (its .to(float32) is no copy); 16-bit layers are read in place and widened.
    raw = _from_le_bytes(layer["params"], _STORED_DTYPE[encoding], copy=encoding == LayerEncoding.FLOAT32)
    if encoding == LayerEncoding.LINEAR16:
        lo, hi = float(layer["min_val"]), float(layer["max_val"])
        # lc0's formula, min * (1 - theta) + max * theta with theta = u / 65535, step by step
        # in float32 (in place: a layer can be 25 M values).
        theta = raw.to(torch.float32).div_(65535.0)
        values = torch.mul(theta, hi)
        values.add_(theta.neg_().add_(1.0).mul_(lo))
    else:
        values = raw.to(torch.float32)
    # One pass for both: NaN propagates through min/max, inf shows as an end.
    smallest, largest = (float(v) for v in torch.aminmax(values))
    if not (math.isfinite(smallest) and math.isfinite(largest)):
        bad = int((~torch.isfinite(values)).sum())
        if encoding == LayerEncoding.LINEAR16:
            raise Lc0FileError(
                f"{where}: LINEAR16 range [{lo:.9g}, {hi:.9g}] gives {bad} of {count} values that are not finite "
                "in float32 (lc0's formula overflows)"
            )
        raise Lc0FileError(f"{where}: {bad} of {count} {encoding.name} values are NaN or infinite")
    if ranges is not None:
        ranges[where] = (smallest, largest)
    return values.view(shape)


def decode_layer(layer: Mapping[str, Any], where: str, *, ranges: Optional[dict] = None) -> torch.Tensor:
    """A decoded ``Weights.Layer`` (as ``protobuf.decode`` returns it) as a float32 tensor:
    shaped by ``dims`` when the layer has them, else 1-D: ``plan_layer``'s checks, then
    ``decode_planned`` (which also refuses values that are not finite in float32).
    ``ranges``, when given, gets ``ranges[where] = (smallest, largest)`` for a layer with values.
    """
    return decode_planned(plan_layer(layer, where), ranges=ranges)


def present(value: Any) -> bool:
    """A weight layer with values, decoded (a tensor) or planned (``LayerPlan``): an empty
    Layer message is as good as none, as in lc0."""
    return isinstance(value, (torch.Tensor, LayerPlan)) and value.numel() > 0


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


def plan_weight_tree(
    tree: Mapping[str, Any],
    message: str = "Weights",
    *,
    path: str = "weights",
    schema: Schema = SCHEMA,
    encodings: Optional[Counter] = None,
    unknown: Optional[list[str]] = None,
) -> dict[str, Any]:
    """A copy of a decoded message tree with every ``Weights.Layer`` replaced by its
    ``LayerPlan`` (``plan_layer``: checked, counted from its byte length, not decoded).
    Scalars and nested messages keep their shape; the field numbers the schema did not know
    are dropped from the tree and appended to ``unknown`` as ``"path#number"``;
    ``encodings`` counts the layers per encoding name."""
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
        planned = []
        for i, item in enumerate(items):
            ipath = f"{fpath}[{i}]" if field.repeated else fpath
            if field.kind == LAYER:
                if unknown is not None and UNKNOWN_FIELDS in item:
                    unknown.extend(f"{ipath}#{number}" for number in item[UNKNOWN_FIELDS])
                plan = plan_layer(item, ipath)
                planned.append(plan)
                if encodings is not None:
                    encodings[plan.encoding.name] += 1
            else:
                planned.append(plan_weight_tree(item, field.kind, path=ipath, schema=schema, encodings=encodings,
                                                unknown=unknown))  # fmt: skip
        out[key] = planned if field.repeated else planned[0]
    return out


def planned_layers(tree: Any):
    """Every ``LayerPlan`` (or tensor) of a planned (or decoded) tree, depth first."""
    if isinstance(tree, (LayerPlan, torch.Tensor)):
        yield tree
    elif isinstance(tree, Mapping):
        for value in tree.values():
            yield from planned_layers(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from planned_layers(value)


def decode_planned_tree(tree: Any, *, ranges: Optional[dict] = None) -> Any:
    """``plan_weight_tree``'s result with every ``LayerPlan`` decoded (``decode_planned``)."""
    if isinstance(tree, LayerPlan):
        return decode_planned(tree, ranges=ranges)
    if isinstance(tree, Mapping):
        return {key: decode_planned_tree(value, ranges=ranges) for key, value in tree.items()}
    if isinstance(tree, list):
        return [decode_planned_tree(value, ranges=ranges) for value in tree]
    return tree


def decode_weight_tree(
    tree: Mapping[str, Any],
    message: str = "Weights",
    *,
    path: str = "weights",
    schema: Schema = SCHEMA,
    encodings: Optional[Counter] = None,
    unknown: Optional[list[str]] = None,
    ranges: Optional[dict] = None,
) -> dict[str, Any]:
    """``plan_weight_tree`` then ``decode_planned_tree``: every ``Weights.Layer`` replaced by
    its float32 tensor (each decoded once); ``ranges`` gets each layer's (smallest, largest)
    value by path (``decode_planned``)."""
    planned = plan_weight_tree(tree, message, path=path, schema=schema, encodings=encodings, unknown=unknown)
    return decode_planned_tree(planned, ranges=ranges)
