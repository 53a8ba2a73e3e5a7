"""FP8 (float8 e4m3) quantization: the reference math of fusedenc's FP8 mode (issue 21).

The scheme is the one the issue names: weights in e4m3 with one fp32 scale per output
channel, activations in e4m3 with one fp32 scale per row, products accumulated in fp32
and the GEMM's output in fp16/bf16.  A scale maps the row's (or channel's) largest
magnitude onto e4m3's largest finite value, 448, so nothing saturates:

    scale = amax(|row|) / 448,   q = e4m3(row / scale),   row ~= q * scale

``scaled_linear`` is what an FP8 GEMM with row and column scales computes (cuBLASLt's
outer-vector scaling, ``torch._scaled_mm`` with row-wise scales): ``(qx qw^T) * sx[m] *
sw[n] + bias``.  The kernels of the FP8 mode will be held to these functions; until they
exist, ``bench/fp8_accuracy.py`` uses them to measure what FP8 costs in accuracy.

A row of zeros gets scale 1 (its codes are zeros).  NaN anywhere in a row makes its
scale NaN, so the whole row comes back NaN: FP8 has no room to carry one bad value
quietly.  +-inf in a row likewise (inf / inf).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

__all__ = ["E4M3", "E4M3_MAX", "Quantized", "dequantize", "quantize_rows", "scaled_linear"]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(E4M3).max


class Quantized(NamedTuple):
    """``q`` (``[rows, k]`` e4m3) and ``scale`` (``[rows]`` fp32): row ``i`` is ``q[i] * scale[i]``."""

    q: torch.Tensor
    scale: torch.Tensor


def quantize_rows(x: torch.Tensor) -> Quantized:
    """``x`` (``[rows, k]``, floating) in e4m3 with one scale per row.  For a weight
    ``[out, in]`` that is one scale per output channel."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 2:
        raise TypeError(f"x must be a 2-D floating tensor, got {getattr(x, 'dtype', type(x))} of shape {getattr(x, 'shape', '?')}")
    xf = x.float()
    amax = xf.abs().amax(dim=1) if x.shape[1] else xf.new_zeros(x.shape[0])  # NaN/inf propagate
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / E4M3_MAX)
    return Quantized((xf / scale[:, None]).to(E4M3), scale)


def dequantize(t: Quantized) -> torch.Tensor:
    """The fp32 values ``t`` stands for."""
    return t.q.float() * t.scale[:, None]


def scaled_linear(
    x: Quantized, w: Quantized, bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.float16
) -> torch.Tensor:
    """``x W^T + bias`` from e4m3 operands: fp32 products and sums of the codes, then the row
    and column scales and the bias in fp32, rounded once to ``out_dtype``."""
    if x.q.shape[1] != w.q.shape[1]:
        raise ValueError(f"x has {x.q.shape[1]} columns but the weight {w.q.shape[1]}")
    acc = x.q.float() @ w.q.float().t()
    y = acc * x.scale[:, None] * w.scale[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)
