"""Device timing shared by ``tune`` and the benchmarks.

- GPU work is timed with device events; CPU work (the benchmarks' CPU smoke
  run) with ``time.perf_counter``.  Every measurement is the median of at
  least ``MIN_REPS`` timed runs after a warm-up.
- ``time_graph`` replays a CUDA graph of back-to-back calls: device time
  without launch overhead.  ``time_calls`` times eager calls (launches
  included).  ``time_interleaved`` compares candidates in one run, each rep
  replaying every candidate once, so drift hits all alike.
- Inputs rotate among several sets when one set would fit in L2
  (``rotation_sets``), so a timed call does not read what the previous call
  left in cache.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Sequence

import torch

from ..graphs.runner import capture, no_cycle_collection, own_cublas_workspace

__all__ = [
    "MIN_REPS",
    "Timing",
    "capture_graph",
    "is_cuda",
    "l2_bytes",
    "rotation_sets",
    "sync",
    "time_calls",
    "time_graph",
    "time_interleaved",
]

MIN_REPS = 20


@dataclasses.dataclass
class Timing:
    """Median milliseconds per call, and how it was measured."""

    ms: float
    samples_ms: list[float]
    method: str  # "events" (eager calls, device events), "graph" (CUDA-graph replays), "wall" (CPU)
    sets: int = 1  # input sets rotated through

    def summary(self) -> dict[str, Any]:
        s = sorted(self.samples_ms)
        return {
            "ms": self.ms,
            "min_ms": s[0],
            "max_ms": s[-1],
            "reps": len(s),
            "method": self.method,
            "input_sets": self.sets,
        }


def is_cuda(device: torch.device) -> bool:
    return torch.device(device).type == "cuda"


def sync(device: torch.device) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


def l2_bytes(device: torch.device) -> int:
    """L2 size of the GPU (50 MB on an H100); a nominal 8 MiB on CPU."""
    if not is_cuda(device):
        return 8 << 20
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or (50 << 20))


def rotation_sets(set_bytes: int, device: torch.device, *, factor: int = 4, max_sets: int = 16) -> int:
    """How many input sets to rotate among so that together they span ``factor`` x L2.

    Capped at ``max_sets``: the smallest inputs (one position is 100 KB) would
    otherwise need thousands; what then stays cache-resident is a few hundred KB,
    negligible beside the weights, which the timed calls read from memory anyway.
    """
    if set_bytes <= 0:
        return 1
    need = -(-factor * l2_bytes(device) // set_bytes)
    return int(max(1, min(max_sets, need)))


def time_calls(
    fn: Callable[[Any], Any],
    inputs: Sequence[Any],
    *,
    reps: int,
    warmup: int = 3,
    device: torch.device,
) -> Timing:
    """Median time of one ``fn(inputs[i % n])`` call, eager (launches included).

    On a GPU each call is bracketed by its own pair of events and calls are
    issued back to back without synchronizing: when the host is ahead, the
    interval is the device time of the call; when the host is the bottleneck
    (small batches), the device waits for launches and the interval shows it.
    That is the throughput a caller issuing calls in a loop sees.
    """
    reps = max(reps, MIN_REPS)
    n = len(inputs)
    for i in range(warmup):
        fn(inputs[i % n])
    sync(device)
    if is_cuda(device):
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for i, (start, end) in enumerate(events):
            start.record()
            fn(inputs[i % n])
            end.record()
        torch.cuda.synchronize(device)
        samples = [start.elapsed_time(end) for start, end in events]
        method = "events"
    else:
        samples = []
        for i in range(reps):
            t0 = time.perf_counter()
            fn(inputs[i % n])
            samples.append((time.perf_counter() - t0) * 1e3)
        method = "wall"
    return Timing(statistics.median(samples), samples, method, n)


def capture_graph(fn: Callable[[], Any], device: torch.device) -> "torch.cuda.CUDAGraph":
    """Capture ``fn()`` into a CUDA graph (after one warm-up call on a side stream)."""
    return capture(fn, device)[0]


def time_graph(
    fn: Callable[[Any], Any],
    inputs: Sequence[Any],
    *,
    reps: int,
    device: torch.device,
    target_us: float = 200.0,
    max_calls: int = 64,
    warmup: int = 3,
) -> Timing:
    """Device time of one ``fn(input)`` call without launch overhead.

    Captures a CUDA graph of back-to-back calls cycling through ``inputs``
    (enough calls for about ``target_us`` per replay, at least one per input
    set), and reports the median over ``reps`` event-timed replays divided by
    the calls per replay.  Falls back to eager ``time_calls`` when capture
    fails (method "events"), and on CPU (method "wall").
    """
    reps = max(reps, MIN_REPS)
    if not is_cuda(device):
        return time_calls(fn, inputs, reps=reps, warmup=warmup, device=device)
    n = len(inputs)
    for i in range(warmup):
        fn(inputs[i % n])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(inputs[0])
    end.record()
    end.synchronize()
    one_us = max(start.elapsed_time(end) * 1e3, 1.0)
    calls = max(n, min(max_calls, round(target_us / one_us)))
    calls = -(-calls // n) * n  # whole rotations: every input set used equally
    try:
        graph = capture_graph(lambda: [fn(inputs[i % n]) for i in range(calls)], device)
    except Exception:  # noqa: BLE001 - some ops cannot be captured; time them eagerly instead
        torch.cuda.synchronize(device)
        return time_calls(fn, inputs, reps=reps, warmup=warmup, device=device)
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in events:
        s.record()
        graph.replay()
        e.record()
    torch.cuda.synchronize(device)
    samples = [s.elapsed_time(e) / calls for s, e in events]
    del graph
    return Timing(statistics.median(samples), samples, "graph", n)


def time_interleaved(
    calls: list[Callable[[], None]], reps: int, warmup: int, stream: torch.cuda.Stream
) -> tuple[list[float], str]:
    """Median device time of each entry of ``calls`` (a function launching one pass over the input
    sets on ``stream``, which must not be the default stream: CUDA graphs capture on it),
    interleaved: every rep replays each candidate once, so drift hits all alike."""
    if not calls:
        return [], "-"
    method = "graph"
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:
            for _ in range(warmup):
                fn()
        start.record()
        calls[0]()
        end.record()
    end.synchronize()
    per_pass = max(start.elapsed_time(end) * 1000.0, 1.0)
    rounds = max(1, min(64, round(200.0 / per_pass)))  # ~200 us per timed replay
    replays: list[Callable[[], object]] = []
    try:
        for fn in calls:
            graph = torch.cuda.CUDAGraph()
            with no_cycle_collection(), own_cublas_workspace(), torch.cuda.graph(graph, stream=stream):
                for _ in range(rounds):
                    fn()
            replays.append(graph.replay)
        for r in replays:
            r()
    except Exception:  # noqa: BLE001 - time eager launches instead
        method = "eager"
        replays = []
        for fn in calls:

            def replay(fn=fn):
                for _ in range(rounds):
                    fn()

            replays.append(replay)
    torch.cuda.synchronize()
    times: list[list[float]] = [[] for _ in calls]
    with torch.cuda.stream(stream):
        for rep in range(reps):
            order = list(range(len(calls)))
            order = order[rep % len(order):] + order[: rep % len(order)]
            for i in order:
                start.record()
                replays[i]()
                end.record()
                end.synchronize()
                times[i].append(start.elapsed_time(end) * 1000.0 / rounds)
    torch.cuda.synchronize()
    return [statistics.median(t) for t in times], method
