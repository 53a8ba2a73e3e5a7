// bias_activation: the elementwise epilogue the GEMM library cannot do itself.
//
// d[i, j] = act(d[i, j] + bias[j])   in place, on an [m, n] row-major matrix
// with row stride ldd, math in fp32, one 16-byte load and store per thread.
#pragma once

#include <cstdint>

#include "../common.h"

namespace fusedenc {

// Requires n and ldd to be multiples of 16 bytes / element size and d, bias
// 16-byte aligned (throws std::invalid_argument otherwise). bias may be null.
// Launches asynchronously on `stream` (on the current device).
void bias_activation(void* d, int64_t ldd, int64_t m, int64_t n, const void* bias, DType dtype,
                     Activation act, gpuStream_t stream);

}  // namespace fusedenc
