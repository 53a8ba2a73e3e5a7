"""What the installed core can do: ``capabilities()``, and ``hopper()``, whether this build holds the
Hopper kernels an sm90 GPU here would run; the plan-cache and fallback reports live in ``core``."""

from __future__ import annotations

from typing import Any

import torch

from . import core
from .common import dtypes
from .common.activations import ACTIVATIONS
from .core import gemm_routes
from .fp8 import rowwise as fp8_mode
from .ops import norm_fold

try:  # written by CMake at build time; absent in a plain source checkout
    from . import _build_info
except ImportError:  # pragma: no cover - only without an install
    _build_info = None

__all__ = ["HOPPER_COST", "capabilities", "hopper", "hopper_lines"]

_DTYPES = tuple(dtypes.name(d) for d in dtypes.SUPPORTED)

#: What a CUDA build without the Hopper kernels gives up on an H100 (the README's t82 body
#: numbers: the same code with and without the sm90 epilogue GEMMs and LayerNorm folding).
HOPPER_COST = "about 13% on an H100 (the t82 body at 1.11-1.14x torch.compile without them, 1.29-1.32x with them, in one A/B run)"
#: What the Hopper kernels are.
HOPPER_KERNELS = ("the CUTLASS epilogue GEMMs (bias + swish/mish/GELU/... in the GEMM), LayerNorm folding "
                  "into the GEMMs and the fast-accumulation FP8 kernels")


def _sm90_devices() -> list[tuple[int, str]]:
    """(index, name) of the visible GPUs of compute capability 9.0 (H100, H200, GH200), CUDA only
    (ROCm's torch reports gfx90a as 9.0 too)."""
    if not torch.version.cuda or not torch.cuda.is_available():
        return []
    return [(i, torch.cuda.get_device_name(i)) for i in range(torch.cuda.device_count())
            if torch.cuda.get_device_capability(i) == (9, 0)]  # fmt: skip


def hopper() -> dict[str, Any]:
    """The Hopper (sm90) CUTLASS kernels and this installation.

    ``built``: this build holds them; ``why_not``: the build's reason when it does not ("" when
    it does, or when there is no CUDA core); ``sm90_devices``: ``[(index, name)]`` of the GPUs here
    that would run them; ``warning``: None, or what ``python -m fusedenc`` says loudly: the CUDA
    core runs on a Hopper GPU here without them, and what that costs (``HOPPER_COST``).
    """
    info = core.library_info()
    cuda_core = info is not None and info["vendor"] == "cuda"
    built = cuda_core and bool(core.sm90_gemm_kernels())
    state = getattr(_build_info, "SM90_GEMM", "") if cuda_core else ""
    why_not = "" if built or not cuda_core else (state.removeprefix("not built: ") or "not compiled in")
    devices = _sm90_devices() if cuda_core else []
    warning = None
    if cuda_core and not built and devices:
        # --no-deps: the build reads only the wheel's headers; its own requirements (cuda-python,
        # scipy, pydot, ...) serve CUTLASS's Python API, which fusedenc never imports.
        fix = ("pip install --no-deps nvidia-cutlass (only its headers are used; or set FUSEDENC_CUTLASS_INCLUDE), "
               "then run the set-up again"
               if "CUTLASS" in why_not else
               "build again with 90 among FUSEDENC_CUDA_ARCHITECTURES, CUTLASS's headers "
               "(pip install --no-deps nvidia-cutlass) and FUSEDENC_SM90_BUILD not off")
        gpus = ", ".join(f"GPU {i} ({name})" for i, name in devices)
        warning = (f"WARNING: this build has NO Hopper kernels, and {gpus} would run them.\n"
                   f"Missing: {HOPPER_KERNELS} ({why_not}).\n"
                   f"Cost: {HOPPER_COST}.\n"
                   f"Fix: {fix}.")
    return {"built": built, "why_not": why_not, "sm90_devices": devices, "warning": warning}


def hopper_lines() -> list[str]:
    """``python -m fusedenc``'s lines about the Hopper kernels: the warning on a Hopper GPU, a note
    on a CUDA core built without them elsewhere, nothing otherwise."""
    h = hopper()
    if h["warning"]:
        return ["  " + line for line in h["warning"].splitlines()]
    if h["why_not"]:
        return [f"  note: no Hopper (sm90) kernels in this build ({h['why_not']}); that costs {HOPPER_COST}"]
    return []


def capabilities() -> dict[str, Any]:
    """Which fusions are native library epilogues and which are fallback kernels.

    ``activations[dtype][activation]`` is a dict with ``fusion`` ("native": the
    library epilogue applies bias and activation; "fallback": the BIAS epilogue
    plus fusedenc's activation kernel; "reference": PyTorch ops), ``epilogue``
    (the library epilogue used with a bias) and ``kernel`` (what runs after it).
    The table describes the built core even when no GPU is present;
    ``active`` says whether GPU tensors use it now (see ``backend()``).
    A heuristic can still refuse a fused epilogue for one shape at run time:
    ``fallback_events()`` lists those cases.  ``triton_gemm_routes`` lists the
    problems where ``tune gemm`` measured the Triton kernel (activation on the
    accumulator) faster than the library's epilogue plus the activation kernel.
    """
    b = core.backend()
    info = core.library_info()
    report: dict[str, Any] = {
        "backend": b.name,
        "reason": b.reason,
        "active": b.name != "reference",
        "vendor": info["vendor"] if info else None,
        "library": b.library,
        "dtypes": list(_DTYPES),
        "activations": {},
        "residual": {},
        # Per device: the GEMM tuning file read at the core's first use and what became of it.
        "gemm_tuning": core.gemm_tuning_report(),
        # Problems a tuning file routes to the Triton FFN1 kernel (it measured faster there).
        "triton_gemm_routes": [
            dict(key._asdict(), config=config._asdict()) for key, config in sorted(gemm_routes.routes().items())
        ],
    }
    epilogues = core.native_epilogues()
    # The Hopper kernels as a whole: built or why not, and whether a GPU here would run them.
    report["hopper"] = hopper()
    sm90 = set(core.sm90_gemm_kernels())
    gelu_units = set(core.sm90_gelu_epilogue_kernels()) if core.sm90_gelu_epilogue_on() else set()
    report["sm90_epilogue_gemm"] = [f"{d}:{a}" for d, a in sorted(sm90)]
    # The GELU units (exact and tanh GELU fixed at compile time): built, and switched on or not.
    report["sm90_gelu_epilogue"] = {
        "kernels": [f"{d}:{a}" for d, a in sorted(core.sm90_gelu_epilogue_kernels())],
        "on": core.sm90_gelu_epilogue_on(),
    }
    # Post-LN LayerNorms folded into the GEMMs around them (norm_fold): dtypes whose Hopper
    # norm and residual kernels this build holds (they run on compute capability 9.0).
    report["layer_norm_folding"] = {
        "mode": norm_fold.current_mode(),
        "dtypes": [
            dtypes.name(d) for d in dtypes.SUPPORTED
            if (dtypes.name(d), "none") in sm90 and core.sm90_residual_gemm_compiled(d)
        ],
    }
    # FP8 (fusedenc.fp8.rowwise): what this build holds, and whether the current GPU runs it.
    compiled = core.fp8_compiled()
    library = "hipBLASLt" if info and info["vendor"] == "hip" else "cuBLASLt"
    fp8: dict[str, Any] = {
        "gemm": f"{library} e4m3 GEMM, fp32 scale per activation row and per weight channel" if compiled else None,
        "quantize": "fusedenc row-wise e4m3 kernel" if compiled else None,
        # The e4m3 flavour of the current GPU's codes (torch.float8_<format>): "e4m3fn" (OCP:
        # NVIDIA, AMD gfx95x) or "e4m3fnuz" (AMD gfx94x, MI300), and its largest finite value.
        "format": "e4m3fn",
        "max": 448.0,
        # Output dtypes of the Hopper FP8 GEMM with the activation in its epilogue (sm90).
        "sm90_epilogue_gemm": core.sm90_fp8_gemm_kernels() if compiled else [],
        # ... and of its form writing e4m3 with static column scales (a calibrated FFN1 -> FFN2).
        "sm90_e4m3_output": core.fp8.sm90_fp8_e4m3_output_kernels() if compiled else [],
        # ... and that form with exact GELU (a unit of its own: BERT-family FFN1s in the fold).
        "sm90_e4m3_output_gelu": core.fp8.sm90_fp8_e4m3_gelu_kernels() if compiled else [],
        # ... and the residual kernel of the FP8 mode with LayerNorms folded (fusedenc.encoder.fp8_fold).
        "sm90_folded_layer_norm": [n for n in ("float16", "bfloat16")
                                   if compiled and core.fp8.sm90_fp8_residual_compiled(getattr(torch, n))],
        "runs_here": False,
        "reason": "",
    }
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        ok, why = core.fp8_status(device)
        fmt = fp8_mode.format_for(device)
        fp8.update(runs_here=ok, reason=why, format=str(fmt.dtype).replace("torch.float8_", ""), max=fmt.max)
    else:
        fp8["reason"] = "no GPU: fusedenc.fp8 runs its PyTorch reference"
    report["fp8"] = fp8
    for dtype in _DTYPES:
        per_act = {}
        for act in ACTIVATIONS:
            if epilogues is None:
                per_act[act] = {"fusion": "reference", "epilogue": None, "kernel": "torch"}
            elif epilogues[act]["bias"] is not None:
                per_act[act] = {"fusion": "native", "epilogue": epilogues[act]["bias"], "kernel": None}
            else:
                per_act[act] = {"fusion": "fallback", "epilogue": "BIAS", "kernel": "bias_activation"}
                if (dtype, act) in sm90:
                    # On compute capability 9.0, GEMMs that fill the chip run it in the epilogue.
                    per_act[act]["sm90"] = {"fusion": "native", "kernel": "CUTLASS sm90 epilogue GEMM"}
                elif act == "gelu" and (dtype, act) in gelu_units:  # plain tanh-GELU GEMMs keep GELU_BIAS
                    per_act[act]["sm90"] = {"fusion": "native", "kernel": "CUTLASS sm90 GELU unit"}
        report["activations"][dtype] = per_act
        report["residual"][dtype] = (
            {"fusion": "native", "epilogue": "BIAS with beta*C, C != D", "kernel": None}
            if info
            else {"fusion": "reference", "epilogue": None, "kernel": "torch"}
        )
    return report
