"""Bad input never reaches a kernel: one table of bad calls across the public API.

Each row is (name, make, exception type, regex, family): ``make(dev)`` builds
the operands on ``dev`` and returns a zero-argument callable that makes the bad
call; the call must raise the given type with a message matching the regex,
which names the offending argument.  After each bad call a valid call of the
same family (linear, layer_norm, attention, the block) on the same device and
stream gives the right answer (``helpers.assert_close_rule`` against the
written-out formula).  On the GPU the bad call must not have reached the GEMM
library either (the plan cache saw no call).

Rows run on "cpu" always and on "cuda" under the ``gpu`` marker.  "Another
device" is ``meta`` next to CPU tensors and the CPU next to CUDA tensors.
Rows marked cuda-only need a GPU object (the CUDA-graph runner).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from encoder_helpers import block_config, block_formula, block_params, randomize
from helpers import assert_close_rule, attention_formula, linear_formula, poisoned, randn, ref_dtype, same_dtype_torch
from layer_norm_helpers import ln_formula, ln_same_dtype

import fusedenc
from fusedenc import EncoderBlock, EncoderStack
from fusedenc.attention import attention

H = torch.float16
NAN, INF = float("nan"), float("inf")


def _other(dev: str) -> str:
    """A device other than ``dev`` that tensors can live on without a second GPU."""
    return "meta" if dev == "cpu" else "cpu"


def _r(shape, dev, dtype=H, scale=1.0):
    return randn(shape, dtype, device=dev, scale=scale)


def _misaligned(shape, dev, dtype=H):
    """A tensor whose data pointer is one element (2 bytes for fp16) past a 16-byte boundary."""
    n = math.prod(shape)
    return _r((n + 8,), dev, dtype)[1 : 1 + n].view(shape)


def _lin(dev, m=4, k=16, n=24):
    return dict(x=_r((m, k), dev), weight=_r((n, k), dev, scale=k**-0.5), bias=_r((n,), dev))


def _linear(x, weight, bias=None, activation="none", residual=None, beta=1.0, alpha=1.0, out=None):
    return lambda: fusedenc.linear(x, weight, bias, activation, residual, beta, alpha=alpha, out=out)


def _L(dev, **over):
    a = _lin(dev)
    a.update(over)
    return _linear(**a)


def _ln_args(dev, t=4, d=16):
    return dict(x=_r((t, d), dev), weight=1 + _r((d,), dev, scale=0.2), bias=_r((d,), dev, scale=0.2))


def _LN(dev, **over):
    a = _ln_args(dev)
    a.update(over)
    x, w, b = a.pop("x"), a.pop("weight"), a.pop("bias")
    eps = a.pop("eps", 1e-5)
    return lambda: fusedenc.layer_norm(x, w, b, eps, **a)


def _qkv(dev, b=2, s=5, h=2, dh=8, dtype=H):
    return fusedenc.ops.gemm.split_qkv(_r((b, s, 3 * h * dh), dev, dtype), h)


def _A(dev, **over):
    q, k, v = _qkv(dev)
    a = dict(q=q, k=k, v=v, attn_bias=None, key_padding_mask=None)
    a.update(over)
    kw = {key: a.pop(key) for key in ("scale", "backend") if key in a}
    return lambda: attention(a["q"], a["k"], a["v"], a["attn_bias"], a["key_padding_mask"], **kw)


def _block(dev, **kw):
    return randomize(EncoderBlock(16, 2, 32, "relu", dtype=H, device=dev, **kw), torch.Generator().manual_seed(1))


def _B(dev, x=None, attn_bias=None, key_padding_mask=None, seq_len=None, block=None):
    block = block or _block(dev)
    x = _r((2, 4, 16), dev) if x is None else x
    return lambda: block(x, attn_bias, key_padding_mask, seq_len=seq_len)


def _noncontig_param_block(dev):
    block = _block(dev)
    w = block.ffn1_weight
    block.ffn1_weight = nn.Parameter(w.detach().t().contiguous().t(), requires_grad=False)  # same values, [F, D] strides (1, F)
    return _B(dev, block=block)


def _stack_runner(dev, **kw):
    stack = EncoderStack([_block(dev)])
    return stack.graph_runner(**kw)


def _graph_runner_x(dev):
    runner = _stack_runner(dev, seq_len=4, batch_sizes=(2,))
    return lambda: runner(_r((2, 5, 16), dev))


def _graph_runner_bias(dev):
    runner = _stack_runner(dev, seq_len=4, batch_sizes=(2,), attn_bias=True)
    return lambda: runner(_r((2, 4, 16), dev))


def _overlapping_out(dev):
    buf = _r((4, 24), dev)
    return _linear(buf[:, :16], _r((24, 16), dev), out=buf)


def _partial_residual(dev):
    r = _r((5, 24), dev)
    return _linear(_r((4, 16), dev), _r((24, 16), dev), residual=r[:4], out=r[1:])


def _ln_sum_out_partial(dev):
    r = _r((5, 16), dev)
    x = _r((4, 16), dev)
    return lambda: fusedenc.layer_norm(x, None, None, residual=r[:4], sum_out=r[1:])


def _ln_sum_out_over_out(dev):
    buf = _r((4, 16), dev)
    x = _r((4, 16), dev)
    return lambda: fusedenc.layer_norm(x, None, None, out=buf, sum_out=buf)


def _ln_out_over_x(dev):
    x = _r((4, 16), dev)
    return lambda: fusedenc.layer_norm(x, None, None, out=x)


def _pack(dev, **over):
    d = 8
    a = dict(q_weight=_r((d, d), dev), k_weight=_r((d, d), dev), v_weight=_r((d, d), dev))
    a.update(over)
    return lambda: fusedenc.pack_qkv(**a)


def _fq(dev, x=None, w=None, b=None, heads=2):
    x = _r((2, 3, 16), dev) if x is None else x
    w = _r((48, 16), dev) if w is None else w
    return lambda: fusedenc.fused_qkv(x, w, b, heads)


LIN, LN, ATT, BLK = "linear", "layer_norm", "attention", "block"

# (name, make(dev) -> bad call, exception, regex naming the argument, family[, "cuda"/"cpu" only])
ROWS = [
    # ---- linear
    ("linear-x-not-a-tensor", lambda d: _L(d, x=[[1.0] * 16]), TypeError, r"^x must be a torch\.Tensor", LIN),
    ("linear-x-int-dtype", lambda d: _L(d, x=torch.ones(4, 16, dtype=torch.int32, device=d)), TypeError, r"^x\.dtype=torch\.int32", LIN),
    ("linear-x-float64", lambda d: _L(d, x=torch.ones(4, 16, dtype=torch.float64, device=d)), TypeError, r"^x\.dtype=torch\.float64", LIN),
    ("linear-weight-dtype", lambda d: _L(d, weight=_r((24, 16), d, torch.float32)), TypeError, r"^weight\.dtype", LIN),
    ("linear-bias-dtype", lambda d: _L(d, bias=_r((24,), d, torch.bfloat16)), TypeError, r"^bias\.dtype", LIN),
    ("linear-x-scalar", lambda d: _L(d, x=_r((), d)), ValueError, r"^x must have at least one dimension", LIN),
    ("linear-weight-rank-3", lambda d: _L(d, weight=_r((1, 24, 16), d)), ValueError, r"^weight must be 2-D", LIN),
    ("linear-K-mismatch", lambda d: _L(d, x=_r((4, 24), d)), ValueError, r"x\.shape\[-1\]=24 does not match weight", LIN),
    ("linear-K-not-16-bytes", lambda d: _L(d, x=_r((4, 12), d), weight=_r((24, 12), d)), ValueError, r"K=x\.shape\[-1\]=12", LIN),
    ("linear-N-not-16-bytes", lambda d: _L(d, weight=_r((20, 16), d), bias=_r((20,), d)), ValueError, r"N=weight\.shape\[0\]=20", LIN),
    ("linear-bias-shape", lambda d: _L(d, bias=_r((16,), d)), ValueError, r"^bias must have shape \(24,\)", LIN),
    ("linear-bias-not-contiguous", lambda d: _L(d, bias=_r((48,), d)[::2]), ValueError, r"^bias must be contiguous", LIN),
    ("linear-weight-transposed", lambda d: _L(d, weight=_r((16, 24), d).t()), ValueError, r"^weight must be row-major", LIN),
    ("linear-x-column-strided", lambda d: _L(d, x=_r((4, 32), d)[:, ::2]), ValueError, r"^x must have unit stride", LIN),
    ("linear-x-rows-overlap", lambda d: _L(d, x=_r((16,), d).expand(4, 16)), ValueError, r"^x has overlapping rows", LIN),
    ("linear-x-not-viewable", lambda d: _L(d, x=_r((2, 3, 16), d).transpose(0, 1)), ValueError, r"^x with shape .* cannot be viewed", LIN),
    ("linear-x-misaligned", lambda d: _L(d, x=_misaligned((4, 16), d)), ValueError, r"^x data pointer is not 16-byte aligned", LIN),
    ("linear-weight-misaligned", lambda d: _L(d, weight=_misaligned((24, 16), d)), ValueError, r"^weight data pointer", LIN),
    ("linear-x-row-stride", lambda d: _L(d, x=_r((4, 20), d)[:, :16]), ValueError, r"^x row stride 20", LIN),
    ("linear-alpha-nan", lambda d: _L(d, alpha=NAN), ValueError, r"^alpha=nan is not finite", LIN),
    ("linear-alpha-inf", lambda d: _L(d, alpha=INF), ValueError, r"^alpha=inf is not finite", LIN),
    ("linear-alpha-tensor", lambda d: _L(d, alpha=torch.tensor(1.0)), TypeError, r"^alpha must be a real number", LIN),
    ("linear-beta-inf", lambda d: _L(d, beta=-INF, residual=_r((4, 24), d)), ValueError, r"^beta=-inf is not finite", LIN),
    ("linear-beta-without-residual", lambda d: _L(d, beta=0.5), ValueError, r"^beta=0\.5 has no effect without a residual", LIN),
    ("linear-activation-unknown", lambda d: _L(d, activation="swiglu"), ValueError, r"^activation='swiglu'", LIN),
    ("linear-activation-not-str", lambda d: _L(d, activation=None), TypeError, r"^activation must be a str", LIN),
    ("linear-residual-with-activation", lambda d: _L(d, activation="relu", residual=_r((4, 24), d)), ValueError, r"cannot be combined with residual", LIN),
    ("linear-residual-shape", lambda d: _L(d, residual=_r((4, 16), d)), ValueError, r"^residual must have shape \(4, 24\)", LIN),
    ("linear-residual-misaligned", lambda d: _L(d, residual=_misaligned((4, 24), d)), ValueError, r"^residual data pointer", LIN),
    ("linear-out-shape", lambda d: _L(d, out=torch.empty(4, 16, dtype=H, device=d)), ValueError, r"^out must have shape \(4, 24\)", LIN),
    ("linear-out-dtype", lambda d: _L(d, out=torch.empty(4, 24, device=d)), TypeError, r"^out\.dtype", LIN),
    ("linear-out-overlaps-x", _overlapping_out, ValueError, r"^out overlaps x", LIN),
    ("linear-out-partially-overlaps-residual", _partial_residual, ValueError, r"^out partially overlaps residual", LIN),
    ("linear-weight-other-device", lambda d: _L(d, weight=_r((24, 16), _other(d))), ValueError, r"^weight is on", LIN),
    ("linear-bias-other-device", lambda d: _L(d, bias=_r((24,), _other(d))), ValueError, r"^bias is on", LIN),
    ("linear-out-other-device", lambda d: _L(d, out=torch.empty(4, 24, dtype=H, device=_other(d))), ValueError, r"^out is on", LIN),
    # ---- fused_qkv / pack_qkv
    ("fused_qkv-heads-not-dividing-D", lambda d: _fq(d, heads=3), ValueError, r"^num_heads=3 does not divide D=16", LIN),
    ("fused_qkv-heads-zero", lambda d: _fq(d, heads=0), ValueError, r"^num_heads must be a positive int", LIN),
    ("fused_qkv-heads-float", lambda d: _fq(d, heads=2.0), ValueError, r"^num_heads must be a positive int", LIN),
    ("fused_qkv-x-rank-2", lambda d: _fq(d, x=_r((3, 16), d)), ValueError, r"^x must be \[B, S, D\]", LIN),
    ("fused_qkv-w-shape", lambda d: _fq(d, w=_r((16, 16), d)), ValueError, r"^w_qkv must have shape \(48, 16\)", LIN),
    ("fused_qkv-w-dtype", lambda d: _fq(d, w=_r((48, 16), d, torch.float32)), TypeError, r"^w_qkv\.dtype", LIN),
    ("fused_qkv-b-shape", lambda d: _fq(d, b=_r((16,), d)), ValueError, r"^b_qkv must have shape \(48,\)", LIN),
    ("fused_qkv-b-other-device", lambda d: _fq(d, b=_r((48,), _other(d))), ValueError, r"^b_qkv is on", LIN),
    ("pack_qkv-not-square", lambda d: _pack(d, k_weight=_r((8, 4), d)), ValueError, r"^k_weight must be square", LIN),
    ("pack_qkv-missing-biases", lambda d: _pack(d, q_bias=_r((8,), d)), ValueError, r"missing k_bias, v_bias", LIN),
    ("pack_qkv-dtype", lambda d: _pack(d, v_weight=_r((8, 8), d, torch.float32)), TypeError, r"^v_weight is torch\.float32", LIN),
    ("pack_qkv-bias-shape", lambda d: _pack(d, q_bias=_r((4,), d), k_bias=_r((8,), d), v_bias=_r((8,), d)), ValueError, r"^q_bias must have shape \(8,\)", LIN),
    ("pack_qkv-weight-other-device", lambda d: _pack(d, k_weight=_r((8, 8), _other(d))), ValueError, r"^k_weight is on", LIN),
    # ---- layer_norm
    ("layer_norm-x-float64", lambda d: _LN(d, x=torch.ones(4, 16, dtype=torch.float64, device=d)), TypeError, r"^x\.dtype=torch\.float64", LN),
    ("layer_norm-x-scalar", lambda d: _LN(d, x=_r((), d)), ValueError, r"^x must have at least one dimension", LN),
    ("layer_norm-D-not-16-bytes", lambda d: _LN(d, x=_r((4, 12), d)), ValueError, r"^D=x\.shape\[-1\]=12", LN),
    ("layer_norm-D-too-large", lambda d: _LN(d, x=_r((1, 16392), d)), ValueError, r"^D=x\.shape\[-1\]=16392 .* at most 16384", LN),
    ("layer_norm-eps-nan", lambda d: _LN(d, eps=NAN), ValueError, r"^eps=nan is not finite", LN),
    ("layer_norm-eps-inf", lambda d: _LN(d, eps=INF), ValueError, r"^eps=inf is not finite", LN),
    ("layer_norm-eps-negative", lambda d: _LN(d, eps=-1e-5), ValueError, r"^eps=-1e-05 must be >= 0", LN),
    ("layer_norm-alpha-nan", lambda d: _LN(d, alpha=NAN), ValueError, r"^alpha=nan is not finite", LN),
    ("layer_norm-weight-shape", lambda d: _LN(d, weight=_r((8,), d)), ValueError, r"^weight must have shape \(16,\)", LN),
    ("layer_norm-bias-dtype", lambda d: _LN(d, bias=_r((16,), d, torch.float32)), TypeError, r"^bias\.dtype", LN),
    ("layer_norm-x_bias-not-contiguous", lambda d: _LN(d, x_bias=_r((32,), d)[::2]), ValueError, r"^x_bias must be contiguous", LN),
    ("layer_norm-weight-misaligned", lambda d: _LN(d, weight=_misaligned((16,), d)), ValueError, r"^weight data pointer", LN),
    ("layer_norm-residual-shape", lambda d: _LN(d, residual=_r((4, 8), d)), ValueError, r"^residual must have shape \(4, 16\)", LN),
    ("layer_norm-residual-misaligned", lambda d: _LN(d, residual=_misaligned((4, 16), d)), ValueError, r"^residual data pointer", LN),
    ("layer_norm-residual-column-strided", lambda d: _LN(d, residual=_r((4, 32), d)[:, ::2]), ValueError, r"^residual must have unit stride", LN),
    ("layer_norm-out-overlaps-x", _ln_out_over_x, ValueError, r"^out overlaps x", LN),
    ("layer_norm-sum_out-overlaps-out", _ln_sum_out_over_out, ValueError, r"^sum_out overlaps out", LN),
    ("layer_norm-sum_out-partially-overlaps-residual", _ln_sum_out_partial, ValueError, r"^sum_out partially overlaps residual", LN),
    ("layer_norm-weight-other-device", lambda d: _LN(d, weight=_r((16,), _other(d))), ValueError, r"^weight is on", LN),
    ("layer_norm-residual-other-device", lambda d: _LN(d, residual=_r((4, 16), _other(d))), ValueError, r"^residual is on", LN),
    # ---- attention
    ("attention-q-not-a-tensor", lambda d: _A(d, q=None), TypeError, r"^q must be a torch\.Tensor", ATT),
    ("attention-q-int", lambda d: _A(d, q=torch.ones(2, 5, 2, 8, dtype=torch.int64, device=d)), TypeError, r"^q\.dtype=torch\.int64", ATT),
    ("attention-k-dtype", lambda d: _A(d, k=_r((2, 5, 2, 8), d, torch.float32)), TypeError, r"^k\.dtype", ATT),
    ("attention-v-rank", lambda d: _A(d, v=_r((2, 5, 16), d)), ValueError, r"^v must be 4-D", ATT),
    ("attention-k-shape", lambda d: _A(d, k=_r((2, 6, 2, 8), d)), ValueError, r"^k has shape", ATT),
    ("attention-zero-heads", lambda d: _A(d, q=_r((2, 5, 0, 8), d), k=_r((2, 5, 0, 8), d), v=_r((2, 5, 0, 8), d)), ValueError, r"^q must have at least one head", ATT),
    ("attention-q-last-stride", lambda d: _A(d, q=_r((2, 5, 2, 16), d)[..., ::2]), ValueError, r"^q must have unit stride", ATT),
    ("attention-bias-shape", lambda d: _A(d, attn_bias=_r((2, 2, 5, 4), d)), ValueError, r"^attn_bias must have shape", ATT),
    ("attention-bias-batch", lambda d: _A(d, attn_bias=_r((3, 2, 5, 5), d)), ValueError, r"^attn_bias must have shape \(2 or 1", ATT),
    ("attention-bias-int", lambda d: _A(d, attn_bias=torch.zeros(2, 2, 5, 5, dtype=torch.int32, device=d)), TypeError, r"^attn_bias\.dtype", ATT),
    ("attention-mask-not-bool", lambda d: _A(d, key_padding_mask=torch.zeros(2, 5, device=d)), TypeError, r"^key_padding_mask must be a bool", ATT),
    ("attention-mask-shape", lambda d: _A(d, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool, device=d)), ValueError, r"^key_padding_mask must have shape \(2, 5\)", ATT),
    ("attention-scale-nan", lambda d: _A(d, scale=NAN), ValueError, r"^scale=nan is not finite", ATT),
    ("attention-scale-str", lambda d: _A(d, scale="0.1"), TypeError, r"^scale must be a real number", ATT),
    ("attention-backend-unknown", lambda d: _A(d, backend="xformers"), ValueError, r"^backend='xformers'", ATT),
    ("attention-v-other-device", lambda d: _A(d, v=_r((2, 5, 2, 8), _other(d))), ValueError, r"^v is on", ATT),
    ("attention-bias-other-device", lambda d: _A(d, attn_bias=_r((1, 2, 5, 5), _other(d))), ValueError, r"^attn_bias is on", ATT),
    ("attention-mask-other-device", lambda d: _A(d, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool, device=_other(d))), ValueError, r"^key_padding_mask is on", ATT),
    # ---- EncoderBlock / EncoderStack / GraphRunner / plan cache
    ("block-heads-not-dividing-D", lambda d: (lambda: EncoderBlock(16, 3, 32, device=d)), ValueError, r"^n_heads=3 does not divide d_model=16", BLK),
    ("block-d_model-not-16-bytes", lambda d: (lambda: EncoderBlock(12, 2, 32, device=d)), ValueError, r"^d_model=12 must be a multiple of 8", BLK),
    ("block-d_ff-zero", lambda d: (lambda: EncoderBlock(16, 2, 0, device=d)), ValueError, r"^d_ff must be a positive int", BLK),
    ("block-alpha-nan", lambda d: (lambda: EncoderBlock(16, 2, 32, residual_alpha=NAN, device=d)), ValueError, r"^residual_alpha must be a finite number", BLK),
    ("block-eps-negative", lambda d: (lambda: EncoderBlock(16, 2, 32, layer_norm_eps=-1.0, device=d)), ValueError, r"^layer_norm_eps=-1\.0 must be >= 0", BLK),
    ("block-activation-unknown", lambda d: (lambda: EncoderBlock(16, 2, 32, "swiglu", device=d)), ValueError, r"^activation='swiglu'", BLK),
    ("block-x-not-a-tensor", lambda d: _B(d, x=[[0.0] * 16]), TypeError, r"^x must be a torch\.Tensor", BLK),
    ("block-x-dtype", lambda d: _B(d, x=_r((2, 4, 16), d, torch.float32)), TypeError, r"^x\.dtype=torch\.float32 does not match", BLK),
    ("block-x-width", lambda d: _B(d, x=_r((2, 4, 24), d)), ValueError, r"^x\.shape\[-1\]=24 does not match d_model=16", BLK),
    ("block-x-rank", lambda d: _B(d, x=_r((2, 2, 4, 16), d)), ValueError, r"^x must be \[B, S, D\]", BLK),
    ("block-seq_len-mismatch", lambda d: _B(d, seq_len=3), ValueError, r"^seq_len=3 does not match x", BLK),
    ("block-rows-without-seq_len", lambda d: _B(d, x=_r((8, 16), d)), ValueError, r"needs seq_len", BLK),
    ("block-rows-not-multiple-of-seq_len", lambda d: _B(d, x=_r((9, 16), d), seq_len=4), ValueError, r"^T=x\.shape\[0\]=9 is not a multiple of seq_len=4", BLK),
    ("block-x-misaligned", lambda d: _B(d, x=_misaligned((2, 4, 16), d)), ValueError, r"^x data pointer is not 16-byte aligned", BLK),
    ("block-attn_bias-shape", lambda d: _B(d, attn_bias=_r((2, 2, 4, 5), d)), ValueError, r"^attn_bias must have shape", BLK),
    ("block-attn_bias-int", lambda d: _B(d, attn_bias=torch.zeros(2, 2, 4, 4, dtype=torch.int32, device=d)), TypeError, r"^attn_bias\.dtype", BLK),
    ("block-mask-not-bool", lambda d: _B(d, key_padding_mask=torch.zeros(2, 4, device=d)), TypeError, r"^key_padding_mask must be bool", BLK),
    ("block-mask-shape", lambda d: _B(d, key_padding_mask=torch.zeros(4, 2, dtype=torch.bool, device=d)), ValueError, r"^key_padding_mask must have shape \(2, 4\)", BLK),
    ("block-x-other-device", lambda d: _B(d, x=_r((2, 4, 16), _other(d))), ValueError, r"^x is on .* but the block's parameters", BLK),
    ("block-attn_bias-other-device", lambda d: _B(d, attn_bias=_r((1, 2, 4, 4), _other(d))), ValueError, r"^attn_bias is on", BLK),
    ("block-mask-other-device", lambda d: _B(d, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool, device=_other(d))), ValueError, r"^key_padding_mask is on", BLK),
    ("block-parameter-not-contiguous", _noncontig_param_block, ValueError, r"^parameter ffn1_weight must be contiguous", BLK),
    ("stack-empty", lambda d: (lambda: EncoderStack([])), ValueError, r"at least one block", BLK),
    ("stack-not-a-block", lambda d: (lambda: EncoderStack([nn.Linear(16, 16)])), TypeError, r"^blocks\[0\] is a Linear", BLK),
    ("stack-num_layers-zero", lambda d: (lambda: EncoderStack.build(0, 16, 2, 32, device=d)), ValueError, r"^num_layers must be a positive int", BLK),
    ("plan-cache-limit-zero", lambda d: (lambda: fusedenc.set_plan_cache_limit(0)), ValueError, r"^limit must be a positive int", LIN),
    ("plan-cache-limit-float", lambda d: (lambda: fusedenc.set_plan_cache_limit(8.0)), ValueError, r"^limit must be a positive int", LIN),
    ("graph_runner-stack-on-cpu", lambda d: (lambda: _stack_runner("cpu", seq_len=4)), ValueError, r"stack on a GPU", BLK, "cpu"),
    ("graph_runner-seq_len-zero", lambda d: (lambda: _stack_runner(d, seq_len=0)), ValueError, r"^seq_len must be a positive int", BLK, "cuda"),
    ("graph_runner-batch_sizes-empty", lambda d: (lambda: _stack_runner(d, seq_len=4, batch_sizes=())), ValueError, r"^batch_sizes must be positive ints", BLK, "cuda"),
    ("graph_runner-x-shape", _graph_runner_x, ValueError, r"^x must have shape \[B, 4, 16\]", BLK, "cuda"),
    ("graph_runner-attn_bias-missing", _graph_runner_bias, ValueError, r"attn_bias=True; pass an attn_bias", BLK, "cuda"),
]


def _params():
    out = []
    for row in ROWS:
        name, only = row[0], (row[5] if len(row) > 5 else None)
        if only in (None, "cpu"):
            out.append(pytest.param(row, "cpu", id=f"cpu-{name}"))
        if only in (None, "cuda"):
            out.append(pytest.param(row, "cuda", id=f"cuda-{name}", marks=pytest.mark.gpu))
    return out


def test_table_covers_at_least_40_kinds():
    names = [r[0] for r in ROWS]
    assert len(set(names)) == len(names), "duplicate row names"
    assert len([r for r in ROWS if len(r) < 6 or r[5] != "cuda"]) >= 40


# ------------------------------------------------------------ valid calls ----


def _valid(family: str, dev: str) -> None:
    """One valid call of ``family`` on ``dev`` (current stream): must match the formula."""
    g = torch.Generator().manual_seed(7)
    if family == LIN:
        x, w, b = randn((6, 32), H, dev, g), randn((24, 32), H, dev, g, 32**-0.5), randn((24,), H, dev, g)
        out = fusedenc.linear(x, w, b, "relu", out=poisoned((6, 24), H, dev))
        ref = linear_formula(x, w, b, "relu", dtype=ref_dtype(H))
        assert_close_rule(out, ref, same_dtype_torch(x, w, b, "relu"), H, what=f"valid linear on {dev}")
    elif family == LN:
        x, r = randn((6, 32), H, dev, g), randn((6, 32), H, dev, g)
        w, b = 1 + randn((32,), H, dev, g, 0.2), randn((32,), H, dev, g, 0.2)
        out = fusedenc.layer_norm(x, w, b, residual=r, alpha=0.5, out=poisoned((6, 32), H, dev))
        ref, _ = ln_formula(x, w, b, 1e-5, residual=r, alpha=0.5)
        same, _ = ln_same_dtype(x, w, b, 1e-5, residual=r, alpha=0.5)
        assert_close_rule(out, ref, same, H, what=f"valid layer_norm on {dev}")
    elif family == ATT:

        q, k, v = fusedenc.ops.gemm.split_qkv(randn((2, 7, 3 * 32), H, dev, g), 2)
        out = attention(q, k, v)
        assert_close_rule(out, attention_formula(q, k, v, dtype=ref_dtype(H)), attention_formula(q, k, v, dtype=H), H, what=f"valid attention on {dev}")
    else:
        block = randomize(EncoderBlock(16, 2, 32, "swish", dtype=H, device=dev), g)
        x = randn((2, 5, 16), H, dev, g)
        with torch.inference_mode():
            out = block(x)
        p, cfg = block_params(block), block_config(block)
        ref = block_formula(p, x, cfg, dtype=ref_dtype(H))
        same = block_formula(p, x, cfg, dtype=H)
        assert_close_rule(out, ref, same, H, what=f"valid block on {dev}")
    if dev == "cuda":
        torch.cuda.synchronize()  # no sticky error left behind


def _gemm_calls() -> int:
    info = fusedenc.plan_cache_info()
    return info["hits"] + info["misses"]


@pytest.mark.parametrize("row, dev", _params())
def test_bad_call_raises_naming_the_argument(row, dev):
    name, make, exc, pattern, family = row[:5]
    limit = fusedenc.plan_cache_info()["limit"]
    bad = make(dev)
    if dev == "cuda":
        torch.cuda.synchronize()
    calls = _gemm_calls()
    with pytest.raises(exc, match=pattern) as info:
        bad()
    assert type(info.value) is exc, f"{name}: raised {type(info.value).__name__}, expected exactly {exc.__name__}"
    if dev == "cuda":
        torch.cuda.synchronize()
        assert _gemm_calls() == calls, f"{name}: the GEMM library was reached"
    assert fusedenc.plan_cache_info()["limit"] == limit
    _valid(family, dev)


# ------------------------------------------------- FUSEDENC_PLAN_CACHE_LIMIT ----


@pytest.mark.parametrize(
    "text, expected",
    [("", None), ("  ", None), ("7", 7), (" 64 ", 64), ("0", "warn"), ("-3", "warn"), ("lots", "warn"), ("2.5", "warn")],
)
def test_plan_cache_limit_from_env(text, expected, monkeypatch):
    from fusedenc import core

    monkeypatch.setenv(core.PLAN_CACHE_LIMIT_ENV, text)
    if expected == "warn":
        with pytest.warns(RuntimeWarning, match=r"FUSEDENC_PLAN_CACHE_LIMIT=.*not a positive integer"):
            assert core.plan_cache_limit_from_env() is None
    else:
        assert core.plan_cache_limit_from_env() == expected


@pytest.mark.parametrize("text, limit", [("5", 5), ("bogus", 1024), (None, 1024)])
def test_plan_cache_limit_env_applies_at_first_use(text, limit):
    """A fresh process reads FUSEDENC_PLAN_CACHE_LIMIT when the core is first used."""
    import os
    import subprocess
    import sys

    from fusedenc import core

    if core.native_module() is None:
        pytest.skip(f"no native core: {fusedenc.backend()}")
    env = dict(os.environ)
    env.pop(core.PLAN_CACHE_LIMIT_ENV, None)
    if text is not None:
        env[core.PLAN_CACHE_LIMIT_ENV] = text
    code = (
        "import warnings, fusedenc\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    info = fusedenc.plan_cache_info()\n"
        "print(info['limit'], len([x for x in w if 'FUSEDENC_PLAN_CACHE_LIMIT' in str(x.message)]))\n"
        "fusedenc.set_plan_cache_limit(3)\n"
        "print(fusedenc.plan_cache_info()['limit'])\n"
    )
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    first, second = res.stdout.split("\n")[:2]
    got_limit, warned = map(int, first.split())
    assert got_limit == limit
    assert warned == (1 if text == "bogus" else 0)
    assert int(second) == 3
