"""Fit the rational behind the exact-GELU epilogue (csrc/kernels/activations.cuh) and check the
kernel's steps in a float32 emulation.

GELU(x) = max(x, 0) - h(|x|), h(a) = 0.5 a erfc(a / sqrt 2) = e^(-a^2 / 2) R(a), and R(a) =
a P(a) / Q(a) with P of degree M and Q of degree M + 1, Q(0) = 1 (R tends to 1 / sqrt(2 pi)).
The fit minimizes R's largest relative error on [0, 14] by Lawson's iteration over a linearized
weighted least-squares problem (fp64 values of R from mpmath).  The check runs the kernel's
float32 steps (fma, the 2^24-shifted ex2, the reciprocal) over every fp16 and bf16 value in
[-40, 40] and counts outputs further than half an output ulp + 1e-5 relative from the fp64 GELU
(tests/test_sm90_gelu_gpu.py asks the same of the kernel).

    python3 tools/gelu_rational_fit.py [--degree 3]
"""

from __future__ import annotations

import argparse
import math

import mpmath
import numpy as np
import torch

LIMIT = 14.0  # |x| is clamped there: h < 2e-43 beyond, 0 in fp16 and bf16
SHIFT = 2.0**24  # ex2 of y + 24 stays normal down to a = 14; Q carries the 2^-24 back


def target(a: float) -> float:
    return float(mpmath.mpf(0.5) * a * mpmath.erfc(a / mpmath.sqrt(2)) * mpmath.exp(a * a / 2))


def fit(m: int, iters: int = 60) -> tuple[float, np.ndarray, np.ndarray]:
    """(max relative error, P's coefficients p0..pm, Q's q0 = 1..q(m+1)), lowest degree first."""
    mpmath.mp.dps = 40
    a = np.linspace(0.0, LIMIT, 6000)[1:]
    a = np.unique(np.concatenate([a, LIMIT * (1 - np.cos(np.linspace(0.0, np.pi / 2, 4000)))[1:]]))
    y = np.array([target(float(v)) for v in a])
    weights, q_prev, best = np.ones_like(a), np.ones_like(a), None
    for _ in range(iters):
        # a P(a) - y Q(a) = 0, scaled by 1 / (y Q_prev): relative error, linear in the coefficients
        cols = [a ** (i + 1) for i in range(m + 1)] + [-y * a**j for j in range(1, m + 2)]
        lhs = np.stack(cols, 1) / (y * q_prev)[:, None]
        root = np.sqrt(weights)
        c, *_ = np.linalg.lstsq(lhs * root[:, None], root / q_prev, rcond=None)
        p, q = c[: m + 1], np.concatenate([[1.0], c[m + 1 :]])
        q_prev = np.polyval(q[::-1], a)
        err = (a * np.polyval(p[::-1], a) / q_prev - y) / y
        worst = float(np.abs(err).max())
        if best is None or worst < best[0]:
            best = (worst, p.copy(), q.copy())
        weights = np.maximum(weights * np.abs(err) / np.sum(weights * np.abs(err)), 1e-12)
    return best


def kernel_steps(x: np.ndarray, p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """The kernel's float32 arithmetic (fma as one rounding), ex2 and rcp correctly rounded."""
    f32 = np.float32

    def fma(u, v, w):
        return (np.float64(u) * np.asarray(v, np.float64) + np.float64(w)).astype(f32)

    a = np.minimum(np.abs(x), f32(LIMIT))
    y = fma((a * a).astype(f32), f32(-0.5 / math.log(2.0)), f32(24.0))
    e = np.exp2(y.astype(np.float64)).astype(f32)
    e[y < -126] = 0  # ex2.approx.ftz
    pc, qc = p.astype(f32), (q.astype(f32) * f32(SHIFT)).astype(f32)
    pv = np.full_like(a, pc[-1])
    for c in pc[-2::-1]:
        pv = fma(pv, a, c)
    qv = np.full_like(a, qc[-1])
    for c in qc[-2::-1]:
        qv = fma(qv, a, c)
    h = ((a * pv).astype(f32) * e).astype(f32)
    h = (h.astype(np.float64) * (1.0 / qv.astype(np.float64)).astype(f32)).astype(f32)
    return (np.maximum(x, f32(0)) - h).astype(f32)


def check(p: np.ndarray, q: np.ndarray) -> dict[str, int]:
    """Per dtype, how many of its values in [-40, 40] the kernel's steps put outside half an
    output ulp + 1e-5 relative of the fp64 GELU."""
    outside_by_dtype = {}
    for dtype, half_ulp, tiny in ((torch.float16, 2.0**-11, 2.0**-24), (torch.bfloat16, 2.0**-8, 2.0**-133)):
        every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).double()
        x = every[torch.isfinite(every) & (every.abs() <= 40)].to(dtype).float().numpy()
        out = torch.from_numpy(kernel_steps(x, p, q)).to(dtype).double().numpy()
        xd = x.astype(np.float64)
        ref = np.array([0.5 * v * math.erfc(-v / math.sqrt(2.0)) for v in xd])
        outside = np.abs(out - ref) > np.abs(ref) * (half_ulp + 1e-5) + tiny
        outside_by_dtype[str(dtype)] = int(outside.sum())
        print(f"{dtype}: {int(outside.sum())} of {len(x)} values outside half an ulp + 1e-5 relative")
    return outside_by_dtype


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--degree", type=int, default=3, help="P's degree (Q's is one more; the kernel: 3)")
    args = ap.parse_args()
    worst, p, q = fit(args.degree)
    print(f"max relative error of R on [0, {LIMIT:g}]: {worst:.3g}")
    print("P:", ", ".join(repr(float(v)) for v in p))
    print("Q:", ", ".join(repr(float(v)) for v in q))
    check(p, q)


if __name__ == "__main__":
    main()
