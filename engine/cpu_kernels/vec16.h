// 16 float lanes: AVX-512 where the build machine has it, else AVX2 (two 8-lane halves), else plain loops (the same
// operations lane by lane, so the kernels' results do not depend on which lane a row sits in).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "dtypes.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

namespace kvt {

// e^x for x <= 0 (a score minus the running max): 2^t with t = x log2(e) split as n + f, n the
// nearest integer (f in [-0.5, 0.5], t - n exact), 2^f by its degree-7 Taylor polynomial (relative
// error < 1e-8) and scaled by 2^n. Vectorizes, unlike libm's expf; V16::exp_nonpositive is the
// same arithmetic in lanes, so the scalar and vector paths agree bit for bit.
inline float exp_nonpositive(float x) {
  const float t = std::max(x, -87.0f) * 1.4426950408889634f;
  const float n = std::nearbyint(t);
  const float f = t - n;
  float p = 1.5252733804059838e-05f;
  for (float c : {1.5403530393381606e-04f, 1.3333558146428441e-03f, 9.618129107628477e-03f, 5.5504108664821576e-02f,
                  2.402265069591007e-01f, 6.931471805599453e-01f, 1.0f})
    p = std::fma(p, f, c);
  const int32_t bits = (int32_t(n) + 127) << 23;  // 2^n, normal: n >= -126 after the clamp
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;  // one rounding, as scalef's
}

#if defined(__AVX512F__)
struct V16 {
  __m512 v;
  static inline V16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static inline V16 set1(float x) { return {_mm512_set1_ps(x)}; }
  static inline V16 zero() { return {_mm512_setzero_ps()}; }
  inline void store(float* p) const { _mm512_storeu_ps(p, v); }
  static inline V16 fmadd(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  static inline V16 max(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
  friend inline V16 operator+(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend inline V16 operator-(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend inline V16 operator*(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
  friend inline V16 operator/(V16 a, V16 b) { return {_mm512_div_ps(a.v, b.v)}; }
  static inline V16 load_bf16(const uint16_t* p) {
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16))};
  }
  // fp8 bytes through float16: e5m2 is a float16's top byte; e4m3's sign, exponent and mantissa
  // shifted into a float16's place read 2^-8 of the value (bias 15, not 7), so times 256, exactly.
  // Sign-extending the byte puts its sign in bits 8-15, so one shift by 7 leaves it in bit 15 (and
  // 14, cleared) with the magnitude in bits 7-13. Its NaN (magnitude 0x7f, which reads 480 there,
  // beyond the format's 448) gets a float16 NaN's exponent in the 16-bit lanes, before widening:
  // 9 vector operations (5 of them 256-bit), 16 before.
  static inline V16 load_e4m3(const fp8e4m3* p) {
    const __m256i h = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 7);
    const __m256i mag = _mm256_set1_epi16(0x3f80);
    const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(h, mag), mag);
    const __m256i bits = _mm256_or_si256(_mm256_and_si256(h, _mm256_set1_epi16(int16_t(0xbf80))),
                                         _mm256_and_si256(nan, _mm256_set1_epi16(0x7e00)));
    return {_mm512_mul_ps(_mm512_cvtph_ps(bits), _mm512_set1_ps(256.0f))};
  }
  static inline V16 load_e5m2(const fp8e5m2* p) {
    const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm512_cvtph_ps(_mm256_slli_epi16(x, 8))};
  }
  static inline V16 lane(V16 x, int j) { return {_mm512_permutexvar_ps(_mm512_set1_epi32(j), x.v)}; }
  inline float hmax() const { return _mm512_reduce_max_ps(v); }
  static inline bool all_one(V16 x) { return _mm512_cmp_ps_mask(x.v, _mm512_set1_ps(1.0f), _CMP_EQ_OQ) == 0xffff; }
  static inline V16 neg_inf_from(V16 x, int n) {  // lanes n..15 = -inf
    return {_mm512_mask_mov_ps(x.v, __mmask16(~((1u << n) - 1u)), _mm512_set1_ps(-INFINITY))};
  }
  inline float hsum() const { return _mm512_reduce_add_ps(v); }
  // lane j = the sum of x[j]'s lanes: a transpose-and-add tree (30 shuffles and adds for 16 sums)
  static inline V16 hsum16(const V16* x) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; ++i)
      a[i] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * i].v, x[2 * i + 1].v), _mm512_unpackhi_ps(x[2 * i].v, x[2 * i + 1].v));
    for (int i = 0; i < 4; ++i) {
      const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1]));
      const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1]));
      b[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
    }
    for (int i = 0; i < 2; ++i)
      c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
    return {_mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd))};
  }
  // -inf in the lanes where key > pos (the key is after the row), x elsewhere
  static inline V16 masked_below(V16 x, V16 pos, float key) {
    const __mmask16 after = _mm512_cmp_ps_mask(pos.v, _mm512_set1_ps(key), _CMP_LT_OQ);
    return {_mm512_mask_mov_ps(x.v, after, _mm512_set1_ps(-INFINITY))};
  }
  // -inf in the lanes where pos > limit (a sliding window: the key fell out of the row's sight)
  static inline V16 masked_above(V16 x, V16 pos, float limit) {
    const __mmask16 past = _mm512_cmp_ps_mask(pos.v, _mm512_set1_ps(limit), _CMP_GT_OQ);
    return {_mm512_mask_mov_ps(x.v, past, _mm512_set1_ps(-INFINITY))};
  }
  static inline V16 neg_inf_below(V16 x, int n) {  // lanes 0..n-1 = -inf
    return {_mm512_mask_mov_ps(x.v, __mmask16((1u << n) - 1u), _mm512_set1_ps(-INFINITY))};
  }
  static inline V16 zero_where_neg_inf(V16 x, V16 s) {
    const __mmask16 m = _mm512_cmp_ps_mask(s.v, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
    return {_mm512_mask_mov_ps(x.v, m, _mm512_setzero_ps())};
  }
  // kvt::exp_nonpositive in lanes (the same operations, so the same bits).
  static inline V16 exp_nonpositive(V16 x) {
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x.v, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(1.4426950408889634f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.5252733804059838e-05f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428441e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821576e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265069591007e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471805599453e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return {_mm512_scalef_ps(p, n)};
  }
};
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// AVX2 (CPUs without AVX-512: AMD before Zen 4, Intel client cores): 16 lanes as two 8-lane
// halves, each operation the AVX-512 one's per lane. The plain loops below, which such CPUs ran
// before, made the batch-64 decode at 2k contexts 7.4x (float32) to 11x (fp8) slower, and took
// a minute to compile (`benchmarks/kernels_cpu.py --march haswell`, docs/performance/kernels.md).
struct V16 {
  __m256 lo, hi;
  static inline V16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static inline V16 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  static inline V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  inline void store(float* p) const { _mm256_storeu_ps(p, lo); _mm256_storeu_ps(p + 8, hi); }
  static inline V16 fmadd(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
  static inline V16 max(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
  friend inline V16 operator+(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
  friend inline V16 operator-(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
  friend inline V16 operator*(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
  friend inline V16 operator/(V16 a, V16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
  static inline __m256 bf16x8(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
  static inline V16 load_bf16(const uint16_t* p) {
    return {bf16x8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            bf16x8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  }
  // float16 bits [16 lanes] to floats, times `scale` (exact: a power of two).
  static inline V16 half(__m256i bits, float scale) {
    const __m256 s = _mm256_set1_ps(scale);
    return {_mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(bits)), s),
            _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(bits, 1)), s)};
  }
  static inline V16 load_e4m3(const fp8e4m3* p) {  // as the AVX-512 one
    const __m256i h = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 7);
    const __m256i mag = _mm256_set1_epi16(0x3f80);
    const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(h, mag), mag);
    return half(_mm256_or_si256(_mm256_and_si256(h, _mm256_set1_epi16(int16_t(0xbf80))),
                                _mm256_and_si256(nan, _mm256_set1_epi16(0x7e00))), 256.0f);
  }
  static inline V16 load_e5m2(const fp8e5m2* p) {
    return half(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8), 1.0f);
  }
  static inline V16 lane(V16 x, int j) {
    const __m256 src = j < 8 ? x.lo : x.hi;
    const __m256 b = _mm256_permutevar8x32_ps(src, _mm256_set1_epi32(j & 7));
    return {b, b};
  }
  // 8 lanes folded by `op` (_mm_max_ps or _mm_add_ps): halves, then pairs, then the last two
  template <class Op>
  static inline float fold8(__m256 x, Op op) {
    __m128 m = op(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = op(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(op(m, _mm_movehdup_ps(m)));
  }
  inline float hmax() const { return fold8(_mm256_max_ps(lo, hi), [](__m128 a, __m128 b) { return _mm_max_ps(a, b); }); }
  static inline bool all_one(V16 x) {
    const __m256 one = _mm256_set1_ps(1.0f);
    return (_mm256_movemask_ps(_mm256_cmp_ps(x.lo, one, _CMP_EQ_OQ)) & _mm256_movemask_ps(_mm256_cmp_ps(x.hi, one, _CMP_EQ_OQ))) == 0xff;
  }
  // lanes where `m` (a lane mask of 16 bits) is set take `y`, the others keep x
  static inline V16 select(V16 x, unsigned m, float y) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i lo_m = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(int(m & 0xff)), bit), bit);
    const __m256i hi_m = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(int(m >> 8)), bit), bit);
    const __m256 v = _mm256_set1_ps(y);
    return {_mm256_blendv_ps(x.lo, v, _mm256_castsi256_ps(lo_m)), _mm256_blendv_ps(x.hi, v, _mm256_castsi256_ps(hi_m))};
  }
  static inline V16 neg_inf_from(V16 x, int n) { return select(x, ~((1u << n) - 1u) & 0xffffu, -INFINITY); }
  inline float hsum() const { return fold8(_mm256_add_ps(lo, hi), [](__m128 a, __m128 b) { return _mm_add_ps(a, b); }); }
  // lane j = the sum of x[j]'s lanes: each x[j] folded to 8 lanes, then an 8-way transpose-and-add
  static inline __m256 hsum8x8(const __m256* a) {
    __m256 b[4], c[2];
    for (int i = 0; i < 4; ++i) b[i] = _mm256_hadd_ps(a[2 * i], a[2 * i + 1]);
    for (int i = 0; i < 2; ++i) c[i] = _mm256_hadd_ps(b[2 * i], b[2 * i + 1]);
    // c[0] lanes: [x0 x1 x2 x3 | x0 x1 x2 x3] halves (low 128 from lanes 0-3, high from 4-7), c[1] likewise x4..x7
    const __m256 lo = _mm256_permute2f128_ps(c[0], c[1], 0x20), hi = _mm256_permute2f128_ps(c[0], c[1], 0x31);
    return _mm256_add_ps(lo, hi);
  }
  static inline V16 hsum16(const V16* x) {
    __m256 a[16];
    for (int j = 0; j < 16; ++j) a[j] = _mm256_add_ps(x[j].lo, x[j].hi);
    return {hsum8x8(a), hsum8x8(a + 8)};
  }
  static inline V16 cmp_blend(V16 x, V16 a, V16 b, int pred, float y) {  // lanes where a <pred> b take y
    const __m256 v = _mm256_set1_ps(y);
    return {_mm256_blendv_ps(x.lo, v, _mm256_cmp_ps(a.lo, b.lo, pred)), _mm256_blendv_ps(x.hi, v, _mm256_cmp_ps(a.hi, b.hi, pred))};
  }
  static inline V16 masked_below(V16 x, V16 pos, float key) { return cmp_blend(x, pos, set1(key), _CMP_LT_OQ, -INFINITY); }
  static inline V16 masked_above(V16 x, V16 pos, float limit) { return cmp_blend(x, pos, set1(limit), _CMP_GT_OQ, -INFINITY); }
  static inline V16 neg_inf_below(V16 x, int n) { return select(x, (1u << n) - 1u, -INFINITY); }
  static inline V16 zero_where_neg_inf(V16 x, V16 s) { return cmp_blend(x, s, set1(-INFINITY), _CMP_EQ_OQ, 0.0f); }
  static inline __m256 exp8(__m256 x) {  // kvt::exp_nonpositive's operations
    const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(1.4426950408889634f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_set1_ps(1.5252733804059838e-05f);
    for (float c : {1.5403530393381606e-04f, 1.3333558146428441e-03f, 9.618129107628477e-03f, 5.5504108664821576e-02f,
                    2.402265069591007e-01f, 6.931471805599453e-01f, 1.0f})
      p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  }
  static inline V16 exp_nonpositive(V16 x) { return {exp8(x.lo), exp8(x.hi)}; }
};
#else
struct V16 {
  float v[16];
  static inline V16 load(const float* p) { V16 r; std::memcpy(r.v, p, sizeof r.v); return r; }
  static inline V16 set1(float x) { V16 r; std::fill(r.v, r.v + 16, x); return r; }
  static inline V16 zero() { return set1(0.0f); }
  inline void store(float* p) const { std::memcpy(p, v, sizeof v); }
  template <class F>
  static inline V16 map(F f) { V16 r; for (int i = 0; i < 16; ++i) r.v[i] = f(i); return r; }
  static inline V16 fmadd(V16 a, V16 b, V16 c) { return map([&](int i) { return std::fma(a.v[i], b.v[i], c.v[i]); }); }
  static inline V16 max(V16 a, V16 b) { return map([&](int i) { return std::max(a.v[i], b.v[i]); }); }
  friend inline V16 operator+(V16 a, V16 b) { return map([&](int i) { return a.v[i] + b.v[i]; }); }
  friend inline V16 operator-(V16 a, V16 b) { return map([&](int i) { return a.v[i] - b.v[i]; }); }
  friend inline V16 operator*(V16 a, V16 b) { return map([&](int i) { return a.v[i] * b.v[i]; }); }
  friend inline V16 operator/(V16 a, V16 b) { return map([&](int i) { return a.v[i] / b.v[i]; }); }
  static inline V16 load_bf16(const uint16_t* p) { return map([&](int i) { return bf16_to_f32(p[i]); }); }
  static inline V16 load_e4m3(const fp8e4m3* p) { return map([&](int i) { return E4M3::load(p, i); }); }
  static inline V16 load_e5m2(const fp8e5m2* p) { return map([&](int i) { return E5M2::load(p, i); }); }
  static inline V16 lane(V16 x, int j) { return set1(x.v[j]); }
  inline float hmax() const { return *std::max_element(v, v + 16); }
  static inline bool all_one(V16 x) { return std::all_of(x.v, x.v + 16, [](float e) { return e == 1.0f; }); }
  static inline V16 neg_inf_from(V16 x, int n) { return map([&](int i) { return i >= n ? -INFINITY : x.v[i]; }); }
  inline float hsum() const { float t = 0.0f; for (float e : v) t += e; return t; }
  static inline V16 hsum16(const V16* x) { return map([&](int i) { return x[i].hsum(); }); }
  static inline V16 masked_below(V16 x, V16 pos, float key) {
    return map([&](int i) { return pos.v[i] < key ? -INFINITY : x.v[i]; });
  }
  static inline V16 masked_above(V16 x, V16 pos, float limit) {
    return map([&](int i) { return pos.v[i] > limit ? -INFINITY : x.v[i]; });
  }
  static inline V16 neg_inf_below(V16 x, int n) { return map([&](int i) { return i < n ? -INFINITY : x.v[i]; }); }
  static inline V16 zero_where_neg_inf(V16 x, V16 s) {
    return map([&](int i) { return s.v[i] == -INFINITY ? 0.0f : x.v[i]; });
  }
  static inline V16 exp_nonpositive(V16 x) { return map([&](int i) { return kvt::exp_nonpositive(x.v[i]); }); }
};
#endif

// dst[d * 16 + j] = src[j * stride + d] for j < 16, d < D: 16 rows of D floats transposed (D rows of
// 16 lanes), in 8x8 blocks in registers where AVX2 is there. Moves bits only.
inline void transpose16(const float* src, int64_t stride, int D, float* dst) {
  int d0 = 0;
#if defined(__AVX2__)
  for (; d0 + 8 <= D; d0 += 8)
    for (int j0 = 0; j0 < 16; j0 += 8) {
      __m256 r[8], t[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + (j0 + i) * stride + d0);
      for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
      }
      for (int i = 0; i < 4; ++i) {
        _mm256_storeu_ps(dst + int64_t(d0 + i) * 16 + j0, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(dst + int64_t(d0 + i + 4) * 16 + j0, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
      }
    }
#endif
  for (int d = d0; d < D; ++d)
    for (int j = 0; j < 16; ++j) dst[int64_t(d) * 16 + j] = src[j * stride + d];
}

// fp8 rows widened 16 lanes at a time (the scalar table reads one byte at a time: a prefill over
// an fp8 cache ran 1.5x slower than over float32). The same values either way: widening is exact.
template <class KV, class Widen>
inline void load_fp8_rows(const typename KV::T* src, int64_t stride, int n, int D, float* dst, Widen widen) {
  for (int j = 0; j < n; ++j) {
    const typename KV::T* row = src + j * stride;
    const int whole = D / 16 * 16;
    for (int d = 0; d < whole; d += 16) widen(row + d).store(dst + j * D + d);
    for (int d = whole; d < D; ++d) dst[j * D + d] = KV::load(row, d);
  }
}

template <>
inline void load_rows<E4M3>(const fp8e4m3* src, int64_t stride, int n, int D, float* dst) {
  load_fp8_rows<E4M3>(src, stride, n, D, dst, V16::load_e4m3);
}

template <>
inline void load_rows<E5M2>(const fp8e5m2* src, int64_t stride, int n, int D, float* dst) {
  load_fp8_rows<E5M2>(src, stride, n, D, dst, V16::load_e5m2);
}

}  // namespace kvt
