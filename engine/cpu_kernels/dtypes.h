// float32 / bfloat16 / fp8 element access shared by the CPU kernels: compute in float32, store back
// rounded as torch rounds (to nearest even; NaN stays NaN).
#pragma once
#include <cstdint>
#include <cmath>
#include <cstring>

namespace kvt {

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

struct F32 {
  using T = float;
  static inline float load(const float* p, int64_t i) { return p[i]; }
  static inline void store(float* p, int64_t i, float x) { p[i] = x; }
  static inline float round(float x) { return x; }
};

struct BF16 {
  using T = uint16_t;
  static inline float load(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }
  static inline void store(uint16_t* p, int64_t i, float x) { p[i] = f32_to_bf16(x); }
  static inline float round(float x) { return bf16_to_f32(f32_to_bf16(x)); }  // what a bf16 op stores
};

// fp8 caches (--kv-cache-dtype fp8*): byte types of their own, so that overloads and templates
// tell the two formats apart. Values are K / k_scale and V / v_scale; the scales are applied
// outside the kernels (engine/runner/attention.py), so a kernel only widens the bytes.
struct fp8e4m3 { uint8_t bits; };  // float8_e4m3fn: bias 7, 3 mantissa bits, no inf; 0x7f/0xff NaN
struct fp8e5m2 { uint8_t bits; };  // float8_e5m2: float16's top byte

// All 256 values of a format, widened once (exact: every fp8 value is a float).
struct Fp8Table {
  float v[256];
  template <class F>
  explicit Fp8Table(F widen) { for (int b = 0; b < 256; ++b) v[b] = widen(uint8_t(b)); }
};

inline float e4m3_value(uint8_t b) {
  const int e = (b >> 3) & 0xf, m = b & 7;
  if (e == 15 && m == 7) return NAN;
  const float mag = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(float(8 + m), e - 10);
  return (b & 0x80) ? -mag : mag;
}

inline float e5m2_value(uint8_t b) {
  const int e = (b >> 2) & 0x1f, m = b & 3;
  const float mag = e == 31 ? (m ? NAN : INFINITY) : e == 0 ? std::ldexp(float(m), -16) : std::ldexp(float(4 + m), e - 17);
  return (b & 0x80) ? -mag : mag;
}

struct E4M3 {
  using T = fp8e4m3;
  static inline float load(const T* p, int64_t i) {
    static const Fp8Table table(e4m3_value);
    return table.v[p[i].bits];
  }
};

struct E5M2 {
  using T = fp8e5m2;
  static inline float load(const T* p, int64_t i) {
    static const Fp8Table table(e5m2_value);
    return table.v[p[i].bits];
  }
};

// Whether a cache type is widened into a float buffer before use (fp8: once per key, not once
// per query head that reads it).
template <class KV>
constexpr bool widened() { return sizeof(typename KV::T) == 1; }

// n cache rows of one kv head (`stride` elements apart) into a dense float [n, D] buffer.
template <class IO>
inline void load_rows(const typename IO::T* src, int64_t stride, int n, int D, float* dst) {
  for (int j = 0; j < n; ++j) {
#pragma omp simd
    for (int d = 0; d < D; ++d) dst[j * D + d] = IO::load(src + j * stride, d);
  }
}

}  // namespace kvt
