// Causal attention for prompt chunks on CPU, reading K/V through the block table in place.
//
// Why not SDPA: a chunk after cached context needs a [query_len, context_len] mask, so SDPA's flash
// kernel does the masked half of the work too, and SDPA sums in an order that depends on the chunk's
// shape, so a row computed after a prefix hit would differ in the last bits from the same row in a
// fresh prefill. Here every row's arithmetic depends only on the row and its keys:
// - a work item is 16 consecutive query positions (one per SIMD lane) of one kv head, for each of
//   its GQA query heads (or for one of them); the lanes never mix, so a row's result does not
//   depend on its tile;
// - keys are taken 16 at a time in slices fixed by absolute position (a block, or a 16-key part of
//   one), each lane sums its dot products over d = 0..D-1 in order, and the online softmax
//   visits the slices in order; keys a row must not see get probability exactly 0, and a slice
//   with none of its keys visible is an exact no-op (its rescale factor is exp(0) = 1);
// so a chunk split anywhere, a fresh prefill and a prefill after a prefix hit give the same bits.
//
// Layout per item: the query tile is held transposed (qt[d] = 16 lanes), scores are 16 vectors
// (one per key, rows in lanes), and the output accumulator is transposed too (ot[d]); max, exp
// and sums are then lane-wise, with no horizontal reductions.
//
// A tile of a few rows (a one-token chunk after a prefix or tier hit, the tail of a chunk) would
// leave most lanes idle, so `attend_rows` takes it with the keys in lanes instead, doing each row's
// operations in the tile's order: each key's dot product an FMA chain over d (the slice's K
// transposed once per item), the same exp and masks, the sum over keys in key order, and each
// output element an FMA chain over the keys. So which path a row takes does not change its bits.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx.h"
#include "dtypes.h"
#include "vec16.h"

namespace {

using kvt::BF16;
using kvt::F32;
using kvt::V16;

constexpr int L = 16;  // lanes = query rows per tile = keys per slice
constexpr int NARROW = 8;  // tiles of at most this many rows go to attend_rows

struct Shape {
  int64_t q_row_stride, out_row_stride, block_stride, token_stride;
  int heads, kv_heads, head_dim, block_size;
  float scale;
  int64_t window;  // > 0: a row at position p sees keys j with p - window < j only
};

struct Seq {  // one prompt chunk: rows [q0, q0 + qlen) of q attend to keys [0, ctx); row i is at ctx - qlen + i
  int64_t q0, qlen, ctx, table_offset;
};

struct Item {
  int32_t seq, kvh;
  int64_t row0;  // first row of the tile, relative to the chunk
  int32_t h0, h1;  // its kv head's query heads [h0, h1) (of G): all of them, or one when tiles are few
};

// The cache's element type, chosen at run time: it only decides how a slice is widened into
// floats, so the tile code is compiled once per q type, not once per (q, cache) pair (with the
// fp8 caches, seven pairs made the portable x86-64 build take minutes).
enum class Cache { F32, BF16, E4M3, E5M2 };

// Keys [k0, k0 + n) of one kv head as a dense float [L, D] slice (`at` elements into the cache),
// rows n..L-1 zero (they may be past the sequence's end: never-written cache, which must not reach
// a product even as 0 * NaN).
inline void load_slice(Cache c, const void* cache, int64_t at, int64_t stride, int n, int D, float* dst) {
  switch (c) {
    case Cache::F32: kvt::load_rows<F32>(static_cast<const float*>(cache) + at, stride, n, D, dst); break;
    case Cache::BF16: kvt::load_rows<BF16>(static_cast<const uint16_t*>(cache) + at, stride, n, D, dst); break;
    case Cache::E4M3: kvt::load_rows<kvt::E4M3>(static_cast<const kvt::fp8e4m3*>(cache) + at, stride, n, D, dst); break;
    case Cache::E5M2: kvt::load_rows<kvt::E5M2>(static_cast<const kvt::fp8e5m2*>(cache) + at, stride, n, D, dst); break;
  }
  std::fill(dst + int64_t(n) * D, dst + int64_t(L) * D, 0.0f);
}

// IO is q's and out's element type, KV the cache's (a bfloat16 cache under float32 q with --kv-cache-dtype).
template <class IO, int D_>
void attend_tile(const typename IO::T* q, Cache cache, const void* kc, const void* vc, typename IO::T* out,
                 const int64_t* table, const Seq& sq, const Item& it, const Shape& s, float* scratch) {
  const int D = D_ > 0 ? D_ : s.head_dim;
  const int G = s.heads / s.kv_heads, BS = s.block_size;
  const int rows = int(std::min<int64_t>(L, sq.qlen - it.row0));
  const int64_t pos0 = sq.ctx - sq.qlen + it.row0;  // position of lane 0
  float* qt = scratch;                      // [G][D][L]
  float* ot = qt + int64_t(G) * D * L;      // [G][D][L]
  float* kbuf = ot + int64_t(G) * D * L;    // [L][D]
  float* vbuf = kbuf + int64_t(L) * D;      // [L][D]
  float posf[L];
  for (int r = 0; r < L; ++r) posf[r] = float(pos0 + std::min(r, rows - 1));  // spare lanes copy the last row
  const V16 rowpos = V16::load(posf);
  V16 m[16], l[16];  // per head (G <= 16, checked by the caller)
  for (int h = it.h0; h < it.h1; ++h) {
    const int qh = it.kvh * G + h;
    for (int r = 0; r < L; ++r) {
      const typename IO::T* qr = q + (sq.q0 + it.row0 + std::min(r, rows - 1)) * s.q_row_stride + int64_t(qh) * D;
      for (int d = 0; d < D; ++d) qt[(int64_t(h) * D + d) * L + r] = IO::load(qr, d) * s.scale;
    }
    std::fill(ot + int64_t(h) * D * L, ot + int64_t(h + 1) * D * L, 0.0f);
    m[h] = V16::set1(-INFINITY);
    l[h] = V16::zero();
  }
  const int slice = std::min(BS, L);  // keys per slice: a block, or a 16-key part of one
  const int64_t last = pos0 + rows - 1;  // the tile's last row sees keys [0, last]
  // With a window, slices wholly before the first row's window are invisible to every row: skipping
  // them is the same no-op as visiting them.
  const int64_t first_key = s.window > 0 ? std::max<int64_t>(0, pos0 - s.window + 1) / slice * slice : 0;
  for (int64_t k0 = first_key; k0 <= last; k0 += slice) {
    const int n = int(std::min<int64_t>(slice, sq.ctx - k0));
    const int64_t base = table[k0 / BS] * s.block_stride + (k0 % BS) * s.token_stride + int64_t(it.kvh) * D;
    // Dense float copies: the products then address K and V at fixed offsets, and bf16 is converted once.
    load_slice(cache, kc, base, s.token_stride, n, D, kbuf);
    load_slice(cache, vc, base, s.token_stride, n, D, vbuf);
    float keyf[L];  // slots past the slice's valid keys are masked for every row
    for (int j = 0; j < L; ++j) keyf[j] = j < n ? float(k0 + j) : INFINITY;
    // every key of the slice is visible to every row (none after a row, none out of a row's window)
    const bool visible = n == L && k0 + L - 1 <= pos0 && (s.window <= 0 || k0 > last - s.window);
    const bool windowed = s.window > 0 && k0 <= last - s.window;  // some row's window starts after k0
    for (int h = it.h0; h < it.h1; ++h) {
      V16 sc[L];
      #pragma GCC unroll 16
      for (int j = 0; j < L; ++j) sc[j] = V16::zero();
      const float* qh = qt + int64_t(h) * D * L;
      for (int d = 0; d < D; ++d) {
        const V16 qd = V16::load(qh + d * L);
        #pragma GCC unroll 16
        for (int j = 0; j < L; ++j) sc[j] = V16::fmadd(qd, V16::set1(kbuf[j * D + d]), sc[j]);
      }
      // The shortcuts below skip only operations that would leave every lane unchanged (a mask
      // with nothing to mask, a rescale by exactly 1), so the bits do not depend on them.
      V16 bmax = V16::set1(-INFINITY);
      if (visible) {
        #pragma GCC unroll 16
        for (int j = 0; j < L; ++j) bmax = V16::max(bmax, sc[j]);
      } else {
        #pragma GCC unroll 16
        for (int j = 0; j < L; ++j) {
          sc[j] = V16::masked_below(sc[j], rowpos, keyf[j]);  // -inf where the key is after the row
          if (windowed) sc[j] = V16::masked_above(sc[j], rowpos, keyf[j] + float(s.window - 1));
          bmax = V16::max(bmax, sc[j]);
        }
      }
      const V16 mnew = V16::max(m[h], bmax);
      V16 corr = V16::exp_nonpositive(m[h] - mnew);
      // A row whose window starts past this slice has seen nothing yet (m = -inf on both sides):
      // its rescale must be 0, not exp(NaN).
      if (s.window > 0) corr = V16::zero_where_neg_inf(corr, m[h]);
      V16 sum = V16::zero();
      if (visible) {
        #pragma GCC unroll 16
        for (int j = 0; j < L; ++j) {
          sc[j] = V16::exp_nonpositive(sc[j] - mnew);
          sum = sum + sc[j];
        }
      } else {
        #pragma GCC unroll 16
        for (int j = 0; j < L; ++j) {
          sc[j] = V16::zero_where_neg_inf(V16::exp_nonpositive(sc[j] - mnew), sc[j]);
          sum = sum + sc[j];
        }
      }
      l[h] = V16::fmadd(l[h], corr, sum);
      m[h] = mnew;
      const bool rescale = !V16::all_one(corr);
      float* oh = ot + int64_t(h) * D * L;
      int d = 0;
      for (; d + 4 <= D; d += 4) {  // four independent FMA chains (one per d) hide the FMA latency
        V16 o[4];
        for (int u = 0; u < 4; ++u) o[u] = rescale ? V16::load(oh + (d + u) * L) * corr : V16::load(oh + (d + u) * L);
        #pragma GCC unroll 16
        for (int j = 0; j < L; ++j)
          for (int u = 0; u < 4; ++u) o[u] = V16::fmadd(sc[j], V16::set1(vbuf[j * D + d + u]), o[u]);
        for (int u = 0; u < 4; ++u) o[u].store(oh + (d + u) * L);
      }
      for (; d < D; ++d) {
        V16 o = rescale ? V16::load(oh + d * L) * corr : V16::load(oh + d * L);
        #pragma GCC unroll 16
        for (int j = 0; j < L; ++j) o = V16::fmadd(sc[j], V16::set1(vbuf[j * D + d]), o);
        o.store(oh + d * L);
      }
    }
  }
  for (int h = it.h0; h < it.h1; ++h) {
    float inv[L];
    (V16::set1(1.0f) / l[h]).store(inv);  // l >= 1: every row sees its own key
    const float* oh = ot + int64_t(h) * D * L;
    for (int r = 0; r < rows; ++r) {
      typename IO::T* orow = out + (sq.q0 + it.row0 + r) * s.out_row_stride + int64_t(it.kvh * G + h) * D;
      for (int d = 0; d < D; ++d) IO::store(orow, d, oh[d * L + r] * inv[r]);
    }
  }
}

// C dot products of rows of qv ([C][D]) with the slice's 16 keys (kt: [D][16]), each an FMA chain
// over d in order; the C chains interleave (a fixed C keeps them in registers).
template <int C>
inline void dots(const float* qv, int D, const float* kt, V16* sc) {
  for (int c = 0; c < C; ++c) sc[c] = V16::zero();
  for (int d = 0; d < D; ++d) {
    const V16 kd = V16::load(kt + d * L);
    #pragma GCC unroll 4
    for (int c = 0; c < C; ++c) sc[c] = V16::fmadd(V16::set1(qv[c * D + d]), kd, sc[c]);
  }
}

// A tile of at most NARROW rows with the keys in lanes: the same result as attend_tile, bit for bit
// (see the top of the file), for about rows/16 of its arithmetic plus one transpose of K a slice.
template <class IO, int D_>
void attend_rows(const typename IO::T* q, Cache cache, const void* kc, const void* vc, typename IO::T* out,
                 const int64_t* table, const Seq& sq, const Item& it, const Shape& s, float* scratch) {
  const int D = D_ > 0 ? D_ : s.head_dim;
  const int G = s.heads / s.kv_heads, BS = s.block_size;
  const int rows = int(std::min<int64_t>(L, sq.qlen - it.row0));  // <= NARROW
  const int nh = it.h1 - it.h0;
  const int64_t pos0 = sq.ctx - sq.qlen + it.row0;
  float* kbuf = scratch;                    // [L][D]
  float* vbuf = kbuf + int64_t(L) * D;      // [L][D]
  float* kt = vbuf + int64_t(L) * D;        // [D][L]: the slice's K, keys in lanes
  float* qs = kt + int64_t(D) * L;          // [nh][rows][D], scaled
  float* os = qs + int64_t(nh) * NARROW * D;  // [nh][rows][D]
  float m[16 * NARROW], l[16 * NARROW];
  for (int h = 0; h < nh; ++h)
    for (int r = 0; r < rows; ++r) {
      const typename IO::T* qr = q + (sq.q0 + it.row0 + r) * s.q_row_stride + int64_t(it.kvh * G + it.h0 + h) * D;
      float* qv = qs + (int64_t(h) * rows + r) * D;
      for (int d = 0; d < D; ++d) qv[d] = IO::load(qr, d) * s.scale;
      std::fill(os + (int64_t(h) * rows + r) * D, os + (int64_t(h) * rows + r + 1) * D, 0.0f);
      m[h * rows + r] = -INFINITY;
      l[h * rows + r] = 0.0f;
    }
  const int slice = std::min(BS, L);
  const int64_t last = pos0 + rows - 1;
  const int64_t first_key = s.window > 0 ? std::max<int64_t>(0, pos0 - s.window + 1) / slice * slice : 0;
  for (int64_t k0 = first_key; k0 <= last; k0 += slice) {
    const int n = int(std::min<int64_t>(slice, sq.ctx - k0));
    const int64_t base = table[k0 / BS] * s.block_stride + (k0 % BS) * s.token_stride + int64_t(it.kvh) * D;
    // A whole float32 slice is read where it lies; else it is widened (and zero-filled past the
    // sequence's end) into kbuf and vbuf first, as attend_tile does.
    const float* vrows = vbuf;
    int64_t vstride = D;
    if (cache == Cache::F32 && n == L) {
      kvt::transpose16(static_cast<const float*>(kc) + base, s.token_stride, D, kt);
      vrows = static_cast<const float*>(vc) + base;
      vstride = s.token_stride;
    } else {
      load_slice(cache, kc, base, s.token_stride, n, D, kbuf);
      load_slice(cache, vc, base, s.token_stride, n, D, vbuf);
      kvt::transpose16(kbuf, D, D, kt);
    }
    // The keys each row sees are lanes [lo, hi) of the slice: those the tile's masks leave it.
    int lo[NARROW], hi[NARROW];
    for (int r = 0; r < rows; ++r) {
      const int64_t pos = pos0 + r;
      hi[r] = int(std::min<int64_t>(n, pos - k0 + 1));
      lo[r] = s.window > 0 ? int(std::max<int64_t>(0, pos - s.window + 1 - k0)) : 0;
    }
    // (head, row) pairs hr = h * rows + r, CH at a time: their dot products are independent FMA
    // chains, interleaved to hide the FMA latency (one chain alone waits on each step).
    constexpr int CH = 4;
    const int pairs = nh * rows;
    for (int c0 = 0; c0 < pairs; c0 += CH) {
      const int cn = std::min(CH, pairs - c0);
      V16 sc[CH];
      const float* qv = qs + int64_t(c0) * D;
      switch (cn) {
        case 4: dots<4>(qv, D, kt, sc); break;
        case 3: dots<3>(qv, D, kt, sc); break;
        case 2: dots<2>(qv, D, kt, sc); break;
        default: dots<1>(qv, D, kt, sc); break;
      }
      for (int c = 0; c < cn; ++c) {
        const int hr = c0 + c, r = hr % rows;
        // A slice the row sees none of is skipped: the tile's visit of it changes nothing.
        if (lo[r] >= hi[r]) continue;
        V16 x = sc[c];
        if (hi[r] < L) x = V16::neg_inf_from(x, hi[r]);
        if (lo[r] > 0) x = V16::neg_inf_below(x, lo[r]);
        const float bmax = x.hmax();
        const float mnew = m[hr] > bmax ? m[hr] : bmax;
        // kvt::exp_nonpositive is V16::exp_nonpositive's arithmetic on one lane (same bits)
        const float corr = s.window > 0 && m[hr] == -INFINITY ? 0.0f : kvt::exp_nonpositive(m[hr] - mnew);
        float p[L];
        V16::zero_where_neg_inf(V16::exp_nonpositive(x - V16::set1(mnew)), x).store(p);
        float sum = 0.0f;
        for (int j = 0; j < L; ++j) sum = sum + p[j];  // in key order, as the tile's lanes add them
        l[hr] = std::fma(l[hr], corr, sum);
        m[hr] = mnew;
        float* o = os + int64_t(hr) * D;
        const V16 cv = V16::set1(corr);
        const bool rescale = corr != 1.0f;
        int d = 0;
        for (; d + 2 * L <= D; d += 2 * L) {  // two independent chains over the keys
          V16 a0 = V16::load(o + d), a1 = V16::load(o + d + L);
          if (rescale) a0 = a0 * cv, a1 = a1 * cv;
          #pragma GCC unroll 16
          for (int j = 0; j < L; ++j) {
            const V16 pj = V16::set1(p[j]);
            a0 = V16::fmadd(pj, V16::load(vrows + j * vstride + d), a0);
            a1 = V16::fmadd(pj, V16::load(vrows + j * vstride + d + L), a1);
          }
          a0.store(o + d);
          a1.store(o + d + L);
        }
        for (; d + L <= D; d += L) {
          V16 a = V16::load(o + d);
          if (rescale) a = a * cv;
          #pragma GCC unroll 16
          for (int j = 0; j < L; ++j) a = V16::fmadd(V16::set1(p[j]), V16::load(vrows + j * vstride + d), a);
          a.store(o + d);
        }
        for (; d < D; ++d) {
          float a = rescale ? o[d] * corr : o[d];
          for (int j = 0; j < L; ++j) a = std::fma(p[j], vrows[j * vstride + d], a);
          o[d] = a;
        }
      }
    }
  }
  for (int h = 0; h < nh; ++h)
    for (int r = 0; r < rows; ++r) {
      const int hr = h * rows + r;
      const float inv = 1.0f / l[hr];  // the tile's lane-wise division, on one lane
      typename IO::T* orow = out + (sq.q0 + it.row0 + r) * s.out_row_stride + int64_t(it.kvh * G + it.h0 + h) * D;
      const float* o = os + int64_t(hr) * D;
      for (int d = 0; d < D; ++d) IO::store(orow, d, o[d] * inv);
    }
}

// The work items of a call, longest first. A work item is a tile of one kv head with all its query
// heads, which share the K/V slices. With fewer tiles than the threads can balance (a step after a
// prefix hit recomputes one tile per sequence), each query head is an item of its own: a head's
// arithmetic is the same either way, so the bits do not depend on this. A narrow tile keeps its heads
// together: their dot products are the chains attend_rows interleaves, and they share one transpose
// of each K slice.
std::vector<Item> make_items(const Seq* seqs, int64_t nseq, const Shape& s, int threads, bool narrow_together = true) {
  const int G = s.heads / s.kv_heads;
  int64_t tiles = 0;
  for (int64_t i = 0; i < nseq; ++i) tiles += (seqs[i].qlen + L - 1) / L * s.kv_heads;
  const int per = tiles >= 4 * int64_t(threads) ? G : 1;
  std::vector<Item> items;
  for (int64_t i = 0; i < nseq; ++i)
    for (int64_t r = 0; r < seqs[i].qlen; r += L) {
      const int step = narrow_together && seqs[i].qlen - r <= NARROW ? G : per;
      for (int kvh = 0; kvh < s.kv_heads; ++kvh)
        for (int h = 0; h < G; h += step) items.push_back({int32_t(i), kvh, r, h, std::min(G, h + step)});
    }
  // Longest first (the tiles furthest into their sequence see the most keys), so the dynamic
  // schedule does not end on one thread with a long tile.
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    return seqs[a.seq].ctx - seqs[a.seq].qlen + a.row0 > seqs[b.seq].ctx - seqs[b.seq].qlen + b.row0;
  });
  return items;
}

template <class IO, int D_>
void run(const void* q, Cache cache, const void* k, const void* v, void* out, const Seq* seqs, int64_t nseq,
         const int64_t* tables, const Shape& s, int threads) {
  using T = typename IO::T;
  const int G = s.heads / s.kv_heads;
  const std::vector<Item> items = make_items(seqs, nseq, s, threads);
  const size_t floats = std::max(size_t(2 * G * s.head_dim * L + 2 * L * s.head_dim),     // attend_tile's
                                 size_t(3 * L * s.head_dim + 2 * G * NARROW * s.head_dim));  // attend_rows'
  const int64_t n = int64_t(items.size());
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scratch(floats);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      const Seq& sq = seqs[items[i].seq];
      if (sq.qlen - items[i].row0 <= NARROW)
        attend_rows<IO, D_>(static_cast<const T*>(q), cache, k, v, static_cast<T*>(out), tables + sq.table_offset, sq,
                            items[i], s, scratch.data());
      else
        attend_tile<IO, D_>(static_cast<const T*>(q), cache, k, v, static_cast<T*>(out), tables + sq.table_offset, sq,
                            items[i], s, scratch.data());
    }
  }
}

#include "prefill_bf16.h"
#include "prefill_amx.h"

#ifdef KVT_PREFILL_BF16
// Every item of a call on the pairs path (bfloat16 q and cache): V^T packed once, then the items as
// `run`'s, each on the tile unit (AMX) or in vdpbf16ps.
template <int D_, bool AMX>
void run_pairs(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, const Seq* seqs, int64_t nseq,
               const int64_t* tables, const Shape& s, int threads) {
  std::vector<int64_t> first(nseq + 1, 0);
  for (int64_t i = 0; i < nseq; ++i) first[i + 1] = first[i] + (seqs[i].ctx + KS - 1) / KS;
  // Kept between calls (pack_vt writes every element it is read at): a fresh allocation of a long
  // context's V^T would fault its pages in again on every layer.
  static thread_local std::vector<uint16_t> vt;
  const size_t need = size_t(first[nseq]) * s.kv_heads * s.head_dim * KS;
  if (vt.size() < need) vt.resize(need);
  uint16_t* const vtp = vt.data();  // the caller's: inside the parallel region `vt` is each thread's own
  pack_vt(v, seqs, nseq, tables, s, first, vtp, threads);
  // narrow tiles split by head too: on this path a narrow tile costs a full one, and heads share nothing
  const std::vector<Item> items = make_items(seqs, nseq, s, threads, false);
  const int64_t n = int64_t(items.size());
  const size_t floats = pair_scratch_floats(s.head_dim);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scratch(floats);
#ifdef KVT_AMX
    if constexpr (AMX) configure_tiles();  // per thread, per call: oneDNN configures the tiles its own way
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      const Seq& sq = seqs[items[i].seq];
      const uint16_t* vts = vtp + first[items[i].seq] * s.kv_heads * int64_t(s.head_dim) * KS;
#ifdef KVT_AMX
      if constexpr (AMX) {
        attend_tile_amx<D_>(q, k, out, tables + sq.table_offset, vts, sq, items[i], s, scratch.data());
        continue;
      }
#endif
      attend_tile_dp<D_>(q, k, out, tables + sq.table_offset, vts, sq, items[i], s, scratch.data());
    }
#ifdef KVT_AMX
    if constexpr (AMX) _tile_release();
#endif
  }
}

template <bool AMX>
void dispatch_pairs(const void* q, const void* k, const void* v, void* out, const Seq* seqs, int64_t nseq,
                    const int64_t* tables, const Shape& s, int threads) {
  const auto* q16 = static_cast<const uint16_t*>(q);
  const auto *k16 = static_cast<const uint16_t*>(k), *v16 = static_cast<const uint16_t*>(v);
  auto* o16 = static_cast<uint16_t*>(out);
  if (s.head_dim == 64)
    run_pairs<64, AMX>(q16, k16, v16, o16, seqs, nseq, tables, s, threads);
  else if (s.head_dim == 128)
    run_pairs<128, AMX>(q16, k16, v16, o16, seqs, nseq, tables, s, threads);
  else
    run_pairs<0, AMX>(q16, k16, v16, o16, seqs, nseq, tables, s, threads);
}
#endif

// Which path bfloat16 q and cache take with `pairs` on: 2 AMX tiles, 1 vdpbf16ps, 0 none (attend_tile's).
int pairs_kind() {
#ifdef KVT_AMX
  if (amx_ready()) return 2;
#endif
#ifdef KVT_PREFILL_BF16
  return 1;
#else
  return 0;
#endif
}

template <class IO>
void dispatch(const void* q, Cache cache, const void* k, const void* v, void* out, const Seq* seqs, int64_t nseq,
              const int64_t* tables, const Shape& s, int threads) {
  if (s.head_dim == 64)
    run<IO, 64>(q, cache, k, v, out, seqs, nseq, tables, s, threads);
  else if (s.head_dim == 128)
    run<IO, 128>(q, cache, k, v, out, seqs, nseq, tables, s, threads);
  else
    run<IO, 0>(q, cache, k, v, out, seqs, nseq, tables, s, threads);
}

}  // namespace

extern "C" {

// seqs: nseq rows of (q0, qlen, ctx, table_offset) int64; tables: the block ids every row's
// table_offset points into (ntables of them); dtypes as kvt_paged_attention's. Returns 0, or -1 for
// shapes or dtypes the kernel does not take or a chunk whose table would run past the end of `tables`.
int kvt_prefill_attention(int dtypes, const void* q, int64_t q_row_stride, const void* k_cache,
                          const void* v_cache, int64_t block_stride, int64_t token_stride, void* out,
                          int64_t out_row_stride, const int64_t* seqs, int64_t nseq, const int64_t* tables,
                          int64_t ntables, int heads,
                          int kv_heads, int head_dim, int block_size, float scale, int64_t window, int threads,
                          int pairs) {
  if (kv_heads <= 0 || heads % kv_heads != 0 || heads / kv_heads > 16 || head_dim <= 0 || block_size <= 0 ||
      (block_size % L != 0 && L % block_size != 0) || (dtypes != 0 && dtypes != 2 && dtypes != 3 && dtypes != 4 &&
                                                       dtypes != 5 && dtypes != 8 && dtypes != 9))
    return -1;
  for (int64_t i = 0; i < nseq; ++i) {
    const int64_t* r = seqs + 4 * i;
    if (r[1] < 1 || r[2] < r[1] || r[3] < 0 || r[3] + (r[2] + block_size - 1) / block_size > ntables) return -1;
  }
  const Shape s{q_row_stride, out_row_stride, block_stride, token_stride, heads, kv_heads, head_dim, block_size, scale,
                window};
  const Seq* sq = reinterpret_cast<const Seq*>(seqs);
  const Cache cache = (dtypes & 14) == 2 ? Cache::BF16 : (dtypes & 14) == 4 ? Cache::E4M3
                      : (dtypes & 14) == 8 ? Cache::E5M2 : Cache::F32;
#ifdef KVT_PREFILL_BF16
  if (pairs && dtypes == 3 && head_dim % 32 == 0 && block_size % L == 0) {
#ifdef KVT_AMX
    if (pairs_kind() == 2) {
      dispatch_pairs<true>(q, k_cache, v_cache, out, sq, nseq, tables, s, threads);
      return 0;
    }
#endif
    dispatch_pairs<false>(q, k_cache, v_cache, out, sq, nseq, tables, s, threads);  // built for AVX512-BF16
    return 0;
  }
#endif
  if (dtypes & 1)
    dispatch<BF16>(q, cache, k_cache, v_cache, out, sq, nseq, tables, s, threads);
  else
    dispatch<F32>(q, cache, k_cache, v_cache, out, sq, nseq, tables, s, threads);
  return 0;
}

// The path kvt_prefill_attention's bfloat16 q and cache take with `pairs` set (head_dim a multiple of
// 32, block_size of 16): 2 AMX tiles (built for AMX-BF16 and the kernel granted the tile state),
// 1 vdpbf16ps (built for AVX512-BF16), 0 attend_tile's float32 lanes.
int kvt_prefill_bf16_kind() { return pairs_kind(); }

}  // extern "C"
