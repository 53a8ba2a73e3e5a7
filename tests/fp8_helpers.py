"""What the FP8 tests share: the GPU gate, a random post-LN stack, the relative error, and a
spy on the FP8 mode's quantization passes."""

from __future__ import annotations

import pytest
import torch
from encoder_helpers import randomize

from fusedenc import EncoderStack, core
from fusedenc.encoder import executors
from fusedenc.fp8 import rowwise as fp8


def require_fp8_gpu() -> None:
    """Skip without a GPU that runs FP8; on an H100 with an FP8 build, it must run."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    ok, why = core.fp8_status(torch.device("cuda", torch.cuda.current_device()))
    if torch.cuda.get_device_capability() == (9, 0) and core.fp8_compiled():
        assert ok, why  # an H100 with an FP8 build must run it
    if not ok:
        pytest.skip(f"no FP8 here: {why}")


def random_stack(layers: int, d: int, heads: int, d_ff: int, gen: torch.Generator, **build_kwargs) -> EncoderStack:
    """A swish post-LN stack (Lc0's alpha) in fp16 unless told, random weights, eval mode."""
    build_kwargs.setdefault("dtype", torch.float16)
    s = EncoderStack.build(layers, d, heads, d_ff, activation="swish", residual_alpha=(2 * layers) ** -0.25,
                           **build_kwargs)  # fmt: skip
    for b in s.blocks:
        randomize(b, gen)
    return s.eval()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def count_quantize_passes(monkeypatch) -> list[tuple[int, ...]]:
    """The shapes every ``fp8.quantize_rows`` call of the FP8 mode quantizes from now on."""
    passes: list[tuple[int, ...]] = []
    real = fp8.quantize_rows

    def spy(t):
        passes.append(tuple(t.shape))
        return real(t)

    monkeypatch.setattr(executors.fp8, "quantize_rows", spy)
    return passes


def synthetic_lc0(tmp_path, preset: str, seed: int, planes_seed: int, sample: int, positions: int,
                  device: str = "cpu"):  # fmt: skip
    """A synthetic fp16 Lc0 net of ``preset`` written to ``tmp_path`` and loaded, with calibration
    planes (``sample`` positions) and other planes to run (``positions``): ``(net, sample, planes)``."""
    from lc0_writer import random_planes, write_preset

    from fusedenc.lc0 import load_network

    path = tmp_path / f"{preset}.pb.gz"
    write_preset(path, preset, seed=seed)
    net = load_network(str(path), dtype=torch.float16, device=device)
    g = torch.Generator().manual_seed(planes_seed)
    return net, random_planes(sample, g).to(device, torch.float16), random_planes(positions, g).to(device, torch.float16)
