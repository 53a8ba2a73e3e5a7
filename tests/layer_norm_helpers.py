"""LayerNorm formulas for the tests: the math written out, and plain PyTorch in the op's dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ln_formula(x, weight, bias, eps, residual=None, alpha=1.0, x_bias=None, dtype=torch.float64):
    """``layer_norm``'s math written out in ``dtype``: returns (out, h).

    h = alpha * (x + x_bias) + residual; mean and biased variance by hand
    (two passes), no F.layer_norm involved.
    """
    h = x.to(dtype)
    if x_bias is not None:
        h = h + x_bias.to(dtype)
    h = h * alpha
    if residual is not None:
        h = h + residual.to(dtype)
    d = h.shape[-1]
    mean = h.sum(-1, keepdim=True) / d
    centered = h - mean
    var = (centered * centered).sum(-1, keepdim=True) / d
    y = centered / torch.sqrt(var + eps)
    if weight is not None:
        y = y * weight.to(dtype)
    if bias is not None:
        y = y + bias.to(dtype)
    return y, h


def ln_same_dtype(x, weight, bias, eps, residual=None, alpha=1.0, x_bias=None):
    """What plain PyTorch computes in the op's dtype: each step rounded, then F.layer_norm.

    Returns (out, h) with h = residual + alpha * (x + x_bias) in x.dtype.
    """
    h = x if x_bias is None else x + x_bias
    if alpha != 1.0:
        h = alpha * h
    if residual is not None:
        h = residual + h
    return F.layer_norm(h, (h.shape[-1],), weight, bias, eps), h


def assert_rounded_once(out, exact, dtype, what=""):
    """Each element of ``out`` within one unit in the last place (of ``dtype``) of ``exact``.

    What fp32 math rounded once to fp16/bf16 achieves (half an ulp of rounding
    plus fp32 error far below it); rounding an intermediate such as h to the
    dtype costs several ulps on rows with a mean offset, which the tolerance
    rule alone cannot see (plain torch rounds h too).  The 1e-5 absolute floor
    covers fp32's own error near zero.
    """
    assert dtype in (torch.float16, torch.bfloat16), "only meaningful for 16-bit outputs"
    out64, exact64 = out.detach().double().cpu(), exact.detach().double().cpu()
    assert torch.equal(out64.isnan(), exact64.isnan()), f"{what}: NaN mismatch"
    finite = ~exact64.isnan()
    err = (out64 - exact64).abs()[finite]
    bound = torch.finfo(dtype).eps * exact64.abs()[finite] + 1e-5
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (
        f"{what}: |out - exact| = {err[worst].item():.3g} > 1 ulp bound {bound[worst].item():.3g} "
        f"at exact value {exact64[finite][worst].item():.6g}"
    )
