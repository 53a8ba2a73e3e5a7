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
// e^x as one MUFU.EX2 with denormals flushed (ex2.approx.ftz).  __expf compiles to the
// non-flushing ex2, which sm_90 wraps in a range fix-up (a compare and two predicated
// multiplies around the MUFU op, all on the activation's dependent chain).  Flushing only
// changes results below 2^-126, which are 0 in the 16-bit outputs these epilogues write.
// Measured on an H100 (fp16, folded FFN1): outputs bit-identical; swish 65536 x 768 -> 2304
// 404 -> 398 us, mish 65536 x 1024 -> 1536 348 -> 342 us; whole nets within noise.
__device__ __forceinline__ float exp_ftz(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
#else
  return __expf(x);
#endif
}
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
// gelu_in_epilogue).  Both are written so that the dependent chain is short (the epilogue's
// cost follows its chain's latency, not its instruction count: bench/NOTES.md) and so that
// the negative tail keeps its relative accuracy down to the subnormals bf16 can hold:
// __expf (not exp_ftz) keeps subnormal results, and no form subtracts two numbers near 1.
// Checked in a float32 emulation over every fp16/bf16 value in [-40, 40] against fp64 erfc
// and sigmoid: within the output's half ulp + 1e-5 relative everywhere, 4e-6 / 1e-5 relative
// in fp32 (tests/test_sm90_gelu_gpu.py checks the kernels the same way).
//
// Exact GELU as x - h (x >= 0) or -h (x < 0), h = 0.5 |x| erfc(|x| / sqrt 2), with erfc from
// Numerical Recipes' erfcc fit: erfc(z) = t exp(-z^2 + P(t)), t = 1 / (1 + z / 2), P of degree
// 9 (relative error < 1.2e-7 for every z >= 0); P by Estrin's scheme (depth 4 instead of
// Horner's 9).  |x| is clamped at 15 (erfc(15 / sqrt 2) < 1e-50: 0 in fp32), so +inf gives
// +inf and NaN comes back through x; -inf gives -0 (torch: NaN; no finite accumulator is -inf).
template <> __device__ __forceinline__ float activate_fast<Activation::gelu>(float x) {
  const float a = fminf(fabsf(x), 15.f);
  const float t = __fdividef(1.f, fmaf(0.35355339059327373f, a, 1.f));  // 1 / (1 + z / 2), z = a / sqrt 2
  const float t2 = t * t;
  const float t4 = t2 * t2;
  const float q0 = fmaf(1.00002368f, t, -1.26551223f);
  const float q1 = fmaf(0.09678418f, t, 0.37409196f);
  const float q2 = fmaf(0.27886807f, t, -0.18628806f);
  const float q3 = fmaf(1.48851587f, t, -1.13520398f);
  const float q4 = fmaf(0.17087277f, t, -0.82215223f);
  const float p = fmaf(q4, t4 * t4, fmaf(fmaf(q3, t2, q2), t4, fmaf(q1, t2, q0)));
  const float e = __expf(fmaf(-0.5f * a, a, p));  // e^(-z^2 + P(t)), subnormals kept
  const float h = (0.5f * a) * t * e;
  return x < 0.f ? -h : x - h;
}
// tanh-GELU: 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3), as
// x / (1 + w) (u >= 0) or x w / (1 + w) (u < 0) with w = e^(-2|u|) <= 1: no overflow, and the
// negative tail (torch's 0.5 x (1 + tanh(u)) is 0 there) stays accurate.  NaN -> NaN, +inf ->
// +inf, -inf -> NaN (as torch).
template <> __device__ __forceinline__ float activate_fast<Activation::gelu_tanh>(float x) {
  const float inner = fmaf(0.044715f, x * x, 1.f);
  const float w = __expf((-1.5957691216057308f * fabsf(x)) * inner);  // e^(-2|u|), 2 sqrt(2 / pi)
  return (x >= 0.f ? x : x * w) * __fdividef(1.f, 1.f + w);
}

}  // namespace fusedenc
