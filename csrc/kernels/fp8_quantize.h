// fp8_quantize: rows of a [rows, k] fp16/bf16/fp32 matrix in float8 e4m3 with one
// fp32 scale per row, the activation side of fusedenc's FP8 GEMM (fp8.py holds the
// reference math, which this kernel matches bit for bit):
//
//   scale = amax(|row|) / max   (1 for a row of zeros; NaN or inf in a row propagate;
//                                max 448 for OCP e4m3, 240 for MI300's FNUZ e4m3)
//   q     = e4m3(row / scale)   (IEEE division, round to nearest even, saturating)
//
// Builds with FP8 GEMMs only (vendor.h's FUSEDENC_HAS_FP8_GEMM).
#pragma once

#include <cstdint>

#include "../common.h"
#include "fp8_convert.h"

namespace fusedenc {

struct Fp8QuantizeArgs {
  int64_t rows = 0, k = 0;
  const void* x = nullptr;  // [rows, k], row stride ldx elements
  int64_t ldx = 0;
  DType dtype = DType::f16;
  uint8_t* q = nullptr;  // [rows, k] e4m3 codes, row stride ldq
  int64_t ldq = 0;
  float* scale = nullptr;  // [rows]
  Fp8Format format = Fp8Format::e4m3fn;  // the device's flavour (fp8_gemm.h's fp8_format)
};

// Checks the arguments (throws std::invalid_argument), then launches on `stream`.
void fp8_quantize_rows(const Fp8QuantizeArgs& args, gpuStream_t stream);

}  // namespace fusedenc
