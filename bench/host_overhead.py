"""Host cost of one fusedenc.linear call, against torch's own ops.

Times many back-to-back calls on a tiny GEMM (8 x 64 x 64), where the GPU
finishes each kernel faster than the host can issue the next, so wall time per
call is the host's cost of issuing it.  Reports microseconds per call for:

  fusedenc.linear          the public eager path (validation + native call)
  torch.ops.fusedenc.linear  the same through the torch dispatcher (custom op)
  _C.gemm only             the raw binding with precomputed arguments
  F.linear                 torch's own bias GEMM (cuBLASLt), for scale
  F.linear + F.gelu        what the fused op replaces

and for one whole encoder layer (B=1, S=8, D=64, F=128, post-LN):

  EncoderBlock             the eager GPU path (signature checked once, direct core calls)
  EncoderBlock via ops     the same block through the public ops (per-op checks)
  nn.TransformerEncoderLayer  torch's layer in eval mode (its fused fast path)

Usage: python bench/host_overhead.py [--calls N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

import fusedenc
from fusedenc import _native


def per_call_us(fn, calls: int, repeats: int = 7) -> float:
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def _through_ops(block, x):
    """The block's data path through the public ops (what torch.compile and CPU tensors use)."""
    from fusedenc import encoder

    rows, b, s = block._as_rows(x, None)
    return block._run(encoder._OpsExecutor(), None, rows, b, s, None, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available() or fusedenc.backend().name == "reference":
        raise SystemExit(f"needs a GPU with the native core: {fusedenc.backend()}")

    dev = torch.device("cuda")
    x = torch.randn(8, 64, device=dev, dtype=torch.float16)
    w = torch.randn(64, 64, device=dev, dtype=torch.float16)
    b = torch.randn(64, device=dev, dtype=torch.float16)
    out = torch.empty(8, 64, device=dev, dtype=torch.float16)
    module = _native.native_module()
    stream = torch.cuda.current_stream().cuda_stream
    ws = _native.workspace(dev, stream)
    raw = (0, stream, 8, 64, 64, x.data_ptr(), 64, w.data_ptr(), 64, b.data_ptr(), 0, 0,
           out.data_ptr(), 64, 0, 2, 1.0, 0.0, ws.data_ptr(), ws.numel())  # fmt: skip

    cases = {
        "fusedenc.linear (gelu_tanh epilogue)": lambda: fusedenc.linear(x, w, b, "gelu_tanh"),
        "fusedenc.linear (out=, preallocated)": lambda: fusedenc.linear(x, w, b, "gelu_tanh", out=out),
        "torch.ops.fusedenc.linear (dispatcher)": lambda: torch.ops.fusedenc.linear(x, w, b, "gelu_tanh", None, 1.0, 1.0),
        "_C.gemm only (precomputed args)": lambda: module.gemm(*raw),
        "F.linear": lambda: F.linear(x, w, b),
        "F.linear + F.gelu(tanh)": lambda: F.gelu(F.linear(x, w, b), approximate="tanh"),
    }
    block = fusedenc.EncoderBlock(64, 4, 128, "gelu", dtype=torch.float16, device=dev)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, 0.0, "gelu", batch_first=True, device=dev,
                                             dtype=torch.float16).eval()  # fmt: skip
    xb = torch.randn(1, 8, 64, device=dev, dtype=torch.float16)
    cases["EncoderBlock (one layer)"] = lambda: block(xb)
    cases["EncoderBlock via the public ops"] = lambda: _through_ops(block, xb)
    cases["nn.TransformerEncoderLayer (eval)"] = lambda: layer(xb)
    with torch.inference_mode():
        results = {name: per_call_us(fn, args.calls) for name, fn in cases.items()}

    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "library": fusedenc.backend().library,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "calls": args.calls,
    }
    print(f"host cost per call, us (median of 7 x {args.calls} calls), {meta['device']}, {meta['library']}")
    for name, us in results.items():
        print(f"  {name:42s} {us:7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "us_per_call": results}, f, indent=2)


if __name__ == "__main__":
    main()
