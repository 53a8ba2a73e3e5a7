"""What the installed core can do: capabilities, plan cache and fallback reports."""

from __future__ import annotations

from typing import Any

from . import _native, gemm_routes
from .activations import ACTIVATIONS

__all__ = [
    "capabilities",
    "clear_plan_cache",
    "fallback_events",
    "gemm_choices",
    "plan_cache_info",
    "set_plan_cache_limit",
]

_DTYPES = ("float16", "bfloat16", "float32")


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
    b = _native.backend()
    module = _native.native_module()
    report: dict[str, Any] = {
        "backend": b.name,
        "reason": b.reason,
        "active": b.name != "reference",
        "vendor": module.VENDOR if module else None,
        "library": b.library,
        "dtypes": list(_DTYPES),
        "activations": {},
        "residual": {},
        # Per device: the GEMM tuning file read at the core's first use and what became of it.
        "gemm_tuning": _native.gemm_tuning_report(),
        # Problems a tuning file routes to the Triton FFN1 kernel (it measured faster there).
        "triton_gemm_routes": [
            dict(key._asdict(), config=config._asdict()) for key, config in sorted(gemm_routes.routes().items())
        ],
    }
    epilogues = module.native_epilogues() if module else None
    for dtype in _DTYPES:
        per_act = {}
        for act in ACTIVATIONS:
            if epilogues is None:
                per_act[act] = {"fusion": "reference", "epilogue": None, "kernel": "torch"}
            elif epilogues[act]["bias"] is not None:
                per_act[act] = {"fusion": "native", "epilogue": epilogues[act]["bias"], "kernel": None}
            else:
                per_act[act] = {"fusion": "fallback", "epilogue": "BIAS", "kernel": "bias_activation"}
        report["activations"][dtype] = per_act
        report["residual"][dtype] = (
            {"fusion": "native", "epilogue": "BIAS with beta*C, C != D", "kernel": None}
            if module
            else {"fusion": "reference", "epilogue": None, "kernel": "torch"}
        )
    return report


def fallback_events() -> list[dict[str, str]]:
    """Every GEMM shape whose fused epilogue the library refused, with the reason."""
    module = _native.native_module()
    return list(module.fallback_events()) if module else []


def plan_cache_info() -> dict[str, int]:
    """Size, limit, hits, misses and evictions of the native GEMM plan cache.

    The cache is one LRU map per process, shared by every device, stream and
    thread; ``limit`` is 1024 plans unless ``FUSEDENC_PLAN_CACHE_LIMIT`` or
    ``set_plan_cache_limit`` says otherwise.  Without a native core all counts are 0.
    """
    module = _native.native_module()
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
    module = _native.native_module()
    if module is not None:
        module.set_plan_cache_limit(limit)


def clear_plan_cache() -> None:
    module = _native.native_module()
    if module is not None:
        module.clear_plan_cache()


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
    module = _native.native_module()
    if module is None or not hasattr(module, "gemm_choices"):
        return []
    out = []
    for c in module.gemm_choices():
        key = dict(_native.key_from_core(c["key"]), device=c["key"]["device"])
        out.append(dict(c, key=key))
    return sorted(out, key=lambda c: (c["key"]["device"], c["key"]["m"], c["key"]["n"], c["key"]["k"]))
