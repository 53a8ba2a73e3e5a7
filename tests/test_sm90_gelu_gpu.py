"""The Hopper GELU units (the epilogue GEMM with exact GELU or tanh-GELU fixed at compile time)
against the fp32 reference, with the tolerance rule of ``helpers.assert_close_rule`` and
NaN-poisoned outputs; and their switch (``fusedenc.testing.sm90_gelu_epilogue``, on by
default: measured faster than cuBLASLt + the pass).

With the switch on, a folded GEMM (``core.sm90_norm_gemm``) applies either GELU in its
epilogue, and a plain GEMM with exact GELU runs on the kernel (``core.sm90_gemm_applies`` says
so; tanh-GELU keeps cuBLASLt's own GELU epilogue).  Which path ran is observable: the kernel
applies GELU to the fp32 accumulator, while GEMM + pass applies it to the output rounded to
16 bits, so the two differ in some elements.  They run on a compute-capability 9.0 GPU of a
build that holds the units; elsewhere they skip with the reason.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import (
    assert_close_rule,
    assert_within_output_rounding,
    gelu_fp64,
    linear_formula,
    poisoned,
    randn,
    ref_dtype,
    same_dtype_torch,
    whole_range_inputs,
)
from test_sm90_gemm_gpu import DEVICE, HALF, _operands  # the epilogue GEMM's tests: same operands

import fusedenc
import fusedenc.testing
from fusedenc import core
from fusedenc.common import dtypes

pytestmark = pytest.mark.gpu

GELUS = ["gelu", "gelu_tanh"]


def _require_unit(dtype: torch.dtype, act: str) -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 GELU units run on compute capability 9.0 only")
    if (dtypes.name(dtype), act) not in core.sm90_gelu_epilogue_kernels():
        pytest.skip(f"this build has no sm90 GELU unit for {dtypes.name(dtype)} {act} (built without CUTLASS?)")


def _norm_gemm(x, w, b, act, out, rstd=None, shift=None, colsum=None) -> None:
    stream = torch.cuda.current_stream().cuda_stream
    assert core.sm90_norm_gemm(x, w, out, b, act, rstd, shift, colsum, stream, core.workspace(x.device, stream))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("act", GELUS)
@pytest.mark.parametrize(
    "m,k,n",
    [
        (4096, 768, 3072),  # bert-base FFN1, 32 x 128 tokens
        (16384, 384, 1536),  # MiniLM FFN1
        (8192 + 40, 1024, 4096),  # bge-large / e5-large FFN1, M not a multiple of the tile
        (4096 + 8, 264, 1032),  # K, N odd multiples of 8: partial K and N tiles
    ],
)
@pytest.mark.sweep
def test_units_match_the_fp32_reference(dtype, act, m, k, n, gen):
    _require_unit(dtype, act)
    x, w, b = _operands(m, k, n, dtype, gen)
    with fusedenc.testing.sm90_gelu_epilogue():
        out = poisoned((m, n), dtype, DEVICE)
        _norm_gemm(x, w, b, act, out)
        ref = linear_formula(x, w, b, act, dtype=ref_dtype(dtype))
        assert_close_rule(out, ref, same_dtype_torch(x, w, b, act), dtype, what=f"{act} {m}x{k}x{n} seed {gen.seed_value}")
        if act == "gelu":  # the plain GEMM takes the unit too, but at short K and few rows
            plain = poisoned((m, n), dtype, DEVICE)
            applies, why = core.sm90_gemm_applies(x, w, b, plain, act)
            if k < 512 and m < 16384:
                assert (applies, why) == (
                    False, "exact GELU with K < 512 and under 16384 rows: faster as cuBLASLt's GEMM and the pass")
            else:
                assert applies, why
                fusedenc.linear(x, w, b, act, out=plain)
                assert torch.equal(plain, out)  # the same kernel, the same bits


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("act", GELUS)
def test_folded_layer_norm_with_gelu(dtype, act, gen):
    """The LayerNorm-folding form: act(rstd[m] * x W^T + shift[m] * colsum[n] + b[n])."""
    _require_unit(dtype, act)
    m, k, n = 8192, 768, 3072
    x, w, b = _operands(m, k, n, dtype, gen)
    rstd = 0.5 + randn((m,), torch.float32, device=DEVICE, gen=gen).abs()
    shift = randn((m,), torch.float32, device=DEVICE, gen=gen, scale=0.3)
    colsum = randn((n,), torch.float32, device=DEVICE, gen=gen, scale=0.3)
    with fusedenc.testing.sm90_gelu_epilogue():
        out = poisoned((m, n), dtype, DEVICE)
        _norm_gemm(x, w, b, act, out, rstd, shift, colsum)
    pre = rstd[:, None].double() * (x.double() @ w.double().t()) + shift[:, None].double() * colsum.double() + b.double()
    ref = fusedenc.common.activations.apply_activation(pre, act)
    # The same math in the dtype, each step rounded: what an unfused PyTorch user gets.
    same = fusedenc.common.activations.apply_activation(
        (rstd[:, None] * (x @ w.t()).float() + shift[:, None] * colsum + b.float()).to(dtype), act)
    assert_close_rule(out, ref, same, dtype, what=f"folded {act}, seed {gen.seed_value}")


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("act", GELUS)
def test_units_accurate_over_the_whole_range(dtype, act, gen):
    """Every representable input in [-40, 40] through an identity weight (the accumulator is
    exactly the input): each output within half an ulp of the output plus 1e-5 relative of the
    fp64 GELU, and within the smallest subnormal near zero, the negative tail included (erfc
    and the sigmoid form, not torch's 1 + erf / 1 + tanh, which lose the tail in fp64)."""
    _require_unit(dtype, act)
    x, w = whole_range_inputs(dtype, gen, DEVICE)
    out = poisoned((x.shape[0], w.shape[0]), dtype, DEVICE)
    with fusedenc.testing.sm90_gelu_epilogue():
        _norm_gemm(x, w, None, act, out)
    assert_within_output_rounding(out, x, gelu_fp64(x.double(), act), dtype, act)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("act", GELUS)
@pytest.mark.parametrize("m", [1, 7, 130])
def test_units_on_strided_views_and_few_rows(dtype, act, m, gen):
    """Few rows (one partial tile, most threads storing nothing), no bias, and the output a
    view of a wider buffer (the row stride is not the row): nothing outside the view is
    written, every element inside is."""
    _require_unit(dtype, act)
    k, n = 384, 1536
    x, w, _ = _operands(m, k, n, dtype, gen)
    big_out = poisoned((m, n + 136), dtype, DEVICE)
    out = big_out[:, 72 : 72 + n]
    with fusedenc.testing.sm90_gelu_epilogue():
        _norm_gemm(x, w, None, act, out)
    ref = linear_formula(x, w, None, act, dtype=ref_dtype(dtype))
    same = same_dtype_torch(x, w, None, act)
    assert_close_rule(out, ref, same, dtype, what=f"{act} m {m}, strided, seed {gen.seed_value}")
    assert torch.isnan(big_out[:, :72]).all() and torch.isnan(big_out[:, 72 + n :]).all()


@pytest.mark.parametrize("act", GELUS)
def test_extreme_inputs_and_nan(act, gen):
    _require_unit(torch.float16, act)
    m, k, n = 8192, 256, 1024
    x, w, b = _operands(m, k, n, torch.float16, gen, scale=30.0)  # pre-activations of +-30 and beyond
    x[7, 3] = float("nan")
    out = poisoned((m, n), torch.float16, DEVICE)
    with fusedenc.testing.sm90_gelu_epilogue():
        _norm_gemm(x, w, b, act, out)
    assert torch.isnan(out[7]).all()
    keep = torch.ones(m, dtype=torch.bool, device=DEVICE)
    keep[7] = False
    ref = linear_formula(x[keep], w, b, act, dtype=torch.float32)
    assert_close_rule(out[keep], ref, same_dtype_torch(x[keep], w, b, act), torch.float16, what=f"extreme {act}")


def test_the_switch_chooses_the_path(gen):
    """Off: the plain path refuses exact GELU with the pass's reason and a folded GEMM runs
    kernel + pass; on (the default, unless FUSEDENC_SM90_GELU=0): the unit.  Both within tolerance, different in some bits
    (the pass reads the rounded GEMM output, the unit the fp32 accumulator); leaving the switch
    restores what was."""
    _require_unit(torch.float16, "gelu")
    m, k, n = 8192, 768, 3072
    x, w, b = _operands(m, k, n, torch.float16, gen)
    was = core.sm90_gelu_epilogue_on()
    assert was == (os.environ.get("FUSEDENC_SM90_GELU") not in ("0", "off")), "on by default"
    probe = poisoned((m, n), torch.float16, DEVICE)
    with fusedenc.testing.sm90_gelu_epilogue(False):
        assert core.sm90_gemm_applies(x, w, b, probe, "gelu") == (
            False, "this activation is faster as cuBLASLt's GEMM and a separate pass")
        off = poisoned((m, n), torch.float16, DEVICE)
        _norm_gemm(x, w, b, "gelu", off)
    with fusedenc.testing.sm90_gelu_epilogue():
        assert core.sm90_gelu_epilogue_on()
        assert core.sm90_gemm_applies(x, w, b, probe, "gelu") == (True, "")
        assert core.sm90_gemm_applies(x, w, b, probe, "gelu_tanh") == (False, "cuBLASLt fuses this activation itself")
        on = poisoned((m, n), torch.float16, DEVICE)
        _norm_gemm(x, w, b, "gelu", on)
    assert core.sm90_gelu_epilogue_on() == was
    ref = linear_formula(x, w, b, "gelu", dtype=torch.float32)
    same = same_dtype_torch(x, w, b, "gelu")
    for got, what in ((off, "kernel + pass"), (on, "unit")):
        assert_close_rule(got, ref, same, torch.float16, what=what)
    assert not torch.equal(on, off), "the switch changed nothing: one path ran both times"
    assert ("float16", "gelu") not in core.sm90_gemm_kernels()  # the FP8 fold's list stays without GELU
    caps = fusedenc.capabilities()["sm90_gelu_epilogue"]
    assert set(caps["kernels"]) == {f"{d}:{a}" for d, a in core.sm90_gelu_epilogue_kernels()}
