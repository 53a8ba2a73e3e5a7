"""The tests' synthetic Lc0 nets: ``fusedenc.lc0.writer`` (re-exported under the old name), and
``random_planes``, input planes for them."""

from __future__ import annotations

import torch

from fusedenc.lc0.writer import PRESETS, build_net, encode_net, weight_shapes, write_net, write_preset  # noqa: F401


def random_planes(batch: int, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Input planes like lc0's ``[B, 112, 8, 8]``: sparse 0/1 piece planes, a rule-50-like
    scalar plane (108) and the all-ones plane (111); drawn on the CPU from ``gen``."""
    planes = (torch.rand((batch, 112, 8, 8), generator=gen) < 0.1).float()
    planes[:, 108] = torch.rand((batch, 1, 1), generator=gen)
    planes[:, 111] = 1.0
    return planes.to(dtype)
