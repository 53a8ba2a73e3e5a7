// Fused residual + scale + bias + LayerNorm: one read of each input row, one
// write of each output row, everything in between in registers.
//
// Work split.  A row of D elements is `vecs` 16-byte vectors (8 halves or 4
// floats).  A *group* of G consecutive threads (G a power of two) owns one row;
// thread `lane` of the group holds vectors lane, lane + G, lane + 2G, ... (at
// most kMaxChunks of them), so each load instruction of a group reads G
// consecutive vectors (coalesced).  The number of chunks per thread is a
// template parameter, so the register arrays are indexed only by compile-time
// constants and never spill to local memory.
//   - rows of up to 32 vectors (D <= 256 fp16, D <= 128 fp32): one vector per
//     thread, G = vecs rounded up to a power of two, several rows per block;
//   - longer rows: the smallest G that needs at most kMaxChunks vectors per
//     thread; G <= 1024 covers D = 16384 for every dtype (4096 fp32 vectors =
//     1024 threads x 4 chunks).  D = 768 fp16 is G = 32 (one warp, no shared
//     memory) x 3 chunks, 4 rows per block.
// A block is max(G, 128) threads: 128 / G rows for small rows, one row for
// G >= 128.  Small-row blocks keep each block's work (and the number of
// blocks) reasonable; 128 is a multiple of every warp width (16 in tests, 32,
// and 64 on AMD's CDNA), so no warp ever straddles a block edge.
//
// Reductions.  Two per row: sum(h) -> mean0, then sum(d) and sum(d^2) with
// d = h - mean0 from the registers (a two-pass variance, never E[h^2]-E[h]^2).
// sum(d)/D corrects mean0's own rounding error (mean = mean0 + shift, the
// "corrected two-pass" algorithm), and the output is computed as
// (d - shift) * rstd, so a row like 1000 + N(0, 1) loses no accuracy to the
// rounding of its mean.  A reduction is an xor-butterfly of warp shuffles
// within the group (or within each warp of it) and, when G exceeds the warp,
// a pass through shared memory over the group's warps.  Both steps give every
// thread of the group the bit-identical sum.  The warp width W is a template
// parameter the host picks per device (warp.cuh): correct for any W from 16 to
// 64 lanes: groups smaller than a warp are aligned and the xor offsets stay
// below G; groups larger than a warp are whole warps.
#include "layer_norm.h"
#include "fp8_rows.cuh"
#include "vectors.cuh"
#include "warp.cuh"

#include <cmath>
#include <stdexcept>
#include <string>

namespace fusedenc {
namespace {

constexpr int kMaxChunks = 4;           // 16-byte vectors held per thread
constexpr int kSmallRowVecs = 32;       // rows of up to this many vectors: one per thread
constexpr int kMaxBlockThreads = 1024;  // G for D = 16384 fp32
constexpr int kMinBlockThreads = 128;   // a multiple of every warp width
// Warps of kWarp lanes in the largest block: the shared-memory slots of one reduction.
template <int kWarp>
constexpr int max_warps_per_block() {
  static_assert(kMinBlockThreads % kWarp == 0 && (kWarp & (kWarp - 1)) == 0, "warp width: a power of two dividing 128");
  return kMaxBlockThreads / kWarp;
}

// Sizes and scalars of one launch (pointers are separate kernel arguments so
// that the read-only ones can be __restrict__).
struct Shape {
  int64_t rows;
  int64_t ldx, ldr, ldo, lds, ldq;
  int cols;
  int vecs;         // cols / elements per vector
  int group_shift;  // G = 1 << group_shift threads per row
  float eps;
  float alpha;
};

// Sum of N values over the G = 1 << group_shift threads that share a row, in warps of
// kWarp lanes.  Every thread of the block must call it (it may __syncthreads); `scratch`
// holds N * max_warps_per_block<kWarp>() floats used by no other call in this kernel.
template <int kWarp, int N>
__device__ __forceinline__ void group_sum(float (&v)[N], int group_shift, float* scratch) {
  constexpr int kMaxWarpsPerBlock = max_warps_per_block<kWarp>();
  const int group = 1 << group_shift;
  const int width = group < kWarp ? group : kWarp;
  for (int offset = width / 2; offset > 0; offset /= 2) {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] += gpu_shfl_xor(v[i], offset);
  }
  if (group > kWarp) {  // the same branch for the whole block
    const int warp = threadIdx.x / kWarp;
    const int warps_per_group = group / kWarp;
    const int first = (threadIdx.x >> group_shift) * warps_per_group;
    if (threadIdx.x % kWarp == 0) {
#pragma unroll
      for (int i = 0; i < N; ++i) scratch[i * kMaxWarpsPerBlock + warp] = v[i];
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < N; ++i) {
      float s = 0.f;
      for (int w = 0; w < warps_per_group; ++w) s += scratch[i * kMaxWarpsPerBlock + first + w];
      v[i] = s;
    }
  }
}

// group_sum's shape for the row's largest magnitude (fp8_amax_combine instead of +).
template <int kWarp>
__device__ __forceinline__ void group_amax(float& v, int group_shift, float* scratch) {
  const int group = 1 << group_shift;
  const int width = group < kWarp ? group : kWarp;
  for (int offset = width / 2; offset > 0; offset /= 2) v = fp8_amax_combine(v, gpu_shfl_xor(v, offset));
  if (group > kWarp) {
    const int warp = threadIdx.x / kWarp;
    const int first = (threadIdx.x >> group_shift) * (group / kWarp);
    if (threadIdx.x % kWarp == 0) scratch[warp] = v;
    __syncthreads();
    float m = 0.f;
    for (int w = 0; w < group / kWarp; ++w) m = fp8_amax_combine(m, scratch[first + w]);
    v = m;
  }
}

// One vector's e4m3 codes (fp8_rows.cuh: the quantization kernel's rule, so the codes are
// bit-identical to quantizing `out`), converted two at a time.
template <int kV>
struct alignas(kV) Codes {
  uint16_t pair[kV / 2];
};
template <typename V>
__device__ __forceinline__ Codes<V::size> fp8_codes(const V& o, const Fp8Divisor& d) {
  Codes<V::size> q;
#if FUSEDENC_HAS_FP8_GEMM
#pragma unroll
  for (int j = 0; j < V::size / 2; ++j) q.pair[j] = fp8_code_pair(to_float(o.v[2 * j]), to_float(o.v[2 * j + 1]), d);
#else
  (void)o; (void)d;  // never launched: the host refuses q_out without FP8
#endif
  return q;
}

// residual and sum_out are not __restrict__: sum_out may be residual itself.
// Each thread reads its residual vectors (first loop) before it writes the
// same vectors of sum_out (after the first reduction), so that is safe.
// Largest block a dtype ever launches (G for D = 16384): 1024 threads for fp32,
// 512 for 16-bit types, whose kernels may then use up to 128 registers (the
// conversions of 4 chunks x 8 values need more than 64 without spilling).
template <typename T>
constexpr int max_block_threads() {
  return static_cast<int>(kLayerNormMaxCols * sizeof(T) / kVecBytes / kMaxChunks);
}
static_assert(max_block_threads<float>() == kMaxBlockThreads, "fp32 rows of D = 16384 need 1024 threads");

template <typename T, int kChunks, bool kFp8, int kWarp>
__global__ void __launch_bounds__(max_block_threads<T>())
layer_norm_kernel(const T* __restrict__ x, const T* residual, const T* __restrict__ x_bias,
                  const T* __restrict__ weight, const T* __restrict__ bias, T* __restrict__ out,
                  T* sum_out, uint8_t* __restrict__ q_out, float* __restrict__ q_scale, const Shape s) {
  using V = Vec<T>;
  constexpr int kV = V::size;
  constexpr int kMaxWarpsPerBlock = max_warps_per_block<kWarp>();
  // [0, W): sum(h); [W, 3W): sum(d), sum(d^2); [3W, 4W): amax of the output (kFp8)
  __shared__ float scratch[(kFp8 ? 4 : 3) * kMaxWarpsPerBlock];

  const int lane = threadIdx.x & ((1 << s.group_shift) - 1);
  const int64_t row =
      static_cast<int64_t>(blockIdx.x) * (blockDim.x >> s.group_shift) + (threadIdx.x >> s.group_shift);
  // Threads past the last row hold nothing but still take part in the
  // reductions (shuffles and barriers need the whole warp / block).
  const bool live = row < s.rows;
  bool has[kChunks];
#pragma unroll
  for (int c = 0; c < kChunks; ++c) has[c] = live && (lane + (c << s.group_shift)) < s.vecs;
  auto column = [&](int c) { return static_cast<int64_t>(lane + (c << s.group_shift)) * kV; };

  // 1. Issue every load of the row before any arithmetic or store.
  V xv[kChunks], rv[kChunks];
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    if (has[c]) {
      xv[c] = load_vec(x + row * s.ldx + column(c));
      if (residual) rv[c] = load_vec(residual + row * s.ldr + column(c));
    }
  }

  // 2. h = alpha * (x + x_bias) + residual in fp32, and its sum.
  float h[kChunks][kV];
  float sum[1] = {0.f};
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    if (has[c]) {
      V bv;
      if (x_bias) bv = load_vec(x_bias + column(c));
#pragma unroll
      for (int j = 0; j < kV; ++j) {
        float v = to_float(xv[c].v[j]);
        if (x_bias) v += to_float(bv.v[j]);
        v *= s.alpha;
        if (residual) v += to_float(rv[c].v[j]);
        h[c][j] = v;
        sum[0] += v;
      }
    } else {
#pragma unroll
      for (int j = 0; j < kV; ++j) h[c][j] = 0.f;
    }
  }
  group_sum<kWarp>(sum, s.group_shift, scratch);
  const float mean0 = sum[0] / static_cast<float>(s.cols);

  // 3. The residual stream, rounded once (stored while the next reduction runs).
  if (sum_out) {
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      if (has[c]) {
        V o;
#pragma unroll
        for (int j = 0; j < kV; ++j) o.v[j] = from_float<T>(h[c][j]);
        store_vec(sum_out + row * s.lds + column(c), o);
      }
    }
  }

  // 4. Second pass over the registers: sum(d) and sum(d^2), d = h - mean0.
  float dsum[2] = {0.f, 0.f};
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    if (has[c]) {
#pragma unroll
      for (int j = 0; j < kV; ++j) {
        const float d = h[c][j] - mean0;
        dsum[0] += d;
        dsum[1] += d * d;
      }
    }
  }
  group_sum<kWarp>(dsum, s.group_shift, scratch + kMaxWarpsPerBlock);
  const float shift = dsum[0] / static_cast<float>(s.cols);  // mean = mean0 + shift
  float var = dsum[1] / static_cast<float>(s.cols) - shift * shift;
  if (var < 0.f) var = 0.f;  // rounding only; a comparison keeps NaN (fmaxf would not)
  const float rstd = 1.f / sqrtf(var + s.eps);

  // 5. Normalize, scale, shift, round once.
  if (!kFp8 && !live) return;  // no barrier or shuffle below (the FP8 copy needs one more)
  V o[kChunks];
  float amax = 0.f;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    if (has[c]) {
      V wv, bv;
      if (weight) wv = load_vec(weight + column(c));
      if (bias) bv = load_vec(bias + column(c));
#pragma unroll
      for (int j = 0; j < kV; ++j) {
        float y = ((h[c][j] - mean0) - shift) * rstd;
        if (weight) y *= to_float(wv.v[j]);
        if (bias) y += to_float(bv.v[j]);
        o[c].v[j] = from_float<T>(y);
        if (kFp8) amax = fp8_amax_combine(amax, fabsf(to_float(o[c].v[j])));
      }
      store_vec(out + row * s.ldo + column(c), o[c]);
    }
  }
  if (!kFp8) return;

  // 6. The FP8 copy: the row's scale from the rounded outputs, then their codes.
  group_amax<kWarp>(amax, s.group_shift, scratch + 3 * kMaxWarpsPerBlock);
  if (!live) return;
  const float scale = fp8_row_scale(amax);
  if (lane == 0) q_scale[row] = scale;
  const Fp8Divisor divisor = fp8_divisor(scale);
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    if (has[c]) *reinterpret_cast<Codes<kV>*>(q_out + row * s.ldq + column(c)) = fp8_codes(o[c], divisor);
  }
}

struct Config {
  int group_shift;  // G = 1 << group_shift threads per row
  int chunks;       // vectors per thread, 1..kMaxChunks
  int threads;      // per block
};

Config choose_config(int vecs) {
  int shift = 0;
  while ((1 << shift) < vecs && (1 << shift) < kSmallRowVecs) ++shift;
  while ((vecs + (1 << shift) - 1) >> shift > kMaxChunks) ++shift;
  const int group = 1 << shift;
  Config cfg;
  cfg.group_shift = shift;
  cfg.chunks = (vecs + group - 1) / group;
  cfg.threads = group > kMinBlockThreads ? group : kMinBlockThreads;
  return cfg;
}

template <typename T, int kChunks>
void launch_chunks(const LayerNormArgs& a, const Shape& s, int64_t blocks, int threads,
                   gpuStream_t stream) {
  with_warp_width(reduction_warp_width(), [&](auto warp) {
    constexpr int kWarp = decltype(warp)::value;
    auto kernel = a.q_out ? layer_norm_kernel<T, kChunks, true, kWarp> : layer_norm_kernel<T, kChunks, false, kWarp>;
    kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
        static_cast<const T*>(a.x), static_cast<const T*>(a.residual),
        static_cast<const T*>(a.x_bias), static_cast<const T*>(a.weight),
        static_cast<const T*>(a.bias), static_cast<T*>(a.out), static_cast<T*>(a.sum_out), a.q_out,
        a.q_scale, s);
  });
}

template <typename T>
void launch(const LayerNormArgs& a, gpuStream_t stream) {
  const int vecs = static_cast<int>(a.cols / Vec<T>::size);
  const Config cfg = choose_config(vecs);
  const int64_t rows_per_block = cfg.threads >> cfg.group_shift;
  const int64_t blocks = (a.rows + rows_per_block - 1) / rows_per_block;
  // Grid limits of both vendors (HIP counts threads in 32 bits).
  if (blocks > 0x7fffffffLL || blocks * cfg.threads > 0xffffffffLL)
    throw std::invalid_argument("layer_norm: " + std::to_string(a.rows) +
                                " rows are more than one launch can cover");
  Shape s;
  s.rows = a.rows;
  s.ldx = a.ldx; s.ldr = a.ldr; s.ldo = a.ldo; s.lds = a.lds; s.ldq = a.ldq;
  s.cols = static_cast<int>(a.cols);
  s.vecs = vecs;
  s.group_shift = cfg.group_shift;
  s.eps = a.eps;
  s.alpha = a.alpha;
  switch (cfg.chunks) {
    case 1: launch_chunks<T, 1>(a, s, blocks, cfg.threads, stream); break;
    case 2: launch_chunks<T, 2>(a, s, blocks, cfg.threads, stream); break;
    case 3: launch_chunks<T, 3>(a, s, blocks, cfg.threads, stream); break;
    case 4: launch_chunks<T, 4>(a, s, blocks, cfg.threads, stream); break;
    default: throw std::logic_error("layer_norm: no kernel for " + std::to_string(cfg.chunks) + " chunks");
  }
  FUSEDENC_CHECK_GPU(gpuGetLastError());
}

[[noreturn]] void bad(const std::string& what) { throw std::invalid_argument("layer_norm: " + what); }

// Byte range [first, last) touched by a [rows, cols] matrix with row stride ld.
struct Span {
  uintptr_t first, last;
};
Span span(const void* p, int64_t rows, int64_t cols, int64_t ld, int es) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(p);
  return {first, first + static_cast<uintptr_t>(((rows - 1) * ld + cols) * es)};
}
bool overlap(const Span& a, const Span& b) { return a.first < b.last && b.first < a.last; }

void check_rows(const char* name, const void* p, int64_t ld, const LayerNormArgs& a, int64_t per_vec) {
  if (ld < a.cols || ld % per_vec)
    bad(std::string(name) + " row stride " + std::to_string(ld) + " must be >= D=" +
        std::to_string(a.cols) + " and a multiple of " + std::to_string(per_vec) + " elements");
  if (!aligned16(p)) bad(std::string(name) + " must be 16-byte aligned");
}

}  // namespace

void layer_norm(const LayerNormArgs& a, gpuStream_t stream) {
  if (a.dtype != DType::f16 && a.dtype != DType::bf16 && a.dtype != DType::f32) bad("unknown dtype");
  const int es = dtype_size(a.dtype);
  const int64_t per_vec = kVecBytes / es;
  if (a.rows < 0) bad("negative number of rows " + std::to_string(a.rows));
  if (a.cols <= 0 || a.cols > kLayerNormMaxCols || a.cols % per_vec)
    bad("D=" + std::to_string(a.cols) + " must be a positive multiple of " + std::to_string(per_vec) +
        " for " + dtype_name(a.dtype) + ", at most " + std::to_string(kLayerNormMaxCols));
  if (!std::isfinite(a.eps) || a.eps < 0.f) bad("eps=" + std::to_string(a.eps) + " must be finite and >= 0");
  if (!std::isfinite(a.alpha)) bad("alpha=" + std::to_string(a.alpha) + " is not finite in fp32");
  if (a.rows == 0) return;
  if (!a.x || !a.out) bad("x and out must not be null");
  check_rows("x", a.x, a.ldx, a, per_vec);
  check_rows("out", a.out, a.ldo, a, per_vec);
  if (a.residual) check_rows("residual", a.residual, a.ldr, a, per_vec);
  if (a.sum_out) check_rows("sum_out", a.sum_out, a.lds, a, per_vec);
  const char* vec_names[] = {"x_bias", "weight", "bias"};
  const void* vec_ptrs[] = {a.x_bias, a.weight, a.bias};
  for (int i = 0; i < 3; ++i)
    if (vec_ptrs[i] && !aligned16(vec_ptrs[i])) bad(std::string(vec_names[i]) + " must be 16-byte aligned");

  // Outputs must not overlap inputs (or each other); sum_out may be exactly residual.
  const Span out_span = span(a.out, a.rows, a.cols, a.ldo, es);
  const Span x_span = span(a.x, a.rows, a.cols, a.ldx, es);
  Span inputs[4] = {x_span, {0, 0}, {0, 0}, {0, 0}};
  int n_inputs = 1;
  for (const void* v : vec_ptrs)
    if (v) inputs[n_inputs++] = span(v, 1, a.cols, a.cols, es);
  for (int i = 0; i < n_inputs; ++i)
    if (overlap(out_span, inputs[i])) bad("out overlaps an input");
  if (a.residual && overlap(out_span, span(a.residual, a.rows, a.cols, a.ldr, es)))
    bad("out overlaps residual");
  if (a.sum_out) {
    const Span sum_span = span(a.sum_out, a.rows, a.cols, a.lds, es);
    if (overlap(sum_span, out_span)) bad("sum_out overlaps out");
    for (int i = 0; i < n_inputs; ++i)
      if (overlap(sum_span, inputs[i])) bad("sum_out overlaps an input");
    if (a.residual && overlap(sum_span, span(a.residual, a.rows, a.cols, a.ldr, es)) &&
        !(a.sum_out == a.residual && a.lds == a.ldr))
      bad("sum_out partially overlaps residual; it may only be residual itself");
  }

  if (!a.q_out != !a.q_scale) bad("q_out and q_scale come together");
  if (a.q_out) {
#if !FUSEDENC_HAS_FP8_GEMM
    throw std::runtime_error(std::string("layer_norm: no FP8 output: ") + FUSEDENC_FP8_MISSING);
#endif
    // Codes are stored a vector's worth (per_vec bytes) at a time.
    if (a.ldq < a.cols || a.ldq % per_vec)
      bad("q_out row stride " + std::to_string(a.ldq) + " must be >= D=" + std::to_string(a.cols) +
          " and a multiple of " + std::to_string(per_vec));
    if (!aligned16(a.q_out) || reinterpret_cast<uintptr_t>(a.q_scale) % 4)
      bad("q_out must be 16-byte aligned and q_scale 4-byte aligned");
    const Span q_span = span(a.q_out, a.rows, a.cols, a.ldq, 1);
    const Span qs_span = span(a.q_scale, 1, a.rows, a.rows, 4);
    Span taken[9] = {out_span, q_span, qs_span};  // + sum_out, residual, x and 3 vectors
    int n_taken = 3;
    if (a.sum_out) taken[n_taken++] = span(a.sum_out, a.rows, a.cols, a.lds, es);
    if (a.residual) taken[n_taken++] = span(a.residual, a.rows, a.cols, a.ldr, es);
    for (int i = 0; i < n_inputs; ++i) taken[n_taken++] = inputs[i];
    for (int i = 0; i < n_taken; ++i) {
      if (i != 1 && overlap(q_span, taken[i])) bad("q_out overlaps another operand");
      if (i != 2 && overlap(qs_span, taken[i])) bad("q_scale overlaps another operand");
    }
  }

  switch (a.dtype) {
    case DType::f16: return launch<gpu_half>(a, stream);
    case DType::bf16: return launch<gpu_bf16>(a, stream);
    case DType::f32: return launch<float>(a, stream);
  }
}

}  // namespace fusedenc
