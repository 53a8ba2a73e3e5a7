"""Test helpers: random inputs, poisoned outputs and the tolerance rule.

The rule (DESIGN.md, from flash-attention's tests): with ``ref`` computed in
higher precision (fp32 for fp16/bf16, fp64 for fp32) and ``same`` the plain
PyTorch computation in the op's own dtype,

    max|out - ref| <= 2 * max|same - ref| + atol

NaN in ``ref`` must be NaN in ``out`` at the same place; NaN anywhere else fails.
"""

from __future__ import annotations

import torch

from fusedenc.activations import apply_activation

ATOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-5}


def ref_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float32 else torch.float32


def randn(shape, dtype, device="cpu", gen=None, scale=1.0) -> torch.Tensor:
    """Fresh N(0, scale^2) values: never zeros, drawn on the CPU for reproducibility."""
    t = torch.randn(shape, generator=gen, dtype=torch.float32) * scale
    return t.to(dtype=dtype, device=device)


def poisoned(shape, dtype, device) -> torch.Tensor:
    """An output buffer full of NaN: any element the op fails to write shows."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def linear_formula(x, w, b=None, activation="none", residual=None, beta=1.0, alpha=1.0, dtype=None):
    """linear's math written out, in ``dtype`` (default: the inputs' own dtype)."""
    dtype = dtype or x.dtype
    y = torch.matmul(x.to(dtype), w.to(dtype).t())
    if alpha != 1.0:
        y = y * alpha
    if b is not None:
        y = y + b.to(dtype)
    if residual is not None:
        return y + beta * residual.to(dtype)
    return apply_activation(y, activation)


def same_dtype_torch(x, w, b=None, activation="none", residual=None, beta=1.0, alpha=1.0):
    """What plain PyTorch computes in the op's dtype: F.linear, then each step rounded."""
    y = torch.nn.functional.linear(x, w, b) if alpha == 1.0 else torch.nn.functional.linear(x, w) * alpha + (
        b if b is not None else 0
    )
    if residual is not None:
        return y + beta * residual
    return apply_activation(y, activation)


def assert_close_rule(out, ref, same, dtype, what="", atol=None):
    """Assert the tolerance rule; ``ref`` in higher precision, ``same`` in ``dtype``."""
    atol = ATOL[dtype] if atol is None else atol
    out64, ref64, same64 = (t.detach().double().cpu() for t in (out, ref, same))
    assert out64.shape == ref64.shape, f"{what}: shape {tuple(out64.shape)} != {tuple(ref64.shape)}"
    ref_nan = torch.isnan(ref64)
    out_nan = torch.isnan(out64)
    assert torch.equal(ref_nan, out_nan), (
        f"{what}: NaN mismatch ({int(out_nan.sum())} NaN in output, {int(ref_nan.sum())} in reference)"
    )
    finite = ~ref_nan
    if not bool(finite.any()):
        return
    err = (out64 - ref64).abs()[finite]
    base = (same64 - ref64).abs()[finite]
    # inf == inf gives nan differences; those must match exactly.
    inf_ok = torch.equal(torch.isinf(out64[finite]), torch.isinf(ref64[finite]))
    assert inf_ok, f"{what}: inf mismatch"
    err = torch.nan_to_num(err, nan=0.0)
    base = torch.nan_to_num(base, nan=0.0)
    bound = 2 * base.max().item() + atol
    worst = err.max().item()
    assert worst <= bound, (
        f"{what}: max|out-ref|={worst:.3g} > 2*max|torch-ref| + atol = {bound:.3g} "
        f"(torch {dtype} error {base.max().item():.3g}, atol {atol})"
    )
