"""Static-scale e4m3 codes in one pass: ``e4m3(x * out_scale[column])``, saturated.

``fusedenc.fp8.rowwise.e4m3_columns`` is what a producer with static FP8 scales writes
(FFN1's epilogue, the Triton attention kernel).  Where the producer cannot
write it (an activation the FP8 epilogue does not apply, such as exact GELU;
an attention backend other than ``triton_short``) the codes are made by a pass
over the 16-bit output.  In torch ops that pass is three kernels with an fp32
intermediate (multiply, clamp, convert: ~19 bytes moved per element); here it
is one kernel reading 2 bytes and writing 1 per element, so the static path
costs what the per-row quantization of the dynamic path does (measured on
bert-base, whose GELU FFN1 and cuDNN attention both take the pass: the torch
form halved the static FP8 mode's speed, bench/NOTES.md).

Math, the torch form's bit for bit: ``x`` (16-bit or fp32) upcast to fp32,
times the fp32 scale, clamped to +-448 (NaN stays NaN), one round-to-nearest-even
conversion to OCP e4m3 (``torch.float8_e4m3fn``).  Only that flavour: MI300's
FNUZ codes take the torch form.

Importing this module imports Triton; ``fusedenc.fp8.rowwise`` imports it only for a
CUDA tensor.  Set ``TRITON_INTERPRET=1`` before the import to run it on CPU
tensors (the tests do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["e4m3_columns"]

_E4M3_MAX = tl.constexpr(448.0)


@triton.jit
def _e4m3_columns_kernel(x_ptr, scale_ptr, out_ptr, rows, cols, x_rs, out_rs,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    r = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # rows * stride can pass 2**31
    c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (r < rows)[:, None] & (c < cols)[None, :]
    x = tl.load(x_ptr + r[:, None] * x_rs + c[None, :], mask=ok, other=0.0).to(tl.float32)
    s = tl.load(scale_ptr + c, mask=c < cols, other=0.0)
    y = x * s[None, :]
    y = tl.where(y > _E4M3_MAX, _E4M3_MAX, tl.where(y < -_E4M3_MAX, -_E4M3_MAX, y))  # NaN fails both: stays NaN
    tl.store(out_ptr + r[:, None] * out_rs + c[None, :], y.to(out_ptr.dtype.element_ty), mask=ok)


def e4m3_columns(x: torch.Tensor, out_scale: torch.Tensor) -> torch.Tensor:
    """OCP e4m3 codes of ``x * out_scale`` per column, saturated, as a new ``[M, N]`` tensor.

    ``x``: 2-D float16/bfloat16/float32 with a unit column stride; ``out_scale``:
    contiguous float32 ``[N]`` on ``x``'s device.  Not validated here:
    ``fusedenc.fp8.rowwise.e4m3_columns`` checks what it sends."""
    return launch(x, out_scale, torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device))


def launch(x: torch.Tensor, out_scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The kernel into ``out`` (``[M, N]``, unit column stride): e4m3 codes, or with a float32
    ``out`` the saturated products before the conversion (the interpreter tests: Triton
    3.9's interpreter rounds to e4m3 without carrying into the next binade, 124.4 -> 64)."""
    rows, cols = x.shape
    if out.numel() == 0:
        return out
    block_m, block_n = 16, 128  # 8 KB of 16-bit input a program; 4 warps, 16 elements a thread
    grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, block_n))
    _e4m3_columns_kernel[grid](x, out_scale, out, rows, cols, x.stride(0), out.stride(0),
                               BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4)  # fmt: skip
    return out
