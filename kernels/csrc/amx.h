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

// Tiles 0-7, each 16 rows of 64 bytes (C 0-3, the shared operand 4, the others 5-7 in
// `tile_pass`). Set per call or work item: oneDNN configures the tiles its own way on the
// same threads.
inline void configure() {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 8; ++t) c.bytes_per_row[t] = 64, c.rows[t] = 16;
  _tile_loadconfig(&c);
}

// C tile c += the shared operand (tile 4: A if shared_is_a, else B) times tile o (the
// intrinsic takes tile numbers as literals, not template arguments).
#define VLMSERVE_AMX_DOT(c, o, shared_is_a) \
  do {                                      \
    if constexpr (shared_is_a)              \
      _tile_dpbf16ps(c, 4, o);              \
    else                                    \
      _tile_dpbf16ps(c, o, 4);              \
  } while (0)

// C tiles 0..T-1 = one operand shared by all times T others, over `steps` K steps of 32
// bfloat16: the shared one's step s at shared + s * step_bytes (its 16 rows `stride` bytes
// apart), other j's at others + 1024 (j * steps + s) (1 KB tiles, rows 64 bytes apart; in
// tiles 5, 6, 7, then 5 again); C_j stored to buf + 256 j.
template <int T, bool SharedIsA>
inline void tile_pass(const void* shared_ptr, int64_t step_bytes, int64_t stride,
                      const void* others_ptr, int64_t steps, float* buf) {
  const char* shared = static_cast<const char*>(shared_ptr);
  const char* others = static_cast<const char*>(others_ptr);
  _tile_zero(0);
  if constexpr (T > 1) _tile_zero(1);
  if constexpr (T > 2) _tile_zero(2);
  if constexpr (T > 3) _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    _mm_prefetch(shared + step_bytes * (s + 16), _MM_HINT_T0);
    _tile_loadd(4, shared + step_bytes * s, stride);
    _tile_loadd(5, others + 1024 * s, 64);
    VLMSERVE_AMX_DOT(0, 5, SharedIsA);
    if constexpr (T > 1) {
      _tile_loadd(6, others + 1024 * (steps + s), 64);
      VLMSERVE_AMX_DOT(1, 6, SharedIsA);
    }
    if constexpr (T > 2) {
      _tile_loadd(7, others + 1024 * (2 * steps + s), 64);
      VLMSERVE_AMX_DOT(2, 7, SharedIsA);
    }
    if constexpr (T > 3) {
      _tile_loadd(5, others + 1024 * (3 * steps + s), 64);
      VLMSERVE_AMX_DOT(3, 5, SharedIsA);
    }
  }
  _tile_stored(0, buf, 64);
  if constexpr (T > 1) _tile_stored(1, buf + 256, 64);
  if constexpr (T > 2) _tile_stored(2, buf + 512, 64);
  if constexpr (T > 3) _tile_stored(3, buf + 768, 64);
}

}  // namespace vlmserve_amx
#else
#define VLMSERVE_AMX 0
#endif
