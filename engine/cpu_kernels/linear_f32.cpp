// float32 linears on the vector units: y[M, N] = x[M, K] W^T (+ b), for every row count.
//
// Why not oneDNN (what torch's packed linear and vLLM's CPU build run): with a decode step's
// weights streamed from memory, its float32 brgemm on an AVX2 EPYC read them at 8-11 GB/s at 1-4
// rows (these two cores stream ~21 GB/s) and reached 39-76 GFLOP/s at 16-64 rows, about half of
// what the FMA units do (docs/CPU.md). Here each thread takes its own range of output columns,
// reads each 16-column panel of it from memory once per row block, and multiplies the block's row
// passes against it from L2.
//
// W is packed once at load (`kvt_linear_f32_pack`) into panels of 16 output columns, [N/16][K][16]:
// a panel is one sequential read, and the micro-kernel loads one 16-float row of it per input.
// The micro-kernel is MR rows x NP panels of float32 accumulators: 12 rows x 2 panels (zmm) in
// AVX-512's 32 registers, 6 x 1 panel (2 ymm) in AVX2's 16. With one panel a pass, AVX-512 was
// bound by its loads (13 per 12 FMAs) and ran at 0.67-0.93x oneDNN at 64-4096 rows on an AMX Xeon.
// Each output is the same dot product in the same order (k ascending, one fused multiply-add per
// input) whatever the row count, the row's position in the batch, the panels beside it or the
// thread count: results are batch-invariant.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include <omp.h>

#include "vec16.h"

namespace {

using kvt::V16;

constexpr int TN = 16;  // output columns per panel
#if defined(__AVX512F__)
#define KVT_F32_VECTOR 2
constexpr int MR = 12, NP = 2;  // 24 accumulators + two panels' rows + a broadcast in 32 zmm
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)  // vec16.h's AVX2 condition
#define KVT_F32_VECTOR 1
constexpr int MR = 6, NP = 1;  // 6 x 2 ymm accumulators + W's row (2) + a broadcast in 16 ymm
#else
#define KVT_F32_VECTOR 0
constexpr int MR = 4, NP = 1;
#endif
// Inputs per pass over W (at most): a panel's slice of KC inputs (128 KB) stays in L2 while every
// row pass of a row block reads it; only K beyond it is sliced. Row blocks: as many rows as keep
// their slice of x within X_BYTES of L2 (a multiple of every MR, at most MC_MAX).
constexpr int64_t KC = 2048;
constexpr int64_t X_BYTES = 192 << 10;
constexpr int64_t MC_STEP = 12, MC_MAX = 240;

void pack(const float* w, int64_t n, int64_t k, float* out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t j = 0; j < n / TN; ++j)
    for (int64_t i = 0; i < k; ++i)
      for (int c = 0; c < TN; ++c) out[(j * k + i) * TN + c] = w[(j * TN + c) * k + i];
}

// Rows x[0..R) (R <= MR, `xs` floats apart) times the slices `b` of P adjacent panels (`bs` floats
// apart), `kl` inputs each -> y rows (`ys` floats apart), 16 P columns: y = (first ? 0 : y) + x b,
// then + bias where `bias` is set (the last slice). Continuing a sum from y is exact (float32 stored
// and reloaded), so each output is one chain of fused multiply-adds over k ascending, however K is
// sliced and whichever panels share a pass. `pf`: the lines of P streams (`bs` apart) to prefetch
// during the pass, one per input each for the first `pf.n` inputs.
struct Prefetch {
  const float* p;
  int64_t n;
};

template <int R, int P>
inline void micro(const float* x, int64_t xs, const float* b, int64_t bs, int64_t kl, bool first, Prefetch pf,
                  const float* bias, float* y, int64_t ys) {
  V16 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < P; ++q) acc[r][q] = first ? V16::zero() : V16::load(y + r * ys + q * TN);
  for (int64_t i = 0; i < kl; ++i) {
    V16 w[P];
    for (int q = 0; q < P; ++q) {
      if (i < pf.n) __builtin_prefetch(pf.p + q * bs + i * TN, 0, 2);  // to L2: a panel outgrows L1
      w[q] = V16::load(b + q * bs + i * TN);
    }
    for (int r = 0; r < R; ++r) {
      const V16 xv = V16::set1(x[r * xs + i]);
      for (int q = 0; q < P; ++q) acc[r][q] = V16::fmadd(xv, w[q], acc[r][q]);
    }
  }
  for (int q = 0; q < P; ++q) {
    const V16 bv = bias ? V16::load(bias + q * TN) : V16::zero();
    for (int r = 0; r < R; ++r) (bias ? acc[r][q] + bv : acc[r][q]).store(y + r * ys + q * TN);
  }
}

template <int P, int R = MR>
inline void micro_n(int rows, const float* x, int64_t xs, const float* b, int64_t bs, int64_t kl, bool first,
                    Prefetch pf, const float* bias, float* y, int64_t ys) {
  if constexpr (R > 1) {
    if (rows < R) return micro_n<P, R - 1>(rows, x, xs, b, bs, kl, first, pf, bias, y, ys);
  }
  micro<R, P>(x, xs, b, bs, kl, first, pf, bias, y, ys);
}

template <int P = NP>
inline void panels_n(int np, int rows, const float* x, int64_t xs, const float* b, int64_t bs, int64_t kl,
                     bool first, Prefetch pf, const float* bias, float* y, int64_t ys) {
  if constexpr (P > 1) {
    if (np < P) return panels_n<P - 1>(np, rows, x, xs, b, bs, kl, first, pf, bias, y, ys);
  }
  micro_n<P>(rows, x, xs, b, bs, kl, first, pf, bias, y, ys);
}

// Each thread owns a contiguous range of column panels; it walks K in slices, then rows in blocks,
// then its panels, then the block's row passes. At decode sizes (one row block) W is read from
// memory once, each slice prefetched while the one before it is multiplied.
void gemm(const float* x, int64_t xs, int64_t m, const float* wp, int64_t n, int64_t k, const float* bias, float* y,
          int64_t ys, int threads) {
  const int64_t nb = n / TN;
  const int64_t parts = std::min<int64_t>(threads, nb);
  const int64_t slices = (k + KC - 1) / KC, kc = (k + slices - 1) / slices;  // even slices
  const int64_t mc = std::clamp<int64_t>(X_BYTES / (kc * int64_t(sizeof(float))) / MC_STEP * MC_STEP, MC_STEP, MC_MAX);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t j0 = nb * p / parts, j1 = nb * (p + 1) / parts;
    for (int64_t k0 = 0; k0 < k; k0 += kc) {
      const int64_t kl = std::min(kc, k - k0);
      const bool first = k0 == 0, last = k0 + kl == k;
      for (int64_t rb = 0; rb < m; rb += mc) {
        const int64_t rb1 = std::min(m, rb + mc);
        for (int64_t j = j0; j < j1; j += NP) {
          const int np = int(std::min<int64_t>(NP, j1 - j));  // an odd last panel goes alone
          const float* b = wp + j * k * TN + k0 * TN;
          // The next slices this thread reads: the next panels', or the first panels' next slices.
          const float* next = j + np < j1 ? b + np * k * TN : wp + j0 * k * TN + (k0 + kl) * TN;
          const int64_t passes = (rb1 - rb + MR - 1) / MR;
          for (int64_t t = 0, r0 = rb; r0 < rb1; ++t, r0 += MR) {
            const int rows = int(std::min<int64_t>(MR, rb1 - r0));
            const float* xr = x + r0 * xs + k0;
            // Pass t brings in its share of them. Fetched all in the first pass, that pass waited on
            // memory while the others fetched nothing (0.75x oneDNN at 256 rows against 0.94x).
            const int64_t i0 = kl * t / passes, i1 = kl * (t + 1) / passes;
            const Prefetch pf{next + i0 * TN, i1 - i0};
            const float* bj = last && bias ? bias + j * TN : nullptr;
            float* yr = y + r0 * ys + j * TN;
            panels_n(np, rows, xr, xs, b, k * TN, kl, first, pf, bj, yr, ys);
          }
        }
      }
    }
  }
}

}  // namespace

extern "C" {

// W [n, k] float32 row-major -> `out` (n * k floats) in the kernel's panel order. n % 16 == 0 (else -1).
int kvt_linear_f32_pack(const float* w, int64_t n, int64_t k, float* out, int threads) {
  if (n % TN || n <= 0 || k <= 0) return -1;
  pack(w, n, k, out, threads);
  return 0;
}

// y[m, n] = x[m, k] W^T + bias (nullable), float32; rows of x and y `*_stride` floats apart, W
// packed by kvt_linear_f32_pack.
int kvt_linear_f32(const float* x, int64_t x_stride, int64_t m, const float* wp, int64_t n, int64_t k,
                   const float* bias, float* y, int64_t y_stride, int threads) {
  if (n % TN || n <= 0 || k <= 0 || m < 0) return -1;
  if (m > 0) gemm(x, x_stride, m, wp, n, k, bias, y, y_stride, threads);
  return 0;
}

// What this build multiplies on: 2 AVX-512, 1 AVX2, 0 scalar lanes (slower than oneDNN, which then
// keeps the linears). engine/cpu_kernels/linear.py decides from it which kernel runs by default.
int kvt_linear_f32_ready() { return KVT_F32_VECTOR; }

}  // extern "C"
