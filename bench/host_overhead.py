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

  EncoderBlock             the plain call (an automatic CUDA graph replayed) and the eager GPU
                           path (automatic graphs off: signature checked once, direct core calls)
  EncoderBlock via ops     the same block's seven steps through the public ops (per-op
                           checks), as executors.OpsExecutor runs them
  nn.TransformerEncoderLayer  torch's layer in eval mode (its fused fast path)

and for whole modules at real shapes (``--modules``, default t82 body and net at 256 positions,
bert-base 32 x 128), the host time of one call: the GPU idle before it (synchronized), the
clock stopped when the call returns (its kernels queued, not finished), median of
``--module-calls``.  Rows per module:

  eager                    the plain call with automatic graphs off (the path before them)
  plain call               the plain call as users make it: automatic CUDA graphs
                           (``fusedenc.graphs.auto``), replaying after the first two calls
  graph runner             the explicit runner (``graph_runner``), output views (no clone)
  torch.compile            torch.compile(module), default mode (the stack: one custom op,
                           replaying the same automatic graphs)

Usage: python bench/host_overhead.py [--calls N] [--modules t82,t82-net,bert-base]
                                     [--module-batch 256] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

import fusedenc
from fusedenc import core
from fusedenc.encoder.executors import OpsExecutor
from fusedenc.graphs import auto as auto_graphs
from fusedenc.tune.presets import PRESETS


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


def host_us(fn, calls: int) -> float:
    """Median host time of one ``fn()`` with the GPU idle before it (its kernels only queued)."""
    samples = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def _stack(name: str, dev: torch.device) -> fusedenc.EncoderStack:
    p = PRESETS[name]
    return fusedenc.EncoderStack.build(p.layers, p.d_model, p.heads, p.d_ff, activation=p.activation,
                                       residual_alpha=p.alpha, layer_norm_eps=p.eps, dtype=torch.float16, device=dev)


def module_cases(names: list[str], batch: int, dev: torch.device, tmp: str) -> dict:
    """Per module: its eager, plain (automatic graphs), graph-runner and torch.compile calls."""
    cases = {}
    for name in names:
        if name.endswith("-net"):
            from fusedenc.lc0 import load_network
            from fusedenc.lc0.writer import write_preset

            path = f"{tmp}/{name}.pb.gz"
            write_preset(path, name.removesuffix("-net"), seed=1)
            module = load_network(path, dtype=torch.float16, device=dev)
            x = (torch.rand((batch, 112, 8, 8), device=dev) < 0.1).half()
            runner = module.graph_runner((batch,))
            what = f"{name} Lc0Network, {batch} positions"
        else:
            module = _stack(name, dev)
            seq = PRESETS[name].seq_lens[0]
            b = batch if name != "bert-base" else 32
            x = torch.randn(b, seq, module.blocks[0].d_model, device=dev, dtype=torch.float16)
            runner = module.graph_runner(seq, (b,))
            what = f"{name} EncoderStack, {b} x {seq}"
        runner.capture_all()
        compiled = torch.compile(module)

        def eager(module=module, x=x):
            with auto_graphs.disabled():
                return module(x)

        cases[f"{what}: eager"] = eager
        cases[f"{what}: plain call"] = lambda module=module, x=x: module(x)
        cases[f"{what}: graph runner"] = lambda runner=runner, x=x: runner(x)
        cases[f"{what}: torch.compile"] = lambda compiled=compiled, x=x: compiled(x)
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--modules", default="t82,t82-net,bert-base",
                    help="whole modules to time (comma list of t82, bt4, bert-base stacks and t82-net, bt4-net; "
                         "empty: none)")
    ap.add_argument("--module-batch", type=int, default=256, help="positions per call (bert-base: 32 sequences)")
    ap.add_argument("--module-calls", type=int, default=50)
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
    cases["EncoderBlock (one layer, plain call: automatic graph)"] = lambda: block(xb)

    def block_eager():
        with auto_graphs.disabled():
            return block(xb)

    cases["EncoderBlock (one layer, automatic graphs off)"] = block_eager
    block_via_ops = through_ops(block)
    cases["EncoderBlock via the public ops"] = lambda: block_via_ops(xb)
    cases["nn.TransformerEncoderLayer (eval)"] = lambda: layer(xb)
    with torch.inference_mode():
        results = {name: per_call_us(fn, args.calls) for name, fn in cases.items()}
        names = [n for n in args.modules.split(",") if n]
        with tempfile.TemporaryDirectory() as tmp:
            modules = module_cases(names, args.module_batch, dev, tmp)
            for name, fn in modules.items():
                for _ in range(5):  # first calls: plans, the automatic graph's capture, compilation
                    fn()
                results[name] = host_us(fn, args.module_calls)

    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "library": fusedenc.backend().library,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "calls": args.calls,
        "module_calls": args.module_calls,
        "module_batch": args.module_batch,
    }
    print(f"host cost per call, us (median of 7 x {args.calls} calls), {meta['device']}, {meta['library']}")
    for name, us in results.items():
        print(f"  {name:62s} {us:9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "us_per_call": results}, f, indent=2)


if __name__ == "__main__":
    main()
