"""Fused residual + scale + bias + LayerNorm, and its PyTorch reference.

One kernel does what a post-LN block spends three to five passes over memory
on: ``LayerNorm(residual + alpha * (x + x_bias))``.  ``sum_out`` also writes
the pre-norm sum, the residual stream that pre-LN blocks carry forward.

Like the ops in ``fusedenc.ops.gemm``, ``layer_norm`` is a torch custom op
(``torch.ops.fusedenc.layer_norm`` and ``layer_norm_out``) with fake
implementations, called directly in eager mode and through the dispatcher
while ``torch.compile`` traces.  CPU tensors, and GPU tensors without an
active native core, run ``reference_layer_norm``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .. import core
from ..common import checks
from ..common.device import current_stream

__all__ = ["layer_norm", "reference_layer_norm"]


def reference_layer_norm(
    x: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
    *,
    residual: Optional[torch.Tensor] = None,
    alpha: float = 1.0,
    x_bias: Optional[torch.Tensor] = None,
    return_sum: bool = False,
):
    """``layer_norm``'s math in fp32, each result rounded once to ``x.dtype``.

    ``h = alpha * (x + x_bias) + residual`` is formed in fp32 and normalized in
    fp32 (``F.layer_norm``); returns the normalized output, or ``(out, h)``
    with ``h`` rounded to ``x.dtype`` when ``return_sum`` is true.
    """
    h = x.float()
    if x_bias is not None:
        h = h + x_bias.float()
    if alpha != 1.0:
        h = h * alpha
    if residual is not None:
        h = h + residual.float()
    w = None if weight is None else weight.float()
    b = None if bias is None else bias.float()
    out = F.layer_norm(h, (x.shape[-1],), w, b, eps).to(x.dtype)
    if return_sum:
        return out, h.to(x.dtype)
    return out


def _check(x, weight, bias, eps, residual, alpha, x_bias, out, sum_out):
    """Every argument rule (the eager op and both fake implementations): (eps, alpha, problem)."""
    eps = checks.check_scalar(eps, "eps")
    alpha = checks.check_scalar(alpha, "alpha")
    return eps, alpha, checks.check_layer_norm(x, weight, bias, eps, residual, alpha, x_bias, out, sum_out)


def _layer_norm(x, weight, bias, eps, residual, alpha, x_bias, out, sum_out):
    eps, alpha, p = _check(x, weight, bias, eps, residual, alpha, x_bias, out, sum_out)

    if core.active_on(x.device):
        if out is None:
            out = torch.empty(p.out_shape, dtype=x.dtype, device=x.device)
        if p.rows == 0:
            return out
        core.layer_norm(
            x=p.x2d, ldx=p.ldx, rows=p.rows, cols=p.cols, out=out, ldo=p.ldo, weight=weight, bias=bias,
            residual=residual, ldr=p.ldr, x_bias=x_bias, sum_out=sum_out, lds=p.lds, eps=eps, alpha=alpha,
            stream=current_stream(x.device),
        )  # fmt: skip
        return out

    # Both results are computed before either is written: sum_out may be residual.
    with torch.no_grad():  # inference only, on every backend: no output carries autograd
        result, h = reference_layer_norm(
            x, weight, bias, eps, residual=residual, alpha=alpha, x_bias=x_bias, return_sum=True
        )
    if sum_out is not None:
        sum_out.copy_(h)
    if out is None:
        out = torch.empty(p.out_shape, dtype=x.dtype, device=x.device)
    out.copy_(result)
    return out


# ------------------------------------------------------------ custom ops ----


@torch.library.custom_op("fusedenc::layer_norm", mutates_args=())
def _layer_norm_op(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float,
    residual: Optional[torch.Tensor],
    alpha: float,
    x_bias: Optional[torch.Tensor],
) -> torch.Tensor:
    return _layer_norm(x, weight, bias, eps, residual, alpha, x_bias, None, None)


@_layer_norm_op.register_fake
def _layer_norm_fake(x, weight, bias, eps, residual, alpha, x_bias):
    return x.new_empty(_check(x, weight, bias, eps, residual, alpha, x_bias, None, None)[2].out_shape)


@torch.library.custom_op("fusedenc::layer_norm_out", mutates_args=("out", "sum_out"))
def _layer_norm_out_op(
    out: torch.Tensor,
    sum_out: Optional[torch.Tensor],
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float,
    residual: Optional[torch.Tensor],
    alpha: float,
    x_bias: Optional[torch.Tensor],
) -> None:
    _layer_norm(x, weight, bias, eps, residual, alpha, x_bias, out, sum_out)


@_layer_norm_out_op.register_fake
def _layer_norm_out_fake(out, sum_out, x, weight, bias, eps, residual, alpha, x_bias):
    _check(x, weight, bias, eps, residual, alpha, x_bias, out, sum_out)


# ------------------------------------------------------------- public op ----


def layer_norm(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float = 1e-5,
    *,
    residual: Optional[torch.Tensor] = None,
    alpha: float = 1.0,
    x_bias: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    sum_out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``LayerNorm(alpha * (x + x_bias) + residual) * weight + bias`` over the last dim, in one pass.

    ``h = alpha * (x + x_bias) + residual`` is formed in fp32 (x_bias and
    residual default to 0), and the mean and biased variance of each row are
    taken from that fp32 ``h`` (two passes over values held in registers, not
    ``E[h^2] - E[h]^2``); ``out = (h - mean) / sqrt(var + eps) * weight + bias``
    is rounded once to the dtype.  ``h`` itself is never rounded before the
    statistics: if ``sum_out`` is given, it receives ``h`` rounded to the dtype
    (the residual stream of a pre-LN block), and may be ``residual`` itself
    (updated in place).

    x, residual, out, sum_out: ``[..., D]``, the same shape, dtype (float16,
    bfloat16 or float32) and device, unit stride in the last dim and rows
    viewable as ``[T, D]`` with one row stride (a column slice of a wider buffer
    is fine).  weight, bias (None: 1 and 0, no affine) and x_bias: contiguous
    ``[D]``.  D must be a multiple of 16 bytes (8 halves, 4 floats), at most
    16384; data pointers 16-byte aligned, row strides multiples of 16 bytes.
    eps >= 0 and alpha finite.  out and sum_out must not overlap any input or
    each other (sum_out == residual excepted).  An empty batch returns an
    empty result.  Bad input raises TypeError or ValueError before any launch.
    Inference only: no autograd.
    """
    if torch.compiler.is_compiling():
        if out is None and sum_out is None:
            return torch.ops.fusedenc.layer_norm(x, weight, bias, eps, residual, alpha, x_bias)
        if out is None:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        torch.ops.fusedenc.layer_norm_out(out, sum_out, x, weight, bias, eps, residual, alpha, x_bias)
        return out
    return _layer_norm(x, weight, bias, eps, residual, alpha, x_bias, out, sum_out)
