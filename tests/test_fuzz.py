"""Differential fuzzing: hypothesis draws the arguments, the written-out formulas judge.

Each property draws one call of an op -- shapes (empty batches included),
dtypes, activations, options, strided rows (column slices of wider buffers),
storage offsets that keep or break 16-byte alignment, attention bias and mask,
batch sizes -- and checks it against the formula of the tests' helpers under
``helpers.assert_close_rule``.  A call that breaks a documented layout rule (a
data pointer off a 16-byte boundary, a row stride that is not a multiple of 16
bytes) must raise ValueError naming the operand instead.  Output buffers the
test owns are NaN-poisoned, and the columns of a wider output buffer that the
op must not touch are checked to still be NaN.

Budget: ``FUSEDENC_FUZZ_EXAMPLES`` examples per property and device (default
25: the CPU file runs in well under a minute on 2 cores; on the GPU set it
high, e.g. 2000).  ``FUSEDENC_FUZZ_DERANDOMIZE=1`` makes the examples a fixed
function of the test (reproducible runs); by default each run draws new ones.
The counts of examples run, and of runs that failed (hypothesis's shrinking
replays included), are printed at the end of the session ("fusedenc fuzz")
and written as JSON to ``$FUSEDENC_FUZZ_REPORT`` when that is set.
CPU parameters always; CUDA ones under the ``gpu`` marker.
"""

from __future__ import annotations

import collections
import json
import math
import os

import pytest
import torch
from encoder_helpers import block_config, block_formula, block_params, padding_mask, randomize
from helpers import assert_close_rule, attention_formula, linear_formula, randn, ref_dtype, same_dtype_torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from layer_norm_helpers import ln_formula, ln_same_dtype

import fusedenc
from fusedenc import EncoderBlock
from fusedenc.common.activations import ACTIVATIONS

EXAMPLES = int(os.environ.get("FUSEDENC_FUZZ_EXAMPLES", "25"))
DERANDOMIZE = os.environ.get("FUSEDENC_FUZZ_DERANDOMIZE", "") == "1"

FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=DERANDOMIZE,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ALIGN_BYTES = 16

# ------------------------------------------------------------ the count ----

_COUNTS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


class _FuzzReport:
    """Prints (and saves) how many examples each property ran, rejected and failed."""

    def pytest_terminal_summary(self, terminalreporter):
        if not _COUNTS:
            return
        terminalreporter.write_sep("-", "fusedenc fuzz")
        total = collections.Counter()
        for key in sorted(_COUNTS):
            c = _COUNTS[key]
            total.update(c)
            terminalreporter.write_line(
                f"{key:28s} ran {c['ran']:6d}  raised as required {c['raised']:5d}  failed {c['failed']:4d}"
            )
        terminalreporter.write_line(
            f"{'total':28s} ran {total['ran']:6d}  raised as required {total['raised']:5d}  failed {total['failed']:4d}"
            f"  (examples per property: {EXAMPLES}; failed counts hypothesis's shrinking replays)"
        )
        path = os.environ.get("FUSEDENC_FUZZ_REPORT")
        if path:
            with open(path, "w", encoding="utf-8") as f:
                json.dump({"examples_per_property": EXAMPLES, "derandomize": DERANDOMIZE,
                           "properties": {k: dict(v) for k, v in _COUNTS.items()}, "total": dict(total)}, f, indent=2)


_PLUGIN_NAME = "fusedenc-fuzz-report"


@pytest.fixture(scope="module", autouse=True)
def _register_report(request):
    pm = request.config.pluginmanager
    if pm.get_plugin(_PLUGIN_NAME) is None:
        pm.register(_FuzzReport(), _PLUGIN_NAME)
    yield


class _Count:
    """Context: one example of ``key``; counts it and whether it failed."""

    def __init__(self, key: str):
        self.c = _COUNTS[key]

    def __enter__(self):
        self.c["ran"] += 1
        return self

    def raised(self):
        self.c["raised"] += 1

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.c["failed"] += 1
        return False


# ------------------------------------------------------------ layouts ----


def _align(dtype) -> int:
    return ALIGN_BYTES // torch.empty((), dtype=dtype).element_size()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@st.composite
def layouts(draw, dtype, *, offsets=True):
    """(pad, offset) in elements: rows padded to ``cols + pad`` (a column slice of a wider
    buffer) and the data starting ``offset`` elements into its storage."""
    a = _align(dtype)
    pad = draw(st.sampled_from([0, 0, 0, a, 2 * a, 1, a + 2]))
    off = draw(st.sampled_from([0, 0, 0, a, 1, a - 1])) if offsets else 0
    return pad, off


def _place(t: torch.Tensor, pad: int, off: int, fill: float = float("nan")) -> torch.Tensor:
    """``t``'s values in a new buffer: rows of ``cols + pad`` elements, ``off`` elements in."""
    shape, cols = tuple(t.shape), t.shape[-1]
    rows = math.prod(shape[:-1])
    flat = torch.full((off + rows * (cols + pad) + 1,), fill, dtype=t.dtype, device=t.device)
    wide = flat[off : off + rows * (cols + pad)].view(*shape[:-1], cols + pad)
    view = wide[..., :cols]
    view.copy_(t)
    return view


def _breaks_layout(t: torch.Tensor) -> bool:
    """Whether ``t`` breaks the ops' layout rules: a pointer off 16 bytes, or (with more than
    one row) a row stride that is not a multiple of 16 bytes."""
    if t.data_ptr() % ALIGN_BYTES:
        return True
    rows = t.numel() // max(t.shape[-1], 1)
    return rows > 1 and (t.stride(-2) * t.element_size()) % ALIGN_BYTES != 0


def _untouched(buf_view: torch.Tensor, pad: int, what: str) -> None:
    """The padding columns next to an output view are still NaN (nothing wrote past the row)."""
    if pad == 0 or buf_view.numel() == 0:
        return
    cols = buf_view.shape[-1]
    wide = buf_view.as_strided(tuple(buf_view.shape[:-1]) + (cols + pad,), buf_view.stride())
    assert torch.isnan(wide[..., cols:]).all(), f"{what}: padding columns of the output buffer were written"


# ------------------------------------------------------------------ linear ----


@st.composite
def linear_cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    a = _align(dtype)
    lead = draw(st.lists(st.integers(0, 6), min_size=1, max_size=3).filter(lambda l: math.prod(l) <= 80))
    k = a * draw(st.integers(1, 12))
    n = a * draw(st.integers(1, 12))
    activation = draw(st.sampled_from(ACTIVATIONS + ("silu",)))
    residual = activation == "none" and draw(st.booleans())
    return dict(
        dtype=dtype, lead=tuple(lead), k=k, n=n, activation=activation,
        bias=draw(st.booleans()), residual=residual,
        alpha=draw(st.sampled_from([1.0, 1.0, 0.5, -1.25, (2 * 15) ** -0.25])),
        beta=draw(st.sampled_from([1.0, 0.5, -2.0])) if residual else 1.0,
        x_layout=draw(layouts(dtype)),
        r_layout=draw(layouts(dtype, offsets=False)),
        out=draw(st.sampled_from(["alloc", "given", "given", "inplace"] if residual else ["alloc", "given"])),
        out_pad=draw(st.sampled_from([0, a])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )  # fmt: skip


@pytest.mark.parametrize("dev", DEVICES)
@FUZZ
@given(case=linear_cases())
def test_fuzz_linear(dev, case):
    with _Count(f"linear[{dev}]") as count:
        c = case
        dtype, g = c["dtype"], _gen(c["seed"])
        x = _place(randn(c["lead"] + (c["k"],), dtype, dev, g), *c["x_layout"])
        w = randn((c["n"], c["k"]), dtype, dev, g, c["k"] ** -0.5)
        b = randn((c["n"],), dtype, dev, g) if c["bias"] else None
        out_shape = c["lead"] + (c["n"],)
        r = _place(randn(out_shape, dtype, dev, g), *c["r_layout"]) if c["residual"] else None
        r_before = None if r is None else r.clone()
        out = None
        if c["out"] == "given":
            out = _place(torch.full(out_shape, float("nan"), dtype=dtype, device=dev), c["out_pad"], 0)
        elif c["out"] == "inplace":
            out = r
        bad = _breaks_layout(x) or (r is not None and _breaks_layout(r))
        what = f"linear {c}"
        if bad:
            with pytest.raises(ValueError, match=r"^(x|residual) (data pointer|row stride)"):
                fusedenc.linear(x, w, b, c["activation"], r, c["beta"], alpha=c["alpha"], out=out)
            count.raised()
            return
        got = fusedenc.linear(x, w, b, c["activation"], r, c["beta"], alpha=c["alpha"], out=out)
        if out is not None:
            assert got is out
        assert got.shape == out_shape and got.dtype == dtype and got.device == x.device
        ref = linear_formula(x, w, b, c["activation"], r_before, c["beta"], c["alpha"], dtype=ref_dtype(dtype))
        same = same_dtype_torch(x, w, b, c["activation"], r_before, c["beta"], c["alpha"])
        assert_close_rule(got, ref, same, dtype, what=what)
        if c["out"] == "given":
            _untouched(out, c["out_pad"], what)


# -------------------------------------------------------------- layer_norm ----


@st.composite
def layer_norm_cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    a = _align(dtype)
    d = draw(st.one_of(st.integers(1, 48).map(lambda v: a * v), st.sampled_from([768, 1024, 2048, 4096, 8192, 16384])))
    max_rows = max(1, 8192 // d)
    lead = draw(st.lists(st.integers(0, 5), min_size=1, max_size=2).filter(lambda l: math.prod(l) <= max_rows))
    residual = draw(st.booleans())
    return dict(
        dtype=dtype, lead=tuple(lead), d=d,
        weight=draw(st.booleans()), bias=draw(st.booleans()), x_bias=draw(st.booleans()), residual=residual,
        alpha=draw(st.sampled_from([1.0, 0.5, (2 * 15) ** -0.25, -1.5])),
        eps=draw(st.sampled_from([1e-5, 1e-6, 1e-3, 0.1])),
        mean=draw(st.sampled_from([0.0, 0.0, 3.0, -40.0])),
        x_layout=draw(layouts(dtype)),
        r_layout=draw(layouts(dtype)),
        out=draw(st.sampled_from(["alloc", "given"])),
        out_pad=draw(st.sampled_from([0, a])),
        sum_out=draw(st.sampled_from(["none", "given", "residual"] if residual else ["none", "given"])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )  # fmt: skip


@pytest.mark.parametrize("dev", DEVICES)
@FUZZ
@given(case=layer_norm_cases())
def test_fuzz_layer_norm(dev, case):
    with _Count(f"layer_norm[{dev}]") as count:
        c = case
        dtype, g, d = c["dtype"], _gen(c["seed"]), c["d"]
        shape = c["lead"] + (d,)
        x = _place((c["mean"] + randn(shape, dtype, dev, g).float()).to(dtype), *c["x_layout"])
        w = (1 + randn((d,), dtype, dev, g, 0.2)) if c["weight"] else None
        b = randn((d,), dtype, dev, g, 0.2) if c["bias"] else None
        xb = randn((d,), dtype, dev, g, 0.5) if c["x_bias"] else None
        r = _place(randn(shape, dtype, dev, g), *c["r_layout"]) if c["residual"] else None
        r_before = None if r is None else r.clone()
        nan = float("nan")
        out = _place(torch.full(shape, nan, dtype=dtype, device=dev), c["out_pad"], 0) if c["out"] == "given" else None
        sum_out = {"none": None, "given": torch.full(shape, nan, dtype=dtype, device=dev), "residual": r}[c["sum_out"]]
        bad = _breaks_layout(x) or (r is not None and _breaks_layout(r))
        kw = dict(residual=r, alpha=c["alpha"], x_bias=xb, out=out, sum_out=sum_out)
        if bad:
            with pytest.raises(ValueError, match=r"^(x|residual) (data pointer|row stride)"):
                fusedenc.layer_norm(x, w, b, c["eps"], **kw)
            count.raised()
            return
        got = fusedenc.layer_norm(x, w, b, c["eps"], **kw)
        if out is not None:
            assert got is out
        assert got.shape == shape and got.dtype == dtype
        args = (x, w, b, c["eps"], r_before, c["alpha"], xb)
        ref, ref_h = ln_formula(*args, dtype=ref_dtype(dtype))
        same, same_h = ln_same_dtype(*args)
        what = f"layer_norm {c}"
        assert_close_rule(got, ref, same, dtype, what=what)
        if sum_out is not None:
            assert_close_rule(sum_out, ref_h, same_h, dtype, what=f"{what} sum_out")
        if out is not None:
            _untouched(out, c["out_pad"], what)


# --------------------------------------------------------------- attention ----


@st.composite
def attention_cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    return dict(
        dtype=dtype,
        batch=draw(st.integers(0, 4)),
        seq=draw(st.one_of(st.integers(1, 24), st.sampled_from([64, 65, 128]))),
        heads=draw(st.integers(1, 4)),
        head_dim=draw(st.sampled_from([8, 16, 32, 64, 128, 4, 12, 40])),
        packed=draw(st.booleans()),
        bias=draw(st.sampled_from(["none", "per_batch", "broadcast", "fp32", "transposed"])),
        mask=draw(st.sampled_from(["none", "lengths", "one_sequence_all_padding"])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _attn_bias(kind, b, h, s, dtype, dev, g):
    """The additive attention bias a case names: none, per_batch [B, H, S, S], broadcast [1, H, S, S],
    fp32 (with half q, k, v) or transposed (a view with unit stride in the wrong dimension)."""
    if kind == "none":
        return None
    if kind == "broadcast":
        return randn((1, h, s, s), dtype, dev, g)
    if kind == "fp32":
        return randn((b, h, s, s), torch.float32, dev, g)
    bias = randn((b, h, s, s), dtype, dev, g)
    return bias.transpose(-1, -2) if kind == "transposed" else bias


def _padding_mask(kind, b, s, dev, g):
    """none, lengths (a random length per sequence) or one_sequence_all_padding (the last one)."""
    if kind == "none":
        return None
    return padding_mask(b, s, g, device=dev, full_row=kind == "one_sequence_all_padding" and b > 0)


@pytest.mark.parametrize("dev", DEVICES)
@FUZZ
@given(case=attention_cases())
def test_fuzz_attention(dev, case):
    with _Count(f"attention[{dev}]"):
        c = case
        dtype, g = c["dtype"], _gen(c["seed"])
        b, s, h, dh = c["batch"], c["seq"], c["heads"], c["head_dim"]
        if c["packed"]:
            q, k, v = fusedenc.ops.gemm.split_qkv(randn((b, s, 3 * h * dh), dtype, dev, g), h)
        else:
            q, k, v = (randn((b, s, h, dh), dtype, dev, g) for _ in range(3))
        bias = _attn_bias(c["bias"], b, h, s, dtype, dev, g)
        mask = _padding_mask(c["mask"], b, s, dev, g)
        got = fusedenc.attention.attention(q, k, v, bias, mask)
        assert got.shape == (b * s, h * dh) and got.dtype == dtype
        ref = attention_formula(q, k, v, bias, mask, dtype=ref_dtype(dtype))
        same = attention_formula(q, k, v, bias, mask, dtype=dtype)
        assert_close_rule(got, ref, same, dtype, what=f"attention {c}")


# ------------------------------------------------------------------- block ----


@st.composite
def block_cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    d = 8 * draw(st.integers(1, 8))
    heads = draw(st.sampled_from([h for h in (1, 2, 3, 4, 8) if d % h == 0]))
    return dict(
        dtype=dtype, d=d, heads=heads, d_ff=8 * draw(st.integers(1, 12)),
        activation=draw(st.sampled_from(ACTIVATIONS)),
        norm_first=draw(st.booleans()),
        alpha=draw(st.sampled_from([1.0, (2 * 15) ** -0.25, 0.5])),
        bias=draw(st.booleans()),
        batch=draw(st.integers(0, 5)),
        seq=draw(st.integers(1, 16)),
        rows_input=draw(st.booleans()),  # x as [T, D] with seq_len
        attn_bias=draw(st.sampled_from(["none", "per_batch", "broadcast", "fp32"])),
        mask=draw(st.sampled_from(["none", "lengths", "one_sequence_all_padding"])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )  # fmt: skip


@pytest.mark.parametrize("dev", DEVICES)
@FUZZ
@given(case=block_cases())
def test_fuzz_block(dev, case):
    with _Count(f"block[{dev}]"):
        c = case
        dtype, g = c["dtype"], _gen(c["seed"])
        b, s, d, h = c["batch"], c["seq"], c["d"], c["heads"]
        block = EncoderBlock(d, h, c["d_ff"], c["activation"], norm_first=c["norm_first"], residual_alpha=c["alpha"],
                             bias=c["bias"], dtype=dtype, device=dev)  # fmt: skip
        randomize(block, g)
        x = randn((b, s, d), dtype, dev, g)
        bias = _attn_bias(c["attn_bias"], b, h, s, dtype, dev, g)
        mask = _padding_mask(c["mask"], b, s, dev, g)
        with torch.inference_mode():
            if c["rows_input"]:
                got = block(x.reshape(b * s, d), bias, mask, seq_len=s).view(b, s, d)
            else:
                got = block(x, bias, mask)
        assert got.shape == (b, s, d) and got.dtype == dtype
        p, cfg = block_params(block), block_config(block)
        ref = block_formula(p, x, cfg, bias, mask, dtype=ref_dtype(dtype))
        same = block_formula(p, x, cfg, bias, mask, dtype=dtype)
        assert_close_rule(got, ref, same, dtype, what=f"block {c}")


@pytest.mark.parametrize("dev", DEVICES)
def test_attention_head_dim_1_output_is_contiguous(dev):
    """Regression (found by the block fuzz): the math backend's result must be dense rows."""
    g = _gen(0)
    q, k, v = fusedenc.ops.gemm.split_qkv(randn((1, 3, 3 * 4), torch.float32, dev, g), 4)  # B=1, S=3, H=4, Dh=1
    out = fusedenc.attention.attention(q, k, v)
    assert out.is_contiguous(), f"strides {out.stride()}"
    block = randomize(EncoderBlock(8, 8, 16, dtype=torch.float32, device=dev), g)
    with torch.inference_mode():
        block(randn((1, 3, 8), torch.float32, dev, g))
