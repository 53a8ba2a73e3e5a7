"""GEMM tuning files: their schema, where they live, how they are read and checked.

``python -m fusedenc.tune gemm`` measures the heuristic's candidate algorithms
per GEMM problem (and the Triton FFN1 kernel where the library has no epilogue
for the activation) and writes the winners to
``$FUSEDENC_CONFIG_DIR/gemm_<arch>.json`` (default ``~/.cache/fusedenc``).
When the native core is first used on a machine with a GPU, ``core`` asks this
module what each visible device's file holds (``collect``) and installs it:
the library choices in the core, the Triton routes in ``gemm_routes``.  A file
measured elsewhere, or one that does not parse, is ignored with one
``GemmTuningWarning`` naming the file and the reason.

This module reads and checks files; it never calls the native core.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch

from ..common import dtypes, table_files
from ..common.activations import ACTIVATIONS, activation_id
from . import gemm_routes
from .gemm_routes import GemmConfig

__all__ = [
    "GEMM_KEY_FIELDS",
    "GEMM_MATCH_KEYS",
    "GEMM_TUNING_SCHEMA",
    "GemmTuningError",
    "GemmTuningWarning",
    "changes_default",
    "collect",
    "device_metadata",
    "gemm_tuning_path",
    "library_choice_applies",
    "key_from_core",
    "key_ident",
    "key_to_core",
    "parse_gemm_tuning",
]

#: Schema tag of GEMM tuning files; a file with another tag is ignored.
GEMM_TUNING_SCHEMA = "fusedenc.gemm-tuning/1"
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
GEMM_KERNELS = ("blaslt", "triton", "sm90")

_DTYPE_NAMES = tuple(dtypes.name(d) for d in dtypes.SUPPORTED)  # index = the core's dtype code


class GemmTuningWarning(UserWarning):
    """A GEMM tuning file was ignored (other device or library version, or unreadable)."""


class GemmTuningError(ValueError):
    """What is wrong with a GEMM tuning file."""


def gemm_tuning_path(arch: str) -> str:
    """Where ``tune gemm`` writes, and the loader reads, the choices for GPU architecture ``arch``."""
    return os.path.join(table_files.config_dir(), f"gemm_{arch}.json")


def device_metadata(library: dict[str, Any], index: int) -> dict[str, Any]:
    """What a tuning file records and is matched against (``GEMM_MATCH_KEYS``) for device ``index``;
    ``library`` is ``core.library_info()``: the vendor, the GEMM library's name and version."""
    props = torch.cuda.get_device_properties(index)
    return {
        "vendor": library["vendor"],
        "device_name": props.name,
        "multiprocessor_count": props.multi_processor_count,
        "library": library["library"],
        "library_version": library["library_version"],
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
    out = {f: key[f] for f in GEMM_KEY_FIELDS}
    out["dtype"] = _DTYPE_NAMES[key["dtype"]]
    out["activation"] = ACTIVATIONS[key["activation"]]
    return out


def key_to_core(key: dict[str, Any], device: int) -> dict[str, Any]:
    """A validated file key -> the keyword arguments of ``_C.set_gemm_choice`` (less index/candidates/algo)."""
    out = {f: key[f] for f in GEMM_KEY_FIELDS}
    out["dtype"] = _DTYPE_NAMES.index(key["dtype"])
    out["activation"] = activation_id(key["activation"])
    out["device"] = device
    return out


def _check_key(key: object, where: str) -> None:
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
    if not isinstance(choice.get("replaces_sm90", False), bool):
        raise GemmTuningError(f"{where}.replaces_sm90 must be a bool")
    if kernel == "sm90" and (choice["index"] != 0 or choice.get("replaces_sm90")):
        raise GemmTuningError(f"{where}: a choice that keeps the sm90 kernel has index 0 and replaces nothing")
    if kernel in ("blaslt", "sm90"):
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


def parse_gemm_tuning(text: str, arch: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(measured_with, choices) of a tuning file for ``arch``; GemmTuningError says what is wrong.

    Each choice is ``{"key": {GEMM_KEY_FIELDS}, "index": int, "candidates": int, "algo": str}``,
    optionally ``"kernel": "triton"`` with ``"triton_config": [GemmConfig fields]`` where the
    Triton FFN1 kernel won (``index`` is then the library's best, used where Triton is
    missing), plus whatever the tuner recorded (times, which GEMM); metadata are checked by the caller.
    """
    obj, measured = table_files.parse_file_header(
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


def _read(path: str, arch: str) -> tuple[Optional[dict], list, Optional[str]]:
    """(measured_with, choices, problem) of one file; problem "absent" when there is none."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        measured, choices = parse_gemm_tuning(text, arch)
        return measured, choices, None
    except FileNotFoundError:
        return None, [], "absent"
    except OSError as exc:
        return None, [], f"cannot be read ({exc})"
    except GemmTuningError as exc:
        return None, [], str(exc)


_warned: set[str] = set()


def _warn(path: str, why: str, stacklevel: int) -> None:
    table_files.warn_once_per_file(
        _warned, path,
        f"fusedenc: ignoring GEMM tuning file {path}: {why}. Re-run `python -m fusedenc.tune gemm` on this "
        "machine to measure a new one; until then the heuristic's first algorithm runs.",
        GemmTuningWarning,
        stacklevel=stacklevel + 1,
    )  # fmt: skip


def _routes_of(index: int, choices: list[dict[str, Any]], path: str, stacklevel: int) -> dict:
    """The Triton routes of a file's choices for device ``index``.  Without the Triton
    package they are skipped with one warning (the library's choice serves them)."""
    triton_choices = [c for c in choices if c.get("kernel") == "triton"]
    if triton_choices and not gemm_routes.triton_available():
        table_files.warn_once_per_file(
            _warned, path + " (triton)",
            f"fusedenc: {len(triton_choices)} GEMM choices in {path} name the Triton kernel, but the triton "
            "package is not installed: the library's algorithm serves them.",
            GemmTuningWarning,
            stacklevel=stacklevel + 1,
        )  # fmt: skip
        return {}
    routes = {}
    for c in triton_choices:
        key = c["key"]
        route = gemm_routes.RouteKey(
            index, key["m"], key["n"], key["k"], _DTYPE_NAMES.index(key["dtype"]), key["activation"], key["has_bias"]
        )
        routes[route] = GemmConfig(*c["triton_config"])
    return routes


def library_choice_applies(choice: dict[str, Any]) -> bool:
    """Whether ``choice`` is a library candidate to install: one other than the heuristic's
    first, or one that replaces the sm90 epilogue GEMM (candidate 0 included).  A choice that
    records the sm90 kernel staying installs nothing."""
    if choice.get("kernel") == "sm90":
        return False
    return choice["index"] != 0 or bool(choice.get("replaces_sm90"))


def changes_default(choice: dict[str, Any]) -> bool:
    """Whether ``choice`` changes what runs where it is installed (Triton routes included)."""
    return choice.get("kernel") == "triton" or library_choice_applies(choice)


def collect(
    devices: list[int], path: Optional[str], arch_of: Callable[[int], str], metadata_of: Callable[[int], dict]
) -> tuple[list[dict[str, Any]], list[tuple[int, dict]], dict]:
    """What to install for ``devices``: ``(report, library choices, Triton routes)``.

    Each device's file is ``path`` or ``gemm_tuning_path(arch_of(index))``; it applies when it
    parses and its ``measured_with`` matches ``metadata_of(index)`` on ``GEMM_MATCH_KEYS``.
    ``report`` has one ``{"device", "path", "status", "choices", "triton_routes"}`` per
    device; library choices are ``(device, choice)`` pairs (candidate 0 left out: it runs
    anyway), routes map ``gemm_routes.RouteKey`` to ``GemmConfig``.  An absent file is
    skipped silently; any other problem warns once per file and process.
    """
    report: list[dict[str, Any]] = []
    installs: list[tuple[int, dict]] = []
    routes: dict = {}
    parsed: dict[str, tuple[Optional[dict], list, Optional[str]]] = {}
    for index in devices:
        arch = arch_of(index)
        file = path or gemm_tuning_path(arch)
        entry: dict[str, Any] = {"device": index, "path": file, "status": "", "choices": 0, "triton_routes": 0}
        report.append(entry)
        if file not in parsed:
            parsed[file] = _read(file, arch)
        measured, choices, problem = parsed[file]
        if problem == "absent":
            entry["status"] = "absent"
            continue
        if problem is None:
            diffs = table_files.metadata_differences(measured, metadata_of(index), GEMM_MATCH_KEYS)
            if diffs:
                problem = "measured on another device or library version (" + "; ".join(diffs) + ")"
        if problem is not None:
            entry["status"] = f"ignored: {problem}"
            _warn(file, problem, stacklevel=3)
            continue
        device_routes = _routes_of(index, choices, file, stacklevel=3)
        routes.update(device_routes)
        # A routed problem never reaches the library.
        chosen = [
            c for c in choices if library_choice_applies(c) and not (device_routes and c.get("kernel") == "triton")
        ]
        installs.extend((index, c) for c in chosen)
        entry.update(status="installed", choices=len(chosen), triton_routes=len(device_routes))
    return report, installs, routes
