// A GEMM epilogue that writes its output straight from registers: the norm tree of
// sm90_gemm_impl.cuh (act(rstd[m] * acc + (shift[m] * colsum[n] + bias[n])), alpha for rstd
// where no LayerNorm is folded), as a collective of our own for CUTLASS's pingpong kernel.
//
// Why: the pingpong kernel lets one warpgroup's epilogue overlap the other's main loop, but it
// orders the epilogues among themselves, so a tile costs max(main loop, epilogue).  With a heavy
// activation at short K (MiniLM's FFN1: exact GELU, K 384) the TMA epilogue is the longer one:
// per 64 x 64 subtile it stages the values in shared memory, syncs its warpgroup on a named
// barrier, issues a TMA store, and at the tile's end waits for every store to land before the
// other warpgroup may start its epilogue (bench/NOTES.md: 5.2 us a tile against a 3.0 us main
// loop).  Here each thread computes all of its values with no barrier in between and stores
// them as it goes (fire and forget), so the arithmetic of the whole tile is one unrolled block
// the compiler can schedule freely.  The price: 8-byte stores (four adjacent columns a thread,
// after one shuffle between neighbouring lanes) instead of TMA's whole lines.
//
// Include from the sm90 units only (device code, CUTLASS headers).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/detail.hpp>
#include <cutlass/numeric_conversion.h>

#include "activations.cuh"

namespace fusedenc {
namespace sm90 {

// The vectors of the norm tree; a null pointer stands for its neutral value.
struct DirectNormArguments {
  const float* rstd = nullptr;    // [m]; null: alpha
  const float* shift = nullptr;   // [m]; null: 0
  const float* colsum = nullptr;  // [n]; null: 0
  const void* bias = nullptr;     // [n], the output's dtype; null: 0
  float alpha = 1.f;
};

template <class Element, Activation A>
class DirectNormEpilogue {
 public:
  using ElementC = void;  // no source operand
  using ElementD = Element;
  using ElementOutput = Element;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using StrideC = cute::Stride<int64_t, cute::Int<1>, int64_t>;  // row-major [m, n] (and a batch mode)
  using StrideD = StrideC;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  using ThreadEpilogueOp = DirectNormArguments;  // only named (not used) by CUTLASS's device adapter

  struct SharedStorage {};  // none: the mainloop gets the whole carveout for its stages
  using TensorStorage = SharedStorage;

  // Laid out like CUTLASS's DefaultEpilogue arguments (thread, C, its stride, D, its stride), so the
  // one launch() of sm90_gemm_impl.cuh fills either kind.
  struct Arguments {
    DirectNormArguments thread{};
    void const* ptr_C = nullptr;
    StrideC dC{};
    Element* ptr_D = nullptr;
    StrideD dD{};
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  // Four columns are stored as one 8-byte word: N a multiple of 4 (a word is all in or all out)
  // and D's rows 8-byte aligned (the callers' shape checks ask 16 bytes of every operand already).
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& shape, Arguments const& args) {
    const auto n = cute::get<1>(shape);
    return n % 4 == 0 && cute::get<0>(args.dD) % 4 == 0 && reinterpret_cast<uintptr_t>(args.ptr_D) % 8 == 0;
  }

  CUTLASS_HOST_DEVICE
  DirectNormEpilogue(Params const& params, SharedStorage const& = SharedStorage()) : params_(params) {}

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_mnk,
                                 BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout> const& acc,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    const int M = static_cast<int>(get<0>(problem_shape_mnkl));
    const int N = static_cast<int>(get<1>(problem_shape_mnkl));
    const auto m_coord = get<0>(blk_coord_mnkl);
    const auto n_coord = get<1>(blk_coord_mnkl);

    // The output tile and the coordinates of its elements, partitioned like the accumulators.
    Tensor mD = make_tensor(make_gmem_ptr(params_.ptr_D), make_shape(M, N), make_stride(get<0>(params_.dD), _1{}));
    Tensor gD = local_tile(mD, take<0, 2>(blk_shape_mnk), make_coord(m_coord, n_coord));
    Tensor cD = local_tile(make_identity_tensor(make_shape(M, N)), take<0, 2>(blk_shape_mnk),
                           make_coord(m_coord, n_coord));
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor tDgD = thr_mma.partition_C(gD);  // ((2, 2, N/8), MMA_M, MMA_N)
    Tensor tDcD = thr_mma.partition_C(cD);

    // Hopper's wgmma accumulator fragment: per thread ((2 columns, 2 rows, N/8 column groups), the
    // tile's M repeats, its N repeats).  Rows depend on (v1, MMA_M) only, columns on (v0, v2,
    // MMA_N) only, and v0's two values are adjacent columns: one 32-bit store.
    static_assert(rank(FrgLayout{}) == 3 && rank<0>(FrgLayout{}) == 3, "expected an sm90 wgmma accumulator");
    static_assert(size<0, 0>(FrgLayout{}) == 2 && size<0, 1>(FrgLayout{}) == 2, "expected an sm90 wgmma accumulator");
    constexpr int kRowHalves = 2;
    constexpr int kColGroups = size<0, 2>(FrgLayout{});
    constexpr int kMmaM = size<1>(FrgLayout{});
    constexpr int kMmaN = size<2>(FrgLayout{});

    const DirectNormArguments& v = params_.thread;
    const Element* bias = static_cast<const Element*>(v.bias);

    // The rows' scale and shift (2 x MMA_M rows a thread), then the columns' colsum and bias (2
    // adjacent columns x N/8 groups x MMA_N).  Null vectors are uniform branches.
    float row_scale[kMmaM][kRowHalves], row_shift[kMmaM][kRowHalves];
    CUTLASS_PRAGMA_UNROLL
    for (int mm = 0; mm < kMmaM; ++mm) {
      CUTLASS_PRAGMA_UNROLL
      for (int h = 0; h < kRowHalves; ++h) {
        const int m = get<0>(tDcD(make_coord(make_coord(0, h, 0), mm, 0)));
        const bool in = m < M;
        row_scale[mm][h] = v.rstd ? (in ? v.rstd[m] : 0.f) : v.alpha;
        row_shift[mm][h] = v.shift && in ? v.shift[m] : 0.f;
      }
    }
    float col_sum[kMmaN][kColGroups][2], col_bias[kMmaN][kColGroups][2];
    CUTLASS_PRAGMA_UNROLL
    for (int mn = 0; mn < kMmaN; ++mn) {
      CUTLASS_PRAGMA_UNROLL
      for (int g = 0; g < kColGroups; ++g) {
        const int n = get<1>(tDcD(make_coord(make_coord(0, 0, g), 0, mn)));
        const bool in = n < N;  // n even, N a multiple of 4: n + 1 < N too
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < 2; ++c) {
          col_sum[mn][g][c] = v.colsum && in ? v.colsum[n + c] : 0.f;
          col_bias[mn][g][c] = bias && in ? static_cast<float>(bias[n + c]) : 0.f;
        }
      }
    }

    // Two column groups at a time, so that each thread stores 8 bytes: in a quad (one row),
    // lane q holds columns 2q, 2q + 1 of every group; the even lane of a pair keeps its word of
    // group g0 and takes its odd neighbour's (columns 2q .. 2q + 3 of g0), the odd lane keeps its
    // word of g1 and takes the even one's (columns 2q - 2 .. 2q + 1 of g1).  One shuffle for two
    // words; a warp's store then writes eight rows of two whole 32-byte sectors.
    static_assert(kColGroups % 2 == 0, "column groups come in pairs");
    const bool odd = thread_idx & 1;
    cutlass::NumericArrayConverter<Element, float, 2, cutlass::FloatRoundStyle::round_to_nearest> to_output;
    auto word = [&](float a, float b) {
      cutlass::Array<float, 2> y;
      y[0] = activate_fast<A>(a);
      y[1] = activate_fast<A>(b);
      const cutlass::Array<Element, 2> out = to_output(y);
      uint32_t w;
      memcpy(&w, &out, sizeof(w));
      return w;
    };
    CUTLASS_PRAGMA_UNROLL
    for (int mm = 0; mm < kMmaM; ++mm) {
      CUTLASS_PRAGMA_UNROLL
      for (int h = 0; h < kRowHalves; ++h) {
        const int m = get<0>(tDcD(make_coord(make_coord(0, h, 0), mm, 0)));
        const float scale = row_scale[mm][h], shift = row_shift[mm][h];
        CUTLASS_PRAGMA_UNROLL
        for (int mn = 0; mn < kMmaN; ++mn) {
          CUTLASS_PRAGMA_UNROLL
          for (int g0 = 0; g0 < kColGroups; g0 += 2) {
            uint32_t w[2];
            CUTLASS_PRAGMA_UNROLL
            for (int j = 0; j < 2; ++j) {
              const int g = g0 + j;
              // The norm tree's order of operations: rstd * acc + (shift * colsum + bias).
              w[j] = word(fmaf(scale, acc(make_coord(make_coord(0, h, g), mm, mn)),
                               fmaf(shift, col_sum[mn][g][0], col_bias[mn][g][0])),
                          fmaf(scale, acc(make_coord(make_coord(1, h, g), mm, mn)),
                               fmaf(shift, col_sum[mn][g][1], col_bias[mn][g][1])));
            }
            const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? w[0] : w[1], 1);
            const auto at = make_coord(make_coord(0, h, odd ? g0 + 1 : g0), mm, mn);
            const int n = get<1>(tDcD(at)) - (odd ? 2 : 0);  // the first of this lane's four columns
            const uint2 pair = odd ? make_uint2(got, w[1]) : make_uint2(w[0], got);
            if (m < M && n < N) *reinterpret_cast<uint2*>(&tDgD(at) - (odd ? 2 : 0)) = pair;
          }
        }
      }
    }
  }

 private:
  Params params_;
};

}  // namespace sm90
}  // namespace fusedenc
