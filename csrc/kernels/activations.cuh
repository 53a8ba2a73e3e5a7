// activations.cuh: the activation functions in fp32, shared by the bias + activation
// pass and the GEMM epilogues that apply an activation themselves, so that every
// path computes the same math.  Device code: include from .cu files only.
#pragma once

#include "../common.h"

namespace fusedenc {

// ---- the activations, in fp32; NaN in gives NaN out for every one of them ----
template <Activation A>
__device__ __forceinline__ float activate(float x);

template <> __device__ __forceinline__ float activate<Activation::none>(float x) { return x; }
// Written as a comparison rather than fmaxf so that NaN propagates like torch.relu.
template <> __device__ __forceinline__ float activate<Activation::relu>(float x) {
  return x < 0.f ? 0.f : x;
}
template <> __device__ __forceinline__ float activate<Activation::relu2>(float x) {
  float r = x < 0.f ? 0.f : x;
  return r * r;
}
template <> __device__ __forceinline__ float activate<Activation::gelu_tanh>(float x) {
  const float k0 = 0.7978845608028654f;  // sqrt(2 / pi)
  const float k1 = 0.044715f;
  return 0.5f * x * (1.f + tanhf(k0 * (x + k1 * x * x * x)));
}
template <> __device__ __forceinline__ float activate<Activation::gelu>(float x) {
  return 0.5f * x * (1.f + erff(x * 0.7071067811865476f));
}
template <> __device__ __forceinline__ float activate<Activation::swish>(float x) {
  return x / (1.f + expf(-x));
}
template <> __device__ __forceinline__ float activate<Activation::mish>(float x) {
  // x * tanh(softplus(x)) with one exp instead of exp + log1p + tanh: for n = e^x,
  // tanh(log1p(n)) = ((1+n)^2 - 1) / ((1+n)^2 + 1) = n(n+2) / (n(n+2) + 2), exact
  // algebra with no cancellation at either end (n -> 0: ~n; n large: 1 - 2/n^2).
  // Above torch's softplus threshold of 20, tanh(x) == 1 in fp32, so mish(x) == x.
  // The transcendental-heavy form made this pass compute-bound (measured: half
  // of memory speed on an H100 at the BT4 FFN1 shape).
  if (x > 20.f) return x;
  const float n = expf(x);
  const float p = n * (n + 2.f);
  return x * (p / (p + 2.f));
}
template <> __device__ __forceinline__ float activate<Activation::selu>(float x) {
  const float alpha = 1.6732632423543772f;
  const float scale = 1.0507009873554805f;
  return scale * (x > 0.f ? x : alpha * expm1f(x));
}
template <> __device__ __forceinline__ float activate<Activation::tanh>(float x) { return tanhf(x); }
template <> __device__ __forceinline__ float activate<Activation::sigmoid>(float x) {
  return 1.f / (1.f + expf(-x));
}

}  // namespace fusedenc

namespace fusedenc {

// The GEMM epilogue's versions: the epilogue's arithmetic is time the tensor cores wait
// (all of it in a cooperative kernel, which runs the epilogue between main loops; in the
// pingpong kernel whatever the other warpgroup's main loop does not cover).  With IEEE expf and a true division, swish/mish cost as much as ~40% of an
// FFN1 GEMM's main loop (measured at 65536 x 768 x 2304 on an H100: 650 us with
// swish against 370 us with no activation; __frcp_rn, a correctly rounded reciprocal,
// is no faster).  These use the hardware exp2 and reciprocal approximations
// (__expf, __fdividef): relative error ~1e-6, far below the 16-bit outputs (the
// epilogue kernels exist only for fp16/bf16).  __fdividef(x, y) is 0 for
// |y| > 2^126, so swish(x) of very negative x is -0 (torch: -0 or a denormal,
// both 0 in 16 bits); NaN -> NaN; mish(x > 20) = x.  No branches: a data-dependent
// early return in mish made the whole epilogue twice as slow (bt4 FFN1, 16384 x 1024
// x 1536 on an H100: 169 us against 100 branch-free and 79 with no activation), so
// mish computes both sides on a clamped exponent and selects.  Exact GELU (erff) cost
// 139 us there in the run-time switch, more than cuBLASLt + the pass: the GELUs below run
// only in units that fix them at compile time (sm90_gemm.cpp: gelu_in_epilogue).
template <Activation A>
__device__ __forceinline__ float activate_fast(float x) {
  return activate<A>(x);
}
// 2^y and 1/q as one MUFU op each, denormals flushed (ex2.approx.ftz, rcp.approx.ftz).
// __expf compiles to the non-flushing ex2, which sm_90 wraps in a range fix-up (a compare and
// two predicated multiplies around the MUFU op, all on the activation's dependent chain).
// Flushing only changes results below 2^-126, which are 0 in the 16-bit outputs these
// epilogues write (exact GELU, whose bf16 tail reaches below that, shifts its exponent).
// HIP builds take the plain functions.
__device__ __forceinline__ float ex2_ftz(float y) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(y));
  return r;
#else
  return exp2f(y);
#endif
}
__device__ __forceinline__ float rcp_ftz(float q) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(q));
  return r;
#else
  return 1.f / q;
#endif
}
// max(x, y) that returns NaN where either is NaN (fmaxf returns the other), in one instruction.
__device__ __forceinline__ float max_nan(float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(y));
  return r;
#else
  return x != x ? x : fmaxf(x, y);
#endif
}
// e^x through ex2_ftz.  Measured on an H100 against __expf (fp16, folded FFN1): outputs
// bit-identical; swish 65536 x 768 -> 2304 404 -> 398 us, mish 65536 x 1024 -> 1536 348 -> 342
// us; whole nets within noise.
__device__ __forceinline__ float exp_ftz(float x) { return ex2_ftz(x * 1.4426950408889634f); }
template <> __device__ __forceinline__ float activate_fast<Activation::swish>(float x) {
  return __fdividef(x, 1.f + exp_ftz(-x));
}
// 1/d for d in [2, 2^126) on the FMA pipe: an integer seed (relative error <= 5.1%) and
// two Newton steps (error squared at each: 2.6e-3, then 6.6e-6, 1/75 of an fp16 rounding;
// measured over d in [2, 2^121] in a float32 emulation).  Mish's epilogue measured faster
// with it than with the MUFU reciprocal (H100, fp16, FFN1 folded + mish 65536 x 1024 -> 1536:
// MUFU 456-463 us, three steps 387-391 us, two steps 352 us, each against the others as
// cases of one kernel's switch, which shifts every case's speed: whole bt4 net, table
// against table, +0-2%).  Outputs stay within one fp16 rounding and max|out - ref32| does
// not grow.  Swish measured slower with it (16384 x 768 -> 2304: 105 us MUFU, 113 us three
// steps, 138 us two), so swish keeps MUFU's.  Why one activation gains and the other loses
// is not known (bench/NOTES.md).
__device__ __forceinline__ float reciprocal_newton(float d) {
  float r = __int_as_float(0x7EF311C3 - __float_as_int(d));
  float e = fmaf(-d, r, 1.f);
  r = fmaf(r, e, r);
  e = fmaf(-d, r, 1.f);
  return fmaf(r, e, r);
}
template <> __device__ __forceinline__ float activate_fast<Activation::mish>(float x) {
  const float n = exp_ftz(fminf(x, 20.f));  // NaN -> 20: the NaN comes back through x * ...
  const float p = n * (n + 2.f);           // mish(x) = x * tanh(softplus(x)) = x * p / (p + 2)
  const float y = x * (p * reciprocal_newton(p + 2.f));
  return x > 20.f ? x : y;
}
template <> __device__ __forceinline__ float activate_fast<Activation::sigmoid>(float x) {
  return __fdividef(1.f, 1.f + exp_ftz(-x));
}

// The two GELUs for the epilogue units that fix them at compile time (sm90_gemm.cpp:
// gelu_in_epilogue).  An epilogue's activation costs GEMM time (mish, ~15 instructions a value,
// as much as the GELU pass it would replace: bench/NOTES.md), so both are written for few
// instructions and a short dependent chain, and so that the negative tail keeps its relative
// accuracy down to the subnormals bf16 can hold: no form subtracts two numbers near 1.  Checked in a float32
// emulation of these exact steps over every fp16/bf16 value in [-40, 40] against fp64 erfc and
// sigmoid (with the MUFU results off by 2 ulp either way): within the output's half ulp + 1e-5
// relative everywhere, 4e-6 relative in fp32 (tests/test_sm90_gelu_gpu.py checks the kernels
// the same way).
//
// Exact GELU as max(x, 0) - h, h = 0.5 a erfc(a / sqrt 2) for a = |x| (x - h or -h), written h
// = e^(-a^2 / 2) R(a) with R(a) = a P(a) / Q(a), P cubic and Q quartic: a rational fitted to R
// for relative error over [0, 14] (max 3.8e-7; tools/gelu_rational_fit.py fits it and emulates
// these steps).  R tends to 1 / sqrt(2 pi), so nothing in it overflows or cancels; ~16.5
// instructions and 2 MUFU a value in the SASS, against 25 and 1 for CUDA's erff in torch's 1 +
// erf form (which loses the tail) and 32 and 2 for Numerical Recipes' erfcc fit used before.
// The exponential is one ex2 with denormals flushed, taken of y + 24 (2^24 times e^(-a^2 / 2),
// normal down to a = 14) and Q carries the 2^-24 back: the products (a P) e and then / Q stay
// normal wherever h is above bf16's smallest subnormal.  |x| is clamped at 14 (h < 2e-43
// beyond: 0 in both dtypes), so +inf gives +inf and NaN comes back through x; -inf gives
// ~-1e-43, -0 in 16 bits (torch: NaN; no finite accumulator is -inf).
template <> __device__ __forceinline__ float activate_fast<Activation::gelu>(float x) {
  constexpr float kScale = 16777216.f;  // 2^24: e's shift, taken back through Q
  const float a = fminf(fabsf(x), 14.f);
  const float e = ex2_ftz(fmaf(a * a, -0.72134752044448170f, 24.f));  // 2^24 e^(-a^2 / 2)
  float p = fmaf(0.017046008079070668f, a, 0.1195253393320198f);
  p = fmaf(p, a, 0.36196096071292805f);
  p = fmaf(p, a, 0.4999998108821728f);
  float q = fmaf(0.042733009473022f * kScale, a, 0.29940288962377015f * kScale);
  q = fmaf(q, a, 0.9534105193270418f * kScale);
  q = fmaf(q, a, 1.5217877020917112f * kScale);
  q = fmaf(q, a, kScale);
  const float h = ((a * p) * e) * rcp_ftz(q);
  return max_nan(x, 0.f) - h;  // x - h or -h
}
// tanh-GELU: 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3), as
// x / (1 + w) (x >= 0) or x w / (1 + w) (x < 0) with w = e^(-2|u|) <= 1: no overflow, and the
// negative tail (torch's 0.5 x (1 + tanh(u)) is 0 there) stays accurate.  The same exponent
// shift as exact GELU's: w' = 2^24 w from one flushing ex2 (normal while the result is above
// bf16's smallest subnormal), then x 2^24 / (2^24 + w') or x w' / (2^24 + w').  11 instructions
// and 2 MUFU a value (14.5 with __expf's range fix-up, used before).  NaN -> NaN, +inf -> +inf,
// -inf -> NaN (as torch).
template <> __device__ __forceinline__ float activate_fast<Activation::gelu_tanh>(float x) {
  constexpr float kScale = 16777216.f;  // 2^24
  const float inner = fmaf(0.044715f, x * x, 1.f);
  const float w = ex2_ftz(fmaf(-2.3022081981443250f * fabsf(x), inner, 24.f));  // 2^24 e^(-2|u|): -2 sqrt(2 / pi) log2(e)
  return (x * (x >= 0.f ? kScale : w)) * rcp_ftz(w + kScale);
}

}  // namespace fusedenc
