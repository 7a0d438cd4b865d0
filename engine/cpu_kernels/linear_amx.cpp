// bfloat16 linears on AMX tiles for the row counts of decode steps: y[M, N] = x[M, K] W^T (+ b).
//
// Why not oneDNN (what torch's packed linear and vLLM's CPU build run): at a few dozen rows a
// linear only streams its weight from memory, and oneDNN's brgemm read the demo model's decode
// weights at ~10 GB/s with one thread or two alike (a step's 212 MB in 22 ms at 1 row, 28 ms at
// 64), where these two cores stream ~20 GB/s. Here each thread takes its own range of output
// columns and streams that part of W once, in the order the tiles use it.
//
// W is packed once at load (`kvt_linear_pack`) into 1 KB B tiles, [N/16][K/32][16 k pairs][16 n][2]:
// a column block's tiles are contiguous, so a thread's share of W is one sequential read. x is
// the A operand, read in place (a partial 16-row block is copied into a zero-padded buffer). Tiles:
// tmm0..3 the C blocks of up to 64 rows, tmm4/5 A (alternating, so a load need not wait for the
// previous product), tmm6 B. Products sum in float32 in the tile unit's order; the bias is added
// in float32 and the result rounded to bfloat16 once, to nearest even.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "amx.h"
#include "dtypes.h"
#include "vec16.h"

namespace {

constexpr int TN = 16;  // output columns per B tile
constexpr int TK = 32;  // inputs per B tile (16 pairs)
constexpr int TILE = TN * TK;  // bf16 per packed tile
constexpr int MR = 64;  // rows per pass at decode sizes (up to MR rows): four C tiles, W streamed once
// Rows per pass above MR rows: 32 rows of x (36 KB at 576 inputs) stay in L1 while the pass walks
// the column blocks, so only W's tiles come from L2.
constexpr int MR_LARGE = 32;
constexpr int64_t L2_WEIGHTS = 1 << 20;  // bytes of W a thread keeps in L2 across an item's row passes
constexpr int PREFETCH = 4;  // B tiles ahead: the next 4 KB of a thread's stream

void pack(const uint16_t* w, int64_t n, int64_t k, uint16_t* out, int threads) {
  const int64_t nb = n / TN, kb = k / TK;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t j = 0; j < nb; ++j)
    for (int64_t c = 0; c < kb; ++c) {
      uint16_t* t = out + (j * kb + c) * TILE;
      for (int p = 0; p < TK / 2; ++p)
        for (int col = 0; col < TN; ++col)
          for (int i = 0; i < 2; ++i) t[(p * TN + col) * 2 + i] = w[(j * TN + col) * k + c * TK + 2 * p + i];
    }
}

#ifdef KVT_AMX
// One pass: rows [0, 16 * MT) of `a` (its blocks' pointers and byte strides) against column block
// `b` (K/32 tiles), into `c` (16 * MT rows of 16 floats).
template <int MT>
inline void block(const uint16_t* const* a, const int* a_stride, const uint16_t* b, int64_t kb, float* c) {
  if constexpr (MT > 0) _tile_zero(0);
  if constexpr (MT > 1) _tile_zero(1);
  if constexpr (MT > 2) _tile_zero(2);
  if constexpr (MT > 3) _tile_zero(3);
  for (int64_t t = 0; t < kb; ++t) {
    // Past a 4 KB page the hardware prefetcher stops: without this, ~11 GB/s instead of ~20.
    const char* pf = reinterpret_cast<const char*>(b + (t + PREFETCH) * TILE);
    for (int l = 0; l < 16; ++l) _mm_prefetch(pf + 64 * l, _MM_HINT_T0);
    _tile_loadd(6, b + t * TILE, 64);
    const int64_t off = t * TK;
    _tile_loadd(4, a[0] + off, a_stride[0]);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (MT > 1) {
      _tile_loadd(5, a[1] + off, a_stride[1]);
      _tile_dpbf16ps(1, 5, 6);
    }
    if constexpr (MT > 2) {
      _tile_loadd(4, a[2] + off, a_stride[2]);
      _tile_dpbf16ps(2, 4, 6);
    }
    if constexpr (MT > 3) {
      _tile_loadd(5, a[3] + off, a_stride[3]);
      _tile_dpbf16ps(3, 5, 6);
    }
  }
  if constexpr (MT > 0) _tile_stored(0, c, 64);
  if constexpr (MT > 1) _tile_stored(1, c + 256, 64);
  if constexpr (MT > 2) _tile_stored(2, c + 512, 64);
  if constexpr (MT > 3) _tile_stored(3, c + 768, 64);
}

// Work items: the column blocks in `parts` contiguous ranges (one per thread, or one per block
// when there are fewer blocks than threads), times row groups only where there are fewer blocks
// than threads. So each thread streams its own range of W once (per L2 chunk).
// The products of rows [0, 16 * mt) with column block `b` into `c`.
inline void product(int mt, const uint16_t* const* a, const int* as, const uint16_t* b, int64_t kb, float* c) {
  switch (mt) {
    case 1: block<1>(a, as, b, kb, c); break;
    case 2: block<2>(a, as, b, kb, c); break;
    case 3: block<3>(a, as, b, kb, c); break;
    default: block<4>(a, as, b, kb, c); break;
  }
}

// silu(g) * u in float32: x / (1 + e^-x) with e^-|x| (never overflows) from the attention
// kernels' exponential.
inline __m512 silu_mul(__m512 g, __m512 u) {
  const __m512 t = kvt::V16::exp_nonpositive({_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g))}).v;
  const __m512 one = _mm512_set1_ps(1.0f);
  const __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 num = _mm512_mask_mul_ps(g, neg, g, t);  // x, or x e^x where x < 0
  return _mm512_mul_ps(_mm512_div_ps(num, _mm512_add_ps(one, t)), u);
}

// `wu` null: y = x W^T + bias. `wu` set (a gated MLP's up, `wp` its gate, no bias): y = silu(x Wg^T) *
// (x Wu^T), both products in float32 and rounded once: the separate SiLU pass, and the gate's and
// up's round trips through memory, are gone.
void gemm(const uint16_t* x, int64_t x_stride, int64_t m, const uint16_t* wp, const uint16_t* wu, int64_t n,
          int64_t k, const uint16_t* bias, uint16_t* y, int64_t y_stride, int threads) {
  const int64_t nb = n / TN, kb = k / TK;
  const int64_t parts = std::min<int64_t>(threads, nb);
  const int mr = m > MR ? MR_LARGE : MR;
  const int64_t passes = (m + mr - 1) / mr, groups = std::min(passes, (threads + parts - 1) / parts);
  const int64_t per_group = (passes + groups - 1) / groups * mr;
  // Column blocks in chunks whose weights stay in L2 while the group's row passes read them.
  const int64_t chunk = std::max<int64_t>(1, L2_WEIGHTS / (kb * TILE * 2));
#pragma omp parallel num_threads(threads)
  {
    kvt::configure_full_tiles();
    thread_local std::vector<uint16_t> tail;  // a partial row block, zero-padded to 16 rows
    alignas(64) float c[MR * TN];
    alignas(64) float cu[MR * TN];
    alignas(64) float bb[TN];
#pragma omp for schedule(static)
    for (int64_t item = 0; item < parts * groups; ++item) {
      const int64_t p = item / groups, g = item % groups;
      const int64_t j0 = nb * p / parts, j1 = nb * (p + 1) / parts;
      const int64_t g1 = std::min(m, (g + 1) * per_group);
      for (int64_t c0 = j0; c0 < j1; c0 += chunk)
        for (int64_t r0 = g * per_group; r0 < g1; r0 += mr) {
          const int rows = int(std::min<int64_t>(mr, g1 - r0));
          const int mt = (rows + 15) / 16;
          const uint16_t* a[4];
          int as[4];
          for (int i = 0; i < mt; ++i) {
            a[i] = x + (r0 + 16 * i) * x_stride;
            as[i] = int(x_stride * 2);
          }
          if (rows % 16) {
            tail.assign(size_t(16 * k), 0);
            for (int r = 0; r < rows % 16; ++r)
              std::memcpy(tail.data() + r * k, a[mt - 1] + r * x_stride, size_t(k) * 2);
            a[mt - 1] = tail.data();
            as[mt - 1] = int(k * 2);
          }
          for (int64_t j = c0; j < std::min(j1, c0 + chunk); ++j) {
            product(mt, a, as, wp + j * kb * TILE, kb, c);
            if (wu) {
              product(mt, a, as, wu + j * kb * TILE, kb, cu);
              for (int r = 0; r < rows; ++r)
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (r0 + r) * y_stride + j * TN),
                                    reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(
                                        silu_mul(_mm512_load_ps(c + r * TN), _mm512_load_ps(cu + r * TN)))));
              continue;
            }
            __m512 bv = _mm512_setzero_ps();
            if (bias) {
              for (int i = 0; i < TN; ++i) bb[i] = kvt::bf16_to_f32(bias[j * TN + i]);
              bv = _mm512_load_ps(bb);
            }
            for (int r = 0; r < rows; ++r) {
              const __m512 v = _mm512_add_ps(_mm512_load_ps(c + r * TN), bv);
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (r0 + r) * y_stride + j * TN),
                                  reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
            }
          }
        }
    }
  }
}
#endif

}  // namespace

extern "C" {

// Whether kvt_linear runs here (AMX built in and granted to the process).
int kvt_linear_amx_ready() { return kvt::amx_ready() ? 1 : 0; }

// W [n, k] bfloat16 row-major -> `out` (n * k elements) in the kernel's tile order. n % 16 == 0,
// k % 32 == 0 (else -1).
int kvt_linear_pack(const uint16_t* w, int64_t n, int64_t k, uint16_t* out, int threads) {
  if (n % TN || k % TK || n <= 0 || k <= 0) return -1;
  pack(w, n, k, out, threads);
  return 0;
}

// y[m, n] = x[m, k] W^T + bias (nullable), bfloat16; rows of x and y `*_stride` elements apart,
// W packed by kvt_linear_pack. Returns -1 where AMX is not available or shapes do not fit.
int kvt_linear(const uint16_t* x, int64_t x_stride, int64_t m, const uint16_t* wp, int64_t n, int64_t k,
               const uint16_t* bias, uint16_t* y, int64_t y_stride, int threads) {
#ifdef KVT_AMX
  if (!kvt::amx_ready() || n % TN || k % TK || m < 0) return -1;
  if (m > 0) gemm(x, x_stride, m, wp, nullptr, n, k, bias, y, y_stride, threads);
  return 0;
#else
  (void)x, (void)x_stride, (void)m, (void)wp, (void)n, (void)k, (void)bias, (void)y, (void)y_stride, (void)threads;
  return -1;
#endif
}

// y[m, n] = silu(x Wg^T) * (x Wu^T), bfloat16, both [n, k] packed by kvt_linear_pack (a gated MLP's
// gate and up). Returns -1 where kvt_linear would.
int kvt_linear_silu_mul(const uint16_t* x, int64_t x_stride, int64_t m, const uint16_t* wg, const uint16_t* wu,
                        int64_t n, int64_t k, uint16_t* y, int64_t y_stride, int threads) {
#ifdef KVT_AMX
  if (!kvt::amx_ready() || n % TN || k % TK || m < 0) return -1;
  if (m > 0) gemm(x, x_stride, m, wg, wu, n, k, nullptr, y, y_stride, threads);
  return 0;
#else
  (void)x, (void)x_stride, (void)m, (void)wg, (void)wu, (void)n, (void)k, (void)y, (void)y_stride, (void)threads;
  return -1;
#endif
}

}  // extern "C"
