"""The activations fusedenc knows: names, native ids, and PyTorch references.

The numbering matches ``fusedenc::Activation`` in ``csrc/common.h``.  Each
reference computes in the dtype it is given; the ops call it on fp32 values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["ACTIVATIONS", "activation_id", "apply_activation", "canonical_activation"]

#: Canonical names in native-id order.
ACTIVATIONS: tuple[str, ...] = (
    "none",
    "relu",
    "gelu_tanh",  # tanh approximation: what both BLASLt GELU epilogues compute
    "gelu",  # exact, erf-based: what BERT-family models use
    "swish",  # SiLU
    "mish",
    "relu2",  # relu(x) ** 2
    "selu",
    "tanh",
    "sigmoid",
)

_IDS = {name: i for i, name in enumerate(ACTIVATIONS)}
_ALIASES = {"silu": "swish", "identity": "none", "gelu_erf": "gelu", "relu_squared": "relu2"}


def canonical_activation(name: object) -> str:
    """Return the canonical spelling of ``name``; ValueError for unknown ones."""
    if not isinstance(name, str):
        raise TypeError(f"activation must be a str, got {type(name).__name__}")
    key = _ALIASES.get(name, name)
    if key not in _IDS:
        known = ", ".join(ACTIVATIONS + tuple(_ALIASES))
        raise ValueError(f"activation={name!r} is not one of: {known}")
    return key


def activation_id(name: str) -> int:
    return _IDS[canonical_activation(name)]


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


_REFERENCE = {
    "none": lambda x: x,
    "relu": F.relu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "swish": F.silu,
    "mish": F.mish,
    "relu2": _relu2,
    "selu": F.selu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
}


def apply_activation(x: torch.Tensor, name: str) -> torch.Tensor:
    """The PyTorch definition of activation ``name`` applied to ``x``."""
    return _REFERENCE[canonical_activation(name)](x)
