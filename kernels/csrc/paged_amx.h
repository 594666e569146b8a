// The decode kernel's AMX path (paged_attention_cpu.cpp; Intel's `amx_bf16`): one
// (sequence, kv head) of at most 16 query rows, bfloat16 q and cache, head dim a multiple
// of 32, blocks a multiple of 16 tokens. The vector path spends ~120 cycles a key at
// Gemma 3 270M's shape (4 rows, head dim 256) on float32 FMAs over widened keys and
// values; here both products run on tiles, K read in place and V copied once as pairs:
//
// - scores transposed, S^T = K Q^T: A is 16 keys of a block read in place from the cache
//   (rows head_dim apart), B the rows' queries packed once an item as pairs of head dims;
//   a key's row of S^T is a vector whose lane r is query row r's score;
// - the online softmax across keys lane by lane (a running max and sum per lane = row);
// - P^T's vectors, rounded to bfloat16 in pairs of keys, transposed once into P's rows
//   (the A operand of O += P V), and the values packed per 32 keys as pairs (the B
//   operand: the one copy, 16 KB at head dim 256, in L1);
// - 32 keys (two halves of 16) a step: P V's products take K = 32 keys.
//
// The arithmetic is the prefill kernel's AMX path's: bfloat16 products, float32 sums,
// P rounded to bfloat16 (its exponentials to 7.5e-5), the rescale factors float32-exact.
// Keys outside [the first row's window start, the context) are zero values (their slots
// may hold a freed block's data) and zero probabilities.
#pragma once

#include "amx.h"

#if VLMSERVE_AMX && defined(__AVX512BF16__)
#define VLMSERVE_PAGED_AMX 1
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "vec.h"

namespace vlmserve_paged_amx {

constexpr float kLog2e = 1.4426950408889634f;

// Tiles: 0, 1 the scores of a step's two halves (C, 16 keys x 16 rows); 2, 3 their keys
// (A); 4 the queries' pairs of head dims (B); 5 P (A, `rows` rows x 32 keys); 6 the value
// pairs of 16 head dims (B); 7 O's 16 head dims (C, `rows` rows).
inline void configure(int rows) {
  vlmserve_amx::TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 8; ++t) c.bytes_per_row[t] = 64, c.rows[t] = 16;
  c.rows[5] = c.rows[7] = static_cast<uint8_t>(rows);
  _tile_loadconfig(&c);
}

// A thread's buffers: the queries' B tiles, a step's scores, P's rows and value pairs, O.
struct Scratch {
  vlmserve_vec::LineVector<uint32_t> qb, vp;
  vlmserve_vec::LineVector<float> st, o;
  vlmserve_vec::LineVector<uint16_t> pa;
};

// One item: `rows` (<= 16) query rows of q (row r at q + q_rows[r], bfloat16 bits, not
// scaled), row r seeing positions [lo[r], last[r]]; K and V of the kv head at k_head /
// v_head (slot-major, `dim` bfloat16 a slot), the sequence's blocks in `table`. Only
// positions [block_begin * block_size, min(ctx, block_end * block_size)). On return acc
// (rows x dim floats) = sum_j p_j v_j, m[r] the running max in natural units (-inf: no
// key seen) and l[r] = sum_j p_j, as attend_one leaves them.
inline void attend(const uint16_t* q, const int64_t* q_rows, int64_t rows, int64_t dim,
                   const int64_t* last, const int64_t* lo, int64_t ctx, int64_t block_size,
                   const int32_t* table, const uint16_t* k_head, const uint16_t* v_head,
                   float scale, int64_t block_begin, int64_t block_end, float* acc, float* m,
                   float* l, Scratch& w) {
  const int64_t chunks = dim / 32;
  // B tiles of the queries: chunk c, row i (head dims 32c + 2i, 32c + 2i + 1), lane r.
  w.qb.assign(chunks * 256, 0u);
  for (int64_t r = 0; r < rows; ++r) {
    const auto* src = reinterpret_cast<const uint32_t*>(q + q_rows[r]);
    for (int64_t c = 0; c < chunks; ++c)
      for (int i = 0; i < 16; ++i) w.qb[c * 256 + i * 16 + r] = src[c * 16 + i];
  }
  w.st.resize(32 * 16);
  w.pa.resize(16 * 32);
  w.vp.resize(16 * dim);
  w.o.assign(rows * dim, 0.f);
  configure(static_cast<int>(rows));

  const int64_t start = block_begin * block_size, stop = std::min(ctx, block_end * block_size);
  int64_t lo_min = lo[0], lo_max = lo[0], last_min = last[0];
  alignas(64) int32_t last_l[16], lo_l[16];
  for (int r = 0; r < 16; ++r) {
    last_l[r] = r < rows ? static_cast<int32_t>(last[r]) : -1;  // lanes past rows: nothing
    lo_l[r] = r < rows ? static_cast<int32_t>(lo[r]) : 0;
    if (r < rows) {
      lo_min = std::min(lo_min, lo[r]);
      lo_max = std::max(lo_max, lo[r]);
      last_min = std::min(last_min, last[r]);
    }
  }
  const __m512i last_v = _mm512_load_si512(last_l), lo_v = _mm512_load_si512(lo_l);
  const __m512 sc = _mm512_set1_ps(scale * kLog2e);
  __m512 run_max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 run_sum = _mm512_setzero_ps();
  const __m512i pair_index = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);  // fmt: skip
  // Lane 2n: a[n], lane 2n + 1: b[n], for n < 16 (first16) or 16 <= n < 32 (last16): 32
  // pairs in two permutes (bf16_dot.h's interleave, 16 pairs in four ops, and its
  // round_interleave for P measured 4-7% slower here, cache-resident).
  alignas(64) int16_t interleave[64];
  for (int n = 0; n < 32; ++n) interleave[2 * n] = n, interleave[2 * n + 1] = 32 + n;
  const __m512i first16 = _mm512_load_si512(interleave);
  const __m512i last16 = _mm512_load_si512(interleave + 32);
  auto slot = [&](int64_t pos) {
    return static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size;
  };
  for (int64_t pos0 = start; pos0 < stop; pos0 += 32) {
    const bool second = pos0 + 16 < stop;
    // The next step's keys and values into L2 while this one is computed.
    for (int64_t h = 0; h < 2; ++h) {
      const int64_t next = pos0 + 32 + 16 * h;
      if (next >= stop) break;
      const char* kn = reinterpret_cast<const char*>(k_head + slot(next) * dim);
      const char* vn = reinterpret_cast<const char*>(v_head + slot(next) * dim);
      for (int64_t off = 0; off < 32 * dim; off += 64) {
        _mm_prefetch(kn + off, _MM_HINT_T1);
        _mm_prefetch(vn + off, _MM_HINT_T1);
      }
    }
    // Scores: S^T of each half, 16 keys x 16 lanes (rows).
    const uint16_t* k0 = k_head + slot(pos0) * dim;
    const uint16_t* k1 = second ? k_head + slot(pos0 + 16) * dim : nullptr;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t c = 0; c < chunks; ++c) {
      _tile_loadd(4, w.qb.data() + c * 256, 64);
      _tile_loadd(2, k0 + 32 * c, dim * 2);
      _tile_dpbf16ps(0, 2, 4);
      if (second) {
        _tile_loadd(3, k1 + 32 * c, dim * 2);
        _tile_dpbf16ps(1, 3, 4);
      }
    }
    _tile_stored(0, w.st.data(), 64);
    _tile_stored(1, w.st.data() + 256, 64);
    // The values, pairs of keys (zero outside [lo_min, ctx)), while the tiles multiply.
    for (int64_t k = 0; k < 16; ++k) {
      const int64_t p0 = pos0 + 2 * k, p1 = p0 + 1;
      const bool in0 = p0 >= lo_min && p0 < ctx, in1 = p1 >= lo_min && p1 < ctx;
      const uint16_t* v0 = in0 ? v_head + slot(p0) * dim : nullptr;
      const uint16_t* v1 = in1 ? v_head + slot(p1) * dim : nullptr;
      uint32_t* dst = w.vp.data() + k * dim;
      for (int64_t d = 0; d < dim; d += 32) {
        const __m512i a = v0 ? _mm512_loadu_si512(v0 + d) : _mm512_setzero_si512();
        const __m512i b = v1 ? _mm512_loadu_si512(v1 + d) : _mm512_setzero_si512();
        _mm512_store_si512(dst + d, _mm512_permutex2var_epi16(a, first16, b));
        _mm512_store_si512(dst + d + 16, _mm512_permutex2var_epi16(a, last16, b));
      }
    }
    // Softmax over the step's keys, lane r = row r, in base-2 units.
    const int64_t valid = std::min<int64_t>(32, stop - pos0);
    const bool plain = pos0 >= lo_max && pos0 + 31 <= last_min && valid == 32;
    __m512 s[32];
    __mmask16 in[32];
    __m512 step_max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int j = 0; j < 32; ++j) {
      s[j] = _mm512_mul_ps(_mm512_load_ps(w.st.data() + 16 * j), sc);
      if (plain) {
        in[j] = static_cast<__mmask16>((1u << rows) - 1);
      } else {
        const __m512i pos = _mm512_set1_epi32(static_cast<int32_t>(pos0 + j));
        in[j] = j < valid ? static_cast<__mmask16>(_mm512_cmple_epi32_mask(pos, last_v) &
                                                   _mm512_cmpge_epi32_mask(pos, lo_v))
                          : static_cast<__mmask16>(0);
      }
      step_max = _mm512_mask_max_ps(step_max, in[j], step_max, s[j]);
    }
    const __m512 new_max = _mm512_max_ps(run_max, step_max);
    // A lane with nothing seen yet keeps -inf: shift by 0 there (its p are all zero).
    const __mmask16 seen = _mm512_cmp_ps_mask(new_max, new_max, _CMP_ORD_Q) &
                           ~_mm512_cmp_ps_mask(new_max, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
    const __m512 shift = _mm512_maskz_mov_ps(seen, new_max);
    __m512 sum0 = _mm512_setzero_ps(), sum1 = sum0;
    __m512 pairs[16];
    auto prob = [&](int j) {  // 2^(s - max), 0 where not visible
      return _mm512_maskz_mov_ps(in[j], vlmserve_amx::exp2_coarse(_mm512_sub_ps(s[j], shift)));
    };
    for (int i = 0; i < 16; ++i) {
      const __m512 e0 = prob(2 * i), e1 = prob(2 * i + 1);
      sum0 = _mm512_add_ps(sum0, e0);
      sum1 = _mm512_add_ps(sum1, e1);
      // lane r: (e0[r], e1[r]) in bfloat16
      pairs[i] = _mm512_castsi512_ps(
          _mm512_permutexvar_epi16(pair_index, (__m512i)_mm512_cvtne2ps_pbh(e1, e0)));
    }
    vlmserve_amx::transpose16(pairs);  // pairs[r]: row r's 16 pairs of keys, P's A row
    for (int64_t r = 0; r < rows; ++r)
      _mm512_store_ps(reinterpret_cast<float*>(w.pa.data() + 32 * r), pairs[r]);
    // Rescale: 2^(old max - new max), 0 on the first keys (old -inf), 1 while unseen.
    const __m512 factor = _mm512_mask_blend_ps(
        seen, _mm512_set1_ps(1.f), vlmserve_vec::exp2_neg_ps(_mm512_sub_ps(run_max, shift)));
    run_sum = _mm512_fmadd_ps(run_sum, factor, _mm512_add_ps(sum0, sum1));
    run_max = new_max;
    alignas(64) float f[16];
    _mm512_store_ps(f, factor);
    for (int64_t r = 0; r < rows; ++r) {
      if (f[r] == 1.f) continue;
      const __m512 fr = _mm512_set1_ps(f[r]);
      float* orow = w.o.data() + r * dim;
      for (int64_t d = 0; d < dim; d += 16)
        _mm512_store_ps(orow + d, _mm512_mul_ps(_mm512_load_ps(orow + d), fr));
    }
    // O += P V, 16 head dims a product.
    _tile_loadd(5, w.pa.data(), 64);
    for (int64_t d = 0; d < dim; d += 16) {
      _tile_loadd(7, w.o.data() + d, dim * 4);
      _tile_loadd(6, w.vp.data() + d, dim * 4);
      _tile_dpbf16ps(7, 5, 6);
      _tile_stored(7, w.o.data() + d, dim * 4);
    }
  }
  _tile_release();  // no tile state for the OS to save while this thread runs vector code
  alignas(64) float mx[16], sm[16];
  _mm512_store_ps(mx, run_max);
  _mm512_store_ps(sm, run_sum);
  for (int64_t r = 0; r < rows; ++r) {
    m[r] = mx[r] / kLog2e;  // natural units, as the vector path's (flash-decoding merges)
    l[r] = sm[r];
    for (int64_t d = 0; d < dim; ++d) acc[r * dim + d] = w.o[r * dim + d];
  }
}

}  // namespace vlmserve_paged_amx
#else
#define VLMSERVE_PAGED_AMX 0
#endif
