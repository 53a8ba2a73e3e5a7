"""Host cost of one fusedenc.linear call, against torch's own ops.

Times many back-to-back calls on a tiny GEMM (8 x 64 x 64), where the GPU
finishes each kernel faster than the host can issue the next, so wall time per
call is the host's cost of issuing it.  Reports microseconds per call for:

  fusedenc.linear          the public eager path (validation + native call)
  torch.ops.fusedenc.linear  the same through the torch dispatcher (custom op)
  core.gemm                the seam every fusedenc GEMM goes through, without the op's checks
                           (what EncoderBlock's native path pays per GEMM)
  F.linear                 torch's own bias GEMM (cuBLASLt), for scale
  F.linear + F.gelu        what the fused op replaces

and for one whole encoder layer (B=1, S=8, D=64, F=128, post-LN):

  EncoderBlock             the eager GPU path (signature checked once, direct core calls)
  EncoderBlock via ops     the same block's seven steps through the public ops (per-op
                           checks), as executors.OpsExecutor runs them
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
from fusedenc import core
from fusedenc.executors import OpsExecutor


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


def through_ops(block: fusedenc.EncoderBlock):
    """A function running ``block`` (post-LN, no bias or mask) on ``[B, S, D]`` through the public
    ops, step by step as the block does on CPU and under torch.compile (``OpsExecutor``); returns
    the ``[B*S, D]`` rows."""
    assert not block.norm_first and block.batch_first
    ex, p = OpsExecutor(), dict(block.named_parameters())
    alpha, eps, act, heads = block.residual_alpha, block.layer_norm_eps, block.activation, block.n_heads

    def run(x):
        batch, seq, d = x.shape
        x2 = x.contiguous().view(batch * seq, d)
        qkv = ex.linear(x2, p["qkv_weight"], p["qkv_bias"])
        a = ex.attention(None, qkv, batch, seq, heads, None, None)
        y = ex.linear(a, p["out_weight"], p["out_bias"])
        h = ex.layer_norm(y, p["norm1_weight"], p["norm1_bias"], eps, residual=x2, alpha=alpha)
        f = ex.linear(h, p["ffn1_weight"], p["ffn1_bias"], act)
        g = ex.linear(f, p["ffn2_weight"], p["ffn2_bias"])
        return ex.layer_norm(g, p["norm2_weight"], p["norm2_bias"], eps, residual=h, alpha=alpha)

    return run


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
    stream = torch.cuda.current_stream().cuda_stream
    problem = dict(a=x, lda=64, w=w, ldw=64, out=out, ldo=64, m=8, n=64, k=64, bias=b, activation="gelu_tanh",
                   stream=stream, workspace=core.workspace(dev, stream))  # fmt: skip

    cases = {
        "fusedenc.linear (gelu_tanh epilogue)": lambda: fusedenc.linear(x, w, b, "gelu_tanh"),
        "fusedenc.linear (out=, preallocated)": lambda: fusedenc.linear(x, w, b, "gelu_tanh", out=out),
        "torch.ops.fusedenc.linear (dispatcher)": lambda: torch.ops.fusedenc.linear(x, w, b, "gelu_tanh", None, 1.0, 1.0),
        "core.gemm (the seam, no checks)": lambda: core.gemm(**problem),
        "F.linear": lambda: F.linear(x, w, b),
        "F.linear + F.gelu(tanh)": lambda: F.gelu(F.linear(x, w, b), approximate="tanh"),
    }
    block = fusedenc.EncoderBlock(64, 4, 128, "gelu", dtype=torch.float16, device=dev)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, 0.0, "gelu", batch_first=True, device=dev,
                                             dtype=torch.float16).eval()  # fmt: skip
    xb = torch.randn(1, 8, 64, device=dev, dtype=torch.float16)
    cases["EncoderBlock (one layer)"] = lambda: block(xb)
    block_via_ops = through_ops(block)
    cases["EncoderBlock via the public ops"] = lambda: block_via_ops(xb)
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
