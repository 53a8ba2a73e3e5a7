// common.h: the core's vocabulary (dtypes, activations) and error helpers.
// Vendor-neutral: everything vendor-specific comes from vendor.h.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "vendor.h"

namespace fusedenc {

// Numbering is part of the Python <-> C++ contract (fusedenc/_native.py).
enum class DType : int { f16 = 0, bf16 = 1, f32 = 2 };

enum class Activation : int {
  none = 0,
  relu = 1,
  gelu_tanh = 2,
  gelu = 3,  // exact, erf-based
  swish = 4, // SiLU: x * sigmoid(x)
  mish = 5,
  relu2 = 6, // relu(x)^2
  selu = 7,
  tanh = 8,
  sigmoid = 9,
};
constexpr int kNumActivations = 10;

inline const char* activation_name(Activation a) {
  static const char* names[kNumActivations] = {"none",  "relu",  "gelu_tanh", "gelu",
                                               "swish", "mish",  "relu2",     "selu",
                                               "tanh",  "sigmoid"};
  int i = static_cast<int>(a);
  return (i >= 0 && i < kNumActivations) ? names[i] : "invalid";
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
    case DType::f32: return "float32";
  }
  return "invalid";
}

inline int dtype_size(DType t) { return t == DType::f32 ? 4 : 2; }

// Library and runtime failures become std::runtime_error (RuntimeError in
// Python) naming the call and the status; bad arguments that slipped past the
// Python checks become std::invalid_argument (ValueError).
[[noreturn]] inline void throw_blas(const char* what, blasStatus_t st) {
  throw std::runtime_error(std::string(FUSEDENC_BLASLT_NAME) + ": " + what + " failed with " +
                           blasLtStatusName(st));
}
[[noreturn]] inline void throw_gpu(const char* what, gpuError_t err) {
  throw std::runtime_error(std::string(FUSEDENC_VENDOR) + " runtime: " + what + " failed with " +
                           gpuGetErrorName(err));
}

#define FUSEDENC_CHECK_BLAS(expr)                                  \
  do {                                                             \
    blasStatus_t fusedenc_st_ = (expr);                            \
    if (fusedenc_st_ != BLAS_STATUS_SUCCESS) ::fusedenc::throw_blas(#expr, fusedenc_st_); \
  } while (0)

#define FUSEDENC_CHECK_GPU(expr)                                   \
  do {                                                             \
    gpuError_t fusedenc_err_ = (expr);                             \
    if (fusedenc_err_ != gpuSuccess) ::fusedenc::throw_gpu(#expr, fusedenc_err_); \
  } while (0)

// What the kernels' launch decisions need to know about a device, queried once per
// device (the attribute queries are cheap but not free on a hot path).
struct DeviceFacts {
  int sm_count = 0;
  int cc_major = 0, cc_minor = 0;  // compute capability (HIP: as the runtime reports it)
  int fp8_flavour = kGpuFp8None;   // the e4m3 flavour FP8 GEMMs read here (vendor.h)
  int warp_size = 0;               // lanes per warp: 32, or 64 on AMD's CDNA GPUs
};

// By value: a reference into the table would dangle once another device grows it.
inline DeviceFacts device_facts(int device) {
  static std::mutex mu;
  static std::vector<DeviceFacts> table;
  std::lock_guard<std::mutex> lock(mu);
  if (device >= static_cast<int>(table.size())) table.resize(device + 1);
  DeviceFacts& f = table[device];
  if (f.sm_count == 0) {
    FUSEDENC_CHECK_GPU(gpuDeviceGetAttribute(&f.cc_major, gpuDevAttrComputeCapabilityMajor, device));
    FUSEDENC_CHECK_GPU(gpuDeviceGetAttribute(&f.cc_minor, gpuDevAttrComputeCapabilityMinor, device));
    FUSEDENC_CHECK_GPU(gpuDeviceFp8Flavour(device, &f.fp8_flavour, nullptr));
    FUSEDENC_CHECK_GPU(gpuDeviceGetAttribute(&f.warp_size, gpuDevAttrWarpSize, device));
    FUSEDENC_CHECK_GPU(gpuDeviceGetAttribute(&f.sm_count, gpuDevAttrMultiProcessorCount, device));
  }
  return f;
}

// ---- warp widths of the reductions (kernels/warp.cuh) ----
// The LayerNorm and FP8-quantization kernels reduce across a warp with shuffles, then across
// warps through shared memory; the width W is a template parameter.  Any power of two up to
// the hardware warp is correct (the shuffles stay inside aligned groups of W lanes), so the
// host picks the device's own width, and a test may force a narrower one that the build holds.
inline std::vector<int> compiled_warp_widths() {
  std::vector<int> widths;
#if defined(FUSEDENC_NARROW_WARP_TESTS)
  widths.push_back(16);
#endif
  widths.push_back(32);
#if FUSEDENC_HAS_WAVE64
  widths.push_back(64);
#endif
  return widths;
}

// 0: each device's own width; else a width of compiled_warp_widths() (tests).
inline std::atomic<int>& forced_warp_width() {
  static std::atomic<int> width{0};
  return width;
}

inline void set_forced_warp_width(int width) {
  if (width != 0) {
    bool known = false;
    for (int w : compiled_warp_widths()) known = known || w == width;
    if (!known)
      throw std::invalid_argument("warp width " + std::to_string(width) +
                                  " is not one this build's reductions are compiled for");
  }
  forced_warp_width().store(width, std::memory_order_relaxed);
}

// The width the reductions use on the current device: a forced one if set (never more than
// the hardware's: the shuffles would reach lanes that do not exist), else the device's own.
inline int reduction_warp_width() {
#if FUSEDENC_HAS_WAVE64
  int device = 0;
  FUSEDENC_CHECK_GPU(gpuGetDevice(&device));
  const int hardware = device_facts(device).warp_size;  // 32 or 64 on AMD GPUs
#else
  const int hardware = 32;  // every NVIDIA GPU: no query on the launch path
#endif
  const int forced = forced_warp_width().load(std::memory_order_relaxed);
  if (forced == 0) return hardware;
  if (forced > hardware)
    throw std::invalid_argument("forced warp width " + std::to_string(forced) + " exceeds this GPU's " +
                                std::to_string(hardware) + " lanes");
  return forced;
}

// Makes `device` current for the guard's lifetime and restores the caller's
// device after, so the core never leaves the process on another device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    FUSEDENC_CHECK_GPU(gpuGetDevice(&previous_));
    if (previous_ != device) FUSEDENC_CHECK_GPU(gpuSetDevice(device));
    switched_ = previous_ != device;
  }
  ~DeviceGuard() {
    if (switched_) (void)gpuSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

}  // namespace fusedenc
