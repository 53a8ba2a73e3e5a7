// fp8_gemm: one BLASLt call for   D = act((A_q @ W_q^T) * a_scale[m] * w_scale[n] + bias)
// on row-major float8 e4m3 operands with one fp32 scale per row of each (per activation
// row, per weight output channel: the library's outer-vector scaling), fp32 accumulation,
// D in fp16 or bf16.  The reference math is fusedenc/fp8.py (scaled_linear).
//
// relu and the tanh GELU come from the library epilogue where it has them for FP8;
// other activations run the bias_activation kernel after the GEMM (as gemm.h does).
// Which libraries and GPUs run it, and in which e4m3 flavour, is vendor.h's to say
// (FUSEDENC_HAS_FP8_GEMM, gpuDeviceFp8Flavour); fp8_format() gives the flavour the operands
// are in, fp8_gemm_status() whether it runs and if not why.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common.h"
#include "kernels/fp8_convert.h"

namespace fusedenc {

struct Fp8GemmArgs {
  int device = 0;
  gpuStream_t stream = nullptr;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;  // [m, k] e4m3, row stride lda (bytes = elements)
  int64_t lda = 0;
  const float* a_scale = nullptr;  // [m]
  const void* w = nullptr;  // [n, k] e4m3, row stride ldw
  int64_t ldw = 0;
  const float* w_scale = nullptr;  // [n]
  const void* bias = nullptr;  // [n] in out_dtype, or null
  void* d = nullptr;  // [m, n] out_dtype, row stride ldd
  int64_t ldd = 0;
  // With out_scale ([n] fp32), D holds e4m3 codes instead: e4m3(out_scale[n] * act(...)),
  // saturating, row stride ldd bytes (the next GEMM's input with static per-column scales
  // folded into its weight).  Only the Hopper FP8 kernel writes them (fast_accum, an
  // activation its epilogue has, fp16 bias); sm90_fp8_gemm_applies says whether it runs.
  const float* out_scale = nullptr;
  // A LayerNorm folded in (fusedenc.fp8's folded mode): A holds e4m3 codes of the
  // un-normalized z (static column scales folded into W), a_scale holds rstd, and the
  // epilogue adds shift[m] * colsum[n] ([m], [n] fp32; both or neither).  Hopper kernel only.
  const float* shift = nullptr;
  const float* colsum = nullptr;
  DType out_dtype = DType::f16;  // f16 or bf16 (with out_scale: the bias's dtype)
  Activation act = Activation::none;
  bool fast_accum = false;  // Hopper's faster, less precise FP8 accumulation
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// The e4m3 flavour of `device` (vendor.h's gpuDeviceFp8Flavour): e4m3fnuz or e4m3fn (OCP).
// The operands of fp8_gemm and the codes fp8_quantize_rows writes are in it.
Fp8Format fp8_format(int device);
const char* fp8_format_name(Fp8Format f);  // "e4m3fn" / "e4m3fnuz": torch.float8_<name>

// Whether this build and `device` run fp8_gemm; when not, `why` says what is missing.
bool fp8_gemm_status(int device, std::string* why);

// Runs on args.stream.  Throws std::invalid_argument for arguments that break the
// contract (sizes, 16-byte rows, dtypes) and std::runtime_error when the library
// has no algorithm or fails.
void fp8_gemm(const Fp8GemmArgs& args);

void clear_fp8_plan_cache();

}  // namespace fusedenc
