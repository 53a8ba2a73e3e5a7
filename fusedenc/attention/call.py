"""One attention call as the backends and tables see it: validation, buckets, the table key."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch

from ..common import dtypes
from ..common.device import device_facts

__all__ = [
    "BATCH_HEADS_BUCKETS",
    "EXTRAS",
    "SEQ_BUCKETS",
    "AttentionCall",
    "batch_heads_bucket",
    "describe_call",
    "seq_bucket",
    "table_key",
    "validate",
]

SEQ_BUCKETS = (64, 128, 256, 512, 1024, 2048)
BATCH_HEADS_BUCKETS = (16, 64, 256, 1024, 4096, 16384)
EXTRAS = ("none", "bias", "mask", "bias+mask")
#: q, k, v and bias pointers and strides the fused kernels read must be aligned to this.
ALIGN_BYTES = 16

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
        "dtype": dtypes.name(call.dtype),
        "head_dim": call.head_dim,
        "seq": seq_bucket(call.seq),
        "batch_heads": batch_heads_bucket(call.batch * call.heads),
        "extras": call.extras,
    }


# ------------------------------------------------------------ validation ----


def _check_tensor(t: object, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def validate(q, k, v, attn_bias, key_padding_mask, scale, backend, backend_names) -> None:
    """Every rule of ``attention``'s arguments, before anything launches: TypeError for types and
    dtypes, ValueError for the rest.  ``backend_names``: the names a forced backend may take."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_tensor(t, name)
    if q.dtype not in dtypes.SUPPORTED:
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
        if backend not in backend_names:
            raise ValueError(f"backend={backend!r} is not one of {sorted(backend_names)}")


def _aligned(t: torch.Tensor, align: int) -> bool:
    if t.data_ptr() % ALIGN_BYTES:
        return False
    return all(st % align == 0 for sz, st in zip(t.shape[:-1], t.stride()[:-1]) if sz > 1)


def describe_call(q, k, v, attn_bias, key_padding_mask) -> AttentionCall:
    """The facts of a validated call that the backends and the tables judge it by."""
    b, s, h, d = q.shape
    dev = q.device
    index = dev.index if dev.index is not None else (torch.cuda.current_device() if dev.type == "cuda" else 0)
    arch, cap, rocm = device_facts(torch.device(dev.type, index))
    align = ALIGN_BYTES // q.element_size()
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

