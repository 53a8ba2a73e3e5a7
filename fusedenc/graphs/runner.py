"""CUDA graphs of a whole EncoderStack, one per batch-size bucket (``GraphRunner``).

Inference engines with fixed batch sizes spend most of their time at small
batches on kernel launches; a graph replays all of a stack's launches in one
call.  ``EncoderStack.graph_runner(...)`` makes one; ``BucketedGraphs`` is the
machinery, shared with ``fusedenc.lc0``'s whole-network runner and the token-bucketed
``VarlenGraphRunner``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from typing import Callable, Iterator, Optional, Sequence, TypeVar, Union

import torch
import torch.nn as nn

__all__ = ["BucketedGraphs", "CaptureUnavailable", "GraphRunner", "capture", "capture_possible", "eager_calls",
           "eager_only", "no_cycle_collection", "own_cublas_workspace"]

T = TypeVar("T")

#: PyTorch captures CUDA graphs only through its caching allocator, which this variable turns off
#: (read once, as PyTorch does; debuggers and compute-sanitizer's memcheck set it).
NO_CACHING_ENV = "PYTORCH_NO_CUDA_MEMORY_CACHING"
_caching_allocator_off = os.environ.get(NO_CACHING_ENV, "") == "1"


class CaptureUnavailable(RuntimeError):
    """A CUDA graph was asked for where PyTorch cannot capture one."""


def capture_possible() -> bool:
    """Whether CUDA graphs can be captured in this process (automatic graphs run eagerly when not)."""
    return not _caching_allocator_off


def _clear_cublas_workspaces() -> None:
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # absent from CPU builds
    if clear is not None:
        clear()


@contextlib.contextmanager
def own_cublas_workspace() -> Iterator[None]:
    """Wrap a CUDA graph capture so that the graph owns the cuBLAS workspace its torch
    matmuls use.  torch caches one workspace per (cuBLAS handle, stream); one cached before
    the capture may lie in memory the graph does not own, e.g. an earlier graph's pool,
    freed when the cache is next cleared (``torch.compile``'s CUDA graphs clear it around
    each of their captures): the graph's replays then write to freed memory (seen on an
    H100 as "unspecified launch failure" on the next replay).  Cleared before the capture,
    torch makes the workspace inside the graph's pool; cleared after it, eager work never
    shares it with replays.  torch's own CUDA-graph trees do the same."""
    _clear_cublas_workspaces()
    try:
        yield
    finally:
        _clear_cublas_workspaces()


_gc_pause_lock = threading.Lock()
_gc_pauses = 0  # captures in flight (any thread) that paused the cycle collector
_gc_was_enabled = False


@contextlib.contextmanager
def no_cycle_collection() -> Iterator[None]:
    """Wrap a CUDA graph capture so that Python's cycle collector does not run inside it.
    A collection can start at any allocation, on any thread; if it frees an object that
    held CUDA resources (pinned host memory, an event, an earlier graph: e.g. a closed
    Evaluator's buffers left in a reference cycle), the free is a call CUDA forbids during
    a capture, and the capture fails ("operation not permitted when stream is capturing",
    seen on two H200s, in the second GPU's capture).  torch no longer collects before a
    capture (``force_cudagraph_gc``).  Paused while any capture runs, re-enabled (if it
    was on) when the last one ends; garbage waits for the next collection."""
    global _gc_pauses, _gc_was_enabled
    with _gc_pause_lock:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_pause_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()


class _EagerCalls(threading.local):
    """A per-thread depth: while above 0, fusedenc modules called on this thread run eagerly
    (no automatic graphs, ``auto_graphs``): inside a capture, and inside another fusedenc
    module's call (an Lc0 net's blocks, a stack's warm-up)."""

    depth = 0

    def __enter__(self) -> None:
        self.depth += 1

    def __exit__(self, *exc) -> None:
        self.depth -= 1


_EAGER = _EagerCalls()


def eager_calls() -> _EagerCalls:
    """``with eager_calls():`` fusedenc modules called inside run eagerly (this thread)."""
    return _EAGER


def eager_only() -> bool:
    """Whether this thread is inside ``eager_calls()``."""
    return _EAGER.depth > 0


def capture(
    fn: Callable[[], T], device: torch.device, pool: Optional[object] = None, *, capture_error_mode: str = "global"
) -> tuple["torch.cuda.CUDAGraph", T]:
    """Capture ``fn()`` into a CUDA graph (in ``pool``, else a pool of its own) and return the
    graph with what the captured call returned (its static output).  One warm-up call on a
    side stream comes first: GEMM plans, workspaces, cuBLAS handles, the attention decision,
    folded weights and lazily made constants must exist before capture.  fusedenc modules
    called by ``fn`` run eagerly in both (their own automatic graphs stay out of this one).
    ``capture_error_mode``: ``torch.cuda.graph``'s ("thread_local" lets other threads work on)."""
    if not capture_possible():  # else the capture fails half-way and leaves the device unusable
        raise CaptureUnavailable(
            f"fusedenc: cannot capture a CUDA graph: {NO_CACHING_ENV}=1 turns off PyTorch's caching allocator, "
            f"which CUDA graph capture needs. Unset it, or run without graphs (plain calls fall back to eager "
            f"by themselves; graph runners cannot).")
    with eager_calls(), _capture_streams(device) as (side, stream):
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with no_cycle_collection(), own_cublas_workspace(), \
                torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode):
            out = fn()
    return graph, out


_free_streams: dict[torch.device, list[tuple["torch.cuda.Stream", "torch.cuda.Stream"]]] = {}
_free_streams_lock = threading.Lock()


@contextlib.contextmanager
def _capture_streams(device: torch.device) -> Iterator[tuple["torch.cuda.Stream", "torch.cuda.Stream"]]:
    """A (warm-up, capture) pair of streams of ``device``, reused across captures: the GEMM
    workspace is one buffer per stream (``core.workspace``), so a new warm-up stream a capture
    would hold 32 MiB more (torch hands out 32 streams round robin: up to 1 GiB; seen as
    reserved memory growing with every automatic capture).  A pair serves one capture at a
    time (two threads capturing at once take two pairs).  The capture stream is one of this
    device: torch's default capture stream is made once, on whichever device was current at
    the process's first capture, and a graph of another GPU captured on it fails ("operation
    not permitted when stream is capturing", seen with two H200s)."""
    with _free_streams_lock:
        free = _free_streams.setdefault(device, [])
        pair = free.pop() if free else None
    if pair is None:
        pair = (torch.cuda.Stream(device), torch.cuda.Stream(device))
    try:
        yield pair
    finally:
        with _free_streams_lock:
            _free_streams[device].append(pair)


class _Captured:
    __slots__ = ("graph", "inputs", "out")

    def __init__(self, graph, inputs, out):
        self.graph, self.inputs, self.out = graph, inputs, out


Output = Union[torch.Tensor, dict[str, torch.Tensor]]


def _rows(out: Output, stop: int) -> Output:
    return {k: v[:stop] for k, v in out.items()} if isinstance(out, dict) else out[:stop]


def _cat(parts: list[Output]) -> Output:
    if isinstance(parts[0], dict):
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    return torch.cat(parts)


def _clone(out: Output) -> Output:
    return {k: v.clone() for k, v in out.items()} if isinstance(out, dict) else out.clone()


class BucketedGraphs:
    """The machinery of a graph runner: one CUDA graph of ``run(*inputs)`` per batch-size
    bucket, captured on first use (``capture_all()`` does it up front), sharing one
    memory pool.

    A call with B rows replays the graph of the smallest bucket ``>= B`` with the inputs
    copied into the bucket's static inputs (rows past B are padding: the rows of a batch
    are independent, so they do not affect the real ones) and returns the first B rows
    of the static output (a tensor or a dict of tensors): views valid until the next
    call.  A batch larger than every bucket runs in chunks of the largest and returns
    new tensors.  Subclasses say what the static inputs are (``_static_inputs``) and
    check each call before ``_dispatch`` (or replay ``_graph(rows)`` themselves, where
    their inputs are not all batch-first: ``VarlenGraphRunner``).  ``name``: what the
    buckets are called in the error for bad ones.  Not thread-safe: one runner per thread.
    """

    def __init__(self, run: Callable[..., Output], batch_sizes: Sequence[int], device: torch.device, *,
                 name: str = "batch_sizes"):  # fmt: skip
        sizes = sorted(set(batch_sizes))
        if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in sizes):
            raise ValueError(f"{name} must be positive ints, got {batch_sizes!r}")
        self._run = run
        self.batch_sizes = tuple(sizes)
        self.device = device
        self._graphs: dict[int, _Captured] = {}
        self._pool = None
        self.capture_seconds = 0.0

    def _static_inputs(self, bucket: int) -> tuple[Optional[torch.Tensor], ...]:
        """Zero-filled inputs of batch ``bucket`` (None for an input calls do not pass)."""
        raise NotImplementedError

    def _empty(self, inputs: tuple[Optional[torch.Tensor], ...]) -> Output:
        """The result for a batch of 0 rows (nothing is captured or replayed): by default
        the eager run's, which launches nothing for an empty batch."""
        return self._run(*inputs)

    def capture_all(self) -> float:
        """Capture every bucket's graph now (largest first); returns the seconds spent."""
        start = time.perf_counter()
        for b in reversed(self.batch_sizes):
            if b not in self._graphs:
                self._capture(b)
        return time.perf_counter() - start

    def _capture(self, bucket: int) -> _Captured:
        start = time.perf_counter()
        inputs = self._static_inputs(bucket)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph, out = capture(lambda: self._run(*inputs), self.device, self._pool)
        captured = _Captured(graph, inputs, out)
        self._graphs[bucket] = captured
        self.capture_seconds += time.perf_counter() - start
        return captured

    def _graph(self, rows: int) -> _Captured:
        """The graph of the smallest bucket ``>= rows`` (``rows`` <= the largest), captured now if new."""
        bucket = next(s for s in self.batch_sizes if s >= rows)
        return self._graphs.get(bucket) or self._capture(bucket)

    def _dispatch(self, inputs: tuple[Optional[torch.Tensor], ...]) -> Output:
        """``inputs`` (checked): the first batch-first; the others None, batch-first, or
        with a leading 1 (the same for every row)."""
        b = inputs[0].shape[0]
        if b == 0:
            return self._empty(inputs)
        largest = self.batch_sizes[-1]
        if b > largest:
            parts = []
            for i in range(0, b, largest):
                sl = slice(i, min(b, i + largest))
                chunk = tuple(t if t is None or (j > 0 and t.shape[0] == 1) else t[sl] for j, t in enumerate(inputs))
                parts.append(_clone(self._replay(chunk)))
            return _cat(parts)
        return self._replay(inputs)

    def _replay(self, inputs: tuple[Optional[torch.Tensor], ...]) -> Output:
        b = inputs[0].shape[0]
        g = self._graph(b)
        for static, given in zip(g.inputs, inputs):
            if given is not None:
                static[:b].copy_(given)
        g.graph.replay()
        return _rows(g.out, b)


class GraphRunner(BucketedGraphs):
    """Replays one CUDA graph of the whole stack per batch-size bucket.

    Inference engines with fixed batch sizes spend most of their time at small
    batches on kernel launches; a graph replays all of a stack's launches in
    one call.  A call with B sequences runs the graph of the smallest bucket
    ``>= B``, with B copied into the bucket's static input (rows past B are
    padding: sequences are independent, so they do not affect the real ones);
    a batch larger than every bucket runs in chunks of the largest.  Graphs are
    captured on first use of a bucket (``capture_all()`` does it up front) and
    share one memory pool.

    The result is a view into the bucket's static output, valid until the
    next call (``.clone()`` it to keep it); a chunked call returns a new tensor.
    ``attn_bias`` / ``key_padding_mask`` say whether calls pass them
    (``[B or 1, H, S, S]`` and bool ``[B, S]``).  Input ``[B, S, D]`` in the
    stack's dtype on its GPU (batch first).  Not thread-safe: one runner per thread.
    """

    def __init__(self, stack: nn.Module, seq_len: int, batch_sizes: Sequence[int], *, attn_bias: bool, key_padding_mask: bool):
        # Any module with EncoderStack's interface runs (``blocks`` with d_model, n_heads and
        # qkv_weight; ``batch_first``; ``forward(x, attn_bias, key_padding_mask)``): checking the
        # interface instead of the class keeps this module free of an import of the encoder package.
        blocks = getattr(stack, "blocks", None) if isinstance(stack, nn.Module) else None
        if not blocks or not all(hasattr(blocks[0], a) for a in ("d_model", "n_heads", "qkv_weight")):
            raise TypeError(f"stack must be an EncoderStack, got {type(stack).__name__}")
        p = stack.blocks[0].qkv_weight
        if p.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the stack on a GPU; its parameters are on {p.device}")
        if not stack.batch_first:
            raise ValueError("the graph runner takes batch-first input; build the stack with batch_first=True")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        super().__init__(stack, batch_sizes, p.device)
        self.stack = stack
        self.seq_len = seq_len
        self.with_bias = bool(attn_bias)
        self.with_mask = bool(key_padding_mask)
        self.dtype = p.dtype
        self._d = stack.blocks[0].d_model
        self._h = stack.blocks[0].n_heads

    def _static_inputs(self, bucket: int) -> tuple[Optional[torch.Tensor], ...]:
        s, d, h = self.seq_len, self._d, self._h
        kw = {"dtype": self.dtype, "device": self.device}
        x = torch.zeros((bucket, s, d), **kw)
        bias = torch.zeros((bucket, h, s, s), **kw) if self.with_bias else None
        mask = torch.zeros((bucket, s), dtype=torch.bool, device=self.device) if self.with_mask else None
        return x, bias, mask

    def _check(self, x, attn_bias, key_padding_mask):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[1] != self.seq_len or x.shape[2] != self._d:
            raise ValueError(f"x must have shape [B, {self.seq_len}, {self._d}], got {tuple(x.shape)}")
        if x.dtype != self.dtype or x.device != self.device:
            raise TypeError(f"x is {x.dtype} on {x.device}; the runner takes {self.dtype} on {self.device}")
        if (attn_bias is not None) != self.with_bias:
            raise ValueError(f"this runner was made with attn_bias={self.with_bias}; pass an attn_bias exactly then")
        if (key_padding_mask is not None) != self.with_mask:
            raise ValueError(
                f"this runner was made with key_padding_mask={self.with_mask}; pass a key_padding_mask exactly then"
            )
        b, s, h = x.shape[0], self.seq_len, self._h
        if attn_bias is not None:
            if attn_bias.dim() != 4 or attn_bias.shape[0] not in (1, b) or tuple(attn_bias.shape[1:]) != (h, s, s):
                raise ValueError(f"attn_bias must have shape ({b} or 1, {h}, {s}, {s}), got {tuple(attn_bias.shape)}")
            if attn_bias.device != self.device:
                raise ValueError(f"attn_bias is on {attn_bias.device}, the runner on {self.device}")
        if key_padding_mask is not None:
            if tuple(key_padding_mask.shape) != (b, s) or key_padding_mask.dtype != torch.bool:
                raise ValueError(f"key_padding_mask must be bool of shape ({b}, {s}), got "
                                 f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}")  # fmt: skip
            if key_padding_mask.device != self.device:
                raise ValueError(f"key_padding_mask is on {key_padding_mask.device}, the runner on {self.device}")

    def _empty(self, inputs):
        return torch.empty_like(inputs[0])

    def __call__(self, x, attn_bias=None, key_padding_mask=None):
        self._check(x, attn_bias, key_padding_mask)
        return self._dispatch((x, attn_bias, key_padding_mask))
