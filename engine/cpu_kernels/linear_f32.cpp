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
// The micro-kernel is MR rows x 16 columns of float32 accumulators (MR = 12 with 32 vector
// registers, 6 with 16). Each output is the same dot product in the same order (k ascending, one
// fused multiply-add per input) whatever the row count, the row's position in the batch or the
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
#define KVT_F32_VECTOR 1
constexpr int MR = 12;  // 12 accumulators + W's row + a broadcast in 32 zmm registers
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)  // vec16.h's AVX2 condition
#define KVT_F32_VECTOR 1
constexpr int MR = 6;  // 6 x 2 ymm accumulators + W's row (2) + a broadcast in 16 registers
#else
#define KVT_F32_VECTOR 0
constexpr int MR = 4;
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

// Rows x[0..R) (R <= MR, `xs` floats apart) times a panel's slice `b` of `kl` inputs -> y rows
// (`ys` floats apart): y = (first ? 0 : y) + x b, then + bias where `bias` is set (the last slice).
// Continuing a sum from y is exact (float32 stored and reloaded), so each output is one chain of
// fused multiply-adds over k ascending, however K is sliced. `pf`: a stream to prefetch, one
// cache line per input.
template <int R>
inline void micro(const float* x, int64_t xs, const float* b, int64_t kl, bool first, const float* pf,
                  const float* bias, float* y, int64_t ys) {
  V16 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = first ? V16::zero() : V16::load(y + r * ys);
  for (int64_t i = 0; i < kl; ++i) {
    __builtin_prefetch(pf + i * TN, 0, 2);  // to L2 (prefetcht1): a panel outgrows L1
    const V16 w = V16::load(b + i * TN);
    for (int r = 0; r < R; ++r) acc[r] = V16::fmadd(V16::set1(x[r * xs + i]), w, acc[r]);
  }
  const V16 bv = bias ? V16::load(bias) : V16::zero();
  for (int r = 0; r < R; ++r) (bias ? acc[r] + bv : acc[r]).store(y + r * ys);
}

template <int R = MR>
inline void micro_n(int rows, const float* x, int64_t xs, const float* b, int64_t kl, bool first, const float* pf,
                    const float* bias, float* y, int64_t ys) {
  if constexpr (R > 1) {
    if (rows < R) return micro_n<R - 1>(rows, x, xs, b, kl, first, pf, bias, y, ys);
  }
  micro<R>(x, xs, b, kl, first, pf, bias, y, ys);
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
        for (int64_t j = j0; j < j1; ++j) {
          const float* b = wp + j * k * TN + k0 * TN;
          // The block's first pass brings in the next slice this thread reads (the next panel's,
          // or the first panel's next slice) while this one comes from L1 for the other passes.
          const float* next = j + 1 < j1 ? b + k * TN : wp + j0 * k * TN + (k0 + kl) * TN;
          for (int64_t r0 = rb; r0 < rb1; r0 += MR)
            micro_n(int(std::min<int64_t>(MR, rb1 - r0)), x + r0 * xs + k0, xs, b, kl, first,
                    r0 == rb ? next : b, last && bias ? bias + j * TN : nullptr, y + r0 * ys + j * TN, ys);
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

// Whether this build multiplies on vector units (AVX2 or AVX-512): without them the lane loops
// are slower than oneDNN, which then keeps the linears.
int kvt_linear_f32_ready() { return KVT_F32_VECTOR; }

}  // extern "C"
