// What the AMX kernels share: whether this process may use the tile unit, and the tile config.
// KVT_AMX is defined where the build targets AMX-BF16 (-march=native on such a CPU); elsewhere
// `amx_ready()` is false and the callers keep their other paths.
#pragma once
#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define KVT_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace kvt {

#ifdef KVT_AMX
inline bool amx_ready() {
  // Linux hands a process the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA).
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// All eight tiles 16 rows of 64 bytes. Per thread, and at every kernel entry: oneDNN's AMX
// kernels load their own configs on the same threads.
inline void configure_full_tiles() {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  _tile_loadconfig(&c);
}
#else
inline bool amx_ready() { return false; }
#endif

}  // namespace kvt
