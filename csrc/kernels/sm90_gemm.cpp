// Dispatch for sm90_gemm.h: which (dtype, activation) kernels this build holds, and
// whether a call can use them.  Host code only, compiled on every build; the
// kernels themselves (sm90_gemm_impl.cuh) exist only where CMake found CUTLASS.
#include "sm90_gemm.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace fusedenc {

#ifdef FUSEDENC_HAVE_SM90_GEMM
// Keep in step with FUSEDENC_SM90_GEMM_INSTANCES in CMakeLists.txt (a missing
// unit is a link error, not a silent gap).
#define FUSEDENC_SM90_GEMM_INSTANCES(X) \
  X(f16, swish) X(f16, mish) X(f16, relu2) X(f16, gelu) \
  X(bf16, swish) X(bf16, mish) X(bf16, relu2) X(bf16, gelu)
namespace sm90 {
#define FUSEDENC_DECLARE(D, A) bool run_##D##_##A(const GemmArgs& g, int sm_count);
FUSEDENC_SM90_GEMM_INSTANCES(FUSEDENC_DECLARE)
#undef FUSEDENC_DECLARE
}  // namespace sm90
#endif

namespace {

using RunFn = bool (*)(const GemmArgs&, int);

RunFn kernel_for(DType dtype, Activation act) {
#ifdef FUSEDENC_HAVE_SM90_GEMM
#define FUSEDENC_CASE(D, A) \
  if (dtype == DType::D && act == Activation::A) return &sm90::run_##D##_##A;
  FUSEDENC_SM90_GEMM_INSTANCES(FUSEDENC_CASE)
#undef FUSEDENC_CASE
#else
  (void)dtype;
  (void)act;
#endif
  return nullptr;
}

bool env_enabled() {
  const char* v = std::getenv("FUSEDENC_SM90_GEMM");
  return !(v && (std::strcmp(v, "0") == 0 || std::strcmp(v, "off") == 0));
}

std::atomic<bool> g_enabled{env_enabled()};

bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

bool sm90_gemm_compiled(DType dtype, Activation act) { return kernel_for(dtype, act) != nullptr; }

void set_sm90_gemm_enabled(bool on) { g_enabled.store(on); }
bool sm90_gemm_enabled() { return g_enabled.load(); }

bool sm90_gemm_applies(const GemmArgs& g, const char** why) {
  auto no = [&](const char* reason) {
    if (why) *why = reason;
    return false;
  };
  if (!kernel_for(g.dtype, g.act)) return no("no kernel for this dtype and activation in this build");
  if (!g_enabled.load(std::memory_order_relaxed)) return no("switched off");
  if (g.c) return no("a residual input");
  const int64_t per_vec = 16 / dtype_size(g.dtype);
  if (g.k % per_vec || g.n % per_vec || g.lda % per_vec || g.ldw % per_vec || g.ldd % per_vec)
    return no("k, n or a row stride not a multiple of 16 bytes");
  if (!aligned(g.a) || !aligned(g.w) || !aligned(g.d) || (g.bias && !aligned(g.bias)))
    return no("an operand not 16-byte aligned");
  if (g.m >= (int64_t{1} << 31) || g.n >= (int64_t{1} << 31) || g.k >= (int64_t{1} << 31))
    return no("a dimension of 2^31 or more");
  const DeviceFacts f = device_facts(g.device);
  // Exactly 9.0: the kernels are sm_90a code.
  if (f.cc_major != 9 || f.cc_minor != 0) return no("not a compute capability 9.0 device");
  // Output tiles are 256 x 128; with fewer than half as many tiles as SMs the
  // persistent kernel leaves the chip idle where cuBLASLt would split K.
  const int64_t tiles = ((g.m + 255) / 256) * ((g.n + 127) / 128);
  if (2 * tiles < f.sm_count) return no("too few output tiles to fill the GPU");
  return true;
}

bool sm90_gemm(const GemmArgs& g) {
  RunFn fn = kernel_for(g.dtype, g.act);
  if (!fn) throw std::invalid_argument("fusedenc sm90 gemm: no kernel for this dtype and activation");
  return fn(g, device_facts(g.device).sm_count);
}

}  // namespace fusedenc
