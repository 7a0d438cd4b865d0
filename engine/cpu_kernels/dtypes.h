// float32 / bfloat16 element access shared by the CPU kernels: compute in float32, store back
// rounded as torch rounds (to nearest even; NaN stays NaN).
#pragma once
#include <cstdint>
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

// n cache rows of one kv head (`stride` elements apart) into a dense float [n, D] buffer.
template <class IO>
inline void load_rows(const typename IO::T* src, int64_t stride, int n, int D, float* dst) {
  for (int j = 0; j < n; ++j) {
#pragma omp simd
    for (int d = 0; d < D; ++d) dst[j * D + d] = IO::load(src + j * stride, d);
  }
}

}  // namespace kvt
