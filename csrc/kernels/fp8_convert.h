// fp8_convert.h: fp32 -> e4m3 codes in both flavours the core writes, bit-exact, with no
// vendor header (so it also compiles as plain host C++ and can be checked against torch):
//
//   e4m3fn   (OCP; NVIDIA, gfx95x; torch.float8_e4m3fn):   bias 7, largest 448, NaN 0x7f/0xff, -0 exists
//   e4m3fnuz (gfx94x / MI300; torch.float8_e4m3fnuz):      bias 8, largest 240, NaN 0x80 only, no -0
//
// Rounding is to nearest even; magnitudes at or above the largest finite value (inf too)
// saturate to it, NaN stays NaN.  That is torch's `.to(dtype)` of the value clamped to
// +-max first (torch itself turns overflow into NaN), the rule fusedenc.fp8 writes down.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define FUSEDENC_HOST_DEVICE __host__ __device__
#else
#define FUSEDENC_HOST_DEVICE
#endif

namespace fusedenc {

// Bit casts that work in host code (memcpy) and device code (the intrinsics; device
// memcpy is not declared in every HIP toolchain).
FUSEDENC_HOST_DEVICE inline uint32_t fp8_bits_of(float v) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return __float_as_uint(v);
#else
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  return b;
#endif
}
FUSEDENC_HOST_DEVICE inline float fp8_float_of(uint32_t b) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return __uint_as_float(b);
#else
  float v;
  std::memcpy(&v, &b, sizeof(v));
  return v;
#endif
}

// Numbering is part of the Python <-> C++ contract (fusedenc/core/fp8.py, FP8_FORMATS).
enum class Fp8Format : int { e4m3fn = 0, e4m3fnuz = 1 };

FUSEDENC_HOST_DEVICE inline float fp8_max(Fp8Format f) { return f == Fp8Format::e4m3fnuz ? 240.f : 448.f; }

FUSEDENC_HOST_DEVICE inline uint8_t fp8_e4m3_from_float(float v, Fp8Format f) {
  const bool fnuz = f == Fp8Format::e4m3fnuz;
  const uint32_t bits = fp8_bits_of(v);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t mag = bits & 0x7fffffffu;
  if (mag > 0x7f800000u) return fnuz ? 0x80 : static_cast<uint8_t>(sign | 0x7f);  // NaN
  const float a = fp8_float_of(mag);
  // Largest finite code: exponent field 15 with mantissa 7 (FNUZ: 1.875 * 2^7) or 6
  // (OCP: 1.75 * 2^8; mantissa 7 there is NaN).
  if (a >= fp8_max(f)) return static_cast<uint8_t>(sign | (fnuz ? 0x7f : 0x7e));
  const int bias = fnuz ? 8 : 7;
  // The value's binade, no lower than the smallest normal's: within it the codes are
  // multiples of 2^(e - 3) (three mantissa bits; subnormals share the smallest normal's step).
  int e = static_cast<int>(mag >> 23) - 127;
  if (e < 1 - bias) e = 1 - bias;
  // a / 2^(e - 3), exact (a power-of-two multiple that stays in fp32's normal range),
  // then rounded to nearest even: n in [0, 16]; n == 16 carries into the next binade below.
  const float scaled = a * fp8_float_of(static_cast<uint32_t>(127 + 3 - e) << 23);
  float n = scaled;
  {  // round half to even without depending on the current rounding mode or libm
    const float fl = static_cast<float>(static_cast<int>(scaled));
    const float frac = scaled - fl;
    n = fl;
    if (frac > 0.5f || (frac == 0.5f && (static_cast<int>(fl) & 1))) n = fl + 1.f;
  }
  // (e + bias - 1) * 8 + n: for normals n in [8, 16] adds the implicit bit, and n == 16
  // is the next exponent with mantissa 0; for subnormals (e = 1 - bias) it is n itself.
  const int code = (e + bias - 1) * 8 + static_cast<int>(n);
  if (code == 0) return fnuz ? 0 : sign;  // FNUZ has no -0 (0x80 is its NaN)
  return static_cast<uint8_t>(sign | code);
}

}  // namespace fusedenc
