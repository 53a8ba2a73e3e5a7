"""The FP8 implementations bench/nps.py times with ``--dtype fp8``, beside the fp16 ones.

  torch-fp8           what a PyTorch user writes (torchao-style): the fp16 torch model
                      (``peers.TorchEncoder``) with each of a layer's four GEMMs (QKV
                      in-projection, out-projection, FFN1, FFN2) replaced by ``Fp8Linear``:
                      the weight quantized once to e4m3 with one fp32 scale per output
                      channel, the activation rows quantized on the fly with torch ops
                      (one scale per row, amax / 448), then ``torch._scaled_mm`` with
                      row-wise scales, the bias in the call, fp16 out.  Attention, LayerNorm,
                      the activation and the alpha residuals are the fp16 model's own code.
  torch-fp8-compile   ``torch.compile`` of it (and ``torch-fp8-compile:<mode>`` for each
                      ``--compile-modes``), as torch-compile is of the fp16 model.
  fusedenc-fp8        the fusedenc EncoderStack the fusedenc rows run, ``.quantize("fp8")``
                      (accurate accumulation, the library default), eager.
  fusedenc-fp8-graph  the same through the stack's CUDA-graph runner.
  fusedenc-fp8-fast   ``.quantize("fp8", fast_accum=True)`` through the graph runner.
  fusedenc-fp8-static the same with ``calibration=`` 64 random sequences (not the checked
                      input): FFN1 writes FFN2's input in e4m3 with static column scales, and
                      where the Hopper kernels run the LayerNorms are folded into the GEMMs
                      (``fusedenc.encoder.fp8_fold``: the library default when calibrated).
  fusedenc-fp8-static-ln  the same with ``fold_norms=False``: the LayerNorm passes (the A/B).
  fusedenc-fp8-static-plain  fusedenc-fp8-static's stack called plainly (its automatic CUDA
                      graphs), against the graph runner; fusedenc-fp8 is also a plain call.

The FP8 check's oracle is here too: ``emulated_linear``, FP8's GEMM in fusedenc.fp8.rowwise's
reference math, for ``peers.reference_forward`` to run the same net with every GEMM in
emulated FP8 and everything else in fp32.
"""

from __future__ import annotations

import copy
from typing import Callable, Optional

import torch
import torch.nn as nn
from peers import Impl, TorchEncoder, load_fusedenc_stack, make_compile

from fusedenc import core
from fusedenc.fp8 import rowwise as fp8
from fusedenc.tune.presets import Run

__all__ = [
    "FP8_IMPLS",
    "GEMM_MODULES",
    "GRAPH_IMPLS",
    "Fp8Linear",
    "builders",
    "emulated_linear",
    "emulated_scaled_mm",
    "fusedenc_fp8_status",
    "is_fp8",
    "make_fusedenc_fp8",
    "make_torch_fp8",
    "quantize_rows",
    "scaled_mm",
    "scaled_mm_status",
    "torch_fp8_model",
]

#: The FP8 implementations, in the order they run (after the fp16 ones).
FP8_IMPLS = ("torch-fp8", "torch-fp8-compile", "fusedenc-fp8", "fusedenc-fp8-graph", "fusedenc-fp8-fast",
             "fusedenc-fp8-static", "fusedenc-fp8-static-ln", "fusedenc-fp8-static-plain")
#: The ones that replay CUDA graphs (need a GPU).
GRAPH_IMPLS = ("fusedenc-fp8-graph", "fusedenc-fp8-fast", "fusedenc-fp8-static", "fusedenc-fp8-static-ln")
#: TorchBlock's four GEMM modules, in the order a layer runs them.
GEMM_MODULES = ("in_proj", "out_proj", "ffn1", "ffn2")


def is_fp8(name: str) -> bool:
    """Whether a result row (``torch-fp8-compile:<mode>`` included) is an FP8 implementation."""
    return name in FP8_IMPLS or name.startswith("torch-fp8-compile:")


# ------------------------------------------------------------ the torch peer ----


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` in e4m3 with one fp32 scale per row, in torch ops (what the peer runs
    on every GEMM input, and once on each weight): ``(codes [M, K], scale [M, 1])``.  The
    math of ``fusedenc.fp8.rowwise.quantize_rows``: a row's largest magnitude maps onto 448, an
    all-zero row gets scale 1."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / fp8.E4M3_MAX)
    return (xf / scale).to(fp8.E4M3), scale


def scaled_mm(a, b, scale_a, scale_b, bias, out_dtype):
    """``torch._scaled_mm`` with row-wise scales: ``a`` ``[M, K]`` e4m3 row-major, ``b``
    ``[K, N]`` e4m3 column-major, ``scale_a`` ``[M, 1]``, ``scale_b`` ``[1, N]`` (fp32)."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype)


def emulated_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype):
    """What ``scaled_mm`` computes, in fusedenc.fp8.rowwise's reference math (fp32 sums of the codes,
    the scales and bias in fp32, one rounding): lets the peer's math be tested without a GPU."""
    x = fp8.Quantized(a, scale_a.reshape(-1))
    w = fp8.Quantized(b.t(), scale_b.reshape(-1))
    return fp8.scaled_linear(x, w, bias, out_dtype)


class Fp8Linear(nn.Module):
    """An ``nn.Linear``'s FP8 twin: ``mm(quantize_rows(x), w_fp8.t(), ...)`` on ``x``'s rows.

    ``out_dtype``: what the GEMM returns (float16; bfloat16 where a torch version takes
    row-wise scales with a bf16 output only, the result then cast back to the input's
    dtype).  ``mm``: the GEMM (``scaled_mm``; ``emulated_scaled_mm`` in the CPU tests)."""

    def __init__(self, linear: nn.Linear, out_dtype: torch.dtype = torch.float16, mm: Callable = scaled_mm):
        super().__init__()
        w, scale = quantize_rows(linear.weight.detach())
        self.register_buffer("w_fp8", w)  # [N, K]: one scale per output channel
        self.register_buffer("w_scale", scale.reshape(1, -1).contiguous())  # [1, N]
        bias = None if linear.bias is None else linear.bias.detach().to(out_dtype)
        self.register_buffer("bias", bias)
        self.out_dtype, self.mm = out_dtype, mm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        a, scale_a = quantize_rows(rows)
        y = self.mm(a, self.w_fp8.t(), scale_a, self.w_scale, self.bias, self.out_dtype)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y.view(*x.shape[:-1], y.shape[-1])


def torch_fp8_model(model: TorchEncoder, out_dtype: torch.dtype = torch.float16, mm: Callable = scaled_mm) -> TorchEncoder:
    """A copy of the fp16 torch model with its four GEMMs per layer in FP8 (``Fp8Linear``):
    the rest of each block (attention, norms, activation, residuals) is the model's own code."""
    peer = copy.deepcopy(model)
    for blk in peer.blocks:
        for name in GEMM_MODULES:
            setattr(blk, name, Fp8Linear(getattr(blk, name), out_dtype, mm))
    return peer.eval().requires_grad_(False)


def scaled_mm_status(device: torch.device) -> tuple[bool, Optional[torch.dtype], str]:
    """Whether ``torch._scaled_mm`` with row-wise scales runs on ``device``: ``(ok, output
    dtype to ask for, why not)``.  Tried on a small problem (float16 out, else bfloat16 out):
    which devices and output dtypes it takes differs between torch versions."""
    if device.type == "cuda" and not torch.version.hip:
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            return False, None, (f"torch._scaled_mm with row-wise scales needs compute capability 8.9+ "
                                 f"(Ada, Hopper); this GPU is {cap[0]}.{cap[1]}")  # fmt: skip
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(32, 32, generator=g).to(device), torch.randn(16, 32, generator=g).to(device)
    (a, sa), (b, sb) = quantize_rows(x), quantize_rows(w)
    errors = []
    for out_dtype in (torch.float16, torch.bfloat16):
        try:
            scaled_mm(a, b.t(), sa, sb.reshape(1, -1).contiguous(), torch.zeros(16, dtype=out_dtype, device=device),
                      out_dtype)  # fmt: skip
            return True, out_dtype, ""
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
            errors.append(f"{str(out_dtype).replace('torch.', '')} out: {type(exc).__name__}: {str(exc)[:200]}")
    return False, None, (f"torch._scaled_mm with row-wise scales does not run on {device.type} in torch "
                         f"{torch.__version__} ({'; '.join(errors)})")  # fmt: skip


def make_torch_fp8(model: TorchEncoder, out_dtype: torch.dtype) -> Impl:
    peer = torch_fp8_model(model, out_dtype)
    impl = Impl("torch-fp8", peer)
    how = "fp16 out, bias in the call" if out_dtype == torch.float16 else \
          "bf16 out (this torch takes row-wise scales with a bf16 output only), cast to fp16"  # fmt: skip
    impl.notes.append(f"torch._scaled_mm, e4m3 weights per output channel, activations per row (torch ops), {how}")
    impl.info = {"scaled_mm_out_dtype": str(out_dtype).replace("torch.", "")}
    return impl


# ------------------------------------------------------------ fusedenc ----


def fusedenc_fp8_status(device: torch.device) -> tuple[bool, str]:
    """Whether fusedenc's FP8 mode runs on ``device``: always on CPU (its reference math),
    on a GPU where the native core runs FP8 GEMMs."""
    return (True, "") if device.type != "cuda" else core.fp8_status(device)


def make_fusedenc_fp8(model: TorchEncoder, run: Run, device: torch.device, batches: list[int], name: str) -> Impl:
    """The fusedenc rows' EncoderStack (same weights), ``.quantize("fp8")`` as the row ``name``
    (one of the fusedenc-fp8 rows of ``FP8_IMPLS``) says; eager or graphs."""
    graph, static = name in GRAPH_IMPLS, name.startswith("fusedenc-fp8-static")
    fold_norms = name != "fusedenc-fp8-static-ln"
    fast_accum = static or name == "fusedenc-fp8-fast"
    calibration = None
    if static:  # its own random sequences: the checked input is not what the scales saw
        g = torch.Generator().manual_seed(1234)
        calibration = torch.randn(64, run.seq_len, run.preset.d_model, generator=g).to(device, run.dtype)
    stack = load_fusedenc_stack(model, run, device).quantize("fp8", fast_accum=fast_accum, calibration=calibration,
                                                             fold_norms=fold_norms)  # fmt: skip
    how = 'EncoderStack.quantize("fp8"' + (", fast_accum=True" if fast_accum else "") + (
        ", calibration=64 random sequences" if static else "") + ("" if fold_norms else ", fold_norms=False") + ")"
    if not graph:
        impl = Impl(name, stack)
        impl.notes.append(f"{how}, eager")
        return impl
    runner = stack.graph_runner(run.seq_len, batch_sizes=tuple(sorted(set(batches))))
    capture_s = runner.capture_all()
    impl = Impl(name, runner, output_is_view=True)
    impl.info = {"capture_s": capture_s, "buckets": sorted(set(batches)), "fast_accum": fast_accum}
    impl.notes.append(f"{how}, graph runner: captured {len(set(batches))} batch-size graphs in {capture_s:.2f} s")
    return impl


def builders(
    names: list[str], run: Run, device: torch.device, batches: list[int], compile_modes: list[str],
    compile_dynamic: bool, scaled_mm_out: Optional[torch.dtype],
) -> dict[str, Callable[[TorchEncoder], Impl]]:  # fmt: skip
    """Row name -> builder from the fp16 torch model, for the FP8 names in ``names`` (in
    ``FP8_IMPLS`` order); torch-fp8-compile gives one row per mode, as torch-compile does.
    ``scaled_mm_out``: the output dtype ``scaled_mm_status`` found."""
    out: dict[str, Callable[[TorchEncoder], Impl]] = {}
    out_dtype = scaled_mm_out or torch.float16
    for name in [n for n in FP8_IMPLS if n in names]:
        if name == "torch-fp8":
            out[name] = lambda m: make_torch_fp8(m, out_dtype)
        elif name == "torch-fp8-compile":
            for mode in ["default"] + compile_modes:
                key = name if mode == "default" else f"{name}:{mode}"
                out[key] = lambda m, mode=mode: make_compile(torch_fp8_model(m, out_dtype), mode, compile_dynamic,
                                                             name="torch-fp8-compile")  # fmt: skip
        else:
            out[name] = lambda m, name=name: make_fusedenc_fp8(m, run, device, batches, name)
    return out


# ------------------------------------------------------------ the check's oracle ----


def emulated_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``x @ w^T + b`` as an FP8 GEMM computes it, in fusedenc.fp8.rowwise's reference math: ``x``'s
    rows and ``w``'s output channels quantized (``fp8.quantize_rows``), fp32 sums of the codes,
    scales and bias in fp32, fp32 out (``peers.reference_forward``'s ``linear``)."""
    rows = x.reshape(-1, x.shape[-1])
    y = fp8.scaled_linear(fp8.quantize_rows(rows), fp8.quantize_rows(w), b, torch.float32)
    return y.view(*x.shape[:-1], w.shape[0])
