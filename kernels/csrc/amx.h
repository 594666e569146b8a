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
#include <vector>

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

// r[i][j] <- r[j][i] for a 16 x 16 block of 32-bit lanes (the bits moved as they are).
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
  }
}

// 2^x to a relative 7.5e-5 (a degree-3 fit on [-1/2, 1/2]; vscalefps flushes x far below
// -126 to 0), for the attention kernels' probabilities, which are rounded to bfloat16
// (2^-9) for P V: vec.h's float32-accurate exp2_neg_ps is not needed there (this one took
// 15% less of the prefill softmax's time).
inline __m512 exp2_coarse(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 y = _mm512_fmadd_ps(_mm512_set1_ps(5.517166480e-2f), f, _mm512_set1_ps(2.426111251e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.932609677e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.999280572e-1f));
  return _mm512_scalef_ps(y, n);
}

// A candidate for a row's argmax: torch.argmax's order (a NaN above every number, the
// first NaN or the first maximum wins).
struct Best {
  float value;
  int64_t index;
  bool beats(const Best& o) const {
    const bool nan = value != value, other_nan = o.value != o.value;
    if (nan || other_nan) return nan && (!other_nan || index < o.index);
    return value > o.value || (value == o.value && index < o.index);
  }
};

// Greedy tokens from tiles of sums, one thread's share: per row of x, 16 lanes of (first
// maximum, its column) over the columns the thread meets in increasing order (a later
// equal value does not win, a NaN wins over numbers, the first NaN stays; columns below
// 2^31). merge_into folds them into best[row] (index -1: none yet) in torch.argmax's
// order, under the caller's lock.
struct LaneArgmax {
  std::vector<float> value;
  std::vector<int32_t> column;  // -1: none yet
  explicit LaneArgmax(int64_t rows) : value(rows * 16, 0.0f), column(rows * 16, -1) {}

  // Row r's sums v of columns first..first+15 (`valid` of them).
  void update(int64_t r, int64_t first, __mmask16 valid, __m512 v) {
    float* kv = value.data() + 16 * r;
    int32_t* kc = column.data() + 16 * r;
    const __m512 kept = _mm512_loadu_ps(kv);
    const __m512i at = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(first)),
                                        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __mmask16 fresh = _mm512_cmp_epi32_mask(_mm512_loadu_si512(kc), _mm512_set1_epi32(-1), _MM_CMPINT_EQ);
    const __mmask16 take = valid & (fresh | _mm512_cmp_ps_mask(v, kept, _CMP_GT_OQ) |
                                     (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) & ~_mm512_cmp_ps_mask(kept, kept, _CMP_UNORD_Q)));
    _mm512_storeu_ps(kv, _mm512_mask_mov_ps(kept, take, v));
    _mm512_storeu_si512(kc, _mm512_mask_mov_epi32(_mm512_loadu_si512(kc), take, at));
  }

  void merge_into(Best* best) const {
    for (size_t i = 0; i < column.size(); ++i) {
      const Best c{value[i], column[i]};
      if (c.index >= 0 && (best[i / 16].index < 0 || c.beats(best[i / 16]))) best[i / 16] = c;
    }
  }
};

}  // namespace vlmserve_amx
#else
#define VLMSERVE_AMX 0
#endif
