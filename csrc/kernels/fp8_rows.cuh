// The row-wise e4m3 rule of fusedenc.fp8.quantize_rows on the device, shared by every
// kernel that writes it (the quantization kernel, the LayerNorm's FP8 copy), so their codes
// are the reference's bit for bit by construction:
//   amax  = the row's largest magnitude, NaN winning over everything
//   scale = amax / 448 (IEEE division), 1 for a row of zeros
//   code  = e4m3(x / scale), IEEE division, round to nearest even, saturating
#pragma once

#include "../common.h"

namespace fusedenc {

__device__ __forceinline__ float fp8_amax_combine(float m, float a) { return (a > m || a != a) ? a : m; }

__device__ __forceinline__ float fp8_row_scale(float amax) { return amax == 0.f ? 1.f : __fdiv_rn(amax, 448.f); }

#if FUSEDENC_HAS_FP8_GEMM
__device__ __forceinline__ gpu_fp8_e4m3 fp8_code(float x, float scale) { return gpu_to_e4m3(__fdiv_rn(x, scale)); }
#endif

}  // namespace fusedenc
