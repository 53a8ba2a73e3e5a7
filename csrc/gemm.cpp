#include "gemm.h"

#include <atomic>
#include <cstring>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "kernels/bias_activation.h"

namespace fusedenc {
namespace {

// ------------------------------------------------------------- epilogues ----

struct EpilogueChoice {
  blasLtEpilogue_t epilogue;
  const char* name;
};

// The library epilogue that applies `act` (and the bias) itself, if any.
bool native_epilogue(Activation act, bool has_bias, EpilogueChoice* out) {
  switch (act) {
    case Activation::none:
      *out = has_bias ? EpilogueChoice{BLASLT_EPILOGUE_BIAS, "BIAS"}
                      : EpilogueChoice{BLASLT_EPILOGUE_DEFAULT, "DEFAULT"};
      return true;
    case Activation::relu:
      *out = has_bias ? EpilogueChoice{BLASLT_EPILOGUE_RELU_BIAS, "RELU_BIAS"}
                      : EpilogueChoice{BLASLT_EPILOGUE_RELU, "RELU"};
      return true;
    case Activation::gelu_tanh:  // both libraries' GELU is the tanh approximation
      *out = has_bias ? EpilogueChoice{BLASLT_EPILOGUE_GELU_BIAS, "GELU_BIAS"}
                      : EpilogueChoice{BLASLT_EPILOGUE_GELU, "GELU"};
      return true;
#if FUSEDENC_HAS_SWISH_EPILOGUE
    case Activation::swish:
      *out = has_bias ? EpilogueChoice{BLASLT_EPILOGUE_SWISH_BIAS, "SWISH_BIAS_EXT"}
                      : EpilogueChoice{BLASLT_EPILOGUE_SWISH, "SWISH_EXT"};
      return true;
#endif
    default:
      return false;
  }
}

const EpilogueChoice kDefault{BLASLT_EPILOGUE_DEFAULT, "DEFAULT"};
const EpilogueChoice kBias{BLASLT_EPILOGUE_BIAS, "BIAS"};

blasDataType_t blas_type(DType t) {
  switch (t) {
    case DType::f16: return BLAS_R_16F;
    case DType::bf16: return BLAS_R_16BF;
    case DType::f32: return BLAS_R_32F;
  }
  throw std::invalid_argument("unknown dtype");
}

// Largest power of two (capped at 16 bytes) dividing both the base pointer and
// the row pitch: the alignment every row of the operand has.
uint32_t alignment_bytes(const void* p, int64_t ld, DType t) {
  uint64_t v = reinterpret_cast<uintptr_t>(p) | static_cast<uint64_t>(ld * dtype_size(t)) | 16u;
  return static_cast<uint32_t>(v & (~v + 1));
}

// ------------------------------------------------------------------ plans ----

struct PlanKey {
  int device;
  int64_t m, n, k, lda, ldw, ldc, ldd;
  int dtype, act;
  bool has_bias, has_c, force_fallback;
  uint32_t align_a, align_w, align_c, align_d;
  size_t workspace_bytes;

  bool operator==(const PlanKey& o) const {
    return device == o.device && m == o.m && n == o.n && k == o.k && lda == o.lda &&
           ldw == o.ldw && ldc == o.ldc && ldd == o.ldd && dtype == o.dtype && act == o.act &&
           has_bias == o.has_bias && has_c == o.has_c && force_fallback == o.force_fallback &&
           align_a == o.align_a && align_w == o.align_w && align_c == o.align_c &&
           align_d == o.align_d && workspace_bytes == o.workspace_bytes;
  }
};

struct PlanKeyHash {
  size_t operator()(const PlanKey& k) const {
    uint64_t h = 1469598103934665603ull;
    auto mix = [&h](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
    mix(k.device); mix(k.m); mix(k.n); mix(k.k); mix(k.lda); mix(k.ldw); mix(k.ldc); mix(k.ldd);
    mix(k.dtype); mix(k.act); mix(k.has_bias); mix(k.has_c); mix(k.force_fallback);
    mix(k.align_a); mix(k.align_w); mix(k.align_c); mix(k.align_d); mix(k.workspace_bytes);
    return static_cast<size_t>(h);
  }
};

// Plain string building, no iostreams: formatting a number through an
// ostringstream segfaulted inside libstdc++ in the GPU image's torch process
// (stream locale machinery); std::to_string does not touch it.
std::string describe(const PlanKey& k) {
  return "m=" + std::to_string(k.m) + " n=" + std::to_string(k.n) + " k=" + std::to_string(k.k) +
         " " + dtype_name(static_cast<DType>(k.dtype)) +
         " activation=" + activation_name(static_cast<Activation>(k.act)) +
         (k.has_bias ? " bias" : "") + (k.has_c ? " residual" : "");
}

// Everything needed to launch one GEMM shape: descriptors and the algorithm.
// Immutable after construction except for the bias pointer attribute, which
// is set per call under `mu`.
struct Plan {
  blasLtMatmulDesc_t desc = nullptr;
  blasLtMatrixLayout_t layout_w = nullptr, layout_a = nullptr, layout_c = nullptr,
                       layout_d = nullptr;
  blasLtMatmulHeuristicResult_t heuristic{};
  bool epilogue_reads_bias = false;
  // Work left for the bias/activation kernel after the GEMM.
  Activation post_act = Activation::none;
  bool post_bias = false;
  bool fell_back = false;
  std::mutex mu;

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    if (desc) blasLtMatmulDescDestroy(desc);
    for (auto l : {layout_w, layout_a, layout_c, layout_d})
      if (l) blasLtMatrixLayoutDestroy(l);
  }
};

// Builds a plan for `epilogue`; returns null (and the library's answer in
// *why) when the heuristic has no algorithm for it.
std::unique_ptr<Plan> try_plan(blasLtHandle_t handle, const PlanKey& key, EpilogueChoice epilogue,
                               std::string* why) {
  auto plan = std::make_unique<Plan>();
  const blasDataType_t t = blas_type(static_cast<DType>(key.dtype));
  FUSEDENC_CHECK_BLAS(blasLtMatmulDescCreate(&plan->desc, BLAS_COMPUTE_32F, BLAS_R_32F));
  // Row-major D[m, n] = A[m, k] @ W[n, k]^T, read column-major, is
  // D^T[n, m] = W @ A^T: the library's "A" is our W (a column-major k x n
  // matrix, transposed), its "B" is our activations (k x m, as stored).
  const blasOperation_t op_t = BLAS_OP_T, op_n = BLAS_OP_N;
  FUSEDENC_CHECK_BLAS(blasLtMatmulDescSetAttribute(plan->desc, BLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)));
  FUSEDENC_CHECK_BLAS(blasLtMatmulDescSetAttribute(plan->desc, BLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n)));
  FUSEDENC_CHECK_BLAS(blasLtMatmulDescSetAttribute(plan->desc, BLASLT_MATMUL_DESC_EPILOGUE,
                                                   &epilogue.epilogue, sizeof(epilogue.epilogue)));
  plan->epilogue_reads_bias = std::strstr(epilogue.name, "BIAS") != nullptr;
  if (plan->epilogue_reads_bias) {
    const int32_t bias_type = static_cast<int32_t>(t);
    FUSEDENC_CHECK_BLAS(blasLtMatmulDescSetAttribute(plan->desc, BLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                     &bias_type, sizeof(bias_type)));
  }
  FUSEDENC_CHECK_BLAS(blasLtMatrixLayoutCreate(&plan->layout_w, t, key.k, key.n, key.ldw));
  FUSEDENC_CHECK_BLAS(blasLtMatrixLayoutCreate(&plan->layout_a, t, key.k, key.m, key.lda));
  FUSEDENC_CHECK_BLAS(blasLtMatrixLayoutCreate(&plan->layout_c, t, key.n, key.m, key.has_c ? key.ldc : key.ldd));
  FUSEDENC_CHECK_BLAS(blasLtMatrixLayoutCreate(&plan->layout_d, t, key.n, key.m, key.ldd));

  if (key.force_fallback && epilogue.epilogue != BLASLT_EPILOGUE_DEFAULT) {
    *why = "epilogue fallback forced by fusedenc.testing";
    return nullptr;
  }

  blasLtMatmulPreference_t pref = nullptr;
  FUSEDENC_CHECK_BLAS(blasLtMatmulPreferenceCreate(&pref));
  std::unique_ptr<std::remove_pointer_t<blasLtMatmulPreference_t>, blasStatus_t (*)(blasLtMatmulPreference_t)>
      pref_owner(pref, blasLtMatmulPreferenceDestroy);
  const uint64_t ws = key.workspace_bytes;
  FUSEDENC_CHECK_BLAS(blasLtMatmulPreferenceSetAttribute(pref, BLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  FUSEDENC_CHECK_BLAS(blasLtSetAlignmentPreferences(pref, key.align_w, key.align_a, key.align_c, key.align_d));

  int found = 0;
  blasStatus_t st = blasLtMatmulAlgoGetHeuristic(handle, plan->desc, plan->layout_w, plan->layout_a,
                                                 plan->layout_c, plan->layout_d, pref, 1,
                                                 &plan->heuristic, &found);
  if (st != BLAS_STATUS_SUCCESS || found == 0) {
    *why = std::string("heuristic returned ") +
           (st != BLAS_STATUS_SUCCESS ? blasLtStatusName(st) : "no algorithm");
    return nullptr;
  }
  return plan;
}

std::atomic<bool> g_force_fallback{false};

std::mutex g_events_mu;
std::vector<FallbackEvent> g_events;

std::unique_ptr<Plan> make_plan(blasLtHandle_t handle, const PlanKey& key) {
  const Activation act = static_cast<Activation>(key.act);
  EpilogueChoice wanted;
  Activation post_act = Activation::none;
  if (!native_epilogue(act, key.has_bias, &wanted)) {
    wanted = key.has_bias ? kBias : kDefault;
    post_act = act;
  }
  std::string why;
  if (auto plan = try_plan(handle, key, wanted, &why)) {
    plan->post_act = post_act;
    return plan;
  }
  if (wanted.epilogue == BLASLT_EPILOGUE_DEFAULT) {
    throw std::runtime_error(std::string(FUSEDENC_BLASLT_NAME) + ": no algorithm for " +
                             describe(key) + " (" + why + ")");
  }
  // Fall back: plain GEMM (with beta*C if any), then bias + activation kernel.
  std::string why_default;
  auto plan = try_plan(handle, key, kDefault, &why_default);
  if (!plan) {
    throw std::runtime_error(std::string(FUSEDENC_BLASLT_NAME) + ": no algorithm for " +
                             describe(key) + " (" + wanted.name + ": " + why +
                             "; DEFAULT: " + why_default + ")");
  }
  plan->post_act = act;
  plan->post_bias = key.has_bias;
  plan->fell_back = true;
  std::lock_guard<std::mutex> lock(g_events_mu);
  if (g_events.size() < 1024) {  // bounded: a report, not a log
    g_events.push_back({describe(key), wanted.name, "DEFAULT + bias_activation kernel", why});
  }
  return plan;
}

// A bounded LRU map from PlanKey to shared plans.  Lookups hold the lock only
// for the map operation; a miss builds the plan outside it, so one thread's
// heuristic query never blocks another thread's cached call.
class PlanCache {
 public:
  std::shared_ptr<Plan> get(blasLtHandle_t handle, const PlanKey& key, bool* created) {
    *created = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = map_.find(key);
      if (it != map_.end()) {
        ++hits_;
        lru_.splice(lru_.begin(), lru_, it->second.second);
        return it->second.first;
      }
      ++misses_;
    }
    std::shared_ptr<Plan> plan = make_plan(handle, key);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(key);
    if (it != map_.end()) return it->second.first;  // another thread won the race
    lru_.push_front(key);
    map_.emplace(key, std::make_pair(plan, lru_.begin()));
    *created = true;
    evict_locked();
    return plan;
  }

  PlanCacheInfo info() {
    std::lock_guard<std::mutex> lock(mu_);
    return {map_.size(), limit_, hits_, misses_, evictions_};
  }
  void set_limit(size_t limit) {
    std::lock_guard<std::mutex> lock(mu_);
    limit_ = limit < 1 ? 1 : limit;
    evict_locked();
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mu_);
    map_.clear();
    lru_.clear();
  }

 private:
  void evict_locked() {
    // Plans in use elsewhere stay alive through their shared_ptr.
    while (map_.size() > limit_) {
      map_.erase(lru_.back());
      lru_.pop_back();
      ++evictions_;
    }
  }

  std::mutex mu_;
  std::list<PlanKey> lru_;
  std::unordered_map<PlanKey, std::pair<std::shared_ptr<Plan>, std::list<PlanKey>::iterator>, PlanKeyHash> map_;
  size_t limit_ = 1024;
  uint64_t hits_ = 0, misses_ = 0, evictions_ = 0;
};

PlanCache& plan_cache() {
  static PlanCache* cache = new PlanCache();  // never destroyed: see handle_for
  return *cache;
}

// One library handle per (device, stream): hipBLASLt handles must not be shared
// across streams, and cuBLASLt is happy either way.  Handles live for the
// process; destroying them at exit races the driver's own teardown.
blasLtHandle_t handle_for(int device, gpuStream_t stream) {
  static std::mutex mu;
  static auto* handles = new std::map<std::pair<int, uintptr_t>, blasLtHandle_t>();
  const auto key = std::make_pair(device, reinterpret_cast<uintptr_t>(stream));
  std::lock_guard<std::mutex> lock(mu);
  auto it = handles->find(key);
  if (it != handles->end()) return it->second;
  blasLtHandle_t h = nullptr;
  FUSEDENC_CHECK_BLAS(blasLtCreate(&h));
  handles->emplace(key, h);
  return h;
}

void check_args(const GemmArgs& g) {
  auto bad = [](const std::string& what) { throw std::invalid_argument("fusedenc gemm: " + what); };
  if (g.m < 0 || g.n <= 0 || g.k <= 0) bad("sizes must be m >= 0, n > 0, k > 0");
  if (g.lda < g.k || g.ldw < g.k || g.ldd < g.n || (g.c && g.ldc < g.n)) bad("leading dimension smaller than the row");
  if (!g.a || !g.w || !g.d) bad("null operand");
  if (g.c && g.act != Activation::none) bad("a residual cannot be combined with an activation");
  if (static_cast<int>(g.act) < 0 || static_cast<int>(g.act) >= kNumActivations) bad("unknown activation");
  if (g.workspace_bytes && !g.workspace) bad("workspace size without a workspace");
}

}  // namespace

bool gemm(const GemmArgs& args) {
  check_args(args);
  if (args.m == 0) return false;
  DeviceGuard guard(args.device);
  blasLtHandle_t handle = handle_for(args.device, args.stream);

  const bool has_c = args.c != nullptr;
  const PlanKey key{args.device, args.m, args.n, args.k, args.lda, args.ldw,
                    has_c ? args.ldc : 0, args.ldd, static_cast<int>(args.dtype),
                    static_cast<int>(args.act), args.bias != nullptr, has_c,
                    g_force_fallback.load(std::memory_order_relaxed),
                    alignment_bytes(args.a, args.lda, args.dtype),
                    alignment_bytes(args.w, args.ldw, args.dtype),
                    alignment_bytes(has_c ? args.c : args.d, has_c ? args.ldc : args.ldd, args.dtype),
                    alignment_bytes(args.d, args.ldd, args.dtype), args.workspace_bytes};
  bool created = false;
  std::shared_ptr<Plan> plan = plan_cache().get(handle, key, &created);

  const float alpha = args.alpha;
  const float beta = has_c ? args.beta : 0.f;
  {
    std::lock_guard<std::mutex> lock(plan->mu);
    if (plan->epilogue_reads_bias) {
      FUSEDENC_CHECK_BLAS(blasLtMatmulDescSetAttribute(plan->desc, BLASLT_MATMUL_DESC_BIAS_POINTER,
                                                       &args.bias, sizeof(args.bias)));
    }
    FUSEDENC_CHECK_BLAS(blasLtMatmul(handle, plan->desc, &alpha, args.w, plan->layout_w, args.a,
                                     plan->layout_a, &beta, has_c ? args.c : args.d, plan->layout_c,
                                     args.d, plan->layout_d, &plan->heuristic.algo, args.workspace,
                                     args.workspace_bytes, args.stream));
  }
  if (plan->post_act != Activation::none || plan->post_bias) {
    bias_activation(args.d, args.ldd, args.m, args.n, plan->post_bias ? args.bias : nullptr,
                    args.dtype, plan->post_act, args.stream);
  }
  return created && plan->fell_back;
}

const char* native_epilogue_name(Activation act, bool has_bias) {
  EpilogueChoice choice;
  return native_epilogue(act, has_bias, &choice) ? choice.name : nullptr;
}

PlanCacheInfo plan_cache_info() { return plan_cache().info(); }
void set_plan_cache_limit(size_t limit) { plan_cache().set_limit(limit); }
void clear_plan_cache() { plan_cache().clear(); }

std::vector<FallbackEvent> fallback_events() {
  std::lock_guard<std::mutex> lock(g_events_mu);
  return g_events;
}

void set_force_epilogue_fallback(bool on) { g_force_fallback.store(on); }

}  // namespace fusedenc
