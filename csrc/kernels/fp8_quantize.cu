// One block per row: pass 1 finds the row's largest magnitude (NaN wins, so a bad
// value spoils its row's scale as in the reference), pass 2 writes the codes.  The
// second read of the row hits L1/L2: rows are at most a few KB.
#include "fp8_quantize.h"
#include "fp8_rows.cuh"
#include "warp.cuh"

#include <stdexcept>
#include <string>

namespace fusedenc {

#if FUSEDENC_HAS_FP8_GEMM
namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ float load(const T* p) { return static_cast<float>(*p); }
template <>
__device__ __forceinline__ float load<gpu_half>(const gpu_half* p) { return __half2float(*p); }
template <>
__device__ __forceinline__ float load<gpu_bf16>(const gpu_bf16* p) { return __bfloat162float(*p); }


// kWarp: lanes per warp (warp.cuh), picked by the host for the device.
template <typename T, int kWarp>
__global__ void __launch_bounds__(kThreads) fp8_quantize_kernel(Fp8QuantizeArgs args) {
  static_assert(kThreads % kWarp == 0, "whole warps per block");
  const int64_t row = blockIdx.x;
  const T* x = static_cast<const T*>(args.x) + row * args.ldx;
  float m = 0.f;
  for (int64_t i = threadIdx.x; i < args.k; i += kThreads) m = fp8_amax_combine(m, fabsf(load(x + i)));
  for (int off = kWarp / 2; off > 0; off /= 2) m = fp8_amax_combine(m, gpu_shfl_xor(m, off));
  __shared__ float warp_max[kThreads / kWarp];
  __shared__ float row_scale;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (lane == 0) warp_max[warp] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    float r = warp_max[0];
    for (int w = 1; w < kThreads / kWarp; ++w) r = fp8_amax_combine(r, warp_max[w]);
    const float s = fp8_row_scale(r, args.format);
    row_scale = s;
    args.scale[row] = s;
  }
  __syncthreads();
  const Fp8Divisor d = fp8_divisor(row_scale);
  uint8_t* q = args.q + row * args.ldq;
  for (int64_t i = threadIdx.x; i < args.k; i += kThreads) q[i] = fp8_code_byte(load(x + i), d, args.format);
}

// The fast path: one warp per row, the row held in registers (16-byte loads, at most
// kMaxVec of them per lane), so it is read once and no shared memory or block barrier
// is needed.  Rows too long for the registers, or not 16-byte aligned, take the kernel above.
constexpr int kRowsPerBlock = 4;
// Lanes per warp, kWarp, is a template parameter the host picks for the device (warp.cuh:
// 32 on NVIDIA; on HIP the device's own, 64 on the CDNA GPUs that run FP8, gfx94x / gfx95x),
// so the launch, the launch bounds and the row a warp owns agree by construction.
// The longest row the warp kernel takes: 8 x kWarp lanes x 16 bytes (2048 fp16 values at 32).  With
// 16 slots (4096) the registers cut occupancy and the block kernel measured faster
// (2304-wide rows: 64 -> 76 us at 16384 rows on the H100).
constexpr int kMaxVec = 8;

template <typename T>
struct alignas(16) Vec16 {
  T v[16 / sizeof(T)];
};

template <typename T, int kSlots, int kWarp>
__global__ void __launch_bounds__(kRowsPerBlock * kWarp) fp8_quantize_warp_kernel(Fp8QuantizeArgs args) {
  constexpr int V = 16 / sizeof(T);
  const int lane = threadIdx.x % kWarp;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  if (row >= args.rows) return;  // whole warps leave together: the shuffles below stay full
  const int64_t nvec = args.k / V;
  const Vec16<T>* x = reinterpret_cast<const Vec16<T>*>(static_cast<const T*>(args.x) + row * args.ldx);
  Vec16<T> vals[kSlots];
  float m = 0.f;
#pragma unroll
  for (int j = 0; j < kSlots; ++j) {
    const int64_t i = lane + static_cast<int64_t>(j) * kWarp;
    if (i < nvec) {
      vals[j] = x[i];
#pragma unroll
      for (int e = 0; e < V; ++e) m = fp8_amax_combine(m, fabsf(load(&vals[j].v[e])));
    }
  }
  for (int off = kWarp / 2; off > 0; off /= 2) m = fp8_amax_combine(m, gpu_shfl_xor(m, off));
  const float s = fp8_row_scale(m, args.format);
  if (lane == 0) args.scale[row] = s;
  const Fp8Divisor d = fp8_divisor(s);
  struct alignas(V) Codes {
    uint8_t c[V];
  };
  Codes* q = reinterpret_cast<Codes*>(args.q + row * args.ldq);
#pragma unroll
  for (int j = 0; j < kSlots; ++j) {
    const int64_t i = lane + static_cast<int64_t>(j) * kWarp;
    if (i < nvec) {
      Codes out;
#pragma unroll
      for (int e = 0; e < V; ++e) out.c[e] = fp8_code_byte(load(&vals[j].v[e]), d, args.format);
      q[i] = out;
    }
  }
}

template <typename T, int kWarp>
bool warp_path_fits(const Fp8QuantizeArgs& a) {
  constexpr int V = 16 / sizeof(T);
  return a.k % V == 0 && a.ldx % V == 0 && a.ldq % V == 0 && reinterpret_cast<uintptr_t>(a.x) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(a.q) % V == 0 && a.k <= static_cast<int64_t>(V) * kMaxVec * kWarp;
}

template <typename T, int kWarp>
void launch(const Fp8QuantizeArgs& a, gpuStream_t stream) {
  if (warp_path_fits<T, kWarp>(a)) {
    // As few register slots as the row needs: fewer registers, more warps in flight.
    const unsigned blocks = static_cast<unsigned>((a.rows + kRowsPerBlock - 1) / kRowsPerBlock);
    const int64_t per_lane = (a.k / (16 / sizeof(T)) + kWarp - 1) / kWarp;
    if (per_lane <= 4) {
      fp8_quantize_warp_kernel<T, 4, kWarp><<<blocks, kRowsPerBlock * kWarp, 0, stream>>>(a);
    } else {
      fp8_quantize_warp_kernel<T, kMaxVec, kWarp><<<blocks, kRowsPerBlock * kWarp, 0, stream>>>(a);
    }
  } else {
    fp8_quantize_kernel<T, kWarp><<<static_cast<unsigned>(a.rows), kThreads, 0, stream>>>(a);
  }
}

template <typename T>
void launch(const Fp8QuantizeArgs& a, gpuStream_t stream) {
  with_warp_width(reduction_warp_width(), [&](auto warp) { launch<T, decltype(warp)::value>(a, stream); });
}

}  // namespace
#endif

void fp8_quantize_rows(const Fp8QuantizeArgs& a, gpuStream_t stream) {
  auto bad = [](const std::string& what) { throw std::invalid_argument("fusedenc fp8_quantize_rows: " + what); };
  if (a.rows < 0 || a.k < 0) bad("rows and k must be >= 0");
  if (a.ldx < a.k || a.ldq < a.k) bad("row stride smaller than the row");
  if (a.rows == 0) return;
  if (!a.x || !a.q || !a.scale) bad("null pointer");
  if (a.rows > 0x7fffffff) bad("too many rows");
  if (a.format != Fp8Format::e4m3fn && a.format != Fp8Format::e4m3fnuz) bad("unknown e4m3 format");
#if FUSEDENC_HAS_FP8_GEMM
  switch (a.dtype) {
    case DType::f16: launch<gpu_half>(a, stream); break;
    case DType::bf16: launch<gpu_bf16>(a, stream); break;
    case DType::f32: launch<float>(a, stream); break;
  }
  FUSEDENC_CHECK_GPU(gpuGetLastError());
#else
  (void)stream;
  throw std::runtime_error(std::string("fusedenc fp8_quantize_rows: ") + FUSEDENC_FP8_MISSING);
#endif
}

}  // namespace fusedenc
