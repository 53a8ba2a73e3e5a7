// vectors.cuh: what the elementwise kernels share: fp32 conversions of the
// storage dtypes and 16-byte vectors (one load or store instruction per thread).
// Device code: include from .cu files only.
#pragma once

#include <cstdint>

#include "../common.h"

namespace fusedenc {

// Bytes per vector access: 8 halves or 4 floats.  Row lengths, strides and
// pointers the kernels take are multiples of it (checked on the host).
constexpr int kVecBytes = 16;

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) % kVecBytes) == 0; }

// ---- dtype conversions ----
template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<gpu_half>(gpu_half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float<gpu_bf16>(gpu_bf16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ gpu_half from_float<gpu_half>(float v) { return __float2half(v); }
template <> __device__ __forceinline__ gpu_bf16 from_float<gpu_bf16>(float v) { return __float2bfloat16(v); }

template <typename T>
struct alignas(kVecBytes) Vec {
  static constexpr int size = kVecBytes / sizeof(T);
  T v[size];
};

template <typename T>
__device__ __forceinline__ Vec<T> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T>*>(p);
}

template <typename T>
__device__ __forceinline__ void store_vec(T* p, const Vec<T>& v) {
  *reinterpret_cast<Vec<T>*>(p) = v;
}

}  // namespace fusedenc
