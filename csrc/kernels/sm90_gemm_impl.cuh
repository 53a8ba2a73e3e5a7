// The CUTLASS kernels behind sm90_gemm.h, one instantiation per (dtype, epilogue) in
// its own translation unit (they are slow to compile; separate units build in
// parallel).  Include only from those units.
//
// Three epilogues (visitor trees), all computed in fp32 and rounded once:
//   norm:     D = act(rstd[m] * acc + (shift[m] * colsum[n] + bias[n]))
//             With rstd, shift and colsum null this is act(alpha * acc + bias), the plain
//             GEMM + bias + activation.  With them it is LayerNorm folded into the GEMM:
//             A is the un-normalized z, W already scaled by gamma (sm90_gemm.h).
//   residual: D = alpha * (acc + bias[n]) + R,  R = (C * rstd[m] + shift[m]) * gamma[n] + beta[n]
//             (R = C when those are null), and per (row, 128-column tile) partial sums of
//             D and D^2 for the LayerNorm that follows (no atomics: deterministic).
//   fp8:      D = act(a_scale[m] * w_scale[n] * acc + (shift[m] * colsum[n] + bias[n])) with
//             A and W in e4m3 (fusedenc.fp8's per-row scales; fp8_gemm.h).  Folding a
//             LayerNorm, A holds codes of the un-normalized z and a_scale is rstd.
//   fp8 out:  the same, then D = e4m3(out_scale[n] * D) (saturating): the next GEMM's
//             e4m3 input with static per-column scales (calibration), written here.
//   fp8 residual: the residual epilogue on e4m3 operands (acc scaled by w_scale[n]), and
//             optionally e4m3 codes of D / code_scale[n] through a second store (the
//             next GEMM's input with static per-column scales: no LayerNorm pass).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/epilogue/thread/activation.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "activations.cuh"
#include "sm90_gemm.h"

namespace fusedenc {
namespace sm90 {

// The activation is a kernel argument, not a template parameter: one kernel per dtype
// serves every activation (each instantiation costs a minute or more of compile time),
// and the switch is uniform across the CTA, once per register fragment.  CUTLASS
// passes a compute function's `Arguments` as its last call argument.
struct ActivationArguments {
  Activation act = Activation::none;
};
template <Activation A, int N>
CUTLASS_DEVICE cutlass::Array<float, N> activate_all(cutlass::Array<float, N> const& x) {
  cutlass::Array<float, N> y;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < N; ++i) y[i] = activate_fast<A>(x[i]);
  return y;
}
template <class T>
struct RuntimeActivation {
  using Arguments = ActivationArguments;
};
template <int N>
struct RuntimeActivation<cutlass::Array<float, N>> {
  using Arguments = ActivationArguments;
  CUTLASS_DEVICE cutlass::Array<float, N> operator()(cutlass::Array<float, N> const& x, Arguments const& a) const {
    switch (a.act) {
      // Only the activations sm90_gemm.cpp's in_epilogue admits; the others run as a pass.
      case Activation::relu: return activate_all<Activation::relu>(x);
      case Activation::swish: return activate_all<Activation::swish>(x);
      case Activation::mish: return activate_all<Activation::mish>(x);
      case Activation::relu2: return activate_all<Activation::relu2>(x);
      case Activation::sigmoid: return activate_all<Activation::sigmoid>(x);
      default: return x;
    }
  }
};

// One activation fixed at compile time: the kernel's registers and instruction schedule
// serve that activation alone.  The run-time switch above compiles a separate block for each
// case and subtile, and its cases' speed moves with what else the switch holds (bench/NOTES.md,
// where the same mish source measured 388 and 488 us at 65536 x 1024 -> 1536 in two
// builds whose switches differed).  In the SASS the switch also keeps each subtile's
// activation in a block of its own, where a fixed activation lets the compiler overlap one
// subtile's arithmetic with the last one's shared-memory and TMA stores.  Built for the
// kernels with no activation (their switch was dead code: 640 MUFU ops of unused cases)
// and, in fp16, for the Lc0 nets' FFN activations (swish, mish); the run-time kernel serves
// the rest.  The argument is passed and ignored, so both forms take the same epilogue
// arguments.
template <Activation A>
struct FixedActivation {
  template <class T>
  struct Fn {
    using Arguments = ActivationArguments;
    CUTLASS_DEVICE T operator()(T const& x, Arguments const&) const { return activate_all<A>(x); }
  };
};

// acc + x * x: the in-register step of the sum-of-squares reduction (the shuffle and
// shared-memory steps add partial sums with plain `plus`).
template <class T>
struct PlusSquare {
  CUTLASS_HOST_DEVICE T operator()(T const& acc, T const& x) const { return acc + x * x; }
};

// The tile configuration: output tile, cluster, kernel/epilogue schedules and the
// epilogue's subtile (the piece of the output tile one pass of the epilogue handles).
template <class Tile, class Cluster, class KernelSchedule, class EpilogueSchedule,
          class EpilogueTile = cutlass::epilogue::collective::EpilogueTileAuto>
struct Config {
  using TileShape = Tile;
  using ClusterShape = Cluster;
  using Schedule = KernelSchedule;
  using EpiSchedule = EpilogueSchedule;
  using EpiTile = EpilogueTile;
};

// 128 x 128 tiles, no cluster, pingpong: two consumer warpgroups take turns, so one's
// epilogue (the fold's row/column vectors, the residual's two row reductions, the
// activation) runs while the other's main loop keeps the tensor cores busy.  The fastest
// of ten configurations measured on an H100 for both epilogue trees at the t82/bt4 shapes
// (M 16384/65536; e.g. FFN2 65536 x 2304 -> 768 with statistics 348 us against 382 for the
// cooperative 256 x 128 tile used before, cuBLASLt's plain GEMM 333 + LayerNorm 156).
// bench/NOTES.md has the table.  kStatsTileM/N in sm90_gemm.h must match the tile.
using DefaultConfig = Config<cute::Shape<cute::_128, cute::_128, cute::_64>, cute::Shape<cute::_1, cute::_1, cute::_1>,
                             cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                             cutlass::epilogue::TmaWarpSpecialized>;
static_assert(kStatsTileM == 128 && kStatsTileN == 128, "sm90_gemm.h's stats tile is the kernel tile");

// The norm tree with an activation: the same kernel with 64 x 64 epilogue subtiles instead
// of CUTLASS's 64 x 32 (half as many subtile passes, each with twice the independent work,
// so the activation's dependent chain is better hidden).  Measured on an H100 (us, fp16):
// FFN1 + swish 16384 x 768 -> 2304 109 -> 106, 65536 rows 467 -> 429; FFN1 + mish
// 16384 x 1024 -> 1536 104 -> 94, 65536 rows 449 -> 389.  With no activation the 64 x 32
// subtiles stay faster (QKV 16384 x 768 -> 2304: 97 against 100), so both are built.
using NormActConfig = Config<cute::Shape<cute::_128, cute::_128, cute::_64>, cute::Shape<cute::_1, cute::_1, cute::_1>,
                             cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                             cutlass::epilogue::TmaWarpSpecialized, cute::Shape<cute::_64, cute::_64>>;

// The norm tree with no activation and a long main loop (QKV at K >= 1024): cooperative
// 256 x 128 tiles (two warpgroups share B: less shared-memory traffic per FLOP) with
// 128 x 64 subtiles.  The cooperative epilogue is not overlapped, so it pays only where
// the main loop is long: measured (us) QKV 16384 x 1024 -> 3072 200 -> 187, 65536 rows
// 754 -> 682, but 16384 x 768 -> 2304 97 -> 120.
using NormWideConfig = Config<cute::Shape<cute::_256, cute::_128, cute::_64>, cute::Shape<cute::_1, cute::_1, cute::_1>,
                              cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                              cutlass::epilogue::TmaWarpSpecializedCooperative, cute::Shape<cute::_128, cute::_64>>;

namespace fusion = cutlass::epilogue::fusion;
using cute::_0;
using cute::_1;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;
template <class Tile, class E>
using RowVec = fusion::Sm90RowBroadcast<0, Tile, E, float, cute::Stride<_0, _1, int64_t>>;  // [n]
template <class Tile>
using ColVec = fusion::Sm90ColBroadcast<0, Tile, float, float, cute::Stride<_1, _0, int64_t>>;  // [m]
template <template <class> class Fn>
using Op = fusion::Sm90Compute<Fn, float, float, kRound>;

// act(rstd * acc + (shift * colsum + bias))
template <class Tile, class Element, template <class> class Act = RuntimeActivation>
using NormTree = fusion::Sm90EVT<fusion::Sm90Compute<Act, Element, float, kRound>,
    fusion::Sm90EVT<Op<cutlass::homogeneous_multiply_add>,
        ColVec<Tile>,          // rstd (null: alpha)
        fusion::Sm90AccFetch,  // acc
        fusion::Sm90EVT<Op<cutlass::homogeneous_multiply_add>,
            ColVec<Tile>,            // shift (null: 0)
            RowVec<Tile, float>,     // colsum (null: 0)
            RowVec<Tile, Element>>>>;  // bias (null: 0)

// The row sums of Child's value and of its square, per (row, 128-column tile); passes it on.
template <class Tile, class Child>
using RowSums = fusion::Sm90EVT<fusion::Sm90ColReduction<PlusSquare, cutlass::plus, cutlass::plus, 0, Tile, float, float,
                                                         kRound, cute::Stride<_1, _0, int64_t>, 4, true, false>,
    fusion::Sm90EVT<fusion::Sm90ColReduction<cutlass::plus, cutlass::plus, cutlass::plus, 0, Tile, float, float, kRound,
                                             cute::Stride<_1, _0, int64_t>, 4, true, false>,
        Child>>;

// R = (C * rstd + shift) * gamma + beta: the residual input's pending LayerNorm.
template <class Tile, class Element>
using PendingNorm = fusion::Sm90EVT<Op<cutlass::homogeneous_multiply_add>,
    fusion::Sm90EVT<Op<cutlass::homogeneous_multiply_add>,
        fusion::Sm90SrcFetch<Element>,  // C
        ColVec<Tile>,                   // rstd (null: 1)
        ColVec<Tile>>,                  // shift (null: 0)
    RowVec<Tile, Element>,   // gamma (null: 1)
    RowVec<Tile, Element>>;  // beta (null: 0)

// sums(alpha * (acc + bias) + R)
template <class Tile, class Element>
using ResidualTree = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::epilogue::thread::Identity, Element, float, kRound>,
    RowSums<Tile, fusion::Sm90EVT<Op<cutlass::homogeneous_multiply_add>,
        fusion::Sm90ScalarBroadcast<float>,  // alpha
        fusion::Sm90EVT<Op<cutlass::plus>, fusion::Sm90AccFetch, RowVec<Tile, Element>>,  // acc + bias
        PendingNorm<Tile, Element>>>>;

// FP8 (fusedenc.fp8): act(a_scale[m] * (w_scale[n] * acc) + (shift[m] * colsum[n] + bias[n]))
// on e4m3 operands; shift and colsum null (0) but where a LayerNorm is folded (a_scale: rstd).
template <class Tile, class Element>
using Fp8Sum = fusion::Sm90EVT<Op<cutlass::homogeneous_multiply_add>,
    ColVec<Tile>,  // a_scale (rstd)
    fusion::Sm90EVT<Op<cutlass::multiplies>, RowVec<Tile, float>, fusion::Sm90AccFetch>,  // w_scale * acc
    fusion::Sm90EVT<Op<cutlass::homogeneous_multiply_add>,
        ColVec<Tile>,             // shift (null: 0)
        RowVec<Tile, float>,      // colsum (null: 0)
        RowVec<Tile, Element>>>;  // bias (null: 0)
template <class Tile, class Element>
using Fp8Tree = fusion::Sm90EVT<fusion::Sm90Compute<RuntimeActivation, Element, float, kRound>, Fp8Sum<Tile, Element>>;

// e4m3(out_scale[n] * act(...)): the activation in fp32 (not rounded to 16 bits first), one
// saturating conversion (cvt.rn.satfinite).  Act: the run-time switch, or one activation fixed
// at compile time (exact GELU, which the switch lacks: the FP8 fold of BERT-family FFN1s).
template <class Tile, class Element, template <class> class Act = RuntimeActivation>
using Fp8OutTree = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, cutlass::float_e4m3_t, float, kRound>,
    RowVec<Tile, float>,  // out_scale
    fusion::Sm90EVT<fusion::Sm90Compute<Act, float, float, kRound>, Fp8Sum<Tile, Element>>>;

// The FP8 residual: z = alpha * (w_scale[n] * acc + bias) + R (R as in ResidualTree), its row
// statistics, then D = code_scale[n] * aux(inv_code_scale[n] * z) where aux stores e4m3 codes
// of its input (saturating) and passes it on.  With power-of-two scales (fusedenc.fp8's
// rule for these) both products are exact, so D is z rounded once, as ResidualTree's; a
// tree has no node that stores one value and forwards another, hence the round trip.
template <class Tile, class Element, class AuxStore>
using Fp8ResidualTree = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, Element, float, kRound>,
    RowVec<Tile, float>,  // code_scale (null: 1)
    fusion::Sm90EVT<AuxStore,  // codes (null: none)
        fusion::Sm90EVT<Op<cutlass::multiplies>,
            RowVec<Tile, float>,  // inv_code_scale (null: 1)
            RowSums<Tile, fusion::Sm90EVT<Op<cutlass::homogeneous_multiply_add>,
                fusion::Sm90ScalarBroadcast<float>,  // alpha
                fusion::Sm90EVT<Op<cutlass::plus>,   // w_scale * acc + bias
                    fusion::Sm90EVT<Op<cutlass::multiplies>, RowVec<Tile, float>, fusion::Sm90AccFetch>,
                    RowVec<Tile, Element>>,
                PendingNorm<Tile, Element>>>>>>;

// The codes' store: staged through shared memory and written by TMA, like D.
template <class Cfg, class Element>
struct TmaAuxOf {
  using Epi = cutlass::epilogue::collective::detail::EpilogueDescriptor<typename Cfg::TileShape, typename Cfg::EpiTile,
                                                                       Element, Element, typename Cfg::EpiSchedule>;
  using Desc = cutlass::epilogue::collective::detail::AuxStoreDescriptor<Epi, cutlass::layout::RowMajor,
                                                                         cutlass::float_e4m3_t>;
  using type = fusion::Sm90AuxStore<Desc::Stages, typename Epi::EpilogueTile, cutlass::float_e4m3_t, kRound,
                                    typename Desc::Stride, typename Desc::SmemLayoutAtom, typename Desc::CopyOpR2S>;
};
template <class Cfg, class Element>
using TmaAux = typename TmaAuxOf<Cfg, Element>::type;

// FP8 tiles read 128 bytes of K per stage, like the 16-bit tiles' 64 elements.  Hopper's
// fast FP8 accumulation (partial sums stay in the tensor cores' accumulator): measured on
// an H100 at t82's FFN1 (65536 x 2304 x 768, swish) a 128 x 128 pingpong kernel took
// 326 us, the same tile with CUTLASS's accurate main loop (fp32 promotion) 695 us
// pingpong and 399 cooperative, fp16 394, cuBLASLt FP8 + the activation pass 486
// (bench/NOTES.md).  So fp8_gemm sends only fast_accum calls here.  Cooperative 256 x 128
// tiles with 128 x 64 epilogue subtiles, no cluster, measured faster than that pingpong
// tile (e4m3 output, us): 16384 x 768 -> 2304 swish 86 -> 85, 65536 rows 356 -> 303;
// 16384 x 1024 -> 1536 mish 76 -> 71, 65536 rows 337 -> 251.
using Fp8Config = Config<cute::Shape<cute::_256, cute::_128, cute::_128>, cute::Shape<cute::_1, cute::_1, cute::_1>,
                         cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum,
                         cutlass::epilogue::TmaWarpSpecializedCooperative, cute::Shape<cute::_128, cute::_64>>;

// The FP8 residual GEMM: pingpong 128 x 128 tiles (128 bytes of K a stage), so its row
// statistics come per 128-column tile like the 16-bit residual kernel's (kStatsTileM/N) and
// its heavy epilogue overlaps the other warpgroup's main loop; 64 x 32 subtiles, the codes
// staged in shared memory and stored by TMA.  Measured on an H100 (us, 16384 x 768 out, with
// codes): K 768 45.6 and K 2304 60.0, against 50.6 and 71.1 storing the codes from registers;
// 64 x 64 subtiles 68.7 and 91.1 (bench/NOTES.md).  The epilogue bounds it: cuBLASLt's plain
// FP8 GEMM takes 22.3 and 42.2.
using Fp8ResidualConfig = Config<cute::Shape<cute::_128, cute::_128, cute::_128>, cute::Shape<cute::_1, cute::_1, cute::_1>,
                                 cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum,
                                 cutlass::epilogue::TmaWarpSpecialized, cute::Shape<cute::_64, cute::_32>>;

template <class Element, class Tree, bool WithC, class Cfg = DefaultConfig, class ElementAB = Element,
          class ElementD = Element>
struct Kernel {
  using ElementAcc = float;
  using LayoutA = cutlass::layout::RowMajor;     // activations [m, k]
  using LayoutB = cutlass::layout::ColumnMajor;  // weight [n, k]: B = W^T, k contiguous
  using LayoutD = cutlass::layout::RowMajor;     // output [m, n]
  static constexpr int kAlign = 16 / sizeof(Element);
  static constexpr int kAlignAB = 16 / sizeof(ElementAB);
  static constexpr int kAlignD = 16 / sizeof(ElementD);
  using TileShape = typename Cfg::TileShape;
  using ClusterShape = typename Cfg::ClusterShape;
  using ElementC = std::conditional_t<WithC, Element, void>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      typename Cfg::EpiTile, ElementAcc, float, ElementC, LayoutD, kAlign,
      ElementD, LayoutD, kAlignD, typename Cfg::EpiSchedule, Tree>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, LayoutA, kAlignAB, ElementAB,
      LayoutB, kAlignAB, ElementAcc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      typename Cfg::Schedule>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop,
                                                          Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  using EpilogueArgs = typename GemmKernel::CollectiveEpilogue::FusionCallbacks::Arguments;  // the tree's
};

// Returns false, having launched nothing, when CUTLASS cannot run this problem or the
// workspace is too small (the caller falls back or says why); throws on a failed launch.
template <class Gemm, class EpilogueArgs>
bool launch(const GemmArgs& g, int sm_count, EpilogueArgs&& thread_args) {
  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;
  using StrideC = typename Gemm::GemmKernel::StrideC;
  using StrideD = typename Gemm::GemmKernel::StrideD;
  using ElementA = typename Gemm::GemmKernel::ElementA;
  using ElementC = typename Gemm::GemmKernel::ElementC;
  using ElementD = typename Gemm::GemmKernel::ElementD;
  const int m = static_cast<int>(g.m), n = static_cast<int>(g.n), k = static_cast<int>(g.k);
  StrideA sa = cute::make_stride(g.lda, cute::Int<1>{}, int64_t(0));
  StrideB sb = cute::make_stride(g.ldw, cute::Int<1>{}, int64_t(0));
  StrideC sc = cute::make_stride(g.c ? g.ldc : g.ldd, cute::Int<1>{}, int64_t(0));
  StrideD sd = cute::make_stride(g.ldd, cute::Int<1>{}, int64_t(0));
  cutlass::KernelHardwareInfo hw;
  hw.device_id = g.device;
  hw.sm_count = sm_count;
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      {static_cast<const ElementA*>(g.a), sa, static_cast<const ElementA*>(g.w), sb},
      {{}, static_cast<const ElementC*>(g.c), sc, static_cast<ElementD*>(g.d), sd},
      hw};
  args.epilogue.thread = thread_args;
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return false;
  const size_t ws = Gemm::get_workspace_size(args);
  if (ws > g.workspace_bytes) return false;
  // initialize() also sets the kernel's dynamic shared-memory limit, a driver call that
  // costs more host time than the launch (~5-15 us); it is a per-device attribute of the
  // kernel, so it is set once per device and later calls only build the parameters.
  static std::atomic<uint64_t> attribute_set{0};  // bit d: done on device d (d < 64)
  const uint64_t bit = g.device >= 0 && g.device < 64 ? uint64_t{1} << g.device : 0;
  cutlass::Status st;
  if (ws == 0 && bit && (attribute_set.load(std::memory_order_acquire) & bit)) {
    st = gemm.update(args, nullptr);
  } else {
    st = gemm.initialize(args, ws ? g.workspace : nullptr, g.stream);
    if (st == cutlass::Status::kSuccess && bit) attribute_set.fetch_or(bit, std::memory_order_release);
  }
  if (st == cutlass::Status::kSuccess) st = gemm.run(g.stream);
  if (st != cutlass::Status::kSuccess) {
    throw std::runtime_error(std::string("fusedenc sm90 gemm: ") + cutlassGetStatusString(st));
  }
  return true;
}

template <class Element, class Cfg, template <class> class Act>
bool run_norm(const GemmArgs& g, const NormFold& f, int sm_count) {
  using K = Kernel<Element, NormTree<typename Cfg::TileShape, Element, Act>, false, Cfg>;
  const auto bias = static_cast<const Element*>(g.bias);
  typename K::EpilogueArgs t{
      {                                             // rstd * acc + (...)
       {f.rstd, g.alpha, {}},                       //   rstd, null: alpha
       {},                                          //   acc
       {{f.shift, 0.f, {}}, {f.colsum, 0.f, {}}, {bias, Element(0), {}}, {}},  // shift * colsum + bias
       {}},
      {g.act}};                                     // act
  return launch<typename K::Gemm>(g, sm_count, t);
}

template <class Element, class Cfg = DefaultConfig>
bool run_residual(const GemmArgs& g, const ResidualNorm& r, int sm_count) {
  using K = Kernel<Element, ResidualTree<typename Cfg::TileShape, Element>, true, Cfg>;
  const auto bias = static_cast<const Element*>(g.bias);
  const auto gamma = static_cast<const Element*>(r.gamma);
  const auto beta = static_cast<const Element*>(r.beta);
  typename K::EpilogueArgs t{
      {                                  // sumsq
       {                                 //   sum
        {                                //     alpha * (acc + bias) + R
         {{g.alpha}, {}, {}},            //       alpha
         {{}, {bias, Element(0), {}}, {}},  //    acc + bias
         {                               //       R = (C * rstd + shift) * gamma + beta
          {{}, {r.rstd, 1.f, {}}, {r.shift, 0.f, {}}, {}},
          {gamma, Element(1), {}},
          {beta, Element(0), {}},
          {}},
         {}},
        {r.row_sum, 0.f, {}}},
       {r.row_sumsq, 0.f, {}}},
      {}};                               // identity (round to the output type)
  return launch<typename K::Gemm>(g, sm_count, t);
}

// The Fp8Sum arguments (shared by both FP8 trees).
template <class Element>
auto fp8_sum_args(const GemmArgs& g, const Fp8Vectors& v) {
  const auto bias = static_cast<const Element*>(g.bias);
  return typename Fp8Sum<typename Fp8Config::TileShape, Element>::Arguments{
      {v.a_scale, 1.f, {}},                                                       // a_scale
      {{v.w_scale, 1.f, {}}, {}, {}},                                             // w_scale * acc
      {{v.shift, 0.f, {}}, {v.colsum, 0.f, {}}, {bias, Element(0), {}}, {}},      // shift * colsum + bias
      {}};
}

template <class Element>
bool run_fp8(const GemmArgs& g, const Fp8Vectors& v, int sm_count) {
  using K = Kernel<Element, Fp8Tree<typename Fp8Config::TileShape, Element>, false, Fp8Config, cutlass::float_e4m3_t>;
  typename K::EpilogueArgs t{fp8_sum_args<Element>(g, v), {g.act}};  // act(a_scale * (w_scale * acc) + ...)
  return launch<typename K::Gemm>(g, sm_count, t);
}

template <class Element, template <class> class Act = RuntimeActivation>
bool run_fp8_out(const GemmArgs& g, const Fp8Vectors& v, int sm_count) {
  using K = Kernel<Element, Fp8OutTree<typename Fp8Config::TileShape, Element, Act>, false, Fp8Config,
                   cutlass::float_e4m3_t, cutlass::float_e4m3_t>;
  typename K::EpilogueArgs t{
      {v.out_scale, 1.f, {}},                        // out_scale *
      {fp8_sum_args<Element>(g, v), {g.act}},        // act(...)
      {}};
  return launch<typename K::Gemm>(g, sm_count, t);
}

template <class Element>
bool run_fp8_residual(const GemmArgs& g, const float* w_scale, const ResidualNorm& r, const Fp8Codes& codes,
                      int sm_count) {
  using Cfg = Fp8ResidualConfig;
  using Tile = typename Cfg::TileShape;
  using K = Kernel<Element, Fp8ResidualTree<Tile, Element, TmaAux<Cfg, Element>>, true, Cfg, cutlass::float_e4m3_t>;
  const auto bias = static_cast<const Element*>(g.bias);
  const auto gamma = static_cast<const Element*>(r.gamma);
  const auto beta = static_cast<const Element*>(r.beta);
  using StrideAux = cute::Stride<int64_t, _1, int64_t>;
  typename K::EpilogueArgs t{
      {codes.scale, 1.f, {}},                // code_scale *
      {                                      // aux(
       {                                     //   inv_code_scale * sumsq(sum(z))
        {codes.inv_scale, 1.f, {}},
        {                                    //     sumsq
         {                                   //       sum
          {                                  //         z = alpha * (w_scale * acc + bias) + R
           {{g.alpha}, {}, {}},
           {{{w_scale, 1.f, {}}, {}, {}}, {bias, Element(0), {}}, {}},
           {{{}, {r.rstd, 1.f, {}}, {r.shift, 0.f, {}}, {}}, {gamma, Element(1), {}}, {beta, Element(0), {}}, {}},
           {}},
          {r.row_sum, 0.f, {}}},
         {r.row_sumsq, 0.f, {}}},
        {}},
       {static_cast<cutlass::float_e4m3_t*>(codes.q), StrideAux{codes.ldq, _1{}, int64_t(0)}}},
      {}};
  return launch<typename K::Gemm>(g, sm_count, t);
}

}  // namespace sm90
}  // namespace fusedenc

// One unit's instantiation: the functions sm90_gemm.cpp's table points at.
// ACT: the epilogue's activation functor, RuntimeActivation or FixedActivation<...>::Fn.
#define FUSEDENC_SM90_NORM_INSTANCE(NAME, ELEMENT, CONFIG, ACT)                           \
  namespace fusedenc { namespace sm90 {                                                  \
  bool NAME(const GemmArgs& g, const NormFold& f, int sm_count) { return run_norm<ELEMENT, CONFIG, ACT>(g, f, sm_count); } \
  } }
#define FUSEDENC_SM90_RESIDUAL_INSTANCE(NAME, ELEMENT)                                             \
  namespace fusedenc { namespace sm90 {                                                           \
  bool NAME(const GemmArgs& g, const ResidualNorm& r, int sm_count) { return run_residual<ELEMENT>(g, r, sm_count); } \
  } }
#define FUSEDENC_SM90_FP8_INSTANCE(NAME, ELEMENT)                                                  \
  namespace fusedenc { namespace sm90 {                                                           \
  bool NAME(const GemmArgs& g, const Fp8Vectors& v, int sm_count) { return run_fp8<ELEMENT>(g, v, sm_count); } \
  } }
#define FUSEDENC_SM90_FP8_OUT_INSTANCE(NAME, ELEMENT)                                              \
  namespace fusedenc { namespace sm90 {                                                           \
  bool NAME(const GemmArgs& g, const Fp8Vectors& v, int sm_count) { return run_fp8_out<ELEMENT>(g, v, sm_count); } \
  } }
#define FUSEDENC_SM90_FP8_OUT_ACT_INSTANCE(NAME, ELEMENT, ACT)                                     \
  namespace fusedenc { namespace sm90 {                                                           \
  bool NAME(const GemmArgs& g, const Fp8Vectors& v, int sm_count) { return run_fp8_out<ELEMENT, ACT>(g, v, sm_count); } \
  } }
#define FUSEDENC_SM90_FP8_RESIDUAL_INSTANCE(NAME, ELEMENT)                                         \
  namespace fusedenc { namespace sm90 {                                                           \
  bool NAME(const GemmArgs& g, const float* w_scale, const ResidualNorm& r, const Fp8Codes& codes, \
            int sm_count) {                                                                       \
    return run_fp8_residual<ELEMENT>(g, w_scale, r, codes, sm_count);                             \
  } } }
