"""Fused residual + LayerNorm against copy bandwidth and against PyTorch's unfused ops.

For each shape, times (CUDA graphs of back-to-back calls, so launch cost does
not hide the kernel; device events; median of several replays; the calls
cycle through enough copies of the buffers that the 50 MB L2 cannot serve a
call from the previous one's data):

  copy               out.copy_(x): the bandwidth floor for 2 passes of T*D
  fused              fusedenc layer_norm(x, w, b, residual=r, alpha=a): reads 2, writes 1
  fused + sum_out    also writes h: reads 2, writes 2
  fused, no residual reads 1, writes 1
  torch              F.layer_norm(r + a * x, ...) in the same dtype (what it replaces)

and reports microseconds, effective GB/s (bytes the op must move / time) and
the ratio of that to the copy's GB/s.  Also the host cost of one eager call.

Usage: python bench/layer_norm.py [--json PATH] [--shapes 16384x768,...] [--dtype float16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import fusedenc
from fusedenc.norm import layer_norm


def graph_time_us(fns, calls: int = 24, replays: int = 15) -> float:
    """Median device time of one call, from graphs of `calls` back-to-back calls cycling through `fns`."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fns[i % len(fns)]()
    for _ in range(3):
        g.replay()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


def host_us(fn, calls: int = 2000) -> float:
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default="16384x768,16384x1024,4096x4096,1024x16384,16384x64")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    args = ap.parse_args()
    if not torch.cuda.is_available() or fusedenc.backend().name == "reference":
        raise SystemExit(f"needs a GPU with the native core: {fusedenc.backend()}")
    dtype = getattr(torch, args.dtype)
    dev = torch.device("cuda")
    rows = []
    for spec in args.shapes.split(","):
        t, d = (int(v) for v in spec.split("x"))
        size = t * d * torch.empty((), dtype=dtype).element_size()
        n_sets = max(1, -(-(256 << 20) // (4 * size)))  # >= 256 MB of buffers in rotation
        sets = []
        for _ in range(n_sets):
            sets.append(dict(
                x=torch.randn(t, d, device=dev, dtype=dtype), r=torch.randn(t, d, device=dev, dtype=dtype),
                out=torch.empty(t, d, device=dev, dtype=dtype), s=torch.empty(t, d, device=dev, dtype=dtype),
            ))  # fmt: skip
        w = torch.randn(d, device=dev, dtype=dtype)
        b = torch.randn(d, device=dev, dtype=dtype)
        a = 0.5
        cases = {
            "copy": (lambda k: k["out"].copy_(k["x"]), 2 * size),
            "fused": (lambda k: layer_norm(k["x"], w, b, residual=k["r"], alpha=a, out=k["out"]), 3 * size),
            "fused + sum_out": (
                lambda k: layer_norm(k["x"], w, b, residual=k["r"], alpha=a, out=k["out"], sum_out=k["s"]),
                4 * size,
            ),
            "fused, no residual": (lambda k: layer_norm(k["x"], w, b, out=k["out"]), 2 * size),
            "torch": (lambda k: F.layer_norm(k["r"] + a * k["x"], (d,), w, b), 3 * size),
        }
        copy_gbs = None
        for name, (fn, nbytes) in cases.items():
            us = graph_time_us([lambda k=k, fn=fn: fn(k) for k in sets])
            gbs = nbytes / us / 1e3
            if name == "copy":
                copy_gbs = gbs
            rows.append(dict(shape=spec, dtype=args.dtype, case=name, us=us, gbs=gbs, of_copy=gbs / copy_gbs))
        k = sets[0]
        rows.append(dict(shape=spec, dtype=args.dtype, case="host cost, eager fused call",
                         us=host_us(lambda: layer_norm(k["x"], w, b, residual=k["r"], alpha=a, out=k["out"])),
                         gbs=None, of_copy=None))  # fmt: skip
        del sets, k

    name = torch.cuda.get_device_name()
    print(f"{name}, torch {torch.__version__}, {fusedenc.backend()}")
    print(f"{'shape':>12} {'case':>28} {'us':>9} {'GB/s':>8} {'of copy':>8}")
    for row in rows:
        gbs = f"{row['gbs']:.0f}" if row["gbs"] else "-"
        ratio = f"{row['of_copy']:.2f}" if row["of_copy"] else "-"
        print(f"{row['shape']:>12} {row['case']:>28} {row['us']:9.2f} {gbs:>8} {ratio:>8}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, torch=torch.__version__, backend=str(fusedenc.backend()), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
