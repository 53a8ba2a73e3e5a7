"""The FP8 kernels' seam (``fusedenc.fp8.rowwise`` checks the tensors and says what they compute):
cuBLASLt's e4m3 GEMM with per-row scales, the Hopper FP8 epilogue kernel, the row-wise
quantization kernel.  Part of ``core``, the one seam to the native core."""

from __future__ import annotations

from typing import Optional

import torch

from . import ACTIVATION_IDS, DTYPE_CODES, active_on, backend, native_module, pointer

# ------------------------------------------------------------------ FP8 ----
# (fp8/rowwise.py says what these compute and checks the tensors.)


def fp8_compiled() -> bool:
    """Whether this build of the core holds the FP8 GEMM and quantization kernel."""
    module = native_module()
    return bool(module is not None and module.fp8_gemm_compiled())


def fp8_status(device: torch.device) -> tuple[bool, str]:
    """Whether the FP8 kernels run on ``device``, and if not why."""
    module = native_module()
    if module is None or not active_on(device):
        return False, f"the native core is not active on {device} ({backend().reason})"
    index = torch.cuda.current_device() if device.index is None else device.index  # "cuda": the current GPU
    status = _status_by_index.get(index)
    if status is None:  # a property of the device and the build: asked once (every FP8 call asks)
        ok, why = module.fp8_gemm_status(index)
        status = _status_by_index[index] = (bool(ok), str(why))
    return status


_status_by_index: dict[int, tuple[bool, str]] = {}


def fp8_format(device: torch.device) -> str:
    """The e4m3 flavour the core's FP8 kernels use on ``device``: ``"e4m3fn"`` (OCP: NVIDIA,
    AMD gfx95x) or ``"e4m3fnuz"`` (AMD gfx94x, MI300), the ``torch.float8_<name>`` of its
    codes.  ``"e4m3fn"`` where the core is not active on ``device`` (the reference runs)."""
    module = native_module()
    if module is None or not active_on(device) or not hasattr(module, "fp8_format"):
        return "e4m3fn"
    index = torch.cuda.current_device() if device.index is None else device.index  # "cuda": the current GPU
    name = _format_by_index.get(index)
    if name is None:  # a property of the device: asked once
        name = _format_by_index[index] = str(module.fp8_format(index))
    return name


_format_by_index: dict[int, str] = {}


def sm90_fp8_gemm_applies(
    a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
    bias: Optional[torch.Tensor], out: torch.Tensor, activation: str, fast_accum: bool = False,
    out_scale: Optional[torch.Tensor] = None, shift: Optional[torch.Tensor] = None,
    colsum: Optional[torch.Tensor] = None,
) -> tuple[bool, str]:  # fmt: skip
    """Whether ``fp8_gemm`` with these operands runs the Hopper FP8 epilogue kernel (else
    cuBLASLt), and if not why.  ``a``/``w``: e4m3 codes (or their uint8 views); with
    ``out_scale``, ``out`` is e4m3 too, and with ``shift``/``colsum`` a LayerNorm is folded
    (only that kernel does either)."""
    module = native_module()
    if module is None:
        return False, "no native core"
    m, k = a.shape
    n = w.shape[0]
    ok, why = module.sm90_fp8_gemm_applies(
        a.device.index, m, n, k, a.data_ptr(), a.stride(0), a_scale.data_ptr(), w.data_ptr(), w.stride(0),
        w_scale.data_ptr(), pointer(bias), out.data_ptr(), out.stride(0), _dtype_code(out, bias, out_scale),
        ACTIVATION_IDS[activation], bool(fast_accum), pointer(out_scale), pointer(shift), pointer(colsum),
    )  # fmt: skip
    return bool(ok), str(why)


def sm90_fp8_gemm_kernels() -> list[str]:
    """Output dtypes this build holds the Hopper FP8 epilogue GEMM for (empty: none)."""
    module = native_module()
    return [str(d) for d in module.sm90_fp8_gemm_kernels()] if module else []


def sm90_fp8_e4m3_output_kernels() -> list[str]:
    """Bias dtypes of the Hopper FP8 GEMM that writes e4m3 codes with static column scales
    (FFN1 feeding a calibrated FFN2, ``fusedenc.fp8.rowwise``); empty without it."""
    module = native_module()
    return [str(d) for d in module.sm90_fp8_e4m3_output_kernels()] if module else []


def sm90_fp8_e4m3_gelu_kernels() -> list[str]:
    """Bias dtypes of the e4m3-output Hopper FP8 GEMM built with exact GELU (the FP8 fold of
    BERT-family FFN1s; the kernel's run-time activation switch lacks GELU); empty without it."""
    module = native_module()
    return [str(d) for d in module.sm90_fp8_e4m3_gelu_kernels()] if module else []


def fp8_quantize_rows(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, stream: int) -> None:
    """Rows of 2-D ``x`` (unit column stride) into e4m3 codes ``q`` (uint8 view) and fp32 ``scale``."""
    rows, k = x.shape
    native_module().fp8_quantize_rows(
        x.device.index, stream, rows, k, x.data_ptr(), x.stride(0), DTYPE_CODES[x.dtype],
        q.data_ptr(), q.stride(0), scale.data_ptr(),
    )  # fmt: skip


def fp8_gemm(
    a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
    bias: Optional[torch.Tensor], out: torch.Tensor, activation: str, fast_accum: bool, stream: int,
    workspace: torch.Tensor, out_scale: Optional[torch.Tensor] = None, shift: Optional[torch.Tensor] = None,
    colsum: Optional[torch.Tensor] = None,
) -> None:  # fmt: skip
    """``out = act((a @ w^T) * a_scale[:, None] * w_scale[None, :] + shift[:, None] * colsum[None, :] + bias)``
    on e4m3 ``a`` [M, K] and ``w`` [N, K] (``shift``/``colsum``: a folded LayerNorm, ``a_scale`` its
    rstd; None: 0); with ``out_scale`` ([N] fp32), ``out`` (uint8 view) gets ``e4m3(out_scale[None, :] * that)``."""
    m, k = a.shape
    n = w.shape[0]
    native_module().fp8_gemm(
        a.device.index, stream, m, n, k, a.data_ptr(), a.stride(0), a_scale.data_ptr(), w.data_ptr(), w.stride(0),
        w_scale.data_ptr(), pointer(bias), out.data_ptr(), out.stride(0), _dtype_code(out, bias, out_scale),
        ACTIVATION_IDS[activation], fast_accum, workspace.data_ptr(), workspace.numel(), pointer(out_scale),
        pointer(shift), pointer(colsum),
    )  # fmt: skip


def sm90_fp8_residual_compiled(dtype: torch.dtype) -> bool:
    """Whether this build holds the Hopper FP8 residual GEMM (the FP8 mode with LayerNorms
    folded) for ``dtype`` outputs."""
    module = native_module()
    return module is not None and bool(module.sm90_fp8_residual_compiled(DTYPE_CODES[dtype]))


def sm90_fp8_residual_applies(
    a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor], c: torch.Tensor,
    out: torch.Tensor,
) -> tuple[bool, str]:  # fmt: skip
    """Whether ``sm90_fp8_residual_gemm`` runs these operands, and if not why."""
    module = native_module()
    if module is None:
        return False, "no native core"
    m, k = a.shape
    ok, why = module.sm90_fp8_residual_applies(
        a.device.index, m, w.shape[0], k, a.data_ptr(), a.stride(0), w.data_ptr(), w.stride(0), w_scale.data_ptr(),
        pointer(bias), c.data_ptr(), c.stride(0), out.data_ptr(), out.stride(0), DTYPE_CODES[out.dtype],
    )  # fmt: skip
    return bool(ok), str(why)


def sm90_fp8_residual_gemm(
    a, w, w_scale, bias, c, out, alpha, pending, row_sum, row_sumsq, codes, code_scale, inv_code_scale,
    stream, workspace,
) -> bool:  # fmt: skip
    """``out = alpha * (w_scale * (a @ w^T) + bias) + R`` on e4m3 ``a``/``w`` (uint8 views), ``R = c``
    or, for ``pending`` (``norm_fold.NormedRows`` over ``c``), its LayerNorm; partial row sums of
    ``out`` and ``out^2``; with ``codes`` (uint8 ``[M, N]``), e4m3 codes of ``out * inv_code_scale``.
    False: nothing ran (CUTLASS refused)."""
    m, k = a.shape
    rstd = shift = gamma = beta = None
    if pending is not None:
        rstd, shift, gamma, beta = pending.rstd, pending.shift, pending.gamma, pending.beta
    return native_module().sm90_fp8_residual_gemm(
        a.device.index, stream, m, w.shape[0], k, a.data_ptr(), a.stride(0), w.data_ptr(), w.stride(0),
        w_scale.data_ptr(), pointer(bias), c.data_ptr(), c.stride(0), out.data_ptr(), out.stride(0),
        DTYPE_CODES[out.dtype], alpha, pointer(rstd), pointer(shift), pointer(gamma), pointer(beta),
        pointer(row_sum), pointer(row_sumsq), pointer(codes), 0 if codes is None else codes.stride(0),
        pointer(code_scale), pointer(inv_code_scale), workspace.data_ptr(), workspace.numel(),
    )  # fmt: skip


def _dtype_code(out: torch.Tensor, bias: Optional[torch.Tensor], out_scale: Optional[torch.Tensor]) -> int:
    """The core's dtype of an FP8 call: the output's, or with e4m3 output the bias's (fp16 without one)."""
    if out_scale is None:
        return DTYPE_CODES[out.dtype]
    return DTYPE_CODES[torch.float16 if bias is None else bias.dtype]
