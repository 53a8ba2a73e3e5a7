"""FP8 on the GPU (issue 21): the row-wise e4m3 quantization kernel against the reference
math bit for bit, and the cuBLASLt FP8 GEMM with per-row scales against the same codes
summed in float64, by the tolerance rule (``helpers.assert_close_rule``: the CPU reference
``fusedenc.fp8.rowwise.linear``, fp32 sums rounded once, is the same-dtype peer), into
NaN-poisoned outputs.  Skipped where the GPU or the build has no FP8 path; on compute
capability 9.0 with a build that holds it, the path must run."""

from __future__ import annotations

import pytest
import torch
from fp8_helpers import require_fp8_gpu
from helpers import assert_close_rule, poisoned, randn

from fusedenc import core
from fusedenc.common import dtypes
from fusedenc.common.activations import apply_activation
from fusedenc.fp8 import rowwise as fp8

pytestmark = pytest.mark.gpu

DEV = "cuda"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).cpu()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("rows, k", [(1, 16), (33, 40), (300, 768), (17, 1024), (9, 2048), (65, 4096), (3, 1), (5, 4104)])
def test_quantize_kernel_matches_the_reference_bit_for_bit(dtype, rows, k, gen):
    """Both kernels: a warp per row from registers (16-byte rows up to 2048 fp16 / 1024 fp32
    values) and a block per row for the rest (k = 1, 4096, 4104; fp32 past 1024)."""
    require_fp8_gpu()
    x = randn((rows, k), torch.float32, gen=gen) * torch.logspace(-4, 4, rows)[:, None]  # every row size
    x = x.to(dtype)
    got = fp8.quantize_rows(x.to(DEV))
    want = fp8.quantize_rows(x)  # CPU: the reference math
    assert got.q.is_cuda and got.q.dtype == fp8.E4M3 and got.scale.dtype == torch.float32
    assert torch.equal(got.scale.cpu(), want.scale), (got.scale.cpu() - want.scale).abs().max()
    assert torch.equal(_bits(got.q), _bits(want.q))


def test_quantize_kernel_special_rows_and_strided_input():
    require_fp8_gpu()
    wide = torch.randn(6, 80, dtype=torch.float16)
    wide[0] = 0  # zeros: scale 1, codes 0
    wide[1, 10] = float("nan")  # NaN spoils its row
    wide[2, 12] = float("inf")
    wide[3, 14] = -float("inf")
    wide[4, 3] = 1e4  # left of the slice: must not count
    x = wide[:, 8:72]  # a column slice: row stride 80
    got = fp8.quantize_rows(wide.to(DEV)[:, 8:72])
    assert got.q.is_cuda
    want = fp8.quantize_rows(x)
    assert torch.equal(got.scale.cpu().isnan(), want.scale.isnan())
    ok = ~want.scale.isnan()
    assert torch.equal(got.scale.cpu()[ok], want.scale[ok])
    assert got.scale[0].item() == 1.0 and _bits(got.q)[0].eq(0).all()
    assert torch.isnan(fp8.dequantize(got)[1:4]).all() and torch.isfinite(fp8.dequantize(got)[4:]).all()
    assert torch.equal(_bits(got.q)[4:], _bits(want.q)[4:])
    # Rows that start off a 16-byte boundary take the block kernel: same bits.
    odd = fp8.quantize_rows(wide.to(DEV)[:, 3:67])
    ref = fp8.quantize_rows(wide[:, 3:67])
    ok = ~ref.scale.isnan()
    assert torch.equal(odd.scale.cpu()[ok], ref.scale[ok]) and torch.equal(_bits(odd.q)[4:], _bits(ref.q)[4:])


def test_quantize_kernel_codes_at_rounding_boundaries():
    """The kernels divide by a row's scale through its reciprocal and one FMA correction
    (fp8_rows.cuh), which must round as IEEE division does: values that are exact e4m3
    midpoints times a scale that is not a power of two (ties to even), their neighbours one
    ulp away, -0, and rows whose scale is outside [2^-100, 2^100] (the division fallback)."""
    require_fp8_gpu()
    mids = torch.tensor([1.0625, 1.1875, 17.0, 19.0, 0.015625 * 1.5, 2.0**-9 * 1.5, 416.0, 432.0])
    rows = []
    for s in (3.0, 0.7, 1.0 / 3.0, 1e-20, 5e20, 1e-36, 1e35):  # the last two: the fallback
        base = (mids * s).float()
        row = torch.cat([base, base.nextafter(torch.full_like(base, float("inf"))),
                         base.nextafter(torch.full_like(base, -float("inf"))), -base,
                         torch.tensor([-0.0, 0.0, 448.0 * s])])  # fmt: skip
        rows.append(row.float())
    x = torch.stack(rows)
    got = fp8.quantize_rows(x.to(DEV))
    want = fp8.quantize_rows(x)
    assert torch.equal(got.scale.cpu(), want.scale)
    assert torch.equal(_bits(got.q), _bits(want.q)), (_bits(got.q) != _bits(want.q)).nonzero()[:8]


def _operands(m, n, k, gen, out_dtype, with_bias=True):
    x = randn((m, k), torch.float32, gen=gen)
    w = randn((n, k), torch.float32, gen=gen, scale=k**-0.5)
    b = randn((n,), out_dtype, gen=gen, scale=0.5) if with_bias else None
    return fp8.quantize_rows(x), fp8.quantize_rows(w), b


def _ref64(x, w, b, activation):
    y = (x.q.double() @ w.q.double().t()) * x.scale.double()[:, None] * w.scale.double()[None, :]
    if b is not None:
        y = y + b.double()
    return apply_activation(y, activation)


def _torch_same(x, w, b, activation, out_dtype):
    """The same-dtype peer of the rule: what torch computes from these codes, the scaled GEMM
    (+ bias) rounded to the output dtype, then the activation in that dtype (as
    ``torch._scaled_mm`` followed by ``F.silu`` would)."""
    return apply_activation(fp8.scaled_linear(x, w, b, out_dtype), activation)


def _to_gpu(t: fp8.Quantized) -> fp8.Quantized:
    return fp8.Quantized(t.q.to(DEV), t.scale.to(DEV))


ACTS = ["none", "relu", "gelu_tanh", "swish", "mish", "gelu"]


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("m, n, k", [(64, 96, 64), (1, 256, 128), (1000, 2304, 768), (333, 768, 2304)])
@pytest.mark.sweep
def test_fp8_linear_matches_the_float64_sum_of_the_codes(activation, out_dtype, m, n, k, gen):
    require_fp8_gpu()
    x, w, b = _operands(m, n, k, gen, out_dtype)
    out = poisoned((m, n), out_dtype, DEV)
    got = fp8.linear(_to_gpu(x), _to_gpu(w), b.to(DEV), activation, out_dtype=out_dtype, out=out)
    assert got.data_ptr() == out.data_ptr()
    same = _torch_same(x, w, b, activation, out_dtype)
    assert_close_rule(got, _ref64(x, w, b, activation), same, out_dtype, f"fp8 {activation} {m}x{n}x{k}")


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_fp8_linear_without_bias_fast_accum_and_empty(with_bias, gen):
    require_fp8_gpu()
    m, n, k = 512, 1024, 1024
    x, w, b = _operands(m, n, k, gen, torch.float16, with_bias)
    bg = None if b is None else b.to(DEV)
    ref = _ref64(x, w, b, "none")
    same = fp8.linear(x, w, b)
    got = fp8.linear(_to_gpu(x), _to_gpu(w), bg, out=poisoned((m, n), torch.float16, DEV))
    assert_close_rule(got, ref, same, torch.float16, "fp8 plain")
    # Fast accumulation keeps fewer bits inside the tensor cores: within the rule plus
    # 2^-8 of the output's largest magnitude (K = 1024 products; an H200 run on fresh inputs
    # once reached 2^-8.4, over the 2^-9 first allowed here).
    fast = fp8.linear(_to_gpu(x), _to_gpu(w), bg, fast_accum=True, out=poisoned((m, n), torch.float16, DEV))
    slack = 2.0**-8 * ref.abs().max().item()
    assert_close_rule(fast, ref, same, torch.float16, "fp8 fast_accum", atol=1e-3 + slack)
    empty = fp8.linear(fp8.Quantized(x.q[:0].to(DEV), x.scale[:0].to(DEV)), _to_gpu(w), bg)
    assert empty.shape == (0, n)


def test_fp8_linear_refuses_bad_gpu_arguments(gen):
    require_fp8_gpu()
    x, w, b = _operands(16, 32, 64, gen, torch.float16)
    xg, wg = _to_gpu(x), _to_gpu(w)
    with pytest.raises(ValueError, match="x is on"):
        fp8.linear(x, wg)
    with pytest.raises(ValueError, match="bias is on"):
        fp8.linear(xg, wg, b)
    with pytest.raises(ValueError, match="codes on"):
        fp8.linear(fp8.Quantized(xg.q, x.scale), wg)
    with pytest.raises(TypeError, match="out must be"):
        fp8.linear(xg, wg, out=torch.empty((16, 32), dtype=torch.bfloat16, device=DEV))
    with pytest.raises(ValueError, match="unit column stride"):
        fp8.linear(xg, wg, out=torch.empty((32, 16), dtype=torch.float16, device=DEV).t())


def test_fp8_linear_in_a_cuda_graph(gen):
    require_fp8_gpu()
    x, w, b = _operands(256, 512, 256, gen, torch.float16)
    xg, wg, bg = _to_gpu(x), _to_gpu(w), b.to(DEV)
    out = poisoned((256, 512), torch.float16, DEV)
    fp8.linear(xg, wg, bg, "swish", out=out)  # plan made outside the capture
    expect = out.clone()
    out.fill_(float("nan"))
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        fp8.linear(xg, wg, bg, "swish", out=out)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expect)


@pytest.mark.parametrize("activation", ["swish", "mish", "relu2", "sigmoid"])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_hopper_fp8_epilogue_kernel_and_its_cublaslt_twin(activation, out_dtype, with_bias, gen):
    """With fast accumulation asked for, activations cuBLASLt cannot fuse run in the Hopper
    FP8 kernel's epilogue on problems that fill the GPU; with it switched off, cuBLASLt (fast)
    + the activation pass.  Both within the rule against the float64 sum of the codes, plus
    the fast-accumulation slack of the test above (2^-9 of the pre-activation range),
    carried through the activation (relu2 doubles it where the output is largest)."""
    require_fp8_gpu()
    from fusedenc import testing

    m, n, k = 2048 + 40, 2304, 768  # the last 256-row tile partial
    x, w, b = _operands(m, n, k, gen, out_dtype, with_bias)
    xg, wg = _to_gpu(x), _to_gpu(w)
    bg = None if b is None else b.to(DEV)
    out = poisoned((m, n), out_dtype, DEV)
    runs, why = core.sm90_fp8_gemm_applies(xg.q, xg.scale, wg.q, wg.scale, bg, out, activation, fast_accum=True)
    if torch.cuda.get_device_capability() == (9, 0) and dtypes.name(out_dtype) in core.sm90_fp8_gemm_kernels():
        assert runs, why
    if not runs:
        pytest.skip(f"no Hopper FP8 kernel here: {why}")
    ref = _ref64(x, w, b, activation)
    same = _torch_same(x, w, b, activation, out_dtype)
    pre = _ref64(x, w, b, "none")
    delta = 2.0**-9 * pre.abs().max().item()
    moved = torch.maximum((apply_activation(pre + delta, activation) - ref).abs(),
                          (apply_activation(pre - delta, activation) - ref).abs())  # fmt: skip
    atol = dtypes.ATOL[out_dtype] + moved.max().item()
    fp8.linear(xg, wg, bg, activation, out_dtype=out_dtype, fast_accum=True, out=out)
    assert_close_rule(out, ref, same, out_dtype, f"sm90 fp8 {activation}", atol=atol)
    twin = poisoned((m, n), out_dtype, DEV)
    with testing.sm90_gemm_disabled():
        assert not core.sm90_fp8_gemm_applies(xg.q, xg.scale, wg.q, wg.scale, bg, twin, activation, fast_accum=True)[0]
        fp8.linear(xg, wg, bg, activation, out_dtype=out_dtype, fast_accum=True, out=twin)
    assert_close_rule(twin, ref, same, out_dtype, f"cuBLASLt fp8 {activation}", atol=atol)


def test_hopper_fp8_kernel_declines_what_it_cannot_run(gen):
    require_fp8_gpu()
    x, w, b = _operands(2048, 2304, 768, gen, torch.float16)
    xg, wg, bg = _to_gpu(x), _to_gpu(w), b.to(DEV)
    out = torch.empty((2048, 2304), dtype=torch.float16, device=DEV)
    if dtypes.name(torch.float16) not in core.sm90_fp8_gemm_kernels():  # built without CUTLASS, or not for sm90
        for activation in ("none", "relu", "gelu", "swish"):
            ok, why = core.sm90_fp8_gemm_applies(xg.q, xg.scale, wg.q, wg.scale, bg, out, activation, fast_accum=True)
            assert not ok and "in this build" in why, (activation, why)
        return
    for activation, reason in (("none", "cuBLASLt fuses"), ("relu", "cuBLASLt fuses"), ("gelu", "separate pass")):
        ok, why = core.sm90_fp8_gemm_applies(xg.q, xg.scale, wg.q, wg.scale, bg, out, activation, fast_accum=True)
        assert not ok and reason in why, (activation, why)
    ok, why = core.sm90_fp8_gemm_applies(xg.q, xg.scale, wg.q, wg.scale, bg, out, "swish")
    assert not ok and "accurate accumulation" in why
    small = fp8.Quantized(xg.q[:64], xg.scale[:64])
    ok, why = core.sm90_fp8_gemm_applies(small.q, small.scale, wg.q, wg.scale, bg, out[:64], "swish", fast_accum=True)
    assert not ok and "fill the GPU" in why
