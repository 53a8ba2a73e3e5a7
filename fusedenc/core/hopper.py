"""The Hopper (sm90) CUTLASS kernels' seam: the LayerNorm-folding GEMMs (``norm_fold``
says what they compute; the callers have checked shapes and dtypes), their statistics
kernel, and what the epilogue GEMM serves.  Part of ``core``, the one seam to the native core."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from . import ACTIVATION_IDS, DTYPE_CODES, native_module, pointer

# ------------------------------------------- LayerNorm folded into GEMMs ----
# (ops/norm_fold.py says what these compute; the callers have checked shapes and dtypes.)


def sm90_fold_applies(
    a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, c: Optional[torch.Tensor] = None
) -> tuple[bool, str]:
    """Whether the Hopper norm GEMM (``c`` None) or residual GEMM (``c`` given) runs
    row-major ``a`` [M, K] by ``w`` [N, K] into ``out`` [M, N], and if not why."""
    module = native_module()
    if module is None:
        return False, "no native core"
    m, k = a.shape
    n = w.shape[0]
    return tuple(module.sm90_fold_applies(
        a.device.index, m, n, k, a.data_ptr(), a.stride(0), w.data_ptr(), w.stride(0), 0,
        pointer(c), 0 if c is None else c.stride(0), out.data_ptr(), out.stride(0), DTYPE_CODES[a.dtype],
    ))  # fmt: skip


_fold_fits: dict = {}


def sm90_fold_fits(device: int, dtype: torch.dtype, m: int, n: int, k: int, residual: bool) -> bool:
    """``sm90_fold_applies`` for dense row-major operands freshly allocated (aligned):
    the size, dtype and device rules alone, remembered per problem."""
    module = native_module()
    if module is None:
        return False
    key = (device, dtype, m, n, k, residual, module.sm90_gemm_enabled())
    found = _fold_fits.get(key)
    if found is None:
        found = bool(module.sm90_fold_applies(
            device, m, n, k, 256, k, 256, k, 0, 256 if residual else 0, n, 256, n, DTYPE_CODES[dtype],
        )[0])  # fmt: skip
        if len(_fold_fits) > 4096:
            _fold_fits.clear()
        _fold_fits[key] = found
    return found


def sm90_residual_gemm_compiled(dtype: torch.dtype) -> bool:
    """Whether this build holds the Hopper residual GEMM for ``dtype``."""
    module = native_module()
    return module is not None and bool(module.sm90_residual_gemm_compiled(DTYPE_CODES[dtype]))


def stats_tile() -> tuple[int, int]:
    """(rows, columns) of the tile the residual GEMM's partial row sums are per."""
    module = native_module()
    return module.STATS_TILE_M, module.STATS_TILE_N


def sm90_norm_gemm(a, w, out, bias, activation, rstd, shift, colsum, stream, workspace) -> bool:
    """``out = act(rstd * a @ w^T + shift * colsum + bias)``; False: nothing ran (CUTLASS refused)."""
    m, k = a.shape
    n = w.shape[0]
    return native_module().sm90_norm_gemm(
        a.device.index, stream, m, n, k, a.data_ptr(), a.stride(0), w.data_ptr(), w.stride(0), pointer(bias),
        out.data_ptr(), out.stride(0), DTYPE_CODES[a.dtype], ACTIVATION_IDS[activation], 1.0,
        pointer(rstd), pointer(shift), pointer(colsum), workspace.data_ptr(), workspace.numel(),
    )  # fmt: skip


def sm90_residual_gemm(a, w, out, bias, c, alpha, pending, row_sum, row_sumsq, stream, workspace) -> bool:
    """``out = alpha * (a @ w^T + bias) + R`` with ``R = c`` or, for ``pending``
    (a ``norm_fold.NormedRows`` over ``c``), its LayerNorm; partial row sums of ``out`` and
    ``out^2`` into ``row_sum``/``row_sumsq``.  False: nothing ran (CUTLASS refused)."""
    m, k = a.shape
    n = w.shape[0]
    rstd = shift = gamma = beta = None
    if pending is not None:
        rstd, shift, gamma, beta = pending.rstd, pending.shift, pending.gamma, pending.beta
    return native_module().sm90_residual_gemm(
        a.device.index, stream, m, n, k, a.data_ptr(), a.stride(0), w.data_ptr(), w.stride(0), pointer(bias),
        c.data_ptr(), c.stride(0), out.data_ptr(), out.stride(0), DTYPE_CODES[a.dtype], alpha,
        pointer(rstd), pointer(shift), pointer(gamma), pointer(beta), pointer(row_sum), pointer(row_sumsq),
        workspace.data_ptr(), workspace.numel(),
    )  # fmt: skip


def norm_stats(row_sum, row_sumsq, cols, eps, rstd, shift, stream) -> None:
    """``rstd`` and ``shift = -mean * rstd`` per row from the residual GEMM's partial sums
    ``[tiles, ld]`` of rows ``cols`` wide."""
    tiles, ld = row_sum.shape
    native_module().norm_stats(
        row_sum.device.index, stream, rstd.numel(), cols, tiles, ld, row_sum.data_ptr(), row_sumsq.data_ptr(),
        rstd.data_ptr(), shift.data_ptr(), eps,
    )  # fmt: skip


# ------------------------------------------------------------ reports ----


def sm90_gemm_kernels() -> list[tuple[str, str]]:
    """(dtype, activation) pairs of the Hopper epilogue GEMM this build holds (CUTLASS
    kernels that apply activations cuBLASLt cannot fuse); empty without them."""
    module = native_module()
    return [tuple(p) for p in module.sm90_gemm_kernels()] if module else []


def sm90_gemm_applies(
    a: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor, activation: str
) -> tuple[bool, str]:
    """Whether ``gemm`` of row-major 2-D ``a`` [M, K] by ``w`` [N, K] into ``out`` [M, N]
    with ``activation`` (canonical name) runs on the Hopper epilogue kernel, and if not why."""
    module = native_module()
    if module is None:
        return False, "no native core"
    m, k = a.shape
    n = w.shape[0]
    return tuple(module.sm90_gemm_applies(
        a.device.index, m, n, k, a.data_ptr(), a.stride(0), w.data_ptr(), w.stride(0),
        0 if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
        DTYPE_CODES[a.dtype], ACTIVATION_IDS[activation],
    ))  # fmt: skip


def set_sm90_sm_limit(n: int) -> int:
    """From now on this thread's Hopper kernels use at most ``n`` SMs (0: all; their
    persistent grids shrink, and GEMMs too small to fill the chip run there too: cuBLASLt's
    grids cannot be limited); returns the previous limit.  For work split between streams
    (``fusedenc.lc0``'s smolgen beside the QKV GEMM).  A no-op without the native core."""
    module = native_module()
    if module is None:
        return 0
    previous = module.sm90_sm_limit()
    module.set_sm90_sm_limit(n)
    return previous


def sm90_gelu_epilogue_kernels() -> list[tuple[str, str]]:
    """(dtype, activation) pairs of the Hopper GELU units this build holds: the epilogue GEMM
    with exact GELU or tanh-GELU fixed at compile time; empty without them."""
    module = native_module()
    return [tuple(p) for p in module.sm90_gelu_epilogue_kernels()] if module else []


def sm90_gelu_epilogue_on() -> bool:
    """Whether the GELU units are switched on: by default (where built), unless
    ``FUSEDENC_SM90_GELU=0`` at start or inside ``sm90_gelu_epilogue(False)``."""
    module = native_module()
    return bool(module and module.sm90_gelu_epilogue())


@contextlib.contextmanager
def _native_switch(name: str, on: bool) -> Iterator[None]:
    """The core's switch ``name`` (``<name>()`` reads it, ``set_<name>(on)`` sets it) at ``on``
    inside, as it was after; nothing without a native core."""
    module = native_module()
    if module is None:
        yield
        return
    was = getattr(module, name)()
    getattr(module, "set_" + name)(on)
    try:
        yield
    finally:
        getattr(module, "set_" + name)(was)


def sm90_gelu_epilogue(on: bool = True) -> contextlib.AbstractContextManager:
    """Inside, the GELU units are on (or off): a folded GEMM with exact or tanh GELU applies it
    in its epilogue instead of running the pass after it, and a plain GEMM with exact GELU runs
    on the Hopper kernel instead of cuBLASLt + the pass.  The A/B switch of those units, on by
    default (``FUSEDENC_SM90_GELU=0`` turns them off for a whole process).  Public as
    ``fusedenc.testing.sm90_gelu_epilogue``."""
    return _native_switch("sm90_gelu_epilogue", bool(on))


def sm90_gemm_disabled() -> contextlib.AbstractContextManager:
    """Send every GEMM to cuBLASLt (+ the activation pass) inside: the A/B switch for the
    Hopper epilogue kernel (``FUSEDENC_SM90_GEMM=0`` does it for a whole process).
    Public as ``fusedenc.testing.sm90_gemm_disabled``."""
    return _native_switch("sm90_gemm_enabled", False)
