"""Timing, ceilings, environment and progress, shared by bench/nps.py and bench/ops.py.

Methodology (DESIGN.md's benchmark conventions):

- GPU work is timed with device events; CPU work (the CPU smoke run) with
  ``time.perf_counter``.  Every measurement is the median of at least
  ``MIN_REPS`` timed runs after a warm-up.
- Inputs rotate among several sets when one set would fit in L2
  (``rotation_sets``), so a timed call does not read what the previous call
  left in cache.
- One-time work (compilation, CUDA-graph capture, first-call autotuning) is
  done before the timed region and reported separately by the callers.
- Ceilings are measured on the device in the same process: the dense GEMM
  rate (``gemm_rate``) and copy bandwidth (``copy_bandwidth``).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence

import torch

__all__ = [
    "MIN_REPS",
    "Progress",
    "Timing",
    "capture_graph",
    "comma_list",
    "copy_bandwidth",
    "environment",
    "gemm_rate",
    "l2_bytes",
    "resolve_device",
    "start",
    "rotation_sets",
    "slug",
    "sync",
    "time_calls",
    "time_graph",
    "write_json",
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


def resolve_device(name: Optional[str]) -> torch.device:
    """``--device``: cuda (the current GPU), cuda:N or cpu; default a GPU if torch sees one."""
    device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def start(device_name: Optional[str], reps: Optional[int]) -> tuple[torch.device, int]:
    """The benchmarks' common start: the ``--device`` made current (graphs, events and streams
    use the current device) and the ``--reps`` default (30 on a GPU, MIN_REPS on CPU)."""
    device = resolve_device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device, reps or (30 if device.type == "cuda" else MIN_REPS)


def add_preset_arg(ap: argparse.ArgumentParser, preset_names) -> None:
    ap.add_argument("--preset", action="append", default=None,
                    help=f"repeatable or comma list of {', '.join(preset_names)} (or NAME-sLEN); "
                         "default t82,bt4,bert-base with a GPU, tiny without")  # fmt: skip


def add_common_args(ap: argparse.ArgumentParser, dtype_names, reps_help: str) -> None:
    """The options nps.py and ops.py share besides ``--preset`` (see ``check_common_args``)."""
    ap.add_argument("--dtype", choices=sorted(dtype_names), default=None,
                    help="override the presets' float16 (default float32 on CPU)")  # fmt: skip
    ap.add_argument("--reps", type=int, default=None,
                    help=f"{reps_help}, median taken (>= {MIN_REPS}; default 30, {MIN_REPS} on CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--tag", default=None, help="output file name part (default: presets, dtype and device)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda if available)")
    ap.add_argument("--step-timeout", type=float, default=600.0,
                    help="exit (status 3) when one step runs longer than this many seconds, naming it: a hung "
                         "kernel never returns (default 600; 0 disables)")  # fmt: skip


def check_common_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Rejects too few ``--reps`` and flattens ``--preset`` into one list of names."""
    if args.reps is not None and args.reps < MIN_REPS:
        ap.error(f"--reps must be at least {MIN_REPS} (the median of at least {MIN_REPS} timed runs)")
    args.preset = [p for item in (args.preset or []) for p in comma_list(item)]


def result_base_path(args: argparse.Namespace, runs, env: dict, script: str) -> str:
    """``<out-dir>/<script>_<tag>`` (the directory made): ``--tag``, else presets, dtype and device."""
    tag = args.tag or "_".join((
        "-".join(args.preset or dict.fromkeys(r.name for r in runs)),
        str(runs[0].dtype).replace("torch.", ""),
        slug(env["device_name"]),
    ))  # fmt: skip
    os.makedirs(args.out_dir, exist_ok=True)
    return os.path.join(args.out_dir, f"{script}_{tag}")


def comma_list(text: str) -> list[str]:
    """A comma-separated command-line value as a list (empty items dropped)."""
    return [x.strip() for x in text.split(",") if x.strip()]


def is_cuda(device: torch.device) -> bool:
    return torch.device(device).type == "cuda"


def sync(device: torch.device) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


# ------------------------------------------------------------ rotation ----


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


# ------------------------------------------------------------ timing ----


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
    """Capture ``fn()`` into a CUDA graph (after one warm-up call on the capture stream)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()  # lazy initialisation (plans, workspaces, cuBLAS handles) must not happen during capture
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


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


# ------------------------------------------------------------ ceilings ----


def gemm_rate(device: torch.device, dtype: torch.dtype, reps: int = MIN_REPS) -> dict[str, Any]:
    """The dense GEMM rate of this device: best TFLOP/s of ``torch.mm`` over a few large shapes.

    This is the ceiling the roofline and the "% of GEMM rate" columns use.  On
    CPU the shapes are small (the CPU run only exercises the code).
    """
    if is_cuda(device):
        shapes = [(8192, 8192, 8192), (16384, 4096, 8192)]
    else:
        shapes = [(512, 512, 512)]
    best: Optional[dict[str, Any]] = None
    gen = torch.Generator(device="cpu").manual_seed(1)
    for m, n, k in shapes:
        a = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
        b = torch.randn(n, k, generator=gen).to(device=device, dtype=dtype).t()
        out = torch.empty(m, n, device=device, dtype=dtype)
        t = time_graph(lambda _: torch.mm(a, b, out=out), [None], reps=reps, device=device, target_us=2000)
        tflops = 2 * m * n * k / (t.ms * 1e-3) / 1e12
        if best is None or tflops > best["tflops"]:
            best = {"tflops": tflops, "shape_mnk": [m, n, k], "ms": t.ms, "how": f"torch.mm, {t.method}"}
        del a, b, out
    assert best is not None
    best["dtype"] = str(dtype).replace("torch.", "")
    return best


def copy_bandwidth(device: torch.device, reps: int = MIN_REPS) -> dict[str, Any]:
    """Device copy bandwidth: ``dst.copy_(src)`` of a buffer far larger than L2; bytes read + written."""
    nbytes = (512 << 20) if is_cuda(device) else (64 << 20)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = time_graph(lambda _: dst.copy_(src), [None], reps=reps, device=device, target_us=2000)
    gbs = 2 * nbytes / (t.ms * 1e-3) / 1e9
    del src, dst
    return {"gbs": gbs, "bytes_copied": nbytes, "ms": t.ms, "how": f"Tensor.copy_, {t.method}"}


# ------------------------------------------------------------ environment ----


def _run(cmd: list[str]) -> Optional[str]:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _cuda_driver_api_version() -> Optional[int]:
    """cuDriverGetVersion(), e.g. 13000: the CUDA version the installed driver supports."""
    for name in ("libcuda.so.1", "libcuda.so"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        v = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0:
            return v.value
    return None


def _driver(device: torch.device) -> dict[str, Any]:
    if not is_cuda(device):
        return {"driver": None}
    if torch.version.hip:
        text = _run(["rocm-smi", "--showdriverversion"]) or ""
        m = re.search(r"Driver version:\s*(\S+)", text)
        return {"driver": m.group(1) if m else None, "driver_source": "rocm-smi"}
    idx = torch.device(device).index or 0
    text = _run(["nvidia-smi", f"--id={idx}", "--query-gpu=driver_version", "--format=csv,noheader"])
    return {
        "driver": text.splitlines()[0].strip() if text else None,
        "driver_source": "nvidia-smi" if text else None,
        "cuda_driver_api": _cuda_driver_api_version(),
    }


def _git_commit() -> Optional[str]:
    # A copy of the tree whose .git is stale (a remote GPU machine's) names the
    # commit it was made from in FUSEDENC_SOURCE_COMMIT.
    if os.environ.get("FUSEDENC_SOURCE_COMMIT"):
        return os.environ["FUSEDENC_SOURCE_COMMIT"] + " (from FUSEDENC_SOURCE_COMMIT)"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    head = _run(["git", "-C", root, "rev-parse", "HEAD"])
    if head is None:
        return None
    dirty = _run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"])
    return head + ("+dirty" if dirty else "")


def _tuning_files() -> dict[str, Any]:
    """Which user tuning tables (attention, GEMM) the run could load: they change the results."""
    from fusedenc import _native

    where = _native.config_dir()
    try:
        names = sorted(n for n in os.listdir(where) if n.endswith(".json"))
    except OSError:
        names = []
    return {"config_dir": where, "files": names, "gemm_tuning_env": os.environ.get(_native.GEMM_TUNING_ENV)}


def environment(device: torch.device) -> dict[str, Any]:
    """Device, driver and library versions, for the JSON (and the table's header)."""
    import fusedenc

    b = fusedenc.backend()
    env: dict[str, Any] = {
        "device": str(device),
        "device_name": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "blaslt": b.library,  # e.g. "cuBLASLt 13.1.0"; None without a native core
        "fusedenc": getattr(fusedenc, "__version__", None),
        "fusedenc_backend": str(b),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "git_commit": _git_commit(),
        "tuning_files": _tuning_files(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if is_cuda(device):
        props = torch.cuda.get_device_properties(device)
        env.update(
            device_name=props.name,
            multiprocessor_count=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
            l2_bytes=l2_bytes(device),
            compute_capability=None if torch.version.hip else f"{props.major}.{props.minor}",
            gcn_arch=getattr(props, "gcnArchName", None) if torch.version.hip else None,
        )
    env.update(_driver(device))
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:  # noqa: BLE001 - not installed, or broken: just not reported
        env["triton"] = None
    return env


# ------------------------------------------------------------ output ----


def slug(text: str) -> str:
    """A file-name-safe lower-case form: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-") or "x"


def write_json(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)


class Progress:
    """A tqdm progress bar on a terminal; elsewhere (logs), or without tqdm, one plain line per step.

    ``step(what)`` names the step about to run (the bar shows it while it runs)
    and counts the previous one as done; ``close()`` counts the last.

    With ``step_timeout`` > 0 a watchdog thread ends the process (exit status 3)
    when one step runs longer than that, saying which step: a hung GPU kernel
    never returns control to Python, and a benchmark that waits forever says
    nothing.  Whatever the caller wrote before (finished presets) stays.
    """

    def __init__(self, total: int, desc: str, enabled: bool = True, step_timeout: float = 0.0):
        self.total, self.done = total, 0
        self._bar = None
        self._pending = False
        self._plain = enabled
        self._t0 = self._last = time.perf_counter()
        self._current = "start"
        self._closed = False
        # A bar only on a terminal: in a log (a GPU job's captured output) its
        # carriage-return redraws are one unreadable line, so print lines there.
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=True)
                self._plain = False
            except ImportError:
                print(f"({desc}: tqdm is not installed, plain progress lines instead; pip install tqdm)",
                      file=sys.stderr)  # fmt: skip
        if step_timeout > 0:
            threading.Thread(target=self._watch, args=(step_timeout,), daemon=True).start()

    def _watch(self, limit: float) -> None:
        while not self._closed:
            time.sleep(min(5.0, limit / 4))
            if not self._closed and time.perf_counter() - self._last > limit:
                msg = (f"!! no progress for {limit:g} s in step '{self._current}' (a hung kernel?); exiting with "
                       "status 3. Presets finished before it are already written; --step-timeout 0 disables this.")
                print(msg, file=sys.stderr, flush=True)
                print(msg, flush=True)
                os._exit(3)

    def _finish_pending(self) -> None:
        if self._pending:
            self._pending = False
            self.done += 1
            if self._bar is not None:
                self._bar.update(1)

    def step(self, what: str) -> None:
        self._finish_pending()
        self._pending = True
        self._current, self._last = what, time.perf_counter()
        if self._bar is not None:
            self._bar.set_postfix_str(what)
        elif self._plain:
            elapsed = self._last - self._t0
            print(f"[{self.done + 1}/{self.total} {elapsed:6.0f}s] {what}", file=sys.stderr, flush=True)

    def write(self, line: str) -> None:
        """Print a line to stdout without breaking the bar."""
        if self._bar is not None:
            self._bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def close(self) -> None:
        self._closed = True
        self._finish_pending()
        if self._bar is not None:
            self._bar.close()
