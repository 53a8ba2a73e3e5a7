"""``fusedenc.fp8.rowwise``: the reference math of the FP8 mode (per-row e4m3 scales, scaled GEMM)."""

from __future__ import annotations

import pytest
import torch
from helpers import randn

from fusedenc.fp8.rowwise import E4M3, E4M3_MAX, dequantize, quantize_rows, scaled_linear


def test_rows_round_trip_within_e4m3_precision(gen):
    x = randn((64, 300), torch.float32, gen=gen) * torch.logspace(-3, 3, 64)[:, None]  # rows of every size
    t = quantize_rows(x)
    assert t.q.dtype == E4M3 and t.scale.dtype == torch.float32 and t.scale.shape == (64,)
    assert t.q.float().abs().amax(dim=1).eq(E4M3_MAX).all()  # each row's largest value maps onto 448
    back = dequantize(t)
    # 3 mantissa bits: half an ulp is 2^-4 of the value for normals; below e4m3's smallest
    # normal (2^-6 of the code range) the spacing is 2^-9 in codes.
    bound = torch.maximum(x.abs() * 2.0**-4, t.scale[:, None] * 2.0**-10)
    assert ((back - x).abs() <= bound).all()


def test_zero_rows_and_non_finite_rows():
    x = torch.tensor([[0.0, 0.0, 0.0], [1.0, float("nan"), 2.0], [1.0, float("inf"), -1.0], [2.0, -4.0, 1.0]])
    t = quantize_rows(x)
    assert t.scale[0] == 1 and (t.q[0].float() == 0).all()
    back = dequantize(t)
    assert torch.isnan(back[1]).all() and torch.isnan(back[2]).all()  # a bad value spoils its whole row
    assert torch.equal(back[3], x[3])  # small integers are exact


def test_scaled_linear_is_the_gemm_of_the_dequantized_operands(gen):
    x = randn((33, 96), torch.float32, gen=gen)
    w = randn((40, 96), torch.float32, gen=gen)
    b = randn((40,), torch.float16, gen=gen)
    qx, qw = quantize_rows(x), quantize_rows(w)
    out = scaled_linear(qx, qw, b, torch.float16)
    ref = (dequantize(qx).double() @ dequantize(qw).double().t() + b.double())
    assert out.dtype == torch.float16
    # One rounding to fp16 (half an ulp, 2^-11 relative) plus fp32 summation of 96 products.
    assert ((out.double() - ref).abs() <= ref.abs() * 2.0**-10 + 1e-5).all()


def test_bad_arguments():
    with pytest.raises(TypeError, match="2-D floating"):
        quantize_rows(torch.zeros(3, dtype=torch.float32))
    with pytest.raises(TypeError, match="2-D floating"):
        quantize_rows(torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="x has 4 columns but the weight 5"):
        scaled_linear(quantize_rows(torch.ones(2, 4)), quantize_rows(torch.ones(3, 5)))


# ------------------------------------------------------------- fp8.linear ----

from fusedenc.common.activations import apply_activation  # noqa: E402
from fusedenc.fp8 import rowwise as fp8  # noqa: E402


@pytest.mark.parametrize("activation", ["none", "relu", "swish", "gelu"])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_linear_reference_is_scaled_linear_then_the_activation(activation, out_dtype, gen):
    x = fp8.quantize_rows(randn((7, 48), torch.float32, gen=gen))
    w = fp8.quantize_rows(randn((24, 48), torch.float32, gen=gen))
    b = randn((24,), out_dtype, gen=gen)
    out = fp8.linear(x, w, b, activation, out_dtype=out_dtype)
    expect = apply_activation(scaled_linear(x, w, None, torch.float32) + b.float(), activation).to(out_dtype)
    assert out.dtype == out_dtype and torch.equal(out, expect)


def test_linear_bad_arguments(gen):
    x = fp8.quantize_rows(randn((4, 32), torch.float32, gen=gen))
    w = fp8.quantize_rows(randn((8, 32), torch.float32, gen=gen))
    with pytest.raises(TypeError, match="Quantized"):
        fp8.linear(x.q, w)
    with pytest.raises(TypeError, match="x.q must be a 2-D"):
        fp8.linear(fp8.Quantized(x.q.float(), x.scale), w)
    with pytest.raises(TypeError, match="weight.scale must be float32 of shape"):
        fp8.linear(x, fp8.Quantized(w.q, w.scale[:4]))
    with pytest.raises(ValueError, match="x has 32 columns but the weight 48"):
        fp8.linear(x, fp8.quantize_rows(torch.ones(8, 48)))
    odd = fp8.quantize_rows(torch.ones(4, 40))
    with pytest.raises(ValueError, match="multiple of 16"):
        fp8.linear(odd, fp8.quantize_rows(torch.ones(8, 40)))
    with pytest.raises(TypeError, match="out_dtype"):
        fp8.linear(x, w, out_dtype=torch.float32)
    with pytest.raises(TypeError, match=r"bias must be torch.float16 of shape \(8,\)"):
        fp8.linear(x, w, torch.zeros(8, dtype=torch.float32))
    with pytest.raises(TypeError, match=r"bias must be torch.float16 of shape \(8,\)"):
        fp8.linear(x, w, torch.zeros(7, dtype=torch.float16))
    with pytest.raises(ValueError, match="activation"):
        fp8.linear(x, w, activation="softplus")
