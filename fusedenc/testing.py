"""Hooks for tests of code built on fusedenc.

Each A/B switch here changes which kernels a call runs, so automatic CUDA graphs captured
on one side of it must not replay on the other: entering and leaving a switch drops them
(``auto_graphs.invalidate``).  ``layer_norm_folding``'s mode is part of every graph's key.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

from . import core
from .fp8 import rowwise as fp8
from .graphs import auto as auto_graphs
from .ops.norm_fold import mode as layer_norm_folding

__all__ = [
    "auto_graphs_disabled",
    "force_epilogue_fallback",
    "fp8_producers_disabled",
    "layer_norm_folding",
    "sm90_gelu_epilogue",
    "sm90_gemm_disabled",
]


def _dropping_graphs(switch: Callable[..., contextlib.AbstractContextManager]) -> Callable[..., contextlib.AbstractContextManager]:
    @functools.wraps(switch)
    @contextlib.contextmanager
    def wrapped(*args, **kwargs) -> Iterator[None]:
        auto_graphs.invalidate()
        try:
            with switch(*args, **kwargs):
                yield
        finally:
            auto_graphs.invalidate()

    return wrapped


force_epilogue_fallback = _dropping_graphs(core.force_epilogue_fallback)
sm90_gemm_disabled = _dropping_graphs(core.sm90_gemm_disabled)
sm90_gelu_epilogue = _dropping_graphs(core.sm90_gelu_epilogue)
fp8_producers_disabled = _dropping_graphs(fp8.producers_disabled)
#: Plain calls inside run eagerly (no automatic CUDA graphs), process-wide.
auto_graphs_disabled = auto_graphs.disabled
