// bindings: the Python face of the native core.
//
// Python owns tensors, streams and memory (the BLASLt workspace included) and
// passes raw device pointers, sizes, dtypes and the stream as integers; the core
// links no libtorch and never allocates device memory, so one build serves any
// torch version and CUDA-graph capture stays safe.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common.h"
#include "gemm.h"
#include "kernels/bias_activation.h"
#include "kernels/layer_norm.h"

namespace py = pybind11;
using namespace fusedenc;

namespace {

template <typename T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

DType to_dtype(int code) {
  if (code < 0 || code > 2) throw std::invalid_argument("unknown dtype code " + std::to_string(code));
  return static_cast<DType>(code);
}

Activation to_activation(int code) {
  if (code < 0 || code >= kNumActivations)
    throw std::invalid_argument("unknown activation code " + std::to_string(code));
  return static_cast<Activation>(code);
}

bool gemm_binding(int device, uintptr_t stream, int64_t m, int64_t n, int64_t k, uintptr_t a,
                  int64_t lda, uintptr_t w, int64_t ldw, uintptr_t bias, uintptr_t c, int64_t ldc,
                  uintptr_t d, int64_t ldd, int dtype, int act, float alpha, float beta,
                  uintptr_t workspace, size_t workspace_bytes) {
  GemmArgs g;
  g.device = device;
  g.stream = reinterpret_cast<gpuStream_t>(stream);
  g.m = m; g.n = n; g.k = k;
  g.a = ptr<const void>(a); g.lda = lda;
  g.w = ptr<const void>(w); g.ldw = ldw;
  g.bias = ptr<const void>(bias);
  g.c = ptr<const void>(c); g.ldc = ldc;
  g.d = ptr<void>(d); g.ldd = ldd;
  g.dtype = to_dtype(dtype);
  g.act = to_activation(act);
  g.alpha = alpha; g.beta = beta;
  g.workspace = ptr<void>(workspace);
  g.workspace_bytes = workspace_bytes;
  py::gil_scoped_release no_gil;  // the heuristic query can take a while
  return gemm(g);
}

void bias_activation_binding(int device, uintptr_t stream, uintptr_t d, int64_t ldd, int64_t m,
                             int64_t n, uintptr_t bias, int dtype, int act) {
  DeviceGuard guard(device);
  bias_activation(ptr<void>(d), ldd, m, n, ptr<const void>(bias), to_dtype(dtype),
                  to_activation(act), reinterpret_cast<gpuStream_t>(stream));
}

void layer_norm_binding(int device, uintptr_t stream, int64_t rows, int64_t cols, uintptr_t x,
                        int64_t ldx, uintptr_t residual, int64_t ldr, uintptr_t x_bias,
                        uintptr_t weight, uintptr_t bias, uintptr_t out, int64_t ldo,
                        uintptr_t sum_out, int64_t lds, int dtype, double eps, double alpha) {
  LayerNormArgs a;
  a.rows = rows; a.cols = cols;
  a.x = ptr<const void>(x); a.ldx = ldx;
  a.residual = ptr<const void>(residual); a.ldr = ldr;
  a.x_bias = ptr<const void>(x_bias);
  a.weight = ptr<const void>(weight);
  a.bias = ptr<const void>(bias);
  a.out = ptr<void>(out); a.ldo = ldo;
  a.sum_out = ptr<void>(sum_out); a.lds = lds;
  a.dtype = to_dtype(dtype);
  a.eps = static_cast<float>(eps);
  a.alpha = static_cast<float>(alpha);
  DeviceGuard guard(device);
  layer_norm(a, reinterpret_cast<gpuStream_t>(stream));
}

py::dict native_epilogues() {
  py::dict out;
  for (int i = 0; i < kNumActivations; ++i) {
    const Activation a = static_cast<Activation>(i);
    const char* with_bias = native_epilogue_name(a, true);
    const char* without_bias = native_epilogue_name(a, false);
    py::dict entry;
    entry["bias"] = with_bias ? py::cast(std::string(with_bias)) : py::none();
    entry["no_bias"] = without_bias ? py::cast(std::string(without_bias)) : py::none();
    out[activation_name(a)] = entry;
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fusedenc native core (" FUSEDENC_VENDOR ", " FUSEDENC_BLASLT_NAME ")";
  m.attr("VENDOR") = FUSEDENC_VENDOR;
  m.attr("LIBRARY") = FUSEDENC_BLASLT_NAME;
  m.attr("HAS_SWISH_EPILOGUE") = static_cast<bool>(FUSEDENC_HAS_SWISH_EPILOGUE);

  m.def("library_version", &blasLtVersion,
        "Version of the GEMM library as major*10000 + minor*100 + patch.");
  m.def("native_epilogues", &native_epilogues,
        "Per activation: the library epilogue used with and without bias, or None.");

  m.def("gemm", &gemm_binding, py::arg("device"), py::arg("stream"), py::arg("m"), py::arg("n"),
        py::arg("k"), py::arg("a"), py::arg("lda"), py::arg("w"), py::arg("ldw"), py::arg("bias"),
        py::arg("c"), py::arg("ldc"), py::arg("d"), py::arg("ldd"), py::arg("dtype"),
        py::arg("activation"), py::arg("alpha"), py::arg("beta"), py::arg("workspace"),
        py::arg("workspace_bytes"),
        "D = act(alpha * A @ W^T + bias) or alpha * A @ W^T + bias + beta * C, row-major. "
        "Returns True when this call planned a new epilogue fallback.");
  m.def("bias_activation", &bias_activation_binding, py::arg("device"), py::arg("stream"),
        py::arg("d"), py::arg("ldd"), py::arg("m"), py::arg("n"), py::arg("bias"),
        py::arg("dtype"), py::arg("activation"), "In place: d = act(d + bias).");

  m.def("layer_norm", &layer_norm_binding, py::arg("device"), py::arg("stream"), py::arg("rows"),
        py::arg("cols"), py::arg("x"), py::arg("ldx"), py::arg("residual"), py::arg("ldr"),
        py::arg("x_bias"), py::arg("weight"), py::arg("bias"), py::arg("out"), py::arg("ldo"),
        py::arg("sum_out"), py::arg("lds"), py::arg("dtype"), py::arg("eps"), py::arg("alpha"),
        "out = LayerNorm(alpha * (x + x_bias) + residual) * weight + bias over rows of cols "
        "elements; sum_out (optional) gets the pre-norm sum. Null (0) pointers: absent.");

  m.def("plan_cache_info", [] {
    PlanCacheInfo i = plan_cache_info();
    py::dict d;
    d["size"] = i.size; d["limit"] = i.limit; d["hits"] = i.hits;
    d["misses"] = i.misses; d["evictions"] = i.evictions;
    return d;
  });
  m.def("set_plan_cache_limit", &set_plan_cache_limit, py::arg("limit"));
  m.def("clear_plan_cache", &clear_plan_cache);
  m.def("fallback_events", [] {
    py::list out;
    for (const auto& e : fallback_events()) {
      py::dict d;
      d["problem"] = e.problem; d["requested"] = e.requested;
      d["used"] = e.used; d["reason"] = e.reason;
      out.append(d);
    }
    return out;
  });
  m.def("set_force_epilogue_fallback", &set_force_epilogue_fallback, py::arg("on"));
}
