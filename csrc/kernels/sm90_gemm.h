// sm90_gemm: a Hopper GEMM with bias + any activation in its epilogue.
//
// cuBLASLt fuses only relu and (tanh-)GELU; every other activation (swish, mish,
// relu2, exact GELU) costs a separate pass over the output that reads and writes
// it once more (~10% of an Lc0 or t82 forward).  These kernels are CUTLASS 3
// warp-specialized TMA + wgmma GEMMs (persistent, cooperative schedule) whose
// epilogue adds the bias and applies the activation in fp32 (activations.cuh's
// activate_fast: the pass's formulas with hardware exp and reciprocal).  Compiled
// only when CUTLASS headers are found and sm90 is among the CUDA architectures
// (FUSEDENC_HAVE_SM90_GEMM); on every other build and device the cuBLASLt path
// runs unchanged.
#pragma once

#include "../gemm.h"

namespace fusedenc {

// Whether this build holds the kernel for (dtype, act).
bool sm90_gemm_compiled(DType dtype, Activation act);

// Whether `args` can run on it: compiled, a compute-capability 9.0 device, no
// residual, 16-byte aligned rows and pointers, and enough output tiles to fill
// the chip (small GEMMs stay on cuBLASLt, whose split-K serves them better).
// `why` (optional) receives the reason when the answer is no.
bool sm90_gemm_applies(const GemmArgs& args, const char** why = nullptr);

// D = act(alpha * A W^T + bias) on args.stream.  Call only when sm90_gemm_applies.
// Returns false, having launched nothing, where CUTLASS refuses the problem or the
// workspace is too small: the caller then runs cuBLASLt.
bool sm90_gemm(const GemmArgs& args);

// A/B switch (fusedenc.testing / FUSEDENC_SM90_GEMM=0): off sends every GEMM to cuBLASLt.
void set_sm90_gemm_enabled(bool on);
bool sm90_gemm_enabled();

}  // namespace fusedenc
