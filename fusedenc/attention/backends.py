"""The kernels that can serve an attention call ("backends") and what each supports.

Each backend says whether it is installed and has a device (``available``)
and whether it can serve one call (``supports``, with the reason when not);
``plans`` picks the first usable one in the tables' order.  See the package
docstring for what each backend is.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .call import AttentionCall

__all__ = ["BACKENDS", "FALLBACK_ORDER", "AttentionBackend"]

#: Tried after the tables' entries, in this order; math serves every call.
FALLBACK_ORDER = ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math")


def _aten(name: str):
    """``torch.ops.aten.<name>.default``, resolved once (None if this torch lacks it)."""
    try:
        return getattr(torch.ops.aten, name).default
    except (AttributeError, RuntimeError):
        return None


_FLASH_OP = _aten("_scaled_dot_product_flash_attention")
_EFFICIENT_OP = _aten("_scaled_dot_product_efficient_attention")
_CUDNN_OP = _aten("_scaled_dot_product_cudnn_attention")
_MATH_OP = _aten("_scaled_dot_product_attention_math")


class AttentionBackend:
    """One way to compute attention.

    ``available()``: the code is installed and a device it runs on is present.
    ``supports(call)``: ``(True, "")`` or ``(False, reason)`` for one call.
    ``kernel(qt, kt, vt, bias, scale)`` takes ``[B, H, S, Dh]`` views and
    returns ``[B, H, S, Dh]`` (any memory order); backends with
    ``bshd_input = True`` take and return ``[B, S, H, Dh]`` instead.
    Backends with ``native_mask = True`` (always ``bshd_input`` too) are called
    as ``kernel(q, k, v, attn_bias, scale, key_padding_mask)`` with the
    caller's bias and bool mask as they are, and must return ``[B, S, H, Dh]``
    in that memory order.  Backends with ``writes_e4m3 = True`` also take
    ``out_scale=`` (float32 ``[H*Dh]``) and then return the e4m3 codes of
    ``out * out_scale`` per column, saturated (``fusedenc.fp8.rowwise``'s static scales).
    """

    name = "abstract"
    bshd_input = False  # kernel takes q, k, v as [B, S, H, Dh]
    accepts_bias = False  # takes an additive [B, H, S, S] bias (masks arrive merged into it)
    aligned_bias = False  # that bias needs 16-element-aligned strides (padded rows)
    native_mask = False  # reads the caller's bias and bool mask itself: nothing merged or copied
    writes_e4m3 = False  # kernel(..., out_scale=) writes float8 e4m3 codes (native_mask backends)
    description = ""

    def available(self) -> bool:  # pragma: no cover - overridden
        return False

    def supports(self, call: AttentionCall) -> tuple[bool, str]:  # pragma: no cover - overridden
        return False, "abstract backend"

    def kernel(self, q, k, v, bias, scale):  # pragma: no cover - overridden
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<attention backend {self.name}>"


def _need(cond: bool, reason: str) -> Optional[str]:
    return None if cond else reason


def _first_failure(*checks: Optional[str]) -> tuple[bool, str]:
    for c in checks:
        if c is not None:
            return False, c
    return True, ""


# Checks several backends share, with one wording each.
def _gpu_check(call: AttentionCall) -> Optional[str]:
    return _need(call.device_type == "cuda", f"needs a GPU tensor, got {call.device_type}")


def _sm80_check(call: AttentionCall) -> Optional[str]:
    cap = call.capability
    return _need(call.rocm or (cap is not None and cap >= (8, 0)), f"needs sm80 or newer, got {call.arch}")


def _half_check(call: AttentionCall) -> Optional[str]:
    return _need(call.dtype in (torch.float16, torch.bfloat16), f"float16/bfloat16 only, got {call.dtype}")


def _aligned_check(call: AttentionCall) -> Optional[str]:
    return _need(call.aligned, "q, k, v pointers and strides must be 16-byte aligned")


def _head_dim_check(call: AttentionCall, max_dim: int) -> Optional[str]:
    ok = call.head_dim % 8 == 0 and call.head_dim <= max_dim
    return _need(ok, f"head dim must be a multiple of 8 up to {max_dim}, got {call.head_dim}")


def _gpu_present() -> bool:
    return torch.cuda.is_available()


class _SdpaFlash(AttentionBackend):
    name = "sdpa_flash"
    description = "aten._scaled_dot_product_flash_attention (PyTorch's FlashAttention-2)"

    @functools.lru_cache(maxsize=None)
    def available(self) -> bool:
        return _FLASH_OP is not None and _gpu_present() and bool(torch.backends.cuda.is_flash_attention_available())

    def supports(self, call):
        return _first_failure(
            _gpu_check(call),
            _sm80_check(call),
            _half_check(call),
            _head_dim_check(call, 256),
            _need(not call.has_bias, "takes no attn_bias"),
            _need(not call.has_mask, "takes no key_padding_mask"),
            _aligned_check(call),
        )

    def kernel(self, q, k, v, bias, scale):
        return _FLASH_OP(q, k, v, 0.0, False, False, scale=scale)[0]


class _SdpaEfficient(AttentionBackend):
    name = "sdpa_efficient"
    accepts_bias = True
    aligned_bias = True
    description = "aten._scaled_dot_product_efficient_attention (memory-efficient, CUTLASS)"

    @functools.lru_cache(maxsize=None)
    def available(self) -> bool:
        return _EFFICIENT_OP is not None and _gpu_present()

    def supports(self, call):
        cap = call.capability
        return _first_failure(
            _gpu_check(call),
            _need(call.rocm or (cap is not None and cap >= (5, 0)), f"needs sm50 or newer, got {call.arch}"),
            _need(
                call.dtype != torch.bfloat16 or call.rocm or (cap is not None and cap >= (8, 0)),
                f"bfloat16 needs sm80 or newer, got {call.arch}",
            ),
            _need(call.aligned, "q, k, v pointers, strides and head dim must be 16-byte aligned"),
        )

    def kernel(self, q, k, v, bias, scale):
        return _EFFICIENT_OP(q, k, v, bias, False, 0.0, False, scale=scale)[0]


class _SdpaCudnn(AttentionBackend):
    name = "sdpa_cudnn"
    accepts_bias = True
    aligned_bias = True
    description = "aten._scaled_dot_product_cudnn_attention (cuDNN 9 fused attention)"

    @functools.lru_cache(maxsize=None)
    def available(self) -> bool:
        if _CUDNN_OP is None or not (_gpu_present() and torch.version.cuda and torch.backends.cudnn.is_available()):
            return False
        return (torch.backends.cudnn.version() or 0) >= 90000

    def supports(self, call):
        cap = call.capability
        max_dim = 256 if cap is not None and cap >= (9, 0) else 128
        return _first_failure(
            _need(call.device_type == "cuda" and not call.rocm, f"needs an NVIDIA GPU tensor, got {call.arch}"),
            _need(cap is not None and cap >= (8, 0), f"needs sm80 or newer, got {call.arch}"),
            # float32 is not rejected by the aten op: it silently returns NaN (seen with torch 2.11).
            _half_check(call),
            _need(
                call.head_dim % 8 == 0 and call.head_dim <= max_dim,
                f"head dim must be a multiple of 8 up to {max_dim} on {call.arch}, got {call.head_dim}",
            ),
            _aligned_check(call),
        )

    def kernel(self, q, k, v, bias, scale):
        return _CUDNN_OP(q, k, v, bias, False, 0.0, False, False, scale=scale)[0]


class _SdpaMath(AttentionBackend):
    name = "sdpa_math"
    accepts_bias = True
    description = "aten._scaled_dot_product_attention_math (matmul + softmax, any device)"

    def available(self) -> bool:
        return True

    def supports(self, call):
        return True, ""

    def kernel(self, q, k, v, bias, scale):
        return _MATH_OP(q, k, v, bias, 0.0, False, None, scale=scale)[0]


class _ImportedBackend(AttentionBackend):
    """A backend whose kernels come from a module imported on first use (an optional package)."""

    def _importable_here(self) -> bool:
        return _gpu_present()

    def _import(self):  # pragma: no cover - overridden
        raise NotImplementedError

    @functools.cached_property
    def _module(self):
        if not self._importable_here():
            return None
        try:
            return self._import()
        except Exception:  # noqa: BLE001 - any failure means "not usable here"
            return None

    def available(self) -> bool:
        return self._module is not None


class _FlashAttnPackage(_ImportedBackend):
    name = "flash_attn"
    bshd_input = True
    description = "flash-attn package: flash_attn_qkvpacked_func on packed views, else flash_attn_func"

    def _import(self):
        import flash_attn

        return flash_attn

    def supports(self, call):
        return _first_failure(
            _gpu_check(call),
            _sm80_check(call),
            _half_check(call),
            _head_dim_check(call, 256),
            _need(not call.has_bias, "takes no attn_bias"),
            _need(
                not call.has_mask,
                "key_padding_mask would need the varlen interface on unpadded tokens (not implemented)",
            ),
            _aligned_check(call),
        )

    def kernel(self, q, k, v, bias, scale):
        m = self._module
        b, s, h, d = q.shape
        item = q.element_size()
        if (
            q.stride(2) == d
            and k.data_ptr() - q.data_ptr() == h * d * item
            and v.data_ptr() - q.data_ptr() == 2 * h * d * item
        ):  # q, k, v are views of one [B, S, 3, H, Dh] buffer: hand it over whole
            qkv = q.as_strided((b, s, 3, h, d), (q.stride(0), q.stride(1), h * d, d, 1))
            return m.flash_attn_qkvpacked_func(qkv, 0.0, softmax_scale=scale, causal=False)
        return m.flash_attn_func(q, k, v, 0.0, softmax_scale=scale, causal=False)


class _Aiter(_ImportedBackend):
    name = "aiter"
    bshd_input = True
    description = "AMD AITER flash_attn_func (ROCm only; untested, no AMD GPU was available)"

    def _importable_here(self) -> bool:
        return _gpu_present() and bool(torch.version.hip)

    def _import(self):
        import aiter

        return aiter

    def supports(self, call):
        return _first_failure(
            _need(call.device_type == "cuda" and call.rocm, f"needs a ROCm GPU tensor, got {call.arch}"),
            _half_check(call),
            _head_dim_check(call, 256),
            _need(not call.has_bias, "no attn_bias support wired up"),
            _need(not call.has_mask, "no key_padding_mask support wired up"),
            _aligned_check(call),
        )

    def kernel(self, q, k, v, bias, scale):
        return self._module.flash_attn_func(q, k, v, 0.0, softmax_scale=scale, causal=False)


class _TritonShort(_ImportedBackend):
    name = "triton_short"
    bshd_input = True
    native_mask = True
    writes_e4m3 = True
    description = "fusedenc.attention.triton_short: one-tile Triton kernel for short sequences (bias and mask read in-kernel)"

    def _import(self):
        from . import triton_short  # imports Triton: only when this backend is first asked about

        return triton_short

    def supports(self, call):
        ok, why = _first_failure(
            _need(call.device_type == "cuda", f"needs a GPU tensor (CUDA or ROCm), got {call.device_type}"),
            _sm80_check(call),
            _need(self._module is not None, "needs the triton package (and a visible GPU)"),
        )
        if not ok:
            return ok, why
        m = self._module  # float16, bfloat16 and float32 (full-precision products) all served
        return _first_failure(
            _need(call.head_dim in m.HEAD_DIMS, f"head dim must be one of {m.HEAD_DIMS}, got {call.head_dim}"),
            _need(
                call.seq <= m.MAX_SEQ,
                f"sequence length must be at most {m.MAX_SEQ} (all keys in one tile), got {call.seq}",
            ),
            _aligned_check(call),
        )

    def kernel(self, q, k, v, bias, scale, key_padding_mask, out_scale=None):
        b, s, h, d = q.shape
        out = self._module.short_attention(q, k, v, bias, key_padding_mask, scale, out_scale=out_scale)
        return out.view(b, s, h, d)


#: Every backend, by name.
BACKENDS: dict[str, AttentionBackend] = {
    b.name: b
    for b in (_SdpaFlash(), _SdpaEfficient(), _SdpaCudnn(), _SdpaMath(), _FlashAttnPackage(), _Aiter(), _TritonShort())
}
