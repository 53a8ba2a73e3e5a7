"""Hooks for tests of code built on fusedenc."""

from __future__ import annotations

import contextlib
from typing import Iterator

from . import _native

__all__ = ["force_epilogue_fallback"]


@contextlib.contextmanager
def force_epilogue_fallback() -> Iterator[None]:
    """Plan GEMMs as if the library had no algorithm for any fused epilogue.

    Exercises the fallback path (plain GEMM + fusedenc's bias/activation
    kernel) on hardware where the heuristic would never refuse.  Plans made
    inside are cached apart from normal ones.  No effect without a native core.
    """
    module = _native.native_module()
    if module is None:
        yield
        return
    module.set_force_epilogue_fallback(True)
    try:
        yield
    finally:
        module.set_force_epilogue_fallback(False)
