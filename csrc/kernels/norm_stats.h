// norm_stats: a LayerNorm's row statistics from the partial sums a residual GEMM
// epilogue wrote (sm90_gemm.h's ResidualNorm), for the GEMMs that fold the norm.
//
// For each of `rows` rows of a `cols`-wide z: sum = sum over the `tiles` partials of
// row_sum, sumsq likewise; mean = sum / cols, var = max(sumsq / cols - mean^2, 0)
// (the biased variance, like torch); rstd = 1 / sqrt(var + eps), shift = -mean * rstd,
// so that LN(z) = (z * rstd + shift) * gamma + beta.  Partials are laid out
// [tiles][ld] (fp32, ld >= rows); outputs are fp32 [rows].  Vendor-neutral.
#pragma once

#include <cstdint>

#include "../common.h"

namespace fusedenc {

struct NormStatsArgs {
  int64_t rows = 0, cols = 0;
  int64_t tiles = 0, ld = 0;
  const float* row_sum = nullptr;
  const float* row_sumsq = nullptr;
  float* rstd = nullptr;
  float* shift = nullptr;
  float eps = 1e-5f;
};

// Checks the arguments (throws std::invalid_argument), then launches on `stream`.
void norm_stats(const NormStatsArgs& args, gpuStream_t stream);

}  // namespace fusedenc
