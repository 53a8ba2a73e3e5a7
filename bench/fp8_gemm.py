"""FP8 GEMMs against fp16, one block's GEMMs at a time (FP8 speed at the GEMM level).

    python3 bench/fp8_gemm.py [--presets t82,bt4,bert-base] [--rows 16384,65536] [--out FILE]

For each preset's four block GEMMs (QKV, out-projection, FFN1 with its activation, FFN2)
at each row count, device time per call, all columns of a row in one interleaved run
(``fusedenc.tune.timing.time_interleaved``: CUDA graphs, every candidate replayed once
per rep):

  fp16            fusedenc.linear on fp16 operands (what the unfolded block runs today)
  fp8 gemm        fusedenc.fp8.rowwise.linear on operands already in e4m3: cuBLASLt with per-row
                  scales (+ the activation pass for FFN1's swish / mish / GELU)
  fp8 fast        with Hopper's fast FP8 accumulation: cuBLASLt, or for FFN1's swish / mish
                  the Hopper FP8 kernel with the activation in its epilogue
  fp8 lt          fast accumulation with the Hopper kernels switched off: cuBLASLt + the pass
  quantize        fusedenc's row-wise quantization kernel on the GEMM's fp16 input
  scaled_mm       torch._scaled_mm with the same row-wise scales (the torch peer's GEMM;
                  its bias added after, as torchao does where the kernel takes none)
  peer quant      the peer's quantization in torch ops (amax, divide, cast)

and the ratios fp16 / (quantize + fp8 gemm): what FP8 gains when the quantization is a
separate pass, and fp16 / fp8 gemm: what it gains once a producer writes FP8 itself.
GPU with FP8 only (H100: compute capability 9.0).
"""

from __future__ import annotations

import argparse
import sys

import torch

import fusedenc
import fusedenc.testing
from fusedenc import core
from fusedenc.fp8 import rowwise as fp8
from fusedenc.tune.presets import PRESETS, block_gemms
from fusedenc.tune.timing import time_interleaved

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import environment  # noqa: E402


def _without_sm90(fn):
    with fusedenc.testing.sm90_gemm_disabled():
        return fn()


def _peer_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12)
    scale = amax / fp8.E4M3_MAX
    return (x.float() / scale).to(fp8.E4M3), scale


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="t82,bt4,bert-base")
    ap.add_argument("--rows", default="16384,65536", help="GEMM rows (positions x tokens)")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--out", help="also write the table here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("fp8_gemm: needs a GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    ok, why = core.fp8_status(device)
    if not ok:
        print(f"fp8_gemm: no FP8 GEMM here: {why}", file=sys.stderr)
        return 2
    env = environment(device)
    lines = [f"fusedenc FP8 GEMMs against fp16 on {torch.cuda.get_device_name(device)}, torch {env['torch']}, "
             f"{env['blaslt']}, fusedenc {fusedenc.__version__} ({env['git_commit']}); device us per call"]  # fmt: skip
    head = (f"{'preset':<10} {'gemm':<9} {'M x N x K':>20} {'fp16':>8} {'fp8 gemm':>9} {'fp8 fast':>9} {'fp8 lt':>8} "
            f"{'quantize':>9} {'scaled_mm':>10} {'peer quant':>10} {'fp16/(q+gemm)':>14} {'fp16/gemm':>10}")  # fmt: skip
    side = torch.cuda.Stream(device)
    gen = torch.Generator(device=device).manual_seed(0)
    totals: dict[tuple[str, int], list[float]] = {}
    for preset in args.presets.split(","):
        for rows in [int(r) for r in args.rows.split(",")]:
            lines += ["", head]
            seq = PRESETS[preset].seq_lens[0]
            for p in block_gemms(PRESETS[preset], rows // seq, False):
                x = torch.randn((p.m, p.k), device=device, dtype=torch.float16, generator=gen)
                w = torch.randn((p.n, p.k), device=device, dtype=torch.float16, generator=gen) * p.k**-0.5
                b = torch.randn((p.n,), device=device, dtype=torch.float16, generator=gen)
                out16 = torch.empty((p.m, p.n), device=device, dtype=torch.float16)
                out8 = torch.empty_like(out16)
                with torch.cuda.stream(side):
                    qx, qw = fp8.quantize_rows(x), fp8.quantize_rows(w)
                    px, pscale = _peer_quantize(x)
                act = p.activation
                sw = qw.scale[None, :].contiguous()

                calls = [
                    lambda: fusedenc.linear(x, w, b, act, out=out16),
                    lambda: fp8.linear(qx, qw, b, act, out=out8),
                    lambda: fp8.linear(qx, qw, b, act, fast_accum=True, out=out8),
                    lambda: _without_sm90(lambda: fp8.linear(qx, qw, b, act, fast_accum=True, out=out8)),
                    lambda: fp8.quantize_rows(x),
                    lambda: torch._scaled_mm(px, qw.q.t(), scale_a=pscale, scale_b=sw, out_dtype=torch.bfloat16),
                    lambda: _peer_quantize(x),
                ]
                us, _ = time_interleaved(calls, args.reps, 3, side)
                f16, g8, fast, lt, q, smm, pq = us
                totals.setdefault((preset, rows), [0.0, 0.0, 0.0])
                t = totals[(preset, rows)]
                t[0] += f16
                t[1] += q + g8
                t[2] += g8
                lines.append(f"{preset:<10} {p.name:<9} {f'{p.m} x {p.n} x {p.k}':>20} {f16:8.1f} {g8:9.1f} {fast:9.1f} {lt:8.1f} "
                             f"{q:9.1f} {smm:10.1f} {pq:10.1f} {f16 / (q + g8):14.2f}x {f16 / g8:9.2f}x")  # fmt: skip
    lines += ["", "block totals (four GEMMs, accurate accumulation): fp16 / (quantize + fp8 gemm), fp16 / fp8 gemm"]
    for (preset, rows), (f16, qg, g) in totals.items():
        lines.append(f"  {preset:<10} {rows:>6} rows: {f16:8.1f} us fp16, {qg:8.1f} with quantize, {g:8.1f} gemm only: "
                     f"{f16 / qg:.2f}x, {f16 / g:.2f}x")  # fmt: skip
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
