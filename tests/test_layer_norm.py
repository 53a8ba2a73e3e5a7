"""layer_norm on CPU tensors (the reference path): math, options, shapes, checks, custom ops."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import assert_close_rule, poisoned, randn, ref_dtype
from layer_norm_helpers import assert_rounded_once, ln_formula, ln_same_dtype

import fusedenc.ops.norm  # noqa: F401 - registers torch.ops.fusedenc.layer_norm / layer_norm_out
from fusedenc.ops.norm import layer_norm, reference_layer_norm

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
H = torch.float16


def _operands(gen, shape, dtype, *, residual=True, x_bias=True, weight=True, bias=True):
    d = shape[-1]
    return dict(
        x=randn(shape, dtype, gen=gen),
        weight=randn((d,), dtype, gen=gen) if weight else None,
        bias=randn((d,), dtype, gen=gen) if bias else None,
        residual=randn(shape, dtype, gen=gen) if residual else None,
        x_bias=randn((d,), dtype, gen=gen, scale=0.5) if x_bias else None,
    )


def _check(out, sum_out, ops, eps, alpha, dtype, what):
    """out (and sum_out) against the written-out formula in higher precision, by the rule."""
    args = (ops["x"], ops["weight"], ops["bias"], eps, ops["residual"], alpha, ops["x_bias"])
    ref, ref_h = ln_formula(*args, dtype=ref_dtype(dtype))
    same, same_h = ln_same_dtype(*args)
    assert out.dtype == dtype, f"{what}: out dtype {out.dtype}"
    assert_close_rule(out, ref, same, dtype, what=what)
    if sum_out is not None:
        assert_close_rule(sum_out, ref_h, same_h, dtype, what=f"{what} sum_out")


# ------------------------------------------------------------------ math ----

OPTIONS = list(itertools.product([False, True], [False, True], [1.0, 0.37], ["both", "weight", "bias", "none"], [False, True]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "residual,x_bias,alpha,affine,with_sum", OPTIONS, ids=["-".join(map(str, o)) for o in OPTIONS]
)
@pytest.mark.sweep
def test_every_option_combination(dtype, residual, x_bias, alpha, affine, with_sum, gen):
    shape = (13, 64)
    ops = _operands(
        gen, shape, dtype, residual=residual, x_bias=x_bias,
        weight=affine in ("both", "weight"), bias=affine in ("both", "bias"),
    )  # fmt: skip
    out = poisoned(shape, dtype, "cpu")
    sum_out = poisoned(shape, dtype, "cpu") if with_sum else None
    got = layer_norm(
        ops["x"], ops["weight"], ops["bias"], 1e-5,
        residual=ops["residual"], alpha=alpha, x_bias=ops["x_bias"], out=out, sum_out=sum_out,
    )  # fmt: skip
    assert got is out
    what = f"{dtype} residual={residual} x_bias={x_bias} alpha={alpha} affine={affine} seed={gen.seed_value}"
    _check(out, sum_out, ops, 1e-5, alpha, dtype, what)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [8, 16, 24, 768, 1032, 16384])
def test_row_lengths(dtype, d, gen):
    if d % (4 if dtype == torch.float32 else 8):
        pytest.skip("not a multiple of 16 bytes")
    shape = (3 if d > 4096 else 9, d)
    ops = _operands(gen, shape, dtype)
    sum_out = poisoned(shape, dtype, "cpu")
    out = layer_norm(
        ops["x"], ops["weight"], ops["bias"], 1e-6,
        residual=ops["residual"], alpha=0.5, x_bias=ops["x_bias"], sum_out=sum_out,
    )  # fmt: skip
    assert out.shape == shape and out.is_contiguous()
    _check(out, sum_out, ops, 1e-6, 0.5, dtype, f"D={d} {dtype} seed={gen.seed_value}")


@pytest.mark.parametrize("eps", [1e-5, 1e-2, 0.0])
def test_eps(eps, gen):
    ops = _operands(gen, (6, 32), torch.float32)
    out = layer_norm(ops["x"], ops["weight"], ops["bias"], eps, residual=ops["residual"], x_bias=ops["x_bias"])
    _check(out, None, ops, eps, 1.0, torch.float32, f"eps={eps} seed={gen.seed_value}")


@pytest.mark.parametrize("shape", [(16,), (5, 16), (2, 3, 16), (2, 1, 3, 16)])
def test_leading_dimensions(shape, gen):
    ops = _operands(gen, shape, torch.float32)
    sum_out = poisoned(shape, torch.float32, "cpu")
    out = layer_norm(
        ops["x"], ops["weight"], ops["bias"], residual=ops["residual"], alpha=2.0,
        x_bias=ops["x_bias"], sum_out=sum_out,
    )  # fmt: skip
    assert out.shape == shape
    _check(out, sum_out, ops, 1e-5, 2.0, torch.float32, f"shape={shape} seed={gen.seed_value}")


@pytest.mark.parametrize("shape", [(0, 16), (2, 0, 16)])
def test_empty_batch(shape, gen):
    x = torch.empty(shape, dtype=H)
    w = randn((16,), H, gen=gen)
    out = layer_norm(x, w, w, residual=torch.empty(shape, dtype=H), sum_out=torch.empty(shape, dtype=H))
    assert out.shape == shape and out.dtype == H
    given = torch.empty(shape, dtype=H)
    assert layer_norm(x, w, None, out=given) is given


@pytest.mark.parametrize("dtype", DTYPES)
def test_sum_out_is_residual_in_place(dtype, gen):
    ops = _operands(gen, (7, 48 if dtype == torch.float32 else 64), dtype)
    r = ops["residual"]
    before = dict(ops, residual=r.clone())
    out = layer_norm(ops["x"], ops["weight"], ops["bias"], residual=r, alpha=0.7, x_bias=ops["x_bias"], sum_out=r)
    # r now holds h; compare both against the formula on the original residual.
    _check(out, r, before, 1e-5, 0.7, dtype, f"in place {dtype} seed={gen.seed_value}")


def test_strided_rows(gen):
    """x and residual column slices of wider buffers; out and sum_out slices of poisoned canvases."""
    dtype, t, d = H, 5, 32
    x = randn((t, d + 16), dtype, gen=gen)[:, 8 : 8 + d]
    r = randn((t, d + 24), dtype, gen=gen)[:, 16 : 16 + d]
    canvas_o = poisoned((t, d + 8), dtype, "cpu")
    canvas_s = poisoned((t, d + 16), dtype, "cpu")
    out, sum_out = canvas_o[:, 8:], canvas_s[:, :d]
    ops = dict(x=x, weight=randn((d,), dtype, gen=gen), bias=randn((d,), dtype, gen=gen), residual=r, x_bias=None)
    layer_norm(x, ops["weight"], ops["bias"], residual=r, alpha=0.9, out=out, sum_out=sum_out)
    _check(out, sum_out, ops, 1e-5, 0.9, dtype, f"strided seed={gen.seed_value}")
    assert torch.isnan(canvas_o[:, :8]).all() and torch.isnan(canvas_s[:, d:]).all(), "wrote outside out/sum_out"


def test_nan_in_one_row_stays_in_that_row(gen):
    dtype, shape = torch.float32, (6, 32)
    ops = _operands(gen, shape, dtype)
    ops["x"][2, 5] = float("nan")
    sum_out = poisoned(shape, dtype, "cpu")
    out = layer_norm(ops["x"], ops["weight"], ops["bias"], residual=ops["residual"], x_bias=ops["x_bias"], sum_out=sum_out)
    assert torch.isnan(out[2]).all(), "the NaN row must be NaN throughout"
    others = torch.cat([out[:2], out[3:]])
    assert not torch.isnan(others).any(), "NaN leaked into other rows"
    assert torch.isnan(sum_out).nonzero().tolist() == [[2, 5]], "sum_out NaN only where x was NaN"
    _check(out, sum_out, ops, 1e-5, 1.0, dtype, f"NaN row seed={gen.seed_value}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_mean_offset(dtype, gen):
    """Rows of 1000 + N(0, 1): the statistics must not lose the variance to the mean."""
    d = 768
    x = (torch.randn((16, d), generator=gen) + 1000.0).to(dtype)
    w, b = randn((d,), dtype, gen=gen), randn((d,), dtype, gen=gen)
    out = layer_norm(x, w, b, out=poisoned((16, d), dtype, "cpu"))
    ops = dict(x=x, weight=w, bias=b, residual=None, x_bias=None)
    _check(out, None, ops, 1e-5, 1.0, dtype, f"offset 1000 {dtype} seed={gen.seed_value}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_fp32_math_rounded_once(dtype, gen):
    """reference_layer_norm forms h in fp32 (not in dtype) and rounds out and h once."""
    ops = _operands(gen, (5, 64), dtype)
    out, h = reference_layer_norm(
        ops["x"], ops["weight"], ops["bias"], residual=ops["residual"], alpha=0.3,
        x_bias=ops["x_bias"], return_sum=True,
    )  # fmt: skip
    _, h32 = ln_formula(ops["x"], None, None, 1e-5, ops["residual"], 0.3, ops["x_bias"], dtype=torch.float32)
    assert torch.equal(h, h32.to(dtype))
    _check(out, h, ops, 1e-5, 0.3, dtype, f"reference {dtype} seed={gen.seed_value}")


# ------------------------------------------------------------ bad input ----


def _misaligned(shape, dtype=H):
    """A tensor whose data pointer is one element past a 16-byte boundary."""
    n = int(torch.tensor(shape).prod())
    return torch.randn(n + 8).to(dtype)[1 : 1 + n].view(shape)


def _ok():
    return dict(
        x=torch.randn(4, 16).to(H),
        weight=torch.randn(16).to(H),
        bias=torch.randn(16).to(H),
        residual=torch.randn(4, 16).to(H),
        x_bias=torch.randn(16).to(H),
    )


_shared = torch.randn(6, 16).to(H)

CASES = [
    # (description, overrides, exception, message fragment)
    ("x not a tensor", dict(x=[[1.0] * 16] * 4), TypeError, "x must be a torch.Tensor"),
    ("integer x", dict(x=torch.ones(4, 16, dtype=torch.int32)), TypeError, "x.dtype=torch.int32"),
    ("float64 x", dict(x=torch.ones(4, 16, dtype=torch.float64)), TypeError, "x.dtype=torch.float64"),
    ("weight dtype", dict(weight=torch.randn(16)), TypeError, "weight.dtype"),
    ("bias dtype", dict(bias=torch.randn(16)), TypeError, "bias.dtype"),
    ("x_bias dtype", dict(x_bias=torch.randn(16).to(torch.bfloat16)), TypeError, "x_bias.dtype"),
    ("residual dtype", dict(residual=torch.randn(4, 16)), TypeError, "residual.dtype"),
    ("out dtype", dict(out=torch.empty(4, 16)), TypeError, "out.dtype"),
    ("sum_out dtype", dict(sum_out=torch.empty(4, 16)), TypeError, "sum_out.dtype"),
    ("weight not a tensor", dict(weight=[1.0] * 16), TypeError, "weight must be a torch.Tensor"),
    ("weight on another device", dict(weight=torch.empty(16, dtype=H, device="meta")), ValueError, "weight is on meta"),
    ("residual on another device", dict(residual=torch.empty(4, 16, dtype=H, device="meta")), ValueError, "residual is on meta"),
    ("scalar x", dict(x=torch.tensor(1.0).to(H)), ValueError, "x must have at least one dimension"),
    ("weight wrong length", dict(weight=torch.randn(8).to(H)), ValueError, "weight must have shape (16,)"),
    ("weight 2-D", dict(weight=torch.randn(1, 16).to(H)), ValueError, "weight must have shape (16,)"),
    ("bias wrong length", dict(bias=torch.randn(24).to(H)), ValueError, "bias must have shape (16,)"),
    ("x_bias wrong length", dict(x_bias=torch.randn(8).to(H)), ValueError, "x_bias must have shape (16,)"),
    ("weight strided", dict(weight=torch.randn(32).to(H)[::2]), ValueError, "weight must be contiguous"),
    ("residual wrong shape", dict(residual=torch.randn(2, 2, 16).to(H)), ValueError, "residual must have shape (4, 16)"),
    ("residual wrong D", dict(residual=torch.randn(4, 24).to(H)), ValueError, "residual must have shape (4, 16)"),
    ("out wrong shape", dict(out=torch.empty(4, 24, dtype=H)), ValueError, "out must have shape (4, 16)"),
    ("sum_out wrong shape", dict(sum_out=torch.empty(16, dtype=H)), ValueError, "sum_out must have shape (4, 16)"),
    ("D not a multiple of 8", dict(x=torch.randn(4, 12).to(H), weight=None, bias=None, residual=None, x_bias=None), ValueError, "D=x.shape[-1]=12 must be a positive multiple of 8"),
    ("fp32 D not a multiple of 4", dict(x=torch.randn(4, 6), weight=None, bias=None, residual=None, x_bias=None), ValueError, "D=x.shape[-1]=6 must be a positive multiple of 4"),
    ("D zero", dict(x=torch.randn(4, 0).to(H), weight=None, bias=None, residual=None, x_bias=None), ValueError, "D=x.shape[-1]=0"),
    ("D above 16384", dict(x=torch.randn(2, 16392).to(H), weight=None, bias=None, residual=None, x_bias=None), ValueError, "at most 16384"),
    ("x misaligned", dict(x=_misaligned((4, 16))), ValueError, "x data pointer is not 16-byte aligned"),
    ("weight misaligned", dict(weight=_misaligned((16,))), ValueError, "weight data pointer"),
    ("bias misaligned", dict(bias=_misaligned((16,))), ValueError, "bias data pointer"),
    ("x_bias misaligned", dict(x_bias=_misaligned((16,))), ValueError, "x_bias data pointer"),
    ("residual misaligned", dict(residual=_misaligned((4, 16))), ValueError, "residual data pointer"),
    ("out misaligned", dict(out=_misaligned((4, 16))), ValueError, "out data pointer"),
    ("sum_out misaligned", dict(sum_out=_misaligned((4, 16))), ValueError, "sum_out data pointer"),
    ("x row stride not 16 bytes", dict(x=torch.randn(4, 20).to(H)[:, :16]), ValueError, "x row stride 20"),
    ("residual row stride not 16 bytes", dict(residual=torch.randn(4, 28).to(H)[:, :16]), ValueError, "residual row stride 28"),
    ("out row stride not 16 bytes", dict(out=torch.empty(4, 20, dtype=H)[:, :16]), ValueError, "out row stride 20"),
    ("x column-strided", dict(x=torch.randn(4, 32).to(H)[:, ::2]), ValueError, "x must have unit stride"),
    ("x rows overlap", dict(x=torch.randn(16).to(H).expand(4, 16)), ValueError, "overlapping rows"),
    ("x not viewable as rows", dict(x=torch.randn(2, 4, 16).to(H).transpose(0, 1)), ValueError, "cannot be viewed as rows"),
    ("eps NaN", dict(eps=float("nan")), ValueError, "eps=nan"),
    ("eps inf", dict(eps=float("inf")), ValueError, "eps=inf"),
    ("eps negative", dict(eps=-1e-5), ValueError, "eps=-1e-05 must be >= 0"),
    ("eps a tensor", dict(eps=torch.tensor(1e-5)), TypeError, "eps must be a real number"),
    ("eps a bool", dict(eps=True), TypeError, "eps must be a real number"),
    ("alpha NaN", dict(alpha=float("nan")), ValueError, "alpha=nan"),
    ("alpha -inf", dict(alpha=float("-inf")), ValueError, "alpha=-inf"),
    ("alpha a str", dict(alpha="1"), TypeError, "alpha must be a real number"),
    ("out is x", dict(x=_shared[:4], out=_shared[:4]), ValueError, "out overlaps x"),
    ("out overlaps x partially", dict(x=_shared[:4], out=_shared[2:]), ValueError, "out overlaps x"),
    ("out is residual", dict(residual=_shared[:4], out=_shared[:4]), ValueError, "out overlaps residual"),
    ("sum_out is x", dict(x=_shared[:4], sum_out=_shared[:4]), ValueError, "sum_out overlaps x"),
    ("sum_out overlaps out", dict(out=_shared[:4], sum_out=_shared[2:]), ValueError, "sum_out overlaps out"),
    ("sum_out partially overlaps residual", dict(residual=_shared[:4], sum_out=_shared[1:5]), ValueError, "sum_out partially overlaps residual"),
    ("sum_out is weight's storage", dict(weight=_shared[0], sum_out=_shared[:4]), ValueError, "sum_out overlaps weight"),
]


@pytest.mark.parametrize("desc,overrides,exc,fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_arguments(desc, overrides, exc, fragment):
    args = _ok()
    args.update(overrides)
    x = args["x"]
    shape = tuple(x.shape) if isinstance(x, torch.Tensor) and x.dim() else (4, 16)
    # Fresh poisoned outputs unless the case supplies its own: nothing may be written.
    out = args.get("out", poisoned(shape, H, "cpu"))
    sum_out = args.get("sum_out", poisoned(shape, H, "cpu"))
    snapshots = [t.clone() for t in (out, sum_out) if isinstance(t, torch.Tensor)]
    with pytest.raises(exc) as info:
        layer_norm(
            x, args["weight"], args["bias"], args.get("eps", 1e-5), residual=args["residual"],
            alpha=args.get("alpha", 1.0), x_bias=args["x_bias"], out=out, sum_out=sum_out,
        )  # fmt: skip
    assert fragment in str(info.value), f"{desc}: message {str(info.value)!r} lacks {fragment!r}"
    for before, after in zip(snapshots, [t for t in (out, sum_out) if isinstance(t, torch.Tensor)]):
        assert torch.equal(before.isnan(), after.isnan()) and torch.equal(
            before.nan_to_num(), after.nan_to_num()
        ), f"{desc}: an output was written before the error"


# ------------------------------------------------------------ custom ops ----


def _op_args(gen, dtype=torch.float32, residual=True, x_bias=True, affine=True):
    ops = _operands(gen, (6, 16), dtype, residual=residual, x_bias=x_bias, weight=affine, bias=affine)
    return (ops["x"], ops["weight"], ops["bias"], 1e-5, ops["residual"], 0.5, ops["x_bias"])


@pytest.mark.parametrize("options", [(True, True, True), (False, False, True), (True, False, False), (False, True, False)])
def test_opcheck_layer_norm(options, gen):
    residual, x_bias, affine = options
    torch.library.opcheck(torch.ops.fusedenc.layer_norm.default, _op_args(gen, residual=residual, x_bias=x_bias, affine=affine))


@pytest.mark.parametrize("with_sum", [False, True])
def test_opcheck_layer_norm_out(with_sum, gen):
    args = _op_args(gen)
    out = poisoned((6, 16), torch.float32, "cpu")
    sum_out = poisoned((6, 16), torch.float32, "cpu") if with_sum else None
    torch.library.opcheck(torch.ops.fusedenc.layer_norm_out.default, (out, sum_out) + args)


def test_custom_ops_match_public_op(gen):
    args = _op_args(gen, dtype=H)
    x, w, b, eps, r, alpha, xb = args
    want = layer_norm(x, w, b, eps, residual=r, alpha=alpha, x_bias=xb)
    assert torch.equal(torch.ops.fusedenc.layer_norm(*args), want)
    out, s = poisoned((6, 16), H, "cpu"), poisoned((6, 16), H, "cpu")
    torch.ops.fusedenc.layer_norm_out(out, s, *args)
    assert torch.equal(out, want)
    assert torch.equal(s, reference_layer_norm(x, w, b, eps, residual=r, alpha=alpha, x_bias=xb, return_sum=True)[1])


def test_compile_fullgraph_matches_eager(gen):
    """Functional and sum_out forms (sum_out = residual, in place) trace without graph breaks."""
    torch._dynamo.reset()
    d = 32
    w, b, xb = (randn((d,), torch.float32, gen=gen) for _ in range(3))

    def block(x, r):
        h = layer_norm(x, w, b, residual=r, alpha=0.5, x_bias=xb)
        y = layer_norm(h * 2.0, w, None, 1e-6, residual=r, sum_out=r)  # r <- r + 2h
        return y + 1.0

    x = randn((2, 3, d), torch.float32, gen=gen)
    r = randn((2, 3, d), torch.float32, gen=gen)
    r_eager, r_compiled = r.clone(), r.clone()
    want = block(x, r_eager)
    got = torch.compile(block, fullgraph=True, backend="aot_eager")(x, r_compiled)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(r_compiled, r_eager)
    assert not torch.equal(r_compiled, r), "sum_out=residual must update the residual in place"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_h_is_not_rounded_before_the_statistics(dtype, gen):
    """h = x + residual around 30 is normalized from fp32, and out is rounded once."""
    shape = (8, 256)
    x = randn(shape, dtype, gen=gen)
    r = (torch.randn(shape, generator=gen) + 30.0).to(dtype)
    w, b, xb = randn((256,), dtype, gen=gen), randn((256,), dtype, gen=gen), randn((256,), dtype, gen=gen)
    out = layer_norm(x, w, b, residual=r, alpha=0.75, x_bias=xb, out=poisoned(shape, dtype, "cpu"))
    exact, _ = ln_formula(x, w, b, 1e-5, r, 0.75, xb, dtype=torch.float64)
    assert_rounded_once(out, exact, dtype, what=f"{dtype} seed={gen.seed_value}")
