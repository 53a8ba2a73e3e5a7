"""Short-sequence attention in Triton: packed QKV views in, ``[B*S, H*Dh]`` rows out.

At short sequences (Lc0's 64 tokens, BERT's 128) every (sequence, head) pair
is tiny: 64 queries x 64 keys x head dim 32.  The flash-attention kernels
still run their long-sequence machinery (an online-softmax loop over key
blocks, bias and mask materialised as ``[B, H, S, S]``) and land at about
twice the memory floor.  This kernel keeps every key of a sequence in one
tile, so the softmax is computed in one pass with no rescaling:

* one program per (query block, group of heads, sequence); consecutive
  programs share a sequence, so K and V of neighbouring heads come from the
  same DRAM pages and a re-read by another query block hits L2;
* q, k and v are read straight from the strided views of the packed
  ``[B, S, 3, H, Dh]`` buffer (any strides with a unit last one);
* the additive bias is read as the caller passed it: ``[B or 1, H, S, S]``,
  any strides (stride 0 over batch when broadcast), in q's dtype or float32
  (upcast in registers, never copied);
* the bool key padding mask ``[B, S]`` is read once per program, so no
  ``[B, H, S, S]`` mask bias is ever built;
* the output rows are stored straight into ``[B*S, H*Dh]``, what the output
  projection reads.

Math: fp32 scores and accumulation, ``softmax(q k^T * scale + bias, masked
keys -inf) v``.  A query row whose keys are all ``-inf`` (all padding, or an
``-inf`` bias row) gives zeros, the convention of ``fusedenc.attention``; NaN
in q, k, v or bias gives NaN where the formula does.

``short_varlen_attention`` is the same one-tile kernel over packed variable-length
sequences (``cu_seqlens`` offsets, ``fusedenc.attention.varlen``'s ``triton_short`` backend):
one program per (query block, group of heads, sequence), each sequence's keys in one tile
of ``key_block(max_seqlen)``, rows read from and written to the packed ``[T, ...]`` buffers
at the sequence's offset; no bias or mask (the offsets are the mask).  Empty sequences
write nothing; rows past ``cu_seqlens[-1]`` (a graph bucket's slack) are left unwritten.

Importing this module imports Triton; ``fusedenc.attention`` imports it only
when the ``triton_short`` backend is asked whether it is available.  Set
``TRITON_INTERPRET=1`` before the import to run the kernel on CPU tensors
(slowly: the tests do that).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

__all__ = ["HEAD_DIMS", "MAX_SEQ", "LaunchConfig", "key_block", "launch_config", "short_attention",
           "short_varlen_attention"]

#: Longest sequence served: every key of a sequence must fit one tile.
MAX_SEQ = 128
#: Head dims served: powers of two (tl.dot needs 16 or more along each dimension).
HEAD_DIMS = (16, 32, 64, 128)

_LOG2E = math.log2(math.e)
_LOG2E_IN_KERNEL = tl.constexpr(_LOG2E)


class LaunchConfig(NamedTuple):
    block_m: int  # query rows per program (<= the key block; a power of two, >= 16)
    num_warps: int
    heads_per_program: int  # heads one program handles in turn (reduced to a divisor of H)


#: (key block = next power of two >= S, at least 16; head dim) -> launch config.
#: Guessed for an H100, not yet measured: the two fp32 tiles a program holds
#: (scores block_m x key block, accumulator block_m x Dh) spread over
#: num_warps * 32 threads take at most ~96 registers a thread; at 128 keys and
#: Dh 128 the query block halves to stay there.  Small tiles take several heads
#: per program so that a program is not too short to hide its load latency.
_CONFIGS: dict[tuple[int, int], LaunchConfig] = {
    (16, 16): LaunchConfig(16, 1, 4),
    (16, 32): LaunchConfig(16, 1, 4),
    (16, 64): LaunchConfig(16, 1, 4),
    (16, 128): LaunchConfig(16, 2, 2),
    (32, 16): LaunchConfig(32, 2, 4),
    (32, 32): LaunchConfig(32, 2, 4),
    (32, 64): LaunchConfig(32, 2, 2),
    (32, 128): LaunchConfig(32, 4, 2),
    (64, 16): LaunchConfig(64, 4, 2),
    (64, 32): LaunchConfig(64, 4, 2),  # Lc0 t82 and bt4: 64 tokens, head dim 32
    (64, 64): LaunchConfig(64, 4, 1),
    (64, 128): LaunchConfig(64, 4, 1),
    (128, 16): LaunchConfig(128, 8, 1),
    (128, 32): LaunchConfig(128, 8, 1),
    (128, 64): LaunchConfig(128, 8, 1),
    (128, 128): LaunchConfig(64, 8, 1),
}


def key_block(seq: int) -> int:
    """Keys per tile: the next power of two >= ``seq``, at least 16."""
    return max(16, triton.next_power_of_2(seq))


@functools.lru_cache(maxsize=None)
def launch_config(seq: int, heads: int, head_dim: int) -> LaunchConfig:
    """The table's config for a call, with heads per program reduced to a divisor of ``heads``."""
    cfg = _CONFIGS[(key_block(seq), head_dim)]
    per = cfg.heads_per_program
    while heads % per:
        per //= 2
    return cfg._replace(heads_per_program=per)


@triton.jit
def _one_tile_softmax_v(s, v, PRECISION: tl.constexpr):
    """``softmax(s) @ v`` for fp32 base-2 scores ``s`` [BLOCK_M, BLOCK_N] (masked keys -inf)
    holding every key: one pass, no online rescaling.  A row that is all -inf would give
    -inf - -inf = NaN; shifting it by 0 instead makes its p all 0, so its sum is 0 and its
    output 0 @ v / 1 = 0 (NaN in q, k, v or bias still reaches the sum or the product, and
    the output)."""
    m = tl.max(s, 1)
    m = tl.where(m == float("-inf"), 0.0, m)
    p = tl.exp2(s - m[:, None])
    denom = tl.sum(p, 1)
    denom = tl.where(denom == 0.0, 1.0, denom)
    return tl.dot(p.to(v.dtype), v, input_precision=PRECISION) / denom[:, None]


@triton.jit
def _short_attention_kernel(
    q_ptr, k_ptr, v_ptr, bias_ptr, mask_ptr, out_ptr, out_scale_ptr,
    seq, heads, qk_scale,
    q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh,
    bias_sb, bias_sh, bias_sm, bias_sn,
    mask_sb, mask_ss,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr, HAS_OUT_SCALE: tl.constexpr,
):  # fmt: skip
    # Program order: query block fastest, then head group, then sequence.
    pid = tl.program_id(0)
    q_blocks = tl.cdiv(seq, BLOCK_M)
    groups = heads // HEADS_PER_PROGRAM
    q_block = pid % q_blocks
    group = (pid // q_blocks) % groups
    b = (pid // (q_blocks * groups)).to(tl.int64)  # batch offsets can pass 2**31 elements

    rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    keys = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows < seq
    key_in = keys < seq
    key_ok = key_in
    if HAS_MASK:  # True = padding; keys past the sequence read as padding
        pad = tl.load(mask_ptr + b * mask_sb + keys * mask_ss, mask=key_in, other=1)
        key_ok = key_in & (pad == 0)

    out_row_stride = heads * HEAD_DIM
    for i in tl.static_range(HEADS_PER_PROGRAM):
        h = group * HEADS_PER_PROGRAM + i
        q = tl.load(q_ptr + b * q_sb + h * q_sh + rows[:, None] * q_ss + dims[None, :], mask=row_ok[:, None], other=0.0)
        k = tl.load(k_ptr + b * k_sb + h * k_sh + keys[:, None] * k_ss + dims[None, :], mask=key_in[:, None], other=0.0)
        v = tl.load(v_ptr + b * v_sb + h * v_sh + keys[:, None] * v_ss + dims[None, :], mask=key_in[:, None], other=0.0)

        # Scores in base 2: exp2 is the native instruction, so scale and bias carry log2(e).
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if HAS_BIAS:
            bias_ptrs = bias_ptr + b * bias_sb + h * bias_sh + rows[:, None] * bias_sm + keys[None, :] * bias_sn
            bias = tl.load(bias_ptrs, mask=row_ok[:, None] & key_in[None, :], other=0.0)
            s += bias.to(tl.float32) * _LOG2E_IN_KERNEL
        o = _one_tile_softmax_v(tl.where(key_ok[None, :], s, float("-inf")), v, PRECISION)

        # e4m3 codes of o * out_scale[column], saturated at +-448 (NaN stays NaN): OCP codes
        # only (fusedenc.fp8.rowwise.format_for; plans.Plan turns this off on FNUZ devices)
        if HAS_OUT_SCALE:
            o = o * tl.load(out_scale_ptr + h * HEAD_DIM + dims)[None, :]
            o = tl.where(o > 448.0, 448.0, tl.where(o < -448.0, -448.0, o))
        out_ptrs = out_ptr + (b * seq + rows)[:, None] * out_row_stride + h * HEAD_DIM + dims[None, :]
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def short_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: Optional[torch.Tensor],
    key_padding_mask: Optional[torch.Tensor],
    scale: float,
    config: Optional[LaunchConfig] = None,
    out_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``softmax(q k^T * scale + bias, padding keys -inf) v`` as a new ``[B*S, H*Dh]`` tensor.

    q, k, v: ``[B, S, H, Dh]``, same dtype (float16, bfloat16 or float32) and
    device, unit last stride, S <= ``MAX_SEQ``, Dh in ``HEAD_DIMS``.  bias:
    ``[B or 1, H, S, S]`` in q's dtype or float32, any strides, or None.
    key_padding_mask: bool ``[B, S]`` (True = padding) or None.  config
    overrides the table's launch config (benchmarks, tests).  out_scale: float32
    ``[H*Dh]`` on q's device, or None; given, the result is float8 e4m3 codes of
    ``out * out_scale`` per column, saturated (an FP8 out-projection's static input
    scales, ``fusedenc.fp8.rowwise``).  Arguments are not validated here: ``fusedenc.attention``
    does that once per signature.
    """
    b, s, h, d = q.shape
    out_dtype = q.dtype if out_scale is None else torch.float8_e4m3fn
    out = torch.empty((b * s, h * d), dtype=out_dtype, device=q.device)
    if out.numel() == 0:
        return out
    cfg = config or launch_config(s, h, d)
    has_bias, has_mask = bias is not None, key_padding_mask is not None
    if has_bias:
        bias_strides = (0 if bias.shape[0] == 1 else bias.stride(0),) + bias.stride()[1:]
    else:
        bias, bias_strides = q, (0, 0, 0, 0)  # a placeholder pointer, never read
    if has_mask:
        mask = key_padding_mask.view(torch.uint8)  # same bytes; loads as 0/1 on every Triton version
        mask_strides = mask.stride()
    else:
        mask, mask_strides = q, (0, 0)  # a placeholder pointer, never read
    grid = (triton.cdiv(s, cfg.block_m) * (h // cfg.heads_per_program) * b,)
    _short_attention_kernel[grid](
        q, k, v, bias, mask, out, q if out_scale is None else out_scale,
        s, h, scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        *bias_strides, *mask_strides,
        HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=key_block(s), HEADS_PER_PROGRAM=cfg.heads_per_program,
        HAS_BIAS=has_bias, HAS_MASK=has_mask, HAS_OUT_SCALE=out_scale is not None,
        # fp32 inputs: full-precision products, not TF32; 16-bit inputs: the target's default
        PRECISION="ieee" if q.dtype == torch.float32 else None,
        num_warps=cfg.num_warps,
    )  # fmt: skip
    return out


@triton.jit
def _short_varlen_kernel(
    q_ptr, k_ptr, v_ptr, cu_ptr, out_ptr,
    heads, q_blocks, qk_scale,
    q_ss, q_sh, k_ss, k_sh, v_ss, v_sh,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    # Program order as the padded kernel's: query block fastest, then head group, then sequence.
    pid = tl.program_id(0)
    groups = heads // HEADS_PER_PROGRAM
    q_block = pid % q_blocks
    group = (pid // q_blocks) % groups
    n = pid // (q_blocks * groups)
    start = tl.load(cu_ptr + n).to(tl.int64)  # row offsets can pass 2**31 elements
    seq = tl.load(cu_ptr + n + 1).to(tl.int64) - start

    rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    keys = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows < seq  # query blocks past a shorter sequence's end store nothing
    key_ok = keys < seq
    out_row_stride = heads * HEAD_DIM
    for i in tl.static_range(HEADS_PER_PROGRAM):
        h = group * HEADS_PER_PROGRAM + i
        q = tl.load(q_ptr + (start + rows)[:, None] * q_ss + h * q_sh + dims[None, :], mask=row_ok[:, None], other=0.0)
        k = tl.load(k_ptr + (start + keys)[:, None] * k_ss + h * k_sh + dims[None, :], mask=key_ok[:, None], other=0.0)
        v = tl.load(v_ptr + (start + keys)[:, None] * v_ss + h * v_sh + dims[None, :], mask=key_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        # Rows outside the sequence are all -inf (zeros out) and masked at the store.
        o = _one_tile_softmax_v(tl.where(key_ok[None, :], s, float("-inf")), v, PRECISION)
        out_ptrs = out_ptr + (start + rows)[:, None] * out_row_stride + h * HEAD_DIM + dims[None, :]
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def short_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
    config: Optional[LaunchConfig] = None,
) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` within each sequence of packed rows, as a new ``[T, H*Dh]``.

    q, k, v: ``[T, H, Dh]``, same dtype and device, unit last stride (views of a ``[T, 3D]``
    QKV buffer); cu_seqlens: int32 ``[N + 1]`` on their device, checked by the caller, every
    sequence at most ``max_seqlen`` <= ``MAX_SEQ`` rows; Dh in ``HEAD_DIMS``.  No host sync
    (a CUDA graph captures it with a bound for ``max_seqlen``).  Rows past ``cu_seqlens[-1]``
    are not written.  Arguments are not validated here: ``fusedenc.attention.varlen`` does that.
    """
    t, h, d = q.shape
    out = torch.empty((t, h * d), dtype=q.dtype, device=q.device)
    sequences = cu_seqlens.shape[0] - 1
    if out.numel() == 0 or sequences <= 0 or max_seqlen <= 0:
        return out
    cfg = config or launch_config(max_seqlen, h, d)
    q_blocks = triton.cdiv(max_seqlen, cfg.block_m)
    grid = (q_blocks * (h // cfg.heads_per_program) * sequences,)
    _short_varlen_kernel[grid](
        q, k, v, cu_seqlens, out,
        h, q_blocks, scale * _LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=key_block(max_seqlen), HEADS_PER_PROGRAM=cfg.heads_per_program,
        PRECISION="ieee" if q.dtype == torch.float32 else None,
        num_warps=cfg.num_warps,
    )  # fmt: skip
    return out
