"""The attention call on fused-QKV views, and the table that picks its kernel.

``attention(q, k, v, attn_bias, key_padding_mask)`` takes q, k, v as the
``[B, S, H, Dh]`` views that ``fused_qkv`` returns (strided views of one packed
``[B, S, 3D]`` buffer) and returns ``[B*S, H*Dh]``, the rows the output
projection reads.  Several kernels can serve a call ("backends"); a table
keyed by GPU architecture, dtype, head dim, sequence-length bucket, batch*heads
bucket and bias/mask presence says which to prefer, and the first preferred
backend that supports the call wins.

Backends
--------
``sdpa_flash``, ``sdpa_efficient``, ``sdpa_cudnn``, ``sdpa_math``
    PyTorch's SDPA kernels, called as the aten ops that
    ``F.scaled_dot_product_attention`` dispatches to
    (``aten._scaled_dot_product_flash_attention`` and friends).  Calling them
    directly skips SDPA's selector and touches no global state, where
    ``sdpa_kernel([...])`` flips process-wide flags (not thread-safe, and about
    as costly as the kernel launch on the host).  The preparation SDPA would do
    (bool mask to additive bias, bias alignment padding) is done here instead.
    flash, efficient and cuDNN write their output in ``[B, S, H, Dh]`` memory
    order, so the ``[B*S, H*Dh]`` result is a view: no copy.  math writes
    ``[B, H, S, Dh]`` and its result is copied once.
``flash_attn``
    The flash-attn package (``flash_attn_qkvpacked_func`` when q, k and v are
    views of one packed ``[B, S, 3, H, Dh]`` buffer, else ``flash_attn_func``).
    No bias and no padding mask (its varlen interface would need the tokens
    unpadded first: not implemented).
``aiter``
    AMD AITER's ``flash_attn_func`` on ROCm.  No bias, no mask.  Not tested:
    no AMD GPU was available.
``triton_short``
    fusedenc's own Triton kernel for short sequences (``fusedenc.triton_attention``,
    S <= 128): all keys of a sequence in one tile, q, k, v read from the packed
    views, the bias read as given (any strides, q's dtype or float32) and the
    bool mask read in-kernel, output written as ``[B*S, H*Dh]`` rows.  Needs the
    triton package; CUDA and ROCm.  The shipped sm90 table puts it first where
    it measured fastest on an H100 (up to 64 tokens from 4096 batch*heads up,
    and up to 128 tokens with a bias or padding mask); elsewhere it runs where
    a measured user table puts it, or when forced.  The first call with a new
    head dim, tile size, dtype or bias/mask combination compiles the kernel
    (seconds; once per process, then from Triton's disk cache).

Key padding and fully masked rows
---------------------------------
``key_padding_mask[b, j] = True`` removes key ``j`` of sequence ``b`` (the
``nn.MultiheadAttention`` convention).  It becomes ``-inf`` in an additive
bias.  A query row whose keys are all removed (a sequence that is all
padding, or ``-inf`` across a whole row of ``attn_bias``) yields **zeros**, as
``nn.TransformerEncoderLayer`` gives on its SDPA path.  Only backends that
produce those zeros natively accept masks (sdpa_efficient, sdpa_cudnn,
sdpa_math and triton_short: checked by the GPU tests), so the result never
depends on which backend ran.

Choosing, caching, forcing
--------------------------
The first call with a new signature (shapes, strides, dtypes, devices,
alignment, scale, forced backend) validates the arguments, reads the tables
(once per architecture) and makes a plan; later calls with that signature do a
dict lookup and launch.  ``FUSEDENC_ATTENTION_BACKEND=<name>`` or
``backend=<name>`` forces a backend and raises ``ValueError`` if it cannot
serve the call.  The variable is read when a plan is made: after changing it
in a running process, call ``clear_cache()``.  ``explain()`` says what would
run and why.

Tables: ``fusedenc/configs/attention_<arch>.json`` ships with the package
(else ``attention_default.json``); ``python -m fusedenc.tune attention``
writes a measured user table to ``$FUSEDENC_CONFIG_DIR/attention_<arch>.json``
(default ``~/.cache/fusedenc``), whose rules are tried before the shipped ones.
A user table measured on another device or library version, or one that does
not parse, is ignored with one ``AttentionTableWarning`` per file and process.

Inference only: no autograd.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.resources
import math
import os
import threading
from typing import Any, Callable, NamedTuple, Optional

import torch

# Directory of user tables ($FUSEDENC_CONFIG_DIR, default ~/.cache/fusedenc),
# shared with the GEMM tuning files.
from . import _native
from ._native import CONFIG_DIR_ENV, config_dir  # noqa: F401 - CONFIG_DIR_ENV re-exported

__all__ = [
    "BACKENDS",
    "FALLBACK_ORDER",
    "AttentionBackend",
    "AttentionCall",
    "AttentionTableWarning",
    "Candidate",
    "Explanation",
    "attention",
    "clear_cache",
    "device_arch",
    "device_metadata",
    "explain",
    "table_key",
    "user_table_path",
]

#: Schema tag of every table file; a file with another tag is ignored.
TABLE_SCHEMA = "fusedenc.attention-table/1"
#: Environment variable that forces a backend for every call (A/B runs).
BACKEND_ENV = "FUSEDENC_ATTENTION_BACKEND"

#: Tried after the tables' entries, in this order; math serves every call.
FALLBACK_ORDER = ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math")

SEQ_BUCKETS = (64, 128, 256, 512, 1024, 2048)
BATCH_HEADS_BUCKETS = (16, 64, 256, 1024, 4096, 16384)
EXTRAS = ("none", "bias", "mask", "bias+mask")
METADATA_KEYS = ("device_name", "multiprocessor_count", "torch", "cuda", "hip", "cudnn")

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_ALIGN_BYTES = 16
#: Bias rows handed to the fused kernels are padded to this many elements
#: (what SDPA itself does); the memory-efficient kernel rejects other strides.
_BIAS_ROW_ALIGN = 16


class AttentionTableWarning(UserWarning):
    """A user attention table was ignored (other device/library, or unreadable)."""


def _bucket(value: int, bounds: tuple[int, ...]) -> str:
    for b in bounds:
        if value <= b:
            return f"<={b}"
    return f">{bounds[-1]}"


def seq_bucket(seq: int) -> str:
    """The table's sequence-length bucket: '<=64', '<=128', ..., '<=2048', '>2048'."""
    return _bucket(seq, SEQ_BUCKETS)


def batch_heads_bucket(batch_heads: int) -> str:
    """The table's batch*heads bucket: '<=16', '<=64', ... (powers of 4), '>16384'."""
    return _bucket(batch_heads, BATCH_HEADS_BUCKETS)


SEQ_BUCKET_NAMES = tuple(seq_bucket(b) for b in SEQ_BUCKETS) + (f">{SEQ_BUCKETS[-1]}",)
BATCH_HEADS_BUCKET_NAMES = tuple(batch_heads_bucket(b) for b in BATCH_HEADS_BUCKETS) + (
    f">{BATCH_HEADS_BUCKETS[-1]}",
)


# ------------------------------------------------------------ the call ----


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """What a backend needs to know to say whether it can serve a call."""

    device_type: str  # "cpu" or "cuda" (ROCm devices are "cuda" too)
    device_index: int
    arch: str  # "cpu", "sm90", "gfx942", ...
    rocm: bool
    capability: Optional[tuple[int, int]]  # CUDA compute capability, None elsewhere
    dtype: torch.dtype
    batch: int
    seq: int
    heads: int
    head_dim: int
    has_bias: bool
    bias_dtype: Optional[torch.dtype]
    bias_batch: int  # 1 (broadcast over batch) or batch; 0 without bias
    has_mask: bool
    aligned: bool  # q, k, v: 16-byte aligned pointers, strides and head dim
    packed: bool  # q, k, v were views of one [B, S, 3, H, Dh] buffer (informational)

    @property
    def extras(self) -> str:
        if self.has_bias and self.has_mask:
            return "bias+mask"
        return "bias" if self.has_bias else ("mask" if self.has_mask else "none")


def table_key(call: AttentionCall) -> dict[str, Any]:
    """The table key of a call: arch, dtype, head_dim, seq and batch_heads buckets, extras."""
    return {
        "arch": call.arch,
        "dtype": _DTYPE_NAMES[call.dtype],
        "head_dim": call.head_dim,
        "seq": seq_bucket(call.seq),
        "batch_heads": batch_heads_bucket(call.batch * call.heads),
        "extras": call.extras,
    }


# ------------------------------------------------------------ devices ----


@functools.lru_cache(maxsize=None)
def _device_facts(device_type: str, index: int) -> tuple[str, Optional[tuple[int, int]], bool]:
    if device_type != "cuda":
        return device_type, None, False
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip:
        arch = getattr(props, "gcnArchName", "") or "gfx-unknown"
        return arch.split(":")[0], None, True
    return f"sm{props.major}{props.minor}", (props.major, props.minor), False


def device_arch(device: torch.device | str) -> str:
    """'sm90' for an H100, the gfx name ('gfx942') on ROCm, 'cpu' for CPU tensors."""
    device = torch.device(device)
    index = device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda" else 0)
    return _device_facts(device.type, index)[0]


def device_metadata(device: torch.device | str) -> dict[str, Any]:
    """What a measured table records and is matched against: device, SM count, library versions."""
    device = torch.device(device)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        name, count = props.name, props.multi_processor_count
    else:
        name, count = device.type, os.cpu_count()
    return {
        "device_name": name,
        "multiprocessor_count": count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "cudnn": cudnn,
    }


def user_table_path(device: torch.device | str = "cuda") -> str:
    """Where the tuner writes, and the loader reads, the user table of ``device``'s architecture."""
    return _user_table_file(device_arch(device))


def _user_table_file(arch: str) -> str:
    return os.path.join(config_dir(), f"attention_{arch}.json")


# ------------------------------------------------------------ backends ----

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
    in that memory order.
    """

    name = "abstract"
    bshd_input = False  # kernel takes q, k, v as [B, S, H, Dh]
    accepts_bias = False  # takes an additive [B, H, S, S] bias (masks arrive merged into it)
    aligned_bias = False  # that bias needs 16-element-aligned strides (padded rows)
    native_mask = False  # reads the caller's bias and bool mask itself: nothing merged or copied
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


def _try_import(name: str):
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - any failure means "not usable here"
        return None


class _ImportedBackend(AttentionBackend):
    """A backend whose kernels come from a module imported on first use (an optional package)."""

    package = ""

    def _importable_here(self) -> bool:
        return _gpu_present()

    @functools.cached_property
    def _module(self):
        return _try_import(self.package) if self._importable_here() else None

    def available(self) -> bool:
        return self._module is not None


class _FlashAttnPackage(_ImportedBackend):
    name = "flash_attn"
    package = "flash_attn"
    bshd_input = True
    description = "flash-attn package: flash_attn_qkvpacked_func on packed views, else flash_attn_func"

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
    package = "aiter"
    bshd_input = True
    description = "AMD AITER flash_attn_func (ROCm only; untested, no AMD GPU was available)"

    def _importable_here(self) -> bool:
        return _gpu_present() and bool(torch.version.hip)

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
    package = "fusedenc.triton_attention"
    bshd_input = True
    native_mask = True
    description = "fusedenc.triton_attention: one-tile Triton kernel for short sequences (bias and mask read in-kernel)"

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

    def kernel(self, q, k, v, bias, scale, key_padding_mask):
        b, s, h, d = q.shape
        return self._module.short_attention(q, k, v, bias, key_padding_mask, scale).view(b, s, h, d)


#: Every backend, by name.
BACKENDS: dict[str, AttentionBackend] = {
    b.name: b
    for b in (_SdpaFlash(), _SdpaEfficient(), _SdpaCudnn(), _SdpaMath(), _FlashAttnPackage(), _Aiter(), _TritonShort())
}


# ------------------------------------------------------------ validation ----


def _check_tensor(t: object, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _validate(q, k, v, attn_bias, key_padding_mask, scale, backend) -> None:
    """Every rule, before anything launches: TypeError for types/dtypes, ValueError for the rest."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_tensor(t, name)
    if q.dtype not in _DTYPE_NAMES:
        raise TypeError(f"q.dtype={q.dtype} is not supported; use float16, bfloat16 or float32")
    for t, name in ((k, "k"), (v, "v")):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}.dtype={t.dtype} does not match q.dtype={q.dtype}")
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, S, H, Dh], got shape {tuple(t.shape)}")
    for t, name in ((k, "k"), (v, "v")):
        if t.shape != q.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but q has {tuple(q.shape)}; they must be equal")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    b, s, h, d = q.shape
    if h == 0 or d == 0:
        raise ValueError(f"q must have at least one head and a positive head dim, got shape {tuple(q.shape)}")
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if t.stride(-1) != 1 and t.numel() > 0:
            raise ValueError(f"{name} must have unit stride in its last dimension, got strides {t.stride()}")
    if attn_bias is not None:
        _check_tensor(attn_bias, "attn_bias")
        if attn_bias.dtype not in (q.dtype, torch.float32):
            raise TypeError(f"attn_bias.dtype={attn_bias.dtype} must be q.dtype={q.dtype} or float32")
        if attn_bias.dim() != 4 or attn_bias.shape[0] not in (1, b) or tuple(attn_bias.shape[1:]) != (h, s, s):
            raise ValueError(
                f"attn_bias must have shape ({b} or 1, {h}, {s}, {s}) [B or 1, H, S, S], got {tuple(attn_bias.shape)}"
            )
        if attn_bias.device != q.device:
            raise ValueError(f"attn_bias is on {attn_bias.device} but q is on {q.device}")
    if key_padding_mask is not None:
        _check_tensor(key_padding_mask, "key_padding_mask")
        if key_padding_mask.dtype != torch.bool:
            raise TypeError(f"key_padding_mask must be a bool tensor (True = padding), got {key_padding_mask.dtype}")
        if tuple(key_padding_mask.shape) != (b, s):
            raise ValueError(f"key_padding_mask must have shape ({b}, {s}) [B, S], got {tuple(key_padding_mask.shape)}")
        if key_padding_mask.device != q.device:
            raise ValueError(f"key_padding_mask is on {key_padding_mask.device} but q is on {q.device}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
        if not math.isfinite(scale):
            raise ValueError(f"scale={scale} is not finite")
    if backend is not None:
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str or None, got {type(backend).__name__}")
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not one of {sorted(BACKENDS)}")


def _aligned(t: torch.Tensor, align: int) -> bool:
    if t.data_ptr() % _ALIGN_BYTES:
        return False
    return all(st % align == 0 for sz, st in zip(t.shape[:-1], t.stride()[:-1]) if sz > 1)


def _describe(q, k, v, attn_bias, key_padding_mask) -> AttentionCall:
    b, s, h, d = q.shape
    dev = q.device
    index = dev.index if dev.index is not None else (torch.cuda.current_device() if dev.type == "cuda" else 0)
    arch, cap, rocm = _device_facts(dev.type, index)
    align = _ALIGN_BYTES // q.element_size()
    aligned = d % align == 0 and all(_aligned(t, align) for t in (q, k, v))
    item = q.element_size()
    packed = (
        q.stride() == k.stride() == v.stride()
        and q.stride(2) == d
        and k.data_ptr() - q.data_ptr() == h * d * item
        and v.data_ptr() - q.data_ptr() == 2 * h * d * item
    )
    return AttentionCall(
        device_type=dev.type,
        device_index=index,
        arch=arch,
        rocm=rocm,
        capability=cap,
        dtype=q.dtype,
        batch=b,
        seq=s,
        heads=h,
        head_dim=d,
        has_bias=attn_bias is not None,
        bias_dtype=None if attn_bias is None else attn_bias.dtype,
        bias_batch=0 if attn_bias is None else attn_bias.shape[0],
        has_mask=key_padding_mask is not None,
        aligned=aligned,
        packed=packed,
    )


# ------------------------------------------------------------ tables ----


_MATCH_FIELDS = ("dtype", "head_dim", "seq", "batch_heads", "extras")


class _TableError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class _Table:
    path: str
    kind: str  # "user" or "shipped"
    source: str
    rules: tuple[dict, ...]

    def match(self, key: dict) -> Optional[dict]:
        for rule in self.rules:
            m = rule.get("match", {})
            if all(m.get(field, "*") in ("*", key[field]) for field in _MATCH_FIELDS):
                return rule
        return None


def _parse_table(text: str, path: str, kind: str, arch: str) -> tuple[_Table, Optional[dict]]:
    obj, measured = _native.parse_file_header(
        text, TABLE_SCHEMA, (arch, "*"), arch, METADATA_KEYS, _TableError, measured_optional=True
    )
    if kind == "user" and measured is None:
        raise _TableError("a user table must say what it was measured with (measured_with)")
    rules = obj.get("rules")
    if not isinstance(rules, list):
        raise _TableError("rules must be a list")
    allowed = {
        "dtype": set(_DTYPE_NAMES.values()),
        "seq": set(SEQ_BUCKET_NAMES),
        "batch_heads": set(BATCH_HEADS_BUCKET_NAMES),
        "extras": set(EXTRAS),
    }
    for i, rule in enumerate(rules):
        if not isinstance(rule, dict) or not isinstance(rule.get("match", {}), dict):
            raise _TableError(f"rules[{i}] must be an object with a 'match' object")
        for field, value in rule.get("match", {}).items():
            if value == "*":
                continue
            if field == "head_dim":
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    raise _TableError(f"rules[{i}].match.head_dim={value!r} is not a positive int or '*'")
            elif field not in allowed:
                raise _TableError(f"rules[{i}].match has unknown field {field!r}")
            elif value not in allowed[field]:
                raise _TableError(f"rules[{i}].match.{field}={value!r} is not one of {sorted(allowed[field])}")
        names = rule.get("backends")
        if not isinstance(names, list) or not names or not all(n in BACKENDS for n in names):
            raise _TableError(f"rules[{i}].backends must be a non-empty list of names from {sorted(BACKENDS)}")
    return _Table(path, kind, str(obj.get("source", "")), tuple(rules)), measured


_warned_paths: set[str] = set()


def _warn_ignored(path: str, why: str) -> None:
    _native.warn_once_per_file(
        _warned_paths, path,
        f"fusedenc: ignoring attention table {path}: {why}. Re-run `python -m fusedenc.tune attention` "
        "on this machine to measure a new one; until then the shipped table is used.",
        AttentionTableWarning,
        stacklevel=7,  # the caller of attention()
    )  # fmt: skip


def _load_shipped(arch: str) -> Optional[_Table]:
    root = importlib.resources.files("fusedenc.configs")
    for name in (f"attention_{arch}.json", "attention_default.json"):
        res = root / name
        if res.is_file():
            wanted = "*" if name == "attention_default.json" else arch
            table, _ = _parse_table(res.read_text(encoding="utf-8"), str(res), "shipped", wanted)
            return table
    return None


def _load_user(arch: str, device: torch.device) -> Optional[_Table]:
    path = _user_table_file(arch)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        _warn_ignored(path, f"cannot be read ({exc})")
        return None
    try:
        table, measured = _parse_table(text, path, "user", arch)
    except _TableError as exc:
        _warn_ignored(path, str(exc))
        return None
    diffs = _native.metadata_differences(measured, device_metadata(device), METADATA_KEYS)
    if diffs:
        _warn_ignored(path, "measured on another device or library version (" + "; ".join(diffs) + ")")
        return None
    return table


_tables: dict[tuple[str, int], tuple[Optional[_Table], Optional[_Table]]] = {}
_lock = threading.Lock()


def _tables_for(call: AttentionCall) -> tuple[Optional[_Table], Optional[_Table]]:
    """(user table, shipped table) of the call's device, each loaded once."""
    key = (call.device_type, call.device_index)
    found = _tables.get(key)
    if found is None:
        with _lock:
            found = _tables.get(key)
            if found is None:
                dev = torch.device(call.device_type, call.device_index)
                found = (_load_user(call.arch, dev), _load_shipped(call.arch))
                _tables[key] = found
    return found


# ------------------------------------------------------------ choice ----


class Candidate(NamedTuple):
    name: str
    source: str  # "user table", "shipped table" or "fallback order"
    available: bool
    supported: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class Explanation:
    """Which backend serves a call, and why."""

    backend: str
    reason: str
    key: dict
    call: AttentionCall
    user_table: Optional[str]  # path of the user table consulted, None if none was valid
    shipped_table: Optional[str]
    user_rule: Optional[dict]
    shipped_rule: Optional[dict]
    candidates: tuple[Candidate, ...]

    def __str__(self) -> str:
        lines = [f"attention backend: {self.backend} ({self.reason})", f"table key: {self.key}"]
        tables = (("user", self.user_table, self.user_rule), ("shipped", self.shipped_table, self.shipped_rule))
        for kind, path, rule in tables:
            lines.append(f"{kind} table: {path or 'none'}; rule: {rule.get('match') if rule else None}")
        for c in self.candidates:
            if c.available and c.supported:
                state = "ok"
            else:
                state = "not available" if not c.available else f"unsupported: {c.reason}"
            lines.append(f"  {c.name:15s} [{c.source}] {state}")
        return "\n".join(lines)


def _check_backend(b: AttentionBackend, call: AttentionCall) -> tuple[bool, bool, str]:
    if not b.available():
        return False, False, "not available (not installed, or no device it runs on)"
    ok, why = b.supports(call)
    return True, ok, why


def _decide(call: AttentionCall, forced: Optional[str]) -> Explanation:
    key = table_key(call)
    env = os.environ.get(BACKEND_ENV, "").strip() if forced is None else ""
    name = forced or env or None
    if name is not None:
        how = "forced by backend=" if forced else f"forced by {BACKEND_ENV}"
        if name not in BACKENDS:
            raise ValueError(f"{how}{name!r}: unknown attention backend; choose from {sorted(BACKENDS)}")
        b = BACKENDS[name]
        available, supported, why = _check_backend(b, call)
        if not (available and supported):
            raise ValueError(f"attention backend {name!r} ({how}) cannot serve this call: {why} (table key {key})")
        cand = (Candidate(name, "forced", True, True, ""),)
        return Explanation(name, how + name, key, call, None, None, None, None, cand)

    user, shipped = _tables_for(call)
    user_rule = user.match(key) if user else None
    shipped_rule = shipped.match(key) if shipped else None
    order: list[tuple[str, str]] = []
    seen: set[str] = set()
    for source, names in (
        ("user table", user_rule["backends"] if user_rule else ()),
        ("shipped table", shipped_rule["backends"] if shipped_rule else ()),
        ("fallback order", FALLBACK_ORDER),
    ):
        for n in names:
            if n not in seen:
                seen.add(n)
                order.append((n, source))
    candidates = []
    chosen = None
    for n, source in order:
        available, supported, why = _check_backend(BACKENDS[n], call)
        candidates.append(Candidate(n, source, available, supported, why))
        if chosen is None and available and supported:
            chosen = (n, source)
    assert chosen is not None, "sdpa_math serves every call"
    return Explanation(
        chosen[0],
        f"first usable entry, from the {chosen[1]}",
        key,
        call,
        user.path if user else None,
        shipped.path if shipped else None,
        user_rule,
        shipped_rule,
        tuple(candidates),
    )


# ------------------------------------------------------------ plans ----


def _bias_direct_ok(bias: torch.Tensor, dtype: torch.dtype, aligned: bool) -> bool:
    """Whether the kernel can read the caller's bias as it is."""
    if bias.dtype != dtype or bias.stride(-1) != 1:
        return False
    if not aligned:
        return True
    return bias.data_ptr() % _ALIGN_BYTES == 0 and all(
        st % _BIAS_ROW_ALIGN == 0 for sz, st in zip(bias.shape[1:-1], bias.stride()[1:-1]) if sz > 1
    ) and (bias.shape[0] == 1 or bias.stride(0) % _BIAS_ROW_ALIGN == 0)


_consts: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}


def _constants(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """0-dim -inf and 0 on ``device`` (CPU scalars would be copied to the GPU on every call,
    which CUDA-graph capture forbids).  Made once per device and dtype outside capture; inside
    a capture they are made in the graph's pool and not kept."""
    c = _consts.get((device, dtype))
    if c is None:
        c = (torch.full((), -math.inf, dtype=dtype, device=device), torch.zeros((), dtype=dtype, device=device))
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()  # readable from any stream from now on
            _consts[(device, dtype)] = c
    return c


def _make_bias_fn(call: AttentionCall, backend: AttentionBackend, attn_bias) -> Callable:
    """A function (bias, mask) -> additive [B, H, S, S] bias in q's dtype, or None."""
    b, s, h = call.batch, call.seq, call.heads
    dtype = call.dtype
    full = (b, h, s, s)
    if not backend.accepts_bias or not (call.has_bias or call.has_mask):
        return lambda bias, mask: None
    sp = -(-s // _BIAS_ROW_ALIGN) * _BIAS_ROW_ALIGN if backend.aligned_bias else s

    if call.has_bias and not call.has_mask:
        if _bias_direct_ok(attn_bias, dtype, backend.aligned_bias):
            if call.bias_batch == b:
                return lambda bias, mask: bias
            return lambda bias, mask: bias.expand(full)

        def copied(bias, mask):  # cast and/or re-pad once
            buf = torch.empty((call.bias_batch, h, s, sp), dtype=dtype, device=bias.device)[..., :s]
            buf.copy_(bias)
            return buf.expand(full)

        return copied

    if call.has_mask and not call.has_bias:

        def mask_only(bias, mask):  # one kernel: [B, 1, 1, S] of -inf / 0, broadcast over heads and queries
            buf = torch.empty((b, 1, 1, sp), dtype=dtype, device=mask.device)[..., :s]
            neg_inf, zero = _constants(mask.device, dtype)
            torch.where(mask.reshape(b, 1, 1, s), neg_inf, zero, out=buf)
            return buf.expand(full)

        return mask_only

    if call.bias_dtype == dtype and attn_bias.stride(-1) == 1 and sp == s:

        def bias_and_mask(bias, mask):  # one kernel, broadcast over batch; rows need no padding
            return bias.masked_fill(mask.reshape(b, 1, 1, s), -math.inf)

        return bias_and_mask

    def bias_copy_and_mask(bias, mask):  # cast and/or pad rows, then mask: two kernels
        buf = torch.empty((b, h, s, sp), dtype=dtype, device=bias.device)[..., :s]
        buf.copy_(bias)
        return buf.masked_fill_(mask.reshape(b, 1, 1, s), -math.inf)

    return bias_copy_and_mask


class _Plan:
    """Everything decided for one call signature; ``run`` is the per-call hot path."""

    __slots__ = ("backend", "kernel", "bias_fn", "scale", "rows", "cols", "bshd", "bshd_input", "native_mask", "empty")

    def __init__(self, call: AttentionCall, backend: AttentionBackend, attn_bias, scale):
        self.backend = backend
        self.kernel = backend.kernel
        self.native_mask = backend.native_mask
        self.bias_fn = None if backend.native_mask else _make_bias_fn(call, backend, attn_bias)
        self.scale = float(scale) if scale is not None else 1.0 / math.sqrt(call.head_dim)
        b, s, h, d = call.batch, call.seq, call.heads, call.head_dim
        self.rows, self.cols = b * s, h * d
        # [B, H, S, Dh] strides of a tensor whose memory is [B, S, H, Dh]
        self.bshd = (s * h * d, d, h * d, 1)
        self.bshd_input = backend.bshd_input
        self.empty = b * s == 0

    def run(self, q, k, v, attn_bias, key_padding_mask):
        if self.empty:
            return q.new_empty((self.rows, self.cols))
        if self.native_mask:  # bias and mask go in as the caller gave them; [B, S, H, Dh] comes out
            out = self.kernel(q, k, v, attn_bias, self.scale, key_padding_mask)
            return out.reshape(self.rows, self.cols)  # a view: the kernel wrote it densely
        bias = self.bias_fn(attn_bias, key_padding_mask)
        if self.bshd_input:
            out = self.kernel(q, k, v, bias, self.scale)  # [B, S, H, Dh]
            return out.reshape(self.rows, self.cols)  # a view when the kernel wrote it densely
        out = self.kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bias, self.scale)
        if out.stride() == self.bshd:  # flash, efficient, cuDNN: already [B, S, H, Dh] in memory
            return out.as_strided((self.rows, self.cols), (self.cols, 1))
        # math: one copy into dense rows.  Not reshape(): when the copy is not needed reshape
        # returns a view whose strides need not be row-major (B == 1, Dh == 1 gave column
        # stride S), and the output projection reads the result as dense rows.
        return out.transpose(1, 2).contiguous().view(self.rows, self.cols)


_plans: dict[tuple, _Plan] = {}
_MAX_PLANS = 4096


def _signature(q, k, v, attn_bias, key_padding_mask, scale, backend) -> tuple:
    # Everything validation and the decision depend on; cheap attribute reads only.
    sig = (
        type(q), type(k), type(v), q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
        q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(),
        q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15,
        scale, backend,
    )  # fmt: skip
    if attn_bias is not None:
        b = attn_bias
        sig += (type(b), b.dtype, b.device, b.shape, b.stride(), b.data_ptr() & 15)
    else:
        sig += (None,)
    if key_padding_mask is not None:
        sig += (type(key_padding_mask), key_padding_mask.dtype, key_padding_mask.device, key_padding_mask.shape)
    return sig


def _plan_for(q, k, v, attn_bias, key_padding_mask, scale, backend) -> _Plan:
    try:
        sig = _signature(q, k, v, attn_bias, key_padding_mask, scale, backend)
        plan = _plans.get(sig)
    except (AttributeError, TypeError, RuntimeError):  # not tensors, or unhashable scale: validation says which
        sig, plan = None, None
    if plan is not None:
        return plan
    _validate(q, k, v, attn_bias, key_padding_mask, scale, backend)
    call = _describe(q, k, v, attn_bias, key_padding_mask)
    chosen = _decide(call, backend)
    plan = _Plan(call, BACKENDS[chosen.backend], attn_bias, scale)
    if sig is not None:
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        _plans[sig] = plan
    return plan


def _attention(q, k, v, attn_bias, key_padding_mask, scale, backend) -> torch.Tensor:
    return _plan_for(q, k, v, attn_bias, key_padding_mask, scale, backend).run(q, k, v, attn_bias, key_padding_mask)


# ------------------------------------------------------------ custom op ----


@torch.library.custom_op("fusedenc::attention", mutates_args=())
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_bias: Optional[torch.Tensor],
    key_padding_mask: Optional[torch.Tensor],
    scale: Optional[float],
    backend: Optional[str],
) -> torch.Tensor:
    return _attention(q, k, v, attn_bias, key_padding_mask, scale, backend)


@_attention_op.register_fake
def _attention_fake(q, k, v, attn_bias, key_padding_mask, scale, backend):
    _validate(q, k, v, attn_bias, key_padding_mask, scale, backend)
    b, s, h, d = q.shape
    return q.new_empty((b * s, h * d))


# ------------------------------------------------------------ public ----


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_bias: Optional[torch.Tensor] = None,
    key_padding_mask: Optional[torch.Tensor] = None,
    *,
    scale: Optional[float] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """``softmax(q k^T * scale + attn_bias + mask) v`` for self-attention, as ``[B*S, H*Dh]`` rows.

    q, k, v: ``[B, S, H, Dh]`` with unit last stride, same dtype (float16,
    bfloat16, float32) and device; typically the views ``fused_qkv`` returns.
    attn_bias: optional additive ``[B or 1, H, S, S]`` in q's dtype or float32
    (float32 costs one cast per call on the fused backends).
    key_padding_mask: optional bool ``[B, S]``, True = that key is padding.
    Query rows with every key masked come out as zeros.
    scale: defaults to ``1/sqrt(Dh)``.  backend: force one of ``BACKENDS``
    (``ValueError`` if it cannot serve the call).

    The result is in ``(B, S, H, Dh)`` row-major order, what the output
    projection reads; for sdpa_flash, sdpa_efficient, sdpa_cudnn, flash_attn
    and triton_short it is a view of the kernel's output (no copy).  Works
    eagerly, in CUDA-graph capture and under ``torch.compile(fullgraph=True)``
    (as the custom op ``torch.ops.fusedenc.attention``).  Inference only: no
    autograd.
    """
    if torch.compiler.is_compiling():
        return torch.ops.fusedenc.attention(q, k, v, attn_bias, key_padding_mask, scale, backend)
    return _attention(q, k, v, attn_bias, key_padding_mask, scale, backend)


def explain(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_bias: Optional[torch.Tensor] = None,
    key_padding_mask: Optional[torch.Tensor] = None,
    *,
    scale: Optional[float] = None,
    backend: Optional[str] = None,
) -> Explanation:
    """Which backend ``attention`` would run for these arguments, and why (launches nothing).

    Raises what ``attention`` would raise for invalid arguments or an
    unusable forced backend.  ``str()`` of the result is a readable report.
    """
    _validate(q, k, v, attn_bias, key_padding_mask, scale, backend)
    return _decide(_describe(q, k, v, attn_bias, key_padding_mask), backend)


def clear_cache() -> None:
    """Forget loaded tables and cached decisions (re-reads tables and FUSEDENC_ATTENTION_BACKEND)."""
    with _lock:
        _plans.clear()
        _tables.clear()
