"""``attention()`` and ``explain()``, and the custom op ``torch.ops.fusedenc.attention``.

In eager mode ``attention`` plans and launches directly (``plans.run``); while
``torch.compile`` traces it goes through the custom op, whose fake
implementation validates the arguments and gives the output's shape.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import plans
from .backends import BACKENDS
from .call import describe_call, validate
from .plans import Explanation

__all__ = ["attention", "explain"]


@torch.library.custom_op("fusedenc::attention", mutates_args=())
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_bias: Optional[torch.Tensor],
    key_padding_mask: Optional[torch.Tensor],
    scale: Optional[float],
    backend: Optional[str],
) -> torch.Tensor:
    return plans.run(q, k, v, attn_bias, key_padding_mask, scale, backend)


@_attention_op.register_fake
def _attention_fake(q, k, v, attn_bias, key_padding_mask, scale, backend):
    validate(q, k, v, attn_bias, key_padding_mask, scale, backend, BACKENDS)
    b, s, h, d = q.shape
    return q.new_empty((b * s, h * d))


# ------------------------------------------------------------ public ----


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_bias: Optional[torch.Tensor] = None,
    key_padding_mask: Optional[torch.Tensor] = None,
    *,
    scale: Optional[float] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """``softmax(q k^T * scale + attn_bias + mask) v`` for self-attention, as ``[B*S, H*Dh]`` rows.

    q, k, v: ``[B, S, H, Dh]`` with unit last stride, same dtype (float16,
    bfloat16, float32) and device; typically the views ``fused_qkv`` returns.
    attn_bias: optional additive ``[B or 1, H, S, S]`` in q's dtype or float32
    (float32 costs one cast per call on the fused backends).
    key_padding_mask: optional bool ``[B, S]``, True = that key is padding.
    Query rows with every key masked come out as zeros.
    scale: defaults to ``1/sqrt(Dh)``.  backend: force one of ``BACKENDS``
    (``ValueError`` if it cannot serve the call).

    The result is in ``(B, S, H, Dh)`` row-major order, what the output
    projection reads; for sdpa_flash, sdpa_efficient, sdpa_cudnn, flash_attn
    and triton_short it is a view of the kernel's output (no copy).  Works
    eagerly, in CUDA-graph capture and under ``torch.compile(fullgraph=True)``
    (as the custom op ``torch.ops.fusedenc.attention``).  Inference only: no
    autograd.
    """
    if torch.compiler.is_compiling():
        return torch.ops.fusedenc.attention(q, k, v, attn_bias, key_padding_mask, scale, backend)
    return plans.run(q, k, v, attn_bias, key_padding_mask, scale, backend)


def explain(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_bias: Optional[torch.Tensor] = None,
    key_padding_mask: Optional[torch.Tensor] = None,
    *,
    scale: Optional[float] = None,
    backend: Optional[str] = None,
) -> Explanation:
    """Which backend ``attention`` would run for these arguments, and why (launches nothing).

    Raises what ``attention`` would raise for invalid arguments or an
    unusable forced backend.  ``str()`` of the result is a readable report.
    """
    validate(q, k, v, attn_bias, key_padding_mask, scale, backend, BACKENDS)
    return plans.decide(describe_call(q, k, v, attn_bias, key_padding_mask), backend)
