// warp.cuh: which warp width a launch's reductions are instantiated for.
//
// The kernels that reduce across lanes (layer_norm, fp8_quantize) are templates on the width
// W: shuffles with xor offsets below W, then a pass over the block's W-lane groups through
// shared memory.  The code is the same for every W; the host picks W per launch
// (common.h's reduction_warp_width: the device's own, 32 on NVIDIA and RDNA, 64 on CDNA), so
// no macro has to guess a device's wavefront size in a host pass.  Include from .cu files only.
#pragma once

#include <stdexcept>
#include <string>
#include <type_traits>

#include "../common.h"

namespace fusedenc {

template <int W>
using WarpWidth = std::integral_constant<int, W>;

// Calls launch(WarpWidth<W>{}) for W = `width`, one of compiled_warp_widths().
template <typename Launch>
void with_warp_width(int width, Launch&& launch) {
  switch (width) {
#if defined(FUSEDENC_NARROW_WARP_TESTS)
    case 16: launch(WarpWidth<16>{}); return;
#endif
    case 32: launch(WarpWidth<32>{}); return;
#if FUSEDENC_HAS_WAVE64
    case 64: launch(WarpWidth<64>{}); return;
#endif
    default:
      throw std::logic_error("fusedenc: no reduction kernels for a warp of " + std::to_string(width) + " lanes");
  }
}

}  // namespace fusedenc
