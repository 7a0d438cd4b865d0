// The prefill kernel's tile for bfloat16 q and cache with `vdpbf16ps` (AVX512-BF16: AMD Zen 4 and
// later, Intel since Cooper Lake), and what it shares with the AMX tile (prefill_amx.h): 32-key
// slices, V^T packed once per call in key pairs, and the online-softmax step.
//
// The layout is the AMX tile's, with each tile op done in AVX-512 lanes (one query row per lane):
// - S^T[key][rows] = Σ over dim pairs of vdpbf16ps(Q^T pair p, broadcast of the key's pair p): Q^T is
//   built once per item in pairs of dims (lane r holds row r's dims 2p, 2p+1), the key is read in
//   place from the cache; each key's scores are D/2 instructions instead of D widened FMAs;
// - O^T[dim][rows] += Σ over key pairs of vdpbf16ps(P^T pair jp, broadcast of V^T[dim][keys 2jp, 2jp+1]),
//   P rounded to bfloat16 (the normaliser sums the float32 P), as flash attention does in bf16.
//
// Bits: a row's scores, probabilities and output depend only on the row, its keys and the slices
// (fixed by absolute position), so a chunk split anywhere, a fresh prefill and a prefill after a
// prefix hit give the same bits on this path. Its arithmetic is not attend_tile's (nor the AMX tile's),
// so when it is on, every item of a call takes it, narrow tiles included.
//
// Included by prefill_attention.cpp inside its namespace (Shape, Seq, Item, V16, L).
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define KVT_PREFILL_BF16 1

constexpr int KS = 32;  // keys per slice: two 16-key score tiles, and a full 32-key pass of P.V
// A row's running max moves only when a slice's max passes it by more than this (lazy rescaling):
// its probabilities are then at most e^8, and O^T makes the round trip through memory to be
// rescaled rarely instead of at most slices. Decided lane by lane, so a row's bits stay its own.
constexpr float RESCALE_MARGIN = 8.0f;


// 32 rows of 32 bf16 (one register each) transposed in place: five rounds of swapping the
// off-diagonal w x w blocks of every 2w x 2w block, each row one two-source permute.
inline void transpose32x32(__m512i* r) {
  for (int w = 1; w < 32; w *= 2) {
    alignas(64) uint16_t lo[32], hi[32];
    for (int c = 0; c < 32; ++c) {
      lo[c] = uint16_t(c & w ? 32 + c - w : c);  // row i: its own low half, then row i+w's low half
      hi[c] = uint16_t(c & w ? 32 + c : c + w);  // row i+w: row i's high half, then its own
    }
    const __m512i ilo = _mm512_load_si512(lo), ihi = _mm512_load_si512(hi);
    for (int i = 0; i < 32; ++i) {
      if (i & w) continue;
      const __m512i a = r[i], b = r[i + w];
      r[i] = _mm512_permutex2var_epi16(a, ilo, b);
      r[i + w] = _mm512_permutex2var_epi16(a, ihi, b);
    }
  }
}

// V^T of every 32-key slice of every chunk, [slice][kv head][D][32] bf16, zero past each sequence's
// end (never-written cache must not reach a product, even as 0 * NaN). `first[i]`: seq i's first slice.
inline void pack_vt(const uint16_t* vc, const Seq* seqs, int64_t nseq, const int64_t* tables, const Shape& s,
                    const std::vector<int64_t>& first, uint16_t* vt, int threads) {
  const int D = s.head_dim, BS = s.block_size;
  const int64_t total = first[nseq] * s.kv_heads;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t w = 0; w < total; ++w) {
    const int64_t slice = w / s.kv_heads, kvh = w % s.kv_heads;
    const int64_t i = std::upper_bound(first.begin(), first.end(), slice) - first.begin() - 1;
    const int64_t k0 = (slice - first[i]) * KS;
    const int n = int(std::min<int64_t>(KS, seqs[i].ctx - k0));
    const int64_t* table = tables + seqs[i].table_offset;
    const uint16_t* src[KS];
    for (int j = 0; j < n; ++j)
      src[j] = vc + table[(k0 + j) / BS] * s.block_stride + ((k0 + j) % BS) * s.token_stride + kvh * D;
    uint16_t* dst = vt + w * D * KS;
    for (int c0 = 0; c0 < D; c0 += 32) {  // D % 32 == 0
      __m512i r[32];
      for (int j = 0; j < KS; ++j) r[j] = j < n ? _mm512_loadu_si512(src[j] + c0) : _mm512_setzero_si512();
      transpose32x32(r);
      for (int c = 0; c < 32; ++c) _mm512_storeu_si512(dst + (c0 + c) * KS, r[c]);
    }
  }
}

// Scratch for one thread's items, in floats: Q^T pairs, two 16-key score tiles (the AMX tile's),
// P^T pairs, O^T, and 64-byte alignment.
inline size_t pair_scratch_floats(int D) { return size_t(D) * L / 2 + 2 * 256 + 256 + size_t(D) * L + 16; }

// One slice's online-softmax step, lane by lane: `sc` holds the slice's raw dot products (key j's
// row scores in sc[j]) and becomes its probabilities; `m` and `l` move on; P^T goes to `pbuf` in
// bfloat16 key pairs ([16 pairs][16 rows]). Returns the factor O^T must be rescaled by (all ones
// when no lane's max moved past the margin).
inline V16 softmax_slice(V16* sc, int n, int64_t k0, bool visible, bool windowed, const Shape& s, V16 rowpos,
                         V16& m, V16& l, uint32_t* pbuf) {
  const V16 scale = V16::set1(s.scale), margin = V16::set1(RESCALE_MARGIN);
  // (a, b) -> a0 b0 a1 b1 ...: two keys' probabilities per row as one bf16 pair
  alignas(64) static const uint16_t pairs[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i pair_idx = _mm512_load_si512(pairs);
  V16 bmax = V16::set1(-INFINITY);
  #pragma GCC unroll 32
  for (int j = 0; j < KS; ++j) {
    sc[j] = sc[j] * scale;
    if (!visible) {
      const float key = j < n ? float(k0 + j) : INFINITY;  // slots past the end: masked for every row
      sc[j] = V16::masked_below(sc[j], rowpos, key);
      if (windowed) sc[j] = V16::masked_above(sc[j], rowpos, key + float(s.window - 1));
    }
    bmax = V16::max(bmax, sc[j]);
  }
  // lanes whose slice max passes their running max by more than the margin move it to the slice's
  const V16 mnew{_mm512_mask_mov_ps(m.v, _mm512_cmp_ps_mask(bmax.v, (m + margin).v, _CMP_GT_OQ), bmax.v)};
  V16 corr = V16::exp_nonpositive(m - mnew);
  if (s.window > 0) corr = V16::zero_where_neg_inf(corr, m);
  V16 sum = V16::zero();
  #pragma GCC unroll 32
  for (int j = 0; j < KS; ++j) {
    sc[j] = visible ? V16::exp_nonpositive(sc[j] - mnew)
                    : V16::zero_where_neg_inf(V16::exp_nonpositive(sc[j] - mnew), sc[j]);
    sum = sum + sc[j];
  }
  l = V16::fmadd(l, corr, sum);
  m = mnew;
  #pragma GCC unroll 16
  for (int jp = 0; jp < KS / 2; ++jp) {
    const __m512i two = (__m512i)_mm512_cvtne2ps_pbh(sc[2 * jp + 1].v, sc[2 * jp].v);
    _mm512_store_si512(pbuf + jp * L, _mm512_permutexvar_epi16(pair_idx, two));
  }
  return corr;
}

// An item's rows as both pair tiles see them: how many, their positions in lanes (spare lanes copy
// the last row), and the first 32-key slice any of them sees (a sliding window skips the rest).
struct TileRows {
  int rows;
  int64_t pos0, last, first_key;
  V16 rowpos;
};

inline TileRows tile_rows(const Seq& sq, const Item& it, const Shape& s) {
  const int rows = int(std::min<int64_t>(L, sq.qlen - it.row0));
  const int64_t pos0 = sq.ctx - sq.qlen + it.row0;
  float posf[L];
  for (int r = 0; r < L; ++r) posf[r] = float(pos0 + std::min(r, rows - 1));
  const int64_t first_key = s.window > 0 ? std::max<int64_t>(0, pos0 - s.window + 1) / KS * KS : 0;
  return {rows, pos0, pos0 + rows - 1, first_key, V16::load(posf)};
}

// One query head's Q^T for an item in dim pairs ([D/2 pairs][16 rows]; spare lanes copy the last row).
inline void load_qt(const uint16_t* q, const Seq& sq, const Item& it, const Shape& s, int qh, int D, int rows,
                    uint32_t* qt) {
  for (int r = 0; r < L; ++r) {
    const uint32_t* qr = reinterpret_cast<const uint32_t*>(
        q + (sq.q0 + it.row0 + std::min(r, rows - 1)) * s.q_row_stride + int64_t(qh) * D);
    for (int p = 0; p < D / 2; ++p) qt[p * L + r] = qr[p];  // pair p = chunk p / 16, row p % 16
  }
}

// O^T / l written to the item's rows of one query head, in bf16.
inline void store_rows(const float* oh, V16 l, uint16_t* out, const Seq& sq, const Item& it, const Shape& s, int qh,
                       int D, int rows) {
  float inv[L];
  (V16::set1(1.0f) / l).store(inv);
  for (int r = 0; r < rows; ++r) {
    uint16_t* orow = out + (sq.q0 + it.row0 + r) * s.out_row_stride + int64_t(qh) * D;
    for (int d = 0; d < D; ++d) orow[d] = kvt::f32_to_bf16(oh[d * L + r] * inv[r]);
  }
}

// attend_tile's item with bfloat16 q and cache in vdpbf16ps. scratch: pair_scratch_floats(D).
template <int D_>
void attend_tile_dp(const uint16_t* q, const uint16_t* kc, uint16_t* out, const int64_t* table, const uint16_t* vt,
                    const Seq& sq, const Item& it, const Shape& s, float* scratch) {
  const int D = D_ > 0 ? D_ : s.head_dim;
  const int G = s.heads / s.kv_heads, BS = s.block_size, P = D / 2;
  const auto [rows, pos0, last, first_key, rowpos] = tile_rows(sq, it, s);
  float* base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch) + 63) & ~uintptr_t(63));
  uint32_t* qt = reinterpret_cast<uint32_t*>(base);                    // [D/2 pairs][16 rows]
  uint32_t* pbuf = reinterpret_cast<uint32_t*>(base + size_t(D) * L / 2);  // [16 key pairs][16 rows]
  float* oh = base + size_t(D) * L / 2 + 256;                           // [D][16 rows]
  constexpr int J = 8;  // keys whose dot products interleave (independent vdpbf16ps chains)
  for (int h = it.h0; h < it.h1; ++h) {
    const int qh = it.kvh * G + h;
    load_qt(q, sq, it, s, qh, D, rows, qt);
    std::fill(oh, oh + int64_t(D) * L, 0.0f);
    V16 m = V16::set1(-INFINITY), l = V16::zero();
    for (int64_t k0 = first_key; k0 <= last; k0 += KS) {
      const int n = int(std::min<int64_t>(KS, sq.ctx - k0));
      const uint32_t* vp = reinterpret_cast<const uint32_t*>(vt + ((k0 / KS) * s.kv_heads + it.kvh) * int64_t(D) * KS);
      const bool visible = n == KS && k0 + KS - 1 <= pos0 && (s.window <= 0 || k0 > last - s.window);
      const bool windowed = s.window > 0 && k0 <= last - s.window;
      // As on the tile unit: a 16-key half wholly past the sequence's end is not read; keys past the
      // end in a half that is read come from their block and are masked in softmax_slice.
      V16 sc[KS];
      for (int b = 0; b < 2; ++b) {
        if (b == 1 && n <= L) {
          for (int j = L; j < KS; ++j) sc[j] = V16::zero();
          break;
        }
        const uint16_t* kp = kc + table[(k0 + b * L) / BS] * s.block_stride + ((k0 + b * L) % BS) * s.token_stride +
                             int64_t(it.kvh) * D;
        for (int j0 = 0; j0 < L; j0 += J) {
          __m512 acc[J];
          const uint32_t* kr[J];
          for (int j = 0; j < J; ++j) {
            acc[j] = _mm512_setzero_ps();
            kr[j] = reinterpret_cast<const uint32_t*>(kp + (j0 + j) * s.token_stride);
          }
          for (int p = 0; p < P; ++p) {
            const __m512bh qv = (__m512bh)_mm512_load_si512(qt + p * L);
            #pragma GCC unroll 8
            for (int j = 0; j < J; ++j)
              acc[j] = _mm512_dpbf16_ps(acc[j], qv, (__m512bh)_mm512_set1_epi32(int(kr[j][p])));
          }
          for (int j = 0; j < J; ++j) sc[b * L + j0 + j] = V16{acc[j]};
        }
      }
      const V16 corr = softmax_slice(sc, n, k0, visible, windowed, s, rowpos, m, l, pbuf);
      const bool rescale = !V16::all_one(corr);
      __m512bh pv[KS / 2];
      for (int jp = 0; jp < KS / 2; ++jp) pv[jp] = (__m512bh)_mm512_load_si512(pbuf + jp * L);
      for (int d = 0; d < D; ++d) {
        V16 o = V16::load(oh + d * L);
        if (rescale) o = o * corr;
        __m512 acc = o.v;
        #pragma GCC unroll 16
        for (int jp = 0; jp < KS / 2; ++jp)
          acc = _mm512_dpbf16_ps(acc, pv[jp], (__m512bh)_mm512_set1_epi32(int(vp[d * (KS / 2) + jp])));
        V16{acc}.store(oh + d * L);
      }
    }
    store_rows(oh, l, out, sq, it, s, qh, D, rows);
  }
}
#endif
