// bindings: the Python face of the native core.
//
// Python owns tensors, streams and memory (the BLASLt workspace included) and
// passes raw device pointers, sizes, dtypes and the stream as integers; the core
// links no libtorch and never allocates device memory, so one build serves any
// torch version and CUDA-graph capture stays safe.
#include <array>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common.h"
#include "gemm.h"
#include "kernels/sm90_gemm.h"
#include "kernels/bias_activation.h"
#include "kernels/layer_norm.h"
#include "kernels/norm_stats.h"
#include "kernels/fp8_quantize.h"
#include "fp8_gemm.h"

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

GemmArgs gemm_args(int device, uintptr_t stream, int64_t m, int64_t n, int64_t k, uintptr_t a,
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
  return g;
}

// The residual GEMMs' pending LayerNorm and statistics outputs (sm90_gemm.h), from addresses.
ResidualNorm residual_norm(uintptr_t rstd, uintptr_t shift, uintptr_t gamma, uintptr_t beta, uintptr_t row_sum,
                           uintptr_t row_sumsq) {
  ResidualNorm r;
  r.rstd = ptr<const float>(rstd);
  r.shift = ptr<const float>(shift);
  r.gamma = ptr<const void>(gamma);
  r.beta = ptr<const void>(beta);
  r.row_sum = ptr<float>(row_sum);
  r.row_sumsq = ptr<float>(row_sumsq);
  return r;
}

bool gemm_binding(int device, uintptr_t stream, int64_t m, int64_t n, int64_t k, uintptr_t a,
                  int64_t lda, uintptr_t w, int64_t ldw, uintptr_t bias, uintptr_t c, int64_t ldc,
                  uintptr_t d, int64_t ldd, int dtype, int act, float alpha, float beta,
                  uintptr_t workspace, size_t workspace_bytes) {
  GemmArgs g = gemm_args(device, stream, m, n, k, a, lda, w, ldw, bias, c, ldc, d, ldd, dtype, act,
                         alpha, beta, workspace, workspace_bytes);
  py::gil_scoped_release no_gil;  // the heuristic query can take a while
  return gemm(g);
}

py::dict key_dict(const GemmKey& k) {
  py::dict d;
  d["device"] = k.device;
  d["m"] = k.m; d["n"] = k.n; d["k"] = k.k;
  d["lda"] = k.lda; d["ldw"] = k.ldw; d["ldc"] = k.ldc; d["ldd"] = k.ldd;
  d["dtype"] = k.dtype; d["activation"] = k.act;
  d["has_bias"] = k.has_bias; d["has_residual"] = k.has_c;
  d["align_a"] = k.align_a; d["align_w"] = k.align_w; d["align_c"] = k.align_c;
  d["align_d"] = k.align_d;
  d["workspace_bytes"] = k.workspace_bytes;
  return d;
}

py::dict gemm_candidates_binding(int device, uintptr_t stream, int64_t m, int64_t n, int64_t k,
                                 uintptr_t a, int64_t lda, uintptr_t w, int64_t ldw,
                                 uintptr_t bias, uintptr_t c, int64_t ldc, uintptr_t d,
                                 int64_t ldd, int dtype, int act, float alpha, float beta,
                                 uintptr_t workspace, size_t workspace_bytes, int count) {
  GemmArgs g = gemm_args(device, stream, m, n, k, a, lda, w, ldw, bias, c, ldc, d, ldd, dtype, act,
                         alpha, beta, workspace, workspace_bytes);
  GemmCandidates found;
  {
    py::gil_scoped_release no_gil;
    found = gemm_candidates(g, count);
  }
  py::list candidates;
  for (const auto& cand : found.candidates) {
    py::dict e;
    e["algo"] = cand.algo;
    e["workspace_bytes"] = cand.workspace_bytes;
    e["waves"] = cand.waves;
    candidates.append(e);
  }
  py::dict out;
  out["key"] = key_dict(found.key);
  out["epilogue"] = found.epilogue;
  out["fell_back"] = found.fell_back;
  out["candidates"] = candidates;
  return out;
}

void gemm_with_candidate_binding(int device, uintptr_t stream, int64_t m, int64_t n, int64_t k,
                                 uintptr_t a, int64_t lda, uintptr_t w, int64_t ldw,
                                 uintptr_t bias, uintptr_t c, int64_t ldc, uintptr_t d,
                                 int64_t ldd, int dtype, int act, float alpha, float beta,
                                 uintptr_t workspace, size_t workspace_bytes, int count,
                                 int index) {
  GemmArgs g = gemm_args(device, stream, m, n, k, a, lda, w, ldw, bias, c, ldc, d, ldd, dtype, act,
                         alpha, beta, workspace, workspace_bytes);
  py::gil_scoped_release no_gil;
  gemm_with_candidate(g, count, index);
}

void set_gemm_choice_binding(int device, int64_t m, int64_t n, int64_t k, int64_t lda,
                             int64_t ldw, int64_t ldc, int64_t ldd, int dtype, int act,
                             bool has_bias, bool has_residual, uint32_t align_a, uint32_t align_w,
                             uint32_t align_c, uint32_t align_d, size_t workspace_bytes,
                             int index, int candidates, const std::string& algo) {
  GemmKey key;
  key.device = device;
  key.m = m; key.n = n; key.k = k;
  key.lda = lda; key.ldw = ldw; key.ldc = ldc; key.ldd = ldd;
  key.dtype = static_cast<int>(to_dtype(dtype));
  key.act = static_cast<int>(to_activation(act));
  key.has_bias = has_bias; key.has_c = has_residual;
  key.align_a = align_a; key.align_w = align_w; key.align_c = align_c; key.align_d = align_d;
  key.workspace_bytes = workspace_bytes;
  set_gemm_choice(key, index, candidates, algo);
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
                        uintptr_t sum_out, int64_t lds, int dtype, double eps, double alpha,
                        uintptr_t q_out, int64_t ldq, uintptr_t q_scale) {
  LayerNormArgs a;
  a.rows = rows; a.cols = cols;
  a.x = ptr<const void>(x); a.ldx = ldx;
  a.residual = ptr<const void>(residual); a.ldr = ldr;
  a.x_bias = ptr<const void>(x_bias);
  a.weight = ptr<const void>(weight);
  a.bias = ptr<const void>(bias);
  a.out = ptr<void>(out); a.ldo = ldo;
  a.sum_out = ptr<void>(sum_out); a.lds = lds;
  a.q_out = ptr<uint8_t>(q_out); a.ldq = ldq;
  a.q_scale = ptr<float>(q_scale);
  a.dtype = to_dtype(dtype);
  a.eps = static_cast<float>(eps);
  a.alpha = static_cast<float>(alpha);
  DeviceGuard guard(device);
  layer_norm(a, reinterpret_cast<gpuStream_t>(stream));
}

// Copies rectangular blocks (rows x width bytes, each side with its own row pitch) on `stream`,
// in order, in one call from Python: a graph's static inputs filled without a framework op per
// tensor (~10-30 us of host time each on the hosts measured, against ~2 us for the copy itself).
// The direction of each copy follows from its addresses (device or pinned host memory: UVA).
void copy_blocks(int device, uintptr_t stream, const std::vector<std::array<int64_t, 6>>& blocks) {
  for (const auto& b : blocks) {
    if (b[0] == 0 || b[2] == 0 || b[4] < 0 || b[5] < 0 || (b[5] > 1 && (b[1] < b[4] || b[3] < b[4])))
      throw std::invalid_argument("copy_blocks: a block needs two addresses, sizes >= 0 and pitches >= its width");
  }
  DeviceGuard guard(device);
  for (const auto& b : blocks) {
    if (b[4] == 0 || b[5] == 0) continue;
    const auto width = static_cast<size_t>(b[4]);
    const auto rows = static_cast<size_t>(b[5]);
    // One row: the pitches do not matter; pass the width so a dense copy is never refused.
    const auto dpitch = rows > 1 ? static_cast<size_t>(b[1]) : width;
    const auto spitch = rows > 1 ? static_cast<size_t>(b[3]) : width;
    FUSEDENC_CHECK_GPU(gpuMemcpy2DAsync(ptr<void>(static_cast<uintptr_t>(b[0])), dpitch,
                                        ptr<const void>(static_cast<uintptr_t>(b[2])), spitch, width, rows,
                                        gpuMemcpyDefault, reinterpret_cast<gpuStream_t>(stream)));
  }
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
  // Whether the Hopper CUTLASS kernels were compiled in (a build without CUTLASS's headers has none).
#if defined(FUSEDENC_HAVE_SM90_GEMM)
  m.attr("HAS_SM90_KERNELS") = true;
#else
  m.attr("HAS_SM90_KERNELS") = false;
#endif

  // The warp widths the reductions are compiled for (kernels/warp.cuh), and the test switch.
  m.attr("WARP_WIDTHS") = py::tuple(py::cast(compiled_warp_widths()));
  m.def("set_forced_warp_width", &set_forced_warp_width, py::arg("width"),
        "Run the LayerNorm and FP8-quantization reductions with `width` lanes per warp (one of "
        "WARP_WIDTHS, at most the GPU's), 0: each device's own width.  For tests.");
  m.def("forced_warp_width", [] { return forced_warp_width().load(); });
  m.def("reduction_warp_width", [](int device) {
    DeviceGuard guard(device);
    return reduction_warp_width();
  }, py::arg("device"), "Lanes per warp of the reductions launched on `device` now.");

  m.def("copy_blocks", &copy_blocks, py::arg("device"), py::arg("stream"), py::arg("blocks"),
        "Copy blocks (dst, dst_pitch, src, src_pitch, width_bytes, rows) on `stream`, in order.");
  m.def("library_version", &blasLtVersion,
        "Version of the GEMM library as major*10000 + minor*100 + patch.");
  m.def("native_epilogues", &native_epilogues,
        "Per activation: the library epilogue used with and without bias, or None.");

  m.def("sm90_gemm_kernels", [] {
    py::list out;
    for (DType d : {DType::f16, DType::bf16, DType::f32}) {
      for (int a = 0; a < kNumActivations; ++a) {
        if (sm90_gemm_compiled(d, static_cast<Activation>(a))) {
          out.append(py::make_tuple(dtype_name(d), activation_name(static_cast<Activation>(a))));
        }
      }
    }
    return out;
  }, "(dtype, activation) pairs the Hopper epilogue GEMM was compiled for (empty: none).");
  m.def("sm90_gelu_epilogue_kernels", [] {
    py::list out;
    for (DType d : {DType::f16, DType::bf16}) {
      for (Activation a : {Activation::gelu, Activation::gelu_tanh}) {
        if (sm90_gelu_epilogue_compiled(d, a)) out.append(py::make_tuple(dtype_name(d), activation_name(a)));
      }
    }
    return out;
  }, "(dtype, activation) pairs of the Hopper GELU units this build holds (exact and tanh GELU fixed at compile time).");
  m.def("set_sm90_gelu_epilogue", &set_sm90_gelu_epilogue, py::arg("on"));
  m.def("sm90_gelu_epilogue", &sm90_gelu_epilogue);
  m.def("set_sm90_gemm_enabled", &set_sm90_gemm_enabled, py::arg("on"));
  m.def("sm90_gemm_enabled", &sm90_gemm_enabled);
  m.def("set_sm90_sm_limit", &set_sm90_sm_limit, py::arg("n"));
  m.def("sm90_sm_limit", &sm90_sm_limit);
  m.def("sm90_gemm_applies", [](int device, int64_t m, int64_t n, int64_t k, uintptr_t a, int64_t lda,
                                uintptr_t w, int64_t ldw, uintptr_t bias, uintptr_t d, int64_t ldd,
                                int dtype, int act) {
    const GemmArgs g = gemm_args(device, 0, m, n, k, a, lda, w, ldw, bias, 0, 0, d, ldd, dtype, act,
                                 1.f, 0.f, 0, 0);
    const char* why = "";
    const bool yes = sm90_gemm_applies(g, &why);
    return py::make_tuple(yes, yes ? "" : why);
  }, "Whether gemm() with these arguments runs the Hopper epilogue kernel, and if not why.");

  m.attr("STATS_TILE_M") = kStatsTileM;
  m.attr("STATS_TILE_N") = kStatsTileN;
  m.def("sm90_residual_gemm_compiled", [](int dtype) { return sm90_residual_gemm_compiled(to_dtype(dtype)); });
  m.def("sm90_fold_applies", [](int device, int64_t m, int64_t n, int64_t k, uintptr_t a, int64_t lda,
                                uintptr_t w, int64_t ldw, uintptr_t bias, uintptr_t c, int64_t ldc,
                                uintptr_t d, int64_t ldd, int dtype) {
    const GemmArgs g = gemm_args(device, 0, m, n, k, a, lda, w, ldw, bias, c, ldc, d, ldd, dtype, 0,
                                 1.f, 0.f, 0, 0);
    const char* why = "";
    const bool yes = sm90_fold_applies(g, &why);
    return py::make_tuple(yes, yes ? "" : why);
  }, "Whether the LayerNorm-folding GEMMs (norm: c = 0; residual: c set) can run these arguments, and if not why.");
  m.def("sm90_norm_gemm", [](int device, uintptr_t stream, int64_t m, int64_t n, int64_t k, uintptr_t a,
                             int64_t lda, uintptr_t w, int64_t ldw, uintptr_t bias, uintptr_t d, int64_t ldd,
                             int dtype, int act, float alpha, uintptr_t rstd, uintptr_t shift,
                             uintptr_t colsum, uintptr_t workspace, size_t workspace_bytes) {
    GemmArgs g = gemm_args(device, stream, m, n, k, a, lda, w, ldw, bias, 0, 0, d, ldd, dtype, act, alpha,
                           0.f, workspace, workspace_bytes);
    NormFold f;
    f.rstd = ptr<const float>(rstd);
    f.shift = ptr<const float>(shift);
    f.colsum = ptr<const float>(colsum);
    if (m == 0) return true;
    return sm90_norm_gemm(g, f);
  }, "D = act(rstd * A @ W^T + shift * colsum + bias) (null rstd/shift/colsum: alpha/0/0). "
     "False: CUTLASS refused the problem and nothing ran.");
  m.def("sm90_residual_gemm", [](int device, uintptr_t stream, int64_t m, int64_t n, int64_t k, uintptr_t a,
                                 int64_t lda, uintptr_t w, int64_t ldw, uintptr_t bias, uintptr_t c, int64_t ldc,
                                 uintptr_t d, int64_t ldd, int dtype, float alpha, uintptr_t rstd,
                                 uintptr_t shift, uintptr_t gamma, uintptr_t beta, uintptr_t row_sum,
                                 uintptr_t row_sumsq, uintptr_t workspace, size_t workspace_bytes) {
    GemmArgs g = gemm_args(device, stream, m, n, k, a, lda, w, ldw, bias, c, ldc, d, ldd, dtype, 0, alpha,
                           1.f, workspace, workspace_bytes);
    const ResidualNorm r = residual_norm(rstd, shift, gamma, beta, row_sum, row_sumsq);
    if (m == 0) return true;
    return sm90_residual_gemm(g, r);
  }, "D = alpha * (A @ W^T + bias) + (C * rstd + shift) * gamma + beta, with partial row sums of D "
     "and D^2 (sm90_gemm.h). False: CUTLASS refused the problem and nothing ran.");
  m.def("norm_stats", [](int device, uintptr_t stream, int64_t rows, int64_t cols, int64_t tiles, int64_t ld,
                         uintptr_t row_sum, uintptr_t row_sumsq, uintptr_t rstd, uintptr_t shift, double eps) {
    NormStatsArgs a;
    a.rows = rows; a.cols = cols; a.tiles = tiles; a.ld = ld;
    a.row_sum = ptr<const float>(row_sum); a.row_sumsq = ptr<const float>(row_sumsq);
    a.rstd = ptr<float>(rstd); a.shift = ptr<float>(shift);
    a.eps = static_cast<float>(eps);
    DeviceGuard guard(device);
    norm_stats(a, reinterpret_cast<gpuStream_t>(stream));
  }, "rstd and shift = -mean * rstd per row from partial sums of z and z^2 (norm_stats.h).");

  m.def("fp8_quantize_rows", [](int device, uintptr_t stream, int64_t rows, int64_t k, uintptr_t x, int64_t ldx,
                                int dtype, uintptr_t q, int64_t ldq, uintptr_t scale) {
    Fp8QuantizeArgs a;
    a.rows = rows; a.k = k;
    a.x = ptr<const void>(x); a.ldx = ldx; a.dtype = to_dtype(dtype);
    a.q = ptr<uint8_t>(q); a.ldq = ldq; a.scale = ptr<float>(scale);
    a.format = fp8_format(device);
    DeviceGuard guard(device);
    fp8_quantize_rows(a, reinterpret_cast<gpuStream_t>(stream));
  }, "Rows in float8 e4m3 with one fp32 scale per row (fp8_quantize.h).");
  m.def("fp8_gemm", [](int device, uintptr_t stream, int64_t m, int64_t n, int64_t k, uintptr_t a, int64_t lda,
                       uintptr_t a_scale, uintptr_t w, int64_t ldw, uintptr_t w_scale, uintptr_t bias, uintptr_t d,
                       int64_t ldd, int out_dtype, int act, bool fast_accum, uintptr_t workspace,
                       size_t workspace_bytes, uintptr_t out_scale, uintptr_t shift, uintptr_t colsum) {
    Fp8GemmArgs g;
    g.out_scale = ptr<const float>(out_scale);
    g.shift = ptr<const float>(shift);
    g.colsum = ptr<const float>(colsum);
    g.device = device; g.stream = reinterpret_cast<gpuStream_t>(stream);
    g.m = m; g.n = n; g.k = k;
    g.a = ptr<const void>(a); g.lda = lda; g.a_scale = ptr<const float>(a_scale);
    g.w = ptr<const void>(w); g.ldw = ldw; g.w_scale = ptr<const float>(w_scale);
    g.bias = ptr<const void>(bias); g.d = ptr<void>(d); g.ldd = ldd;
    g.out_dtype = to_dtype(out_dtype); g.act = to_activation(act); g.fast_accum = fast_accum;
    g.workspace = ptr<void>(workspace); g.workspace_bytes = workspace_bytes;
    fp8_gemm(g);
  }, py::arg("device"), py::arg("stream"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("a"), py::arg("lda"),
     py::arg("a_scale"), py::arg("w"), py::arg("ldw"), py::arg("w_scale"), py::arg("bias"), py::arg("d"),
     py::arg("ldd"), py::arg("out_dtype"), py::arg("act"), py::arg("fast_accum"), py::arg("workspace"),
     py::arg("workspace_bytes"), py::arg("out_scale") = 0, py::arg("shift") = 0, py::arg("colsum") = 0,
     "D = act((A_q @ W_q^T) * a_scale * w_scale + shift * colsum + bias) on e4m3 operands (shift/colsum: "
     "a folded LayerNorm, a_scale then rstd); with out_scale, D in e4m3 (fp8_gemm.h).");
  m.def("fp8_gemm_status", [](int device) {
    std::string why;
    const bool ok = fp8_gemm_status(device, &why);
    return py::make_tuple(ok, why);
  }, "(runs, why not) for the FP8 GEMM on this device.");
  m.def("fp8_gemm_compiled", [] { return FUSEDENC_HAS_FP8_GEMM != 0; });
  m.def("fp8_format", [](int device) { return std::string(fp8_format_name(fp8_format(device))); },
        "The device's e4m3 flavour, \"e4m3fn\" (OCP) or \"e4m3fnuz\" (gfx94x): torch.float8_<name>.");
  m.def("sm90_fp8_gemm_applies", [](int device, int64_t m, int64_t n, int64_t k, uintptr_t a, int64_t lda,
                                    uintptr_t a_scale, uintptr_t w, int64_t ldw, uintptr_t w_scale, uintptr_t bias,
                                    uintptr_t d, int64_t ldd, int out_dtype, int act, bool fast_accum,
                                    uintptr_t out_scale, uintptr_t shift, uintptr_t colsum) {
    Fp8GemmArgs g;
    g.fast_accum = fast_accum;
    g.out_scale = ptr<const float>(out_scale);
    g.shift = ptr<const float>(shift);
    g.colsum = ptr<const float>(colsum);
    g.device = device; g.m = m; g.n = n; g.k = k;
    g.a = ptr<const void>(a); g.lda = lda; g.a_scale = ptr<const float>(a_scale);
    g.w = ptr<const void>(w); g.ldw = ldw; g.w_scale = ptr<const float>(w_scale);
    g.bias = ptr<const void>(bias); g.d = ptr<void>(d); g.ldd = ldd;
    g.out_dtype = to_dtype(out_dtype); g.act = to_activation(act);
    const char* why = "";
    const bool ok = sm90_fp8_gemm_applies(g, &why);
    return py::make_tuple(ok, std::string(ok ? "" : why));
  }, py::arg("device"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("a"), py::arg("lda"), py::arg("a_scale"),
     py::arg("w"), py::arg("ldw"), py::arg("w_scale"), py::arg("bias"), py::arg("d"), py::arg("ldd"),
     py::arg("out_dtype"), py::arg("act"), py::arg("fast_accum"), py::arg("out_scale") = 0, py::arg("shift") = 0,
     py::arg("colsum") = 0,
     "Whether fp8_gemm would run the Hopper FP8 epilogue kernel for this call, and if not why.");
  // The FP8 residual GEMM (sm90_gemm.h): the FP8 mode with LayerNorms folded.
  auto fp8_residual_args = [](int device, uintptr_t stream, int64_t m, int64_t n, int64_t k, uintptr_t a,
                              int64_t lda, uintptr_t w, int64_t ldw, uintptr_t w_scale, uintptr_t bias,
                              uintptr_t d, int64_t ldd, int dtype) {
    Fp8GemmArgs g;
    g.device = device; g.stream = reinterpret_cast<gpuStream_t>(stream);
    g.m = m; g.n = n; g.k = k;
    g.a = ptr<const void>(a); g.lda = lda;
    g.w = ptr<const void>(w); g.ldw = ldw; g.w_scale = ptr<const float>(w_scale);
    g.bias = ptr<const void>(bias); g.d = ptr<void>(d); g.ldd = ldd;
    g.out_dtype = to_dtype(dtype); g.fast_accum = true;
    return g;
  };
  m.def("sm90_fp8_residual_applies", [fp8_residual_args](int device, int64_t m, int64_t n, int64_t k, uintptr_t a,
                                                         int64_t lda, uintptr_t w, int64_t ldw, uintptr_t w_scale,
                                                         uintptr_t bias, uintptr_t c, int64_t ldc, uintptr_t d,
                                                         int64_t ldd, int dtype) {
    const Fp8GemmArgs g = fp8_residual_args(device, 0, m, n, k, a, lda, w, ldw, w_scale, bias, d, ldd, dtype);
    const char* why = "";
    const bool ok = sm90_fp8_residual_applies(g, ptr<const void>(c), ldc, &why);
    return py::make_tuple(ok, std::string(ok ? "" : why));
  }, "Whether the Hopper FP8 residual GEMM can run these arguments, and if not why.");
  m.def("sm90_fp8_residual_gemm", [fp8_residual_args](int device, uintptr_t stream, int64_t m, int64_t n, int64_t k,
                                                      uintptr_t a, int64_t lda, uintptr_t w, int64_t ldw,
                                                      uintptr_t w_scale, uintptr_t bias, uintptr_t c, int64_t ldc,
                                                      uintptr_t d, int64_t ldd, int dtype, float alpha,
                                                      uintptr_t rstd, uintptr_t shift, uintptr_t gamma,
                                                      uintptr_t beta, uintptr_t row_sum, uintptr_t row_sumsq,
                                                      uintptr_t codes, int64_t ldq, uintptr_t code_scale,
                                                      uintptr_t inv_code_scale, uintptr_t workspace,
                                                      size_t workspace_bytes) {
    Fp8GemmArgs g = fp8_residual_args(device, stream, m, n, k, a, lda, w, ldw, w_scale, bias, d, ldd, dtype);
    g.workspace = ptr<void>(workspace); g.workspace_bytes = workspace_bytes;
    const ResidualNorm r = residual_norm(rstd, shift, gamma, beta, row_sum, row_sumsq);
    Fp8Codes q;
    q.q = ptr<void>(codes); q.ldq = ldq;
    q.scale = ptr<const float>(code_scale); q.inv_scale = ptr<const float>(inv_code_scale);
    if (m == 0) return true;
    return sm90_fp8_residual_gemm(g, ptr<const void>(c), ldc, alpha, r, q);
  }, "D = alpha * (w_scale * (A_q @ W_q^T) + bias) + R on e4m3 operands, with partial row sums and, with "
     "codes, D's e4m3 codes (sm90_gemm.h). False: CUTLASS refused the problem and nothing ran.");
  m.def("sm90_fp8_residual_compiled", [](int dtype) { return sm90_fp8_residual_compiled(to_dtype(dtype)); });
  // The 16-bit dtypes a kernel family was compiled for, by name.
  auto compiled_dtypes = [](bool (*compiled)(DType)) {
    py::list out;
    for (DType d : {DType::f16, DType::bf16}) {
      if (compiled(d)) out.append(dtype_name(d));
    }
    return out;
  };
  m.def("sm90_fp8_gemm_kernels", [compiled_dtypes] { return compiled_dtypes(&sm90_fp8_gemm_compiled); },
        "Output dtypes the Hopper FP8 epilogue GEMM was compiled for.");
  m.def("sm90_fp8_e4m3_output_kernels", [compiled_dtypes] { return compiled_dtypes(&sm90_fp8_e4m3_output_compiled); },
        "Bias dtypes the Hopper FP8 GEMM writing e4m3 (static output scales) was compiled for.");
  m.def("sm90_fp8_e4m3_gelu_kernels", [compiled_dtypes] { return compiled_dtypes(&sm90_fp8_e4m3_gelu_compiled); },
        "Bias dtypes the Hopper FP8 GEMM writing e4m3 was compiled for with exact GELU.");
  m.def("clear_fp8_plan_cache", &clear_fp8_plan_cache);

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
        py::arg("q_out") = 0, py::arg("ldq") = 0, py::arg("q_scale") = 0,
        "out = LayerNorm(alpha * (x + x_bias) + residual) * weight + bias over rows of cols "
        "elements; sum_out (optional) gets the pre-norm sum; q_out / q_scale (optional) the "
        "e4m3 codes of out with one scale per row. Null (0) pointers: absent.");

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

  // Algorithm choice by measurement (python -m fusedenc.tune gemm).
  m.attr("MAX_GEMM_CANDIDATES") = kMaxGemmCandidates;
  m.def("gemm_candidates", &gemm_candidates_binding, py::arg("device"), py::arg("stream"),
        py::arg("m"), py::arg("n"), py::arg("k"), py::arg("a"), py::arg("lda"), py::arg("w"),
        py::arg("ldw"), py::arg("bias"), py::arg("c"), py::arg("ldc"), py::arg("d"),
        py::arg("ldd"), py::arg("dtype"), py::arg("activation"), py::arg("alpha"),
        py::arg("beta"), py::arg("workspace"), py::arg("workspace_bytes"), py::arg("count"),
        "Up to `count` heuristic candidates for the problem `gemm` with these arguments would "
        "plan (nothing runs; the plan cache is untouched): {key, epilogue, fell_back, "
        "candidates: [{algo, workspace_bytes, waves}]}; candidate 0 is the default pick.");
  m.def("gemm_with_candidate", &gemm_with_candidate_binding, py::arg("device"), py::arg("stream"),
        py::arg("m"), py::arg("n"), py::arg("k"), py::arg("a"), py::arg("lda"), py::arg("w"),
        py::arg("ldw"), py::arg("bias"), py::arg("c"), py::arg("ldc"), py::arg("d"),
        py::arg("ldd"), py::arg("dtype"), py::arg("activation"), py::arg("alpha"),
        py::arg("beta"), py::arg("workspace"), py::arg("workspace_bytes"), py::arg("count"),
        py::arg("index"), "`gemm` with candidate `index` of gemm_candidates(..., count).");
  m.def("set_gemm_choice", &set_gemm_choice_binding, py::arg("device"), py::arg("m"),
        py::arg("n"), py::arg("k"), py::arg("lda"), py::arg("ldw"), py::arg("ldc"), py::arg("ldd"),
        py::arg("dtype"), py::arg("activation"), py::arg("has_bias"), py::arg("has_residual"),
        py::arg("align_a"), py::arg("align_w"), py::arg("align_c"), py::arg("align_d"),
        py::arg("workspace_bytes"), py::arg("index"), py::arg("candidates"),
        py::arg("algo") = std::string(),
        "Plans for this key (the `key` dict of gemm_candidates) run candidate `index` of "
        "`candidates`; `algo`, when given, must match that candidate's description or the "
        "choice is ignored (candidate 0 runs).  Clears the plan cache.");
  m.def("clear_gemm_choices", &clear_gemm_choices, "Forget every choice; clears the plan cache.");
  m.def("gemm_choices", [] {
    py::list out;
    for (const auto& c : gemm_choices()) {
      py::dict d;
      d["key"] = key_dict(c.key);
      d["index"] = c.index;
      d["candidates"] = c.count;
      d["algo"] = c.algo;
      d["status"] = c.status;
      d["plans"] = c.plans;
      out.append(d);
    }
    return out;
  }, "Installed choices with their status and the number of plans made under each.");
}
