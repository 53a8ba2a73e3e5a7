"""The Hopper epilogue GEMM (CUTLASS sm90 kernels applying bias + activation in the
epilogue) against the fp32 reference, with the tolerance rule of
``helpers.assert_close_rule`` and NaN-poisoned outputs.

Each numeric test first asserts that the call really takes the kernel
(``core.sm90_gemm_applies``), so a dispatch change cannot turn these into tests of
cuBLASLt.  They run on a compute-capability 9.0 GPU of a build that holds the
kernels; elsewhere they skip with the reason (the other GEMM tests cover those paths).
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    assert_close_rule,
    assert_within_output_rounding,
    linear_formula,
    poisoned,
    randn,
    ref_dtype,
    same_dtype_torch,
    whole_range_inputs,
)

import fusedenc
import fusedenc.testing
from fusedenc import core

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
HALF = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]
ACTS = ["swish", "mish", "relu2", "sigmoid"]  # what the epilogue applies (sm90_gemm.cpp: in_epilogue)


def _require_kernels(dtype: torch.dtype, act: str) -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 epilogue GEMM runs on compute capability 9.0 only")
    name = {torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    if (name, act) not in core.sm90_gemm_kernels():
        pytest.skip(f"this build has no sm90 epilogue GEMM for {name} {act} (built without CUTLASS?)")


def _operands(m, k, n, dtype, gen, bias=True, scale=1.0):
    x = randn((m, k), dtype, device=DEVICE, gen=gen, scale=scale)
    w = randn((n, k), dtype, device=DEVICE, gen=gen, scale=k**-0.5)
    b = randn((n,), dtype, device=DEVICE, gen=gen) if bias else None
    return x, w, b


def _check(out, x, w, b, act, what):
    ref = linear_formula(x, w, b, act, dtype=ref_dtype(x.dtype))
    same = same_dtype_torch(x, w, b, act)
    assert_close_rule(out, ref, same, x.dtype, what=what)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize(
    "m,k,n",
    [
        (16384, 768, 2304),  # t82 FFN1 at 256 positions
        (4096 + 40, 1024, 1536),  # bt4 FFN1 shape, M not a multiple of the tile
        (8192 + 8, 768, 1032),  # N not a multiple of 256 (partial N tile)
        (12288, 264, 776),  # K and N odd multiples of 8: partial K tile too
    ],
)
@pytest.mark.sweep
def test_matches_the_fp32_reference(dtype, act, m, k, n, gen):
    _require_kernels(dtype, act)
    x, w, b = _operands(m, k, n, dtype, gen)
    out = poisoned((m, n), dtype, DEVICE)
    applies, why = core.sm90_gemm_applies(x, w, b, out, act)
    assert applies, why
    fusedenc.linear(x, w, b, act, out=out)
    _check(out, x, w, b, act, what=f"sm90 {act} {m}x{k}x{n} seed {gen.seed_value}")


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("act", ACTS)
def test_activation_accurate_over_the_whole_range(dtype, act, gen):
    """The epilogue's fast formulas (hardware exp and reciprocal, branch-free mish) at every
    representable input in [-40, 40] (tests/test_sm90_gelu_gpu.py does the GELUs): through an
    identity weight the accumulator is exactly the input, so each output may differ from
    the fp64 activation of that input by the output's own rounding (half an ulp) plus
    1e-5 relative, and by no more than the smallest subnormal near zero.  The tails
    (mish above 20, swish and sigmoid of large negatives) are where a cheap
    approximation goes wrong."""
    _require_kernels(dtype, act)
    x, w = whole_range_inputs(dtype, gen, DEVICE)
    out = poisoned((x.shape[0], w.shape[0]), dtype, DEVICE)
    assert core.sm90_gemm_applies(x, w, None, out, act)[0]
    fusedenc.linear(x, w, None, act, out=out)
    ref = fusedenc.common.activations.apply_activation(x.double(), act)  # the formula in fp64
    assert_within_output_rounding(out, x, ref, dtype, act)


@pytest.mark.parametrize("act", ["gelu", "tanh", "selu"])
def test_long_chain_activations_stay_a_pass(act, gen):
    """Exact GELU, tanh and selu cost more in the epilogue than cuBLASLt's GEMM plus the
    pass (measured, sm90_gemm.cpp): the plain path refuses them with that reason, and a
    folded GEMM with one still computes it (the kernel, then the pass)."""
    _require_kernels(torch.float16, "none")
    assert ("float16", act) not in core.sm90_gemm_kernels()
    m, k, n = 16384, 768, 2304
    x, w, b = _operands(m, k, n, torch.float16, gen)
    out = poisoned((m, n), torch.float16, DEVICE)
    with fusedenc.testing.sm90_gelu_epilogue(False):  # without GELU's units (on by default)
        assert core.sm90_gemm_applies(x, w, b, out, act) == (
            False, "this activation is faster as cuBLASLt's GEMM and a separate pass"
        )
        stream = torch.cuda.current_stream().cuda_stream
        assert core.sm90_norm_gemm(x, w, out, b, act, None, None, None, stream, core.workspace(x.device, stream))
    _check(out, x, w, b, act, what=f"norm kernel + pass, {act}, seed {gen.seed_value}")


@pytest.mark.parametrize("dtype", HALF)
def test_without_bias_and_with_alpha(dtype, gen):
    _require_kernels(dtype, "mish")
    m, k, n = 8192, 512, 2048
    x, w, _ = _operands(m, k, n, dtype, gen, bias=False)
    out = poisoned((m, n), dtype, DEVICE)
    assert core.sm90_gemm_applies(x, w, None, out, "mish")[0]
    fusedenc.linear(x, w, None, "mish", alpha=0.5, out=out)
    ref = linear_formula(x, w, None, "mish", alpha=0.5, dtype=ref_dtype(dtype))
    same = same_dtype_torch(x, w, None, "mish", alpha=0.5)
    assert_close_rule(out, ref, same, dtype, what=f"no bias, alpha 0.5, seed {gen.seed_value}")


@pytest.mark.parametrize("dtype", HALF)
def test_strided_rows_in_and_out(dtype, gen):
    """Row strides wider than the rows (views of bigger buffers), as attention's fused QKV makes."""
    _require_kernels(dtype, "swish")
    m, k, n = 8192, 768, 1024
    big_x = randn((m, k + 64), dtype, device=DEVICE, gen=gen)
    x = big_x[:, 32 : 32 + k]
    w = randn((n, k), dtype, device=DEVICE, gen=gen, scale=k**-0.5)
    b = randn((n,), dtype, device=DEVICE, gen=gen)
    big_out = poisoned((m, n + 128), dtype, DEVICE)
    out = big_out[:, 64 : 64 + n]
    assert core.sm90_gemm_applies(x, w, b, out, "swish")[0]
    fusedenc.linear(x, w, b, "swish", out=out)
    _check(out, x.contiguous(), w, b, "swish", what=f"strided, seed {gen.seed_value}")
    # Nothing outside the view was written.
    assert torch.isnan(big_out[:, :64]).all() and torch.isnan(big_out[:, 64 + n :]).all()


@pytest.mark.parametrize("act", ACTS)
def test_extreme_inputs_follow_torch(act, gen):
    """Large pre-activations (mish's softplus threshold of 20, swish's exp overflow) and NaN."""
    _require_kernels(torch.float16, act)
    m, k, n = 8192, 256, 1024
    x, w, b = _operands(m, k, n, torch.float16, gen, scale=30.0)  # outputs of +-30 and beyond
    x[7, 3] = float("nan")  # row 7 of the output is NaN for every activation
    out = poisoned((m, n), torch.float16, DEVICE)
    fusedenc.linear(x, w, b, act, out=out)
    assert torch.isnan(out[7]).all()
    keep = torch.ones(m, dtype=torch.bool, device=DEVICE)
    keep[7] = False
    _check(out[keep], x[keep], w, b, act, what=f"extreme {act}, seed {gen.seed_value}")


def test_switch_off_gives_the_cublaslt_path_and_the_same_result(gen):
    _require_kernels(torch.float16, "swish")
    m, k, n = 16384, 768, 2304
    x, w, b = _operands(m, k, n, torch.float16, gen)
    fused = fusedenc.linear(x, w, b, "swish")
    with fusedenc.testing.sm90_gemm_disabled():
        out = torch.empty_like(fused)
        assert core.sm90_gemm_applies(x, w, b, out, "swish") == (False, "switched off")
        unfused = fusedenc.linear(x, w, b, "swish")
    assert core.sm90_gemm_applies(x, w, b, out, "swish")[0]
    # Two fp32-accumulating GEMMs with different K orders: equal to fp16 rounding.
    ref = linear_formula(x, w, b, "swish", dtype=torch.float32)
    same = same_dtype_torch(x, w, b, "swish")
    assert_close_rule(fused, ref, same, torch.float16, what="sm90")
    assert_close_rule(unfused, ref, same, torch.float16, what="cuBLASLt + pass")


def test_an_sm_limit_sends_small_problems_to_the_hopper_kernel(gen):
    """``core.set_sm90_sm_limit(n)``: the occupancy rule counts n SMs, so a GEMM too small
    for the whole chip (smolgen's dense1 at 256 positions) runs on the Hopper kernel with
    a grid of at most n CTAs; the limit is per thread and restored."""
    _require_kernels(torch.float16, "swish")
    x, w, b = _operands(256, 2048, 256, torch.float16, gen)
    out = poisoned((256, 256), torch.float16, DEVICE)
    assert not core.sm90_gemm_applies(x, w, b, out, "swish")[0]
    previous = core.set_sm90_sm_limit(8)
    try:
        assert core.sm90_gemm_applies(x, w, b, out, "swish")[0]
        fusedenc.linear(x, w, b, "swish", out=out)
    finally:
        assert core.set_sm90_sm_limit(previous) == 8
    assert previous == 0 and not core.sm90_gemm_applies(x, w, b, out, "swish")[0]
    _check(out, x, w, b, "swish", what=f"sm90 on 8 SMs, seed {gen.seed_value}")
    with pytest.raises(ValueError, match="SM limit must be >= 0"):
        core.set_sm90_sm_limit(-1)


def test_small_and_unaligned_problems_stay_on_cublaslt(gen):
    _require_kernels(torch.float16, "swish")
    x, w, b = _operands(256, 768, 256, torch.float16, gen)  # 2 output tiles: too few
    out = torch.empty((256, 256), dtype=torch.float16, device=DEVICE)
    assert core.sm90_gemm_applies(x, w, b, out, "swish") == (False, "too few output tiles to fill the GPU")
    x, w, b = _operands(16384, 768, 32, torch.float16, gen)  # the Lc0 value head's embedding
    out = torch.empty((16384, 32), dtype=torch.float16, device=DEVICE)
    assert core.sm90_gemm_applies(x, w, b, out, "mish") == (False, "fewer than 64 output columns")
    x, w, b = _operands(16384, 768, 2304, torch.float16, gen)
    out = torch.empty((16384, 2304), dtype=torch.float16, device=DEVICE)
    assert core.sm90_gemm_applies(x, w, b, out, "gelu_tanh") == (False, "cuBLASLt fuses this activation itself")
    assert core.sm90_gemm_applies(x, w, b, out, "none") == (False, "cuBLASLt fuses this activation itself")
    odd = torch.empty(16384 * 2304 + 8, dtype=torch.float16, device=DEVICE)[1 : 1 + 16384 * 2304].view(16384, 2304)
    assert core.sm90_gemm_applies(x, w, b, odd, "swish") == (False, "an operand not 16-byte aligned")
