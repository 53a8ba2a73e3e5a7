"""layer_norm's native kernel on the GPU against fp32 (fp64 for fp32) formulas, by the tolerance rule.

``same`` is plain PyTorch in the op's dtype on the GPU:
``F.layer_norm(residual + alpha * (x + x_bias))`` with every step rounded.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import assert_close_rule, poisoned, randn, ref_dtype
from layer_norm_helpers import assert_rounded_once, ln_formula, ln_same_dtype

import fusedenc.ops.norm  # noqa: F401 - registers torch.ops.fusedenc.layer_norm / layer_norm_out
from fusedenc import core
from fusedenc.ops.norm import layer_norm

pytestmark = pytest.mark.gpu

DEV = "cuda"
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
DIMS = [8, 64, 768, 1024, 1032, 4096, 16384]
ROWS = [1, 7, 4097]


def _operands(gen, shape, dtype, *, residual=True, x_bias=True, weight=True, bias=True, offset=0.0):
    d = shape[-1]

    def draw(s, scale=1.0):
        return randn(s, dtype, DEV, gen=gen, scale=scale)

    x = draw(shape)
    if offset:
        x = (torch.randn(shape, generator=gen) + offset).to(dtype=dtype, device=DEV)
    return dict(
        x=x,
        weight=draw((d,)) if weight else None,
        bias=draw((d,)) if bias else None,
        residual=draw(shape) if residual else None,
        x_bias=draw((d,), 0.5) if x_bias else None,
    )


def _call(ops, eps=1e-5, alpha=1.0, **kw):
    return layer_norm(
        ops["x"], ops["weight"], ops["bias"], eps,
        residual=ops["residual"], alpha=alpha, x_bias=ops["x_bias"], **kw,
    )  # fmt: skip


def _check(out, sum_out, ops, eps, alpha, dtype, what):
    args = (ops["x"], ops["weight"], ops["bias"], eps, ops["residual"], alpha, ops["x_bias"])
    ref, ref_h = ln_formula(*args, dtype=ref_dtype(dtype))
    same, same_h = ln_same_dtype(*args)
    assert out.dtype == dtype and out.device.type == "cuda", f"{what}: out is {out.dtype} on {out.device}"
    assert_close_rule(out, ref, same, dtype, what=what)
    if sum_out is not None:
        assert_close_rule(sum_out, ref_h, same_h, dtype, what=f"{what} sum_out")


def test_native_backend_is_active():
    assert core.backend().name != "reference", str(core.backend())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("t", ROWS)
@pytest.mark.sweep
def test_matches_reference(dtype, d, t, gen):
    ops = _operands(gen, (t, d), dtype)
    out = poisoned((t, d), dtype, DEV)
    sum_out = poisoned((t, d), dtype, DEV)
    got = _call(ops, alpha=0.6, out=out, sum_out=sum_out)
    assert got is out
    _check(out, sum_out, ops, 1e-5, 0.6, dtype, f"T={t} D={d} {dtype} seed={gen.seed_value}")


OPTIONS = list(itertools.product([False, True], [False, True], [1.0, 0.37], ["both", "weight", "bias", "none"], [False, True]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "residual,x_bias,alpha,affine,with_sum", OPTIONS, ids=["-".join(map(str, o)) for o in OPTIONS]
)
@pytest.mark.sweep
def test_every_option_combination(dtype, residual, x_bias, alpha, affine, with_sum, gen):
    shape = (33, 1032 if dtype != torch.float32 else 516)
    ops = _operands(
        gen, shape, dtype, residual=residual, x_bias=x_bias,
        weight=affine in ("both", "weight"), bias=affine in ("both", "bias"),
    )  # fmt: skip
    out = poisoned(shape, dtype, DEV)
    sum_out = poisoned(shape, dtype, DEV) if with_sum else None
    _call(ops, alpha=alpha, out=out, sum_out=sum_out)
    what = f"{dtype} residual={residual} x_bias={x_bias} alpha={alpha} affine={affine} seed={gen.seed_value}"
    _check(out, sum_out, ops, 1e-5, alpha, dtype, what)


@pytest.mark.parametrize("dtype", DTYPES)
def test_allocates_out(dtype, gen):
    ops = _operands(gen, (2, 5, 768), dtype)
    out = _call(ops, eps=1e-6, alpha=1.5)
    assert out.shape == (2, 5, 768) and out.is_contiguous()
    _check(out, None, ops, 1e-6, 1.5, dtype, f"allocated {dtype} seed={gen.seed_value}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 768, 4096, 16384])
def test_h_is_not_rounded_before_the_statistics(dtype, d, gen):
    """h around 30 is normalized from fp32 and rounded once (the rule alone cannot see this)."""
    ops = _operands(gen, (9, d), dtype)
    ops["residual"] = (torch.randn((9, d), generator=gen) + 30.0).to(dtype=dtype, device=DEV)
    out = _call(ops, alpha=0.75, out=poisoned((9, d), dtype, DEV))
    exact, _ = ln_formula(ops["x"], ops["weight"], ops["bias"], 1e-5, ops["residual"], 0.75, ops["x_bias"])
    assert_rounded_once(out, exact, dtype, what=f"D={d} {dtype} seed={gen.seed_value}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [8, 768, 1032])
def test_strided_rows(dtype, d, gen):
    """x and residual column slices of wider buffers; out and sum_out slices of poisoned canvases."""
    t, pad = 37, 16
    x = randn((t, d + 2 * pad), dtype, DEV, gen=gen)[:, pad : pad + d]
    r = randn((t, d + pad), dtype, DEV, gen=gen)[:, pad:]
    canvas_o = poisoned((t, d + pad), dtype, DEV)
    canvas_s = poisoned((t, d + 2 * pad), dtype, DEV)
    out, sum_out = canvas_o[:, pad:], canvas_s[:, :d]
    ops = dict(x=x, weight=randn((d,), dtype, DEV, gen=gen), bias=randn((d,), dtype, DEV, gen=gen), residual=r,
               x_bias=randn((d,), dtype, DEV, gen=gen))  # fmt: skip
    _call(ops, alpha=0.9, out=out, sum_out=sum_out)
    _check(out, sum_out, ops, 1e-5, 0.9, dtype, f"strided D={d} {dtype} seed={gen.seed_value}")
    assert torch.isnan(canvas_o[:, :pad]).all(), "wrote left of out"
    assert torch.isnan(canvas_s[:, d:]).all(), "wrote right of sum_out"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 768, 16384])
def test_sum_out_is_residual_in_place(dtype, d, gen):
    ops = _operands(gen, (65, d), dtype)
    before = dict(ops, residual=ops["residual"].clone())
    r = ops["residual"]
    out = _call(ops, alpha=0.7, sum_out=r)
    _check(out, r, before, 1e-5, 0.7, dtype, f"in place D={d} {dtype} seed={gen.seed_value}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [768, 4096])
def test_large_mean_offset(dtype, d, gen):
    """Rows of 1000 + N(0, 1): two-pass statistics keep the variance; E[h^2] - E[h]^2 would not."""
    ops = _operands(gen, (64, d), dtype, residual=False, x_bias=False, offset=1000.0)
    out = _call(ops, out=poisoned((64, d), dtype, DEV))
    what = f"offset 1000 D={d} {dtype} seed={gen.seed_value}"
    _check(out, None, ops, 1e-5, 1.0, dtype, what)
    # The test can tell: the one-pass formula in fp32 fails the same rule.
    h = ops["x"].float()
    mean = h.mean(-1, keepdim=True)
    var = (h * h).mean(-1, keepdim=True) - mean * mean
    naive = ((h - mean) / torch.sqrt(var.clamp_min(0) + 1e-5) * ops["weight"].float() + ops["bias"].float()).to(dtype)
    with pytest.raises(AssertionError):
        _check(naive, None, ops, 1e-5, 1.0, dtype, what)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_in_one_row_stays_in_that_row(dtype, gen):
    shape = (7, 768)
    ops = _operands(gen, shape, dtype)
    ops["x"][3, 17] = float("nan")
    out, sum_out = poisoned(shape, dtype, DEV), poisoned(shape, dtype, DEV)
    _call(ops, out=out, sum_out=sum_out)
    assert torch.isnan(out[3]).all(), "the NaN row must be NaN throughout"
    assert not torch.isnan(torch.cat([out[:3], out[4:]])).any(), "NaN leaked into other rows"
    assert torch.isnan(sum_out).nonzero().tolist() == [[3, 17]], "sum_out is NaN only where x was"
    _check(out, sum_out, ops, 1e-5, 1.0, dtype, f"NaN row {dtype} seed={gen.seed_value}")


@pytest.mark.parametrize("shape", [(0, 768), (3, 0, 64)])
def test_empty_batch(shape):
    x = torch.empty(shape, dtype=torch.float16, device=DEV)
    w = torch.ones(shape[-1], dtype=torch.float16, device=DEV)
    out = layer_norm(x, w, w, residual=torch.empty_like(x), sum_out=torch.empty_like(x))
    assert out.shape == shape and out.device.type == "cuda"


def test_cuda_graph_replay_on_new_inputs(gen):
    dtype, shape = torch.float16, (257, 768)
    ops = _operands(gen, shape, dtype)
    out, sum_out = poisoned(shape, dtype, DEV), poisoned(shape, dtype, DEV)

    def step():
        _call(ops, alpha=0.5, out=out, sum_out=sum_out)
        return _call(ops, eps=1e-6)  # allocated inside the graph

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        allocated = step()

    for trial in range(2):
        ops["x"].copy_(randn(shape, dtype, DEV, gen=gen))
        ops["residual"].copy_(randn(shape, dtype, DEV, gen=gen))
        out.fill_(float("nan"))
        sum_out.fill_(float("nan"))
        allocated.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        what = f"graph replay {trial} seed={gen.seed_value}"
        _check(out, sum_out, ops, 1e-5, 0.5, dtype, what)
        _check(allocated, None, ops, 1e-6, 1.0, dtype, what + " (allocated out)")


def test_compile_fullgraph(gen):
    torch._dynamo.reset()
    dtype, d = torch.float16, 768
    w, b, xb = (randn((d,), dtype, DEV, gen=gen) for _ in range(3))

    def block(x, r):
        h = layer_norm(x, w, b, residual=r, alpha=0.5, x_bias=xb)
        s = torch.empty_like(r)
        y = layer_norm(h, w, None, 1e-6, residual=r, sum_out=s)  # s = r + h
        return y * 2.0, s

    x = randn((4, 16, d), dtype, DEV, gen=gen)
    r = randn((4, 16, d), dtype, DEV, gen=gen)
    want_y, want_s = block(x, r)
    got_y, got_s = torch.compile(block, fullgraph=True)(x, r)
    # The same kernel runs on the same inputs: bit-identical.
    assert torch.equal(got_y, want_y) and torch.equal(got_s, want_s), f"seed={gen.seed_value}"
    ops = dict(x=x, weight=w, bias=b, residual=r, x_bias=xb)
    h = layer_norm(x, w, b, residual=r, alpha=0.5, x_bias=xb)
    _check(got_y / 2, got_s, dict(x=h, weight=w, bias=None, residual=r, x_bias=None), 1e-6, 1.0, dtype,
           f"compiled seed={gen.seed_value}")  # fmt: skip
    _check(h, None, ops, 1e-5, 0.5, dtype, f"compiled first norm seed={gen.seed_value}")


def test_compile_sum_out_in_place_on_graph_input(gen):
    torch._dynamo.reset()
    dtype, d = torch.bfloat16, 1024
    w, b = randn((d,), dtype, DEV, gen=gen), randn((d,), dtype, DEV, gen=gen)

    def block(x, r):
        return layer_norm(x, w, b, residual=r, alpha=0.3, sum_out=r)

    x = randn((8, d), dtype, DEV, gen=gen)
    r = randn((8, d), dtype, DEV, gen=gen)
    r_eager, r_compiled = r.clone(), r.clone()
    want = block(x, r_eager)
    got = torch.compile(block, fullgraph=True)(x, r_compiled)
    assert torch.equal(got, want) and torch.equal(r_compiled, r_eager), f"seed={gen.seed_value}"
    ops = dict(x=x, weight=w, bias=b, residual=r, x_bias=None)
    _check(got, r_compiled, ops, 1e-5, 0.3, dtype, f"compiled in place seed={gen.seed_value}")


def test_runs_on_the_current_stream(gen):
    """Work queued on a side stream: the op must launch there, after the producer of x."""
    dtype, shape = torch.float16, (4096, 1024)
    ops = _operands(gen, shape, dtype)
    x_src = ops["x"]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        big = torch.randn(8192, 8192, device=DEV)
        for _ in range(3):
            big = big @ big.t() * 1e-4  # keep the side stream busy
        x = x_src * 1.0  # produced on the side stream
        out = layer_norm(x, ops["weight"], ops["bias"], residual=ops["residual"], x_bias=ops["x_bias"])
    side.synchronize()
    _check(out, None, dict(ops, x=x_src), 1e-5, 1.0, dtype, f"side stream seed={gen.seed_value}")


def test_native_checks_are_a_second_line_of_defence(gen):
    """The core itself rejects what the Python checks would (std::invalid_argument -> ValueError)."""
    module = core.native_module()
    x = randn((4, 32), torch.float16, DEV, gen=gen)
    out = torch.empty_like(x)
    stream = torch.cuda.current_stream().cuda_stream
    dev = x.device.index

    def call(**kw):
        a = dict(device=dev, stream=stream, rows=4, cols=32, x=x.data_ptr(), ldx=32, residual=0, ldr=0,
                 x_bias=0, weight=0, bias=0, out=out.data_ptr(), ldo=32, sum_out=0, lds=0, dtype=0,
                 eps=1e-5, alpha=1.0)  # fmt: skip
        a.update(kw)
        module.layer_norm(**a)

    call()  # valid
    torch.cuda.synchronize()
    cases = [
        (dict(cols=12, ldx=12, ldo=12), "D=12"),
        (dict(cols=16392, ldx=16392, ldo=16392), "at most 16384"),
        (dict(x=x.data_ptr() + 2), "x must be 16-byte aligned"),
        (dict(ldx=20), "x row stride 20"),
        (dict(out=x.data_ptr()), "out overlaps an input"),
        (dict(residual=out.data_ptr(), ldr=32), "out overlaps residual"),
        (dict(residual=x.data_ptr(), ldr=32, sum_out=x.data_ptr() + 64, lds=32), "sum_out"),
        (dict(eps=float("nan")), "eps"),
        (dict(eps=-1.0), "eps"),
        (dict(alpha=1e300), "alpha"),
        (dict(dtype=7), "dtype"),
    ]
    for kw, fragment in cases:
        out.fill_(float("nan"))
        with pytest.raises(ValueError) as info:
            call(**kw)
        assert fragment in str(info.value), f"{kw}: {info.value}"
        torch.cuda.synchronize()
        assert torch.isnan(out).all(), f"{kw}: launched despite the error"
