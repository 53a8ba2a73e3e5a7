"""Loading the native core and deciding which backend serves GPU tensors.

The core (``fusedenc._C``) is optional: without it, or without a GPU that
matches it, every op runs its PyTorch reference.  ``backend()`` says which
path is active and why; nothing here is decided per call.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import importlib.util
import os
import threading
from types import ModuleType

import torch

try:  # written by CMake at build time; absent in a plain source checkout
    from . import _build_info
except ImportError:  # pragma: no cover - only without an install
    _build_info = None

__all__ = ["Backend", "backend", "native_module", "workspace"]

#: Workspace handed to the GEMM library per (device, stream).  32 MiB is what
#: NVIDIA recommends for Hopper; FUSEDENC_WORKSPACE_MB overrides it.
WORKSPACE_BYTES = int(float(os.environ.get("FUSEDENC_WORKSPACE_MB", "32")) * (1 << 20))

_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


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
        from . import _C
    except ImportError as exc:
        return None, f"the {core} core is built but failed to import: {exc}"
    limit = plan_cache_limit_from_env()
    if limit is not None:
        _C.set_plan_cache_limit(limit)
    return _C, ""


#: Environment variable bounding the native GEMM plan cache (entries), read
#: once, when the core is first used; ``fusedenc.set_plan_cache_limit`` changes
#: it later.  Without it the core's default (1024 plans) holds.
PLAN_CACHE_LIMIT_ENV = "FUSEDENC_PLAN_CACHE_LIMIT"


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
        import warnings

        warnings.warn(
            f"fusedenc: ignoring {PLAN_CACHE_LIMIT_ENV}={text!r}: not a positive integer; "
            "the plan cache keeps its default limit",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return limit


def native_module() -> ModuleType | None:
    """The imported ``fusedenc._C``, or None when it is absent or unusable."""
    return _load()[0]


@functools.lru_cache(maxsize=None)
def backend() -> Backend:
    """The backend that serves ops on GPU tensors (CPU tensors always use the reference)."""
    build = None
    if _build_info is not None:
        build = f"FUSEDENC_GPU={_build_info.GPU_OPTION}: {_build_info.CORE_REASON}"
    module, why = _load()
    if module is None:
        return Backend("reference", why, build=build)
    version = module.library_version()
    library = f"{module.LIBRARY} {version // 10000}.{version // 100 % 100}.{version % 100}"
    forced = os.environ.get("FUSEDENC_BACKEND", "").strip().lower()
    if forced == "reference":
        return Backend("reference", "forced by FUSEDENC_BACKEND=reference", library, build)
    torch_vendor = "hip" if torch.version.hip else ("cuda" if torch.version.cuda else None)
    if torch_vendor != module.VENDOR:
        return Backend(
            "reference",
            f"the native core is {module.VENDOR} but this torch build is {torch_vendor or 'CPU-only'}",
            library,
            build,
        )
    if not torch.cuda.is_available():
        return Backend("reference", f"the {module.VENDOR} core is built but torch sees no GPU", library, build)
    return Backend(module.VENDOR, "native core loaded", library, build)


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPE_CODES[dtype]


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
