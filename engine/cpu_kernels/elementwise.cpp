// Fused elementwise ops of a decoder layer on CPU: one pass over memory instead of the several torch
// ops (each its own pass and dispatch) of the eager code. Built with -ffp-contract=off so that every
// product and sum rounds as torch's do: float32 results are bit-identical to the eager ops'.
// (SiLU-and-multiply stays in torch: a C++ version with a polynomial exp measured slower.)
#include <cmath>
#include <cstdint>
#include <cstring>

#include "dtypes.h"

namespace {

using kvt::BF16;
using kvt::F32;

// out = w * (h * rsqrt(var + eps)) row by row, with var = mean(h^2) computed by torch: the same
// float32 operations as transformers' RMSNorm after its reduction, so results are bit-identical
// (a sum of squares here would be ordered differently from torch's and differ in the last bit,
// which random-weight models amplify to 1e-5 in the hidden states).
template <class IO>
void rms_norm_apply(const typename IO::T* h, const float* var, const typename IO::T* w, typename IO::T* out,
                    int64_t rows, int64_t n, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const typename IO::T* hr = h + r * n;
    const float inv = 1.0f / std::sqrt(var[r] + eps);
    typename IO::T* orow = out + r * n;
    for (int64_t i = 0; i < n; ++i) IO::store(orow, i, IO::load(w, i) * IO::round(IO::load(hr, i) * inv));
  }
}

// x[t, h, :] = x * cos[t] + rotate_half(x) * sin[t], in place; rows of x `row_stride` apart.
template <class IO>
void rope(typename IO::T* x, int64_t row_stride, const typename IO::T* cos, const typename IO::T* sin,
          int64_t tokens, int heads, int dim, int threads) {
  const int half = dim / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    const typename IO::T* c = cos + t * dim;
    const typename IO::T* s = sin + t * dim;
    for (int h = 0; h < heads; ++h) {
      typename IO::T* v = x + t * row_stride + int64_t(h) * dim;
      float a[512];  // dim <= 512, checked by the caller
      for (int i = 0; i < dim; ++i) a[i] = IO::load(v, i);
      for (int i = 0; i < dim; ++i) {
        const float rot = i < half ? -a[i + half] : a[i - half];
        IO::store(v, i, IO::round(IO::round(a[i] * IO::load(c, i)) + IO::round(rot * IO::load(s, i))));
      }
    }
  }
}

}  // namespace

extern "C" {

void kvt_rms_norm_apply(int bf16, const void* h, const float* var, const void* w, void* out, int64_t rows,
                        int64_t n, float eps, int threads) {
  if (bf16)
    rms_norm_apply<BF16>(static_cast<const uint16_t*>(h), var, static_cast<const uint16_t*>(w),
                         static_cast<uint16_t*>(out), rows, n, eps, threads);
  else
    rms_norm_apply<F32>(static_cast<const float*>(h), var, static_cast<const float*>(w), static_cast<float*>(out),
                        rows, n, eps, threads);
}

void kvt_rope(int bf16, void* x, int64_t row_stride, const void* cos, const void* sin, int64_t tokens, int heads,
              int dim, int threads) {
  if (bf16)
    rope<BF16>(static_cast<uint16_t*>(x), row_stride, static_cast<const uint16_t*>(cos),
               static_cast<const uint16_t*>(sin), tokens, heads, dim, threads);
  else
    rope<F32>(static_cast<float*>(x), row_stride, static_cast<const float*>(cos), static_cast<const float*>(sin),
              tokens, heads, dim, threads);
}

}  // extern "C"
