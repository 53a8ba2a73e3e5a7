// Vectorized in-place bias + activation over a row-major [m, n] matrix.
// Memory bound: one 16-byte load and one 16-byte store per thread step, math in
// fp32, one kernel instantiation per (dtype, activation, bias?) so the inner
// loop has no branches on the activation.
#include "bias_activation.h"
#include "vectors.cuh"

#include <algorithm>
#include <mutex>
#include <vector>

namespace fusedenc {
namespace {

// ---- the activations, in fp32; NaN in gives NaN out for every one of them ----
template <Activation A>
__device__ __forceinline__ float activate(float x);

template <> __device__ __forceinline__ float activate<Activation::none>(float x) { return x; }
// Written as a comparison rather than fmaxf so that NaN propagates like torch.relu.
template <> __device__ __forceinline__ float activate<Activation::relu>(float x) {
  return x < 0.f ? 0.f : x;
}
template <> __device__ __forceinline__ float activate<Activation::relu2>(float x) {
  float r = x < 0.f ? 0.f : x;
  return r * r;
}
template <> __device__ __forceinline__ float activate<Activation::gelu_tanh>(float x) {
  const float k0 = 0.7978845608028654f;  // sqrt(2 / pi)
  const float k1 = 0.044715f;
  return 0.5f * x * (1.f + tanhf(k0 * (x + k1 * x * x * x)));
}
template <> __device__ __forceinline__ float activate<Activation::gelu>(float x) {
  return 0.5f * x * (1.f + erff(x * 0.7071067811865476f));
}
template <> __device__ __forceinline__ float activate<Activation::swish>(float x) {
  return x / (1.f + expf(-x));
}
template <> __device__ __forceinline__ float activate<Activation::mish>(float x) {
  // softplus with torch's threshold of 20, where log1p(exp(x)) == x in fp32.
  float softplus = x > 20.f ? x : log1pf(expf(x));
  return x * tanhf(softplus);
}
template <> __device__ __forceinline__ float activate<Activation::selu>(float x) {
  const float alpha = 1.6732632423543772f;
  const float scale = 1.0507009873554805f;
  return scale * (x > 0.f ? x : alpha * expm1f(x));
}
template <> __device__ __forceinline__ float activate<Activation::tanh>(float x) { return tanhf(x); }
template <> __device__ __forceinline__ float activate<Activation::sigmoid>(float x) {
  return 1.f / (1.f + expf(-x));
}

template <typename T, Activation A, bool HasBias>
__global__ void bias_activation_kernel(T* __restrict__ d, int64_t ldd, int64_t m,
                                       int64_t vecs_per_row, const T* __restrict__ bias) {
  using V = Vec<T>;
  const int64_t total = m * vecs_per_row;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += step) {
    const int64_t row = i / vecs_per_row;
    const int64_t col = (i - row * vecs_per_row) * V::size;
    V* p = reinterpret_cast<V*>(d + row * ldd + col);
    V x = *p;
    V b;
    if (HasBias) b = *reinterpret_cast<const V*>(bias + col);
#pragma unroll
    for (int j = 0; j < V::size; ++j) {
      float f = to_float(x.v[j]);
      if (HasBias) f += to_float(b.v[j]);
      x.v[j] = from_float<T>(activate<A>(f));
    }
    *p = x;
  }
}

int multiprocessor_count() {
  // Cached per device: the attribute query is cheap but not free.
  static std::mutex mu;
  static std::vector<int> counts;
  int device = 0;
  FUSEDENC_CHECK_GPU(gpuGetDevice(&device));
  std::lock_guard<std::mutex> lock(mu);
  if (device >= static_cast<int>(counts.size())) counts.resize(device + 1, 0);
  if (counts[device] == 0) {
    FUSEDENC_CHECK_GPU(gpuDeviceGetAttribute(&counts[device], gpuDevAttrMultiProcessorCount, device));
  }
  return counts[device];
}

template <typename T, Activation A>
void launch(T* d, int64_t ldd, int64_t m, int64_t n, const T* bias, gpuStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t vecs_per_row = n / Vec<T>::size;
  const int64_t total = m * vecs_per_row;
  // Enough blocks to fill the chip several times over; the grid-stride loop
  // covers the rest.
  const int64_t max_blocks = static_cast<int64_t>(multiprocessor_count()) * 16;
  const int blocks = static_cast<int>(std::min<int64_t>((total + kThreads - 1) / kThreads, max_blocks));
  if (bias) {
    bias_activation_kernel<T, A, true><<<blocks, kThreads, 0, stream>>>(d, ldd, m, vecs_per_row, bias);
  } else {
    bias_activation_kernel<T, A, false><<<blocks, kThreads, 0, stream>>>(d, ldd, m, vecs_per_row, nullptr);
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
