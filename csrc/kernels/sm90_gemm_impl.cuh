// The CUTLASS kernel behind sm90_gemm.h, one instantiation per (dtype, activation)
// in its own translation unit (they are slow to compile; separate units build in
// parallel).  Include only from those units.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <stdexcept>
#include <string>

#include "activations.cuh"
#include "sm90_gemm.h"

namespace fusedenc {
namespace sm90 {

// CUTLASS wants the activation as `template <class> class Fn`, applied to a scalar
// and to Array<float, N> fragments; both call activate_fast<A> (activations.cuh).
template <Activation A, class T>
struct Elementwise {
  CUTLASS_DEVICE T operator()(T const& x) const { return T(activate_fast<A>(float(x))); }
};
template <Activation A, class T, int N>
struct Elementwise<A, cutlass::Array<T, N>> {
  CUTLASS_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& x) const {
    cutlass::Array<T, N> y;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) y[i] = T(activate_fast<A>(float(x[i])));
    return y;
  }
};
template <Activation A>
struct Activation_ {
  template <class T>
  using Fn = Elementwise<A, T>;
};

// The tile configuration: output tile, cluster and kernel/epilogue schedules.
template <class Tile, class Cluster, class KernelSchedule, class EpilogueSchedule>
struct Config {
  using TileShape = Tile;
  using ClusterShape = Cluster;
  using Schedule = KernelSchedule;
  using EpiSchedule = EpilogueSchedule;
};

// 256 x 128 tiles, clusters of two along N (the two CTAs share the A tile's TMA loads),
// cooperative: the fastest of eight configurations measured on an H100 at the t82/bt4
// FFN1 shapes (M 4096-65536, K 768/1024, N 1536/2304); with no activation its main loop
// matched cuBLAS (370 vs 403 us at 65536 x 768 x 2304).  bench/NOTES.md has the table.
using DefaultConfig = Config<cute::Shape<cute::_256, cute::_128, cute::_64>, cute::Shape<cute::_1, cute::_2, cute::_1>,
                             cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                             cutlass::epilogue::TmaWarpSpecializedCooperative>;

template <class Element, Activation A, class Cfg = DefaultConfig>
struct Kernel {
  using ElementAcc = float;
  using LayoutA = cutlass::layout::RowMajor;     // activations [m, k]
  using LayoutB = cutlass::layout::ColumnMajor;  // weight [n, k]: B = W^T, k contiguous
  using LayoutD = cutlass::layout::RowMajor;     // output [m, n]
  static constexpr int kAlign = 16 / sizeof(Element);
  using TileShape = typename Cfg::TileShape;
  using ClusterShape = typename Cfg::ClusterShape;
  using Fusion = cutlass::epilogue::fusion::LinCombPerColBiasEltAct<
      Activation_<A>::template Fn, Element, float, Element, Element, float>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, float, void, LayoutD, kAlign,
      Element, LayoutD, kAlign, typename Cfg::EpiSchedule,
      Fusion>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, kAlign, Element,
      LayoutB, kAlign, ElementAcc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      typename Cfg::Schedule>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop,
                                                          Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
};

// Returns false, having launched nothing, when CUTLASS cannot run this problem or the
// workspace is too small (the caller falls back to cuBLASLt); throws on a failed launch.
template <class Element, Activation A, class Cfg = DefaultConfig>
bool run(const GemmArgs& g, int sm_count) {
  using K = Kernel<Element, A, Cfg>;
  using Gemm = typename K::Gemm;
  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;
  using StrideD = typename Gemm::GemmKernel::StrideD;
  const int m = static_cast<int>(g.m), n = static_cast<int>(g.n), k = static_cast<int>(g.k);
  StrideA sa = cute::make_stride(g.lda, cute::Int<1>{}, int64_t(0));
  StrideB sb = cute::make_stride(g.ldw, cute::Int<1>{}, int64_t(0));
  StrideD sd = cute::make_stride(g.ldd, cute::Int<1>{}, int64_t(0));
  cutlass::KernelHardwareInfo hw;
  hw.device_id = g.device;
  hw.sm_count = sm_count;
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      {static_cast<const Element*>(g.a), sa, static_cast<const Element*>(g.w), sb},
      {{}, nullptr, sd, static_cast<Element*>(g.d), sd},
      hw};
  args.epilogue.thread.alpha = g.alpha;
  args.epilogue.thread.beta = 0.f;
  args.epilogue.thread.bias_ptr = static_cast<const Element*>(g.bias);
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return false;
  const size_t ws = Gemm::get_workspace_size(args);
  if (ws > g.workspace_bytes) return false;
  cutlass::Status st = gemm.initialize(args, ws ? g.workspace : nullptr, g.stream);
  if (st == cutlass::Status::kSuccess) st = gemm.run(g.stream);
  if (st != cutlass::Status::kSuccess) {
    throw std::runtime_error(std::string("fusedenc sm90 gemm: ") + cutlassGetStatusString(st));
  }
  return true;
}

}  // namespace sm90
}  // namespace fusedenc

// One unit's instantiation: the function sm90_gemm.cu's table points at.
#define FUSEDENC_SM90_GEMM_INSTANCE(NAME, ELEMENT, ACT)                          \
  namespace fusedenc { namespace sm90 {                                         \
  bool NAME(const GemmArgs& g, int sm_count) { return run<ELEMENT, ACT>(g, sm_count); } \
  } }
