"""What fusedenc's modules take from torch's: conversions from ``nn.TransformerEncoderLayer`` /
``nn.TransformerEncoder`` (``EncoderBlock.from_torch``, ``EncoderStack.from_torch``), and the
inference-only contract those modules keep on every device.

Inference only, one behaviour everywhere (``patch_hf``'s layers included): a fusedenc module
is made in eval mode; put in training mode (``.train()``, or its model's), calling it raises
``RuntimeError`` asking for ``.eval()``, as a patched Hugging Face layer does, rather than
silently dropping dropout; and its forward runs without autograd, so an output never carries a
``grad_fn`` (on the CPU the ops are torch ops that would otherwise record one).  ``from_torch``
refuses a layer in training mode with dropout > 0 for the same reason ``patch_hf`` refuses a
model in training mode: it would compute something else than the model did in training.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import torch
import torch.nn as nn

from . import activations, dtypes
from .device import DTYPES_ACCEPTED

__all__ = ["block_from_torch", "inference_only", "runs_eagerly_when_compiled", "stack_from_torch", "without_autograd"]

F = TypeVar("F", bound=Callable[..., Any])


def without_autograd(fn: Callable[..., Any], *args, **kwargs) -> Any:
    """``fn(*args, **kwargs)`` with autograd off: its results carry no history.  ``no_grad`` is
    entered only where grad mode is on: under ``torch.inference_mode()`` / ``no_grad``
    (engines, graph runners) the call pays one flag check, not a context switch."""
    if torch.is_grad_enabled():
        with torch.no_grad():
            return fn(*args, **kwargs)
    return fn(*args, **kwargs)


def inference_only(forward: F) -> F:
    """Wrap a module's ``forward``: refused in training mode, run without autograd
    (``without_autograd``)."""

    @functools.wraps(forward)
    def run(self, *args, **kwargs):
        if self.training:
            raise RuntimeError(
                f"{type(self).__name__} is inference-only (no dropout, no autograd) and is in training mode: "
                "call .eval() on it (or on the model holding it) before running it"
            )
        return without_autograd(forward, self, *args, **kwargs)

    return run  # type: ignore[return-value]


def _dropout(layer: nn.TransformerEncoderLayer) -> float:
    """The largest dropout probability ``layer`` applies in training mode."""
    ps = [m.p for m in layer.modules() if isinstance(m, nn.Dropout)]
    ps.append(float(getattr(layer.self_attn, "dropout", 0.0)))
    return max(ps)


def _check_layer_weights(w: torch.Tensor, name: str) -> None:
    """The layer's weights in a dtype and on a device fusedenc runs (said of the layer, which
    the caller passed, not of a ``dtype=`` it did not)."""
    if w.dtype not in dtypes.SUPPORTED:
        raise TypeError(f"{name}'s weights are {w.dtype}: fusedenc runs {DTYPES_ACCEPTED} "
                        f"(convert it first, e.g. {name}.to(torch.float32))")  # fmt: skip
    if w.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}'s weights are on {w.device}: fusedenc runs on cuda and cpu (load or move them first)")


@torch.no_grad()
def block_from_torch(cls: type, layer: nn.TransformerEncoderLayer, name: str = "layer") -> Any:
    """``EncoderBlock.from_torch``: an EncoderBlock (``cls``) computing what ``layer`` computes in
    eval mode, on its dtype and device.  What the layer is (its type, attention, activation,
    widths) is checked before what state it is in (training mode with dropout)."""
    if not isinstance(layer, nn.TransformerEncoderLayer):
        raise TypeError(f"{name} must be an nn.TransformerEncoderLayer, got {type(layer).__name__}")
    attn = layer.self_attn
    if not attn._qkv_same_embed_dim or attn.in_proj_weight is None:
        raise ValueError("self_attn with kdim/vdim != embed_dim is not supported (needs one packed QKV weight)")
    if attn.bias_k is not None or attn.add_zero_attn:
        raise ValueError("self_attn with add_bias_kv or add_zero_attn is not supported")
    w = attn.in_proj_weight
    _check_layer_weights(w, name)
    block = cls(
        attn.embed_dim,
        attn.num_heads,
        layer.linear1.out_features,
        activations.from_torch(layer.activation),
        norm_first=layer.norm_first,
        layer_norm_eps=layer.norm1.eps,
        bias=attn.in_proj_bias is not None,
        batch_first=attn.batch_first,
        dtype=w.dtype,
        device=w.device,
    )
    if layer.norm2.eps != layer.norm1.eps:
        raise ValueError(f"norm1.eps={layer.norm1.eps} and norm2.eps={layer.norm2.eps} differ")
    p = _dropout(layer)
    if layer.training and p > 0:
        raise ValueError(
            f"{name} is in training mode with dropout {p:g}: fusedenc blocks are inference-only (no dropout, "
            f"no autograd), so the block would not compute what it computes; call {name}.eval() before from_torch"
        )
    sources = {
        "qkv_weight": attn.in_proj_weight, "qkv_bias": attn.in_proj_bias,
        "out_weight": attn.out_proj.weight, "out_bias": attn.out_proj.bias,
        "norm1_weight": layer.norm1.weight, "norm1_bias": layer.norm1.bias,
        "ffn1_weight": layer.linear1.weight, "ffn1_bias": layer.linear1.bias,
        "ffn2_weight": layer.linear2.weight, "ffn2_bias": layer.linear2.bias,
        "norm2_weight": layer.norm2.weight, "norm2_bias": layer.norm2.bias,
    }  # fmt: skip
    for pname, src in sources.items():
        dst = getattr(block, pname)
        if (src is None) != (dst is None):
            raise ValueError(f"{pname}: the layer mixes layers with and without bias; not supported")
        if dst is not None:
            dst.copy_(src)
    return block


@torch.no_grad()
def stack_from_torch(cls: type, block_cls: type, encoder: nn.TransformerEncoder) -> Any:
    """``EncoderStack.from_torch``: an EncoderStack (``cls``) of ``block_cls`` blocks computing
    what ``encoder`` computes in eval mode (final norm included)."""
    if not isinstance(encoder, nn.TransformerEncoder):
        raise TypeError(f"encoder must be an nn.TransformerEncoder, got {type(encoder).__name__}")
    norm = None
    if encoder.norm is not None:
        if not isinstance(encoder.norm, nn.LayerNorm):
            raise TypeError(f"encoder.norm must be an nn.LayerNorm, got {type(encoder.norm).__name__}")
        src = encoder.norm
        norm = nn.LayerNorm(
            src.normalized_shape, eps=src.eps, elementwise_affine=src.elementwise_affine,
            bias=src.bias is not None, dtype=src.weight.dtype if src.weight is not None else None,
            device=src.weight.device if src.weight is not None else None,
        )  # fmt: skip
        norm.load_state_dict(src.state_dict())
        norm.requires_grad_(False)
    blocks = [block_from_torch(block_cls, layer, f"encoder.layers[{i}]") for i, layer in enumerate(encoder.layers)]
    return cls(blocks, norm)


def runs_eagerly_when_compiled(fn: F) -> F:
    """``torch.compiler.disable(fn)``, with torch's dynamo imported at the first call rather
    than at fusedenc's import: importing it pulls in Inductor and Triton (seconds, and
    ``import fusedenc`` must stay light).  torch's own lazy form where this torch has it."""
    lazy = getattr(torch, "_disable_dynamo", None)
    return lazy(fn) if lazy is not None else torch.compiler.disable(fn)
