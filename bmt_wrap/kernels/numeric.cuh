// Numerics shared by the CUDA kernels and their g++ host harness.
//
// Every conversion and per-element formula the kernels use is defined here once, as a function that
// compiles for the device (nvcc, NVRTC) and for the host (g++), so CI checks the kernels' arithmetic
// on machines without a GPU. Low-precision values are handled as raw 16-bit patterns: the kernels need
// no cuda_fp16.h / cuda_bf16.h (which NVRTC may not find), and the host harness runs the very same
// rounding code the device runs.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define BMT_HD __host__ __device__ __forceinline__
#else
#include <math.h>
#define BMT_HD inline
#endif

namespace bmt {

typedef unsigned int u32;
typedef unsigned short u16;

BMT_HD float bits_to_float(u32 bits) {
  union { u32 u; float f; } c;
  c.u = bits;
  return c.f;
}

BMT_HD u32 float_to_bits(float value) {
  union { u32 u; float f; } c;
  c.f = value;
  return c.u;
}

BMT_HD float infinity() { return bits_to_float(0x7f800000u); }

BMT_HD bool is_finite(float x) { return (float_to_bits(x) & 0x7f800000u) != 0x7f800000u; }

// bfloat16 is the upper half of a float32.
BMT_HD float bf16_to_float(u16 h) { return bits_to_float(static_cast<u32>(h) << 16); }

BMT_HD u16 float_to_bf16(float f) {
  u32 u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<u16>((u >> 16) | 0x0040u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even (overflow carries into inf)
  return static_cast<u16>(u >> 16);
}

BMT_HD float half_to_float(u16 h) {
  u32 sign = static_cast<u32>(h & 0x8000u) << 16;
  u32 exponent = (h >> 10) & 0x1fu;
  u32 mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
  if (exponent != 0u) return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  float magnitude = static_cast<float>(mantissa) * bits_to_float(0x33800000u);  // subnormal: m * 2^-24
  return sign ? -magnitude : magnitude;
}

BMT_HD u16 float_to_half(float f) {
  u32 u = float_to_bits(f);
  u16 sign = static_cast<u16>((u >> 16) & 0x8000u);
  u32 a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<u16>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // quiet NaN
  if (a >= 0x477ff000u) return static_cast<u16>(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (a >= 0x38800000u) {  // a normal half: rebias the exponent, round the mantissa to 10 bits
    u32 r = a - 0x38000000u;
    r += 0xfffu + ((r >> 13) & 1u);
    return static_cast<u16>(sign | (r >> 13));
  }
  u32 shift = 126u - (a >> 23);  // subnormal half: mantissa (with its implicit 1) >> shift
  if (shift > 24u) return sign;
  u32 mantissa = (a & 0x7fffffu) | 0x800000u;
  u32 m = mantissa >> shift;
  u32 rest = mantissa & ((1u << shift) - 1u);
  u32 halfway = 1u << (shift - 1u);
  if (rest > halfway || (rest == halfway && (m & 1u))) m += 1u;
  return static_cast<u16>(sign | m);
}

// Storage codecs: how a kernel loads a parameter/gradient element as float and stores it back.
struct F32 {
  typedef float storage;
  static BMT_HD float load(float x) { return x; }
  static BMT_HD float store(float x) { return x; }
};

struct BF16 {
  typedef u16 storage;
  static BMT_HD float load(u16 x) { return bf16_to_float(x); }
  static BMT_HD u16 store(float x) { return float_to_bf16(x); }
};

struct F16 {
  typedef u16 storage;
  static BMT_HD float load(u16 x) { return half_to_float(x); }
  static BMT_HD u16 store(float x) { return float_to_half(x); }
};

}  // namespace bmt
