"""Hostile and damaged Lc0 network files for ``test_lc0_hostile_files.py``.

* ``micro_net``: a very small valid net (``lc0_writer.build_net``) whose structure is most of
  its bytes, so that random mutations hit keys and lengths, not only weights;
* ``random_flips``, ``field_mutation``: the seeded fuzzers (bytes of the gzip stream or of the
  raw protobuf; one field of the decoded ``Net`` changed and re-encoded with the repo's own
  encoder);
* ``gzip_of_repeats``: a gzip member of a block repeated many times, built cheaply (the block
  is deflated once; full flushes make every copy the same bytes), so that gigabyte bombs cost
  kilobytes and milliseconds to build.  The CRC in the trailer is not computed: every bomb must
  be refused long before its trailer is read (and a wrong CRC would be refused anyway);
* ``encode_pieces`` + ``gzip_of_pieces``: a well-formed net (CRC right: it is read to its end)
  whose layers hold hundreds of megabytes of zeros (``Zeros``), built without holding them;
  ``scaled_net``: the micro net at any ``d_model``, every layer as big as that width makes it;
* ``run_file``: read, check and (when it loads) run a file as an engine would, in float32 on
  the CPU with the finite check on; returns what happened.
"""

from __future__ import annotations

import copy
import gzip
import math
import random
import signal
import struct
import time
import warnings
import zlib
from contextlib import contextmanager
from fractions import Fraction
from typing import Any, Callable, NamedTuple, Optional

import torch
from lc0_writer import build_net, encode_net, random_planes

from fusedenc.lc0 import Lc0FileError, Lc0FormatError, Lc0Network, read_net
from fusedenc.lc0.errors import Lc0NonFiniteError, Lc0ValueWarning
from fusedenc.lc0.protobuf import UNKNOWN_FIELDS, decode, encode, encode_varint
from fusedenc.lc0.schema import LC0_MAGIC, SCHEMA

#: The errors a hostile file may give: anything else is a bug.
EXPECTED = (Lc0FileError, Lc0FormatError)

MICRO = dict(layers=2, d_model=16, heads=2, d_ff=32, smolgen=(2, 8, 2), embedding_dense=1, value_channels=1,
             value_hidden=8, mlh_channels=1, mlh_hidden=8, default_activation="mish", ffn_activation="swish",
             smolgen_activation="swish")  # fmt: skip


def micro_net(**overrides: Any) -> dict:
    """The ``Net`` message of a very small valid net (a fresh copy)."""
    return build_net(**{**MICRO, **overrides}, keep_values=False)[0]


def gzip_header() -> bytes:
    return b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"


def gzip_of_repeats(prefix: bytes, block: bytes, copies: int, suffix: bytes = b"") -> bytes:
    """One gzip member of ``prefix + block * copies + suffix`` (see the module doc: cheap to
    build for any ``copies``; its CRC is not computed)."""
    c = zlib.compressobj(6, zlib.DEFLATED, -15)
    head = c.compress(prefix) + c.flush(zlib.Z_FULL_FLUSH)
    first = c.compress(block) + c.flush(zlib.Z_FULL_FLUSH)
    again = c.compress(block) + c.flush(zlib.Z_FULL_FLUSH)
    assert again == first or copies <= 2  # a full flush resets the state: every copy deflates alike
    tail = c.compress(suffix) + c.flush(zlib.Z_FINISH)
    size = (len(prefix) + len(block) * copies + len(suffix)) & 0xFFFFFFFF
    return gzip_header() + head + first + again * (copies - 1) + tail + struct.pack("<II", 0, size)


class Zeros(NamedTuple):
    """``n`` zero bytes of a ``bytes`` field (``encode_pieces``), never allocated whole."""

    n: int


def _piece_size(piece: Any) -> int:
    return piece.n if isinstance(piece, Zeros) else len(piece)


def encode_pieces(value: dict, message: str = "Net") -> list:
    """``protobuf.encode(value, message)`` as a list of ``bytes`` and ``Zeros`` pieces: a
    ``bytes`` field may hold ``Zeros(n)``, which stays a marker (the lengths around it count it)."""
    pieces: list = []
    fields = SCHEMA[message]
    for number in sorted(fields):
        field = fields[number]
        if field.name not in value:
            continue
        item = value[field.name]
        if isinstance(item, Zeros):
            pieces += [key(number, 2) + encode_varint(item.n), item]
        elif field.kind not in SCHEMA:  # a scalar (or repeated scalars): protobuf's own encoder
            pieces.append(encode({field.name: item}, message, SCHEMA))
        else:
            for sub_value in item if field.repeated else [item]:
                sub = encode_pieces(sub_value, field.kind)
                pieces += [key(number, 2) + encode_varint(sum(map(_piece_size, sub)))] + sub
    return pieces


def gzip_of_pieces(pieces: list, block: int = 16 << 20) -> bytes:
    """One well-formed gzip member (CRC and size right) of the pieces' bytes: ``Zeros`` cost one
    deflated block of zeros however long they are (after a full flush every copy deflates alike)."""
    c = zlib.compressobj(6, zlib.DEFLATED, -15)
    zero_block = bytes(block)
    deflated: Optional[bytes] = None
    out, crc, size = [gzip_header()], 0, 0
    for piece in pieces:
        if isinstance(piece, Zeros):
            copies, rest = divmod(piece.n, block)
            for _ in range(copies):
                if deflated is None:
                    deflated = c.compress(zero_block) + c.flush(zlib.Z_FULL_FLUSH)
                out.append(deflated)
                crc = zlib.crc32(zero_block, crc)
            size += copies * block
            piece = bytes(rest)
        out.append(c.compress(piece) + c.flush(zlib.Z_FULL_FLUSH))
        crc = zlib.crc32(piece, crc)
        size += len(piece)
    out.append(c.flush(zlib.Z_FINISH))
    return b"".join(out) + struct.pack("<II", crc, size & 0xFFFFFFFF)


def _layer_counts(node: Any, path: str, out: dict) -> None:
    """Weight path -> value count of every (LINEAR16) layer of a ``build_net`` tree."""
    if isinstance(node, dict):
        if "params" in node:
            out[path] = len(node["params"]) // 2
            return
        for k, v in node.items():
            _layer_counts(v, f"{path}.{k}", out)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _layer_counts(v, f"{path}[{i}]", out)


def _zero_layers(node: Any, path: str, counts: dict) -> Any:
    if isinstance(node, dict):
        if "params" in node:
            return {"encoding": 2, "params": Zeros(2 * counts[path])}  # FLOAT16 zeros
        return {k: _zero_layers(v, f"{path}.{k}", counts) for k, v in node.items()}
    if isinstance(node, list):
        return [_zero_layers(v, f"{path}[{i}]", counts) for i, v in enumerate(node)]
    return node


def scaled_net(d_model: int, **overrides: Any) -> dict:
    """The micro net (``overrides`` applied) at ``d_model``, each layer FLOAT16 ``Zeros`` of the
    count ``build_net`` gives it at that width: a consistent net of any size, built in
    milliseconds.  The counts are quadratic in ``d_model`` (the attention weights are
    ``d_model`` squared), so three small widths fix them; a fourth checks the fit."""
    widths = (8, 16, 24, 32)
    counts = []
    for width in widths:
        found: dict = {}
        _layer_counts(micro_net(d_model=width, **overrides)["weights"], "weights", found)
        counts.append(found)

    def fit(path: str, d: int) -> int:  # Lagrange through the first three widths, exactly
        total = Fraction(0)
        for i, (xi, ci) in enumerate(zip(widths[:3], counts[:3])):
            term = Fraction(ci[path])
            for j, xj in enumerate(widths[:3]):
                if j != i:
                    term *= Fraction(d - xj, xi - xj)
            total += term
        assert total.denominator == 1, (path, total)
        return int(total)

    assert all(fit(p, widths[3]) == n for p, n in counts[3].items()), "layer counts are not quadratic in d_model"
    net = micro_net(d_model=widths[0], **overrides)
    net["weights"] = _zero_layers(net["weights"], "weights", {p: fit(p, d_model) for p in counts[0]})
    return net


def pieces_size(pieces: list) -> int:
    """The bytes ``pieces`` stand for (the decompressed file's size)."""
    return sum(map(_piece_size, pieces))


def key(number: int, wire: int) -> bytes:
    return encode_varint(number << 3 | wire)


def net_header() -> bytes:
    """A valid ``Net`` up to its weights: magic and format of the micro net."""
    net = micro_net()
    return encode({"magic": LC0_MAGIC, "format": net["format"]}, "Net", SCHEMA)


# -- fuzzers --------------------------------------------------------------------------------


def random_flips(data: bytes, rng: random.Random, *, structural: Optional[list] = None) -> bytes:
    """``data`` with 1 to 8 random bytes changed (at ``structural`` offsets when given), or
    truncated, or with random bytes inserted."""
    out = bytearray(data)
    roll = rng.random()
    if roll < 0.1:
        return bytes(out[: rng.randrange(len(out))])
    if roll < 0.2:
        at = rng.randrange(len(out))
        return bytes(out[:at] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 16))) + out[at:])
    for _ in range(rng.randint(1, 8)):
        at = rng.choice(structural) if structural else rng.randrange(len(out))
        out[at] = rng.choice([rng.randrange(256), out[at] ^ (1 << rng.randrange(8)), 0x00, 0xFF, 0x80])
    return bytes(out)


def structural_offsets(payload: bytes) -> list[int]:
    """Offsets of ``payload`` (an encoded Net) outside every layer's ``params`` bytes."""
    params: list[tuple[int, int]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "params" and isinstance(v, memoryview) and v.nbytes:
                    start = _offset(v)
                    params.append((start, start + v.nbytes))
                else:
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    base = memoryview(payload)
    addr0 = _address(base)

    def _offset(v: memoryview) -> int:
        return _address(v) - addr0

    walk(decode(base, "Net", SCHEMA))
    inside = bytearray(len(payload))
    for a, b in params:
        inside[a:b] = b"\1" * (b - a)
    return [i for i, flag in enumerate(inside) if not flag]


def _address(view: memoryview) -> int:
    import numpy as np

    return np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0] if view.nbytes else 0


_INTS = [0, 1, 2, 3, 7, 8, 64, 134, 255, 4096, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 4, 2**40, 2**63, -1, -(2**31)]
_FLOATS = [0.0, -0.0, 1.0, -1.0, 1e-45, 65504.0, 65520.0, 1e20, -1e20, 3e38, -3e38, 3.4028234663852886e38,
           float("inf"), float("-inf"), float("nan")]  # fmt: skip


def _slots(node: Any, out: list, path: str = "") -> None:
    """Every (container, key, path) of ``node``: each field value and each repeated entry."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == UNKNOWN_FIELDS:
                continue
            out.append((node, k, f"{path}.{k}"))
            _slots(v, out, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.append((node, i, f"{path}[{i}]"))
            _slots(v, out, f"{path}[{i}]")


def _mutated_value(value: Any, rng: random.Random, tree: dict) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return rng.choice(_INTS + [rng.randrange(-(2**40), 2**70)])
    if isinstance(value, float):
        return rng.choice(_FLOATS + [rng.uniform(-1e6, 1e6)])
    if isinstance(value, str):
        return rng.choice(["", value * 2, "\udcff"[:0] + "x" * rng.randrange(100)])
    if isinstance(value, bytes):
        data = value
        n = len(data)
        choice = rng.randrange(7)
        if choice == 0:
            return data[: rng.randrange(n + 1)]
        if choice == 1:
            return data + bytes(rng.randrange(256) for _ in range(rng.randint(1, 9)))
        if choice == 2:
            return bytes(rng.randrange(256) for _ in range(n))  # NaN/inf patterns for float encodings
        if choice == 3:
            return b"\xff" * n
        if choice == 4:
            return b""
        if choice == 5:
            return b"\x7f\x7f" * (n // 2) + data[: n % 2]  # bf16/fp16 near their largest values
        return data * 2
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):  # dims
            return rng.choice([[0, 2**32 - 1, 2**32 - 1], [1] + value, value[::-1], value + [1], [2**32 - 1] * 8,
                               [rng.randrange(2**32) for _ in range(rng.randint(1, 9))], []])  # fmt: skip
        choice = rng.randrange(4)
        if choice == 0 and value:
            return value[:-1]
        if choice == 1 and value:
            return value + [copy.deepcopy(rng.choice(value))]
        if choice == 2:
            return []
        return value[::-1]
    if isinstance(value, dict):
        choice = rng.randrange(3)
        if choice == 0:
            return {}
        if choice == 1 and value:
            victim = rng.choice(list(value))
            return {k: v for k, v in value.items() if k != victim}
        return copy.deepcopy(value)
    return value


def _plain(node: Any) -> Any:
    """A decoded tree with bytes in place of memoryviews (so that it deep-copies)."""
    if isinstance(node, dict):
        return {k: _plain(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_plain(v) for v in node]
    return bytes(node) if isinstance(node, memoryview) else node


def field_mutation(payload: bytes, rng: random.Random) -> tuple[bytes, str]:
    """``payload`` (an encoded Net) decoded, one field or entry changed, deleted or swapped,
    and encoded again (packed or not); returns the bytes and what was done."""
    tree = _plain(decode(payload, "Net", SCHEMA))
    slots: list = []
    _slots(tree, slots)
    container, k, path = rng.choice(slots)
    action = rng.random()
    if action < 0.15 and isinstance(container, dict):
        del container[k]
        what = f"deleted {path}"
    elif action < 0.25 and isinstance(container[k], dict):
        other = rng.choice([s for s in slots if isinstance(s[0][s[1]], dict)])
        container[k] = copy.deepcopy(other[0][other[1]])
        what = f"{path} replaced by {other[2]}"
    else:
        container[k] = _mutated_value(container[k], rng, tree)
        what = f"changed {path}"
    try:
        data = encode(tree, "Net", SCHEMA, packed=rng.random() < 0.3)
    except (struct.error, OverflowError, KeyError, TypeError) as exc:  # the encoder's own limits
        return payload, f"{what} (not encodable: {type(exc).__name__}; original kept)"
    return data, what


# -- running a file -------------------------------------------------------------------------


class Timeout(Exception):
    pass


@contextmanager
def time_limit(seconds: float):
    """Raise ``Timeout`` in the main thread after ``seconds`` (a hang is a failure, not a stall)."""

    def on_alarm(signum, frame):
        raise Timeout(f"took more than {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_file(data: bytes, *, max_bytes: Optional[int] = None, forward: bool = True) -> dict:
    """Read ``data``, build its network (float32, CPU, finite check on) and run one forward, as
    an engine would.  Returns ``{"outcome": "ran" | "refused" | "nonfinite", "error": ...,
    "seconds": time to the outcome, "warned": [Lc0ValueWarning messages]}``; any exception
    other than the expected ones propagates (the caller fails the case)."""
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            net = read_net(data, max_bytes=max_bytes)
            model = Lc0Network(net, dtype=torch.float32, device="cpu", check_finite=True)
        except EXPECTED as exc:
            return {"outcome": "refused", "error": exc, "seconds": time.perf_counter() - start, "warned": []}
        warned = [str(w.message) for w in caught if issubclass(w.category, Lc0ValueWarning)]
        outcome, error = "built", None
        if forward:
            try:
                out = model(random_planes(2, torch.Generator().manual_seed(0)))
                assert all(torch.isfinite(t).all() for t in out.values())  # check_finite let it through
                outcome = "ran"
            except Lc0NonFiniteError as exc:
                outcome, error = "nonfinite", exc
    return {"outcome": outcome, "error": error, "seconds": time.perf_counter() - start, "warned": warned}


def gz(payload: bytes) -> bytes:
    return gzip.compress(payload, compresslevel=1, mtime=0)


def encoded(net: dict, *, packed: bool = False) -> bytes:
    return encode(net, "Net", SCHEMA, packed=packed)


def edit(net: dict, fn: Callable[[dict, dict], Any]) -> dict:
    net = copy.deepcopy(net)
    fn(net, net["weights"])
    return net


__all__ = [name for name in dir() if not name.startswith("_")] + ["encode_net", "math"]
