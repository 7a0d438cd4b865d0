// Paged attention for CPU, reading K/V in place through the block table.
//
// Row r of the query attends to the first lens[r] tokens of its sequence's cache (tables[r]):
// a decode, or one token of a short prefill chunk whose causal context ends at its own position.
// A work item is a row (or, with few rows, one kv head of a row); K and V are read once for all
// the GQA query heads that share them, block by block, with an online softmax. Items are spread over torch's OpenMP pool (the
// library links the same libgomp, so no second thread pool competes for the cores).
//
// Built at first use by engine/cpu_kernels/build.py with the system compiler; no torch headers,
// called through ctypes with raw pointers, so the build takes about a second.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "dtypes.h"
#include "vec16.h"

namespace {

using kvt::BF16;
using kvt::exp_nonpositive;
using kvt::F32;
using kvt::load_rows;
using kvt::V16;

struct Shape {
  int64_t q_row_stride, out_row_stride;  // elements between query rows (heads * head_dim if contiguous)
  int64_t block_stride, token_stride;    // elements between cache blocks / tokens in a block
  int64_t table_stride;
  int heads, kv_heads, head_dim, block_size;
  float scale;
  int64_t window;  // > 0: each row attends to its last `window` keys only
};

// Blocks are scattered, so the hardware prefetcher cannot guess the next one: the next block's K
// and V rows (of kv heads [kv0, kv0 + nkv)) are prefetched while this one is computed, a few lines
// between each head's work rather than all at once. A burst of a whole block's ~400 prefetches
// fills the load queue and stalls the compute behind it; spread out, they keep memory busy under
// the compute: a batch-64 layer at context 305 took 1.7-1.8 ms with the burst, 0.95-1.06 spread
// (random blocks; 0.45 ms on cached data). Into L2 (locality 2, prefetcht1), not non-temporal:
// on an AMD EPYC (Zen 4) prefetchnta left compute and memory unoverlapped, and prefetcht1 made a
// batch-64 decode layer at context 344 24% faster in float32 (2.00 -> 1.53 ms) and 8% in bf16,
// A/B in one process (`benchmarks/kernels_cpu.py --against`). The weights do not stay in
// L2 or L3 between steps anyway (hundreds of MB).
class BlockPrefetch {
 public:
  template <class T, class S>
  void start(const T* kc, const T* vc, int64_t offset, int nkv, int D, const S& s, int pieces) {
    k_ = reinterpret_cast<const char*>(kc + offset);
    v_ = reinterpret_cast<const char*>(vc + offset);
    token_bytes_ = s.token_stride * int64_t(sizeof(T));
    lines_per_token_ = (int64_t(nkv) * D * int64_t(sizeof(T)) + 63) / 64;
    next_ = 0;
    total_ = lines_per_token_ * s.block_size;
    per_piece_ = (total_ + pieces - 1) / pieces;
  }
  // Issues the next piece (a K and a V prefetch per line); no-op once the block is covered.
  void issue() {
    for (const int64_t end = std::min(total_, next_ + per_piece_); next_ < end; ++next_) {
      const int64_t off = (next_ / lines_per_token_) * token_bytes_ + (next_ % lines_per_token_) * 64;
      __builtin_prefetch(k_ + off, 0, 2);
      __builtin_prefetch(v_ + off, 0, 2);
    }
  }
  void all() {
    per_piece_ = total_;
    issue();
  }
  // A row's first block (of `nblocks`, from b0), all at once: nothing is computed yet to hide it under.
  template <class T, class S>
  void first(const T* kc, const T* vc, const int64_t* table, int64_t b0, int64_t nblocks, int kv0, int nkv, int D,
             const S& s) {
    if (nblocks <= b0) return;
    start(kc, vc, table[b0] * s.block_stride + int64_t(kv0) * D, nkv, D, s, 1);
    all();
  }

 private:
  const char* k_ = nullptr;
  const char* v_ = nullptr;
  int64_t token_bytes_ = 0, lines_per_token_ = 0, next_ = 0, total_ = 0, per_piece_ = 0;
};

// D is a template parameter for the common head sizes (64, 128): fixed trip counts let the compiler
// keep a head's accumulator in registers and drop the remainder loops (7x faster than a runtime D).
// IO is q's and out's element type, KV the cache's (they differ with --kv-cache-dtype: float32 q over
// a bfloat16 cache); both are computed in float32.
template <class IO, class KV, int D_>
void attend(const typename IO::T* q, const typename KV::T* kc, const typename KV::T* vc, typename IO::T* out,
            const int64_t* table, int64_t len, int64_t start, int kv0, int kv1, const Shape& s, float* scratch) {
  // Keys [start, len): start > 0 for a sliding-window layer.
  // Query heads [h0, h1) are the GQA heads of kv heads [kv0, kv1). A whole-row item reads each
  // cache block once for all heads.
  const int D = D_ > 0 ? D_ : s.head_dim;
  const int G = s.heads / s.kv_heads, BS = s.block_size;
  const int h0 = kv0 * G, nh = (kv1 - kv0) * G;
  float* qf = scratch;            // [nh, D]
  float* acc = qf + nh * D;       // [nh, D]
  float* sc = acc + nh * D;       // [nh, BS]
  float* kb = sc + nh * BS;       // [BS, D]: one kv head's K (then V) rows of the block, as float
  float* m = kb + BS * D;         // [nh]
  float* l = m + nh;              // [nh]
  float* cr = l + nh;             // [nh]: this block's rescale of the head's accumulator
  for (int h = 0; h < nh; ++h) {
    const typename IO::T* qh = q + int64_t(h0 + h) * D;
    for (int d = 0; d < D; ++d) qf[h * D + d] = IO::load(qh, d) * s.scale;
    m[h] = -INFINITY;
    l[h] = 0.0f;
  }
  std::fill(acc, acc + nh * D, 0.0f);
  const int64_t nblocks = (len + BS - 1) / BS, b0 = start / BS;
  BlockPrefetch pf;
  pf.first(kc, vc, table, b0, nblocks, kv0, kv1 - kv0, D, s);
  for (int64_t b = b0; b < nblocks; ++b) {
    const int n = int(std::min<int64_t>(BS, len - b * BS));
    const int j0 = b == b0 ? int(start - b * BS) : 0;  // the window's first key in its first block
    if (b + 1 < nblocks) pf.start(kc, vc, table[b + 1] * s.block_stride + int64_t(kv0) * D, kv1 - kv0, D, s, nh);
    for (int kvh = kv0; kvh < kv1; ++kvh) {
      const int64_t base = table[b] * s.block_stride + int64_t(kvh) * D;
      load_rows<KV>(kc + base, s.token_stride, n, D, kb);
      for (int hh = 0; hh < G; ++hh) {
        const int h = (kvh - kv0) * G + hh;
        if (b + 1 < nblocks) pf.issue();
        const float* qh = qf + h * D;
        float* sh = sc + h * BS;
        for (int j = j0; j < n; ++j) {
          const float* kj = kb + j * D;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int d = 0; d < D; ++d) dot += qh[d] * kj[d];
          sh[j] = dot;
        }
        float bmax = sh[j0];
        for (int j = j0 + 1; j < n; ++j) bmax = std::max(bmax, sh[j]);
        const float mnew = std::max(m[h], bmax);
        const float corr = m[h] == -INFINITY ? 0.0f : exp_nonpositive(m[h] - mnew);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int j = j0; j < n; ++j) {
          const float p = exp_nonpositive(sh[j] - mnew);
          sh[j] = p;
          sum += p;
        }
        l[h] = l[h] * corr + sum;
        m[h] = mnew;
        cr[h] = corr;
      }
      load_rows<KV>(vc + base, s.token_stride, n, D, kb);
      for (int hh = 0; hh < G; ++hh) {
        const int h = (kvh - kv0) * G + hh;
        const float* sh = sc + h * BS;
        float a[D_ > 0 ? D_ : 1];
        float* ah = D_ > 0 ? a : acc + h * D;
        for (int d = 0; d < D; ++d) ah[d] = acc[h * D + d] * cr[h];
        for (int j = j0; j < n; ++j) {
          const float p = sh[j];
          const float* vj = kb + j * D;
#pragma omp simd
          for (int d = 0; d < D; ++d) ah[d] += p * vj[d];
        }
        for (int d = 0; d < D; ++d) acc[h * D + d] = ah[d];
      }
    }
  }
  for (int h = 0; h < nh; ++h) {
    const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;  // len 0: zeros, never NaN
    typename IO::T* oh = out + int64_t(h0 + h) * D;
    for (int d = 0; d < D; ++d) IO::store(oh, d, acc[h * D + d] * inv);
  }
}

inline V16 loadv(const float* p) { return V16::load(p); }
inline V16 loadv(const uint16_t* p) { return V16::load_bf16(p); }
inline V16 loadv(const kvt::fp8e4m3* p) { return V16::load_e4m3(p); }
inline V16 loadv(const kvt::fp8e5m2* p) { return V16::load_e5m2(p); }

// The same contract as `attend` for head sizes that are a multiple of 16, with the keys of a
// block in SIMD lanes: a head's 16 dot products are summed by one transpose-and-add tree
// (V16::hsum16) instead of 16 horizontal reductions, and the softmax of a slice is one vector.
// 2.4x faster than `attend` on cached data; the loads run ahead of use by a block.
template <class IO, class KV, int D>
void attend_lanes(const typename IO::T* q, const typename KV::T* kc, const typename KV::T* vc, typename IO::T* out,
                  const int64_t* table, int64_t len, int64_t start, int kv0, int kv1, const Shape& s, float* scratch) {
  static_assert(D % 16 == 0, "head size must be a multiple of 16");
  constexpr int C = D / 16;
  const int G = s.heads / s.kv_heads, BS = s.block_size;
  const int h0 = kv0 * G, nh = (kv1 - kv0) * G;
  float* qf = scratch;       // [nh, D], scaled
  float* acc = qf + nh * D;  // [nh, D]
  float* m = acc + nh * D;   // [nh]
  float* l = m + nh;         // [nh]
  float* wide = l + nh;      // [16, 2, D]: an fp8 slice's keys and values, widened
  for (int h = 0; h < nh; ++h)
    for (int d = 0; d < D; ++d) qf[h * D + d] = IO::load(q + int64_t(h0 + h) * D, d) * s.scale;
  std::fill(acc, acc + nh * D, 0.0f);
  std::fill(m, m + nh, -INFINITY);
  std::fill(l, l + nh, 0.0f);
  const int64_t nblocks = (len + BS - 1) / BS, b0 = start / BS;
  const int slices = (BS + 15) / 16;
  BlockPrefetch pf;
  pf.first(kc, vc, table, b0, nblocks, kv0, kv1 - kv0, D, s);
  for (int64_t b = b0; b < nblocks; ++b) {
    const int n = int(std::min<int64_t>(BS, len - b * BS));
    const int j0 = b == b0 ? int(start - b * BS) : 0;  // the window's first key in its first block
    const bool more = b + 1 < nblocks;
    if (more) pf.start(kc, vc, table[b + 1] * s.block_stride + int64_t(kv0) * D, kv1 - kv0, D, s, nh * slices);
    for (int kvh = kv0; kvh < kv1; ++kvh) {
      for (int k0 = j0 / 16 * 16; k0 < n; k0 += 16) {
        const int nk = std::min(16, n - k0);
        // Rows past the block's valid keys repeat its last valid one (never-written cache must not
        // reach a product, even as 0 * NaN); their lanes are masked.
        const typename KV::T* krow[16];
        const typename KV::T* vrow[16];
        const int64_t base = table[b] * s.block_stride + int64_t(kvh) * D;
        for (int j = 0; j < 16; ++j) {
          const int64_t t = (k0 + std::min(j, nk - 1)) * s.token_stride;
          krow[j] = kc + base + t;
          vrow[j] = vc + base + t;
        }
        auto heads = [&](const auto* const* kr, const auto* const* vr) {
        for (int hh = 0; hh < G; ++hh) {
          const int h = (kvh - kv0) * G + hh;
          if (more) pf.issue();
          V16 qv[C], dots[16];
          for (int c = 0; c < C; ++c) qv[c] = V16::load(qf + h * D + c * 16);
#pragma GCC unroll 16
          for (int j = 0; j < 16; ++j) {
            V16 a = qv[0] * loadv(kr[j]);
            for (int c = 1; c < C; ++c) a = V16::fmadd(qv[c], loadv(kr[j] + c * 16), a);
            dots[j] = a;
          }
          V16 sc = V16::hsum16(dots);
          if (nk < 16) sc = V16::neg_inf_from(sc, nk);
          if (j0 > k0) sc = V16::neg_inf_below(sc, j0 - k0);  // keys before the window
          const float mnew = std::max(m[h], sc.hmax());
          const float corr = m[h] == -INFINITY ? 0.0f : exp_nonpositive(m[h] - mnew);
          const V16 p = V16::zero_where_neg_inf(V16::exp_nonpositive(sc - V16::set1(mnew)), sc);
          l[h] = l[h] * corr + p.hsum();
          m[h] = mnew;
          V16 o[C];
          for (int c = 0; c < C; ++c) o[c] = V16::load(acc + h * D + c * 16) * V16::set1(corr);
          for (int j = 0; j < nk; ++j) {
            const V16 pj = V16::lane(p, j);
            for (int c = 0; c < C; ++c) o[c] = V16::fmadd(pj, loadv(vr[j] + c * 16), o[c]);
          }
          for (int c = 0; c < C; ++c) o[c].store(acc + h * D + c * 16);
        }
        };
        if constexpr (kvt::widened<KV>()) {
          // fp8: each key's K and V widened once into `wide`, not once per query head reading them.
          const float* kw[16];
          const float* vw[16];
          for (int j = 0; j < 16; ++j) {
            float* kd = wide + j * 2 * D;
            for (int c = 0; c < C; ++c) {
              loadv(krow[j] + c * 16).store(kd + c * 16);
              loadv(vrow[j] + c * 16).store(kd + D + c * 16);
            }
            kw[j] = kd;
            vw[j] = kd + D;
          }
          heads(kw, vw);
        } else {
          heads(krow, vrow);
        }
      }
    }
  }
  for (int h = 0; h < nh; ++h) {
    const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;  // len 0: zeros, never NaN
    typename IO::T* oh = out + int64_t(h0 + h) * D;
    for (int d = 0; d < D; ++d) IO::store(oh, d, acc[h * D + d] * inv);
  }
}

#include "decode_bf16.h"

template <class IO, class KV, int D_>
void run(const void* q, const void* k, const void* v, void* out, const int64_t* rows, const int64_t* tables,
         const int64_t* lens, int64_t n, const Shape& s, int threads) {
  // A sliding-window layer's row attends to its last s.window keys only.
  using T = typename IO::T;
  const T* qp = static_cast<const T*>(q);
  const typename KV::T* kp = static_cast<const typename KV::T*>(k);
  const typename KV::T* vp = static_cast<const typename KV::T*>(v);
  T* op = static_cast<T*>(out);
  // Whole rows read each block once; with few rows, split by kv head so every thread has work.
  const int per_item = n >= 4 * int64_t(threads) ? s.kv_heads : 1;
  const int splits = s.kv_heads / per_item;
  const int64_t items = n * splits;
  const int nh = per_item * (s.heads / s.kv_heads);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scratch(size_t(2 * nh * s.head_dim + nh * s.block_size + s.block_size * s.head_dim + 3 * nh +
                                      32 * s.head_dim));
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t i = it / splits;
      const int kv0 = int(it % splits) * per_item;
      const int64_t start = s.window > 0 ? std::max<int64_t>(0, lens[i] - s.window) : 0;
#ifdef KVT_DECODE_BF16
      if constexpr (std::is_same_v<IO, BF16> && std::is_same_v<KV, BF16> && D_ > 0 && D_ % 32 == 0)
        attend_bf16<D_>(qp + rows[i] * s.q_row_stride, kp, vp, op + rows[i] * s.out_row_stride,
                        tables + i * s.table_stride, lens[i], start, kv0, kv0 + per_item, s, scratch.data());
      else
#endif
      if constexpr (D_ > 0 && D_ % 16 == 0)
        attend_lanes<IO, KV, D_>(qp + rows[i] * s.q_row_stride, kp, vp, op + rows[i] * s.out_row_stride,
                             tables + i * s.table_stride, lens[i], start, kv0, kv0 + per_item, s, scratch.data());
      else
        attend<IO, KV, D_>(qp + rows[i] * s.q_row_stride, kp, vp, op + rows[i] * s.out_row_stride,
                       tables + i * s.table_stride, lens[i], start, kv0, kv0 + per_item, s, scratch.data());
    }
  }
}

template <class IO, class KV>
void dispatch(const void* q, const void* k, const void* v, void* out, const int64_t* rows, const int64_t* tables,
              const int64_t* lens, int64_t n, const Shape& s, int threads) {
  if (s.head_dim == 64)
    run<IO, KV, 64>(q, k, v, out, rows, tables, lens, n, s, threads);
  else if (s.head_dim == 128)
    run<IO, KV, 128>(q, k, v, out, rows, tables, lens, n, s, threads);
  else
    run<IO, KV, 0>(q, k, v, out, rows, tables, lens, n, s, threads);
}

}  // namespace

extern "C" {

// dtypes: bit 0 set = q/out bfloat16 (else float32); bits 1-3 the cache: 1 bfloat16, 2 fp8 e4m3,
// 4 fp8 e5m2, none float32; a float32 cache under bfloat16 q is not built. Returns 0, or -1 for
// shapes or dtypes the kernel does not take (the caller checks them first).
int kvt_paged_attention(int dtypes, const void* q, int64_t q_row_stride, const void* k_cache,
                        const void* v_cache, int64_t block_stride, int64_t token_stride, void* out,
                        int64_t out_row_stride, const int64_t* rows, const int64_t* tables, int64_t table_stride,
                        const int64_t* lens, int64_t n, int heads, int kv_heads, int head_dim, int block_size,
                        float scale, int64_t window, int threads) {
  if (kv_heads <= 0 || heads % kv_heads != 0 || head_dim <= 0 || block_size <= 0)
    return -1;
  const Shape s{q_row_stride, out_row_stride, block_stride, token_stride, table_stride,
                heads, kv_heads, head_dim, block_size, scale, window};
  if (dtypes == 3)
    dispatch<BF16, BF16>(q, k_cache, v_cache, out, rows, tables, lens, n, s, threads);
  else if (dtypes == 2)
    dispatch<F32, BF16>(q, k_cache, v_cache, out, rows, tables, lens, n, s, threads);
  else if (dtypes == 0)
    dispatch<F32, F32>(q, k_cache, v_cache, out, rows, tables, lens, n, s, threads);
  else if (dtypes == 4)
    dispatch<F32, kvt::E4M3>(q, k_cache, v_cache, out, rows, tables, lens, n, s, threads);
  else if (dtypes == 5)
    dispatch<BF16, kvt::E4M3>(q, k_cache, v_cache, out, rows, tables, lens, n, s, threads);
  else if (dtypes == 8)
    dispatch<F32, kvt::E5M2>(q, k_cache, v_cache, out, rows, tables, lens, n, s, threads);
  else if (dtypes == 9)
    dispatch<BF16, kvt::E5M2>(q, k_cache, v_cache, out, rows, tables, lens, n, s, threads);
  else
    return -1;
  return 0;
}

int kvt_abi_version() { return 11; }

}  // extern "C"
