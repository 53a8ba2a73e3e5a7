"""Automatic CUDA graphs behind the plain call of a fusedenc module.

An ``EncoderBlock``, ``EncoderStack`` or ``lc0.Lc0Network`` called eagerly spends most of a
call at small and medium batches on the host (Python and tens of launches a layer); the
graph runners replay the same launches in one call but hand out views valid until the next
call.  This module gives the plain call the graph runner's speed with plain PyTorch
semantics: every module keeps an ``AutoGraphs`` cache, and a call whose inputs it supports

* runs eagerly the first time at a key (bucket, dtype, device, input layouts, module
  settings), so a one-off shape pays no capture; the second call captures one graph
  (``graphs.capture``: warm-up on a side stream, then capture), later calls replay it;
* copies its inputs into the graph's static inputs, as the call's *feed* says
  (``graph_feeds``: batch-first inputs padded to a batch bucket, rows past the batch being
  padding; or packed rows and their ``cu_seqlens`` padded to token, sequence and length
  buckets), and hands back a clone of the first rows of the static output (or writes them
  into the caller's ``out=``): the caller owns what it gets;
* is bounded: at most ``max_graphs`` graphs a module (least recently used evicted; a key
  evicted again and again is captured less and less often), every graph of a device in
  one shared memory pool, ``memory()`` / ``AutoGraphs.stats()`` say what is held.

Eager (no graph) where a graph would be wrong or not pay: off (``FUSEDENC_AUTO_GRAPHS=0``,
``set_enabled(False)``, ``module.auto_graphs.enabled = False``), no native core on the
device, no capture possible (``PYTORCH_NO_CUDA_MEMORY_CACHING=1``), inside a caller's own capture,
inside another fusedenc call (``graphs.eager_calls``),
an empty batch, a batch past ``BUCKETS[-1]`` or ``MAX_ROWS`` rows (host time is amortized
there; packed rows likewise past the largest token or sequence bucket), inputs it cannot
copy (another device, a per-row input of another batch size: the eager path raises the
right error), FP8 calibration running.

A graph stays valid while what it read does: it is keyed on ``invalidate()``'s counter
(``quantize``, the A/B switches of ``fusedenc.testing``) and ``norm_fold``'s mode, and each
call compares the address and in-place version of every parameter and buffer of the module
with those at capture (a few microseconds a hundred tensors; moved, replaced or rewritten
weights are re-captured, as the eager path's weight caches re-fold).  The tensor list is
re-read when any module registers a parameter, buffer or submodule (a process-wide counter
bumped by torch's registration hooks, installed at the first call that may replay).  A graph keeps the
weights it captured alive, so their memory cannot be reused under a stale graph.

Several threads: one lock per device serializes copy-in, replay and copy-out (graphs of a
device share one pool, so two replays must never overlap), and a replay on another stream
than the last waits for it.  Captures use the thread-local capture mode, so other threads'
eager work goes on meanwhile.
"""

from __future__ import annotations

import collections
import operator
import os
import threading
import time
import weakref
from typing import Any, Callable, Hashable, Optional, Sequence, Union

import torch

from ..ops import norm_fold
from .feeds import BUCKETS, MAX_ROWS, BatchFeed, bucket_for
from .runner import capture, capture_possible, eager_calls, eager_only

__all__ = [
    "BUCKETS", "ENV", "MAX_GRAPHS", "MAX_ROWS", "AutoGraphs", "GraphedModule", "bucket_for", "cache_of", "call",
    "clear", "cuda_capture", "disabled", "enabled", "encoder_call", "finish", "invalidate", "memory", "observing",
    "out_view", "set_enabled", "storage_key", "write_out",
]  # fmt: skip

ENV = "FUSEDENC_AUTO_GRAPHS"
# BUCKETS (batch sizes), MAX_ROWS and bucket_for live in graph_feeds (with the packed rows'
# token buckets) and stay importable from here.
#: Graphs one module keeps (least recently used evicted).
MAX_GRAPHS = 8
#: Calls at a key before it is captured (the first runs eagerly).
CAPTURE_AT = 2
_SEEN_LIMIT = 256  # keys a cache remembers calls of
_VERSION = operator.attrgetter("_version")  # map() over it: ~40% less host time than a generator per call

Output = Union[torch.Tensor, dict]

_enabled = os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")
_config_epoch = 0  # invalidate(): anything that changes what a captured graph computes
_structure_epoch = 0  # bumped by every parameter / buffer / submodule registration (hooks)
_hooks_installed = False
_caches: "weakref.WeakSet[AutoGraphs]" = weakref.WeakSet()
_lanes: dict = {}
_lanes_lock = threading.Lock()


def enabled() -> bool:
    """Whether plain calls may use automatic graphs (process-wide; default on, off with ``FUSEDENC_AUTO_GRAPHS=0``)."""
    return _enabled


def set_enabled(on: bool) -> bool:
    """Turn automatic graphs on or off for the process; returns the previous setting."""
    global _enabled
    was, _enabled = _enabled, bool(on)
    return was


class disabled:
    """``with fusedenc.graphs.auto.disabled():`` plain calls inside run eagerly (process-wide)."""

    def __enter__(self):
        self._was = set_enabled(False)

    def __exit__(self, *exc):
        set_enabled(self._was)


def invalidate() -> None:
    """Drop every automatic graph: what they captured no longer holds (a module was
    quantized, an A/B switch flipped).  Called by fusedenc itself; users rarely need it."""
    global _config_epoch
    _config_epoch += 1
    clear()


def clear() -> None:
    """Drop every automatic graph of every module (frees their memory)."""
    for cache in list(_caches):
        cache.clear()


def memory(device: Optional[torch.device] = None) -> dict:
    """What automatic graphs hold, per device: ``{device: {"graphs": n, "static_bytes": their
    inputs and outputs, "pool_bytes": the shared pool's segments}}``."""
    report: dict = {}
    for cache in list(_caches):
        for entry in cache.entries():
            if device is not None and entry.device != torch.device(device):
                continue
            r = report.setdefault(str(entry.device), {"graphs": 0, "static_bytes": 0, "pool_bytes": 0})
            r["graphs"] += 1
            r["static_bytes"] += entry.static_bytes
    with _lanes_lock:
        lanes = list(_lanes.items())
    for dev, lane in lanes:
        if str(dev) in report and lane.pool is not None:
            report[str(dev)]["pool_bytes"] = _pool_bytes(lane.pool)
    return report


def _pool_bytes(pool) -> int:
    try:
        return sum(s["total_size"] for s in torch.cuda.memory_snapshot(pool, include_traces=False))
    except (TypeError, RuntimeError):  # a torch without per-pool snapshots
        return 0


# ------------------------------------------------------------ registration hooks ----


def _registered(*_args) -> None:
    global _structure_epoch
    _structure_epoch += 1


def _install_hooks() -> None:
    """Re-read a module's tensors after any registration (``module.weight = Parameter(...)``,
    ``load_state_dict(assign=True)``): installed once, by the first call that may replay."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    m = torch.nn.modules.module
    for name in ("register_module_parameter_registration_hook", "register_module_buffer_registration_hook",
                 "register_module_module_registration_hook"):  # fmt: skip
        register = getattr(m, name, None)
        if register is not None:
            register(_registered)


# ------------------------------------------------------------ one device's lane ----


class _Lane:
    """What the graphs of one device share: the memory pool, the lock that keeps their
    replays from overlapping, and the stream of the last replay."""

    def __init__(self):
        self.lock = threading.Lock()
        self.pool = None
        self.graphs = 0
        self.last_stream = None

    def order(self, device: torch.device) -> None:
        """Make this replay follow the last one, whichever stream that ran on."""
        if device.type != "cuda":
            return
        stream = torch.cuda.current_stream(device)
        last = self.last_stream
        if last is not None and last != stream:
            stream.wait_stream(last)
        self.last_stream = stream

    def get_pool(self, device: torch.device):
        if self.pool is None and device.type == "cuda":
            self.pool = torch.cuda.graph_pool_handle()
        return self.pool

    def released(self) -> None:
        # With no graph left the pool goes (its memory returns at the next empty_cache); a
        # new capture starts a fresh one rather than re-entering a released pool.
        self.graphs -= 1
        if self.graphs <= 0:
            self.graphs, self.pool = 0, None


def _lane(device: torch.device) -> _Lane:
    lane = _lanes.get(device)
    if lane is None:
        with _lanes_lock:
            lane = _lanes.setdefault(device, _Lane())
    return lane


def cuda_capture(run: Callable[[], Output], device: torch.device, pool) -> tuple[Any, Output]:
    """The real capture (``AutoGraphs.capture``'s default): thread-local capture mode, so other
    threads' eager work (allocations, syncs) goes on during it."""
    return capture(run, device, pool, capture_error_mode="thread_local")


# ------------------------------------------------------------ outputs ----


def _deliver(result: Output, out: Optional[Output]) -> Output:
    """``result`` copied into ``out`` (returned), or a clone the caller owns."""
    if out is None:
        return {k: v.clone() for k, v in result.items()} if isinstance(result, dict) else result.clone()
    return write_out(result, out)


def write_out(result: Output, out: Output) -> Output:
    """Copy ``result`` into the caller's ``out`` (a tensor, or a dict of tensors for a dict
    result) after checking that it matches; returns ``out``."""
    if isinstance(result, dict):
        if not isinstance(out, dict) or set(out) != set(result):
            raise ValueError(f"out must be a dict with keys {sorted(result)}, got "
                             f"{sorted(out) if isinstance(out, dict) else type(out).__name__}")  # fmt: skip
        for k, v in result.items():
            write_out(v, out[k])
        return out
    _check_like(out, result, "the result")
    out.copy_(result)
    return out


def _check_like(out: Any, like: torch.Tensor, what: str) -> None:
    """Raise unless ``out`` is a tensor of ``like``'s shape, dtype and device."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(f"out is {out.dtype} {tuple(out.shape)} on {out.device}; {what} is "
                         f"{like.dtype} {tuple(like.shape)} on {like.device}")  # fmt: skip


# ------------------------------------------------------------ the cache ----


class _Entry:
    __slots__ = ("graph", "inputs", "views", "out", "stamp", "weights", "device", "bucket", "static_bytes", "lane")

    def __init__(self, graph, inputs, views, out, stamp, weights, device, bucket, lane):
        self.graph, self.inputs, self.views, self.out = graph, inputs, views, out
        self.stamp, self.weights, self.device, self.bucket, self.lane = stamp, weights, device, bucket, lane
        tensors = [t for t in inputs if t is not None]
        tensors += list(out.values()) if isinstance(out, dict) else [out]
        self.static_bytes = sum(t.numel() * t.element_size() for t in tensors)


def _drop(entry: _Entry) -> None:
    """Let go of a graph and what it holds (its lane's lock held)."""
    if entry.graph is not None:
        entry.graph = entry.out = entry.inputs = entry.views = entry.weights = None
        entry.lane.released()


class _Seen:
    __slots__ = ("calls", "due", "evictions")

    def __init__(self):
        self.calls, self.due, self.evictions = 0, CAPTURE_AT, 0


class AutoGraphs:
    """One module's automatic CUDA graphs (``module.auto_graphs``).

    ``enabled``: this module's switch (True; the process-wide ``set_enabled`` comes first).
    ``max_graphs``: graphs kept (least recently used evicted).  ``clear()`` drops them;
    ``stats()`` says what they are and hold.  Copies and pickles of the module start empty.
    """

    def __init__(self, max_graphs: int = MAX_GRAPHS, enabled: bool = True):
        self.enabled = bool(enabled)
        self.max_graphs = int(max_graphs)
        #: The capture function ``(run, device, pool) -> (graph, static output)`` (a test seam).
        self.capture = cuda_capture
        self._graphs: "collections.OrderedDict[Hashable, _Entry]" = collections.OrderedDict()
        self._seen: "collections.OrderedDict[Hashable, _Seen]" = collections.OrderedDict()
        self._epoch = _config_epoch
        self._tensors: list = []
        self._versioned: list = []
        self._tensors_epoch = -1
        self.counts = collections.Counter()  # calls: replays, captures, eager (and why), evictions
        self.capture_seconds = 0.0
        _caches.add(self)

    # Copies and pickles: the settings, not the graphs (they belong to this module's tensors).
    def __getstate__(self) -> dict:
        return {"max_graphs": self.max_graphs, "enabled": self.enabled}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def __deepcopy__(self, memo) -> "AutoGraphs":
        return AutoGraphs(self.max_graphs, self.enabled)

    def __repr__(self) -> str:
        return f"AutoGraphs(enabled={self.enabled}, max_graphs={self.max_graphs}, graphs={len(self._graphs)})"

    def entries(self) -> list:
        return list(self._graphs.values())

    def clear(self) -> None:
        """Drop every graph of this module and forget its call counts."""
        dropped = []
        while True:
            try:
                dropped.append(self._graphs.popitem()[1])
            except KeyError:
                break
        self._seen.clear()
        for entry in dropped:
            self._release(entry)

    def stats(self) -> dict:
        """Graphs held (bucket and device each), the bytes of their static inputs and
        outputs, and the call counts (replays, captures, eager calls by reason, evictions)."""
        entries = self.entries()
        return {
            "enabled": self.enabled and _enabled, "max_graphs": self.max_graphs, "graphs": len(entries),
            "buckets": sorted((e.bucket for e in entries), key=_bucket_order),
            "static_bytes": sum(e.static_bytes for e in entries),
            "capture_seconds": self.capture_seconds, "counts": dict(self.counts),
        }  # fmt: skip

    def _release(self, entry: _Entry) -> None:
        with entry.lane.lock:
            _drop(entry)

    def _stamp(self, module: torch.nn.Module) -> tuple:
        """Address and in-place version of every parameter and buffer of ``module``."""
        if self._tensors_epoch != _structure_epoch:
            _install_hooks()
            epoch = _structure_epoch
            tensors = [*module.parameters(), *module.buffers()]
            # Inference tensors keep no version counter (and cannot be changed in place outside inference mode).
            self._tensors, self._versioned = tensors, [t for t in tensors if not t.is_inference()]
            self._tensors_epoch = epoch
        return tuple(map(torch.Tensor.data_ptr, self._tensors)), tuple(map(_VERSION, self._versioned))

    def run(self, module, fn, inputs, feed, key, out, around_capture) -> Optional[Output]:
        """``fn(*inputs)`` through a graph whose static inputs ``feed`` fills (a
        ``graph_feeds`` feed); None: run it eagerly (``feed`` is then why, or ``counts`` says)."""
        if isinstance(feed, str):
            self.counts[feed] += 1
            return None
        device = _feed_device(feed, inputs)
        if self._epoch != _config_epoch:
            self.clear()
            self._epoch = _config_epoch
        full_key = (key, feed.key, device, norm_fold.current_mode())
        lane = _lane(device)

        def launch(entry: _Entry) -> None:
            lane.order(device)
            feed.fill(entry.inputs, inputs)
            entry.graph.replay()

        with lane.lock:
            entry = self._graphs.get(full_key)
            if entry is not None:
                self._graphs.move_to_end(full_key)
                launch(entry)
                # The weights' stamp (~100 tensors: ~20 us of host) is taken after the launch,
                # while the GPU runs.  A stale replay is harmless: the graph holds the weights
                # it captured (entry.weights), so it reads memory it owns; its result is dropped.
                stamp = self._stamp(module)
                if entry.stamp == stamp:
                    self.counts["replays"] += 1
                    return _deliver(feed.take(entry.out), out)
                self.counts["weights changed"] += 1  # moved or changed: every graph is stale
                if device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()  # the stale replay done before its weights go
                stale = list(self._graphs.values())
                self._graphs.clear()
                for e in stale:
                    _drop(e)
            else:
                stamp = self._stamp(module)
            if not self._due(full_key):
                self.counts["eager: first calls"] += 1
                return None
            entry = self._capture(module, fn, inputs, feed, full_key, stamp, lane, around_capture)
            launch(entry)
            self.counts["replays"] += 1
            return _deliver(feed.take(entry.out), out)

    def _due(self, key) -> bool:
        seen = self._seen.get(key)
        if seen is None:
            seen = self._seen[key] = _Seen()
            if len(self._seen) > _SEEN_LIMIT:
                self._seen.popitem(last=False)
        else:
            self._seen.move_to_end(key)
        seen.calls += 1
        return seen.calls >= seen.due

    def _capture(self, module, fn, inputs, feed, key, stamp, lane, around_capture) -> _Entry:
        start = time.perf_counter()
        device = _feed_device(feed, inputs)
        # Static inputs are normal tensors even under inference_mode: later calls outside it copy into them.
        with torch.inference_mode(False):
            statics, views = feed.statics(inputs)
            feed.fill(statics, inputs)  # warm-up and capture run on this call's data
        while len(self._graphs) >= max(self.max_graphs, 1):
            old_key, old = self._graphs.popitem(last=False)
            self.counts["evictions"] += 1
            seen = self._seen.get(old_key)
            if seen is not None:  # back-off: a key evicted k times waits 2 * 4**k more calls
                seen.evictions += 1
                seen.due = seen.calls + CAPTURE_AT * 4**seen.evictions
            _drop(old)

        def run():
            with torch.no_grad():
                return fn(*views)

        with eager_calls():
            if around_capture is None:
                graph, static_out = self.capture(run, device, lane.get_pool(device))
            else:
                with around_capture():
                    graph, static_out = self.capture(run, device, lane.get_pool(device))
        lane.graphs += 1
        # The captured weights stay referenced: their memory cannot be reused under this graph.
        weights = [t.detach() for t in self._tensors]
        entry = _Entry(graph, statics, views, static_out, stamp, weights, device, feed.bucket, lane)
        self._graphs[key] = entry
        self.counts["captures"] += 1
        self.capture_seconds += time.perf_counter() - start
        return entry


def _feed_device(feed, inputs) -> torch.device:
    """The graph's device: the feed's where it has one (its inputs are on the host:
    ``graph_feeds.HostIdsFeed``), else the first input's."""
    return getattr(feed, "device", None) or inputs[0].device


def _bucket_order(bucket) -> tuple:
    # A module may hold batch buckets (ints) and packed ones (tuples): sort each kind apart.
    return (isinstance(bucket, tuple), bucket)


def cache_of(module: torch.nn.Module) -> AutoGraphs:
    """``module``'s cache (made on first use, so modules pickled before it existed have one)."""
    cache = module.__dict__.get("_auto_graphs")
    if cache is None:
        cache = module.__dict__["_auto_graphs"] = AutoGraphs()
    return cache


def call(
    module: torch.nn.Module,
    fn: Callable[..., Output],
    inputs: Sequence[Optional[torch.Tensor]],
    *,
    key: Hashable = None,
    rows_per_item: int = 1,
    native: bool,
    out: Optional[Output] = None,
    around_capture: Optional[Callable[[], Any]] = None,
    feed: Optional[Callable[[tuple], Any]] = None,
) -> Output:
    """``fn(*inputs)`` for ``module``'s plain call, through its automatic graphs where they
    apply, else eagerly; the result is the caller's (a new tensor or dict, or ``out``).

    ``inputs``: by default tensors (or None) whose first holds the batch (batch-first); ``fn``
    returns batch-first tensors (or a dict of them) and computes each item from its own rows.
    ``key``: what else the result depends on (hashable).  ``rows_per_item``: rows one item
    makes (tokens per sequence), for ``MAX_ROWS``.  ``native``: whether the native core runs
    on the device.  ``around_capture``: a context manager entered around warm-up and capture.
    ``feed``: for other inputs, ``inputs -> feed or why not`` (``graph_feeds.PackedFeed.of``:
    packed rows); default ``BatchFeed.of(inputs, rows_per_item)``.  ``inputs[0]`` is a tensor;
    ``feed.take`` picks the call's part of the graph's output."""
    if eager_only():  # inside another fusedenc call (or a graph capture of one): plain eager
        return finish(fn(*inputs), out)
    with eager_calls():
        cache = cache_of(module)
        result = None
        x = inputs[0]
        if not (_enabled and cache.enabled):
            cache.counts["eager: switched off"] += 1
        elif not (native and isinstance(x, torch.Tensor) and x.dim() > 0):
            cache.counts["eager: no native core"] += 1
        elif x.is_cuda and torch.cuda.is_current_stream_capturing():
            cache.counts["eager: caller capturing"] += 1
        elif not capture_possible():
            cache.counts["eager: no caching allocator"] += 1
        else:
            inputs = tuple(inputs)
            how = BatchFeed.of(inputs, rows_per_item) if feed is None else feed(inputs)
            result = cache.run(module, fn, inputs, how, key, out, around_capture)
        return finish(fn(*inputs), out) if result is None else result


def finish(result: Output, out: Optional[Output]) -> Output:
    """``result``, or ``out`` with ``result`` written into it (``write_out``) when given."""
    return result if out is None else write_out(result, out)


def observing(module: torch.nn.Module) -> bool:
    """Whether FP8 calibration is recording ``module``'s blocks (they must run eagerly)."""
    blocks = getattr(module, "blocks", None)
    return any(getattr(b, "fp8_observer", None) is not None for b in (blocks if blocks is not None else (module,)))


def encoder_call(module, eager_rows, rows, batch, seq, attn_bias, key_padding_mask, *, native, out=None):
    """``eager_rows(rows [T, D], batch, seq, attn_bias, key_padding_mask) -> [T, D]`` of a
    block or stack through ``call``: the rows go in as ``[B, S, D]``; ``out`` a ``[B, S, D]``
    view to write (or None).  Returns ``[T, D]`` rows (``out``'s when given)."""
    d = rows.shape[1]

    def run(x3, bias, mask):
        return eager_rows(x3.reshape(-1, d), x3.shape[0], seq, bias, mask).view(x3.shape)

    native = native and not observing(module)
    res = call(module, run, (rows.view(batch, seq, d), attn_bias, key_padding_mask), key=("rows", seq),
               rows_per_item=seq, native=native, out=out)  # fmt: skip
    return res.reshape(-1, d) if out is None else res


def out_view(out: Optional[torch.Tensor], x: torch.Tensor, batch: int, seq: int, batch_first: bool):
    """The caller's ``out`` (x's shape, dtype and device) as a ``[B, S, D]`` view to write into."""
    if out is None:
        return None
    _check_like(out, x, "x")
    if x.dim() == 2:
        if not out.is_contiguous():
            raise ValueError("out of shape [T, D] must be contiguous")
        return out.view(batch, seq, out.shape[1])
    return out if batch_first else out.transpose(0, 1)


class GraphedModule(torch.nn.Module):
    """Base of the modules whose plain call uses automatic graphs (EncoderBlock, EncoderStack,
    Lc0Network): ``auto_graphs`` is the module's cache, dropped when the module is moved or
    converted (``.to()``, ``.half()``, ... where they replace a tensor: the graphs would otherwise
    keep the old weights alive)."""

    @property
    def auto_graphs(self) -> AutoGraphs:
        """This module's automatic CUDA graphs: ``.enabled``, ``.max_graphs``, ``.clear()``, ``.stats()``."""
        return cache_of(self)

    def _apply(self, fn, *args, **kwargs):
        before = storage_key(self)
        result = super()._apply(fn, *args, **kwargs)
        cache = self.__dict__.get("_auto_graphs")
        if cache is not None and storage_key(self) != before:
            cache.clear()
        return result


def storage_key(module: torch.nn.Module) -> tuple:
    """Where and in what dtype every parameter and buffer of ``module`` is stored.  A module's
    ``_apply`` (``.to()``, ``.half()``, ...) compares it before and after and drops its graphs
    (which keep the weights they captured alive) only where a tensor was replaced: ``.to()``
    to where a module already is replaces nothing, and sentence-transformers' ``encode()``
    calls it on every call (dropping the graphs there recaptured every one, every call)."""
    return tuple((t.data_ptr(), t.dtype, t.device) for t in (*module.parameters(), *module.buffers()))
