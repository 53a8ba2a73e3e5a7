// gemm: one BLASLt call for   D = act(alpha * A @ W^T + bias)
//                        or   D = alpha * A @ W^T + bias + beta * C   (C != D allowed)
// on row-major operands, fp16/bf16/fp32 inputs with fp32 accumulation.
//
// The library epilogue does the bias and activation where it can (RELU_BIAS,
// GELU_BIAS, and SWISH_BIAS_EXT on hipBLASLt); other activations get the BIAS
// epilogue plus one in-place activation kernel.  When the heuristic finds no
// algorithm for a fused epilogue, the plan falls back to the plain GEMM plus the
// bias/activation kernel and records why (fallback_events()).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common.h"

namespace fusedenc {

struct GemmArgs {
  int device = 0;
  gpuStream_t stream = nullptr;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;  // [m, k], row stride lda (the activations)
  int64_t lda = 0;
  const void* w = nullptr;  // [n, k], row stride ldw (torch Linear weight layout)
  int64_t ldw = 0;
  const void* bias = nullptr;  // [n] or null
  const void* c = nullptr;     // [m, n], row stride ldc, or null (no residual)
  int64_t ldc = 0;
  void* d = nullptr;  // [m, n], row stride ldd
  int64_t ldd = 0;
  DType dtype = DType::f16;
  Activation act = Activation::none;  // must be none when c is given
  float alpha = 1.f;
  float beta = 0.f;  // used only with c
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// Runs the GEMM on args.stream.  Returns true when this call created a plan
// that had to fall back from a fused epilogue, so the caller can report it once.
// Throws std::invalid_argument for arguments that violate the contract and
// std::runtime_error naming the library status when the library fails.
bool gemm(const GemmArgs& args);

// The library epilogue that fuses `act` (with or without bias), or nullptr when
// the library has none and the activation kernel runs after the GEMM.
const char* native_epilogue_name(Activation act, bool has_bias);

struct PlanCacheInfo {
  size_t size = 0, limit = 0;
  uint64_t hits = 0, misses = 0, evictions = 0;
};
PlanCacheInfo plan_cache_info();
void set_plan_cache_limit(size_t limit);  // at least 1
void clear_plan_cache();

struct FallbackEvent {
  std::string problem;    // shape, dtype, activation
  std::string requested;  // the fused epilogue asked for
  std::string used;       // what runs instead
  std::string reason;     // the library's answer
};
std::vector<FallbackEvent> fallback_events();

// Test hook: while set, newly planned GEMMs behave as if the heuristic had no
// algorithm for any fused epilogue, so the fallback path can be exercised on
// hardware where it would never trigger.  Plans made under it are cached apart.
void set_force_epilogue_fallback(bool on);

}  // namespace fusedenc
