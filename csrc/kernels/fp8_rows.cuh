// The row-wise e4m3 rule of fusedenc.fp8.quantize_rows on the device, shared by every
// kernel that writes it (the quantization kernel, the LayerNorm's FP8 copy), so their codes
// are the reference's bit for bit by construction:
//   amax  = the row's largest magnitude, NaN winning over everything
//   scale = amax / max (IEEE division; max 448 for OCP e4m3, 240 for FNUZ), 1 for a row of zeros
//   code  = e4m3(x / scale), x / scale rounded as IEEE division rounds it (fp8_quotient),
//           then to e4m3 by round to nearest even, saturating
// The one-argument forms are OCP's (NVIDIA, gfx95x: what the LayerNorm kernel writes).
#pragma once

#include "../common.h"
#include "fp8_convert.h"

namespace fusedenc {

__device__ __forceinline__ float fp8_amax_combine(float m, float a) { return (a > m || a != a) ? a : m; }

__device__ __forceinline__ float fp8_row_scale(float amax, Fp8Format f) {
  return amax == 0.f ? 1.f : __fdiv_rn(amax, fp8_max(f));
}
__device__ __forceinline__ float fp8_row_scale(float amax) { return fp8_row_scale(amax, Fp8Format::e4m3fn); }

// x / scale as IEEE division rounds it, without a division per value: a row's values share
// one scale, so its reciprocal y = RN(1 / scale) is taken once, q = RN(x * y) is within one
// ulp of x / scale, and one FMA correction, RN(q + RN(x - q * scale) * y), is the correctly
// rounded quotient (Markstein's theorem; the remainder x - q * scale is exact in an FMA).
// Three instructions a value instead of the division's ~10 and its branch (measured on an
// H100: the LayerNorm kernel's FP8 copy 1% faster, the static FP8 t82 stack 0.5%; the kernel
// is bound by its memory phases, bench/NOTES.md).  The theorem needs y and the remainders normal
// and finite: scales outside [2^-100, 2^100] (a row of tiny values, or inf / NaN in the row)
// keep the division, a branch the whole row takes alike.  The quotient's sign is x's (also
// for -0, which the correction's -0 + +0 would turn into +0).
struct Fp8Divisor {
  float scale;
  float inv;  // RN(1 / scale) when `fast`
  bool fast;
};
__device__ __forceinline__ Fp8Divisor fp8_divisor(float scale) {
  const bool fast = scale >= 0x1p-100f && scale <= 0x1p100f;  // false for NaN and inf too
  // An IEEE division, not __frcp_rn: some HIP headers map that to the hardware's approximate
  // reciprocal, and the theorem needs the correctly rounded one.
  return {scale, fast ? __fdiv_rn(1.f, scale) : 0.f, fast};
}
__device__ __forceinline__ float fp8_quotient(float x, const Fp8Divisor& d) {
  if (!d.fast) return __fdiv_rn(x, d.scale);
  const float q = __fmul_rn(x, d.inv);
  const float rem = __fmaf_rn(-q, d.scale, x);
  return copysignf(__fmaf_rn(rem, d.inv, q), x);
}

#if FUSEDENC_HAS_FP8_GEMM
__device__ __forceinline__ gpu_fp8_e4m3 fp8_code(float x, const Fp8Divisor& d) {
  return gpu_to_e4m3(fp8_quotient(x, d));
}
// Two codes in one conversion where the vendor has one (low byte: a's code).
__device__ __forceinline__ uint16_t fp8_code_pair(float a, float b, const Fp8Divisor& d) {
  return gpu_to_e4m3x2(fp8_quotient(a, d), fp8_quotient(b, d));
}

// The code byte in format `f`: OCP through the vendor's conversion (cuda_fp8.h on NVIDIA),
// FNUZ through fusedenc's own (fp8_convert.h; only HIP builds meet it).
__device__ __forceinline__ uint8_t fp8_code_byte(float x, const Fp8Divisor& d, Fp8Format f) {
  if (f == Fp8Format::e4m3fnuz) return fp8_e4m3_from_float(fp8_quotient(x, d), f);
  return fp8_code(x, d).__x;
}
#endif

}  // namespace fusedenc
