// gemm: one BLASLt call for   D = act(alpha * A @ W^T + bias)
//                        or   D = alpha * A @ W^T + bias + beta * C   (C != D allowed)
// on row-major operands, fp16/bf16/fp32 inputs with fp32 accumulation.
//
// The library epilogue does the bias and activation where it can (RELU_BIAS,
// GELU_BIAS, and SWISH_BIAS where vendor.h says the library has it); other
// activations get the BIAS epilogue plus one in-place activation kernel.  When
// the heuristic finds no algorithm for a fused epilogue, the plan falls back to
// the plain GEMM plus the bias/activation kernel and records why
// (fallback_events()).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
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

// The core's library handle for (device, stream): one per pair, for the process.
blasLtHandle_t blaslt_handle(int device, gpuStream_t stream);

// A heuristic preference owning its library object: the workspace limit and the
// operands' real alignments (bytes), as every plan (16-bit and FP8) asks for them.
using BlasLtPreference =
    std::unique_ptr<std::remove_pointer_t<blasLtMatmulPreference_t>, blasStatus_t (*)(blasLtMatmulPreference_t)>;
BlasLtPreference make_preference(size_t workspace_bytes, uint32_t align_w, uint32_t align_a, uint32_t align_c,
                                 uint32_t align_d);

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

// ------------------------------------------ algorithm choice by measurement --
//
// By default a plan runs the heuristic's first algorithm.  A *choice* names,
// for one problem (GemmKey), candidate `index` of the list the heuristic
// gives when asked for `count` algorithms; plans made while a choice exists
// for their key run that candidate.  Candidate lists are built the same way
// everywhere: candidate 0 is the algorithm the default plan runs (a query for
// one algorithm), followed by the other successful results of a query for
// `count`, in the library's order, at most `count` in all.  When the library
// fell back from a fused epilogue, the list is that of the plan that runs
// (plain GEMM + bias/activation kernel).

// What a plan depends on, without pointers: the device, sizes, leading
// dimensions, dtype, activation, bias/residual presence, the operands'
// alignments (bytes, at most 16) and the workspace size.  ldc is 0 and
// align_c is D's alignment when there is no residual.
struct GemmKey {
  int device = 0;
  int64_t m = 0, n = 0, k = 0, lda = 0, ldw = 0, ldc = 0, ldd = 0;
  int dtype = 0, act = 0;
  bool has_bias = false, has_c = false;
  uint32_t align_a = 0, align_w = 0, align_c = 0, align_d = 0;
  size_t workspace_bytes = 0;

  bool operator==(const GemmKey& o) const;
};
GemmKey gemm_key(const GemmArgs& args);

struct GemmCandidate {
  std::string algo;  // the library's description (equal strings: same kernel configuration)
  size_t workspace_bytes = 0;
  float waves = 0.f;
};

struct GemmCandidates {
  GemmKey key;
  std::string epilogue;  // the library epilogue the candidates run with
  bool fell_back = false;  // epilogue fallback: candidates of the plain GEMM
  std::vector<GemmCandidate> candidates;  // [0] is today's heuristic pick
};

// Up to `count` (1..kMaxGemmCandidates) candidates for the problem `args`
// describes (pointers are read for their alignment only; nothing runs).
// Candidate lists live in a small cache of their own: the plan cache and its
// counters are untouched.
constexpr int kMaxGemmCandidates = 256;
GemmCandidates gemm_candidates(const GemmArgs& args, int count);

// Runs `args` with candidate `index` of gemm_candidates(args, count), on
// args.stream, including the bias/activation kernel where the plan needs it.
// Throws std::invalid_argument when index is out of range.
void gemm_with_candidate(const GemmArgs& args, int count, int index);

struct GemmChoice {
  GemmKey key;
  int index = 0;  // candidate to run
  int count = 1;  // candidates requested when it was measured
  std::string algo;  // expected description of that candidate ("" = not checked)
  std::string status;  // "not used yet", "in use: ...", "ignored: ..." (falls back to candidate 0)
  uint64_t plans = 0;  // plans made under this choice
};

// Installs (replaces) the choice for `key`.  Clears the plan cache so the next
// call of any shape re-plans; a plan being made concurrently is not cached.
void set_gemm_choice(const GemmKey& key, int index, int count, const std::string& algo);
void clear_gemm_choices();  // also clears the plan cache
std::vector<GemmChoice> gemm_choices();

}  // namespace fusedenc
