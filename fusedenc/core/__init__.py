"""The one seam to the native core ``fusedenc._C``: loading it, feeding it, calling it.

Every GEMM and LayerNorm that fusedenc launches goes through ``gemm`` and
``layer_norm`` here, with named arguments; the public ops (``ops``, ``norm``),
the encoder's native executor and ``tune`` all call these functions.  So the
same problem always runs the same plan: a GEMM that a tuning file routes to the
Triton FFN1 kernel (``gemm_routes``) is routed here, for every caller, and
nothing else in the package calls ``_C``.

The kernels with a job of their own have a submodule of this package each:
``core.fp8`` (the FP8 GEMM and quantization) and ``core.hopper`` (the sm90 CUTLASS
GEMMs that fold LayerNorm, and the A/B switch); their functions are re-exported here,
so callers write ``core.fp8_gemm`` like ``core.gemm``.

The core is optional: without it, or without a GPU that matches it, every op
runs its PyTorch reference.  ``backend()`` says which path is active and why;
nothing here is decided per call.  The core links no libtorch: Python owns
tensors, streams and memory (the library workspace too) and passes pointers.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import importlib.util
import os
import threading
import warnings
from types import ModuleType
from typing import Any, Iterator, Optional

import torch

from ..common import dtypes
from ..common.activations import ACTIVATIONS
from ..common.device import device_arch, torch_vendor
from . import gemm_routes, gemm_tuning

try:  # written by CMake at build time; absent in a plain source checkout
    from .. import _build_info
except ImportError:  # pragma: no cover - only without an install
    _build_info = None

__all__ = [
    "ACTIVATION_IDS", "Backend", "DTYPE_CODES", "FallbackWarning", "GEMM_TUNING_ENV", "PLAN_CACHE_LIMIT_ENV",
    "WORKSPACE_BYTES", "active_on", "backend", "clear_gemm_choices", "clear_plan_cache", "copy_blocks",
    "fallback_events", "force_epilogue_fallback", "fp8_compiled", "fp8_gemm", "fp8_quantize_rows", "fp8_status",
    "gemm", "gemm_candidates", "gemm_choices", "gemm_tuning_report", "gemm_with_candidate", "layer_norm",
    "library_info", "load_gemm_tuning", "load_gemm_tuning_at_start", "max_gemm_candidates", "native_epilogues",
    "native_module", "norm_stats", "plan_cache_info", "pointer", "set_plan_cache_limit", "set_sm90_sm_limit",
    "sm90_fold_applies", "sm90_fold_fits", "sm90_fp8_gemm_applies", "sm90_fp8_gemm_kernels", "sm90_gelu_epilogue",
    "sm90_gelu_epilogue_kernels", "sm90_gelu_epilogue_on", "sm90_gemm_applies", "sm90_gemm_disabled", "sm90_gemm_kernels", "sm90_norm_gemm", "sm90_residual_gemm", "sm90_residual_gemm_compiled",
    "stats_tile", "workspace",
]  # fmt: skip

#: Workspace handed to the GEMM library per (device, stream).  32 MiB is what
#: NVIDIA recommends for Hopper; FUSEDENC_WORKSPACE_MB overrides it.
WORKSPACE_BYTES = int(float(os.environ.get("FUSEDENC_WORKSPACE_MB", "32")) * (1 << 20))

#: Environment variable bounding the native GEMM plan cache (entries), read
#: once, when the core is first used; ``set_plan_cache_limit`` changes it
#: later.  Without it the core's default (1024 plans) holds.
PLAN_CACHE_LIMIT_ENV = "FUSEDENC_PLAN_CACHE_LIMIT"
#: "0", "off", "false" or "no": do not load GEMM tuning files at start (A/B runs).
GEMM_TUNING_ENV = "FUSEDENC_GEMM_TUNING"

#: The core's codes for activations and dtypes (the submodules pass them too).
ACTIVATION_IDS = {name: i for i, name in enumerate(ACTIVATIONS)}
DTYPE_CODES = {dtype: dtypes.code(dtype) for dtype in dtypes.SUPPORTED}
#: The loaded core once ``_load`` succeeded: the launches read it without a call.
_module: Optional[ModuleType] = None


class FallbackWarning(RuntimeWarning):
    """A fused epilogue was unavailable for a shape; a slower correct path runs instead."""


@dataclasses.dataclass(frozen=True)
class Backend:
    """Which implementation serves ops on GPU tensors, and why."""

    name: str  # "cuda", "hip" or "reference"
    reason: str
    library: str | None = None  # "cuBLASLt 13.1.1" when a native core is active
    build: str | None = None  # what CMake built, and with what

    def __str__(self) -> str:
        lib = f", {self.library}" if self.library else ""
        return f"{self.name}{lib}: {self.reason}"


# ------------------------------------------------------------ loading ----


def _preload_cublaslt() -> None:
    """Load libcublasLt from the nvidia-cublas wheel if one is installed.

    The core links libcublasLt.so.13 by SONAME; when the library lives in
    site-packages (as with pip-installed torch), the dynamic loader would not
    find it on its own.  Loading it first, globally, satisfies the dependency.
    """
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for sub in ("cu13", "cublas"):
            lib_dir = os.path.join(root, sub, "lib")
            if not os.path.isdir(lib_dir):
                continue
            for name in sorted(os.listdir(lib_dir)):
                if name.startswith("libcublasLt.so"):
                    try:
                        ctypes.CDLL(os.path.join(lib_dir, name), mode=ctypes.RTLD_GLOBAL)
                        return
                    except OSError:
                        continue


@functools.lru_cache(maxsize=None)
def _load() -> tuple[ModuleType | None, str]:
    core = getattr(_build_info, "CORE", "none")
    if core == "none":
        why = getattr(_build_info, "CORE_REASON", "package not built")
        return None, f"built without a native core ({why})"
    if core == "cuda":
        _preload_cublaslt()
    try:
        from .. import _C
    except ImportError as exc:
        return None, f"the {core} core is built but failed to import: {exc}"
    limit = plan_cache_limit_from_env()
    if limit is not None:
        _C.set_plan_cache_limit(limit)
    load_gemm_tuning_at_start(_C)
    global _module
    _module = _C
    return _C, ""


def plan_cache_limit_from_env() -> int | None:
    """The limit ``FUSEDENC_PLAN_CACHE_LIMIT`` asks for, or None when unset or empty.

    A value that is not a positive integer is ignored with one RuntimeWarning
    naming the variable (an import-time error would disable every op).
    """
    text = os.environ.get(PLAN_CACHE_LIMIT_ENV, "").strip()
    if not text:
        return None
    try:
        limit = int(text)
    except ValueError:
        limit = 0
    if limit < 1:
        warnings.warn(
            f"fusedenc: ignoring {PLAN_CACHE_LIMIT_ENV}={text!r}: not a positive integer; "
            "the plan cache keeps its default limit",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return limit


def native_module() -> ModuleType | None:
    """The imported ``fusedenc._C``, or None when it is absent or unusable.

    For tests and diagnostics: the package itself calls the core only through
    this module's functions.
    """
    return _load()[0]


def _library_text(module: ModuleType) -> str:
    v = module.library_version()
    return f"{module.LIBRARY} {v // 10000}.{v // 100 % 100}.{v % 100}"


@functools.lru_cache(maxsize=None)
def backend() -> Backend:
    """The backend that serves ops on GPU tensors (CPU tensors always use the reference)."""
    build = None
    if _build_info is not None:
        build = f"FUSEDENC_GPU={_build_info.GPU_OPTION}: {_build_info.CORE_REASON}"
    module, why = _load()
    if module is None:
        return Backend("reference", why, build=build)
    library = _library_text(module)
    forced = os.environ.get("FUSEDENC_BACKEND", "").strip().lower()
    if forced == "reference":
        return Backend("reference", "forced by FUSEDENC_BACKEND=reference", library, build)
    vendor = torch_vendor()
    if vendor != module.VENDOR:
        return Backend(
            "reference",
            f"the native core is {module.VENDOR} but this torch build is {vendor or 'CPU-only'}",
            library,
            build,
        )
    if not torch.cuda.is_available():
        return Backend("reference", f"the {module.VENDOR} core is built but torch sees no GPU", library, build)
    return Backend(module.VENDOR, "native core loaded", library, build)


def active_on(device: torch.device) -> bool:
    """Whether tensors on ``device`` run on the native core (a GPU and an active backend)."""
    return device.type == "cuda" and backend().name != "reference"


def library_info(module: Optional[ModuleType] = None) -> Optional[dict[str, Any]]:
    """The vendor and GEMM library of the core (``module``, default the loaded one), or None."""
    module = module or native_module()
    if module is None:
        return None
    return {"vendor": module.VENDOR, "library": _library_text(module), "library_version": int(module.library_version())}


# ------------------------------------------------------------ workspace ----

_workspaces: dict[tuple[int, int], torch.Tensor] = {}
_workspace_lock = threading.Lock()


def workspace(device: torch.device, stream: int) -> torch.Tensor:
    """The GEMM library's scratch memory for work queued on ``stream``.

    One buffer per (device, stream): kernels on different streams may run at
    once and must not share scratch.  While a CUDA graph is being captured a
    fresh buffer comes from the graph's private pool instead, so replays never
    share scratch with eager work on the capture stream; the graph keeps it alive.
    """
    if torch.cuda.is_current_stream_capturing():
        return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    key = (device.index, stream)
    buf = _workspaces.get(key)
    if buf is None:
        with _workspace_lock:
            buf = _workspaces.get(key)
            if buf is None:
                buf = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
                _workspaces[key] = buf
    return buf


# ------------------------------------------------------------ launches ----
# The callers have validated every operand (common/checks.py, or the encoder once
# per call signature): these functions trust shapes, strides, dtypes and
# alignment, and take a canonical activation name.


def _gemm_args(
    a, lda, w, ldw, out, ldo, m, n, k, bias=None, residual=None, ldr=0, activation="none", alpha=1.0, beta=1.0,
    *, stream, workspace,
):  # fmt: skip
    """The positional arguments of ``_C.gemm`` (and its tuning variants) from ``gemm``'s, spelled once."""
    return (
        a.device.index, stream, m, n, k, a.data_ptr(), lda, w.data_ptr(), ldw,
        0 if bias is None else bias.data_ptr(), 0 if residual is None else residual.data_ptr(), ldr,
        out.data_ptr(), ldo, DTYPE_CODES[a.dtype], ACTIVATION_IDS[activation], alpha, beta,
        workspace.data_ptr(), workspace.numel(),
    )  # fmt: skip


def gemm(
    *,
    a: torch.Tensor,
    lda: int,
    w: torch.Tensor,
    ldw: int,
    out: torch.Tensor,
    ldo: int,
    m: int,
    n: int,
    k: int,
    bias: Optional[torch.Tensor] = None,
    residual: Optional[torch.Tensor] = None,
    ldr: int = 0,
    activation: str = "none",
    alpha: float = 1.0,
    beta: float = 1.0,
    stream: int,
    workspace: torch.Tensor,
) -> None:
    """``out[m, n] = act(alpha * a[m, k] @ w[n, k]^T + bias)``, or ``... + bias + beta * residual``.

    Row-major operands with row strides ``lda``, ``ldw``, ``ldr``, ``ldo``;
    launched on ``stream`` (of ``a``'s device) with ``workspace`` as the
    library's scratch.  A dense, residual-free, alpha = 1 problem that a
    tuning file routed to the Triton FFN1 kernel runs that kernel; every other
    problem runs one BLASLt call.  A fused epilogue the library refuses falls
    back to BIAS + fusedenc's activation kernel with one ``FallbackWarning``
    per new plan.  The hot path of every GEMM: kept to a few attribute reads.
    """
    if residual is None and alpha == 1.0 and lda == k and ldw == k and ldo == n and gemm_routes.installed():
        route = gemm_routes.lookup(a, a.device.index, m, n, k, DTYPE_CODES[a.dtype], activation, bias is not None)
        if route is not None:  # measured faster than the library here (tune gemm)
            from . import triton_gemm  # imports Triton: only once a route exists

            triton_gemm.launch(a, w, bias, out, activation, route)
            return
    module = _module or native_module()
    args = _gemm_args(
        a, lda, w, ldw, out, ldo, m, n, k, bias, residual, ldr, activation, alpha, beta, stream=stream, workspace=workspace
    )
    if module.gemm(*args):
        _warn_fallback(module)


def _warn_fallback(module: ModuleType) -> None:
    events = module.fallback_events()
    if events:
        e = events[-1]
        warnings.warn(
            f"fusedenc: {e['requested']} epilogue unavailable for {e['problem']} ({e['reason']}); "
            f"using {e['used']}. fusedenc.fallback_events() lists every such case.",
            FallbackWarning,
            stacklevel=5,  # the caller of the public op
        )


def gemm_candidates(*, count: int, **problem: Any) -> dict[str, Any]:
    """Up to ``count`` heuristic candidates for the library call ``gemm(**problem)`` would plan
    (nothing runs; the plan cache is untouched): ``{key, epilogue, fell_back, candidates}``;
    candidate 0 is the default pick.  ``problem``: ``gemm``'s keyword arguments."""
    return native_module().gemm_candidates(*_gemm_args(**problem), count)


def gemm_with_candidate(*, count: int, index: int, **problem: Any) -> None:
    """The library call ``gemm(**problem)`` with candidate ``index`` of ``gemm_candidates(count=count)``."""
    native_module().gemm_with_candidate(*_gemm_args(**problem), count, index)


def max_gemm_candidates() -> int:
    return native_module().MAX_GEMM_CANDIDATES


def copy_blocks(device: torch.device, stream: int, blocks: list) -> None:
    """Copy ``blocks``, each ``(dst, dst_pitch, src, src_pitch, width, rows)`` in bytes (device
    or pinned host addresses), on ``stream`` in order: one native call for what would be a
    framework op per tensor (a graph's static inputs, ``graph_feeds``)."""
    (_module or native_module()).copy_blocks(device.index, stream, blocks)


def pointer(t: Optional[torch.Tensor]) -> int:
    """A tensor's address for the core, 0 for None."""
    return 0 if t is None else t.data_ptr()


def layer_norm(
    *,
    x: torch.Tensor,
    ldx: int,
    rows: int,
    cols: int,
    out: torch.Tensor,
    ldo: int,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    residual: Optional[torch.Tensor] = None,
    ldr: int = 0,
    x_bias: Optional[torch.Tensor] = None,
    sum_out: Optional[torch.Tensor] = None,
    lds: int = 0,
    eps: float,
    alpha: float = 1.0,
    q_out: Optional[torch.Tensor] = None,
    q_scale: Optional[torch.Tensor] = None,
    stream: int,
) -> None:
    """``out = LayerNorm(alpha * (x + x_bias) + residual) * weight + bias`` over ``rows`` rows of
    ``cols``; ``sum_out`` (optional) gets the pre-norm sum; ``q_out`` (uint8 ``[rows, cols]``,
    dense) and ``q_scale`` (fp32 ``[rows]``), optional, the e4m3 codes of ``out`` with one
    scale per row (``fusedenc.fp8.rowwise.quantize_rows(out)``, bit for bit).  One kernel on ``stream``."""
    (_module or native_module()).layer_norm(
        x.device.index, stream, rows, cols, x.data_ptr(), ldx, pointer(residual), ldr, pointer(x_bias),
        pointer(weight), pointer(bias), out.data_ptr(), ldo, pointer(sum_out), lds, DTYPE_CODES[x.dtype], eps, alpha,
        pointer(q_out), cols if q_out is not None else 0, pointer(q_scale),
    )  # fmt: skip


def native_epilogues() -> Optional[dict[str, Any]]:
    """Per activation: the library epilogue used with and without bias (None: none), or None without a core."""
    module = native_module()
    return module.native_epilogues() if module else None


def fallback_events() -> list[dict[str, str]]:
    """Every GEMM shape whose fused epilogue the library refused, with the reason."""
    module = native_module()
    return list(module.fallback_events()) if module else []


def plan_cache_info() -> dict[str, int]:
    """Size, limit, hits, misses and evictions of the native GEMM plan cache.

    The cache is one LRU map per process, shared by every device, stream and
    thread; ``limit`` is 1024 plans unless ``FUSEDENC_PLAN_CACHE_LIMIT`` or
    ``set_plan_cache_limit`` says otherwise.  Without a native core all counts are 0.
    """
    module = native_module()
    if module is None:
        return {"size": 0, "limit": 0, "hits": 0, "misses": 0, "evictions": 0}
    return dict(module.plan_cache_info())


def set_plan_cache_limit(limit: int) -> None:
    """Bound the plan cache to ``limit`` entries (least recently used are evicted).

    The starting limit is 1024 plans, or the environment variable
    ``FUSEDENC_PLAN_CACHE_LIMIT`` (a positive integer; read once, when the
    native core is first used, e.g. by the first GPU op or ``plan_cache_info()``;
    an invalid value is ignored with a RuntimeWarning).  A plan is the
    library's descriptors and one chosen algorithm: host memory only, no
    device memory.  Lowering the limit evicts at once; a plan in use by another
    thread stays alive until that call returns.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be a positive int, got {limit!r}")
    module = native_module()
    if module is not None:
        module.set_plan_cache_limit(limit)


def clear_plan_cache() -> None:
    module = native_module()
    if module is not None:
        module.clear_plan_cache()


@contextlib.contextmanager
def force_epilogue_fallback() -> Iterator[None]:
    """Plan GEMMs as if the library had no algorithm for any fused epilogue.

    Exercises the fallback path (plain GEMM + fusedenc's bias/activation
    kernel) on hardware where the heuristic would never refuse.  Plans made
    inside are cached apart from normal ones.  No effect without a native core.
    Public as ``fusedenc.testing.force_epilogue_fallback``.
    """
    module = native_module()
    if module is None:
        yield
        return
    module.set_force_epilogue_fallback(True)
    try:
        yield
    finally:
        module.set_force_epilogue_fallback(False)


# ------------------------------------------------------------ GEMM tuning ----

_tuning_lock = threading.Lock()
_tuning_report: list[dict[str, Any]] = []


def load_gemm_tuning(
    module: Optional[ModuleType] = None,
    devices: Optional[list[int]] = None,
    path: Optional[str] = None,
) -> list[dict[str, Any]]:
    """Read the GEMM tuning file of each device and install its choices in the core.

    Replaces every installed choice (and so clears the plan cache) and every
    Triton route.  ``module`` defaults to the loaded core (tests pass a fake);
    ``devices`` to every visible GPU; ``path`` overrides the file
    (``gemm_tuning.gemm_tuning_path(arch)``) for all of them.  Returns, per
    device, what was done (``gemm_tuning.collect``); ``gemm_tuning_report()``
    keeps the latest.
    """
    module = module or native_module()
    if module is None:
        return []
    if devices is None:
        devices = list(range(torch.cuda.device_count()))
    info = library_info(module)
    report, installs, routes = gemm_tuning.collect(
        devices,
        path,
        arch_of=lambda index: device_arch(torch.device("cuda", index)),
        metadata_of=lambda index: gemm_tuning.device_metadata(info, index),
    )
    with _tuning_lock:
        module.clear_gemm_choices()
        for index, c in installs:
            module.set_gemm_choice(
                **gemm_tuning.key_to_core(c["key"], index),
                index=c["index"],
                candidates=c["candidates"],
                algo=c.get("algo", ""),
            )
        gemm_routes.install(routes)
        _tuning_report[:] = report
    return report


def clear_gemm_choices() -> None:
    """Forget every installed choice (the tuner measures the heuristic itself)."""
    module = native_module()
    if module is not None:
        module.clear_gemm_choices()


def gemm_tuning_report() -> list[dict[str, Any]]:
    """What the latest ``load_gemm_tuning`` did, per device (empty before the core's first use)."""
    with _tuning_lock:
        return [dict(e) for e in _tuning_report]


def gemm_choices() -> list[dict[str, Any]]:
    """GEMM algorithm choices installed from tuning files (``python -m fusedenc.tune gemm``).

    One dict per problem: ``key`` (device, sizes, leading dimensions, dtype and
    activation names, bias/residual, alignments, workspace bytes), ``index`` of
    the heuristic candidate to run among ``candidates``, ``algo`` (its
    description when measured), ``status`` ("not used yet", "in use: ..." or
    "ignored: ...", in which case the heuristic's first algorithm runs) and
    ``plans`` (plans made under it).  Empty without a native core or a tuning
    file; ``capabilities()["gemm_tuning"]`` says which files were read.
    """
    module = native_module()
    if module is None or not hasattr(module, "gemm_choices"):
        return []
    out = []
    for c in module.gemm_choices():
        key = dict(gemm_tuning.key_from_core(c["key"]), device=c["key"]["device"])
        out.append(dict(c, key=key))
    return sorted(out, key=lambda c: (c["key"]["device"], c["key"]["m"], c["key"]["n"], c["key"]["k"]))


def _gemm_tuning_wanted() -> bool:
    return os.environ.get(GEMM_TUNING_ENV, "").strip().lower() not in ("0", "off", "false", "no")


def load_gemm_tuning_at_start(module: ModuleType) -> None:
    """Install tuning files when the core is first used; never on CPU-only machines, never raising."""
    if not _gemm_tuning_wanted() or os.environ.get("FUSEDENC_BACKEND", "").strip().lower() == "reference":
        return
    if torch_vendor() != getattr(module, "VENDOR", None) or not hasattr(module, "set_gemm_choice"):
        return
    try:
        if not torch.cuda.is_available():
            return
        load_gemm_tuning(module)
    except Exception as exc:  # noqa: BLE001 - a tuning file must never disable the core
        warnings.warn(
            f"fusedenc: GEMM tuning files not loaded: {type(exc).__name__}: {exc}",
            gemm_tuning.GemmTuningWarning,
            stacklevel=3,
        )


# The kernels with a seam of their own (imported last: they use the names above).
from .fp8 import (  # noqa: E402
    fp8_compiled,
    fp8_gemm,
    fp8_quantize_rows,
    fp8_status,
    sm90_fp8_gemm_applies,
    sm90_fp8_gemm_kernels,
)
from .hopper import (  # noqa: E402
    norm_stats,
    set_sm90_sm_limit,
    sm90_fold_applies,
    sm90_fold_fits,
    sm90_gemm_applies,
    sm90_gelu_epilogue,
    sm90_gelu_epilogue_kernels,
    sm90_gelu_epilogue_on,
    sm90_gemm_disabled,
    sm90_gemm_kernels,
    sm90_norm_gemm,
    sm90_residual_gemm,
    sm90_residual_gemm_compiled,
    stats_tile,
)
