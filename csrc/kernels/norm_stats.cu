// One thread per row: `tiles` (a handful) partial sums each, coalesced across the
// warp because the partials are row-major in the row index.  The final subtraction
// sumsq / cols - mean^2 is done in double: it cancels when |mean| >> std.
#include "norm_stats.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace fusedenc {
namespace {

__global__ void norm_stats_kernel(NormStatsArgs a) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= a.rows) return;
  float sum = 0.f, sumsq = 0.f;
  for (int64_t t = 0; t < a.tiles; ++t) {
    sum += a.row_sum[t * a.ld + row];
    sumsq += a.row_sumsq[t * a.ld + row];
  }
  const double mean = static_cast<double>(sum) / static_cast<double>(a.cols);
  double var = static_cast<double>(sumsq) / static_cast<double>(a.cols) - mean * mean;
  var = var < 0.0 ? 0.0 : var;
  const float rstd = static_cast<float>(1.0 / sqrt(var + static_cast<double>(a.eps)));
  a.rstd[row] = rstd;
  a.shift[row] = static_cast<float>(-mean) * rstd;
}

[[noreturn]] void bad(const std::string& what) { throw std::invalid_argument("fusedenc norm_stats: " + what); }

}  // namespace

void norm_stats(const NormStatsArgs& a, gpuStream_t stream) {
  if (a.rows < 0 || a.cols <= 0 || a.tiles <= 0 || a.ld < a.rows)
    bad("rows=" + std::to_string(a.rows) + ", cols=" + std::to_string(a.cols) + ", tiles=" +
        std::to_string(a.tiles) + ", ld=" + std::to_string(a.ld) + ": need rows >= 0, cols > 0, tiles > 0, ld >= rows");
  if (!std::isfinite(a.eps) || a.eps < 0.f) bad("eps must be finite and >= 0");
  if (a.rows == 0) return;
  if (!a.row_sum || !a.row_sumsq || !a.rstd || !a.shift) bad("null pointer");
  constexpr int kThreads = 256;
  const int64_t blocks = (a.rows + kThreads - 1) / kThreads;
  if (blocks > 0x7fffffff) bad("too many rows");
  norm_stats_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
  FUSEDENC_CHECK_GPU(gpuGetLastError());
}

}  // namespace fusedenc
