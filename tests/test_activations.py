"""The activation table and its PyTorch references, against textbook formulas in fp64."""

from __future__ import annotations

import math

import pytest
import torch

from fusedenc.common.activations import ACTIVATIONS, activation_id, apply_activation, canonical_activation


def _formula(name: str, x: torch.Tensor) -> torch.Tensor:
    """Each activation written from its definition, elementwise in fp64."""
    xs = x.tolist()
    selu_alpha, selu_scale = 1.6732632423543772, 1.0507009873554805

    def one(v: float) -> float:
        if name == "none":
            return v
        if name == "relu":
            return max(v, 0.0)
        if name == "relu2":
            return max(v, 0.0) ** 2
        if name == "gelu":
            return 0.5 * v * (1 + math.erf(v / math.sqrt(2)))
        if name == "gelu_tanh":
            return 0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3)))
        if name == "swish":
            return v / (1 + math.exp(-v))
        if name == "mish":
            return v * math.tanh(math.log1p(math.exp(v)) if v < 20 else v)
        if name == "selu":
            return selu_scale * (v if v > 0 else selu_alpha * math.expm1(v))
        if name == "tanh":
            return math.tanh(v)
        if name == "sigmoid":
            return 1 / (1 + math.exp(-v))
        raise AssertionError(name)

    return torch.tensor([one(v) for v in xs], dtype=torch.float64)


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_reference_matches_formula(name, gen):
    x = torch.randn(512, generator=gen, dtype=torch.float64) * 4
    got = apply_activation(x, name)
    want = _formula(name, x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"{name} (seed {gen.seed_value})")


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_nan_propagates(name):
    x = torch.tensor([float("nan"), 1.0, -1.0], dtype=torch.float32)
    y = apply_activation(x, name)
    assert torch.isnan(y[0]), f"{name} turned NaN into {y[0].item()}"
    assert torch.isfinite(y[1:]).all()


def test_ids_follow_native_numbering():
    # csrc/common.h numbers the activations in this order; the binding relies on it.
    assert ACTIVATIONS == ("none", "relu", "gelu_tanh", "gelu", "swish", "mish", "relu2", "selu", "tanh", "sigmoid")
    assert [activation_id(a) for a in ACTIVATIONS] == list(range(len(ACTIVATIONS)))


@pytest.mark.parametrize("alias,name", [("silu", "swish"), ("identity", "none"), ("gelu_erf", "gelu"), ("relu_squared", "relu2")])
def test_aliases(alias, name):
    assert canonical_activation(alias) == name


def test_unknown_activation_is_rejected():
    with pytest.raises(ValueError, match="activation='swiglu'"):
        canonical_activation("swiglu")
    with pytest.raises(TypeError, match="activation must be a str"):
        canonical_activation(3)
