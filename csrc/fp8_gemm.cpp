#include "fp8_gemm.h"

#include <memory>
#include <mutex>
#include <stdexcept>
#include <unordered_map>

#include "gemm.h"
#include "kernels/bias_activation.h"
#include "kernels/sm90_gemm.h"

namespace fusedenc {

namespace {

// Largest power of two (at most 16) dividing the base address and the row pitch.
uint32_t align_of(const void* p, int64_t row_bytes) {
  uint64_t v = reinterpret_cast<uintptr_t>(p) | static_cast<uint64_t>(row_bytes) | 16u;
  return static_cast<uint32_t>(v & (~v + 1));
}

}  // namespace

Fp8Format fp8_format(int device) {
  return device_facts(device).fp8_flavour == kGpuFp8Fnuz ? Fp8Format::e4m3fnuz : Fp8Format::e4m3fn;
}

const char* fp8_format_name(Fp8Format f) { return f == Fp8Format::e4m3fnuz ? "e4m3fnuz" : "e4m3fn"; }

bool fp8_gemm_status(int device, std::string* why) {
#if FUSEDENC_HAS_FP8_GEMM
  if (device_facts(device).fp8_flavour != kGpuFp8None) return true;
  if (why) {  // the refusal's reason: asked again (the facts keep only the answer)
    int flavour = kGpuFp8None;
    FUSEDENC_CHECK_GPU(gpuDeviceFp8Flavour(device, &flavour, why));
  }
  return false;
#else
  (void)device;
  if (why) *why = FUSEDENC_FP8_MISSING;
  return false;
#endif
}

#if FUSEDENC_HAS_FP8_GEMM
namespace {

struct Fp8Key {
  int device = 0;
  int64_t m = 0, n = 0, k = 0, lda = 0, ldw = 0, ldd = 0;
  int out_dtype = 0, act = 0;
  bool has_bias = false, fast_accum = false;
  uint32_t align_a = 0, align_w = 0, align_d = 0;
  size_t workspace_bytes = 0;
  bool operator==(const Fp8Key& o) const {
    return device == o.device && m == o.m && n == o.n && k == o.k && lda == o.lda && ldw == o.ldw &&
           ldd == o.ldd && out_dtype == o.out_dtype && act == o.act && has_bias == o.has_bias &&
           fast_accum == o.fast_accum && align_a == o.align_a && align_w == o.align_w &&
           align_d == o.align_d && workspace_bytes == o.workspace_bytes;
  }
};

struct Fp8KeyHash {
  size_t operator()(const Fp8Key& k) const {
    uint64_t h = 1469598103934665603ull;
    auto mix = [&h](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
    mix(k.device); mix(k.m); mix(k.n); mix(k.k); mix(k.lda); mix(k.ldw); mix(k.ldd);
    mix(k.out_dtype); mix(k.act); mix(k.has_bias); mix(k.fast_accum);
    mix(k.align_a); mix(k.align_w); mix(k.align_d); mix(k.workspace_bytes);
    return static_cast<size_t>(h);
  }
};

struct Fp8Plan {
  blasLtMatmulDesc_t desc = nullptr;
  blasLtMatrixLayout_t layout_w = nullptr, layout_a = nullptr, layout_d = nullptr;
  blasLtMatmulAlgo_t algo{};
  bool reads_bias = false;
  size_t workspace_bytes = 0;  // what the algorithm was chosen for: none, or the caller's
  Activation post_act = Activation::none;  // left for the bias_activation kernel
  bool post_bias = false;
  std::mutex mu;  // the scale and bias pointers live in the descriptor
  ~Fp8Plan() {
    if (layout_d) blasLtMatrixLayoutDestroy(layout_d);
    if (layout_a) blasLtMatrixLayoutDestroy(layout_a);
    if (layout_w) blasLtMatrixLayoutDestroy(layout_w);
    if (desc) blasLtMatmulDescDestroy(desc);
  }
};

struct Epilogue {
  blasLtEpilogue_t value;
  bool reads_bias;
  Activation post_act;
  bool post_bias;
};

// What to ask the library for, best first: the fused activation where the library
// has one, then BIAS + the activation kernel, then the plain GEMM + bias and activation.
std::vector<Epilogue> epilogues(Activation act, bool has_bias) {
  std::vector<Epilogue> out;
  if (act == Activation::relu) {
    out.push_back({has_bias ? BLASLT_EPILOGUE_RELU_BIAS : BLASLT_EPILOGUE_RELU, has_bias, Activation::none, false});
  } else if (act == Activation::gelu_tanh) {
    out.push_back({has_bias ? BLASLT_EPILOGUE_GELU_BIAS : BLASLT_EPILOGUE_GELU, has_bias, Activation::none, false});
  }
  if (has_bias) out.push_back({BLASLT_EPILOGUE_BIAS, true, act, false});
  out.push_back({BLASLT_EPILOGUE_DEFAULT, false, act, has_bias});
  return out;
}

// The heuristic answers "no algorithm" for outer-vector scales unless the scale (and
// bias) pointers are set, so the first call's pointers go into the descriptor here;
// every call sets its own before it runs.
void set_pointers(blasLtMatmulDesc_t desc, const Fp8GemmArgs& g, bool reads_bias) {
  FUSEDENC_CHECK_BLAS(blasLtMatmulDescSetAttribute(desc, BLASLT_MATMUL_DESC_A_SCALE_POINTER, &g.w_scale, sizeof(g.w_scale)));
  FUSEDENC_CHECK_BLAS(blasLtMatmulDescSetAttribute(desc, BLASLT_MATMUL_DESC_B_SCALE_POINTER, &g.a_scale, sizeof(g.a_scale)));
  if (reads_bias) {
    FUSEDENC_CHECK_BLAS(blasLtMatmulDescSetAttribute(desc, BLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof(g.bias)));
  }
}

std::unique_ptr<Fp8Plan> try_plan(blasLtHandle_t handle, const Fp8Key& key, const Epilogue& epi,
                                  const Fp8GemmArgs& g) {
  auto plan = std::make_unique<Fp8Plan>();
  const blasDataType_t out_t = key.out_dtype == static_cast<int>(DType::bf16) ? BLAS_R_16BF : BLAS_R_16F;
  FUSEDENC_CHECK_BLAS(blasLtMatmulDescCreate(&plan->desc, BLAS_COMPUTE_32F, BLAS_R_32F));
  // The library's column-major view: its A is our weight [n, k] read transposed ("TN",
  // the layout FP8 needs), its B our activations; its A scale is per output channel,
  // its B scale per activation row.
  const blasOperation_t op_t = BLAS_OP_T, op_n = BLAS_OP_N;
  FUSEDENC_CHECK_BLAS(blasLtMatmulDescSetAttribute(plan->desc, BLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)));
  FUSEDENC_CHECK_BLAS(blasLtMatmulDescSetAttribute(plan->desc, BLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n)));
  FUSEDENC_CHECK_BLAS(blasLtSetOuterVectorScales(plan->desc));  // per-row / per-channel, not per-tensor
  FUSEDENC_CHECK_BLAS(blasLtSetFastAccum(plan->desc, key.fast_accum ? 1 : 0));  // a no-op where the library has no switch (vendor.h)
  FUSEDENC_CHECK_BLAS(blasLtMatmulDescSetAttribute(plan->desc, BLASLT_MATMUL_DESC_EPILOGUE, &epi.value, sizeof(epi.value)));
  if (epi.reads_bias) {
    const int32_t bias_t = static_cast<int32_t>(out_t);
    FUSEDENC_CHECK_BLAS(blasLtMatmulDescSetAttribute(plan->desc, BLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_t, sizeof(bias_t)));
  }
  set_pointers(plan->desc, g, epi.reads_bias);
  const blasDataType_t fp8_t = blasLtFp8Type(device_facts(key.device).fp8_flavour);  // the device is in the key
  FUSEDENC_CHECK_BLAS(blasLtMatrixLayoutCreate(&plan->layout_w, fp8_t, key.k, key.n, key.ldw));
  FUSEDENC_CHECK_BLAS(blasLtMatrixLayoutCreate(&plan->layout_a, fp8_t, key.k, key.m, key.lda));
  FUSEDENC_CHECK_BLAS(blasLtMatrixLayoutCreate(&plan->layout_d, out_t, key.n, key.m, key.ldd));

  // An algorithm that needs no workspace first: the library's FP8 kernels that take one are
  // preceded by a memset of it, and in a captured graph the memset and the dependency gap after
  // it cost ~4 us a GEMM, more than the workspace-free kernels lose (H100, static FP8 t82 /
  // bt4 stacks: +2.9% / +2.2% positions/s at 256 positions, +0.6% at 1024; bench/NOTES.md).
  blasLtMatmulHeuristicResult_t result{};
  int found = 0;
  for (const size_t ws : {size_t{0}, key.workspace_bytes}) {
    const BlasLtPreference pref = make_preference(ws, key.align_w, key.align_a, key.align_d, key.align_d);
    const blasStatus_t st = blasLtMatmulAlgoGetHeuristic(handle, plan->desc, plan->layout_w, plan->layout_a,
                                                         plan->layout_d, plan->layout_d, pref.get(), 1, &result, &found);
    if (st == BLAS_STATUS_SUCCESS && found > 0) {
      plan->workspace_bytes = ws;
      break;
    }
    if (ws == key.workspace_bytes) return nullptr;
  }
  plan->algo = result.algo;
  plan->reads_bias = epi.reads_bias;
  plan->post_act = epi.post_act;
  plan->post_bias = epi.post_bias;
  return plan;
}

std::shared_ptr<Fp8Plan> make_plan(blasLtHandle_t handle, const Fp8Key& key, const Fp8GemmArgs& g) {
  for (const Epilogue& epi : epilogues(static_cast<Activation>(key.act), key.has_bias)) {
    if (auto plan = try_plan(handle, key, epi, g)) return std::shared_ptr<Fp8Plan>(std::move(plan));
  }
  throw std::runtime_error(std::string("fusedenc fp8_gemm: ") + FUSEDENC_BLASLT_NAME +
                           " has no FP8 algorithm with per-row scales for m=" + std::to_string(key.m) +
                           " n=" + std::to_string(key.n) + " k=" + std::to_string(key.k));
}

std::mutex g_plans_mu;
std::unordered_map<Fp8Key, std::shared_ptr<Fp8Plan>, Fp8KeyHash>& plans() {
  static auto* map = new std::unordered_map<Fp8Key, std::shared_ptr<Fp8Plan>, Fp8KeyHash>();  // see handle_for
  return *map;
}

}  // namespace
#endif

void clear_fp8_plan_cache() {
#if FUSEDENC_HAS_FP8_GEMM
  std::lock_guard<std::mutex> lock(g_plans_mu);
  plans().clear();
#endif
}

void fp8_gemm(const Fp8GemmArgs& g) {
  auto bad = [](const std::string& what) { throw std::invalid_argument("fusedenc fp8_gemm: " + what); };
  if (g.m < 0 || g.n <= 0 || g.k <= 0) bad("sizes must be m >= 0, n > 0, k > 0");
  if (g.k % 16 || g.lda % 16 || g.ldw % 16) bad("k and the operands' row strides must be multiples of 16 (16-byte FP8 rows)");
  if (g.lda < g.k || g.ldw < g.k || g.ldd < g.n) bad("leading dimension smaller than the row");
  if (g.out_dtype != DType::f16 && g.out_dtype != DType::bf16) bad("the output (or, with out_scale, the bias) must be float16 or bfloat16");
  if (static_cast<int>(g.act) < 0 || static_cast<int>(g.act) >= kNumActivations) bad("unknown activation");
  if (g.workspace_bytes && !g.workspace) bad("workspace size without a workspace");
  if (g.m == 0) return;
  if (!g.a || !g.w || !g.d || !g.a_scale || !g.w_scale) bad("null operand or scale");
  if (align_of(g.a, g.lda) < 16 || align_of(g.w, g.ldw) < 16) bad("FP8 operands must start on 16-byte boundaries");
  std::string why;
  if (!fp8_gemm_status(g.device, &why)) throw std::runtime_error("fusedenc fp8_gemm: " + why);
#if FUSEDENC_HAS_FP8_GEMM
  if (g.out_scale || g.shift || g.colsum) {  // the Hopper kernel or nothing (fusedenc.fp8 asks first)
    const char* what = g.out_scale ? "e4m3 output" : "a folded LayerNorm";
    const char* no = "";
    if (!sm90_fp8_gemm_applies(g, &no)) bad(std::string(what) + " does not run here: " + no);
    if (!sm90_fp8_gemm(g)) bad(std::string(what) + ": CUTLASS refused the problem");
    return;
  }
  // An activation the library cannot fuse: the Hopper kernel applies it in its epilogue
  // instead of a pass over the output (as gemm() does for 16-bit GEMMs).
  if (sm90_fp8_gemm_applies(g) && sm90_fp8_gemm(g)) return;
  DeviceGuard guard(g.device);
  Fp8Key key;
  key.device = g.device;
  key.m = g.m; key.n = g.n; key.k = g.k; key.lda = g.lda; key.ldw = g.ldw; key.ldd = g.ldd;
  key.out_dtype = static_cast<int>(g.out_dtype);
  key.act = static_cast<int>(g.act);
  key.has_bias = g.bias != nullptr;
  key.fast_accum = g.fast_accum;
  key.align_a = align_of(g.a, g.lda);
  key.align_w = align_of(g.w, g.ldw);
  key.align_d = align_of(g.d, g.ldd * dtype_size(g.out_dtype));
  key.workspace_bytes = g.workspace_bytes;
  blasLtHandle_t handle = blaslt_handle(g.device, g.stream);
  std::shared_ptr<Fp8Plan> plan;
  {
    std::lock_guard<std::mutex> lock(g_plans_mu);
    auto it = plans().find(key);
    if (it != plans().end()) plan = it->second;
  }
  if (!plan) {
    plan = make_plan(handle, key, g);
    std::lock_guard<std::mutex> lock(g_plans_mu);
    if (plans().size() >= 256) plans().clear();  // bounded: shapes are few in practice
    plans().emplace(key, plan);
  }
  const float one = 1.f, zero = 0.f;
  {
    std::lock_guard<std::mutex> lock(plan->mu);
    set_pointers(plan->desc, g, plan->reads_bias);
    FUSEDENC_CHECK_BLAS(blasLtMatmul(handle, plan->desc, &one, g.w, plan->layout_w, g.a, plan->layout_a, &zero,
                                     g.d, plan->layout_d, g.d, plan->layout_d, &plan->algo,
                                     plan->workspace_bytes ? g.workspace : nullptr, plan->workspace_bytes, g.stream));
  }
  if (plan->post_act != Activation::none || plan->post_bias) {
    bias_activation(g.d, g.ldd, g.m, g.n, plan->post_bias ? g.bias : nullptr, g.out_dtype, plan->post_act, g.stream);
  }
#endif
}

}  // namespace fusedenc
