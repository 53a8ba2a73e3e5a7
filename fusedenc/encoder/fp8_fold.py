"""The FP8 mode with its LayerNorms folded into the GEMMs.

In the calibrated FP8 mode (``fusedenc.fp8.rowwise``) each post-LN layer still runs two LayerNorm
passes that write the normalized rows in fp16 and in e4m3: ~22% of a t82 layer at 256
positions, memory-bound.  Here, as ``norm_fold`` does for 16-bit blocks, no pass is left:

* the GEMM that ends a residual branch (out-projection, FFN2) reads e4m3 operands (its
  input's static column scales folded into the weight's copy) and writes
  ``z = alpha * (x W^T + b) + residual`` in fp16, the row sums of ``z`` and ``z^2`` for the
  LayerNorm that follows, and e4m3 codes of ``z / c`` with static per-column scales ``c``
  from calibration (``CodedRows``);
* the GEMM that reads ``LN(z)`` (the next QKV, FFN1) reads those codes with
  ``W * gamma * c`` in e4m3 (per output channel) and applies the norm in its epilogue:
  ``rstd * (z (W gamma)^T) + shift * colsum + (W beta + b)``; FFN1 writes FFN2's e4m3
  input as before.

So the FP8 GEMMs read e4m3 codes of the un-normalized sum with static column scales instead
of the normalized rows with one scale per row.  Measured in emulation (``bench/NOTES.md``,
``bench/fp8_accuracy.py``): the same error as the per-row mode on the t82/bt4 presets, and
with 1% outlier channels 1.04x (t82) and 0.97x (bt4) its error (one seed).  ``EncoderBlock.quantize(..., fold_norms=False)`` keeps the
LayerNorm passes.

The scales ``c`` are powers of two (``fp8.static_scales(..., power_of_two=True)``): the epilogue stores the codes of ``z * (1 / c)`` and
multiplies back by ``c`` (a CUTLASS epilogue tree stores one value and passes it on), which
is exact only then.  Rounding a scale up to a power of two costs at most one binade of
headroom, which e4m3's uniform relative precision does not notice.

The kernels are Hopper's (``sm90_gemm.h``: the FP8 kernel with a folded LayerNorm, the FP8
residual kernel); elsewhere, and in ``norm_fold.mode("force")``, the same math runs in torch.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional, Sequence, Union

import torch

from .. import core
from ..common.activations import apply_activation
from ..fp8 import rowwise as fp8
from ..ops import norm_fold
from ..ops.norm_fold import NormedRows
from .executors import Fp8Executor, NativeExecutor

__all__ = ["CodedRows", "FoldedFp8", "applies", "block_rows", "fold_weight", "norm_linear", "residual_linear",
           "stack_rows"]


class CodedRows(NamedTuple):
    """Rows pending their LayerNorm with e4m3 codes of ``z`` for the FP8 GEMM that reads them."""

    rows: NormedRows
    codes: Optional[torch.Tensor]  # [T, D] e4m3 codes of z / scale (None: not written)
    scale: Optional[torch.Tensor]  # [D] fp32, powers of two


class FoldedFp8(NamedTuple):
    """A Linear layer reading ``LN(z)`` as e4m3 codes of ``z / c``: its FP8 copy and epilogue vectors."""

    weight: fp8.Quantized  # e4m3(W * gamma * c) per output channel
    colsum: torch.Tensor  # [N] fp32, row sums of the weight the codes are multiplied with (W * gamma, as coded)
    bias: torch.Tensor  # [N] W beta + b, the model's dtype


def fold_weight(
    weight: torch.Tensor, bias: Optional[torch.Tensor], gamma: torch.Tensor, beta: Optional[torch.Tensor],
    scale: torch.Tensor,
) -> FoldedFp8:  # fmt: skip
    """``weight`` [N, K] after a LayerNorm ``gamma``/``beta`` whose input arrives as codes of
    ``z / scale``.  The column sums are of the weight as coded: they must cancel exactly what
    the GEMM multiplies the row mean with."""
    q = fp8.quantize_rows(weight.float() * (gamma.float() * scale)[None, :])
    colsum = (fp8.dequantize(q) / scale[None, :]).sum(1)
    return FoldedFp8(q, colsum.contiguous(), norm_fold.folded_bias(weight, bias, beta))


def applies(blocks: Sequence[Any], rows: torch.Tensor) -> bool:
    """Whether quantized ``blocks`` run on ``rows`` [T, D] with their LayerNorms folded:
    every block post-LN, in FP8 with every GEMM, calibrated with the LayerNorm inputs'
    scales (``quantize(..., fold_norms=True)``), and ``norm_fold.current_mode()`` ``force``,
    or ``auto`` with the Hopper kernels for fp16, fast accumulation, an FFN activation their
    epilogue applies, at a size where folding pays (so that no GEMM falls back to torch)."""
    mode = norm_fold.current_mode()
    if mode == "off" or rows.shape[0] == 0:
        return False
    for b in blocks:
        w8 = b._fp8
        if w8 is None or b.norm_first or b.norm1_weight is None or not w8.folds_norms:
            return False
    if mode == "force":
        return True
    if rows.dtype != torch.float16 or not core.active_on(rows.device) or not core.fp8.sm90_fp8_residual_compiled(rows.dtype):
        return False
    if not all(b._fp8.fast_accum for b in blocks) or not core.fp8_status(rows.device)[0]:
        return False  # the kernels accumulate fast only
    dev, t = rows.device.index, rows.shape[0]
    in_epilogue = _epilogue_activations()
    for b in blocks:
        # FFN1's activation must be one the FP8 epilogue applies (exact GELU in its own unit;
        # not tanh, selu, ...): the folded FFN1 writes e4m3 codes, which no pass after it could make.
        if b.activation not in in_epilogue or not norm_fold.fills_gpu(rows, b.d_model):
            return False
        if not core.sm90_fold_fits(dev, rows.dtype, t, b.d_model, b.d_model, True):  # device and alignment rules
            return False
    return True


@functools.lru_cache(maxsize=None)
def _epilogue_activations() -> frozenset:
    """The activations the Hopper FP8 epilogue applies to FFN1's e4m3 output for an fp16 stack
    (its run-time switch has the 16-bit kernels' list; exact GELU has a unit of its own): a
    property of the build, asked once (``applies`` runs on every stack call)."""
    acts = {act for dtype, act in core.sm90_gemm_kernels() if dtype == "float16"}
    if "float16" in core.fp8.sm90_fp8_e4m3_gelu_kernels():
        acts.add("gelu")
    return frozenset(acts)


def _native(device: torch.device) -> bool:
    return norm_fold.current_mode() != "off" and device.type == "cuda" and core.active_on(device)


def norm_linear(
    rows: CodedRows,
    folded: FoldedFp8,
    activation: str,
    *,
    out_dtype: torch.dtype,
    out_scale: Optional[torch.Tensor] = None,
    fast_accum: bool = True,
    stream: Optional[int] = None,
    workspace: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``act(LN(z) W^T + b)`` from the codes of ``z`` (``activation``: a canonical name), in
    ``out_dtype``, or with ``out_scale`` ([N] fp32) as e4m3 codes of that times ``out_scale``."""
    codes, pending = rows.codes, rows.rows
    m, n = codes.shape[0], folded.weight.q.shape[0]
    w = folded.weight
    if out_scale is None:
        out = torch.empty((m, n), dtype=out_dtype, device=codes.device)
    else:
        out = torch.empty((m, n), dtype=codes.dtype, device=codes.device)
    if m and fast_accum and _native(codes.device):
        a, wq, out_k = codes.view(torch.uint8), w.q.view(torch.uint8), out if out_scale is None else out.view(torch.uint8)
        ok, _ = core.sm90_fp8_gemm_applies(a, pending.rstd, wq, w.scale, folded.bias, out_k, activation, True,
                                           out_scale, pending.shift, folded.colsum)  # fmt: skip
        if ok:
            stream, workspace = norm_fold.kernel_args(codes.device, stream, workspace)
            core.fp8_gemm(a, pending.rstd, wq, w.scale, folded.bias, out_k, activation, True, stream, workspace,
                          out_scale=out_scale, shift=pending.shift, colsum=folded.colsum)  # fmt: skip
            return out
    acc = torch.mm(codes.float(), w.q.float().t()) * w.scale[None, :]
    y = apply_activation(norm_fold.folded_epilogue(acc, pending, folded.colsum, folded.bias), activation)
    if out_scale is None:
        out.copy_(y)
        return out
    return fp8.e4m3_columns(y, out_scale, fp8.format_for(codes.device)) if m else out


def residual_linear(
    codes: torch.Tensor,
    weight: fp8.Quantized,
    bias: Optional[torch.Tensor],
    residual: Union[torch.Tensor, NormedRows],
    alpha: float,
    gamma: torch.Tensor,
    beta: Optional[torch.Tensor],
    eps: float,
    code_scale: Optional[tuple[torch.Tensor, torch.Tensor]],
    *,
    fast_accum: bool = True,
    stream: Optional[int] = None,
    workspace: Optional[torch.Tensor] = None,
) -> CodedRows:
    """``z = alpha * (x W^T + b) + residual`` from e4m3 ``codes`` of ``x`` (their static column
    scales are in ``weight``'s copy; a pending ``residual`` is normalized on the fly), with the
    statistics of the LayerNorm ``gamma``/``beta``/``eps`` that follows and, for ``code_scale``
    ``(c, 1 / c)``, e4m3 codes of ``z / c`` for the next GEMM."""
    src = residual.z if isinstance(residual, NormedRows) else residual
    m, n = codes.shape[0], weight.q.shape[0]
    z = torch.empty((m, n), dtype=src.dtype, device=src.device)
    out_codes = None if code_scale is None else torch.empty((m, n), dtype=codes.dtype, device=codes.device)
    if m and fast_accum and _native(codes.device):
        a, wq = codes.view(torch.uint8), weight.q.view(torch.uint8)
        if core.fp8.sm90_fp8_residual_applies(a, wq, weight.scale, bias, src, z)[0]:
            sums = norm_fold.statistics_buffer(m, n, z.device)
            stream, workspace = norm_fold.kernel_args(z.device, stream, workspace)
            pending = residual if isinstance(residual, NormedRows) else None
            scale, inv = (None, None) if code_scale is None else code_scale
            if core.fp8.sm90_fp8_residual_gemm(
                a, wq, weight.scale, bias, src, z, alpha, pending, sums[0], sums[1],
                None if out_codes is None else out_codes.view(torch.uint8), scale, inv, stream, workspace,
            ):  # fmt: skip
                return CodedRows(norm_fold.pending_rows(z, sums, eps, gamma, beta, stream), out_codes, scale)
    acc = torch.mm(codes.float(), weight.q.float().t()) * weight.scale[None, :]
    rows, zf = norm_fold.residual_sum(acc, bias, residual, alpha, z, gamma, beta, eps)
    if code_scale is not None and m:
        out_codes = fp8.e4m3_columns(zf, code_scale[1], fp8.format_for(codes.device))
    return CodedRows(rows, out_codes, None if code_scale is None else code_scale[0])


def block_rows(block, rows, batch, seq, attn_bias, key_padding_mask, executor, codes_out=True, after_qkv=None):
    """Quantized post-LN ``block`` with its LayerNorms folded into the FP8 GEMMs: ``rows`` plain
    ``[T, D]`` (a stack's input) or the previous block's ``CodedRows``; returns this block's,
    pending its norm2 (``codes_out``: with the codes the next block reads).  ``executor``: a
    shared ``NativeExecutor`` or None; ``after_qkv()``: as ``EncoderBlock.folded_rows``'."""
    z = rows if isinstance(rows, torch.Tensor) else rows.rows.z
    ex, plan = block._prepared(z, batch, seq, attn_bias, key_padding_mask, executor)
    alpha, eps, act, w8 = block.residual_alpha, block.layer_norm_eps, block.activation, block._fp8
    p, cache = block._parameters, block._fold_cache
    device = p["qkv_weight"].device
    kw = {"stream": ex.stream, "workspace": ex.workspace} if isinstance(ex, NativeExecutor) else {}
    kw["fast_accum"] = w8.fast_accum
    if isinstance(rows, torch.Tensor):  # the stack's input: codes with one scale per row, by a pass
        qkv = Fp8Executor(ex, w8).linear(rows, p["qkv_weight"], p["qkv_bias"])
        residual = rows
    else:
        fold = cache.cached(fold_weight, p["qkv_weight"], p["qkv_bias"], rows.rows.gamma, rows.rows.beta, rows.scale)
        qkv = norm_linear(rows, fold, "none", out_dtype=z.dtype, **kw)
        residual = rows.rows
    if after_qkv is not None:
        after_qkv()
    a = ex.attention(plan, qkv, batch, seq, block.n_heads, attn_bias, key_padding_mask,
                     out_scale=w8.attention_out_scale(device))  # fmt: skip
    h = residual_linear(a, w8.get(p["out_weight"]), p["out_bias"], residual, alpha, p["norm1_weight"], p["norm1_bias"],
                        eps, w8.norm_code_scales("norm1", device), **kw)  # fmt: skip
    fold = cache.cached(fold_weight, p["ffn1_weight"], p["ffn1_bias"], p["norm1_weight"], p["norm1_bias"], h.scale)
    f = norm_linear(h, fold, act, out_dtype=z.dtype, out_scale=w8.out_scale(p["ffn1_weight"]), **kw)
    return residual_linear(f, w8.get(p["ffn2_weight"]), p["ffn2_bias"], h.rows, alpha, p["norm2_weight"],
                           p["norm2_bias"], eps, w8.norm_code_scales("norm2", device) if codes_out else None,
                           **kw)  # fmt: skip


def stack_rows(blocks, rows, batch, seq, attn_bias, key_padding_mask, executor) -> torch.Tensor:
    """``rows`` [T, D] through ``blocks`` (where ``applies``) and the last one's LayerNorm."""
    pending, last = rows, len(blocks) - 1
    for i, block in enumerate(blocks):
        pending = block_rows(block, pending, batch, seq, attn_bias, key_padding_mask, executor, i < last)
    return norm_fold.materialize(pending.rows, blocks[-1].layer_norm_eps)
