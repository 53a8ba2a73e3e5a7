"""CUDA graphs: the explicit ``GraphRunner`` and capture helpers (runner.py), the automatic
graphs behind a module's plain call (auto.py), how a call's inputs reach a graph's static
buffers (feeds.py) and graphs of packed rows per token count (varlen.py)."""

from .runner import (
    BucketedGraphs,
    CaptureUnavailable,
    GraphRunner,
    capture,
    capture_possible,
    eager_calls,
    eager_only,
    no_cycle_collection,
    own_cublas_workspace,
)

__all__ = [
    "BucketedGraphs",
    "CaptureUnavailable",
    "GraphRunner",
    "capture",
    "capture_possible",
    "eager_calls",
    "eager_only",
    "no_cycle_collection",
    "own_cublas_workspace",
]
