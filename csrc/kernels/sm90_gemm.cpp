// Dispatch for sm90_gemm.h: which (dtype, activation) kernels this build holds, and
// whether a call can use them.  Host code only, compiled on every build; the
// kernels themselves (sm90_gemm_impl.cuh) exist only where CMake found CUTLASS.
#include "sm90_gemm.h"

#include "bias_activation.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace fusedenc {

#ifdef FUSEDENC_HAVE_SM90_GEMM
// Keep in step with FUSEDENC_SM90_GEMM_INSTANCES in CMakeLists.txt (a missing
// unit is a link error, not a silent gap): per dtype, the norm kernel in three tile
// configurations (pick_norm: no activation, every activation chosen at run time, and the
// wide tile with no activation), the two GELU units, the residual kernel and the FP8 kernel.
#define FUSEDENC_SM90_DTYPES(X) X(f16) X(bf16)
namespace sm90 {
#define FUSEDENC_DECLARE(D)                                                     \
  bool norm_##D(const GemmArgs& g, const NormFold& f, int sm_count);           \
  bool norm_act_##D(const GemmArgs& g, const NormFold& f, int sm_count);       \
  bool norm_wide_##D(const GemmArgs& g, const NormFold& f, int sm_count);      \
  bool residual_##D(const GemmArgs& g, const ResidualNorm& r, int sm_count);   \
  bool fp8_##D(const GemmArgs& g, const Fp8Vectors& v, int sm_count);
FUSEDENC_SM90_DTYPES(FUSEDENC_DECLARE)
#undef FUSEDENC_DECLARE
// fp16 only: e4m3 output (FFN1 writing FFN2's input in the FP8 mode), and the FP8 residual
// kernel of the FP8 mode with LayerNorms folded.
bool fp8out_f16(const GemmArgs& g, const Fp8Vectors& v, int sm_count);
bool fp8residual_f16(const GemmArgs& g, const float* w_scale, const ResidualNorm& r, const Fp8Codes& codes,
                     int sm_count);
// fp16 only: the e4m3-output kernel with exact GELU fixed at compile time (the FP8 fold of
// BERT-family FFN1s: its codes feed FFN2, so no pass could apply GELU after it).
bool fp8out_gelu_f16(const GemmArgs& g, const Fp8Vectors& v, int sm_count);
// fp16 only: the activation tile with swish and with mish fixed at compile time (the Lc0
// nets' FFN activations; bf16 runs them in the run-time switch of norm_act).
bool norm_swish_f16(const GemmArgs& g, const NormFold& f, int sm_count);
bool norm_mish_f16(const GemmArgs& g, const NormFold& f, int sm_count);
// Both dtypes: the activation tile with exact GELU and with tanh-GELU fixed at compile time
// (BERT-family FFN1s; never in the run-time switch, whose other cases they would slow down).
#define FUSEDENC_DECLARE_GELU(D)                                                \
  bool norm_gelu_##D(const GemmArgs& g, const NormFold& f, int sm_count);      \
  bool norm_gelutanh_##D(const GemmArgs& g, const NormFold& f, int sm_count);
FUSEDENC_SM90_DTYPES(FUSEDENC_DECLARE_GELU)
#undef FUSEDENC_DECLARE_GELU
}  // namespace sm90
#endif

namespace {

using NormFn = bool (*)(const GemmArgs&, const NormFold&, int);
using ResidualFn = bool (*)(const GemmArgs&, const ResidualNorm&, int);
using Fp8Fn = bool (*)(const GemmArgs&, const Fp8Vectors&, int);
using Fp8ResidualFn = bool (*)(const GemmArgs&, const float*, const ResidualNorm&, const Fp8Codes&, int);

// The kernels this build holds for a dtype (all null: none).  norm_act and the fp8 kernels
// take the activation as an argument, the other norm kernels have theirs compiled in (so
// only pick_norm chooses among them); for fp8 the dtype is the output's.
struct Kernels {
  NormFn norm = nullptr;       // no activation (QKV, compress): compiled without one
  NormFn norm_act = nullptr;   // with an activation in the epilogue (FFN1), chosen at run time
  NormFn norm_wide = nullptr;  // no activation, long main loop (see pick_norm)
  NormFn norm_swish = nullptr; // norm_act's tile with swish fixed at compile time (null: norm_act)
  NormFn norm_mish = nullptr;  // and with mish
  NormFn norm_gelu = nullptr;       // and with exact GELU (null: GEMM, then the pass)
  NormFn norm_gelu_tanh = nullptr;  // and with tanh-GELU
  ResidualFn residual = nullptr;
  Fp8Fn fp8 = nullptr;
  Fp8Fn fp8out = nullptr;  // the FP8 kernel writing e4m3 (its dtype: the bias's)
  Fp8Fn fp8out_gelu = nullptr;  // and with exact GELU
  Fp8ResidualFn fp8residual = nullptr;
};

Kernels kernels_for(DType dtype) {
  Kernels k;
#ifdef FUSEDENC_HAVE_SM90_GEMM
#define FUSEDENC_CASE(D)                           \
  if (dtype == DType::D) {                         \
    k.norm = &sm90::norm_##D;                      \
    k.norm_act = &sm90::norm_act_##D;              \
    k.norm_wide = &sm90::norm_wide_##D;            \
    k.norm_gelu = &sm90::norm_gelu_##D;            \
    k.norm_gelu_tanh = &sm90::norm_gelutanh_##D;   \
    k.residual = &sm90::residual_##D;              \
    k.fp8 = &sm90::fp8_##D;                        \
  }
  FUSEDENC_SM90_DTYPES(FUSEDENC_CASE)
#undef FUSEDENC_CASE
  if (dtype == DType::f16) {
    k.norm_swish = &sm90::norm_swish_f16;
    k.norm_mish = &sm90::norm_mish_f16;
    k.fp8out = &sm90::fp8out_f16;
    k.fp8out_gelu = &sm90::fp8out_gelu_f16;
    k.fp8residual = &sm90::fp8residual_f16;
  }
#else
  (void)dtype;
#endif
  return k;
}

// A process-wide switch from the environment: "0" or "off" turns it off, "1" or "on" on,
// anything else (or unset) leaves `fallback`.
bool env_switch(const char* name, bool fallback) {
  const char* v = std::getenv(name);
  if (v && (std::strcmp(v, "0") == 0 || std::strcmp(v, "off") == 0)) return false;
  if (v && (std::strcmp(v, "1") == 0 || std::strcmp(v, "on") == 0)) return true;
  return fallback;
}

std::atomic<bool> g_enabled{env_switch("FUSEDENC_SM90_GEMM", true)};

// The GELU units are on: measured on an H200 against cuBLASLt + the pass at FFN1 of MiniLM,
// bert-base and bge-large shapes (16384 and 65536 rows) they tie at MiniLM's and take 14-21%
// off at the others (bench/NOTES.md).  FUSEDENC_SM90_GELU=0 or set_sm90_gelu_epilogue(false)
// turns them off (the A/B switch).
std::atomic<bool> g_gelu_enabled{env_switch("FUSEDENC_SM90_GELU", true)};

bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

// The activations the epilogue applies itself.  Its cost grows with the length of the
// activation's dependent arithmetic (the epilogue runs one warp per scheduler, so latency
// is not hidden): measured on an H100 at 16384 x 1024 x 1536, no activation 78 us, relu2
// 80, swish 87, mish 104, exact GELU by erfcc 150 against cuBLASLt's 81 + a ~25 us pass.  So
// tanh and selu (long tanh/expm1 chains) stay a separate pass, also after a folded GEMM; the
// two GELUs run in their own units (gelu_unit below: a cheaper rational erf, which measured
// faster than cuBLASLt + the pass; bench/NOTES.md).
static bool in_epilogue(Activation act) {
  switch (act) {
    case Activation::none:
    case Activation::relu:
    case Activation::swish:
    case Activation::mish:
    case Activation::relu2:
    case Activation::sigmoid:
      return true;
    default:
      return false;
  }
}

// The GELU unit of `k` for `act` (null: none built, or `act` is no GELU).
static NormFn gelu_kernel(const Kernels& k, Activation act) {
  if (act == Activation::gelu) return k.norm_gelu;
  if (act == Activation::gelu_tanh) return k.norm_gelu_tanh;
  return nullptr;
}

// The same where the units are switched on.  Not part of in_epilogue: sm90_gemm_compiled,
// which the FP8 fold reads as its kernels' activations, must not list activations the FP8
// kernels' run-time switch lacks.
static NormFn gelu_unit(const Kernels& k, Activation act) {
  return g_gelu_enabled.load(std::memory_order_relaxed) ? gelu_kernel(k, act) : nullptr;
}

bool sm90_gemm_compiled(DType dtype, Activation act) { return kernels_for(dtype).norm != nullptr && in_epilogue(act); }
bool sm90_gelu_epilogue_compiled(DType dtype, Activation act) { return gelu_kernel(kernels_for(dtype), act) != nullptr; }
void set_sm90_gelu_epilogue(bool on) { g_gelu_enabled.store(on); }
bool sm90_gelu_epilogue() { return g_gelu_enabled.load(); }
bool sm90_residual_gemm_compiled(DType dtype) { return kernels_for(dtype).residual != nullptr; }

void set_sm90_gemm_enabled(bool on) { g_enabled.store(on); }
bool sm90_gemm_enabled() { return g_enabled.load(); }

namespace {
// Per thread: a CUDA graph is captured by one thread, and another thread's launches keep
// the whole chip.
thread_local int t_sm_limit = 0;

// The persistent grid of a launch on `device`: every SM, or the calling thread's limit.
int launch_sms(int device) {
  const int sms = device_facts(device).sm_count;
  return t_sm_limit > 0 ? std::min(t_sm_limit, sms) : sms;
}

// Which norm kernel runs a call (bench/NOTES.md has the measurements behind each rule):
// an activation in the epilogue takes the 64 x 64-subtile kernel (for swish and mish its
// build with the activation fixed at compile time, where the build has one); no activation
// takes the cooperative 256 x 128 tile when the main loop is long (K >= 1024) and the
// problem spans many waves of those tiles (its epilogue is not overlapped, and a wave's
// tail is twice as long), else the pingpong 128 x 128 one.
NormFn pick_norm(const Kernels& k, const GemmArgs& g, int sms) {
  if (NormFn gelu = gelu_unit(k, g.act)) return gelu;
  if (g.act == Activation::swish && k.norm_swish) return k.norm_swish;
  if (g.act == Activation::mish && k.norm_mish) return k.norm_mish;
  if (g.act != Activation::none) return k.norm_act;
  const int64_t wide_tiles = ((g.m + 255) / 256) * ((g.n + 127) / 128);
  if (g.k >= 1024 && wide_tiles >= 4 * int64_t{sms}) return k.norm_wide;
  return k.norm;
}
}  // namespace

void set_sm90_sm_limit(int n) {
  if (n < 0) throw std::invalid_argument("fusedenc: the SM limit must be >= 0 (0: all SMs)");
  t_sm_limit = n;
}
int sm90_sm_limit() { return t_sm_limit; }

namespace {

// The rules every form shares (the kernel's existence is the caller's check).  The
// occupancy rule is a speed rule for the plain form only: the folded forms have no
// cuBLASLt twin, so they run whenever they can.
bool shape_fits(const GemmArgs& g, const char** why, bool check_occupancy) {
  auto no = [&](const char* reason) {
    if (why) *why = reason;
    return false;
  };
  if (!g_enabled.load(std::memory_order_relaxed)) return no("switched off");
  const int64_t per_vec = 16 / dtype_size(g.dtype);
  if (g.k % per_vec || g.n % per_vec || g.lda % per_vec || g.ldw % per_vec || g.ldd % per_vec ||
      (g.c && g.ldc % per_vec))
    return no("k, n or a row stride not a multiple of 16 bytes");
  if (!aligned(g.a) || !aligned(g.w) || !aligned(g.d) || (g.bias && !aligned(g.bias)) || (g.c && !aligned(g.c)))
    return no("an operand not 16-byte aligned");
  if (g.m >= (int64_t{1} << 31) || g.n >= (int64_t{1} << 31) || g.k >= (int64_t{1} << 31))
    return no("a dimension of 2^31 or more");
  const DeviceFacts f = device_facts(g.device);
  // Exactly 9.0: the kernels are sm_90a code.
  if (f.cc_major != 9 || f.cc_minor != 0) return no("not a compute capability 9.0 device");
  // Output tiles are kStatsTileM x kStatsTileN; with fewer than half as many tiles as SMs the
  // persistent kernel leaves the chip idle where cuBLASLt would split K.
  const int64_t tiles = ((g.m + kStatsTileM - 1) / kStatsTileM) * ((g.n + kStatsTileN - 1) / kStatsTileN);
  // Under a thread's SM limit every size runs here: cuBLASLt's grids cannot be limited.
  if (check_occupancy && t_sm_limit == 0 && 2 * tiles < f.sm_count) return no("too few output tiles to fill the GPU");
  return true;
}

}  // namespace

namespace {

// Why an activation is better served by cuBLASLt (nullptr: the epilogue should apply it).
// `k`: the kernels of the call's dtype (a GELU unit switched on takes exact GELU; tanh-GELU
// stays with cuBLASLt's own GELU epilogue).
const char* activation_stays_on_cublaslt(Activation act, bool has_bias, const Kernels& k) {
  if (act == Activation::none || native_epilogue_name(act, has_bias)) return "cuBLASLt fuses this activation itself";
  if (!in_epilogue(act) && !gelu_unit(k, act)) return "this activation is faster as cuBLASLt's GEMM and a separate pass";
  return nullptr;
}

}  // namespace

bool sm90_gemm_applies(const GemmArgs& g, const char** why) {
  auto no = [&](const char* reason) {
    if (why) *why = reason;
    return false;
  };
  const Kernels k = kernels_for(g.dtype);
  if (!k.norm) return no("no kernel for this dtype and activation in this build");
  if (const char* reason = activation_stays_on_cublaslt(g.act, g.bias != nullptr, k)) return no(reason);
  if (g.c) return no("a residual input");
  // Measured on an H200 (fp16, FFN1 384 -> 1536 with exact GELU, the unit against cuBLASLt + the
  // pass): 19.8 against 18.7 us at 4096 rows, a tie at 16384, 119-121 against 123-126 at 32768.
  // With K this short the unit's epilogue outlasts its main loop (bench/NOTES.md), and with few
  // rows the pass's extra read is in L2.  MiniLM at 32 sentences is this case.
  if (g.act == Activation::gelu && g.k < 512 && g.m < 16384)
    return no("exact GELU with K < 512 and under 16384 rows: faster as cuBLASLt's GEMM and the pass");
  // Measured on an H100 (the Lc0 value and moves-left heads, 16384 x 768 -> 32 and 8, mish):
  // 128-wide tiles read A at a third of the bandwidth cuBLASLt's narrow tiles reach, and the
  // pass over so few columns is cheap (25 us against 32 for both heads).
  if (g.n < kStatsTileN / 2) return no("fewer than 64 output columns");
  return shape_fits(g, why, true);
}

bool sm90_gemm(const GemmArgs& g) {
  const Kernels k = kernels_for(g.dtype);
  if (!k.norm) throw std::invalid_argument("fusedenc sm90 gemm: no kernel for this dtype and activation");
  const int sms = launch_sms(g.device);
  return pick_norm(k, g, sms)(g, NormFold{}, sms);
}

namespace {

// The FP8 call as the kernels' GemmArgs (A and W hold e4m3 codes; dtype is D's).
GemmArgs fp8_as_gemm(const Fp8GemmArgs& f) {
  GemmArgs g;
  g.device = f.device; g.stream = f.stream;
  g.m = f.m; g.n = f.n; g.k = f.k;
  g.a = f.a; g.lda = f.lda; g.w = f.w; g.ldw = f.ldw;
  g.bias = f.bias; g.d = f.d; g.ldd = f.ldd;
  g.dtype = f.out_dtype; g.act = f.act;
  g.workspace = f.workspace; g.workspace_bytes = f.workspace_bytes;
  return g;
}

}  // namespace

bool sm90_fp8_gemm_compiled(DType out_dtype) { return kernels_for(out_dtype).fp8 != nullptr; }
bool sm90_fp8_e4m3_output_compiled(DType dtype) { return kernels_for(dtype).fp8out != nullptr; }
bool sm90_fp8_e4m3_gelu_compiled(DType dtype) { return kernels_for(dtype).fp8out_gelu != nullptr; }

namespace {
// The e4m3-output FP8 kernel that applies `act` (null: none built for this dtype, or its
// epilogue lacks `act`).  Both the routing question and the launch read it, so a call that
// skipped sm90_fp8_gemm_applies throws instead of running the run-time switch's identity case.
Fp8Fn fp8_e4m3_kernel(const Kernels& k, Activation act) {
  if (act == Activation::gelu) return k.fp8out_gelu;
  return in_epilogue(act) ? k.fp8out : nullptr;
}
}  // namespace

bool sm90_fp8_gemm_applies(const Fp8GemmArgs& f, const char** why) {
  auto no = [&](const char* reason) {
    if (why) *why = reason;
    return false;
  };
  const bool folded = f.shift || f.colsum;
  if (folded && (!f.shift || !f.colsum)) return no("a folded LayerNorm needs both shift and colsum");
  if (f.out_scale) {
    // e4m3 output: only this kernel writes it, for every activation its epilogue has.
    const Kernels k = kernels_for(f.out_dtype);
    if (!k.fp8out) return no("no e4m3-output FP8 kernel for this dtype in this build");
    if (!fp8_e4m3_kernel(k, f.act)) return no("an activation the kernel's epilogue does not have");
    if (f.n % 16 || f.ldd % 16 || reinterpret_cast<uintptr_t>(f.d) % 16 || reinterpret_cast<uintptr_t>(f.out_scale) % 4)
      return no("e4m3 output: n, its row stride or its address not a multiple of 16 bytes");
  } else {
    if (!kernels_for(f.out_dtype).fp8) return no("no FP8 kernel for this output dtype in this build");
    if (folded) {  // only this kernel folds: every activation its epilogue has
      if (!in_epilogue(f.act)) return no("an activation the kernel's epilogue does not have");
    } else if (const char* reason = activation_stays_on_cublaslt(f.act, f.bias != nullptr, Kernels{})) {
      return no(reason);
    }
  }
  if (!f.fast_accum) return no("accurate accumulation asked for: the kernel accumulates fast");
  // e4m3 rows: k and the operands' row strides count bytes; shape_fits checks D's (and the
  // rest: switch, pointers, sizes, device, occupancy) on the 16-bit view.
  if (f.k % 16 || f.lda % 16 || f.ldw % 16) return no("k or an operand's row stride not a multiple of 16 bytes");
  if (reinterpret_cast<uintptr_t>(f.a_scale) % 4 || reinterpret_cast<uintptr_t>(f.w_scale) % 4)
    return no("a scale vector not 4-byte aligned");
  // The folded form has no cuBLASLt twin: it runs at every size.
  return shape_fits(fp8_as_gemm(f), why, !folded);
}

namespace {
Fp8Vectors fp8_vectors(const Fp8GemmArgs& f) {
  Fp8Vectors v;
  v.a_scale = f.a_scale; v.w_scale = f.w_scale; v.shift = f.shift; v.colsum = f.colsum; v.out_scale = f.out_scale;
  return v;
}
}  // namespace

bool sm90_fp8_gemm(const Fp8GemmArgs& f) {
  DeviceGuard guard(f.device);
  const Kernels k = kernels_for(f.out_dtype);
  Fp8Fn fn = f.out_scale ? fp8_e4m3_kernel(k, f.act) : k.fp8;
  if (!fn) throw std::invalid_argument("fusedenc sm90 fp8 gemm: no kernel for this output dtype and activation");
  return fn(fp8_as_gemm(f), fp8_vectors(f), launch_sms(f.device));
}

bool sm90_fp8_residual_compiled(DType dtype) { return kernels_for(dtype).fp8residual != nullptr; }

bool sm90_fp8_residual_applies(const Fp8GemmArgs& f, const void* c, int64_t ldc, const char** why) {
  auto no = [&](const char* reason) {
    if (why) *why = reason;
    return false;
  };
  if (!kernels_for(f.out_dtype).fp8residual) return no("no FP8 residual kernel for this dtype in this build");
  if (!f.fast_accum) return no("accurate accumulation asked for: the kernel accumulates fast");
  if (f.act != Activation::none) return no("an activation: the residual kernel has none");
  if (f.a_scale || f.shift || f.colsum || f.out_scale) return no("per-row scales, a folded LayerNorm or e4m3 output");
  if (!c) return no("no residual input");
  if (f.k % 16 || f.lda % 16 || f.ldw % 16 || f.n % 16) return no("k, n or an operand's row stride not a multiple of 16 bytes");
  if (reinterpret_cast<uintptr_t>(f.w_scale) % 4) return no("a scale vector not 4-byte aligned");
  GemmArgs g = fp8_as_gemm(f);
  g.c = c;
  g.ldc = ldc;
  return shape_fits(g, why, false);
}

bool sm90_fp8_residual_gemm(const Fp8GemmArgs& f, const void* c, int64_t ldc, float alpha, const ResidualNorm& r,
                            const Fp8Codes& codes) {
  const char* why = "";
  if (!sm90_fp8_residual_applies(f, c, ldc, &why))
    throw std::invalid_argument(std::string("fusedenc sm90 fp8 residual gemm: ") + why);
  if (!f.w_scale) throw std::invalid_argument("fusedenc sm90 fp8 residual gemm: no weight scales");
  if ((r.rstd == nullptr) != (r.shift == nullptr))
    throw std::invalid_argument("fusedenc sm90 fp8 residual gemm: rstd and shift come together");
  if ((r.row_sum == nullptr) != (r.row_sumsq == nullptr))
    throw std::invalid_argument("fusedenc sm90 fp8 residual gemm: row_sum and row_sumsq come together");
  if (codes.q && (!codes.scale || !codes.inv_scale || codes.ldq < f.n || codes.ldq % 16 ||
                  reinterpret_cast<uintptr_t>(codes.q) % 16))
    throw std::invalid_argument("fusedenc sm90 fp8 residual gemm: codes need both scales and 16-byte rows");
  GemmArgs g = fp8_as_gemm(f);
  g.c = c;
  g.ldc = ldc;
  g.alpha = alpha;
  DeviceGuard guard(f.device);
  return kernels_for(f.out_dtype).fp8residual(g, f.w_scale, r, codes, launch_sms(f.device));
}

bool sm90_fold_applies(const GemmArgs& g, const char** why) {
  const bool compiled = g.c ? kernels_for(g.dtype).residual != nullptr : kernels_for(g.dtype).norm != nullptr;
  if (!compiled) {
    if (why) *why = "no kernel for this dtype in this build";
    return false;
  }
  return shape_fits(g, why, false);
}

bool sm90_norm_gemm(const GemmArgs& g, const NormFold& fold) {
  const Kernels k = kernels_for(g.dtype);
  if (!k.norm) throw std::invalid_argument("fusedenc sm90 norm gemm: no kernel for this dtype and activation");
  if (g.c) throw std::invalid_argument("fusedenc sm90 norm gemm: takes no residual");
  if ((fold.rstd == nullptr) != (fold.shift == nullptr))
    throw std::invalid_argument("fusedenc sm90 norm gemm: rstd and shift come together");
  const char* why = "";
  if (!shape_fits(g, &why, false)) throw std::invalid_argument(std::string("fusedenc sm90 norm gemm: ") + why);
  DeviceGuard guard(g.device);
  const int sms = launch_sms(g.device);
  if (in_epilogue(g.act) || gelu_unit(k, g.act)) return pick_norm(k, g, sms)(g, fold, sms);
  // The bias goes in the epilogue, the activation in the pass after it (see in_epilogue).
  GemmArgs plain = g;
  plain.act = Activation::none;
  if (!pick_norm(k, plain, sms)(plain, fold, sms)) return false;
  bias_activation(g.d, g.ldd, g.m, g.n, nullptr, g.dtype, g.act, g.stream);
  return true;
}

bool sm90_residual_gemm(const GemmArgs& g, const ResidualNorm& r) {
  ResidualFn fn = kernels_for(g.dtype).residual;
  if (!fn) throw std::invalid_argument("fusedenc sm90 residual gemm: no kernel for this dtype");
  if (!g.c) throw std::invalid_argument("fusedenc sm90 residual gemm: needs the residual input");
  if (g.act != Activation::none) throw std::invalid_argument("fusedenc sm90 residual gemm: no activation");
  if ((r.rstd == nullptr) != (r.shift == nullptr))
    throw std::invalid_argument("fusedenc sm90 residual gemm: rstd and shift come together");
  if ((r.row_sum == nullptr) != (r.row_sumsq == nullptr))
    throw std::invalid_argument("fusedenc sm90 residual gemm: row_sum and row_sumsq come together");
  const char* why = "";
  if (!shape_fits(g, &why, false)) throw std::invalid_argument(std::string("fusedenc sm90 residual gemm: ") + why);
  DeviceGuard guard(g.device);
  return fn(g, r, launch_sms(g.device));
}

}  // namespace fusedenc
