// layer_norm: residual + scale + bias + LayerNorm in one pass over memory.
//
// For each of `rows` rows of `cols` elements:
//   h       = alpha * (x + x_bias) + residual          (fp32; x_bias, residual optional)
//   out     = (h - mean(h)) / sqrt(var(h) + eps) * weight + bias
//   sum_out = h rounded to the dtype                    (optional)
// Statistics and normalization use the fp32 h (not the rounded one); the
// variance is the biased one, like torch.  Each output is rounded once.
#pragma once

#include <cstdint>

#include "../common.h"

namespace fusedenc {

// Largest row length the kernel holds in registers.
constexpr int64_t kLayerNormMaxCols = 16384;

struct LayerNormArgs {
  int64_t rows = 0;           // T
  int64_t cols = 0;           // D, a multiple of 16 bytes / element size, <= kLayerNormMaxCols
  const void* x = nullptr;    // [rows, cols], row stride ldx
  int64_t ldx = 0;
  const void* residual = nullptr;  // optional, row stride ldr
  int64_t ldr = 0;
  const void* x_bias = nullptr;    // optional [cols]
  const void* weight = nullptr;    // optional [cols] (absent: 1)
  const void* bias = nullptr;      // optional [cols] (absent: 0)
  void* out = nullptr;             // [rows, cols], row stride ldo
  int64_t ldo = 0;
  void* sum_out = nullptr;         // optional, row stride lds; may be `residual` itself
  int64_t lds = 0;
  // Optional FP8 copy of `out` for the GEMMs that read it (fusedenc's FP8 mode): e4m3
  // codes of the rounded output with one fp32 scale per row, exactly what
  // fp8_quantize_rows makes of `out` (scale = amax / 448, 1 for a zero row; NaN wins),
  // written by the kernel that already holds the row, so no quantization pass runs.
  // Both or neither; CUDA builds with FP8 only (vendor.h's FUSEDENC_HAS_FP8_GEMM).
  uint8_t* q_out = nullptr;        // [rows, cols] codes, row stride ldq
  int64_t ldq = 0;
  float* q_scale = nullptr;        // [rows]
  DType dtype = DType::f16;
  float eps = 1e-5f;
  float alpha = 1.f;
};

// Checks the arguments (throws std::invalid_argument: sizes, strides that are
// not multiples of 16 bytes, pointers not 16-byte aligned, non-finite or
// negative eps, non-finite alpha), then launches asynchronously on `stream`
// (current device).  `out` must not overlap any input; `sum_out` may be exactly
// `residual` (same pointer and row stride: each element is read before the same
// thread writes it), otherwise it must not overlap anything either; nor may q_out
// and q_scale.
void layer_norm(const LayerNormArgs& args, gpuStream_t stream);

}  // namespace fusedenc
