"""GEMM problems measured to run faster as the Triton FFN1 kernel than as a BLASLt call.

Where the GEMM library has no epilogue for an activation (cuBLASLt: swish,
mish, exact GELU, ...), ``fusedenc.linear`` runs the BIAS epilogue and then one
activation pass over the output.  ``python -m fusedenc.tune gemm`` also times
``fusedenc.core.triton_gemm`` (the activation applied to the accumulator, one
store) at those problems and records, per problem, whichever won
(``"kernel": "triton"`` and its launch config in the tuning file).  The loader
(``core.load_gemm_tuning``) installs those routes here, and ``core.gemm``, the
one launcher of every GEMM, looks each problem up before calling the library.

A route covers one exact problem: device, M, N, K, dtype, activation and
whether there is a bias, with dense rows (lda = ldw = K, ldd = N), 16-byte
aligned operands, no residual and alpha = 1 -- the shapes ``tune gemm``
measures.  Everything else runs the BLASLt path as before.

This module does not import Triton: the loader only checks that it is
installed, and ``core.gemm`` imports the kernel module at the first routed call.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import NamedTuple, Optional

import torch

__all__ = ["GemmConfig", "RouteKey", "install", "installed", "lookup", "routes", "triton_available"]


class GemmConfig(NamedTuple):
    """Launch configuration of ``fusedenc.core.triton_gemm``'s kernel."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int  # row blocks that share a column block before moving on (L2 reuse of W)
    num_warps: int
    num_stages: int


class RouteKey(NamedTuple):
    device: int
    m: int
    n: int
    k: int
    dtype: int  # the core's dtype code (dtypes.code)
    activation: str  # canonical name
    has_bias: bool


#: The installed routes.  Read without a lock on the hot path (a dict lookup is
#: atomic under the GIL); ``install`` swaps the contents under the loader's lock.
_ROUTES: dict[RouteKey, GemmConfig] = {}


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Whether the Triton package is installed (without importing it).  Asked once per
    process: ``fp8.e4m3_columns`` asks on every call, and a failed lookup walks sys.path."""
    return importlib.util.find_spec("triton") is not None


def install(new: dict[RouteKey, GemmConfig]) -> None:
    """Replace every route (the loader calls this after reading the tuning files)."""
    _ROUTES.clear()
    _ROUTES.update(new)


def installed() -> bool:
    """Whether any route is installed (the common case, none, costs one check per GEMM)."""
    return bool(_ROUTES)


def routes() -> dict[RouteKey, GemmConfig]:
    """A copy of the installed routes."""
    return dict(_ROUTES)


def lookup(
    x: torch.Tensor, device: int, m: int, n: int, k: int, dtype: int, activation: str, has_bias: bool
) -> Optional[GemmConfig]:
    """The route of a dense, residual-free, alpha = 1 problem, or None (``x`` for its alignment)."""
    if not _ROUTES:
        return None
    # A plain tuple hashes and compares like the RouteKey it stands for, and costs less to build.
    config = _ROUTES.get((device, m, n, k, dtype, activation, has_bias))
    if config is None or x.data_ptr() % 16:
        return None
    return config
