"""The ops on CPU tensors (the reference path) against fp64 formulas."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close_rule, linear_formula, poisoned, randn, same_dtype_torch

import fusedenc
from fusedenc.common.activations import ACTIVATIONS

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_every_activation(dtype, activation, with_bias, gen):
    m, n, k = 13, 24, 32
    x = randn((m, k), dtype, gen=gen)
    w = randn((n, k), dtype, gen=gen, scale=k**-0.5)
    b = randn((n,), dtype, gen=gen) if with_bias else None
    out = fusedenc.linear(x, w, b, activation, out=poisoned((m, n), dtype, "cpu"))
    ref = linear_formula(x, w, b, activation, dtype=torch.float64)
    same = same_dtype_torch(x, w, b, activation)
    assert_close_rule(out, ref, same, dtype, what=f"{activation} bias={with_bias} seed={gen.seed_value}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_linear_rounds_once(dtype, gen):
    """reference_linear is the fp32 math rounded once: exactly the fp32 formula cast to dtype."""
    x = randn((9, 16), dtype, gen=gen)
    w = randn((8, 16), dtype, gen=gen, scale=0.25)
    b = randn((8,), dtype, gen=gen)
    got = fusedenc.reference_linear(x, w, b, "mish", alpha=0.5)
    want = linear_formula(x, w, b, "mish", alpha=0.5, dtype=torch.float32).to(dtype)
    assert torch.equal(got, want)


@pytest.mark.parametrize("shape", [(8,), (5, 8), (2, 3, 8), (2, 1, 3, 8)])
def test_leading_dimensions(shape, gen):
    x = randn(shape, torch.float32, gen=gen)
    w = randn((12, 8), torch.float32, gen=gen)
    out = fusedenc.linear(x, w, None, "relu")
    assert out.shape == shape[:-1] + (12,)
    want = linear_formula(x, w, None, "relu", dtype=torch.float64)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("beta", [1.0, -0.5, 2.0])
@pytest.mark.parametrize("alpha", [1.0, 0.37])
def test_residual_and_scales(alpha, beta, gen):
    dtype = torch.float16
    x = randn((6, 16), dtype, gen=gen)
    w = randn((24, 16), dtype, gen=gen, scale=0.25)
    b = randn((24,), dtype, gen=gen)
    r = randn((6, 24), dtype, gen=gen)
    out = fusedenc.linear(x, w, b, residual=r, beta=beta, alpha=alpha, out=poisoned((6, 24), dtype, "cpu"))
    ref = linear_formula(x, w, b, residual=r, beta=beta, alpha=alpha, dtype=torch.float32)
    same = same_dtype_torch(x, w, b, residual=r, beta=beta, alpha=alpha)
    assert_close_rule(out, ref, same, dtype, what=f"alpha={alpha} beta={beta} seed={gen.seed_value}")


def test_residual_in_place(gen):
    x = randn((4, 8), torch.float32, gen=gen)
    w = randn((8, 8), torch.float32, gen=gen)
    r = randn((4, 8), torch.float32, gen=gen)
    want = linear_formula(x, w, None, residual=r.clone(), dtype=torch.float64)
    got = fusedenc.linear(x, w, None, residual=r, out=r)
    assert got is r
    torch.testing.assert_close(r.double(), want, rtol=1e-5, atol=1e-5)


def test_strided_operands(gen):
    """x as a column slice of a wider buffer, out as a column slice of a poisoned one."""
    wide = randn((5, 24), torch.float32, gen=gen)
    x = wide[:, 8:16]
    w = randn((4, 8), torch.float32, gen=gen)
    canvas = poisoned((5, 12), torch.float32, "cpu")
    out = canvas[:, 4:8]
    fusedenc.linear(x, w, None, "tanh", out=out)
    torch.testing.assert_close(out.double(), linear_formula(x, w, None, "tanh", dtype=torch.float64), rtol=1e-5, atol=1e-5)
    assert torch.isnan(canvas[:, :4]).all() and torch.isnan(canvas[:, 8:]).all()


@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8)])
def test_empty_batch(shape):
    x = torch.empty(shape, dtype=torch.float16)
    w = torch.randn(16, 8).half()
    out = fusedenc.linear(x, w, None, "gelu")
    assert out.shape == shape[:-1] + (16,)


def test_pack_and_fused_qkv(gen):
    bsz, seq, d, heads = 2, 5, 16, 4
    dtype = torch.float32
    x = randn((bsz, seq, d), dtype, gen=gen)
    ws = [randn((d, d), dtype, gen=gen, scale=0.25) for _ in range(3)]
    bs = [randn((d,), dtype, gen=gen) for _ in range(3)]
    w_qkv, b_qkv = fusedenc.pack_qkv(*ws, *bs)
    assert w_qkv.shape == (3 * d, d) and b_qkv.shape == (3 * d,)
    q, k, v = fusedenc.fused_qkv(x, w_qkv, b_qkv, heads)
    for got, w, b, name in zip((q, k, v), ws, bs, "qkv"):
        assert got.shape == (bsz, seq, heads, d // heads), name
        want = linear_formula(x, w, b, dtype=torch.float64).view(bsz, seq, heads, d // heads)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, msg=name)
    # Zero-copy views of one packed buffer, in [q | k | v] order.
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    assert q.stride() == (seq * 3 * d, 3 * d, d // heads, 1)
    assert k.data_ptr() - q.data_ptr() == d * q.element_size()
    assert v.data_ptr() - q.data_ptr() == 2 * d * q.element_size()


def test_pack_qkv_without_bias():
    w = [torch.randn(8, 8) for _ in range(3)]
    w_qkv, b_qkv = fusedenc.pack_qkv(*w)
    assert b_qkv is None
    assert torch.equal(w_qkv, torch.cat(w))


def test_inference_mode_and_compile_free_paths(gen):
    """The reference path works under inference_mode and no_grad alike."""
    x = randn((3, 8), torch.float32, gen=gen)
    w = randn((8, 8), torch.float32, gen=gen)
    with torch.inference_mode():
        a = fusedenc.linear(x, w, None, "swish")
    with torch.no_grad():
        b = fusedenc.linear(x, w, None, "swish")
    assert torch.equal(a, b)
