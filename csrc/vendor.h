// vendor.h: the one file in fusedenc that names a vendor API.
//
// Every CUDA/cuBLASLt or HIP/hipBLASLt name used by the core is mapped here to a
// neutral name (gpu* for the runtime, blasLt* / BLASLT_* for the GEMM library),
// the way ggml-cuda's vendors/hip.h lets one source tree serve both vendors.
// Code outside this file uses only the neutral names, so a reader never has to
// wonder which vendor a line is for.  Enum *values* differ between the two
// libraries (e.g. GELU_BIAS), so everything is mapped by name, never by number.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

// The e4m3 flavours of FP8 GEMM operands (gpuDeviceFp8Flavour): none, OCP (e4m3fn: NVIDIA,
// AMD gfx95x), FNUZ (e4m3fnuz: AMD gfx94x, MI300).
constexpr int kGpuFp8None = 0, kGpuFp8Ocp = 1, kGpuFp8Fnuz = 2;

#if defined(FUSEDENC_HIP)
// ---------------------------------------------------------------- ROCm / HIP --
#include <hip/hip_runtime.h>
#include <hipblaslt/hipblaslt.h>
// HIPBLASLT_VERSION_MAJOR/MINOR/PATCH (the SWISH_EXT guard and blasLtVersion below).
#include <hipblaslt/hipblaslt-version.h>
#if defined(__HIPCC__)
#include <hip/hip_bf16.h>
#include <hip/hip_fp16.h>
#endif

#define FUSEDENC_VENDOR "hip"
#define FUSEDENC_BLASLT_NAME "hipBLASLt"

using gpuStream_t = hipStream_t;
using gpuError_t = hipError_t;
#define gpuSuccess hipSuccess
#define gpuGetDevice hipGetDevice
#define gpuSetDevice hipSetDevice
#define gpuGetLastError hipGetLastError
#define gpuGetErrorName hipGetErrorName
#define gpuDeviceGetAttribute hipDeviceGetAttribute
#define gpuDevAttrMultiProcessorCount hipDeviceAttributeMultiprocessorCount
#define gpuDevAttrComputeCapabilityMajor hipDeviceAttributeComputeCapabilityMajor
#define gpuDevAttrComputeCapabilityMinor hipDeviceAttributeComputeCapabilityMinor
#define gpuDevAttrWarpSize hipDeviceAttributeWarpSize
#define gpuMemcpy2DAsync hipMemcpy2DAsync
#define gpuMemcpyDefault hipMemcpyDefault
// Lanes per warp (wavefront): 64 on CDNA (gfx9: MI200, MI300, MI350), 32 on RDNA (gfx10-12:
// Radeon, Strix Halo) in its default wave32 mode.  A host pass cannot know which: clang 19
// defines __AMDGCN_WAVEFRONT_SIZE as 64 in the host pass whatever the targets (each device
// pass gets its target's size), newer clang deprecates the macro, and one host binary serves
// every target.  So the reductions are templates on the width (kernels/warp.cuh), compiled for
// 32 and 64, and the host picks one per device from its warpSize attribute (DeviceFacts).
#define FUSEDENC_HAS_WAVE64 1

// The e4m3 flavour the FP8 GEMM reads on `device` (kGpuFp8*), from its architecture name
// ("gfx942:sramecc+:xnack-"): gfx94x (MI300) has the FNUZ e4m3 MFMA, gfx95x (MI350) the OCP
// one (hipBLASLt 1.0+); others have no hipBLASLt FP8 GEMM with per-row scales (gfx12's OCP
// kernels lack the vector scales).  kGpuFp8None sets `why` (when given) to the reason.
// A failed query returns its status with *flavour none and `prop` never read.
inline gpuError_t gpuDeviceFp8Flavour(int device, int* flavour, std::string* why) {
  *flavour = kGpuFp8None;
  hipDeviceProp_t prop{};
  const hipError_t err = hipGetDeviceProperties(&prop, device);
  if (err != hipSuccess) {
    if (why) *why = std::string("hipGetDeviceProperties failed: ") + hipGetErrorName(err);
    return err;
  }
  const std::string arch(prop.gcnArchName, strnlen(prop.gcnArchName, sizeof(prop.gcnArchName)));
  if (arch.rfind("gfx94", 0) == 0) {
    *flavour = kGpuFp8Fnuz;
  } else if (arch.rfind("gfx95", 0) == 0) {
#if defined(HIPBLASLT_VERSION_MAJOR) && HIPBLASLT_VERSION_MAJOR >= 1
    *flavour = kGpuFp8Ocp;
#else
    if (why) *why = "OCP e4m3 GEMMs (gfx95x) need hipBLASLt 1.0 (ROCm 7.0) or newer (this GPU is " + arch + ")";
#endif
  } else if (why) {
    *why = "hipBLASLt runs FP8 GEMMs with per-row scales on gfx94x (MI300, FNUZ e4m3) and gfx95x "
           "(MI350, OCP e4m3) only; this GPU is " + arch;
  }
  return hipSuccess;
}

#if defined(__HIPCC__)
using gpu_half = __half;
using gpu_bf16 = __hip_bfloat16;

// value from the lane whose index is this lane's XOR lane_mask, whole warp.  With lane_mask
// below a width W (a power of two up to the wavefront) the lanes exchange within aligned
// groups of W: a W-lane reduction is correct on wave32 and wave64 hardware alike.
template <typename T>
__device__ __forceinline__ T gpu_shfl_xor(T value, int lane_mask) {
  return __shfl_xor(value, lane_mask);
}
#endif

using blasStatus_t = hipblasStatus_t;
using blasLtHandle_t = hipblasLtHandle_t;
using blasLtMatmulDesc_t = hipblasLtMatmulDesc_t;
using blasLtMatrixLayout_t = hipblasLtMatrixLayout_t;
using blasLtMatmulPreference_t = hipblasLtMatmulPreference_t;
using blasLtMatmulHeuristicResult_t = hipblasLtMatmulHeuristicResult_t;
using blasLtMatmulAlgo_t = hipblasLtMatmulAlgo_t;
using blasLtEpilogue_t = hipblasLtEpilogue_t;
using blasDataType_t = hipDataType;
using blasOperation_t = hipblasOperation_t;

#define BLAS_STATUS_SUCCESS HIPBLAS_STATUS_SUCCESS
#define BLAS_OP_N HIPBLAS_OP_N
#define BLAS_OP_T HIPBLAS_OP_T
#define BLAS_R_16F HIP_R_16F
#define BLAS_R_16BF HIP_R_16BF
#define BLAS_R_32F HIP_R_32F
#define BLAS_COMPUTE_32F HIPBLAS_COMPUTE_32F

#define BLASLT_EPILOGUE_DEFAULT HIPBLASLT_EPILOGUE_DEFAULT
#define BLASLT_EPILOGUE_BIAS HIPBLASLT_EPILOGUE_BIAS
#define BLASLT_EPILOGUE_RELU HIPBLASLT_EPILOGUE_RELU
#define BLASLT_EPILOGUE_RELU_BIAS HIPBLASLT_EPILOGUE_RELU_BIAS
#define BLASLT_EPILOGUE_GELU HIPBLASLT_EPILOGUE_GELU
#define BLASLT_EPILOGUE_GELU_BIAS HIPBLASLT_EPILOGUE_GELU_BIAS

// SWISH_EXT / SWISH_BIAS_EXT arrived with hipBLASLt 1.0 (ROCm 7.0).  Older
// releases get the BIAS epilogue plus our activation kernel instead; the
// capability report says which one a build has.
// FP8 GEMM with one fp32 scale per row of each operand (fusedenc.fp8).  hipBLASLt has
// two APIs for it: 0.10-0.12 (ROCm 6.3/6.4) take the vectors through the
// A/B_SCALE_POINTER_VEC_EXT attributes; 1.0 (ROCm 7.0) removed those (its header turns
// them into static_asserts) for cuBLASLt's A/B_SCALE_MODE = OUTER_VEC_32F with the plain
// scale pointers.  The e4m3 flavour follows the GPU (gpuDeviceFp8Flavour, from the
// arch name): FNUZ (HIP_R_8F_E4M3_FNUZ, ROCm 6.0+) on gfx94x/MI300, OCP (HIP_R_8F_E4M3,
// ROCm 6.3+) on gfx95x, whose FP8 kernels first ship in hipBLASLt 1.0.  hipBLASLt
// has no fast-accumulation switch (MI300's FP8 MFMA always sums in fp32).
#if defined(HIPBLASLT_VERSION_MAJOR) && \
    (HIPBLASLT_VERSION_MAJOR >= 1 || (HIPBLASLT_VERSION_MAJOR == 0 && HIPBLASLT_VERSION_MINOR >= 10))
#define FUSEDENC_HAS_FP8_GEMM 1
#if HIPBLASLT_VERSION_MAJOR >= 1
// The library type of FP8 operands in `flavour` (gpuDeviceFp8Flavour's answer, never none).
inline blasDataType_t blasLtFp8Type(int flavour) {
  return flavour == kGpuFp8Fnuz ? HIP_R_8F_E4M3_FNUZ : HIP_R_8F_E4M3;
}
#define BLASLT_MATMUL_DESC_A_SCALE_POINTER HIPBLASLT_MATMUL_DESC_A_SCALE_POINTER
#define BLASLT_MATMUL_DESC_B_SCALE_POINTER HIPBLASLT_MATMUL_DESC_B_SCALE_POINTER
// Both operands' scales as vectors (A: one per row of op(A), B: one per column of op(B)).
inline blasStatus_t blasLtSetOuterVectorScales(blasLtMatmulDesc_t desc) {
  const hipblasLtMatmulMatrixScale_t mode = HIPBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
  blasStatus_t st = hipblasLtMatmulDescSetAttribute(desc, HIPBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, sizeof(mode));
  if (st != HIPBLAS_STATUS_SUCCESS) return st;
  return hipblasLtMatmulDescSetAttribute(desc, HIPBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode, sizeof(mode));
}
#else
inline blasDataType_t blasLtFp8Type(int flavour) {
  // gpuDeviceFp8Flavour answers OCP only with hipBLASLt 1.0+, and fp8_gemm asks it first.
  if (flavour != kGpuFp8Fnuz) throw std::logic_error("fusedenc: OCP e4m3 operands need hipBLASLt 1.0 or newer");
  return HIP_R_8F_E4M3_FNUZ;
}
// The _VEC_EXT pointer attributes are themselves the vector mode: nothing else to set.
#define BLASLT_MATMUL_DESC_A_SCALE_POINTER HIPBLASLT_MATMUL_DESC_A_SCALE_POINTER_VEC_EXT
#define BLASLT_MATMUL_DESC_B_SCALE_POINTER HIPBLASLT_MATMUL_DESC_B_SCALE_POINTER_VEC_EXT
inline blasStatus_t blasLtSetOuterVectorScales(blasLtMatmulDesc_t) { return HIPBLAS_STATUS_SUCCESS; }
#endif
inline blasStatus_t blasLtSetFastAccum(blasLtMatmulDesc_t, int8_t) { return HIPBLAS_STATUS_SUCCESS; }
#else
#define FUSEDENC_HAS_FP8_GEMM 0
#define FUSEDENC_FP8_MISSING "hipBLASLt older than 0.10 (ROCm 6.3) has no per-row (vector) FP8 scales"
#endif
#if FUSEDENC_HAS_FP8_GEMM && defined(__HIPCC__)
// e4m3 codes are written by fusedenc's own bit-exact conversion (kernels/fp8_convert.h),
// FNUZ or OCP as the kernel's argument says: ROCm 6.x's hip_fp8.h picks one flavour per
// build target, and our reference (torch's conversion after a clamp) is the contract.
#include "kernels/fp8_convert.h"
struct gpu_fp8_e4m3 {
  uint8_t __x;
};
// OCP e4m3 from fp32, rounded to nearest even, saturating to +-448 (NaN stays NaN).
__device__ __forceinline__ gpu_fp8_e4m3 gpu_to_e4m3(float v) {
  return gpu_fp8_e4m3{fusedenc::fp8_e4m3_from_float(v, fusedenc::Fp8Format::e4m3fn)};
}
// Two of them, a's code in the low byte.
__device__ __forceinline__ uint16_t gpu_to_e4m3x2(float a, float b) {
  return static_cast<uint16_t>(gpu_to_e4m3(a).__x | (gpu_to_e4m3(b).__x << 8));
}
#endif

#if defined(HIPBLASLT_VERSION_MAJOR) && HIPBLASLT_VERSION_MAJOR >= 1
#define FUSEDENC_HAS_SWISH_EPILOGUE 1
#define BLASLT_EPILOGUE_SWISH HIPBLASLT_EPILOGUE_SWISH_EXT
#define BLASLT_EPILOGUE_SWISH_BIAS HIPBLASLT_EPILOGUE_SWISH_BIAS_EXT
#else
#define FUSEDENC_HAS_SWISH_EPILOGUE 0
#endif

#define BLASLT_MATMUL_DESC_TRANSA HIPBLASLT_MATMUL_DESC_TRANSA
#define BLASLT_MATMUL_DESC_TRANSB HIPBLASLT_MATMUL_DESC_TRANSB
#define BLASLT_MATMUL_DESC_EPILOGUE HIPBLASLT_MATMUL_DESC_EPILOGUE
#define BLASLT_MATMUL_DESC_BIAS_POINTER HIPBLASLT_MATMUL_DESC_BIAS_POINTER
#define BLASLT_MATMUL_DESC_BIAS_DATA_TYPE HIPBLASLT_MATMUL_DESC_BIAS_DATA_TYPE
#define BLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES HIPBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES

#define blasLtCreate hipblasLtCreate
#define blasLtMatmulDescCreate hipblasLtMatmulDescCreate
#define blasLtMatmulDescDestroy hipblasLtMatmulDescDestroy
#define blasLtMatmulDescSetAttribute hipblasLtMatmulDescSetAttribute
#define blasLtMatrixLayoutCreate hipblasLtMatrixLayoutCreate
#define blasLtMatrixLayoutDestroy hipblasLtMatrixLayoutDestroy
#define blasLtMatmulPreferenceCreate hipblasLtMatmulPreferenceCreate
#define blasLtMatmulPreferenceDestroy hipblasLtMatmulPreferenceDestroy
#define blasLtMatmulPreferenceSetAttribute hipblasLtMatmulPreferenceSetAttribute
#define blasLtMatmulAlgoGetHeuristic hipblasLtMatmulAlgoGetHeuristic
#define blasLtMatmul hipblasLtMatmul

// hipBLASLt has no minimum-alignment preferences: its heuristic checks the
// pointers itself.  Our callers guarantee 16-byte alignment anyway.
inline blasStatus_t blasLtSetAlignmentPreferences(blasLtMatmulPreference_t, uint32_t, uint32_t,
                                                  uint32_t, uint32_t) {
  return HIPBLAS_STATUS_SUCCESS;
}

inline const char* blasLtStatusName(blasStatus_t status) {
  switch (status) {
    case HIPBLAS_STATUS_SUCCESS: return "HIPBLAS_STATUS_SUCCESS";
    case HIPBLAS_STATUS_NOT_INITIALIZED: return "HIPBLAS_STATUS_NOT_INITIALIZED";
    case HIPBLAS_STATUS_ALLOC_FAILED: return "HIPBLAS_STATUS_ALLOC_FAILED";
    case HIPBLAS_STATUS_INVALID_VALUE: return "HIPBLAS_STATUS_INVALID_VALUE";
    case HIPBLAS_STATUS_MAPPING_ERROR: return "HIPBLAS_STATUS_MAPPING_ERROR";
    case HIPBLAS_STATUS_EXECUTION_FAILED: return "HIPBLAS_STATUS_EXECUTION_FAILED";
    case HIPBLAS_STATUS_INTERNAL_ERROR: return "HIPBLAS_STATUS_INTERNAL_ERROR";
    case HIPBLAS_STATUS_NOT_SUPPORTED: return "HIPBLAS_STATUS_NOT_SUPPORTED";
    case HIPBLAS_STATUS_ARCH_MISMATCH: return "HIPBLAS_STATUS_ARCH_MISMATCH";
    case HIPBLAS_STATUS_HANDLE_IS_NULLPTR: return "HIPBLAS_STATUS_HANDLE_IS_NULLPTR";
    case HIPBLAS_STATUS_INVALID_ENUM: return "HIPBLAS_STATUS_INVALID_ENUM";
    default: return "HIPBLAS_STATUS_UNKNOWN";
  }
}

// Version of the library the core was compiled against, as major*10000 +
// minor*100 + patch (hipBLASLt's own runtime query needs a handle; the SONAME
// pins the major version).
inline long blasLtVersion() {
  return HIPBLASLT_VERSION_MAJOR * 10000L + HIPBLASLT_VERSION_MINOR * 100L + HIPBLASLT_VERSION_PATCH;
}

// Algorithm identity, for choosing among heuristic candidates by measurement.
// hipBLASLt keeps the solution index in the first int of the opaque algo (what
// hipblaslt_ext::getIndexFromAlgo reads, and PyTorch's TunableOp without that
// header); the rest of the struct may hold padding, so only the index is compared.
inline int blasLtAlgoSolutionIndex(const blasLtMatmulAlgo_t& algo) {
  int index = -1;
  std::memcpy(&index, &algo, sizeof(index));
  return index;
}
inline bool blasLtSameAlgo(const blasLtMatmulAlgo_t& a, const blasLtMatmulAlgo_t& b) {
  return blasLtAlgoSolutionIndex(a) == blasLtAlgoSolutionIndex(b);
}
// A short, stable description of a heuristic result: equal strings mean the
// same kernel configuration within one library version.
inline std::string blasLtDescribeAlgo(const blasLtMatmulHeuristicResult_t& r) {
  return "solution=" + std::to_string(blasLtAlgoSolutionIndex(r.algo));
}

#else
// ------------------------------------------------------------ NVIDIA / CUDA --
#include <cublasLt.h>
#include <cuda_runtime_api.h>
#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#define FUSEDENC_VENDOR "cuda"
#define FUSEDENC_BLASLT_NAME "cuBLASLt"

using gpuStream_t = cudaStream_t;
using gpuError_t = cudaError_t;
#define gpuSuccess cudaSuccess
#define gpuGetDevice cudaGetDevice
#define gpuSetDevice cudaSetDevice
#define gpuGetLastError cudaGetLastError
#define gpuGetErrorName cudaGetErrorName
#define gpuDeviceGetAttribute cudaDeviceGetAttribute
#define gpuDevAttrMultiProcessorCount cudaDevAttrMultiProcessorCount
#define gpuDevAttrComputeCapabilityMajor cudaDevAttrComputeCapabilityMajor
#define gpuDevAttrComputeCapabilityMinor cudaDevAttrComputeCapabilityMinor
#define gpuDevAttrWarpSize cudaDevAttrWarpSize
#define gpuMemcpy2DAsync cudaMemcpy2DAsync
#define gpuMemcpyDefault cudaMemcpyDefault
// Every NVIDIA GPU has 32-lane warps (kernels/warp.cuh).
#define FUSEDENC_HAS_WAVE64 0

// The e4m3 flavour the FP8 GEMM reads on `device` (kGpuFp8*): OCP from compute capability
// 9.0 on (cuBLASLt's outer-vector scales), none before (`why`, when given, says so).
inline gpuError_t gpuDeviceFp8Flavour(int device, int* flavour, std::string* why) {
  int major = 0, minor = 0;
  cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (err != cudaSuccess) return err;
  *flavour = major >= 9 ? kGpuFp8Ocp : kGpuFp8None;
  if (*flavour == kGpuFp8None && why) {
    *why = "FP8 GEMMs with per-row scales need compute capability 9.0 or newer (this GPU has " +
           std::to_string(major) + "." + std::to_string(minor) + ")";
  }
  return cudaSuccess;
}

#if defined(__CUDACC__)
using gpu_half = __half;
using gpu_bf16 = __nv_bfloat16;

// value from the lane whose index is this lane's XOR lane_mask; every lane of
// the warp must take part (no divergent early exit before a call).  With lane_mask below
// a width W (a power of two up to 32) the lanes exchange within aligned groups of W.
template <typename T>
__device__ __forceinline__ T gpu_shfl_xor(T value, int lane_mask) {
  return __shfl_xor_sync(0xffffffffu, value, lane_mask);
}
#endif

using blasStatus_t = cublasStatus_t;
using blasLtHandle_t = cublasLtHandle_t;
using blasLtMatmulDesc_t = cublasLtMatmulDesc_t;
using blasLtMatrixLayout_t = cublasLtMatrixLayout_t;
using blasLtMatmulPreference_t = cublasLtMatmulPreference_t;
using blasLtMatmulHeuristicResult_t = cublasLtMatmulHeuristicResult_t;
using blasLtMatmulAlgo_t = cublasLtMatmulAlgo_t;
using blasLtEpilogue_t = cublasLtEpilogue_t;
using blasDataType_t = cudaDataType_t;
using blasOperation_t = cublasOperation_t;

#define BLAS_STATUS_SUCCESS CUBLAS_STATUS_SUCCESS
#define BLAS_OP_N CUBLAS_OP_N
#define BLAS_OP_T CUBLAS_OP_T
#define BLAS_R_16F CUDA_R_16F
#define BLAS_R_16BF CUDA_R_16BF
#define BLAS_R_32F CUDA_R_32F
#define BLAS_COMPUTE_32F CUBLAS_COMPUTE_32F

#define BLASLT_EPILOGUE_DEFAULT CUBLASLT_EPILOGUE_DEFAULT
#define BLASLT_EPILOGUE_BIAS CUBLASLT_EPILOGUE_BIAS
#define BLASLT_EPILOGUE_RELU CUBLASLT_EPILOGUE_RELU
#define BLASLT_EPILOGUE_RELU_BIAS CUBLASLT_EPILOGUE_RELU_BIAS
#define BLASLT_EPILOGUE_GELU CUBLASLT_EPILOGUE_GELU
#define BLASLT_EPILOGUE_GELU_BIAS CUBLASLT_EPILOGUE_GELU_BIAS

// cuBLASLt has no swish/SiLU epilogue: BIAS plus our activation kernel.
#define FUSEDENC_HAS_SWISH_EPILOGUE 0

// FP8 GEMM with one fp32 scale per row of each operand (outer-vector scaling):
// cuBLASLt 12.9+ on Hopper.  e4m3 storage and conversions come from cuda_fp8.h.
#if defined(CUBLAS_VERSION) && CUBLAS_VERSION >= 120900
#define FUSEDENC_HAS_FP8_GEMM 1
#define BLASLT_MATMUL_DESC_A_SCALE_POINTER CUBLASLT_MATMUL_DESC_A_SCALE_POINTER
#define BLASLT_MATMUL_DESC_B_SCALE_POINTER CUBLASLT_MATMUL_DESC_B_SCALE_POINTER
// The library type of FP8 operands (OCP e4m3, the only flavour gpuDeviceFp8Flavour gives here).
inline blasDataType_t blasLtFp8Type(int) { return CUDA_R_8F_E4M3; }
// Both operands' scales as vectors (A: one per row of op(A), B: one per column of op(B)).
inline blasStatus_t blasLtSetOuterVectorScales(blasLtMatmulDesc_t desc) {
  const int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
  blasStatus_t st = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, sizeof(mode));
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  return cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode, sizeof(mode));
}
inline blasStatus_t blasLtSetFastAccum(blasLtMatmulDesc_t desc, int8_t fast) {
  return cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast));
}
#else
#define FUSEDENC_HAS_FP8_GEMM 0
#define FUSEDENC_FP8_MISSING "cuBLASLt older than 12.9 has no per-row (outer-vector) FP8 scales"
#endif
#if FUSEDENC_HAS_FP8_GEMM && defined(__CUDACC__)
#include <cuda_fp8.h>
using gpu_fp8_e4m3 = __nv_fp8_e4m3;
// e4m3 from fp32, rounded to nearest even, saturating to +-448 (NaN stays NaN).
__device__ __forceinline__ gpu_fp8_e4m3 gpu_to_e4m3(float v) {
  gpu_fp8_e4m3 out;
  out.__x = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
  return out;
}
// Two of them in one instruction, a's code in the low byte.
__device__ __forceinline__ uint16_t gpu_to_e4m3x2(float a, float b) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
}
#endif

#define BLASLT_MATMUL_DESC_TRANSA CUBLASLT_MATMUL_DESC_TRANSA
#define BLASLT_MATMUL_DESC_TRANSB CUBLASLT_MATMUL_DESC_TRANSB
#define BLASLT_MATMUL_DESC_EPILOGUE CUBLASLT_MATMUL_DESC_EPILOGUE
#define BLASLT_MATMUL_DESC_BIAS_POINTER CUBLASLT_MATMUL_DESC_BIAS_POINTER
#define BLASLT_MATMUL_DESC_BIAS_DATA_TYPE CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE
#define BLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES

#define blasLtCreate cublasLtCreate
#define blasLtMatmulDescCreate cublasLtMatmulDescCreate
#define blasLtMatmulDescDestroy cublasLtMatmulDescDestroy
#define blasLtMatmulDescSetAttribute cublasLtMatmulDescSetAttribute
#define blasLtMatrixLayoutCreate cublasLtMatrixLayoutCreate
#define blasLtMatrixLayoutDestroy cublasLtMatrixLayoutDestroy
#define blasLtMatmulPreferenceCreate cublasLtMatmulPreferenceCreate
#define blasLtMatmulPreferenceDestroy cublasLtMatmulPreferenceDestroy
#define blasLtMatmulPreferenceSetAttribute cublasLtMatmulPreferenceSetAttribute
#define blasLtMatmulAlgoGetHeuristic cublasLtMatmulAlgoGetHeuristic
#define blasLtMatmul cublasLtMatmul

// The heuristic may pick kernels that assume more alignment than a call's
// pointers have unless it is told the real alignment (PyTorch does the same).
inline blasStatus_t blasLtSetAlignmentPreferences(blasLtMatmulPreference_t pref, uint32_t a,
                                                  uint32_t b, uint32_t c, uint32_t d) {
  const struct {
    cublasLtMatmulPreferenceAttributes_t attr;
    uint32_t bytes;
  } items[] = {{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, a},
               {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, b},
               {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, c},
               {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, d}};
  for (const auto& item : items) {
    blasStatus_t st =
        cublasLtMatmulPreferenceSetAttribute(pref, item.attr, &item.bytes, sizeof(item.bytes));
    if (st != CUBLAS_STATUS_SUCCESS) return st;
  }
  return CUBLAS_STATUS_SUCCESS;
}

inline const char* blasLtStatusName(blasStatus_t status) { return cublasLtGetStatusName(status); }

// Runtime version of the loaded cuBLASLt, as major*10000 + minor*100 + patch.
inline long blasLtVersion() { return static_cast<long>(cublasLtGetVersion()); }

// Algorithm identity, for choosing among heuristic candidates by measurement.
// cuBLASLt documents cublasLtMatmulAlgo_t as trivially serializable (plain
// uint64_t data[8]), so bytes compare.
inline bool blasLtSameAlgo(const blasLtMatmulAlgo_t& a, const blasLtMatmulAlgo_t& b) {
  return std::memcmp(&a, &b, sizeof(blasLtMatmulAlgo_t)) == 0;
}
// A short, stable description of a heuristic result: the algorithm id and its
// configuration (tile, stages, split-K, reduction, swizzle, custom option,
// inner shape, cluster shape).  Equal strings mean the same kernel
// configuration within one library version.  Attributes the library cannot
// report read as "?".
inline std::string blasLtDescribeAlgo(const blasLtMatmulHeuristicResult_t& r) {
  const struct {
    cublasLtMatmulAlgoConfigAttributes_t attr;
    const char* name;
  } items[] = {{CUBLASLT_ALGO_CONFIG_ID, "algo"},
               {CUBLASLT_ALGO_CONFIG_TILE_ID, "tile"},
               {CUBLASLT_ALGO_CONFIG_STAGES_ID, "stages"},
               {CUBLASLT_ALGO_CONFIG_SPLITK_NUM, "splitk"},
               {CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, "reduction"},
               {CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, "swizzle"},
               {CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, "custom"},
               {CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, "inner"},
               {CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, "cluster"}};
  std::string out;
  for (const auto& item : items) {
    // Ask for the attribute's size first: int32, uint32 or uint16 by attribute.
    size_t size = 0;
    std::string value = "?";
    if (cublasLtMatmulAlgoConfigGetAttribute(&r.algo, item.attr, nullptr, 0, &size) ==
            CUBLAS_STATUS_SUCCESS &&
        size > 0 && size <= sizeof(uint64_t)) {
      uint64_t raw = 0;  // little-endian: the low bytes hold the value
      size_t written = 0;
      if (cublasLtMatmulAlgoConfigGetAttribute(&r.algo, item.attr, &raw, size, &written) ==
          CUBLAS_STATUS_SUCCESS) {
        if (size == sizeof(int32_t) && item.attr == CUBLASLT_ALGO_CONFIG_ID) {
          int32_t v = 0;
          std::memcpy(&v, &raw, sizeof(v));
          value = std::to_string(v);
        } else {
          value = std::to_string(raw);
        }
      }
    }
    if (!out.empty()) out += " ";
    out += std::string(item.name) + "=" + value;
  }
  return out;
}

#endif

// ------------------------------------------------------------ both vendors --
// The heuristic result struct has the same fields in both libraries; these
// accessors keep its member names (a vendor API) in this file.
inline bool blasLtHeuristicUsable(const blasLtMatmulHeuristicResult_t& r) {
  return r.state == BLAS_STATUS_SUCCESS;
}
inline const blasLtMatmulAlgo_t& blasLtHeuristicAlgo(const blasLtMatmulHeuristicResult_t& r) {
  return r.algo;
}
inline size_t blasLtHeuristicWorkspaceBytes(const blasLtMatmulHeuristicResult_t& r) {
  return r.workspaceSize;
}
inline float blasLtHeuristicWaves(const blasLtMatmulHeuristicResult_t& r) { return r.wavesCount; }

// One library handle per (device, stream) is what both libraries accept:
// hipBLASLt requires it, cuBLASLt allows it.
