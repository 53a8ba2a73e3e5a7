"""The activation vocabulary: canonical names, native ids, PyTorch references,
and how torch, Hugging Face and Lc0 spell each one.

The numbering matches ``fusedenc::Activation`` in ``csrc/common.h``.  Each
reference computes in the dtype it is given; the ops call it on fp32 values.
Every other module maps foreign names through this one (``from_torch``,
``HF_ACTIVATIONS``, ``LC0_ACTIVATIONS``), so a new activation is added here once.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "ACTIVATIONS",
    "HF_ACTIVATIONS",
    "LC0_ACTIVATIONS",
    "activation_id",
    "apply_activation",
    "canonical_activation",
    "from_torch",
    "torch_function",
]

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

#: ``config.hidden_act`` of a Hugging Face model -> canonical name.  HF's "gelu" is the exact erf form.
HF_ACTIVATIONS: dict[str, str] = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "silu": "swish",
    "swish": "swish",
    "tanh": "tanh",
    "sigmoid": "sigmoid",
    "mish": "mish",
}

#: lc0's ``ActivationFunction`` enum (proto/net.proto) -> canonical name.  DEFAULT (0)
#: means "the net's default_activation" and SOFTMAX (9) is no elementwise activation:
#: neither is listed; the loader resolves or refuses them.
LC0_ACTIVATIONS: dict[int, str] = {
    1: "mish",
    2: "relu",
    3: "none",
    4: "tanh",
    5: "sigmoid",
    6: "selu",
    7: "swish",
    8: "relu2",
}


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


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


#: The torch function an idiomatic PyTorch model calls for each activation: the
#: references of the ops and the activations of the benchmarks' torch peers.
_TORCH_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "none": _identity,
    "relu": F.relu,
    "gelu_tanh": _gelu_tanh,
    "gelu": F.gelu,
    "swish": F.silu,
    "mish": F.mish,
    "relu2": _relu2,
    "selu": F.selu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
}


def torch_function(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The torch function computing activation ``name`` (``F.silu`` for "swish", ...)."""
    return _TORCH_FUNCTIONS[canonical_activation(name)]


def apply_activation(x: torch.Tensor, name: str) -> torch.Tensor:
    """The PyTorch definition of activation ``name`` applied to ``x``."""
    return torch_function(name)(x)


_TORCH_MODULES = {nn.ReLU: "relu", nn.SiLU: "swish", nn.Mish: "mish", nn.Tanh: "tanh", nn.Sigmoid: "sigmoid", nn.SELU: "selu"}


def from_torch(act: object) -> str:
    """The canonical name of what ``nn.TransformerEncoderLayer`` holds in ``.activation``:
    a name, a torch function or an ``nn`` activation module.  TypeError for anything else."""
    if isinstance(act, str):
        return canonical_activation(act)
    if act is F.gelu:
        return "gelu"
    if act in (torch.tanh, F.tanh):
        return "tanh"
    if act in (torch.sigmoid, F.sigmoid):
        return "sigmoid"
    for name in ("relu", "swish", "mish", "selu"):
        if act is _TORCH_FUNCTIONS[name]:
            return name
    for cls, name in _TORCH_MODULES.items():
        if type(act) is cls:
            return name
    if type(act) is nn.GELU:
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    raise TypeError(
        f"activation {act!r} has no fusedenc equivalent; supported: relu, gelu (exact or tanh), "
        "silu, mish, tanh, sigmoid, selu (as functions, nn modules or names)"
    )
