"""Hooks for tests of code built on fusedenc."""

from __future__ import annotations

from .core import force_epilogue_fallback, sm90_gemm_disabled

__all__ = ["force_epilogue_fallback", "sm90_gemm_disabled"]
