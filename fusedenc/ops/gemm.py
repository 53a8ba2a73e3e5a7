"""Public fused ops and their PyTorch references.

``linear`` is one BLASLt call for ``act(alpha * x @ W^T + b)`` or
``alpha * x @ W^T + b + beta * residual``; ``fused_qkv`` is one such GEMM on a
concatenated ``[3D, D]`` weight, returning q, k, v as zero-copy views.

Each op is registered as a torch custom op (``torch.ops.fusedenc.*``) with a
fake implementation, so it traces under ``torch.compile(fullgraph=True)``.  In
eager mode the public functions call the implementation directly, skipping the
dispatcher: that is what keeps the host cost per call low.

Each op has a reference (``reference_linear``) with the same math in fp32; it
serves CPU tensors and GPU tensors without a native core, and is the oracle of
the tests.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import core
from ..common import checks
from ..common.activations import ACTIVATIONS, apply_activation, canonical_activation
from ..common.device import current_stream
from ..core import FallbackWarning

__all__ = [
    "ACTIVATIONS",
    "FallbackWarning",
    "fused_qkv",
    "linear",
    "pack_qkv",
    "reference_linear",
    "split_qkv",
]


def reference_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: str = "none",
    residual: Optional[torch.Tensor] = None,
    beta: float = 1.0,
    *,
    alpha: float = 1.0,
) -> torch.Tensor:
    """``linear``'s math in fp32, rounded once to x.dtype (like an fp32-accumulating GEMM epilogue)."""
    y = torch.matmul(x.float(), weight.float().t())
    if alpha != 1.0:
        y = y * alpha
    if bias is not None:
        y = y + bias.float()
    if residual is not None:
        y = y + beta * residual.float()
    else:
        y = apply_activation(y, activation)
    return y.to(x.dtype)


def _linear(x, weight, bias, activation, residual, alpha, beta, out):
    activation = canonical_activation(activation)
    alpha = checks.check_scalar(alpha, "alpha")
    beta = checks.check_scalar(beta, "beta")
    p = checks.check_linear(x, weight, bias, activation, residual, alpha, beta, out)

    if core.active_on(x.device):
        if out is None:
            out = torch.empty(p.out_shape, dtype=x.dtype, device=x.device)
        if p.m == 0:
            return out
        stream = current_stream(x.device)
        core.gemm(
            a=p.x2d, lda=p.ldx, w=weight, ldw=p.ldw, out=out, ldo=p.ldo, m=p.m, n=p.n, k=p.k,
            bias=bias, residual=p.residual2d, ldr=p.ldr, activation=activation, alpha=alpha, beta=beta,
            stream=stream, workspace=core.workspace(x.device, stream),
        )  # fmt: skip
        return out

    with torch.no_grad():  # inference only, on every backend: no output carries autograd
        result = reference_linear(x, weight, bias, activation, residual, beta, alpha=alpha)
    if out is None:
        return result
    out.copy_(result)
    return out


# ------------------------------------------------------------ custom ops ----


@torch.library.custom_op("fusedenc::linear", mutates_args=())
def _linear_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    activation: str,
    residual: Optional[torch.Tensor],
    alpha: float,
    beta: float,
) -> torch.Tensor:
    return _linear(x, weight, bias, activation, residual, alpha, beta, None)


@_linear_op.register_fake
def _linear_fake(x, weight, bias, activation, residual, alpha, beta):
    activation = canonical_activation(activation)
    p = checks.check_linear(x, weight, bias, activation, residual, alpha, beta, None)
    return x.new_empty(p.out_shape)


@torch.library.custom_op("fusedenc::linear_out", mutates_args=("out",))
def _linear_out_op(
    out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    activation: str,
    residual: Optional[torch.Tensor],
    alpha: float,
    beta: float,
) -> None:
    _linear(x, weight, bias, activation, residual, alpha, beta, out)


@_linear_out_op.register_fake
def _linear_out_fake(out, x, weight, bias, activation, residual, alpha, beta):
    activation = canonical_activation(activation)
    checks.check_linear(x, weight, bias, activation, residual, alpha, beta, out)


# ------------------------------------------------------------ public ops ----


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: str = "none",
    residual: Optional[torch.Tensor] = None,
    beta: float = 1.0,
    *,
    alpha: float = 1.0,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``act(alpha * x @ weight.T + bias)``, or ``alpha * x @ weight.T + bias + beta * residual``.

    x: ``[..., K]``; weight: ``[N, K]`` (``nn.Linear`` layout); bias: ``[N]``;
    residual and out: ``[..., N]``.  fp16, bf16 or fp32, accumulated in fp32.
    K, N and every row stride must be multiples of 16 bytes, and data pointers
    16-byte aligned.  ``activation`` is one of ``ACTIVATIONS`` and cannot be
    combined with ``residual``.  ``out`` may be the residual itself (in place).
    An empty batch returns an empty result.  Inference only: no autograd.
    """
    if torch.compiler.is_compiling():
        if out is None:
            return torch.ops.fusedenc.linear(x, weight, bias, activation, residual, alpha, beta)
        torch.ops.fusedenc.linear_out(out, x, weight, bias, activation, residual, alpha, beta)
        return out
    return _linear(x, weight, bias, activation, residual, alpha, beta, out)


def split_qkv(qkv: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views q, k, v ``[B, S, H, Dh]`` of a packed ``[B, S, 3*D]`` buffer (no copy)."""
    b, s, three_d = qkv.shape
    d = three_d // 3
    q, k, v = qkv.view(b, s, 3, num_heads, d // num_heads).unbind(2)
    return q, k, v


def fused_qkv(
    x: torch.Tensor,
    w_qkv: torch.Tensor,
    b_qkv: Optional[torch.Tensor],
    num_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One GEMM for Q, K and V: x ``[B, S, D]`` times the packed ``[3D, D]`` weight.

    Returns q, k, v as zero-copy ``[B, S, H, D/H]`` views of one ``[B, S, 3D]``
    buffer (what a packed-QKV flash-attention call reads).  Build ``w_qkv`` and
    ``b_qkv`` with ``pack_qkv``.
    """
    x = checks.tensor_arg(x, "x")
    w_qkv = checks.tensor_arg(w_qkv, "w_qkv")
    if x.dim() != 3:
        raise ValueError(f"x must be [B, S, D], got shape {tuple(x.shape)}")
    d = x.shape[-1]
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    if d % num_heads:
        raise ValueError(f"num_heads={num_heads} does not divide D={d}")
    if w_qkv.dim() != 2 or tuple(w_qkv.shape) != (3 * d, d):
        raise ValueError(f"w_qkv must have shape ({3 * d}, {d}) for D={d}, got {tuple(w_qkv.shape)}")
    checks.same_kind(w_qkv, "w_qkv", x)
    if b_qkv is not None:
        b_qkv = checks.tensor_arg(b_qkv, "b_qkv")
        if tuple(b_qkv.shape) != (3 * d,):
            raise ValueError(f"b_qkv must have shape ({3 * d},) for D={d}, got {tuple(b_qkv.shape)}")
        checks.same_kind(b_qkv, "b_qkv", x)
    qkv = linear(x, w_qkv, b_qkv)
    return split_qkv(qkv, num_heads)


def _same_as_q(t: torch.Tensor, name: str, q_weight: torch.Tensor) -> None:
    """TypeError for a dtype other than q_weight's, ValueError for another device (the ops' rule)."""
    if t.dtype != q_weight.dtype:
        raise TypeError(f"{name} is {t.dtype} on {t.device}; q_weight is {q_weight.dtype} on {q_weight.device}")
    if t.device != q_weight.device:
        raise ValueError(f"{name} is on {t.device} but q_weight is on {q_weight.device}")


def pack_qkv(
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    v_weight: torch.Tensor,
    q_bias: Optional[torch.Tensor] = None,
    k_bias: Optional[torch.Tensor] = None,
    v_bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Concatenate separate ``[D, D]`` projections into ``w_qkv [3D, D]`` and ``b_qkv [3D]``."""
    weights = {"q_weight": q_weight, "k_weight": k_weight, "v_weight": v_weight}
    for name, w in weights.items():
        checks.tensor_arg(w, name)
        if w.dim() != 2 or w.shape[0] != w.shape[1]:
            raise ValueError(f"{name} must be square [D, D], got shape {tuple(w.shape)}")
        if w.shape != q_weight.shape:
            raise ValueError(f"{name} has shape {tuple(w.shape)}, q_weight {tuple(q_weight.shape)}")
        _same_as_q(w, name, q_weight)
    biases = {"q_bias": q_bias, "k_bias": k_bias, "v_bias": v_bias}
    given = [name for name, b in biases.items() if b is not None]
    if given and len(given) != 3:
        missing = sorted(set(biases) - set(given))
        raise ValueError(f"give all three biases or none; missing {', '.join(missing)}")
    w_qkv = torch.cat([q_weight, k_weight, v_weight], dim=0).contiguous()
    if not given:
        return w_qkv, None
    d = q_weight.shape[0]
    for name, b in biases.items():
        checks.tensor_arg(b, name)
        if tuple(b.shape) != (d,):
            raise ValueError(f"{name} must have shape ({d},), got {tuple(b.shape)}")
        _same_as_q(b, name, q_weight)
    return w_qkv, torch.cat([q_bias, k_bias, v_bias]).contiguous()
