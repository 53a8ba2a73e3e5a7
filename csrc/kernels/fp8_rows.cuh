// The row-wise e4m3 rule of fusedenc.fp8.quantize_rows on the device, shared by every
// kernel that writes it (the quantization kernel, the LayerNorm's FP8 copy), so their codes
// are the reference's bit for bit by construction:
//   amax  = the row's largest magnitude, NaN winning over everything
//   scale = amax / max (IEEE division; max 448 for OCP e4m3, 240 for FNUZ), 1 for a row of zeros
//   code  = e4m3(x / scale), IEEE division, round to nearest even, saturating
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

#if FUSEDENC_HAS_FP8_GEMM
__device__ __forceinline__ gpu_fp8_e4m3 fp8_code(float x, float scale) { return gpu_to_e4m3(__fdiv_rn(x, scale)); }

// The code byte in format `f`: OCP through the vendor's conversion (cuda_fp8.h on NVIDIA),
// FNUZ through fusedenc's own (fp8_convert.h; only HIP builds meet it).
__device__ __forceinline__ uint8_t fp8_code_byte(float x, float scale, Fp8Format f) {
  if (f == Fp8Format::e4m3fnuz) return fp8_e4m3_from_float(__fdiv_rn(x, scale), f);
  return fp8_code(x, scale).__x;
}
#endif

}  // namespace fusedenc
