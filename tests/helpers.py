"""Test helpers: random inputs, poisoned outputs and the tolerance rule.

The rule (docs/ARCHITECTURE.md, from flash-attention's tests): with ``ref`` computed in
higher precision (fp32 for fp16/bf16, fp64 for fp32) and ``same`` the plain
PyTorch computation in the op's own dtype,

    max|out - ref| <= 2 * max|same - ref| + atol

NaN in ``ref`` must be NaN in ``out`` at the same place; NaN anywhere else fails.
"""

from __future__ import annotations

import math

import torch

from fusedenc.common.activations import apply_activation
from fusedenc.common.dtypes import ATOL  # noqa: F401 - the rule's atol, re-exported for the tests


def ref_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float32 else torch.float32


def randn(shape, dtype, device="cpu", gen=None, scale=1.0) -> torch.Tensor:
    """Fresh N(0, scale^2) values: never zeros, drawn on the CPU for reproducibility."""
    t = torch.randn(shape, generator=gen, dtype=torch.float32) * scale
    return t.to(dtype=dtype, device=device)


def poisoned(shape, dtype, device) -> torch.Tensor:
    """An output buffer full of NaN: any element the op fails to write shows."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def whole_range_inputs(dtype, gen, device, rows=16384, k=256) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [rows, k]`` holding every value of ``dtype`` in [-40, 40] on a 2^-6 grid (each exact
    in fp16 and bf16) and N(0, 8^2) draws, shuffled, and the identity ``w [k, k]``: through
    ``x @ w^T`` an epilogue's accumulator is exactly each input."""
    grid = torch.arange(-40.0, 40.0, 2.0**-6, dtype=torch.float64)
    values = torch.cat([grid, randn((rows * k - grid.numel(),), torch.float32, gen=gen, scale=8.0).double()])
    x = values[torch.randperm(values.numel(), generator=gen)].view(rows, k).to(device, dtype)
    return x, torch.eye(k, k, dtype=dtype, device=device)


def gelu_fp64(x: torch.Tensor, act: str) -> torch.Tensor:
    """Exact GELU or tanh-GELU of fp64 ``x`` without the cancellation of torch's ``1 + erf`` /
    ``1 + tanh`` forms in the negative tail (where bf16 still holds values down to 1e-40)."""
    if act == "gelu":
        return 0.5 * x * torch.special.erfc(-x / math.sqrt(2.0))
    return x * torch.sigmoid(2.0 * math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3))


def assert_within_output_rounding(out, x, ref, dtype, what) -> None:
    """Each output within half an ulp of the output (``dtype``) plus 1e-5 relative of the fp64
    ``ref``, and within the smallest subnormal near zero; finite where ``x`` is."""
    half_ulp = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[dtype]
    tiny = {torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133}[dtype]
    bound = ref.abs() * (half_ulp + 1e-5) + tiny
    err = (out.double() - ref).abs()
    worst = (err - bound).argmax()
    assert bool(torch.isfinite(out).all()), f"{what}: non-finite output for finite input"
    assert bool((err <= bound).all()), (
        f"{what} {dtype}: at x={x.flatten()[worst].item()!r} got {out.flatten()[worst].item()!r}, "
        f"want {ref.flatten()[worst].item()!r} (error {err.flatten()[worst].item():.3g} > {bound.flatten()[worst].item():.3g})"
    )


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


def attention_formula(q, k, v, bias=None, mask=None, *, dtype, scale=None):
    """Self-attention written out in ``dtype``: softmax(q k^T * scale + bias, keys where ``mask``
    is True at -inf) v, with q, k, v ``[B, S, H, Dh]`` (scale defaults to 1/sqrt(Dh)).  A query row
    whose keys are all -inf gives zeros (fusedenc's convention).  Returns ``[B*S, H*Dh]`` rows in
    (B, S, H, Dh) order, what ``fusedenc.attention.attention`` returns."""
    b, s, h, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qh, kh, vh = (t.to(dtype).permute(0, 2, 1, 3) for t in (q, k, v))  # [B, H, S, Dh]
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias.to(dtype)
    if mask is not None:
        scores = scores.masked_fill(mask[:, None, None, :], float("-inf"))
    dead = torch.isneginf(scores).all(dim=-1, keepdim=True)
    p = torch.softmax(scores, dim=-1).masked_fill(dead, 0.0)
    return torch.matmul(p, vh).permute(0, 2, 1, 3).reshape(b * s, h * d)


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


def random_game(rng, plies: int, start: str = "startpos") -> list:
    """The ``Position``s of one random legal game from ``start`` (fusedenc's own move
    generator), history and all: ``plies`` moves, fewer where the game ends."""
    from fusedenc.lc0 import Position

    p = Position.from_fen(start)
    out = [p]
    for _ in range(plies):
        moves = p.legal_moves()
        if not moves:
            break
        p = p.push(rng.choice(moves))
        out.append(p)
    return out
