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
import json
import os
import threading
import warnings
from types import ModuleType
from typing import Any, Optional

import torch

from . import gemm_routes
from .gemm_routes import GemmConfig

try:  # written by CMake at build time; absent in a plain source checkout
    from . import _build_info
except ImportError:  # pragma: no cover - only without an install
    _build_info = None

__all__ = [
    "Backend",
    "GemmTuningWarning",
    "backend",
    "gemm_tuning_path",
    "gemm_tuning_report",
    "load_gemm_tuning",
    "native_module",
    "workspace",
]

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
    _load_gemm_tuning_at_start(_C)
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


# ------------------------------------------------------ GEMM tuning files ----
# `python -m fusedenc.tune gemm` measures the heuristic's candidate algorithms
# per GEMM problem and writes the winners to $FUSEDENC_CONFIG_DIR/gemm_<arch>.json
# (default ~/.cache/fusedenc).  When the core is first used on a machine with
# a GPU, each visible device's file is read, checked against the device (name,
# multiprocessor count) and the GEMM library's version, and its choices are
# installed in the core.  A file measured elsewhere, or one that does not
# parse, is ignored with one GemmTuningWarning naming the file and the reason.

#: Schema tag of GEMM tuning files; a file with another tag is ignored.
GEMM_TUNING_SCHEMA = "fusedenc.gemm-tuning/1"
#: Directory of user tuning files (shared with the attention tables).
CONFIG_DIR_ENV = "FUSEDENC_CONFIG_DIR"
#: "0", "off", "false" or "no": do not load GEMM tuning files at start (A/B runs).
GEMM_TUNING_ENV = "FUSEDENC_GEMM_TUNING"
#: What a file's ``measured_with`` must match on this device for its choices to apply.
GEMM_MATCH_KEYS = ("vendor", "device_name", "multiprocessor_count", "library_version")
#: A choice's ``key``: the core's plan key without pointers (see csrc/gemm.h GemmKey).
GEMM_KEY_FIELDS = (
    "m", "n", "k", "lda", "ldw", "ldc", "ldd", "dtype", "activation", "has_bias", "has_residual",
    "align_a", "align_w", "align_c", "align_d", "workspace_bytes",
)  # fmt: skip
#: The core's limit on candidates per problem (csrc/gemm.h kMaxGemmCandidates).
MAX_GEMM_CANDIDATES = 256
#: What a choice's ``kernel`` may name: the library call (default) or the Triton FFN1 kernel (gemm_routes.py).
GEMM_KERNELS = ("blaslt", "triton")

_DTYPE_NAMES = ("float16", "bfloat16", "float32")  # index = the core's dtype code


class GemmTuningWarning(UserWarning):
    """A GEMM tuning file was ignored (other device or library version, or unreadable)."""


class GemmTuningError(ValueError):
    """What is wrong with a GEMM tuning file."""


def config_dir() -> str:
    return os.environ.get(CONFIG_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "fusedenc")


def gemm_tuning_path(arch: str) -> str:
    """Where ``tune gemm`` writes, and the loader reads, the choices for GPU architecture ``arch``."""
    return os.path.join(config_dir(), f"gemm_{arch}.json")


def _library_name(module: ModuleType) -> str:
    v = module.library_version()
    return f"{module.LIBRARY} {v // 10000}.{v // 100 % 100}.{v % 100}"


def gemm_device_metadata(module: ModuleType, index: int) -> dict[str, Any]:
    """What a tuning file records and is matched against (``GEMM_MATCH_KEYS``) for device ``index``."""
    props = torch.cuda.get_device_properties(index)
    return {
        "vendor": module.VENDOR,
        "device_name": props.name,
        "multiprocessor_count": props.multi_processor_count,
        "library": _library_name(module),
        "library_version": int(module.library_version()),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
    }


def _is_int(v: object, low: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def key_ident(key: dict[str, Any]) -> tuple:
    """A file key's identity (its values in GEMM_KEY_FIELDS order): what makes two choices the same problem."""
    return tuple(key[f] for f in GEMM_KEY_FIELDS)


def key_from_core(key: dict[str, Any]) -> dict[str, Any]:
    """A key as ``_C.gemm_candidates`` returns it -> the file's form (names, no device)."""
    from .activations import ACTIVATIONS

    out = {f: key[f] for f in GEMM_KEY_FIELDS}
    out["dtype"] = _DTYPE_NAMES[key["dtype"]]
    out["activation"] = ACTIVATIONS[key["activation"]]
    return out


def key_to_core(key: dict[str, Any], device: int) -> dict[str, Any]:
    """A validated file key -> the keyword arguments of ``_C.set_gemm_choice`` (less index/candidates/algo)."""
    from .activations import activation_id

    out = {f: key[f] for f in GEMM_KEY_FIELDS}
    out["dtype"] = _DTYPE_NAMES.index(key["dtype"])
    out["activation"] = activation_id(key["activation"])
    out["device"] = device
    return out


def _check_key(key: object, where: str) -> None:
    from .activations import ACTIVATIONS

    if not isinstance(key, dict):
        raise GemmTuningError(f"{where}.key must be an object")
    missing = [f for f in GEMM_KEY_FIELDS if f not in key]
    extra = sorted(set(key) - set(GEMM_KEY_FIELDS))
    if missing or extra:
        raise GemmTuningError(f"{where}.key: missing fields {missing}, unknown fields {extra}")
    for f in ("m", "n", "k", "lda", "ldw", "ldd"):
        if not _is_int(key[f], 1):
            raise GemmTuningError(f"{where}.key.{f}={key[f]!r} is not a positive int")
    if not _is_int(key["ldc"], 0) or not _is_int(key["workspace_bytes"], 0):
        raise GemmTuningError(f"{where}.key: ldc and workspace_bytes must be non-negative ints")
    for f in ("align_a", "align_w", "align_c", "align_d"):
        if key[f] not in (1, 2, 4, 8, 16) or isinstance(key[f], bool):
            raise GemmTuningError(f"{where}.key.{f}={key[f]!r} is not one of 1, 2, 4, 8, 16")
    for f in ("has_bias", "has_residual"):
        if not isinstance(key[f], bool):
            raise GemmTuningError(f"{where}.key.{f}={key[f]!r} is not a bool")
    if key["dtype"] not in _DTYPE_NAMES:
        raise GemmTuningError(f"{where}.key.dtype={key['dtype']!r} is not one of {list(_DTYPE_NAMES)}")
    if key["activation"] not in ACTIVATIONS:
        raise GemmTuningError(f"{where}.key.activation={key['activation']!r} is not one of {list(ACTIVATIONS)}")
    if key["has_residual"] and key["activation"] != "none":
        raise GemmTuningError(f"{where}.key: a residual cannot be combined with an activation")


def _check_kernel(choice: dict[str, Any], where: str) -> None:
    """A choice's optional ``kernel`` ("blaslt" or "triton") and, for Triton, its ``triton_config``."""
    kernel = choice.get("kernel", "blaslt")
    if kernel not in GEMM_KERNELS:
        raise GemmTuningError(f"{where}.kernel={kernel!r} is not one of {list(GEMM_KERNELS)}")
    if kernel == "blaslt":
        return
    key = choice["key"]
    dense = key["lda"] == key["k"] and key["ldw"] == key["k"] and key["ldd"] == key["n"]
    aligned = key["align_a"] == key["align_w"] == key["align_d"] == 16
    if key["has_residual"] or not dense or not aligned:
        raise GemmTuningError(
            f"{where}: the Triton kernel serves only dense, 16-byte aligned problems without a residual"
        )
    cfg = choice.get("triton_config")
    fields = list(GemmConfig._fields)
    if not isinstance(cfg, list) or len(cfg) != len(fields) or not all(_is_int(v, 1) for v in cfg):
        raise GemmTuningError(f"{where}.triton_config must be a list of {len(fields)} positive ints {fields}")
    c = GemmConfig(*cfg)
    powers_of_two = (c.block_m, c.block_n, c.block_k, c.num_warps)
    if any(v & (v - 1) for v in powers_of_two) or min(c.block_m, c.block_n, c.block_k) < 16 or c.num_stages > 8:
        raise GemmTuningError(
            f"{where}.triton_config={cfg}: blocks must be powers of two >= 16, warps a power of two, stages <= 8"
        )


def parse_file_header(
    text: str,
    schema: str,
    arches: tuple[str, ...],
    device_arch: str,
    measured_keys: tuple[str, ...],
    error: type[Exception],
    measured_optional: bool,
) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
    """(the file's JSON object, its ``measured_with``) after the checks every table file shares.

    The GEMM tuning file and the attention table open alike: a JSON object with ``schema``,
    an ``arch`` among ``arches`` and ``measured_with``, an object holding ``measured_keys``
    (or null, where ``measured_optional``: the shipped attention tables are not measured
    on the user's machine).  Raises ``error`` saying what is wrong.
    """
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise error(f"not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise error("top level is not a JSON object")
    if obj.get("schema") != schema:
        raise error(f"schema is {obj.get('schema')!r}, expected {schema!r}")
    if obj.get("arch") not in arches:
        raise error(f"arch is {obj.get('arch')!r}, this device is {device_arch!r}")
    measured = obj.get("measured_with")
    if measured is None and measured_optional:
        return obj, None
    if not (isinstance(measured, dict) and all(k in measured for k in measured_keys)):
        null = "null or " if measured_optional else ""
        raise error(f"measured_with must be {null}an object with keys {list(measured_keys)}")
    return obj, measured


def parse_gemm_tuning(text: str, arch: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(measured_with, choices) of a tuning file for ``arch``; GemmTuningError says what is wrong.

    Each choice is ``{"key": {GEMM_KEY_FIELDS}, "index": int, "candidates": int, "algo": str}``,
    optionally ``"kernel": "triton"`` with ``"triton_config": [GemmConfig fields]`` where the
    Triton FFN1 kernel won (``index`` is then the library's best, used where Triton is
    missing), plus whatever the tuner recorded (times, which GEMM); metadata are checked by the caller.
    """
    obj, measured = parse_file_header(
        text, GEMM_TUNING_SCHEMA, (arch,), arch, GEMM_MATCH_KEYS, GemmTuningError, measured_optional=False
    )
    choices = obj.get("choices")
    if not isinstance(choices, list):
        raise GemmTuningError("choices must be a list")
    seen = set()
    for i, c in enumerate(choices):
        where = f"choices[{i}]"
        if not isinstance(c, dict):
            raise GemmTuningError(f"{where} must be an object")
        _check_key(c.get("key"), where)
        count, index = c.get("candidates"), c.get("index")
        if not _is_int(count, 1) or count > MAX_GEMM_CANDIDATES:
            raise GemmTuningError(f"{where}.candidates={count!r} is not an int in 1..{MAX_GEMM_CANDIDATES}")
        if not _is_int(index, 0) or index >= count:
            raise GemmTuningError(f"{where}.index={index!r} is not an int in 0..{count - 1}")
        if not isinstance(c.get("algo", ""), str):
            raise GemmTuningError(f"{where}.algo must be a string")
        _check_kernel(c, where)
        ident = key_ident(c["key"])
        if ident in seen:
            raise GemmTuningError(f"{where} repeats the key of an earlier choice")
        seen.add(ident)
    return measured, choices


def metadata_differences(
    measured: dict[str, Any], here: dict[str, Any], keys: tuple[str, ...] = GEMM_MATCH_KEYS
) -> list[str]:
    """``key: file X, here Y`` for each of ``keys`` where a tuning file's ``measured_with`` differs from this machine."""
    return [f"{k}: file {measured.get(k)!r}, here {here.get(k)!r}" for k in keys if measured.get(k) != here.get(k)]


def warn_once_per_file(seen: set[str], path: str, message: str, category: type[Warning], stacklevel: int) -> None:
    """Warn about a user tuning file once per process (``seen`` holds the paths already reported)."""
    if path in seen:
        return
    seen.add(path)
    warnings.warn(message, category, stacklevel=stacklevel + 1)


_tuning_lock = threading.Lock()
_tuning_report: list[dict[str, Any]] = []
_warned_tuning: set[str] = set()


def _warn_tuning(path: str, why: str) -> None:
    warn_once_per_file(
        _warned_tuning, path,
        f"fusedenc: ignoring GEMM tuning file {path}: {why}. Re-run `python -m fusedenc.tune gemm` on this "
        "machine to measure a new one; until then the heuristic's first algorithm runs.",
        GemmTuningWarning,
        stacklevel=3,
    )  # fmt: skip


def _device_arch(index: int) -> str:
    from .attention import device_arch

    return device_arch(torch.device("cuda", index))


def load_gemm_tuning(
    module: Optional[ModuleType] = None,
    devices: Optional[list[int]] = None,
    path: Optional[str] = None,
) -> list[dict[str, Any]]:
    """Read the GEMM tuning file of each device and install its choices in the core.

    Replaces every installed choice (and so clears the plan cache).  ``devices``
    defaults to every visible GPU; ``path`` overrides the file
    (``gemm_tuning_path(arch)``) for all of them.  Returns, per device, what was
    done: ``{"device", "path", "status", "choices", "triton_routes"}`` (library
    choices installed; problems routed to the Triton kernel, ``gemm_routes``);
    ``gemm_tuning_report()`` keeps the latest.  A file that is absent is skipped silently; one that is
    unreadable, malformed or measured on another device or library version is
    ignored with one ``GemmTuningWarning`` per file and process.
    """
    module = module or native_module()
    if module is None:
        return []
    if devices is None:
        devices = list(range(torch.cuda.device_count()))
    report: list[dict[str, Any]] = []
    installs: list[tuple[int, dict]] = []
    routes: dict[gemm_routes.RouteKey, GemmConfig] = {}
    parsed: dict[str, tuple[Optional[dict], list, Optional[str]]] = {}
    for index in devices:
        file = path or gemm_tuning_path(_device_arch(index))
        entry: dict[str, Any] = {"device": index, "path": file, "status": "", "choices": 0, "triton_routes": 0}
        report.append(entry)
        if file not in parsed:
            try:
                with open(file, encoding="utf-8") as f:
                    text = f.read()
                measured, choices = parse_gemm_tuning(text, _device_arch(index))
                parsed[file] = (measured, choices, None)
            except FileNotFoundError:
                parsed[file] = (None, [], "absent")
            except OSError as exc:
                parsed[file] = (None, [], f"cannot be read ({exc})")
            except GemmTuningError as exc:
                parsed[file] = (None, [], str(exc))
        measured, choices, problem = parsed[file]
        if problem == "absent":
            entry["status"] = "absent"
            continue
        if problem is None:
            diffs = metadata_differences(measured, gemm_device_metadata(module, index))
            if diffs:
                problem = "measured on another device or library version (" + "; ".join(diffs) + ")"
        if problem is not None:
            entry["status"] = f"ignored: {problem}"
            _warn_tuning(file, problem)
            continue
        routed = _collect_routes(routes, index, choices, file)
        # Candidate 0 is what runs anyway; a routed problem never reaches the library.
        chosen = [c for c in choices if c["index"] != 0 and not (routed and c.get("kernel") == "triton")]
        installs.extend((index, c) for c in chosen)
        entry["status"] = "installed"
        entry["choices"] = len(chosen)
        entry["triton_routes"] = routed
    with _tuning_lock:
        module.clear_gemm_choices()
        for index, c in installs:
            module.set_gemm_choice(
                **key_to_core(c["key"], index), index=c["index"], candidates=c["candidates"], algo=c.get("algo", "")
            )
        gemm_routes.install(routes)
        _tuning_report[:] = report
    return report


def _collect_routes(
    routes: dict[gemm_routes.RouteKey, GemmConfig], index: int, choices: list[dict[str, Any]], file: str
) -> int:
    """Add a file's Triton choices for device ``index`` to ``routes``; how many.  Without the
    Triton package they are skipped with one warning (the library's choice serves them)."""
    triton_choices = [c for c in choices if c.get("kernel") == "triton"]
    if triton_choices and not gemm_routes.triton_available():
        warn_once_per_file(
            _warned_tuning, file + " (triton)",
            f"fusedenc: {len(triton_choices)} GEMM choices in {file} name the Triton kernel, but the triton "
            "package is not installed: the library's algorithm serves them.",
            GemmTuningWarning,
            stacklevel=4,
        )  # fmt: skip
        return 0
    for c in triton_choices:
        key = c["key"]
        route = gemm_routes.RouteKey(
            index, key["m"], key["n"], key["k"], _DTYPE_NAMES.index(key["dtype"]), key["activation"], key["has_bias"]
        )
        routes[route] = GemmConfig(*c["triton_config"])
    return len(triton_choices)


def gemm_tuning_report() -> list[dict[str, Any]]:
    """What the latest ``load_gemm_tuning`` did, per device (empty before the core's first use)."""
    with _tuning_lock:
        return [dict(e) for e in _tuning_report]


def _gemm_tuning_wanted() -> bool:
    return os.environ.get(GEMM_TUNING_ENV, "").strip().lower() not in ("0", "off", "false", "no")


def _load_gemm_tuning_at_start(module: ModuleType) -> None:
    """Install tuning files when the core is first used; never on CPU-only machines, never raising."""
    if not _gemm_tuning_wanted() or os.environ.get("FUSEDENC_BACKEND", "").strip().lower() == "reference":
        return
    torch_vendor = "hip" if torch.version.hip else ("cuda" if torch.version.cuda else None)
    if torch_vendor != getattr(module, "VENDOR", None) or not hasattr(module, "set_gemm_choice"):
        return
    try:
        if not torch.cuda.is_available():
            return
        load_gemm_tuning(module)
    except Exception as exc:  # noqa: BLE001 - a tuning file must never disable the core
        warnings.warn(f"fusedenc: GEMM tuning files not loaded: {type(exc).__name__}: {exc}", GemmTuningWarning, stacklevel=3)
