// sm90_gemm: a Hopper GEMM with bias + any activation in its epilogue.
//
// cuBLASLt fuses only relu and (tanh-)GELU; every other activation (swish, mish,
// relu2, exact GELU) costs a separate pass over the output that reads and writes
// it once more (~10% of an Lc0 or t82 forward).  These kernels are CUTLASS 3
// warp-specialized TMA + wgmma GEMMs (persistent, pingpong schedule) whose
// epilogue adds the bias and applies the activation in fp32 (activations.cuh's
// activate_fast: the pass's formulas with hardware exp and reciprocal).  Compiled
// only when CUTLASS headers are found and sm90 is among the CUDA architectures
// (FUSEDENC_HAVE_SM90_GEMM); on every other build and device the cuBLASLt path
// runs unchanged.
//
// The same kernels fold LayerNorm into the GEMMs around it: the
// GEMM that ends a residual branch writes z = alpha * (A W^T + b) + residual and
// per-row partial sums of z and z^2 (ResidualNorm); layer_norm_stats turns those into
// rstd and shift = -mean * rstd; a GEMM that reads LN(z) then reads z itself with
// gamma folded into its weight and applies the norm in its epilogue (NormFold):
//   LN(z) W^T + b = rstd * z (W * gamma)^T + shift * colsum(W * gamma) + (W beta + b).
// The next residual LN(z) is recomputed the same way in the next ResidualNorm epilogue.
#pragma once

#include "../fp8_gemm.h"
#include "../gemm.h"

namespace fusedenc {

// The kernels' output tile: the partial statistics are one value per row for each
// kStatsTileN columns, stored [ceil(n / kStatsTileN)][round_up(m, kStatsTileM)] (fp32).
constexpr int kStatsTileM = 128;
constexpr int kStatsTileN = 128;

// Epilogue of a GEMM that reads a LayerNorm's input z instead of its output:
// D = act(rstd[m] * (A W^T)[m, n] + shift[m] * colsum[n] + bias[n]) (fp32 vectors; bias
// is args.bias, of the GEMM's dtype).  All null: D = act(alpha * A W^T + bias).
struct NormFold {
  const float* rstd = nullptr;    // [m]; null: args.alpha
  const float* shift = nullptr;   // [m], -mean * rstd; null: 0
  const float* colsum = nullptr;  // [n], column sums of the folded weight; null: 0
};

// Epilogue of a GEMM that ends a residual branch: D = alpha * (A W^T + bias) + R with
// R = (C * rstd[m] + shift[m]) * gamma[n] + beta[n], C = args.c (the previous LayerNorm
// recomputed from its input and statistics); null rstd/shift/gamma/beta: 1/0/1/0, so
// R = C.  Non-null row_sum/row_sumsq receive the partial sums of D and D^2 (fp32,
// layout above), computed from D before rounding.
struct ResidualNorm {
  const float* rstd = nullptr;
  const float* shift = nullptr;
  const void* gamma = nullptr;  // [n], the GEMM's dtype
  const void* beta = nullptr;
  float* row_sum = nullptr;
  float* row_sumsq = nullptr;
};

// The FP8 kernels' vectors (fp32; fp8_gemm.h's Fp8GemmArgs carries them): a_scale [m] (rstd
// where a LayerNorm is folded), w_scale [n], shift [m] and colsum [n] (null: 0; a folded
// LayerNorm's, as NormFold's), out_scale [n] (e4m3 output; null: 16-bit output).
struct Fp8Vectors {
  const float* a_scale = nullptr;
  const float* w_scale = nullptr;
  const float* shift = nullptr;
  const float* colsum = nullptr;
  const float* out_scale = nullptr;
};

// The FP8 residual GEMM's second output: e4m3 codes of D * inv_scale[n] (saturating), the
// next GEMM's input with static per-column scales `scale` (= 1 / inv_scale, both powers of
// two so that the epilogue's round trip through them is exact).  q null: no codes.
struct Fp8Codes {
  void* q = nullptr;  // [m, n] e4m3, row stride ldq bytes
  int64_t ldq = 0;
  const float* scale = nullptr;      // [n]
  const float* inv_scale = nullptr;  // [n]
};

// Whether this build holds the kernel for (dtype, act) with `act` in its epilogue (exact
// and tanh GELU, tanh and selu are not: a separate pass is faster in the run-time switch;
// sm90_gemm.cpp).
bool sm90_gemm_compiled(DType dtype, Activation act);

// The GELU units: the epilogue kernel with exact GELU or tanh-GELU fixed at compile time
// (both dtypes).  On unless switched off (FUSEDENC_SM90_GELU=0 or set_sm90_gelu_epilogue):
// on, a folded GEMM with either GELU applies it in its epilogue instead of running the pass
// after it, and a plain GEMM with exact GELU runs here instead of cuBLASLt + the pass
// (tanh-GELU keeps cuBLASLt's own GELU epilogue).
bool sm90_gelu_epilogue_compiled(DType dtype, Activation act);
void set_sm90_gelu_epilogue(bool on);
bool sm90_gelu_epilogue();

// Whether `args` can run on it: compiled, a compute-capability 9.0 device, no
// residual, 16-byte aligned rows and pointers, and enough output tiles to fill
// the chip (small GEMMs stay on cuBLASLt, whose split-K serves them better).
// `why` (optional) receives the reason when the answer is no.
bool sm90_gemm_applies(const GemmArgs& args, const char** why = nullptr);

// D = act(alpha * A W^T + bias) on args.stream.  Call only when sm90_gemm_applies.
// Returns false, having launched nothing, where CUTLASS refuses the problem or the
// workspace is too small: the caller then runs cuBLASLt.
bool sm90_gemm(const GemmArgs& args);

// The LayerNorm-folding forms (above).  Both check their arguments (sm90_gemm_applies'
// rules, plus: norm has no args.c; residual has args.c, act none, and rows of
// statistics when asked) and throw std::invalid_argument when they do not hold; they
// return false, having launched nothing, where CUTLASS refuses the problem.
bool sm90_norm_gemm(const GemmArgs& args, const NormFold& fold);
bool sm90_residual_gemm(const GemmArgs& args, const ResidualNorm& norm);
// Whether this build holds the residual kernel for `dtype`.
bool sm90_residual_gemm_compiled(DType dtype);
// Whether sm90_norm_gemm (args.c null) or sm90_residual_gemm (args.c set) can run
// `args`: the kernel is compiled and sm90_gemm_applies' shape and device rules hold
// (not its occupancy rule: whether folding pays at a size is the caller's decision).
bool sm90_fold_applies(const GemmArgs& args, const char** why = nullptr);

// FP8 (fp8_gemm.h): D = act(a_scale[m] * w_scale[n] * (A W^T) + bias[n]) with A and W in
// e4m3 (plus shift[m] * colsum[n] where a LayerNorm is folded: that form runs only here, for
// every activation the epilogue has, on any number of tiles), for the activations the epilogue applies (sm90_gemm_applies' rule: not none, not
// one cuBLASLt fuses, not one that runs faster as a pass) on problems that fill the GPU.
// Its main loop accumulates fast (Hopper's FP8 accumulator, as cuBLASLt's fast_accum), so
// only calls that ask for fast accumulation come here; accurate ones stay on cuBLASLt.
// With out_scale (e4m3 output) it is the only kernel that writes it: every activation its
// epilogue has (none included) and exact GELU where its unit is built, fp16 bias, n and D's
// row stride multiples of 16.
bool sm90_fp8_gemm_applies(const Fp8GemmArgs& args, const char** why = nullptr);
// Returns false, having launched nothing, where CUTLASS refuses the problem.
bool sm90_fp8_gemm(const Fp8GemmArgs& args);
bool sm90_fp8_gemm_compiled(DType out_dtype);
// Whether this build holds the e4m3-output form (out_scale) for a bias of `dtype`.
bool sm90_fp8_e4m3_output_compiled(DType dtype);
// ... and with exact GELU (not in that kernel's run-time switch: a unit of its own).
bool sm90_fp8_e4m3_gelu_compiled(DType dtype);

// The FP8 mode with LayerNorms folded (fusedenc.fp8): the residual GEMM on e4m3 operands,
// D = alpha * (w_scale[n] * (A W^T) + bias) + R with ResidualNorm's R and statistics and,
// with codes.q, D's e4m3 codes (Fp8Codes).  A's static column scales are folded into W, so
// there is no a_scale.  fp16 only, fast accumulation, n a multiple of 16.  Throws
// std::invalid_argument where the arguments break those rules (sm90_fp8_residual_applies
// says whether they hold); returns false, having launched nothing, where CUTLASS refuses.
bool sm90_fp8_residual_applies(const Fp8GemmArgs& args, const void* c, int64_t ldc, const char** why = nullptr);
bool sm90_fp8_residual_gemm(const Fp8GemmArgs& args, const void* c, int64_t ldc, float alpha, const ResidualNorm& norm,
                            const Fp8Codes& codes);
bool sm90_fp8_residual_compiled(DType dtype);

// A/B switch (fusedenc.testing / FUSEDENC_SM90_GEMM=0): off sends every GEMM to cuBLASLt.
void set_sm90_gemm_enabled(bool on);
bool sm90_gemm_enabled();

// The most SMs the calling thread's Hopper kernels use (0, the default: all): their
// persistent grids get min(n, sm_count) CTAs, and sm90_gemm_applies drops its occupancy
// rule (cuBLASLt's grids cannot be limited).  The Lc0 net (fusedenc.lc0) runs its QKV
// GEMM on all SMs but a few and smolgen's small GEMMs on those few, on another stream, so
// that both run at once.
void set_sm90_sm_limit(int n);
int sm90_sm_limit();

}  // namespace fusedenc
