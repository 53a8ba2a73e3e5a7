"""Fused residual + LayerNorm against copy bandwidth and against PyTorch's unfused ops.

For each shape, times (``fusedenc.tune.timing.time_graph``: CUDA graphs of
back-to-back calls, so launch cost does not hide the kernel; device events;
median of 20 replays; the calls cycle through enough copies of the buffers
that the 50 MB L2 cannot serve a call from the previous one's data):

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
import time

import torch
import torch.nn.functional as F

import fusedenc
from fusedenc.common import dtypes
from fusedenc.ops.norm import layer_norm
from fusedenc.tune.timing import MIN_REPS, time_graph


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
    ap.add_argument("--dtype", default="float16", choices=list(dtypes.BY_NAME))
    args = ap.parse_args()
    if not torch.cuda.is_available() or fusedenc.backend().name == "reference":
        raise SystemExit(f"needs a GPU with the native core: {fusedenc.backend()}")
    dtype = dtypes.BY_NAME[args.dtype]
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
            us = time_graph(fn, sets, reps=MIN_REPS, device=dev).ms * 1e3
            gbs = nbytes / us / 1e3
            if name == "copy":
                copy_gbs = gbs
            rows.append(dict(shape=spec, dtype=args.dtype, case=name, us=us, gbs=gbs, of_copy=gbs / copy_gbs))
        rows.append(dict(shape=spec, dtype=args.dtype, case="host cost, eager fused call",
                         us=host_us(lambda k=sets[0]: layer_norm(k["x"], w, b, residual=k["r"], alpha=a, out=k["out"])),
                         gbs=None, of_copy=None))  # fmt: skip
        del sets

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
