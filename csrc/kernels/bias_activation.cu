// Vectorized in-place bias + activation over a row-major [m, n] matrix.
// Memory bound: one 16-byte load and one 16-byte store per thread step, math in
// fp32, one kernel instantiation per (dtype, activation, bias?) so the inner
// loop has no branches on the activation.
#include "bias_activation.h"
#include "activations.cuh"
#include "vectors.cuh"

#include <algorithm>

namespace fusedenc {
namespace {

// 16-bit outputs take the GELUs of the epilogue units (activations.cuh: within half an output
// ulp over the whole range, the negative tail included, in fewer instructions than erff:
// 16.5 against 25 a value for exact GELU, which matters where the pass is not bound by memory
// alone); fp32 keeps torch's formulas.
template <typename T, Activation A>
__device__ __forceinline__ float activate_for(float f) {
  constexpr bool kHalf = sizeof(T) == 2;
  if constexpr (kHalf && (A == Activation::gelu || A == Activation::gelu_tanh)) return activate_fast<A>(f);
  else return activate<A>(f);
}

template <typename T, Activation A, bool HasBias>
__device__ __forceinline__ void apply(Vec<T>& x, const T* __restrict__ bias, int64_t col) {
  Vec<T> b;
  if (HasBias) b = *reinterpret_cast<const Vec<T>*>(bias + col);
#pragma unroll
  for (int j = 0; j < Vec<T>::size; ++j) {
    float f = to_float(x.v[j]);
    if (HasBias) f += to_float(b.v[j]);
    x.v[j] = from_float<T>(activate_for<T, A>(f));
  }
}

// Each thread handles two vectors per step (both loads issued before any math:
// more bytes in flight per thread).  Index is the index type: 32-bit whenever
// the matrix has fewer than 2^31 vectors (the host picks), because a 64-bit
// division per vector costs more than the rest of the index math together.
template <typename T, Activation A, bool HasBias, typename Index>
__global__ void bias_activation_kernel(T* __restrict__ d, int64_t ldd, Index total,
                                       Index vecs_per_row, const T* __restrict__ bias) {
  using V = Vec<T>;
  const Index step = static_cast<Index>(gridDim.x) * blockDim.x;
  for (Index i = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += 2 * step) {
    const Index i2 = i + step;
    const bool second = i2 < total;
    const Index row = i / vecs_per_row, row2 = i2 / vecs_per_row;
    const int64_t col = static_cast<int64_t>(i - row * vecs_per_row) * V::size;
    const int64_t col2 = static_cast<int64_t>(i2 - row2 * vecs_per_row) * V::size;
    V* p = reinterpret_cast<V*>(d + static_cast<int64_t>(row) * ldd + col);
    V* p2 = reinterpret_cast<V*>(d + static_cast<int64_t>(row2) * ldd + col2);
    V x = *p, x2;
    if (second) x2 = *p2;
    apply<T, A, HasBias>(x, bias, col);
    *p = x;
    if (second) {
      apply<T, A, HasBias>(x2, bias, col2);
      *p2 = x2;
    }
  }
}

int multiprocessor_count() {
  int device = 0;
  FUSEDENC_CHECK_GPU(gpuGetDevice(&device));
  return device_facts(device).sm_count;
}

template <typename T, Activation A>
void launch(T* d, int64_t ldd, int64_t m, int64_t n, const T* bias, gpuStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t vecs_per_row = n / Vec<T>::size;
  const int64_t total = m * vecs_per_row;
  // Enough blocks to fill the chip several times over; the grid-stride loop
  // covers the rest.
  const int64_t max_blocks = static_cast<int64_t>(multiprocessor_count()) * 16;
  const int blocks = static_cast<int>(std::min<int64_t>((total + 2 * kThreads - 1) / (2 * kThreads), max_blocks));
  if (total < (int64_t{1} << 31)) {
    const auto t = static_cast<uint32_t>(total), v = static_cast<uint32_t>(vecs_per_row);
    if (bias) bias_activation_kernel<T, A, true, uint32_t><<<blocks, kThreads, 0, stream>>>(d, ldd, t, v, bias);
    else bias_activation_kernel<T, A, false, uint32_t><<<blocks, kThreads, 0, stream>>>(d, ldd, t, v, nullptr);
  } else {
    if (bias) bias_activation_kernel<T, A, true, int64_t><<<blocks, kThreads, 0, stream>>>(d, ldd, total, vecs_per_row, bias);
    else bias_activation_kernel<T, A, false, int64_t><<<blocks, kThreads, 0, stream>>>(d, ldd, total, vecs_per_row, nullptr);
  }
  FUSEDENC_CHECK_GPU(gpuGetLastError());
}

template <typename T>
void dispatch_activation(void* d, int64_t ldd, int64_t m, int64_t n, const void* bias,
                         Activation act, gpuStream_t stream) {
  T* dp = static_cast<T*>(d);
  const T* bp = static_cast<const T*>(bias);
  switch (act) {
    case Activation::none: return launch<T, Activation::none>(dp, ldd, m, n, bp, stream);
    case Activation::relu: return launch<T, Activation::relu>(dp, ldd, m, n, bp, stream);
    case Activation::gelu_tanh: return launch<T, Activation::gelu_tanh>(dp, ldd, m, n, bp, stream);
    case Activation::gelu: return launch<T, Activation::gelu>(dp, ldd, m, n, bp, stream);
    case Activation::swish: return launch<T, Activation::swish>(dp, ldd, m, n, bp, stream);
    case Activation::mish: return launch<T, Activation::mish>(dp, ldd, m, n, bp, stream);
    case Activation::relu2: return launch<T, Activation::relu2>(dp, ldd, m, n, bp, stream);
    case Activation::selu: return launch<T, Activation::selu>(dp, ldd, m, n, bp, stream);
    case Activation::tanh: return launch<T, Activation::tanh>(dp, ldd, m, n, bp, stream);
    case Activation::sigmoid: return launch<T, Activation::sigmoid>(dp, ldd, m, n, bp, stream);
  }
  throw std::invalid_argument("bias_activation: unknown activation id " +
                              std::to_string(static_cast<int>(act)));
}

}  // namespace

void bias_activation(void* d, int64_t ldd, int64_t m, int64_t n, const void* bias, DType dtype,
                     Activation act, gpuStream_t stream) {
  const int64_t per_vec = kVecBytes / dtype_size(dtype);
  if (m < 0 || n < 0 || ldd < n) throw std::invalid_argument("bias_activation: bad sizes");
  if (n % per_vec || ldd % per_vec)
    throw std::invalid_argument("bias_activation: n and ldd must be multiples of " +
                                std::to_string(per_vec) + " elements");
  if (!aligned16(d) || (bias && !aligned16(bias)))
    throw std::invalid_argument("bias_activation: d and bias must be 16-byte aligned");
  if (m == 0 || n == 0) return;
  if (act == Activation::none && bias == nullptr) return;  // nothing to do
  switch (dtype) {
    case DType::f16: return dispatch_activation<gpu_half>(d, ldd, m, n, bias, act, stream);
    case DType::bf16: return dispatch_activation<gpu_bf16>(d, ldd, m, n, bias, act, stream);
    case DType::f32: return dispatch_activation<float>(d, ldd, m, n, bias, act, stream);
  }
  throw std::invalid_argument("bias_activation: unknown dtype");
}

}  // namespace fusedenc
