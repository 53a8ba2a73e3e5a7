"""What the tune subcommands share: argument parsers and the GPU check."""

from __future__ import annotations

import argparse
from typing import Callable, Optional

import torch

__all__ = ["int_list", "name_list", "no_gpu_reason"]


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(x <= 0 for x in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def name_list(allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        values = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in values if x not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(allowed)}")
        return values

    return parse


def no_gpu_reason() -> Optional[str]:
    if not torch.cuda.is_available():
        build = "CPU-only torch build" if not (torch.version.cuda or torch.version.hip) else "torch sees no GPU"
        return f"no CUDA/ROCm GPU available ({build}); tuning measures kernels on the GPU it runs on"
    return None
