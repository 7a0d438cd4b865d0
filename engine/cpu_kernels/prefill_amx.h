// The prefill kernel's tile on AMX (bfloat16 q and cache, head_dim a multiple of 32, 16-key slices):
// QK^T and P·V on the tile unit, the softmax in AVX-512 lanes as attend_tile does it.
//
// Included by prefill_attention.cpp inside its namespace (it uses Shape, Seq, Item, and prefill_bf16.h's
// slices, V^T packing and softmax step). Built only where the compiler targets AMX-BF16 (-march=native
// on such a CPU); elsewhere `amx_ready()` is false.
//
// Layout, chosen so that the softmax keeps attend_tile's lanes (one query row per lane, no
// horizontal reductions):
// - scores come out transposed, S^T[key][row] = K · Q^T: A is the slice's K read in place from the
//   cache (16 keys x 32 dims a tile op), B is the tile's Q^T in pairs of dims (built once per item);
// - O^T[dim][row] += V^T · P^T: A is V^T (packed once per call for every slice, `pack_vt`), B is P^T in
//   pairs of keys, made from the 16 score vectors by one conversion and one permute per pair.
// O^T lives in memory between slices (8 tile registers hold one slice's operands), which is also
// where the online softmax rescales it.
//
// Bits: a row's scores, probabilities and output depend only on the row, its keys and the slices
// (fixed by absolute position), as in attend_tile, so a chunk split anywhere, a fresh prefill and a
// prefill after a prefix hit give the same bits, on this path. Every item of a call takes it when it
// is on (narrow tiles too), since its arithmetic is not attend_tile's: P is rounded to bfloat16 for
// P·V (the normaliser sums the float32 P), as flash attention does in bf16, and the products sum in
// the tile unit's order.
#ifdef KVT_AMX
using kvt::amx_ready;

// Every tile 16 rows of 64 bytes: tmm0/1 S^T of the slice's two 16-key halves [16 keys][16 rows] f32;
// tmm2 the A operand, K [16 keys][32 dims] or V^T [16 dims][32 keys] bf16; tmm3 the B operand, Q^T
// [16 dim pairs][16 rows x 2] or P^T [16 key pairs][16 rows x 2]; tmm4..7 O^T [16 dims][16 rows] f32.
inline void configure_tiles() { kvt::configure_full_tiles(); }


// O^T += V^T · P^T for one slice (P^T in tmm3). With D = 64, O^T stays in tmm4..7 for the whole
// item (the loop is head by head so that one head's four tiles fit); other sizes keep it in memory.
template <int D_>
inline void accumulate_pv(const uint16_t* vp, float* oh, int D) {
  if constexpr (D_ == 64) {
    _tile_loadd(2, vp + 0 * 16 * KS, 64);
    _tile_dpbf16ps(4, 2, 3);
    _tile_loadd(2, vp + 1 * 16 * KS, 64);
    _tile_dpbf16ps(5, 2, 3);
    _tile_loadd(2, vp + 2 * 16 * KS, 64);
    _tile_dpbf16ps(6, 2, 3);
    _tile_loadd(2, vp + 3 * 16 * KS, 64);
    _tile_dpbf16ps(7, 2, 3);
  } else {
    for (int c = 0; c < D / 16; ++c) {
      _tile_loadd(4, oh + c * 16 * L, 64);
      _tile_loadd(2, vp + c * 16 * KS, 64);
      _tile_dpbf16ps(4, 2, 3);
      _tile_stored(4, oh + c * 16 * L, 64);
    }
  }
}

template <int D_>
inline void store_o(float* oh) {
  if constexpr (D_ == 64) {
    _tile_stored(4, oh + 0 * 16 * L, 64);
    _tile_stored(5, oh + 1 * 16 * L, 64);
    _tile_stored(6, oh + 2 * 16 * L, 64);
    _tile_stored(7, oh + 3 * 16 * L, 64);
  }
}

template <int D_>
inline void load_o(const float* oh) {
  if constexpr (D_ == 64) {
    _tile_loadd(4, oh + 0 * 16 * L, 64);
    _tile_loadd(5, oh + 1 * 16 * L, 64);
    _tile_loadd(6, oh + 2 * 16 * L, 64);
    _tile_loadd(7, oh + 3 * 16 * L, 64);
  }
}

// attend_tile's item with bfloat16 q and cache on the tile unit. scratch: pair_scratch_floats(D).
template <int D_>
void attend_tile_amx(const uint16_t* q, const uint16_t* kc, uint16_t* out, const int64_t* table, const uint16_t* vt,
                     const Seq& sq, const Item& it, const Shape& s, float* scratch) {
  const int D = D_ > 0 ? D_ : s.head_dim;
  const int G = s.heads / s.kv_heads, BS = s.block_size, C = D / 32;
  const auto [rows, pos0, last, first_key, rowpos] = tile_rows(sq, it, s);
  float* base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch) + 63) & ~uintptr_t(63));
  uint32_t* qt = reinterpret_cast<uint32_t*>(base);   // [C][16 pairs][16 rows]: Q^T, dims in pairs
  float* sbuf = base + size_t(D) * L / 2;              // [32 keys][16 rows]
  uint32_t* pbuf = reinterpret_cast<uint32_t*>(sbuf + 2 * 256);  // [16 key pairs][16 rows]
  float* oh = sbuf + 2 * 256 + 256;                    // [D][16 rows]
  for (int h = it.h0; h < it.h1; ++h) {
    const int qh = it.kvh * G + h;
    load_qt(q, sq, it, s, qh, D, rows, qt);
    std::fill(oh, oh + int64_t(D) * L, 0.0f);
    load_o<D_>(oh);
    V16 m = V16::set1(-INFINITY), l = V16::zero();
    for (int64_t k0 = first_key; k0 <= last; k0 += KS) {
      const int n = int(std::min<int64_t>(KS, sq.ctx - k0));
      const uint16_t* vp = vt + ((k0 / KS) * s.kv_heads + it.kvh) * int64_t(D) * KS;
      const bool visible = n == KS && k0 + KS - 1 <= pos0 && (s.window <= 0 || k0 > last - s.window);
      const bool windowed = s.window > 0 && k0 <= last - s.window;
      // A 16-key half wholly past the sequence's end is not read (no block there). Keys past the end
      // in a half that is read come from their block (memory that exists, maybe never written):
      // their scores are masked below and their V^T is zero.
      _tile_zero(0);
      _tile_zero(1);
      for (int b = 0; b < (n > L ? 2 : 1); ++b) {
        const uint16_t* kp = kc + table[(k0 + b * L) / BS] * s.block_stride + ((k0 + b * L) % BS) * s.token_stride +
                             int64_t(it.kvh) * D;
        for (int c = 0; c < C; ++c) {
          _tile_loadd(3, qt + c * 16 * L, 64);
          _tile_loadd(2, kp + c * 32, int(s.token_stride * 2));
          if (b == 0) _tile_dpbf16ps(0, 2, 3);
          else _tile_dpbf16ps(1, 2, 3);
        }
      }
      _tile_stored(0, sbuf, 64);
      _tile_stored(1, sbuf + 256, 64);
      V16 sc[KS];
      for (int j = 0; j < KS; ++j) sc[j] = V16::load(sbuf + j * L);
      const V16 corr = softmax_slice(sc, n, k0, visible, windowed, s, rowpos, m, l, pbuf);
      if (!V16::all_one(corr)) {
        store_o<D_>(oh);
        for (int d = 0; d < D; ++d) (V16::load(oh + d * L) * corr).store(oh + d * L);
        load_o<D_>(oh);
      }
      _tile_loadd(3, pbuf, 64);
      accumulate_pv<D_>(vp, oh, D);
    }
    store_o<D_>(oh);
    store_rows(oh, l, out, sq, it, s, qh, D, rows);
  }
}
#else
using kvt::amx_ready;
#endif
