// Intel AMX tiles (`amx_tile`, `amx_bf16`) for the kernels in this folder that use them:
// the process's permission to use the tile state, and one tile layout. VLMSERVE_AMX is 1
// where the build targets a CPU with AMX BF16 (-march=native on one), else 0 and nothing
// here exists.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define VLMSERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace vlmserve_amx {

// Asks Linux for the tile state once per process (oneDNN asks too); false if refused.
inline bool enabled() {
  static const bool ok = [] {
    constexpr int kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};

// Tiles 0-7, each 16 rows of 64 bytes (how a kernel assigns them is its own). Set per
// call or work item: oneDNN configures the tiles its own way on the same threads.
inline void configure() {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 8; ++t) c.bytes_per_row[t] = 64, c.rows[t] = 16;
  _tile_loadconfig(&c);
}

}  // namespace vlmserve_amx
#else
#define VLMSERVE_AMX 0
#endif
