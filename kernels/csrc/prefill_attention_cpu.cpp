// Prefill and extend attention on the CPU (float32 math whatever the q / cache dtype;
// AVX-512 or AVX2 + FMA), reading
// K/V straight from the paged cache through the block table: a fresh prompt and a chunk on
// a cached prefix are the same case (the step's own K/V are written to the cache before attention runs).
//
// Registered as torch.ops.vlmserve_prefill.prefill_attention; kernels/cpu_attention.py
// builds this file with torch.utils.cpp_extension on first use. Layout as
// paged_attention_cpu.cpp: a layer's cache is [2 (k, v), num_kv_heads, num_slots, head_dim].
//
// One work item is (sequence, kv head, block of consecutive query tokens). Its rows are
// the block's tokens times the group's query heads (GQA: every K/V row loaded serves them
// all), held transposed (qt[d][row], pre-scaled), so that the scores of a tile of keys come
// out as st[key][row] and the online softmax runs down the keys with rows across the
// vector lanes: no horizontal reductions. Two register-blocked micro-kernels do the FLOPs:
// scores (keys x rows of accumulators, a broadcast key element times a row of qt) and
// values (rows x dims, a broadcast probability times a row of V), sized to the registers. Tiles past a row
// block's last position are never visited; only the tiles that straddle the diagonal are
// masked. Each row sees the keys [lo, hi]: hi its position, or the end of the bidirectional
// span it is in (`key_ends`, an image's tokens); lo past the sliding window (`window` > 0),
// tiles wholly before every row's lo are never visited.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <immintrin.h>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "bf16_dot.h"
#include "paged_inputs.h"
#include "vec.h"

namespace {

#if VLMSERVE_VEC_LANES
namespace vec = vlmserve_vec;
using vec::kLanes;
using vec::vfloat;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kTileKeys = 64;  // keys per tile (the score tile is kTileKeys x rows)
// Register blocking: the scores micro-kernel holds kKeysPerStep x kMaxRowVecs accumulators
// plus kMaxRowVecs query vectors and a broadcast key element; the values micro-kernel
// kRowsPerStep x kMaxDimVecs accumulators plus kMaxDimVecs value vectors and a broadcast
// probability: 31 and 29 of AVX-512's 32 registers, 15 of AVX2's 16.
#if defined(__AVX512F__)
constexpr int kKeysPerStep = 4, kMaxRowVecs = 6, kRowsPerStep = 6, kMaxDimVecs = 4;
#else
constexpr int kKeysPerStep = 6, kMaxRowVecs = 2, kRowsPerStep = 6, kMaxDimVecs = 2;
#endif
constexpr int64_t kTargetRows = 96;  // query rows per item, a multiple of both widths
// The AMX path's: keys a step (the scores of this many keys go through the softmax
// together, and each P V pass keeps its output tiles in registers over all of them: o goes
// through the tiles once a step, so a longer step moves less of it) and query rows an item
// (measured on one AMX Xeon: 256 / 64 against 64-256 / 32-96; after the row-major rewrite
// 128-512 / 32-128 were all within noise of them).
constexpr int64_t kAmxKeys = 256;
constexpr int64_t kAmxRows = 64;
// The scores' row stride: not a multiple of 1 KB, whose tile stores ran slower.
constexpr int64_t kAmxLds = kAmxKeys + 16;

// st[j][r0 + L v + lane] = sum_d keys[j][d] * qt[d][r0 + L v + lane] for JB keys, NV vectors.
template <int JB, int NV>
inline void scores_tile(const float* const* keys, const float* qt, int64_t ldq, float* st,
                        int64_t lds, int64_t dim) {
  vfloat acc[JB][NV];
#pragma GCC unroll 8
  for (int j = 0; j < JB; ++j)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[j][v] = vec::zero();
  for (int64_t d = 0; d < dim; ++d) {
    vfloat q[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) q[v] = vec::load(qt + d * ldq + kLanes * v);
#pragma GCC unroll 8
    for (int j = 0; j < JB; ++j) {
      const vfloat k = vec::set1(keys[j][d]);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[j][v] = vec::fmadd(k, q[v], acc[j][v]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < JB; ++j)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) vec::store(st + j * lds + kLanes * v, acc[j][v]);
}

// The scores of `count` keys against every row: st[j][r] for j < count, r < L * vecs.
inline void scores(const float* const* keys, int64_t count, const float* qt, int64_t vecs,
                   float* st, int64_t dim) {
  const int64_t ld = kLanes * vecs;
  for (int64_t j = 0; j < count; j += kKeysPerStep) {
    vec::with_size<kKeysPerStep>(std::min<int64_t>(kKeysPerStep, count - j), [&](auto jb) {
      for (int64_t v = 0; v < vecs; v += kMaxRowVecs) {
        vec::with_size<kMaxRowVecs>(std::min<int64_t>(kMaxRowVecs, vecs - v), [&](auto nv) {
          scores_tile<decltype(jb)::value, decltype(nv)::value>(keys + j, qt + kLanes * v, ld, st + j * ld + kLanes * v, ld, dim);
        });
      }
    });
  }
}

// o[r0 + i][L w + lane] = o[..] * correction[r0 + i] + sum_j p[j][r0 + i] * vals[j][L w + lane]
// for RB rows and DV dim vectors (o rows are `ldo` apart, p rows `ldp`).
template <int RB, int DV>
inline void values_tile(const float* const* vals, int64_t count, const float* p, int64_t ldp,
                        const float* correction, float* o, int64_t ldo) {
  vfloat acc[RB][DV];
#pragma GCC unroll 8
  for (int i = 0; i < RB; ++i) {
    const vfloat c = vec::set1(correction[i]);
#pragma GCC unroll 8
    for (int w = 0; w < DV; ++w) acc[i][w] = vec::mul(vec::load(o + i * ldo + kLanes * w), c);
  }
  for (int64_t j = 0; j < count; ++j) {
    vfloat v[DV];
#pragma GCC unroll 8
    for (int w = 0; w < DV; ++w) v[w] = vec::load(vals[j] + kLanes * w);
#pragma GCC unroll 8
    for (int i = 0; i < RB; ++i) {
      const vfloat pb = vec::set1(p[j * ldp + i]);
#pragma GCC unroll 8
      for (int w = 0; w < DV; ++w) acc[i][w] = vec::fmadd(pb, v[w], acc[i][w]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < RB; ++i)
#pragma GCC unroll 8
    for (int w = 0; w < DV; ++w) vec::store(o + i * ldo + kLanes * w, acc[i][w]);
}

// o = o * correction + p^T V over `count` keys, in slices of up to kMaxDimVecs vectors of
// dims (o rows are `dim` long, a multiple of the lanes).
inline void values(const float* const* vals, int64_t count, const float* p, int64_t rows,
                   const float* correction, float* o, int64_t dim, const float** shifted) {
  const int64_t dim_vecs = dim / kLanes;
  for (int64_t w = 0; w < dim_vecs; w += kMaxDimVecs) {
    for (int64_t j = 0; j < count; ++j) shifted[j] = vals[j] + kLanes * w;
    vec::with_size<kMaxDimVecs>(std::min<int64_t>(kMaxDimVecs, dim_vecs - w), [&](auto dv) {
      for (int64_t r = 0; r < rows; r += kRowsPerStep) {
        vec::with_size<kRowsPerStep>(std::min<int64_t>(kRowsPerStep, rows - r), [&](auto rb) {
          values_tile<decltype(rb)::value, decltype(dv)::value>(shifted, count, p + r, rows, correction + r,
                              o + r * dim + kLanes * w, dim);
        });
      }
    });
  }
}

// Online softmax over one tile of scores st[j][r] (keys first..first+count, base-2 units),
// rows across lanes: st becomes the probabilities 2^(s - new max), 0 where a row may not
// see a key (position > the row's; only checked when Masked, on tiles that straddle the
// diagonal); m, l and each row's rescale factor `correction` advance.
template <bool Masked>
inline void softmax_tile(float* st, int64_t count, int64_t vecs, int64_t first,
                         const int32_t* positions, const int32_t* neg_lows, float* m, float* l,
                         float* correction, float scale) {
  const int64_t ld = kLanes * vecs;
  const vfloat sc = vec::set1(scale);
  for (int64_t v = 0; v < vecs; ++v) {
    const int32_t* pos = positions + kLanes * v;
    auto seen = [&](int64_t j) {
      if constexpr (!Masked) return vec::all_lanes();
      return vec::le(static_cast<int32_t>(first + j), pos);
    };
    // key >= lo as -key <= -lo: the one comparison vec.h has.
    auto in_window = [&](int64_t j) {
      return vec::le(static_cast<int32_t>(-(first + j)), neg_lows + kLanes * v);
    };
    const vfloat old_max = vec::load(m + kLanes * v);
    vfloat new_max = old_max;
    for (int64_t j = 0; j < count; ++j) {
      const vfloat s = vec::mul(vec::load(st + j * ld + kLanes * v), sc);
      if constexpr (Masked)  // both masks: max(new_max, s) only where both hold
        new_max = vec::mask_max(new_max, seen(j), vec::mask_max(new_max, in_window(j), s));
      else
        new_max = vec::max(new_max, s);
    }
    vfloat sum = vec::zero();
    for (int64_t j = 0; j < count; ++j) {
      float* s = st + j * ld + kLanes * v;
      vfloat e = vec::exp2_neg_ps(vec::sub(vec::mul(vec::load(s), sc), new_max));
      if constexpr (Masked) e = vec::maskz(seen(j), vec::maskz(in_window(j), e));
      vec::store(s, e);
      sum = vec::add(sum, e);
    }
    // Before the first tile m = -inf: the factor is ~0 and multiplies zeros.
    const vfloat c = vec::exp2_neg_ps(vec::sub(old_max, new_max));
    vec::store(correction + kLanes * v, c);
    vec::store(l + kLanes * v, vec::fmadd(vec::load(l + kLanes * v), c, sum));
    vec::store(m + kLanes * v, new_max);
  }
}

// One step's tensors and shapes, as the items read them (scalar_t: q's and out's dtype,
// cache_t: the cache's).
template <typename scalar_t, typename cache_t>
struct Problem {
  const scalar_t* q;
  scalar_t* out;
  const cache_t* k_base;  // cache[0]: [kv_heads, num_slots, dim]
  const cache_t* v_base;  // cache[1]
  const int32_t *tables, *starts, *qlens, *clens;
  int64_t q_stride, o_stride, num_slots, max_blocks, group, dim, block_size;
  float scale2;  // the softmax scale times log2(e): scores in base-2 units
  int64_t window;  // > 0: keys > position - window only
  const int32_t* key_ends;  // per flat token, the end of the keys it sees; null: causal
};

struct Item {
  int64_t seq, kv_head, first_query, num_queries, work;
};

// Per-thread buffers, reused across items.
struct Scratch {
  vec::LineVector<float> st, o;  // the AMX path's tile operands: on cache lines
  std::vector<float> qt, m, l, correction, ktile, vtile;
  std::vector<int32_t> positions, neg_lows;
  std::vector<const float*> keys, vals, shifted;
  std::vector<uint32_t> qp, pp, vp;  // bfloat16 pairs (the dot-product path)
  std::vector<const uint16_t*> key_bits, val_bits;
  std::vector<uint16_t> zero_row;
  vec::LineVector<uint16_t> pb, qa;  // the AMX path's P [rows][keys], query rows [rows][dim]
};

// The keys one item's rows see, [lo, hi] per row (w.positions = hi, w.neg_lows = -lo;
// padding rows copy the last row), and their extremes over the rows.
struct Bounds {
  int64_t min_hi, max_hi, min_lo, max_lo;
};

template <typename scalar_t, typename cache_t>
Bounds row_bounds(const Problem<scalar_t, cache_t>& pb, const Item& item, int64_t rows,
                  int64_t rows_used, Scratch& w) {
  const int64_t query_len = pb.qlens[item.seq], ctx = pb.clens[item.seq];
  const int64_t first_token = pb.starts[item.seq] + item.first_query;
  // Query token i sits at position ctx - query_len + first_query + i and sees keys <= it.
  const int64_t first_pos = ctx - query_len + item.first_query;
  Bounds b{ctx, 0, ctx, 0};
  w.positions.resize(rows);
  w.neg_lows.resize(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = std::min(r, rows_used - 1) / pb.group;
    const int64_t pos = first_pos + i;
    const int64_t hi = pb.key_ends ? pb.key_ends[first_token + i] - 1 : pos;
    const int64_t lo = pb.window > 0 ? std::max<int64_t>(0, pos - pb.window + 1) : 0;
    w.positions[r] = static_cast<int32_t>(hi);
    w.neg_lows[r] = static_cast<int32_t>(-lo);
    b.min_hi = std::min(b.min_hi, hi), b.max_hi = std::max(b.max_hi, hi);
    b.min_lo = std::min(b.min_lo, lo), b.max_lo = std::max(b.max_lo, lo);
  }
  return b;
}

template <typename scalar_t, typename cache_t>
inline int64_t slot_of(const Problem<scalar_t, cache_t>& pb, const int32_t* table, int64_t p) {
  return static_cast<int64_t>(table[p / pb.block_size]) * pb.block_size + p % pb.block_size;
}

// out[token][head] = o[r] / l[r] for the item's rows (o rows `width` long).
template <typename scalar_t, typename cache_t>
void write_rows(const Problem<scalar_t, cache_t>& pb, const Item& item, int64_t rows_used,
                int64_t width, const Scratch& w) {
  const int64_t first_token = pb.starts[item.seq] + item.first_query;
  for (int64_t r = 0; r < rows_used; ++r) {
    const int64_t i = r / pb.group, head = item.kv_head * pb.group + r % pb.group;
    scalar_t* dst = pb.out + (first_token + i) * pb.o_stride + head * pb.dim;
    const float inv = 1.f / w.l[r];
    for (int64_t d = 0; d < pb.dim; ++d)
      dst[d] = static_cast<scalar_t>(w.o[r * width + d] * inv);
  }
}

// The online softmax over one tile of scores (masked only where the tile needs it), the
// scores multiplied by `scale` as they are read (1: st holds them scaled).
inline void softmax_step(Scratch& w, const Bounds& b, int64_t first, int64_t count,
                         int64_t vecs, float scale = 1.f) {
  // The tile reaches past some row's last key or starts before some row's window.
  if (first + count - 1 > b.min_hi || first < b.max_lo)
    softmax_tile<true>(w.st.data(), count, vecs, first, w.positions.data(), w.neg_lows.data(),
                       w.m.data(), w.l.data(), w.correction.data(), scale);
  else
    softmax_tile<false>(w.st.data(), count, vecs, first, w.positions.data(), w.neg_lows.data(),
                        w.m.data(), w.l.data(), w.correction.data(), scale);
}

// Rows r of one item: query token i = r / group, head kv_head * group + r % group. A float32
// cache with head dims a multiple of the lanes is read in place; other cache dtypes and head
// dims are copied (as float32) tile by tile into float buffers padded to the vector width.
template <typename scalar_t, typename cache_t>
void attend_item(const Problem<scalar_t, cache_t>& pb, const Item& item, Scratch& w) {
  constexpr bool kInPlace = std::is_same_v<cache_t, float>;
  const int64_t dim = pb.dim, group = pb.group;
  const bool in_place = kInPlace && dim % kLanes == 0;
  const int64_t width = (dim + kLanes - 1) / kLanes * kLanes;  // o's row length
  const int64_t rows_used = item.num_queries * group;
  const int64_t vecs = (rows_used + kLanes - 1) / kLanes, rows = kLanes * vecs;
  w.qt.assign(dim * rows, 0.f);
  w.o.assign(rows * width, 0.f);
  w.st.resize(kTileKeys * rows);
  w.m.assign(rows, kNegInf);
  w.l.assign(rows, 0.f);
  w.correction.resize(rows);
  const Bounds b = row_bounds(pb, item, rows, rows_used, w);
  const int64_t first_token = pb.starts[item.seq] + item.first_query;
  for (int64_t r = 0; r < rows_used; ++r) {
    const int64_t head = item.kv_head * group + r % group;
    const scalar_t* src = pb.q + (first_token + r / group) * pb.q_stride + head * dim;
    for (int64_t d = 0; d < dim; ++d) w.qt[d * rows + r] = static_cast<float>(src[d]) * pb.scale2;
  }
  const cache_t* k_head = pb.k_base + item.kv_head * pb.num_slots * dim;
  const cache_t* v_head = pb.v_base + item.kv_head * pb.num_slots * dim;
  const int32_t* table = pb.tables + item.seq * pb.max_blocks;
  w.keys.resize(kTileKeys);
  w.vals.resize(kTileKeys);
  w.shifted.resize(kTileKeys);
  if (!in_place) {
    w.ktile.assign(kTileKeys * width, 0.f);
    w.vtile.assign(kTileKeys * width, 0.f);
  }
  for (int64_t first = b.min_lo; first <= b.max_hi; first += kTileKeys) {
    const int64_t count = std::min(kTileKeys, b.max_hi + 1 - first);
    for (int64_t j = 0; j < count; ++j) {
      const int64_t slot = slot_of(pb, table, first + j);
      const cache_t* kr = k_head + slot * dim;
      const cache_t* vr = v_head + slot * dim;
      if constexpr (kInPlace) {
        if (in_place) {
          w.keys[j] = kr;
          w.vals[j] = vr;
          continue;
        }
      }
      float* kt = w.ktile.data() + j * width;
      float* vt = w.vtile.data() + j * width;
      vlmserve_paged::to_float(kr, kt, dim);
      vlmserve_paged::to_float(vr, vt, dim);
      w.keys[j] = kt;
      w.vals[j] = vt;
    }
    scores(w.keys.data(), count, w.qt.data(), vecs, w.st.data(), dim);
    softmax_step(w, b, first, count, vecs);
    values(w.vals.data(), count, w.st.data(), rows, w.correction.data(), w.o.data(), width,
           w.shifted.data());
  }
  write_rows(pb, item, rows_used, width, w);
}

#if VLMSERVE_BF16_DOT
namespace bf = vlmserve_bf16;

// scores_tile with bfloat16 pairs: qp[e][r] holds row r's head dims 2e and 2e + 1, a key's
// pair is broadcast straight from the cache row; the scores are scaled as they are stored.
template <int JB, int NV>
inline void scores_tile_dot(const uint16_t* const* keys, const uint32_t* qp, int64_t ldq,
                            float* st, int64_t lds, int64_t pairs, vfloat scale) {
  vfloat acc[JB][NV];
#pragma GCC unroll 8
  for (int j = 0; j < JB; ++j)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[j][v] = vec::zero();
  for (int64_t e = 0; e < pairs; ++e) {
    bf::vpair q[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) q[v] = bf::load(qp + e * ldq + kLanes * v);
#pragma GCC unroll 8
    for (int j = 0; j < JB; ++j) {
      const bf::vpair k = bf::broadcast(keys[j] + 2 * e);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[j][v] = bf::dot(acc[j][v], k, q[v]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < JB; ++j)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) vec::store(st + j * lds + kLanes * v, vec::mul(acc[j][v], scale));
}

inline void scores_dot(const uint16_t* const* keys, int64_t count, const uint32_t* qp,
                       int64_t vecs, float* st, int64_t pairs, float scale) {
  const int64_t ld = kLanes * vecs;
  const vfloat sc = vec::set1(scale);
  for (int64_t j = 0; j < count; j += kKeysPerStep) {
    vec::with_size<kKeysPerStep>(std::min<int64_t>(kKeysPerStep, count - j), [&](auto jb) {
      for (int64_t v = 0; v < vecs; v += kMaxRowVecs) {
        vec::with_size<kMaxRowVecs>(std::min<int64_t>(kMaxRowVecs, vecs - v), [&](auto nv) {
          scores_tile_dot<decltype(jb)::value, decltype(nv)::value>(
              keys + j, qp + kLanes * v, ld, st + j * ld + kLanes * v, ld, pairs, sc);
        });
      }
    });
  }
}

// values_tile with bfloat16 pairs of consecutive keys: pp[k][r] the probabilities of keys
// 2k and 2k + 1 for row r, vp[k][d] their values at dim d.
template <int RB, int DV>
inline void values_tile_dot(const uint32_t* vp, int64_t ldv, int64_t npairs, const uint32_t* pp,
                            int64_t ldp, const float* correction, float* o, int64_t ldo) {
  vfloat acc[RB][DV];
#pragma GCC unroll 8
  for (int i = 0; i < RB; ++i) {
    const vfloat c = vec::set1(correction[i]);
#pragma GCC unroll 8
    for (int w = 0; w < DV; ++w) acc[i][w] = vec::mul(vec::load(o + i * ldo + kLanes * w), c);
  }
  for (int64_t k = 0; k < npairs; ++k) {
    bf::vpair v[DV];
#pragma GCC unroll 8
    for (int w = 0; w < DV; ++w) v[w] = bf::load(vp + k * ldv + kLanes * w);
#pragma GCC unroll 8
    for (int i = 0; i < RB; ++i) {
      const bf::vpair p = bf::set1(pp[k * ldp + i]);
#pragma GCC unroll 8
      for (int w = 0; w < DV; ++w) acc[i][w] = bf::dot(acc[i][w], p, v[w]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < RB; ++i)
#pragma GCC unroll 8
    for (int w = 0; w < DV; ++w) vec::store(o + i * ldo + kLanes * w, acc[i][w]);
}

inline void values_dot(const uint32_t* vp, int64_t npairs, const uint32_t* pp, int64_t rows,
                       const float* correction, float* o, int64_t dim) {
  const int64_t dim_vecs = dim / kLanes;
  for (int64_t w = 0; w < dim_vecs; w += kMaxDimVecs) {
    vec::with_size<kMaxDimVecs>(std::min<int64_t>(kMaxDimVecs, dim_vecs - w), [&](auto dv) {
      for (int64_t r = 0; r < rows; r += kRowsPerStep) {
        vec::with_size<kRowsPerStep>(std::min<int64_t>(kRowsPerStep, rows - r), [&](auto rb) {
          values_tile_dot<decltype(rb)::value, decltype(dv)::value>(
              vp + kLanes * w, dim, npairs, pp + r, rows, correction + r, o + r * dim + kLanes * w,
              dim);
        });
      }
    });
  }
}

// w.qp[e][r] = row r's head dims 2e and 2e + 1 as a bfloat16 pair (rows `rows` wide, the
// padding rows zero).
void pack_query_pairs(const Problem<at::BFloat16, at::BFloat16>& pb, const Item& item,
                      int64_t rows, int64_t rows_used, Scratch& w) {
  const int64_t dim = pb.dim, group = pb.group, pairs = dim / 2;
  const int64_t first_token = pb.starts[item.seq] + item.first_query;
  w.qp.assign(pairs * rows, 0u);
  for (int64_t r = 0; r < rows_used; ++r) {
    const int64_t head = item.kv_head * group + r % group;
    const auto* src = reinterpret_cast<const uint16_t*>(pb.q + (first_token + r / group) *
                                                                   pb.q_stride + head * dim);
    for (int64_t e = 0; e < pairs; ++e)
      w.qp[e * rows + r] = src[2 * e] | static_cast<uint32_t>(src[2 * e + 1]) << 16;
  }
}

// attend_item for a bfloat16 q and cache with an even head dim, on AVX-512 BF16 dot
// products (o and the value pairs padded to the vector width with zeros): the scores from bfloat16 q and k (exact products, float32 sums), the
// softmax in float32 as above, and the probabilities rounded to bfloat16 for P V (as
// FlashAttention does in bfloat16), float32 accumulation throughout.
void attend_item_dot(const Problem<at::BFloat16, at::BFloat16>& pb, const Item& item,
                     Scratch& w) {
  const int64_t dim = pb.dim, group = pb.group, pairs = dim / 2;
  const int64_t width = (dim + kLanes - 1) / kLanes * kLanes;  // o's and vp's row length
  const int64_t rows_used = item.num_queries * group;
  const int64_t vecs = (rows_used + kLanes - 1) / kLanes, rows = kLanes * vecs;
  w.o.assign(rows * width, 0.f);
  w.st.resize(kTileKeys * rows);
  w.pp.resize(kTileKeys / 2 * rows);
  w.vp.resize(kTileKeys / 2 * width);
  w.m.assign(rows, kNegInf);
  w.l.assign(rows, 0.f);
  w.correction.resize(rows);
  w.zero_row.assign(dim, 0);
  w.key_bits.resize(kTileKeys);
  w.val_bits.resize(kTileKeys);
  const Bounds b = row_bounds(pb, item, rows, rows_used, w);
  pack_query_pairs(pb, item, rows, rows_used, w);
  const auto* k_head = reinterpret_cast<const uint16_t*>(pb.k_base) + item.kv_head * pb.num_slots * dim;
  const auto* v_head = reinterpret_cast<const uint16_t*>(pb.v_base) + item.kv_head * pb.num_slots * dim;
  const int32_t* table = pb.tables + item.seq * pb.max_blocks;
  for (int64_t first = b.min_lo; first <= b.max_hi; first += kTileKeys) {
    const int64_t count = std::min(kTileKeys, b.max_hi + 1 - first);
    for (int64_t j = 0; j < count; ++j) {
      const int64_t slot = slot_of(pb, table, first + j);
      w.key_bits[j] = k_head + slot * dim;
      w.val_bits[j] = v_head + slot * dim;
    }
    scores_dot(w.key_bits.data(), count, w.qp.data(), vecs, w.st.data(), pairs, pb.scale2);
    softmax_step(w, b, first, count, vecs);
    // P and V in pairs of consecutive keys, a zero key after an odd count.
    const int64_t npairs = (count + 1) / 2;
    for (int64_t k = 0; k < npairs; ++k) {
      const bool both = 2 * k + 1 < count;
      const float* p0 = w.st.data() + 2 * k * rows;
      for (int64_t v = 0; v < vecs; ++v) {
        const vfloat second = both ? vec::load(p0 + rows + kLanes * v) : vec::zero();
        bf::store(w.pp.data() + k * rows + kLanes * v,
                  bf::round_interleave(vec::load(p0 + kLanes * v), second));
      }
      const uint16_t* v0 = w.val_bits[2 * k];
      const uint16_t* v1 = both ? w.val_bits[2 * k + 1] : w.zero_row.data();
      for (int64_t d = 0; d < width; d += kLanes)
        bf::store(w.vp.data() + k * width + d, bf::interleave(v0 + d, v1 + d, dim - d));
    }
    values_dot(w.vp.data(), npairs, w.pp.data(), rows, w.correction.data(), w.o.data(), width);
  }
  write_rows(pb, item, rows_used, width, w);
}

#if VLMSERVE_AMX
// The AMX path (Intel's tile matrix units, `amx_bf16`): both products of attend_item_dot
// on 16 x 16 float32 tiles, TDPBF16PS taking 16 x 32 bfloat16 A tiles and B tiles of
// bfloat16 pairs. The scores come out row-major (S = Q K^T: A the query rows as they lie,
// B the keys packed as pairs of head dims, `pack_operands`), so the online softmax runs
// along each row and writes P in bfloat16 straight as the A operand of O += P V (B the
// value pairs). An item's rows go through each step of keys 32 at a time: their scores,
// softmax and P V while the step's K and V tiles stay in cache.
// Tiles (amx.h's layout): C 0-3, A 4-5, B 6-7.
namespace amx {
using vlmserve_amx::configure;
using vlmserve_amx::enabled;
using vlmserve_amx::exp2_coarse;
using vlmserve_amx::transpose16;

// st[16 u + r][16 t + n] = query row (16 u + r) . key (16 t + n) for NR row tiles of qa
// (rows `dim` bfloat16 apart) and NK key tiles of kp (per key tile, dim / 32 blocks of
// 1 KB: [pair of dims][key] as bfloat16 pairs); st rows `lds` floats apart.
template <int NR, int NK>
inline void scores(const uint16_t* qa, int64_t dim, const uint32_t* kp, float* st, int64_t lds) {
  const int64_t steps = dim / 32;
  _tile_zero(0);
  if constexpr (NR > 1) _tile_zero(1);
  if constexpr (NK > 1) _tile_zero(2);
  if constexpr (NK > 1 && NR > 1) _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, qa + 32 * s, dim * 2);
    if constexpr (NR > 1) _tile_loadd(5, qa + 16 * dim + 32 * s, dim * 2);
    _tile_loadd(6, kp + 256 * s, 64);
    if constexpr (NK > 1) _tile_loadd(7, kp + 256 * (steps + s), 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NR > 1) _tile_dpbf16ps(1, 5, 6);
    if constexpr (NK > 1) _tile_dpbf16ps(2, 4, 7);
    if constexpr (NK > 1 && NR > 1) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, st, lds * 4);
  if constexpr (NR > 1) _tile_stored(1, st + 16 * lds, lds * 4);
  if constexpr (NK > 1) _tile_stored(2, st + 16, lds * 4);
  if constexpr (NK > 1 && NR > 1) _tile_stored(3, st + 16 * lds + 16, lds * 4);
}

// o[16 u + r][16 v + d] += sum_j p[16 u + r][j] v[j][16 v + d] over `steps` x 32 keys, for
// NR row tiles of p (ldp bfloat16 a row) and ND dim tiles of vp (ldv pairs a row).
template <int NR, int ND>
inline void values(const uint16_t* p, int64_t ldp, const uint32_t* vp, int64_t ldv,
                   int64_t steps, float* o, int64_t ldo) {
  _tile_loadd(0, o, ldo * 4);
  if constexpr (ND > 1) _tile_loadd(1, o + 16, ldo * 4);
  if constexpr (NR > 1) _tile_loadd(2, o + 16 * ldo, ldo * 4);
  if constexpr (NR > 1 && ND > 1) _tile_loadd(3, o + 16 * ldo + 16, ldo * 4);
  for (int64_t k = 0; k < steps; ++k) {
    _tile_loadd(4, p + 32 * k, ldp * 2);
    if constexpr (NR > 1) _tile_loadd(5, p + 16 * ldp + 32 * k, ldp * 2);
    _tile_loadd(6, vp + 16 * k * ldv, ldv * 4);
    if constexpr (ND > 1) _tile_loadd(7, vp + 16 * k * ldv + 16, ldv * 4);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (ND > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (NR > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (NR > 1 && ND > 1) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, o, ldo * 4);
  if constexpr (ND > 1) _tile_stored(1, o + 16, ldo * 4);
  if constexpr (NR > 1) _tile_stored(2, o + 16 * ldo, ldo * 4);
  if constexpr (NR > 1 && ND > 1) _tile_stored(3, o + 16 * ldo + 16, ldo * 4);
}

// Lanes j of the 16 keys from `at` with a <= at + j < b.
inline __mmask16 key_mask(int64_t a, int64_t b, int64_t at) {
  const int64_t lo = std::clamp<int64_t>(a - at, 0, 16), hi = std::clamp<int64_t>(b - at, 0, 16);
  return static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1));
}

// Lane r = the maximum (Max) or the sum of v[r]'s lanes.
template <bool Max>
inline __m512 reduce16(__m512 v[16]) {
  transpose16(v);
  for (int n = 8; n > 0; n /= 2)
    for (int i = 0; i < n; ++i) v[i] = Max ? _mm512_max_ps(v[i], v[i + n]) : _mm512_add_ps(v[i], v[i + n]);
  return v[0];
}

// The online softmax of 16 rows over a step's scores (row r's at st + r * lds, base-2
// units once times `scale`), keys [a[r], b[r]) of row r visible: row r of p (ldp apart)
// = 2^(scale s - its new max) in bfloat16 for 32 * steps keys (zero where not visible),
// and the rows' m, l and o (dim floats a row) advanced. A row with no visible key (a >= b)
// keeps m, l and o and gets a zero row of P.
inline void softmax_rows(const float* st, int64_t lds, const int64_t* a, const int64_t* b,
                         int64_t steps, float scale, float* m, float* l, uint16_t* p,
                         int64_t ldp, float* o, int64_t dim) {
  __m512 acc[16];
  for (int r = 0; r < 16; ++r) {
    const float* s = st + r * lds;
    __m512 m0 = _mm512_set1_ps(kNegInf), m1 = m0;
    int64_t j = a[r] / 16 * 16;
    for (; j + 32 <= b[r]; j += 32) {
      m0 = _mm512_mask_max_ps(m0, key_mask(a[r], b[r], j), m0, _mm512_loadu_ps(s + j));
      m1 = _mm512_max_ps(m1, _mm512_loadu_ps(s + j + 16));
    }
    for (; j < b[r]; j += 16)
      m1 = _mm512_mask_max_ps(m1, key_mask(a[r], b[r], j), m1, _mm512_loadu_ps(s + j));
    acc[r] = _mm512_max_ps(m0, m1);
  }
  const __m512 old_max = _mm512_loadu_ps(m);
  const __m512 new_max = _mm512_max_ps(old_max, _mm512_mul_ps(reduce16<true>(acc), _mm512_set1_ps(scale)));
  alignas(64) float nm[16];
  _mm512_store_ps(nm, new_max);
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < 16; ++r) {
    const float* s = st + r * lds;
    uint16_t* pr = p + r * ldp;
    auto store = [&](int64_t j, __m512 e) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), (__m256i)_mm512_cvtneps_pbh(e));
    };
    const int64_t lo = a[r] < b[r] ? a[r] / 16 * 16 : 0, hi = a[r] < b[r] ? (b[r] + 15) / 16 * 16 : 0;
    const __m512 mr = _mm512_set1_ps(nm[r]);
    __m512 s0 = _mm512_setzero_ps(), s1 = s0;
    for (int64_t j = 0; j < lo; j += 16) store(j, _mm512_setzero_ps());
    for (int64_t j = lo; j < hi; j += 16) {
      __m512 e = exp2_coarse(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), sc, mr));
      if (j < a[r] || j + 16 > b[r]) e = _mm512_maskz_mov_ps(key_mask(a[r], b[r], j), e);
      if (j & 16) s1 = _mm512_add_ps(s1, e);
      else s0 = _mm512_add_ps(s0, e);
      store(j, e);
    }
    for (int64_t j = hi; j < 32 * steps; j += 16) store(j, _mm512_setzero_ps());
    acc[r] = _mm512_add_ps(s0, s1);
  }
  // Before a row's first visible key m = -inf: its factor is 0 and multiplies zeros; a row
  // without a visible key has new max = old max (or both -inf: factor 0, l and o zeros).
  const __m512 c = vec::exp2_neg_ps(_mm512_sub_ps(old_max, new_max));
  _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), c, reduce16<false>(acc)));
  _mm512_storeu_ps(m, new_max);
  alignas(64) float cs[16];
  _mm512_store_ps(cs, c);
  for (int r = 0; r < 16; ++r) {
    if (cs[r] == 1.f) continue;
    const __m512 cv = _mm512_set1_ps(cs[r]);
    float* orow = o + r * dim;
    for (int64_t d = 0; d < dim; d += 16) _mm512_storeu_ps(orow + d, _mm512_mul_ps(_mm512_loadu_ps(orow + d), cv));
  }
}

}  // namespace amx

// Every sequence's keys and values for one KV head, packed once a call as the AMX operands
// and read by all of the sequence's items, from its first visible key rounded down to 32
// (`base`) to a multiple of 32 keys past its last (zeros outside the keys its rows may see:
// their blocks may be freed):
// - keys: per tile of 16 keys, per 32 head dims, a 1 KB block [pair of dims][key];
// - values: pairs of consecutive keys, [k][d] keys base + 2k and base + 2k + 1 at dim d.
// Both point into buffers the calling thread keeps for its next call (one per layer and
// step: every element is written, so they are neither allocated nor cleared again).
struct Packed {
  const uint32_t *keys, *values;
  std::vector<int64_t> offset, base;  // per (seq, kv head): where its operands start; per seq
};

// The first key any row of the sequence may see (its first query's window start).
template <typename scalar_t, typename cache_t>
int64_t first_key(const Problem<scalar_t, cache_t>& pb, int64_t seq) {
  const int64_t first_pos = pb.clens[seq] - pb.qlens[seq];
  return pb.window > 0 ? std::max<int64_t>(0, first_pos - pb.window + 1) : 0;
}

Packed pack_operands(const Problem<at::BFloat16, at::BFloat16>& pb, int64_t num_seqs,
                     int64_t kv_heads) {
  Packed packed;
  const int64_t dim = pb.dim;
  int64_t total = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    packed.base.push_back(first_key(pb, s) / 32 * 32);
    const int64_t keys = (pb.clens[s] - packed.base[s] + 31) / 32 * 32;
    for (int64_t h = 0; h < kv_heads; ++h) packed.offset.push_back(total), total += keys / 2 * dim;
  }
  static thread_local vec::LineVector<uint32_t> key_buffer, value_buffer;
  for (auto* buffer : {&key_buffer, &value_buffer})
    if (static_cast<int64_t>(buffer->size()) < total) buffer->resize(total);
  // The calling thread's buffers, taken here: the loop's threads have buffers of their own.
  uint32_t *keys = key_buffer.data(), *values = value_buffer.data();
  packed.keys = keys;
  packed.values = values;
  const auto* k_base = reinterpret_cast<const uint16_t*>(pb.k_base);
  const auto* v_base = reinterpret_cast<const uint16_t*>(pb.v_base);
  const std::vector<uint16_t> zero(dim, 0);
  const int64_t tasks = num_seqs * kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t n = 0; n < tasks; ++n) {
    const int64_t s = n / kv_heads, h = n % kv_heads, base = packed.base[s], ctx = pb.clens[s];
    const int64_t lo = first_key(pb, s);
    const int32_t* table = pb.tables + s * pb.max_blocks;
    auto row = [&](const uint16_t* head, int64_t j) {
      return j >= lo && j < ctx ? head + slot_of(pb, table, j) * dim : zero.data();
    };
    const uint16_t* k_head = k_base + h * pb.num_slots * dim;
    const uint16_t* v_head = v_base + h * pb.num_slots * dim;
    uint32_t* kp = keys + packed.offset[n];
    uint32_t* vp = values + packed.offset[n];
    const int64_t tiles = (ctx - base + 31) / 32 * 2;
    for (int64_t t = 0; t < tiles; ++t) {
      const uint16_t* rows[16];
      for (int j = 0; j < 16; ++j) rows[j] = row(k_head, base + 16 * t + j);
      for (int64_t d = 0; d < dim; d += 32) {
        __m512 r[16];
        for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_ps(rows[j] + d);
        amx::transpose16(r);
        for (int e = 0; e < 16; ++e) _mm512_storeu_ps(kp + 16 * e, r[e]);
        kp += 256;
      }
    }
    for (int64_t k = 0; k < tiles * 8; ++k) {
      const uint16_t* v0 = row(v_head, base + 2 * k);
      const uint16_t* v1 = row(v_head, base + 2 * k + 1);
      for (int64_t d = 0; d < dim; d += kLanes)
        bf::store(vp + k * dim + d, bf::interleave(v0 + d, v1 + d));
    }
  }
  return packed;
}

// attend_item_dot on AMX tiles (bfloat16 q and cache, head dim a multiple of 32): the same
// arithmetic (bfloat16 products, float32 sums, P rounded to bfloat16) and online softmax,
// P's exponentials from exp2_coarse.
void attend_item_amx(const Problem<at::BFloat16, at::BFloat16>& pb, const Item& item,
                     const Packed& packed, int64_t kv_heads, Scratch& w) {
  const int64_t dim = pb.dim, group = pb.group;
  const int64_t rows_used = item.num_queries * group;
  const int64_t rows = (rows_used + 15) / 16 * 16;
  w.o.assign(rows * dim, 0.f);
  w.st.resize(32 * kAmxLds);
  w.pb.resize(32 * kAmxKeys);
  w.m.assign(rows, kNegInf);
  w.l.assign(rows, 0.f);
  const Bounds b = row_bounds(pb, item, rows, rows_used, w);
  // The query rows as they lie (bfloat16 [rows][dim], padding rows zero).
  w.qa.assign(rows * dim, 0);
  const int64_t first_token = pb.starts[item.seq] + item.first_query;
  for (int64_t r = 0; r < rows_used; ++r) {
    const int64_t head = item.kv_head * group + r % group;
    std::memcpy(w.qa.data() + r * dim, pb.q + (first_token + r / group) * pb.q_stride + head * dim,
                2 * dim);
  }
  const int64_t base = packed.base[item.seq];
  const int64_t at = packed.offset[item.seq * kv_heads + item.kv_head];
  const uint32_t* kpairs = packed.keys + at;
  const uint32_t* vpairs = packed.values + at;
  amx::configure();
  for (int64_t first = std::max(base, b.min_lo / 32 * 32); first <= b.max_hi; first += kAmxKeys) {
    const int64_t count = std::min(kAmxKeys, b.max_hi + 1 - first);
    const uint32_t* kp = kpairs + (first - base) * dim / 2;
    const uint32_t* vp = vpairs + (first - base) / 2 * dim;
    for (int64_t u = 0; u < rows; u += 32) {
      const int64_t slab = std::min<int64_t>(32, rows - u);
      // Row r sees this step's keys [a[r], e[r]); the slab's rows [a_min, seen).
      int64_t a[32], e[32], seen = 0, a_min = count;
      for (int64_t r = 0; r < slab; ++r) {
        a[r] = std::max<int64_t>(0, -w.neg_lows[u + r] - first);
        e[r] = std::min<int64_t>(count, w.positions[u + r] + 1 - first);
        seen = std::max(seen, e[r]), a_min = std::min(a_min, a[r]);
      }
      if (a_min >= seen) continue;
      const int64_t key_tiles = (seen + 15) / 16, steps = (seen + 31) / 32;
      const uint16_t* qa = w.qa.data() + u * dim;
      for (int64_t t = 0; t < key_tiles; t += 2) {
        const uint32_t* k = kp + t * 8 * dim;
        float* st = w.st.data() + 16 * t;
        const bool two_keys = t + 1 < key_tiles;
        if (slab > 16 && two_keys) amx::scores<2, 2>(qa, dim, k, st, kAmxLds);
        else if (slab > 16) amx::scores<2, 1>(qa, dim, k, st, kAmxLds);
        else if (two_keys) amx::scores<1, 2>(qa, dim, k, st, kAmxLds);
        else amx::scores<1, 1>(qa, dim, k, st, kAmxLds);
      }
      for (int64_t g = 0; g < slab; g += 16) {
        amx::softmax_rows(w.st.data() + g * kAmxLds, kAmxLds, a + g, e + g, steps, pb.scale2,
                          w.m.data() + u + g, w.l.data() + u + g, w.pb.data() + g * kAmxKeys,
                          kAmxKeys, w.o.data() + (u + g) * dim, dim);
      }
      for (int64_t d = 0; d < dim; d += 32) {
        float* o = w.o.data() + u * dim + d;
        if (slab > 16) amx::values<2, 2>(w.pb.data(), kAmxKeys, vp + d, dim, steps, o, dim);
        else amx::values<1, 2>(w.pb.data(), kAmxKeys, vp + d, dim, steps, o, dim);
      }
    }
  }
  _tile_release();
  write_rows(pb, item, rows_used, dim, w);
}
#endif
#endif

// One item, on the bfloat16 dot products where they apply.
template <typename scalar_t, typename cache_t>
void attend_one(const Problem<scalar_t, cache_t>& pb, const Item& item, Scratch& w) {
#if VLMSERVE_BF16_DOT
  if constexpr (std::is_same_v<scalar_t, at::BFloat16> && std::is_same_v<cache_t, at::BFloat16>) {
    if (pb.dim % 2 == 0) return attend_item_dot(pb, item, w);
  }
#endif
  attend_item(pb, item, w);
}

// Whether the step runs on AMX tiles: bfloat16 q and cache, head dims a multiple of 32.
template <typename scalar_t, typename cache_t>
bool use_amx(const Problem<scalar_t, cache_t>& pb) {
#if VLMSERVE_AMX
  if constexpr (std::is_same_v<scalar_t, at::BFloat16> && std::is_same_v<cache_t, at::BFloat16>)
    return pb.dim % 32 == 0 && amx::enabled();
#endif
  return false;
}

template <typename scalar_t, typename cache_t>
void attend(const at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
            const at::Tensor& block_tables, const at::Tensor& query_starts,
            const at::Tensor& query_lens, const at::Tensor& context_lens, int64_t block_size,
            double scale, int64_t window, const at::Tensor& key_ends) {
  const int64_t kv_heads = kv_cache.size(1), num_slots = kv_cache.size(2), dim = q.size(2);
  const cache_t* k_base = kv_cache.data_ptr<cache_t>();
  const Problem<scalar_t, cache_t> pb{
      q.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), k_base,
      k_base + kv_heads * num_slots * dim, block_tables.data_ptr<int32_t>(),
      query_starts.data_ptr<int32_t>(), query_lens.data_ptr<int32_t>(),
      context_lens.data_ptr<int32_t>(), q.stride(0), out.stride(0), num_slots,
      block_tables.size(1), q.size(1) / kv_heads, dim, block_size,
      static_cast<float>(scale * 1.4426950408889634), window,
      key_ends.numel() ? key_ends.data_ptr<int32_t>() : nullptr};
  const int64_t target_rows = use_amx(pb) ? kAmxRows : kTargetRows;
  const int64_t queries_per_item = std::max<int64_t>(1, target_rows / pb.group);
  std::vector<Item> items;
  for (int64_t s = 0; s < query_starts.size(0); ++s) {
    const int64_t q_len = pb.qlens[s], ctx = pb.clens[s];
    for (int64_t first = 0; first < q_len; first += queries_per_item) {
      const int64_t n = std::min(queries_per_item, q_len - first);
      const int64_t work = (ctx - q_len + first + n) * n;  // keys visited x queries
      for (int64_t h = 0; h < kv_heads; ++h) items.push_back({s, h, first, n, work});
    }
  }
  // Most work first, so the dynamic schedule ends balanced.
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.work > b.work; });
  const int64_t num_items = static_cast<int64_t>(items.size());
#if VLMSERVE_AMX
  if constexpr (std::is_same_v<scalar_t, at::BFloat16> && std::is_same_v<cache_t, at::BFloat16>) {
    if (use_amx(pb)) {
      const Packed packed = pack_operands(pb, query_starts.size(0), kv_heads);
#pragma omp parallel num_threads(at::get_num_threads())
      {
        Scratch scratch;
#pragma omp for schedule(dynamic, 1)
        for (int64_t n = 0; n < num_items; ++n)
          attend_item_amx(pb, items[n], packed, kv_heads, scratch);
      }
      return;
    }
  }
#endif
#pragma omp parallel num_threads(at::get_num_threads())
  {
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t n = 0; n < num_items; ++n) attend_one(pb, items[n], scratch);
  }
}
#endif

void prefill_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                       const at::Tensor& block_tables, const at::Tensor& query_starts,
                       const at::Tensor& query_lens, const at::Tensor& context_lens,
                       int64_t block_size, double scale, int64_t window,
                       const std::optional<at::Tensor>& maybe_key_ends) {
  const at::Tensor key_ends = maybe_key_ends.value_or(at::empty({0}, q.options().dtype(at::kInt)));
  vlmserve_paged::check_inputs(out, q, kv_cache, block_tables, query_starts, query_lens,
                               context_lens);
  TORCH_CHECK(key_ends.numel() == 0 || (key_ends.scalar_type() == at::kInt &&
                                        key_ends.is_contiguous() && key_ends.numel() == q.size(0)),
              "key_ends: empty or int32 [num_tokens]");
#if VLMSERVE_VEC_LANES
  vlmserve_paged::dispatch_dtypes(q, kv_cache, [&](auto q_t, auto cache_t) {
    attend<decltype(q_t), decltype(cache_t)>(out, q, kv_cache, block_tables, query_starts,
                                             query_lens, context_lens, block_size, scale, window,
                                             key_ends);
  });
#else
  TORCH_CHECK(false, "prefill_attention needs AVX2 + FMA or AVX-512");
#endif
}

}  // namespace

// The float lanes the kernel was built for; 0: it cannot run on this CPU.
int64_t vector_lanes() { return vlmserve_vec::kLanes; }
// Whether bfloat16 q and cache run on AVX-512 BF16 dot products (even head dims), not
// widened to float32.
bool bf16_dot() { return vlmserve_bf16::kBf16Dot; }
// Whether bfloat16 q and cache with head dims a multiple of 32 run on AMX tiles here (built
// for a CPU with amx_bf16, and Linux granted the tile state).
bool amx_tiles() {
#if VLMSERVE_VEC_LANES && VLMSERVE_BF16_DOT && VLMSERVE_AMX
  return amx::enabled();
#else
  return false;
#endif
}

TORCH_LIBRARY(vlmserve_prefill, m) {
  m.def("vector_lanes() -> int", &vector_lanes);
  m.def("bf16_dot() -> bool", &bf16_dot);
  m.def("amx() -> bool", &amx_tiles);
  m.def(
      "prefill_attention(Tensor(a!) out, Tensor q, Tensor kv_cache, Tensor block_tables, "
      "Tensor query_starts, Tensor query_lens, Tensor context_lens, int block_size, "
      "float scale, int window=0, Tensor? key_ends=None) -> ()");
}

TORCH_LIBRARY_IMPL(vlmserve_prefill, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
