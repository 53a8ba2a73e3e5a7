"""Attention over variable-length sequences packed into one row buffer (``cu_seqlens`` offsets).

The padding-free path (``fusedenc.varlen.packing``) keeps only a batch's real tokens: ``T`` rows,
sequence ``i`` being rows ``cu_seqlens[i]:cu_seqlens[i + 1]``.  Each row attends to the
rows of its own sequence.  q, k and v are ``[T, H, Dh]`` views of the fused QKV GEMM's
``[T, 3D]`` output (row stride ``3D``, no copy), as on the padded path.

Backends (``VARLEN_BACKENDS``, chosen per call by ``choose``; ``FUSEDENC_VARLEN_ATTENTION``
or ``backend=`` forces one, for measuring):

``flash_varlen``
    PyTorch's own FlashAttention-2 variable-length kernel,
    ``torch.ops.aten._flash_attention_forward`` with ``cum_seq_q``/``cum_seq_k`` (the op
    ``torch.nn.attention.varlen.varlen_attn`` calls in the torch versions that have it; the
    aten op is in every torch fusedenc supports, so it is called directly, feature-detected
    at run time).  Reads the strided views as they are (only the last stride must be 1) and
    writes dense ``[T, H, Dh]``: the rows the output projection reads.  CUDA (not ROCm),
    sm80+, float16/bfloat16, head dim a multiple of 8 up to 256.  No host sync, so it can be
    captured in a CUDA graph (``max_seqlen`` is then fixed at capture: an upper bound).
``triton_short``
    fusedenc's one-tile Triton kernel (``attention/triton_short.py``) on offsets: one
    program per (query block, group of heads, sequence), every key of a sequence in one
    tile, so sequences of at most ``triton_short.MAX_SEQ`` (128) tokens; CUDA sm80+ or ROCm,
    float16/bfloat16/float32, head dims 16/32/64/128, the triton package.  No host sync.
    The default where the call's ``max_seqlen`` (or its graph bucket's bound) is at most
    ``SHORT_DEFAULT_MAX``: sentence batches, where flash's long-sequence machinery runs one
    short tile.
``padded``
    Scatters the rows into a zero-filled ``[N, max_seqlen, H, Dh]`` layout, runs
    ``fusedenc.attention`` with the matching key padding mask, and gathers the real rows
    back: correct everywhere (CPU, fp32, ROCm, any head dim), graph-capturable, but it pays
    the padded attention and two copies.  The fallback, and the CPU path.

Empty sequences (``cu_seqlens[i] == cu_seqlens[i + 1]``) are allowed and produce no rows.
Rows past ``cu_seqlens[-1]`` belong to no sequence (a graph bucket's slack): their output
is unspecified.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Optional

import torch

from ..common import dtypes
from ..common.device import device_facts
from .op import attention

__all__ = [
    "BACKEND_ENV",
    "SHORT_DEFAULT_MAX",
    "VARLEN_BACKENDS",
    "VarlenPlan",
    "choose",
    "reference_varlen_attention",
    "varlen_attention",
]

VARLEN_BACKENDS = ("flash_varlen", "triton_short", "padded")
#: Forces a varlen backend (one of ``VARLEN_BACKENDS``), e.g. to measure one against another.
BACKEND_ENV = "FUSEDENC_VARLEN_ATTENTION"
#: Sequences this short (a bound: a graph bucket's ``max_seqlen``) default to ``triton_short``:
#: one tile of keys per program, no online rescaling.  On an H200 at 32 sentences of ~25
#: tokens it took 35 us a MiniLM call against flash_varlen's 67 (bench/NOTES.md); on ROCm,
#: where flash_varlen is not built, it replaces the padded layout.
SHORT_DEFAULT_MAX = 128


def _flash_op():
    try:
        return torch.ops.aten._flash_attention_forward.default
    except (AttributeError, RuntimeError):
        return None


_FLASH = _flash_op()


@functools.lru_cache(maxsize=None)
def _flash_device_ok(device_type: str, index: int) -> Optional[str]:
    """None if the flash varlen kernel runs on this device, else why not."""
    if device_type != "cuda":
        return f"needs a CUDA GPU, got {device_type}"
    if _FLASH is None:
        return "this torch has no aten._flash_attention_forward"
    if not torch.backends.cuda.is_flash_attention_available():
        return "this torch build has no flash attention"
    arch, cap, rocm = device_facts(torch.device("cuda", index))
    if rocm:
        return "not used on ROCm (untested there)"
    if cap is None or cap < (8, 0):
        return f"needs sm80 or newer, got {arch}"
    return None


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda" else 0)


def flash_unusable(dtype: torch.dtype, head_dim: int, device: torch.device) -> Optional[str]:
    """None if ``flash_varlen`` can serve q of this dtype, head dim and device, else the reason."""
    why = _flash_device_ok(device.type, _device_index(device))
    if why is not None:
        return why
    if dtype not in (torch.float16, torch.bfloat16):
        return f"float16/bfloat16 only, got {dtype}"
    if head_dim % 8 or head_dim > 256:
        return f"head dim must be a multiple of 8 up to 256, got {head_dim}"
    return None


@functools.lru_cache(maxsize=None)
def _triton_module(device_type: str, index: int):
    """``triton_short`` if its kernel can run on this device, else why not (a str)."""
    if device_type != "cuda":
        return f"needs a GPU (CUDA or ROCm), got {device_type}"
    arch, cap, rocm = device_facts(torch.device("cuda", index))
    if not rocm and (cap is None or cap < (8, 0)):
        return f"needs sm80 or newer, got {arch}"
    try:
        from . import triton_short  # imports Triton: only when this backend is asked about
    except ImportError as exc:
        return f"needs the triton package ({exc})"
    return triton_short


def triton_unusable_on(device: torch.device) -> Optional[str]:
    """None if fusedenc's Triton kernels can run on ``device`` (CUDA sm80+ or ROCm, the
    triton package importable), else why not."""
    module = _triton_module(device.type, _device_index(device))
    return module if isinstance(module, str) else None


def triton_unusable(dtype: torch.dtype, head_dim: int, device: torch.device, max_seqlen: Optional[int]) -> Optional[str]:
    """None if ``triton_short`` can serve q of this dtype and head dim on ``device`` for
    sequences of at most ``max_seqlen`` tokens (None: not known yet), else the reason."""
    module = _triton_module(device.type, _device_index(device))
    if isinstance(module, str):
        return module
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"float16/bfloat16/float32 only, got {dtype}"
    if head_dim not in module.HEAD_DIMS:
        return f"head dim must be one of {module.HEAD_DIMS}, got {head_dim}"
    if max_seqlen is not None and max_seqlen > module.MAX_SEQ:
        return f"sequences must be at most {module.MAX_SEQ} tokens (all keys in one tile), got {max_seqlen}"
    return None


def choose(dtype: torch.dtype, head_dim: int, device: torch.device, backend: Optional[str] = None,
           max_seqlen: Optional[int] = None) -> str:  # fmt: skip
    """The varlen backend for q of this dtype, head dim and device (and sequences of at most
    ``max_seqlen``, where known): ``backend`` (or ``$FUSEDENC_VARLEN_ATTENTION``) if given
    (``ValueError`` if it cannot serve); else ``triton_short`` for sequences known to be at
    most ``SHORT_DEFAULT_MAX`` tokens where Triton runs, ``flash_varlen`` where it runs, else
    ``padded``."""
    forced = backend if backend is not None else (os.environ.get(BACKEND_ENV) or None)
    if forced is not None:
        if forced not in VARLEN_BACKENDS:
            raise ValueError(f"varlen attention backend {forced!r} is not one of {VARLEN_BACKENDS}")
        why = None
        if forced == "flash_varlen":
            why = flash_unusable(dtype, head_dim, device)
        elif forced == "triton_short":
            why = triton_unusable(dtype, head_dim, device, max_seqlen)
        if why is not None:
            raise ValueError(f"varlen attention backend {forced!r} cannot serve this call: {why}")
        return forced
    if max_seqlen is not None and max_seqlen <= SHORT_DEFAULT_MAX and triton_unusable(dtype, head_dim, device,
                                                                                     max_seqlen) is None:  # fmt: skip
        return "triton_short"
    return "flash_varlen" if flash_unusable(dtype, head_dim, device) is None else "padded"


# ------------------------------------------------------------ validation ----


def _check(q, k, v, cu_seqlens, max_seqlen, scale) -> None:
    for t, name in ((q, "q"), (k, "k"), (v, "v"), (cu_seqlens, "cu_seqlens")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dtype not in dtypes.SUPPORTED:
        raise TypeError(f"q.dtype={q.dtype} is not supported; use float16, bfloat16 or float32")
    for t, name in ((k, "k"), (v, "v")):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}.dtype={t.dtype} does not match q.dtype={q.dtype}")
        if t.shape != q.shape or t.device != q.device:
            raise ValueError(f"{name} is {tuple(t.shape)} on {t.device}; q is {tuple(q.shape)} on {q.device}")
    if q.dim() != 3 or q.shape[1] == 0 or q.shape[2] == 0:
        raise ValueError(f"q must be [T, H, Dh] with H, Dh > 0, got shape {tuple(q.shape)}")
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if t.stride(-1) != 1 and t.numel() > 0:
            raise ValueError(f"{name} must have unit stride in its last dimension, got strides {t.stride()}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be int32 [N + 1] with N >= 1 sequences, got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {q.device}")
    if not cu_seqlens.is_contiguous():
        raise ValueError("cu_seqlens must be contiguous")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise ValueError(f"max_seqlen must be an int >= 0, got {max_seqlen!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")


def check_offsets(cu: list[int], rows: int, max_seqlen: int) -> None:
    """The values of ``cu_seqlens`` (on the host): start at 0, never decrease, end at most at
    ``rows``, no sequence longer than ``max_seqlen``.  ``ValueError`` naming the first fault."""
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens[0] must be 0, got {cu[0]}")
    for i in range(len(cu) - 1):
        n = cu[i + 1] - cu[i]
        if n < 0:
            raise ValueError(f"cu_seqlens must not decrease: cu_seqlens[{i + 1}]={cu[i + 1]} < cu_seqlens[{i}]={cu[i]}")
        if n > max_seqlen:
            raise ValueError(f"sequence {i} has {n} rows, more than max_seqlen={max_seqlen}")
    if cu[-1] > rows:
        raise ValueError(f"cu_seqlens[-1]={cu[-1]} exceeds the {rows} rows given")


# ------------------------------------------------------------ kernels ----


def _flash(q, k, v, cu, max_seqlen, scale):
    out = _FLASH(q, k, v, cu, cu, max_seqlen, max_seqlen, 0.0, False, False, scale=scale)[0]
    return out.view(q.shape[0], -1)  # dense [T, H, Dh] -> [T, H*Dh]


def padded_positions(cu: torch.Tensor, rows: int, max_seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``rows`` packed rows: each row's index in a ``[N, max_seqlen]`` padded layout
    (rows past ``cu[-1]`` land in a trailing scratch slot ``N * max_seqlen``), and the
    ``[N, max_seqlen]`` key padding mask (True = padding).  On the device, no host sync."""
    cu64 = cu.long()
    n = cu.numel() - 1
    pos = torch.arange(rows, device=cu.device)
    seq = torch.searchsorted(cu64[1:], pos, right=True)
    inside = seq < n
    seq_c = seq.clamp(max=n - 1)
    flat = torch.where(inside, seq_c * max_seqlen + (pos - cu64[seq_c]), n * max_seqlen)
    lengths = cu64[1:] - cu64[:-1]
    mask = torch.arange(max_seqlen, device=cu.device)[None, :] >= lengths[:, None]
    return flat, mask


def _padded(q, k, v, cu, max_seqlen, scale):
    t, h, d = q.shape
    n = cu.numel() - 1
    if max_seqlen == 0:
        return q.new_zeros((t, h * d))
    flat, mask = padded_positions(cu, t, max_seqlen)

    def spread(x):
        buf = x.new_zeros((n * max_seqlen + 1, h, d))  # + 1: the scratch slot of rows outside every sequence
        buf.index_copy_(0, flat, x)
        return buf[:-1].view(n, max_seqlen, h, d)

    out = attention(spread(q), spread(k), spread(v), None, mask, scale=scale)  # [N * max_seqlen, H*Dh]
    return torch.cat([out, out.new_zeros((1, h * d))]).index_select(0, flat)


def _triton(q, k, v, cu, max_seqlen, scale):
    module = _triton_module(q.device.type, q.device.index)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    return module.short_varlen_attention(q, k, v, cu, max_seqlen, scale)


_KERNELS = {"flash_varlen": _flash, "triton_short": _triton, "padded": _padded}


# ------------------------------------------------------------ public ----


def _may_sync(t: torch.Tensor) -> bool:
    if torch.compiler.is_compiling():
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    scale: Optional[float] = None,
    backend: Optional[str] = None,
    check_values: bool = True,
) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` within each sequence of packed rows, as ``[T, H*Dh]``.

    q, k, v: ``[T, H, Dh]`` (unit last stride; typically views of a ``[T, 3D]`` QKV buffer).
    cu_seqlens: int32 ``[N + 1]`` on q's device, sequence i = rows ``cu[i]:cu[i + 1]``.
    max_seqlen: the longest sequence (an upper bound is fine).  ``check_values``: read
    cu_seqlens on the host to check its values (one sync; skipped while capturing a CUDA
    graph or compiling).  ``backend``: one of ``VARLEN_BACKENDS`` (see the module docstring).
    """
    _check(q, k, v, cu_seqlens, max_seqlen, scale)
    if check_values and _may_sync(cu_seqlens):
        check_offsets(cu_seqlens.tolist(), q.shape[0], max_seqlen)
    name = choose(q.dtype, q.shape[2], q.device, backend, max_seqlen)
    return _KERNELS[name](q, k, v, cu_seqlens, max_seqlen, scale)


class VarlenPlan:
    """The attention of an encoder block's packed rows: which sequences the rows form.

    Passed where a padded call passes its ``key_padding_mask`` (``EncoderBlock._prepared``
    recognizes it), so every data path of a block and a stack (plain, LayerNorm-folded,
    FP8) runs on packed rows unchanged; ``run`` is what the executors call.
    ``cu_seqlens``: int32 ``[N + 1]`` on the rows' device, values already checked.
    """

    __slots__ = ("cu_seqlens", "max_seqlen", "backend", "scale")
    writes_e4m3 = False  # FP8's static column codes come from the executor's pass

    def __init__(self, cu_seqlens: torch.Tensor, max_seqlen: int, backend: Optional[str] = None, scale=None):
        self.cu_seqlens = cu_seqlens
        self.max_seqlen = int(max_seqlen)
        self.backend = backend
        self.scale = scale

    def choose(self, dtype: torch.dtype, head_dim: int, device: torch.device) -> "VarlenPlan":
        """This plan with its backend decided for q of this dtype, head dim and device
        (``ValueError`` before any launch if a forced backend cannot serve)."""
        backend = choose(dtype, head_dim, device, self.backend, self.max_seqlen)
        return VarlenPlan(self.cu_seqlens, self.max_seqlen, backend, self.scale)

    def run(self, q, k, v, attn_bias=None, key_padding_mask=None):
        """q, k, v: ``[1, T, H, Dh]`` views (a block's packed rows as one "sequence" of T)."""
        if attn_bias is not None:
            raise ValueError("attn_bias is not supported on packed rows")
        q, k, v = q[0], k[0], v[0]
        name = self.backend or choose(q.dtype, q.shape[2], q.device, None, self.max_seqlen)
        return _KERNELS[name](q, k, v, self.cu_seqlens, self.max_seqlen, self.scale)


def reference_varlen_attention(q, k, v, cu_seqlens, scale: Optional[float] = None) -> torch.Tensor:
    """The math, in float32, one sequence at a time (tests' oracle): ``[T, H*Dh]`` float32;
    rows outside every sequence are zeros."""
    t, h, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros((t, h, d), dtype=torch.float32, device=q.device)
    cu = cu_seqlens.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        if b > a:
            qs, ks, vs = (x[a:b].float().transpose(0, 1) for x in (q, k, v))  # [H, n, Dh]
            p = torch.softmax(qs @ ks.transpose(1, 2) * scale, dim=-1)
            out[a:b] = (p @ vs).transpose(0, 1)
    return out.view(t, h * d)
