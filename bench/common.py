"""What bench/nps.py and bench/ops.py share besides timing: the command line, the device,
the ceilings, the environment record, the output files and the progress display.

Timing itself (``time_calls``, ``time_graph``, ``capture_graph``, input rotation)
is ``fusedenc.tune.timing``, the one copy ``python -m fusedenc.tune`` measures
with too.  Methodology (docs/ARCHITECTURE.md, "Benchmarks"):

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
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from typing import Any, Optional

import torch

import fusedenc
from fusedenc import core
from fusedenc.common import dtypes, table_files
from fusedenc.tune.presets import GPU_PRESETS, PRESETS
from fusedenc.tune.timing import MIN_REPS, is_cuda, l2_bytes, time_graph

__all__ = [
    "Progress",
    "add_common_args",
    "add_preset_arg",
    "check_common_args",
    "comma_list",
    "copy_bandwidth",
    "environment",
    "gemm_rate",
    "resolve_device",
    "result_base_path",
    "slug",
    "start",
    "write_json",
]


# ------------------------------------------------------------ command line ----


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


def add_preset_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--preset", action="append", default=None,
                    help=f"repeatable or comma list of {', '.join(PRESETS)} (or NAME-sLEN); "
                         f"default {','.join(GPU_PRESETS)} with a GPU, tiny without")  # fmt: skip


#: Local results go under the current directory (ignored by git in a checkout), never into
#: bench/results/, which holds the committed results of the reference GPU.
DEFAULT_RESULTS_DIR = "fusedenc-results"
RESULTS_DIR_ENV = "FUSEDENC_RESULTS_DIR"


def add_common_args(ap: argparse.ArgumentParser, reps_help: str, extra_dtypes: Optional[dict[str, str]] = None) -> None:
    """The options nps.py and ops.py share besides ``--preset`` (see ``check_common_args``).
    ``extra_dtypes``: further ``--dtype`` choices one script understands (name -> what it means)."""
    extra = extra_dtypes or {}
    ap.add_argument("--dtype", choices=sorted(dtypes.BY_NAME) + sorted(extra), default=None,
                    help="override the presets' float16 (default float32 on CPU)"
                         + "".join(f"; {name}: {what}" for name, what in sorted(extra.items())))  # fmt: skip
    ap.add_argument("--reps", type=int, default=None,
                    help=f"{reps_help}, median taken (>= {MIN_REPS}; default 30, {MIN_REPS} on CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=os.environ.get(RESULTS_DIR_ENV) or DEFAULT_RESULTS_DIR,
                    help=f"where the JSON, table and plot go (default ${RESULTS_DIR_ENV}, else ./{DEFAULT_RESULTS_DIR} "
                         "under the current directory; the committed results in bench/results/ are written "
                         "only when named here)")  # fmt: skip
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


def result_base_path(args: argparse.Namespace, runs, env: dict, script: str, precision: Optional[str] = None) -> str:
    """``<out-dir>/<script>_<tag>`` (the directory made): ``--tag``, else presets, dtype (or
    ``precision``, e.g. fp8, where that names the run better) and device."""
    tag = args.tag or "_".join((
        "-".join(args.preset or dict.fromkeys(r.name for r in runs)),
        precision or str(runs[0].dtype).replace("torch.", ""),
        slug(env["device_name"]),
    ))  # fmt: skip
    os.makedirs(args.out_dir, exist_ok=True)
    return os.path.join(args.out_dir, f"{script}_{tag}")


def comma_list(text: str) -> list[str]:
    """A comma-separated command-line value as a list (empty items dropped)."""
    return [x.strip() for x in text.split(",") if x.strip()]


# ------------------------------------------------------------ ceilings ----


def gelu_unit_reason(device: torch.device, dtype: torch.dtype, activation: str) -> Optional[str]:
    """Why the Hopper GELU unit cannot run ``activation`` in ``dtype`` on ``device`` (None: it can)."""
    if activation not in ("gelu", "gelu_tanh"):
        return f"the activation is {activation}, not a GELU"
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return "the Hopper GELU units run on compute capability 9.0 only"
    if (dtypes.name(dtype), activation) not in core.sm90_gelu_epilogue_kernels():
        return f"this build has no Hopper GELU unit for {dtypes.name(dtype)} {activation}"
    return None


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
        # The operands go in as the one input set, not captured by the lambda: deleted before the next shape.
        operands = [(a, b, out)]
        t = time_graph(lambda o: torch.mm(o[0], o[1], out=o[2]), operands, reps=reps, device=device, target_us=2000)
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
    t = time_graph(lambda sd: sd[1].copy_(sd[0]), [(src, dst)], reps=reps, device=device, target_us=2000)
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
    where = table_files.config_dir()
    try:
        names = sorted(n for n in os.listdir(where) if n.endswith(".json"))
    except OSError:
        names = []
    return {"config_dir": where, "files": names, "gemm_tuning_env": os.environ.get(core.GEMM_TUNING_ENV)}


#: Said by every benchmark that runs fusedenc's rows on a CPU: fusedenc's ops on CPU tensors
#: are their PyTorch reference, so the rows are not fusedenc's speed.
CPU_NOTE = ("CPU run: the fusedenc rows time the PyTorch reference ops (fusedenc has no native core on "
            "the CPU), not fusedenc's GPU path (fused kernels, CUDA graphs)")  # fmt: skip


def _host_cpu() -> Optional[str]:
    """The host CPU's model name (Linux: /proc/cpuinfo), else what ``platform`` says, else None."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def environment(device: torch.device) -> dict[str, Any]:
    """Device, driver and library versions, for the JSON (and the table's header).  On a GPU
    without the native core it says so on stderr, and stops the run where
    ``FUSEDENC_REQUIRE_NATIVE`` is set (the GPU scripts set it): numbers of the fallback would
    otherwise pass for fusedenc's (a device run once measured a build its sync had removed)."""
    b = fusedenc.backend()
    if is_cuda(device) and not core.active_on(device):
        why = f"fusedenc's native core is not active on {device} ({b}): fusedenc rows run its PyTorch fallback"
        if os.environ.get("FUSEDENC_REQUIRE_NATIVE"):
            raise SystemExit(f"FUSEDENC_REQUIRE_NATIVE is set and {why}")
        print(f"warning: {why}", file=sys.stderr)
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
        # Small batches are bound by the host CPU (HF models at 32 sentences, eager rows): the same
        # GPU reads up to ~1.5x apart on two hosts, so the host and how busy it was go in the file.
        "host_cpu": _host_cpu(),
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "git_commit": _git_commit(),
        "tuning_files": _tuning_files(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if is_cuda(device):
        props = torch.cuda.get_device_properties(device)
        env.update(
            device_name=props.name,
            # Which physical GPU: a claim "on two machines" can then be checked from the files.
            device_uuid=str(getattr(props, "uuid", "")) or None,
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


def describe_environment(env: dict[str, Any]) -> str:
    """The first line of a result table and the plot's title: the device and the versions that
    are present (a CPU run has no driver, CUDA or BLASLt to name)."""
    device = env["device_name"] + (f" (driver {env['driver']})" if env.get("driver") else "")
    parts = [device, f"torch {env['torch']}"]
    for key, label in (("cuda", "CUDA"), ("hip", "HIP"), ("cudnn", "cuDNN"), ("triton", "Triton")):
        if env.get(key):
            parts.append(f"{label} {env[key]}")
    parts.append(env["blaslt"] or "no BLASLt")
    return ", ".join(parts)


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


# ------------------------------------------------------------ GPU kernels ----


#: Kernels listed by their device time in ``--kernels``' record (the JSON; the table keeps one line).
TOP_KERNELS = 12


def kernel_profile(step, batches, seconds_per_pass: float) -> dict:
    """One pass of ``step`` under ``torch.profiler`` (CUDA activity): GPU kernels and copies a
    batch, the kernels' summed device time a batch, and that time's share of the timed pass's
    (``seconds_per_pass``: the median of the timed passes); the ``TOP_KERNELS`` longest kernels
    by name, with their calls and time a batch."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for b in batches:
            step(b)
        torch.cuda.synchronize()
    kernels = copies = 0
    device_us = 0.0
    by_name = []
    for e in prof.key_averages():
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        us = getattr(e, "self_device_time_total", None)
        us = e.self_cuda_time_total if us is None else us
        if e.key.startswith(("Memcpy", "Memset")):
            copies += e.count
        else:
            kernels += e.count
            device_us += us
            by_name.append((us, e.count, e.key))
    n = len(batches)
    if kernels == 0:
        raise RuntimeError("the profiler recorded no GPU kernels")
    # Where a batch's kernel time goes: what a fusion or a faster kernel would have to remove.
    top = [{"kernel": name[:120], "per_batch": count / n, "us_per_batch": us / n}
           for us, count, name in sorted(by_name, reverse=True)[:TOP_KERNELS]]  # fmt: skip
    return {"kernels_per_batch": kernels / n, "copies_per_batch": copies / n, "kernel_us_per_batch": device_us / n,
            "pass_us_per_batch": seconds_per_pass * 1e6 / n, "busy_fraction": device_us / (seconds_per_pass * 1e6),
            "top_kernels": top}  # fmt: skip


def kernel_note(k: dict) -> str:
    """One line of ``kernel_profile``'s record: kernels and copies a batch, their time, how busy."""
    if "error" in k:
        return f"kernels: {k['error'][:80]}"
    return (f"{k['kernels_per_batch']:.0f} kernels + {k['copies_per_batch']:.0f} copies a batch, "
            f"{k['kernel_us_per_batch']:.0f} us of kernels in {k['pass_us_per_batch']:.0f} us "
            f"({100 * k['busy_fraction']:.0f}% busy)")
