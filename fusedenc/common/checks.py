"""Argument checks shared by the ops: everything is validated before a launch.

Wrong types and dtypes raise TypeError, everything else ValueError, and each
message names the offending argument and its value.  The same rules hold on
every backend, so code that passes on the CPU reference passes on the GPU.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensor

from . import dtypes

#: Dtypes the ops accept (``dtypes.SUPPORTED``).
SUPPORTED_DTYPES = dtypes.SUPPORTED

#: Rows and row strides of every GEMM operand must span whole 16-byte vectors:
#: the vectorized epilogue kernel and the fast library kernels both need it.
ALIGN_BYTES = 16


def align_elems(dtype: torch.dtype) -> int:
    return ALIGN_BYTES // (4 if dtype == torch.float32 else 2)


class LinearProblem(NamedTuple):
    m: int
    n: int
    k: int
    x2d: torch.Tensor  # [m, k] view of x
    ldx: int
    ldw: int
    residual2d: torch.Tensor | None
    ldr: int
    ldo: int  # row stride of out (n when the op allocates it)
    out_shape: tuple[int, ...]


def tensor_arg(t: object, name: str) -> torch.Tensor:
    """``t`` if it is a tensor; TypeError naming argument ``name`` otherwise."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def same_kind(t: torch.Tensor, name: str, x: torch.Tensor) -> None:
    """TypeError if ``t``'s dtype differs from ``x``'s, ValueError if its device does."""
    if t.dtype != x.dtype:
        raise TypeError(f"{name}.dtype={t.dtype} does not match x.dtype={x.dtype}")
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device} but x is on {x.device}")


def _rows(t: torch.Tensor, name: str) -> tuple[torch.Tensor, int]:
    """View ``t`` as [rows, cols] with unit column stride; return it and its row stride."""
    cols = t.shape[-1]
    try:
        t2 = t.view(-1, cols)
    except RuntimeError:
        raise ValueError(
            f"{name} with shape {tuple(t.shape)} and strides {t.stride()} cannot be viewed as rows "
            "without a copy; make it contiguous"
        ) from None
    if t2.shape[0] <= 1:
        return t2, max(cols, 1)
    if t2.stride(1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension, got strides {t.stride()}")
    if t2.stride(0) < cols:
        raise ValueError(f"{name} has overlapping rows (row stride {t2.stride(0)} < {cols} columns)")
    return t2, t2.stride(0)


def _check_aligned(t: torch.Tensor, name: str, ld: int, align: int) -> None:
    if ld % align:
        raise ValueError(
            f"{name} row stride {ld} must be a multiple of {align} elements ({ALIGN_BYTES} bytes)"
        )
    if t.device.type != "meta" and not _is_fake(t) and t.data_ptr() % ALIGN_BYTES:
        raise ValueError(
            f"{name} data pointer is not {ALIGN_BYTES}-byte aligned (storage offset {t.storage_offset()})"
        )


def _is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, FakeTensor)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) byte range that ``t`` touches."""
    start = t.data_ptr()
    extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)
    return start, start + extent * t.element_size()


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, a1 = _span(a)
    b0, b1 = _span(b)
    return a0 < b1 and b0 < a1


def check_scalar(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name}={value} is not finite")
    return float(value)


def check_linear(
    x: object,
    weight: object,
    bias: object,
    activation: str,
    residual: object,
    alpha: float,
    beta: float,
    out: object,
) -> LinearProblem:
    x = tensor_arg(x, "x")
    weight = tensor_arg(weight, "weight")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x.dtype={x.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension [..., K], got a scalar")
    same_kind(weight, "weight", x)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x.shape[-1]={x.shape[-1]} does not match weight.shape[1]={k}")
    align = align_elems(x.dtype)
    if k == 0 or k % align:
        raise ValueError(f"K=x.shape[-1]={k} must be a positive multiple of {align} for {x.dtype}")
    if n == 0 or n % align:
        raise ValueError(f"N=weight.shape[0]={n} must be a positive multiple of {align} for {x.dtype}")
    out_shape = tuple(x.shape[:-1]) + (n,)

    x2d, ldx = _rows(x, "x")
    _check_aligned(x, "x", ldx, align)
    if weight.stride(1) != 1 or weight.stride(0) < k:
        raise ValueError(f"weight must be row-major with unit column stride, got strides {weight.stride()}")
    ldw = weight.stride(0)
    _check_aligned(weight, "weight", ldw, align)

    if bias is not None:
        bias = tensor_arg(bias, "bias")
        same_kind(bias, "bias", x)
        if bias.shape != (n,):
            raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
        if bias.stride(0) != 1:
            raise ValueError(f"bias must be contiguous, got stride {bias.stride()}")
        _check_aligned(bias, "bias", n, align)

    if activation != "none" and residual is not None:
        raise ValueError(
            f"activation={activation!r} cannot be combined with residual: where the library adds "
            "beta*C relative to the activation is not specified; apply the residual separately"
        )
    residual2d, ldr = None, 0
    if residual is not None:
        residual = tensor_arg(residual, "residual")
        same_kind(residual, "residual", x)
        if tuple(residual.shape) != out_shape:
            raise ValueError(f"residual must have shape {out_shape}, got {tuple(residual.shape)}")
        residual2d, ldr = _rows(residual, "residual")
        _check_aligned(residual, "residual", ldr, align)
    elif beta != 1.0:
        raise ValueError(f"beta={beta} has no effect without a residual")

    ldo = n
    if out is not None:
        out = tensor_arg(out, "out")
        same_kind(out, "out", x)
        if tuple(out.shape) != out_shape:
            raise ValueError(f"out must have shape {out_shape}, got {tuple(out.shape)}")
        _, ldo = _rows(out, "out")
        _check_aligned(out, "out", ldo, align)
        if not _is_fake(out):
            for other, name in ((x, "x"), (weight, "weight"), (bias, "bias")):
                if other is not None and _overlaps(out, other):
                    raise ValueError(f"out overlaps {name}: the GEMM cannot write over its own inputs")
            if residual is not None and _overlaps(out, residual):
                same = out.data_ptr() == residual.data_ptr() and out.stride() == residual.stride()
                if not same:
                    raise ValueError("out partially overlaps residual; it may only be the very same tensor")
    return LinearProblem(x2d.shape[0], n, k, x2d, ldx, ldw, residual2d, ldr, ldo, out_shape)


# ------------------------------------------------------------ layer_norm ----

#: Longest row the fused LayerNorm kernel holds in registers (csrc/kernels/layer_norm.h).
LAYER_NORM_MAX_DIM = 16384


class LayerNormProblem(NamedTuple):
    rows: int  # T
    cols: int  # D
    x2d: torch.Tensor  # [T, D] view of x
    ldx: int
    ldr: int  # row stride of residual (0 without one)
    ldo: int  # row stride of out (D when the op allocates it)
    lds: int  # row stride of sum_out (0 without one)
    out_shape: tuple[int, ...]


def _real_memory(t: torch.Tensor) -> bool:
    """Whether ``t`` has real storage whose addresses can be compared."""
    return t.device.type != "meta" and not _is_fake(t)


def _check_vector(t: object, name: str, x: torch.Tensor, d: int, align: int) -> torch.Tensor | None:
    """A per-column ``[D]`` parameter (weight, bias, x_bias): contiguous and aligned, or None."""
    if t is None:
        return None
    t = tensor_arg(t, name)
    same_kind(t, name, x)
    if tuple(t.shape) != (d,):
        raise ValueError(f"{name} must have shape ({d},), got {tuple(t.shape)}")
    if t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride()}")
    _check_aligned(t, name, d, align)
    return t


def _check_like_x(t: object, name: str, x: torch.Tensor, align: int) -> tuple[torch.Tensor, int]:
    """A ``[..., D]`` operand with x's shape, dtype and device; returns it and its row stride."""
    t = tensor_arg(t, name)
    same_kind(t, name, x)
    if tuple(t.shape) != tuple(x.shape):
        raise ValueError(f"{name} must have shape {tuple(x.shape)} like x, got {tuple(t.shape)}")
    _, ld = _rows(t, name)
    _check_aligned(t, name, ld, align)
    return t, ld


def check_layer_norm(
    x: object,
    weight: object,
    bias: object,
    eps: float,
    residual: object,
    alpha: float,
    x_bias: object,
    out: object,
    sum_out: object,
) -> LayerNormProblem:
    """Validate ``layer_norm``'s arguments (eps and alpha already through ``check_scalar``)."""
    x = tensor_arg(x, "x")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x.dtype={x.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension [..., D], got a scalar")
    d = x.shape[-1]
    align = align_elems(x.dtype)
    if d == 0 or d % align or d > LAYER_NORM_MAX_DIM:
        raise ValueError(
            f"D=x.shape[-1]={d} must be a positive multiple of {align} for {x.dtype}, "
            f"at most {LAYER_NORM_MAX_DIM}"
        )
    if eps < 0:
        raise ValueError(f"eps={eps} must be >= 0")
    x2d, ldx = _rows(x, "x")
    _check_aligned(x, "x", ldx, align)

    vectors = {
        "weight": _check_vector(weight, "weight", x, d, align),
        "bias": _check_vector(bias, "bias", x, d, align),
        "x_bias": _check_vector(x_bias, "x_bias", x, d, align),
    }
    ldr = 0
    if residual is not None:
        residual, ldr = _check_like_x(residual, "residual", x, align)
    ldo = d
    if out is not None:
        out, ldo = _check_like_x(out, "out", x, align)
    lds = 0
    if sum_out is not None:
        sum_out, lds = _check_like_x(sum_out, "sum_out", x, align)

    # Each thread reads its own elements before writing them, but threads do
    # not wait for one another: outputs must not overlap inputs (or each
    # other), except sum_out being residual itself (an in-place residual stream).
    # Byte ranges come from the row strides already known (cheaper than _span).
    rows = x2d.shape[0]
    if rows and (
        (out is not None and _real_memory(out)) or (sum_out is not None and _real_memory(sum_out))
    ):
        es = x.element_size()

        def rows_span(t: torch.Tensor, n: int, ld: int) -> tuple[int, int]:
            start = t.data_ptr()
            return start, start + ((n - 1) * ld + d) * es

        inputs = {"x": rows_span(x, rows, ldx)}
        if residual is not None:
            inputs["residual"] = rows_span(residual, rows, ldr)
        for name, t in vectors.items():
            if t is not None:
                inputs[name] = rows_span(t, 1, d)
        out_span = None
        if out is not None:
            out_span = rows_span(out, rows, ldo)
            for name, (a0, a1) in inputs.items():
                if a0 < out_span[1] and out_span[0] < a1:
                    raise ValueError(f"out overlaps {name}: it must be a separate buffer")
        if sum_out is not None:
            s0, s1 = rows_span(sum_out, rows, lds)
            if out_span is not None and out_span[0] < s1 and s0 < out_span[1]:
                raise ValueError("sum_out overlaps out")
            for name, (a0, a1) in inputs.items():
                if not (a0 < s1 and s0 < a1):
                    continue
                if name == "residual":
                    if s0 == a0 and lds == ldr and sum_out.stride() == residual.stride():
                        continue
                    raise ValueError("sum_out partially overlaps residual; it may only be the very same tensor")
                raise ValueError(f"sum_out overlaps {name}: it must be a separate buffer or residual itself")
    return LayerNormProblem(x2d.shape[0], d, x2d, ldx, ldr, ldo, lds, tuple(x.shape))


# ------------------------------------------------------------ encoder blocks ----


def check_block_call(params, heads: int, x2: torch.Tensor, batch: int, seq: int, attn_bias, key_padding_mask) -> None:
    """An EncoderBlock call's block-level rules with block-level messages: ``params`` its
    ``(name, tensor)`` pairs (``qkv_weight`` first), ``x2`` its ``[T, D]`` rows."""
    ref = params[0][1]
    if x2.dtype != ref.dtype:
        raise TypeError(f"x.dtype={x2.dtype} does not match the block's dtype {ref.dtype}")
    if x2.device != ref.device:
        raise ValueError(f"x is on {x2.device} but the block's parameters are on {ref.device}")
    for name, p in params:
        if p.dtype != ref.dtype or p.device != ref.device:
            raise TypeError(f"parameter {name} is {p.dtype} on {p.device}; qkv_weight is {ref.dtype} on {ref.device}")
        if not p.is_contiguous():
            raise ValueError(f"parameter {name} must be contiguous")
    h = heads
    if attn_bias is not None:
        if not isinstance(attn_bias, torch.Tensor):
            raise TypeError(f"attn_bias must be a torch.Tensor or None, got {type(attn_bias).__name__}")
        if attn_bias.dim() != 4 or attn_bias.shape[0] not in (1, batch) or tuple(attn_bias.shape[1:]) != (h, seq, seq):
            raise ValueError(
                f"attn_bias must have shape ({batch} or 1, {h}, {seq}, {seq}) [B or 1, H, S, S], "
                f"got {tuple(attn_bias.shape)}"
            )
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor):
            raise TypeError(f"key_padding_mask must be a torch.Tensor or None, got {type(key_padding_mask).__name__}")
        if tuple(key_padding_mask.shape) != (batch, seq):
            raise ValueError(
                f"key_padding_mask must have shape ({batch}, {seq}) [B, S], got {tuple(key_padding_mask.shape)}"
            )
        if key_padding_mask.dtype != torch.bool:
            raise TypeError(f"key_padding_mask must be bool (True = padding), got {key_padding_mask.dtype}")


def check_block_operands(params, d_model: int, d_ff: int, x2: torch.Tensor) -> None:
    """What the native core assumes of an EncoderBlock's operands (the ops' rules, checked once
    per call signature): ``params`` its ``(name, tensor or None)`` pairs, ``x2`` its rows."""
    if d_model > LAYER_NORM_MAX_DIM:
        raise ValueError(f"d_model={d_model} exceeds the fused LayerNorm's limit of {LAYER_NORM_MAX_DIM}")
    if x2.data_ptr() % ALIGN_BYTES:
        raise ValueError(f"x data pointer is not {ALIGN_BYTES}-byte aligned (storage offset {x2.storage_offset()})")
    d, f = d_model, d_ff
    shapes = {
        "qkv_weight": (3 * d, d), "qkv_bias": (3 * d,), "out_weight": (d, d), "out_bias": (d,),
        "norm1_weight": (d,), "norm1_bias": (d,), "ffn1_weight": (f, d), "ffn1_bias": (f,),
        "ffn2_weight": (d, f), "ffn2_bias": (d,), "norm2_weight": (d,), "norm2_bias": (d,),
    }  # fmt: skip
    for name, p in params:
        if p is None:
            continue
        if tuple(p.shape) != shapes[name]:
            raise ValueError(f"parameter {name} has shape {tuple(p.shape)}, expected {shapes[name]}")
        if p.data_ptr() % ALIGN_BYTES:
            raise ValueError(f"parameter {name} data pointer is not {ALIGN_BYTES}-byte aligned")
