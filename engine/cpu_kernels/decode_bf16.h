// The decode kernel for bfloat16 q over a bfloat16 cache on CPUs with AVX512-BF16 (AMX machines and
// AMD Zen 4 have it): `attend_lanes`' contract and loop, with the products in `vdpbf16ps`.
//
// attend_lanes widens every K and V element to float32 once per query head that reads it and
// runs float32 FMAs: on a batch-64 layer at context 344 it ran at ~33 GFLOP/s, twice the memory
// bound's time, compute-bound even on cached data. Here:
// - QK^T: q stays bfloat16 (the scale multiplies the scores), and a key's dot product is D/32
//   `vdpbf16ps` on its row read in place, no widening;
// - P·V: each 16-key slice's V is interleaved once into key pairs (VNNI order, shared by the GQA
//   heads), P is rounded to bfloat16 as flash attention does in bf16, and each key pair is one
//   `vdpbf16ps` per 16 dims. The normaliser sums the float32 P.
// The interleave leaves dims in a fixed order within each 32 (`dim_of`); the accumulator keeps
// that order and is put back when the row is written.
//
// Included by paged_attention.cpp inside its namespace (Shape, BlockPrefetch, V16).
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define KVT_DECODE_BF16 1

// Lane i of the low (hi = 0) or high half of a 32-dim chunk after unpacklo/hi_epi16 of two rows.
constexpr int dim_of(int i, int hi) { return 8 * (i / 4) + 4 * hi + (i % 4); }

template <int D>
void attend_bf16(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, uint16_t* out, const int64_t* table,
                 int64_t len, int64_t start, int kv0, int kv1, const Shape& s, float* scratch) {
  static_assert(D % 32 == 0, "head size must be a multiple of 32");
  constexpr int C2 = D / 32;  // 32-dim chunks of a row
  const int G = s.heads / s.kv_heads, BS = s.block_size;
  const int h0 = kv0 * G, nh = (kv1 - kv0) * G;
  // 64-byte aligned regions: a 64-byte access that splits two cache lines costs two, and a load from
  // a split store is not forwarded (the V pairs are stored and read back within the slice).
  float* acc = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch) + 63) & ~uintptr_t(63));  // [nh][C2][2][16], dims in dim_of order
  float* sc = acc + nh * D;                                   // [nh][16]: a slice's scores
  uint16_t* vp = reinterpret_cast<uint16_t*>(sc + nh * 16);  // [8 pairs][C2][2][32]: the slice's V, VNNI
  float* m = sc + nh * 16 + 8 * D;                            // [nh]
  float* l = m + nh;                                          // [nh]
  std::fill(acc, acc + nh * D, 0.0f);
  std::fill(m, m + nh, -INFINITY);
  std::fill(l, l + nh, 0.0f);
  const __m512 scale = _mm512_set1_ps(s.scale);
  const int64_t nblocks = (len + BS - 1) / BS, b0 = start / BS;
  const int slices = (BS + 15) / 16;
  BlockPrefetch pf;
  pf.first(kc, vc, table, b0, nblocks, kv0, kv1 - kv0, D, s);
  for (int64_t b = b0; b < nblocks; ++b) {
    const int n = int(std::min<int64_t>(BS, len - b * BS));
    const int j0 = b == b0 ? int(start - b * BS) : 0;
    const bool more = b + 1 < nblocks;
    if (more) pf.start(kc, vc, table[b + 1] * s.block_stride + int64_t(kv0) * D, kv1 - kv0, D, s, nh * slices);
    for (int kvh = kv0; kvh < kv1; ++kvh) {
      const int64_t base = table[b] * s.block_stride + int64_t(kvh) * D;
      for (int k0 = j0 / 16 * 16; k0 < n; k0 += 16) {
        const int nk = std::min(16, n - k0);
        // Rows past the block's valid keys repeat its last valid one (never-written cache must not
        // reach a product, even as 0 * NaN); their probabilities are 0.
        const uint16_t* krow[16];
        for (int j = 0; j < 16; ++j) krow[j] = kc + base + (k0 + std::min(j, nk - 1)) * s.token_stride;
        for (int jp = 0; jp < 8; ++jp) {
          const uint16_t* v0 = vc + base + (k0 + std::min(2 * jp, nk - 1)) * s.token_stride;
          const uint16_t* v1 = vc + base + (k0 + std::min(2 * jp + 1, nk - 1)) * s.token_stride;
          for (int c = 0; c < C2; ++c) {
            const __m512i a = _mm512_loadu_si512(v0 + 32 * c), bb = _mm512_loadu_si512(v1 + 32 * c);
            _mm512_store_si512(vp + (jp * C2 + c) * 64, _mm512_unpacklo_epi16(a, bb));
            _mm512_store_si512(vp + (jp * C2 + c) * 64 + 32, _mm512_unpackhi_epi16(a, bb));
          }
        }
        for (int hh = 0; hh < G; ++hh) {
          const int h = (kvh - kv0) * G + hh;
          if (more) pf.issue();
          const uint16_t* qh = q + int64_t(h0 + h) * D;
          __m512bh qv[C2];
          for (int c = 0; c < C2; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qh + 32 * c);
          V16 dots[16];
#pragma GCC unroll 16
          for (int j = 0; j < 16; ++j) {
            __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(krow[j]));
            for (int c = 1; c < C2; ++c) a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(krow[j] + 32 * c));
            dots[j] = {a};
          }
          V16 x = V16::hsum16(dots) * V16{scale};
          if (nk < 16) x = V16::neg_inf_from(x, nk);
          if (j0 > k0) x = V16::neg_inf_below(x, j0 - k0);  // keys before the window
          x.store(sc + h * 16);
        }
        for (int hh = 0; hh < G; ++hh) {
          const int h = (kvh - kv0) * G + hh;
          const V16 x = V16::load(sc + h * 16);
          const float mnew = std::max(m[h], x.hmax());
          // e^0 is 1 exactly: most slices do not move the max, and skip the scalar exponential.
          const float corr = m[h] == -INFINITY ? 0.0f : mnew == m[h] ? 1.0f : kvt::exp_nonpositive(m[h] - mnew);
          const V16 p = V16::zero_where_neg_inf(V16::exp_nonpositive(x - V16::set1(mnew)), x);
          l[h] = l[h] * corr + p.hsum();
          m[h] = mnew;
          float* ah = acc + h * D;
          __m512 o[2][2 * C2];
          const __m512 cv = _mm512_set1_ps(corr);
          for (int i = 0; i < 2 * C2; ++i) {
            o[0][i] = _mm512_mul_ps(_mm512_load_ps(ah + 16 * i), cv);
            o[1][i] = _mm512_setzero_ps();
          }
          // All 8 pairs, fully unrolled: a pair past the valid keys has probability 0 (and V rows
          // that repeat a valid key), so it adds exact zeros.
          const __m512i pb = (__m512i)_mm512_cvtne2ps_pbh(p.v, p.v);
#pragma GCC unroll 8
          for (int jp = 0; jp < 8; ++jp) {
            const __m512bh pj = (__m512bh)_mm512_permutexvar_epi32(_mm512_set1_epi32(jp), pb);
            for (int i = 0; i < 2 * C2; ++i)
              o[jp & 1][i] = _mm512_dpbf16_ps(o[jp & 1][i], pj, (__m512bh)_mm512_load_si512(vp + (jp * C2) * 64 + 32 * i));
          }
          for (int i = 0; i < 2 * C2; ++i) _mm512_store_ps(ah + 16 * i, _mm512_add_ps(o[0][i], o[1][i]));
        }
      }
    }
  }
  for (int h = 0; h < nh; ++h) {
    const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;  // len 0: zeros, never NaN
    uint16_t* oh = out + int64_t(h0 + h) * D;
    const float* ah = acc + h * D;
    for (int c = 0; c < C2; ++c)
      for (int hi = 0; hi < 2; ++hi)
        for (int i = 0; i < 16; ++i) oh[32 * c + dim_of(i, hi)] = kvt::f32_to_bf16(ah[(2 * c + hi) * 16 + i] * inv);
  }
}
#endif
