// One block per row: pass 1 finds the row's largest magnitude (NaN wins, so a bad
// value spoils its row's scale as in the reference), pass 2 writes the codes.  The
// second read of the row hits L1/L2: rows are at most a few KB.
#include "fp8_quantize.h"

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

// The larger magnitude, NaN winning over everything.
__device__ __forceinline__ float amax_combine(float m, float a) { return (a > m || a != a) ? a : m; }

template <typename T>
__global__ void __launch_bounds__(kThreads) fp8_quantize_kernel(Fp8QuantizeArgs args) {
  const int64_t row = blockIdx.x;
  const T* x = static_cast<const T*>(args.x) + row * args.ldx;
  float m = 0.f;
  for (int64_t i = threadIdx.x; i < args.k; i += kThreads) m = amax_combine(m, fabsf(load(x + i)));
  for (int off = FUSEDENC_WARP_SIZE / 2; off > 0; off /= 2) m = amax_combine(m, gpu_shfl_xor(m, off));
  __shared__ float warp_max[kThreads / 32];
  __shared__ float row_scale;
  const int warp = threadIdx.x / FUSEDENC_WARP_SIZE, lane = threadIdx.x % FUSEDENC_WARP_SIZE;
  if (lane == 0) warp_max[warp] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    float r = warp_max[0];
    for (int w = 1; w < kThreads / FUSEDENC_WARP_SIZE; ++w) r = amax_combine(r, warp_max[w]);
    const float s = r == 0.f ? 1.f : __fdiv_rn(r, 448.f);
    row_scale = s;
    args.scale[row] = s;
  }
  __syncthreads();
  const float s = row_scale;
  gpu_fp8_e4m3* q = reinterpret_cast<gpu_fp8_e4m3*>(args.q + row * args.ldq);
  for (int64_t i = threadIdx.x; i < args.k; i += kThreads) q[i] = gpu_to_e4m3(__fdiv_rn(load(x + i), s));
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
#if FUSEDENC_HAS_FP8_GEMM
  const dim3 grid(static_cast<unsigned>(a.rows));
  switch (a.dtype) {
    case DType::f16: fp8_quantize_kernel<gpu_half><<<grid, kThreads, 0, stream>>>(a); break;
    case DType::bf16: fp8_quantize_kernel<gpu_bf16><<<grid, kThreads, 0, stream>>>(a); break;
    case DType::f32: fp8_quantize_kernel<float><<<grid, kThreads, 0, stream>>>(a); break;
  }
  FUSEDENC_CHECK_GPU(gpuGetLastError());
#else
  (void)stream;
  throw std::runtime_error(std::string("fusedenc fp8_quantize_rows: ") + FUSEDENC_FP8_MISSING);
#endif
}

}  // namespace fusedenc
