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
#include "kernels/sm90_gemm.h"

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

size_t hash_gemm_key(const GemmKey& k, bool extra) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
  mix(k.device); mix(k.m); mix(k.n); mix(k.k); mix(k.lda); mix(k.ldw); mix(k.ldc); mix(k.ldd);
  mix(k.dtype); mix(k.act); mix(k.has_bias); mix(k.has_c); mix(extra);
  mix(k.align_a); mix(k.align_w); mix(k.align_c); mix(k.align_d); mix(k.workspace_bytes);
  return static_cast<size_t>(h);
}

struct GemmKeyHash {
  size_t operator()(const GemmKey& k) const { return hash_gemm_key(k, false); }
};

// The plan cache's key: the problem, and whether the test hook that forces
// the epilogue fallback was on when the plan was made.
struct PlanKey : GemmKey {
  bool force_fallback = false;

  bool operator==(const PlanKey& o) const {
    return GemmKey::operator==(o) && force_fallback == o.force_fallback;
  }
};

struct PlanKeyHash {
  size_t operator()(const PlanKey& k) const { return hash_gemm_key(k, k.force_fallback); }
};

// Plain string building, no iostreams: formatting a number through an
// ostringstream segfaulted inside libstdc++ in the GPU image's torch process
// (stream locale machinery); std::to_string does not touch it.
std::string describe(const GemmKey& k) {
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
  blasLtMatmulHeuristicResult_t heuristic{};  // the algorithm calls run
  // Every candidate (see gemm.h); kept only by the candidate cache's plans.
  std::vector<blasLtMatmulHeuristicResult_t> candidates;
  const char* epilogue_name = "";
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
// `count` > 1 also fills plan->candidates (gemm.h: candidate 0 is the
// one-algorithm query's answer, then the others of a `count` query).
std::unique_ptr<Plan> try_plan(blasLtHandle_t handle, const PlanKey& key, EpilogueChoice epilogue,
                               std::string* why, int count) {
  auto plan = std::make_unique<Plan>();
  plan->epilogue_name = epilogue.name;
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

  const BlasLtPreference pref_owner =
      make_preference(key.workspace_bytes, key.align_w, key.align_a, key.align_c, key.align_d);
  blasLtMatmulPreference_t pref = pref_owner.get();

  int found = 0;
  blasStatus_t st = blasLtMatmulAlgoGetHeuristic(handle, plan->desc, plan->layout_w, plan->layout_a,
                                                 plan->layout_c, plan->layout_d, pref, 1,
                                                 &plan->heuristic, &found);
  if (st != BLAS_STATUS_SUCCESS || found == 0) {
    *why = std::string("heuristic returned ") +
           (st != BLAS_STATUS_SUCCESS ? blasLtStatusName(st) : "no algorithm");
    return nullptr;
  }
  plan->candidates.push_back(plan->heuristic);
  if (count > 1) {
    std::vector<blasLtMatmulHeuristicResult_t> more(static_cast<size_t>(count));
    int returned = 0;
    st = blasLtMatmulAlgoGetHeuristic(handle, plan->desc, plan->layout_w, plan->layout_a,
                                      plan->layout_c, plan->layout_d, pref, count, more.data(),
                                      &returned);
    if (st == BLAS_STATUS_SUCCESS) {
      for (int i = 0; i < returned && static_cast<int>(plan->candidates.size()) < count; ++i) {
        if (!blasLtHeuristicUsable(more[i])) continue;
        if (blasLtSameAlgo(blasLtHeuristicAlgo(more[i]), blasLtHeuristicAlgo(plan->heuristic))) continue;
        plan->candidates.push_back(more[i]);
      }
    }
  }
  return plan;
}

std::atomic<bool> g_force_fallback{false};

std::mutex g_events_mu;
std::vector<FallbackEvent> g_events;

// `record` false: do not add a fallback event (candidate lists for tuning).
std::unique_ptr<Plan> make_plan(blasLtHandle_t handle, const PlanKey& key, int count, bool record) {
  const Activation act = static_cast<Activation>(key.act);
  EpilogueChoice wanted;
  Activation post_act = Activation::none;
  if (!native_epilogue(act, key.has_bias, &wanted)) {
    wanted = key.has_bias ? kBias : kDefault;
    post_act = act;
  }
  std::string why;
  if (auto plan = try_plan(handle, key, wanted, &why, count)) {
    plan->post_act = post_act;
    return plan;
  }
  if (wanted.epilogue == BLASLT_EPILOGUE_DEFAULT) {
    throw std::runtime_error(std::string(FUSEDENC_BLASLT_NAME) + ": no algorithm for " +
                             describe(key) + " (" + why + ")");
  }
  // Fall back: plain GEMM (with beta*C if any), then bias + activation kernel.
  std::string why_default;
  auto plan = try_plan(handle, key, kDefault, &why_default, count);
  if (!plan) {
    throw std::runtime_error(std::string(FUSEDENC_BLASLT_NAME) + ": no algorithm for " +
                             describe(key) + " (" + wanted.name + ": " + why +
                             "; DEFAULT: " + why_default + ")");
  }
  plan->post_act = act;
  plan->post_bias = key.has_bias;
  plan->fell_back = true;
  if (!record) return plan;
  std::lock_guard<std::mutex> lock(g_events_mu);
  if (g_events.size() < 1024) {  // bounded: a report, not a log
    g_events.push_back({describe(key), wanted.name, "DEFAULT + bias_activation kernel", why});
  }
  return plan;
}

// ---------------------------------------------------------------- choices ----

struct ChoiceEntry {
  int index = 0, count = 1;
  std::string algo, status = "not used yet";
  uint64_t plans = 0;
};

std::mutex g_choices_mu;
std::atomic<bool> g_have_choices{false};  // no lookup at all while none is installed

std::unordered_map<GemmKey, ChoiceEntry, GemmKeyHash>& choice_table() {
  static auto* table = new std::unordered_map<GemmKey, ChoiceEntry, GemmKeyHash>();
  return *table;
}

bool lookup_choice(const GemmKey& key, ChoiceEntry* out) {
  if (!g_have_choices.load(std::memory_order_acquire)) return false;
  std::lock_guard<std::mutex> lock(g_choices_mu);
  auto it = choice_table().find(key);
  if (it == choice_table().end()) return false;
  *out = it->second;
  return true;
}

// Whether a tuning file installed a library choice for this problem (the atomic
// first: no key is built while no file is installed).
bool has_choice(const GemmArgs& args) {
  if (!g_have_choices.load(std::memory_order_acquire)) return false;
  ChoiceEntry unused;
  return lookup_choice(gemm_key(args), &unused);
}

void note_choice(const GemmKey& key, const std::string& status) {
  std::lock_guard<std::mutex> lock(g_choices_mu);
  auto it = choice_table().find(key);
  if (it == choice_table().end()) return;
  it->second.status = status;
  ++it->second.plans;
}

// The plan a gemm() call runs: the heuristic's first algorithm, or the
// candidate a choice names for this key.  A choice that no longer fits (fewer
// candidates now, or a different algorithm at its index) leaves candidate 0
// running and says why in gemm_choices().
std::unique_ptr<Plan> make_cached_plan(blasLtHandle_t handle, const PlanKey& key) {
  ChoiceEntry choice;
  if (key.force_fallback || !lookup_choice(key, &choice)) {
    auto plan = make_plan(handle, key, 1, true);
    plan->candidates.clear();
    return plan;
  }
  auto plan = make_plan(handle, key, choice.count, true);
  const int have = static_cast<int>(plan->candidates.size());
  const std::string which = "candidate " + std::to_string(choice.index);
  std::string status;
  if (choice.index >= have) {
    status = "ignored: " + which + " of " + std::to_string(choice.count) +
             " requested, the heuristic now gives " + std::to_string(have) +
             "; running candidate 0";
  } else {
    const std::string now = blasLtDescribeAlgo(plan->candidates[choice.index]);
    if (!choice.algo.empty() && now != choice.algo) {
      status = "ignored: " + which + " is now [" + now + "], measured [" + choice.algo +
               "]; running candidate 0";
    } else {
      plan->heuristic = plan->candidates[choice.index];
      status = "in use: " + which + " [" + now + "]";
    }
  }
  plan->candidates.clear();
  plan->candidates.shrink_to_fit();
  note_choice(key, status);
  return plan;
}

// A bounded LRU map from PlanKey to shared plans.  Lookups hold the lock only
// for the map operation; a miss builds the plan outside it, so one thread's
// heuristic query never blocks another thread's cached call.
class PlanCache {
 public:
  std::shared_ptr<Plan> get(blasLtHandle_t handle, const PlanKey& key, bool* created) {
    *created = false;
    uint64_t generation = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = map_.find(key);
      if (it != map_.end()) {
        ++hits_;
        lru_.splice(lru_.begin(), lru_, it->second.second);
        return it->second.first;
      }
      ++misses_;
      generation = generation_;
    }
    std::shared_ptr<Plan> plan = make_cached_plan(handle, key);
    std::lock_guard<std::mutex> lock(mu_);
    // Cleared while this plan was made (e.g. a new choice): it may be stale;
    // it serves this call only.
    if (generation != generation_) {
      *created = true;
      return plan;
    }
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
    ++generation_;
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
  uint64_t generation_ = 0;  // bumped by clear()
};

PlanCache& plan_cache() {
  static PlanCache* cache = new PlanCache();  // never destroyed: see handle_for
  return *cache;
}

// Candidate lists for tuning, apart from the plan cache: (problem, count) ->
// a plan holding every candidate.  Small and short-lived: emptied when full.
class CandidateCache {
 public:
  std::shared_ptr<Plan> get(blasLtHandle_t handle, const PlanKey& key, int count) {
    const Key k{key, count};
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = map_.find(k);
      if (it != map_.end()) return it->second;
    }
    std::shared_ptr<Plan> plan = make_plan(handle, key, count, false);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(k);
    if (it != map_.end()) return it->second;
    if (map_.size() >= 64) map_.clear();
    map_.emplace(k, plan);
    return plan;
  }

 private:
  struct Key {
    PlanKey key;
    int count;
    bool operator==(const Key& o) const { return key == o.key && count == o.count; }
  };
  struct KeyHash {
    size_t operator()(const Key& k) const {
      return PlanKeyHash()(k.key) ^ (static_cast<size_t>(k.count) * 0x9e3779b97f4a7c15ull);
    }
  };
  std::mutex mu_;
  std::unordered_map<Key, std::shared_ptr<Plan>, KeyHash> map_;
};

CandidateCache& candidate_cache() {
  static CandidateCache* cache = new CandidateCache();  // never destroyed: see handle_for
  return *cache;
}

// One library handle per (device, stream), which both libraries accept (see
// vendor.h).  Handles live for the process; destroying them at exit races the
// driver's own teardown.
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

bool GemmKey::operator==(const GemmKey& o) const {
  return device == o.device && m == o.m && n == o.n && k == o.k && lda == o.lda && ldw == o.ldw &&
         ldc == o.ldc && ldd == o.ldd && dtype == o.dtype && act == o.act &&
         has_bias == o.has_bias && has_c == o.has_c && align_a == o.align_a &&
         align_w == o.align_w && align_c == o.align_c && align_d == o.align_d &&
         workspace_bytes == o.workspace_bytes;
}

GemmKey gemm_key(const GemmArgs& args) {
  const bool has_c = args.c != nullptr;
  GemmKey key;
  key.device = args.device;
  key.m = args.m; key.n = args.n; key.k = args.k;
  key.lda = args.lda; key.ldw = args.ldw; key.ldc = has_c ? args.ldc : 0; key.ldd = args.ldd;
  key.dtype = static_cast<int>(args.dtype);
  key.act = static_cast<int>(args.act);
  key.has_bias = args.bias != nullptr;
  key.has_c = has_c;
  key.align_a = alignment_bytes(args.a, args.lda, args.dtype);
  key.align_w = alignment_bytes(args.w, args.ldw, args.dtype);
  key.align_c = alignment_bytes(has_c ? args.c : args.d, has_c ? args.ldc : args.ldd, args.dtype);
  key.align_d = alignment_bytes(args.d, args.ldd, args.dtype);
  key.workspace_bytes = args.workspace_bytes;
  return key;
}

namespace {

PlanKey plan_key(const GemmArgs& args) {
  PlanKey key;
  static_cast<GemmKey&>(key) = gemm_key(args);
  key.force_fallback = g_force_fallback.load(std::memory_order_relaxed);
  return key;
}

// One launch of `plan` with `algo`: the library call, then the
// bias/activation kernel when the plan leaves work for it.
void run_plan(blasLtHandle_t handle, Plan& plan, const blasLtMatmulAlgo_t& algo,
              const GemmArgs& args) {
  const bool has_c = args.c != nullptr;
  const float alpha = args.alpha;
  const float beta = has_c ? args.beta : 0.f;
  {
    std::lock_guard<std::mutex> lock(plan.mu);
    if (plan.epilogue_reads_bias) {
      FUSEDENC_CHECK_BLAS(blasLtMatmulDescSetAttribute(plan.desc, BLASLT_MATMUL_DESC_BIAS_POINTER,
                                                       &args.bias, sizeof(args.bias)));
    }
    FUSEDENC_CHECK_BLAS(blasLtMatmul(handle, plan.desc, &alpha, args.w, plan.layout_w, args.a,
                                     plan.layout_a, &beta, has_c ? args.c : args.d, plan.layout_c,
                                     args.d, plan.layout_d, &algo, args.workspace,
                                     args.workspace_bytes, args.stream));
  }
  if (plan.post_act != Activation::none || plan.post_bias) {
    bias_activation(args.d, args.ldd, args.m, args.n, plan.post_bias ? args.bias : nullptr,
                    args.dtype, plan.post_act, args.stream);
  }
}

void check_count(int count) {
  if (count < 1 || count > kMaxGemmCandidates) {
    throw std::invalid_argument("fusedenc gemm: candidate count must be in 1.." +
                                std::to_string(kMaxGemmCandidates) + ", got " +
                                std::to_string(count));
  }
}

}  // namespace

blasLtHandle_t blaslt_handle(int device, gpuStream_t stream) { return handle_for(device, stream); }

BlasLtPreference make_preference(size_t workspace_bytes, uint32_t align_w, uint32_t align_a, uint32_t align_c,
                                 uint32_t align_d) {
  blasLtMatmulPreference_t pref = nullptr;
  FUSEDENC_CHECK_BLAS(blasLtMatmulPreferenceCreate(&pref));
  BlasLtPreference owner(pref, blasLtMatmulPreferenceDestroy);
  const uint64_t ws = workspace_bytes;
  FUSEDENC_CHECK_BLAS(blasLtMatmulPreferenceSetAttribute(pref, BLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  FUSEDENC_CHECK_BLAS(blasLtSetAlignmentPreferences(pref, align_w, align_a, align_c, align_d));
  return owner;
}

bool gemm(const GemmArgs& args) {
  check_args(args);
  if (args.m == 0) return false;
  DeviceGuard guard(args.device);
  // An activation cuBLASLt cannot fuse: the Hopper kernel applies it in its own
  // epilogue instead of a second pass (unless the fallback is forced for a test,
  // or a tuning file measured a library candidate faster for this problem).
  if (!g_force_fallback.load(std::memory_order_relaxed) && sm90_gemm_applies(args) &&
      !has_choice(args) && sm90_gemm(args)) {
    return false;
  }
  blasLtHandle_t handle = handle_for(args.device, args.stream);
  bool created = false;
  std::shared_ptr<Plan> plan = plan_cache().get(handle, plan_key(args), &created);
  run_plan(handle, *plan, blasLtHeuristicAlgo(plan->heuristic), args);
  return created && plan->fell_back;
}

GemmCandidates gemm_candidates(const GemmArgs& args, int count) {
  check_args(args);
  check_count(count);
  if (args.m == 0) throw std::invalid_argument("fusedenc gemm: candidates need m > 0");
  DeviceGuard guard(args.device);
  blasLtHandle_t handle = handle_for(args.device, args.stream);
  const PlanKey key = plan_key(args);
  std::shared_ptr<Plan> plan = candidate_cache().get(handle, key, count);
  GemmCandidates out;
  out.key = key;
  out.epilogue = plan->epilogue_name;
  out.fell_back = plan->fell_back;
  for (const auto& r : plan->candidates) {
    out.candidates.push_back({blasLtDescribeAlgo(r), blasLtHeuristicWorkspaceBytes(r), blasLtHeuristicWaves(r)});
  }
  return out;
}

void gemm_with_candidate(const GemmArgs& args, int count, int index) {
  check_args(args);
  check_count(count);
  if (args.m == 0) return;
  DeviceGuard guard(args.device);
  blasLtHandle_t handle = handle_for(args.device, args.stream);
  std::shared_ptr<Plan> plan = candidate_cache().get(handle, plan_key(args), count);
  if (index < 0 || index >= static_cast<int>(plan->candidates.size())) {
    throw std::invalid_argument("fusedenc gemm: candidate index " + std::to_string(index) +
                                " out of range: " + std::to_string(plan->candidates.size()) +
                                " candidates for " + describe(plan_key(args)));
  }
  run_plan(handle, *plan, blasLtHeuristicAlgo(plan->candidates[index]), args);
}

void set_gemm_choice(const GemmKey& key, int index, int count, const std::string& algo) {
  check_count(count);
  if (index < 0 || index >= count) {
    throw std::invalid_argument("fusedenc gemm: choice index " + std::to_string(index) +
                                " must be in 0.." + std::to_string(count - 1));
  }
  {
    std::lock_guard<std::mutex> lock(g_choices_mu);
    ChoiceEntry entry;
    entry.index = index;
    entry.count = count;
    entry.algo = algo;
    choice_table()[key] = entry;
    g_have_choices.store(true, std::memory_order_release);
  }
  plan_cache().clear();
}

void clear_gemm_choices() {
  {
    std::lock_guard<std::mutex> lock(g_choices_mu);
    choice_table().clear();
    g_have_choices.store(false, std::memory_order_release);
  }
  plan_cache().clear();
}

std::vector<GemmChoice> gemm_choices() {
  std::lock_guard<std::mutex> lock(g_choices_mu);
  std::vector<GemmChoice> out;
  for (const auto& kv : choice_table()) {
    GemmChoice c;
    c.key = kv.first;
    c.index = kv.second.index;
    c.count = kv.second.count;
    c.algo = kv.second.algo;
    c.status = kv.second.status;
    c.plans = kv.second.plans;
    out.push_back(c);
  }
  return out;
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
