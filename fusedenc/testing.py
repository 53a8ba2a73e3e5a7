"""Hooks for tests of code built on fusedenc."""

from __future__ import annotations

from .core import force_epilogue_fallback, sm90_gemm_disabled
from .fp8 import producers_disabled as fp8_producers_disabled
from .norm_fold import mode as layer_norm_folding

__all__ = ["force_epilogue_fallback", "fp8_producers_disabled", "layer_norm_folding", "sm90_gemm_disabled"]
