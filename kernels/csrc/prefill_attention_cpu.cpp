// Prefill and extend attention on the CPU (float32, AVX-512), reading K/V straight from the
// paged cache through the block table: a fresh prompt and a chunk on a cached prefix are
// the same case (the step's own K/V are written to the cache before attention runs).
//
// Registered as torch.ops.vlmserve_prefill.prefill_attention; kernels/cpu_attention.py
// builds this file with torch.utils.cpp_extension on first use. Layout as
// paged_attention_cpu.cpp: a layer's cache is [2 (k, v), num_kv_heads, num_slots, head_dim].
//
// One work item is (sequence, kv head, block of consecutive query tokens). Its rows are
// the block's tokens times the group's query heads (GQA: every K/V row loaded serves them
// all), held transposed (qt[d][row], pre-scaled), so that the scores of a tile of keys come
// out as st[key][row] and the online softmax runs down the keys with rows across the 16
// lanes: no horizontal reductions. Two register-blocked micro-kernels do the FLOPs:
// scores (4 keys x 96 rows of accumulators, a broadcast key element times a row of qt) and
// values (6 rows x 64 dims, a broadcast probability times a row of V). Tiles past a row
// block's last position are never visited; only the tiles that straddle the diagonal are
// masked.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <immintrin.h>
#include <limits>
#include <type_traits>
#include <vector>

#include "paged_inputs.h"
#include "vec_avx512.h"

namespace {

#if defined(__AVX512F__)
using vlmserve_vec::exp_ps;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kTargetRows = 96;  // query rows per item: 6 vectors, the scores tile width
constexpr int64_t kTileKeys = 64;    // keys per tile (the score tile is kTileKeys x rows)
constexpr int kKeysPerStep = 4;      // scores micro-kernel: keys x row vectors accumulators
constexpr int kMaxRowVecs = 6;
constexpr int kRowsPerStep = 6;  // values micro-kernel: rows x dim vectors accumulators
constexpr int kMaxDimVecs = 4;

// st[j][r0 + 16v + lane] = sum_d keys[j][d] * qt[d][r0 + 16v + lane] for JB keys, NV vectors.
template <int JB, int NV>
inline void scores_tile(const float* const* keys, const float* qt, int64_t ldq, float* st,
                        int64_t lds, int64_t dim) {
  __m512 acc[JB][NV];
#pragma GCC unroll 8
  for (int j = 0; j < JB; ++j)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[j][v] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; ++d) {
    __m512 q[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) q[v] = _mm512_loadu_ps(qt + d * ldq + 16 * v);
#pragma GCC unroll 8
    for (int j = 0; j < JB; ++j) {
      const __m512 k = _mm512_set1_ps(keys[j][d]);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[j][v] = _mm512_fmadd_ps(k, q[v], acc[j][v]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < JB; ++j)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(st + j * lds + 16 * v, acc[j][v]);
}

template <int JB>
inline void scores_rows(const float* const* keys, const float* qt, int64_t ldq, float* st,
                        int64_t lds, int64_t dim, int64_t vecs) {
  for (int64_t v = 0; v < vecs; v += kMaxRowVecs) {
    const float* q = qt + 16 * v;
    float* s = st + 16 * v;
    switch (std::min<int64_t>(kMaxRowVecs, vecs - v)) {
      case 1: scores_tile<JB, 1>(keys, q, ldq, s, lds, dim); break;
      case 2: scores_tile<JB, 2>(keys, q, ldq, s, lds, dim); break;
      case 3: scores_tile<JB, 3>(keys, q, ldq, s, lds, dim); break;
      case 4: scores_tile<JB, 4>(keys, q, ldq, s, lds, dim); break;
      case 5: scores_tile<JB, 5>(keys, q, ldq, s, lds, dim); break;
      default: scores_tile<JB, 6>(keys, q, ldq, s, lds, dim); break;
    }
  }
}

// The scores of `count` keys against every row: st[j][r] for j < count, r < 16 * vecs.
inline void scores(const float* const* keys, int64_t count, const float* qt, int64_t vecs,
                   float* st, int64_t dim) {
  const int64_t ld = 16 * vecs;
  int64_t j = 0;
  for (; j + kKeysPerStep <= count; j += kKeysPerStep)
    scores_rows<kKeysPerStep>(keys + j, qt, ld, st + j * ld, ld, dim, vecs);
  switch (count - j) {
    case 1: scores_rows<1>(keys + j, qt, ld, st + j * ld, ld, dim, vecs); break;
    case 2: scores_rows<2>(keys + j, qt, ld, st + j * ld, ld, dim, vecs); break;
    case 3: scores_rows<3>(keys + j, qt, ld, st + j * ld, ld, dim, vecs); break;
    default: break;
  }
}

// o[r0 + i][16w + lane] = o[..] * correction[r0 + i] + sum_j p[j][r0 + i] * vals[j][16w + lane]
// for RB rows and DV dim vectors (o rows are `ldo` apart, p rows `ldp`).
template <int RB, int DV>
inline void values_tile(const float* const* vals, int64_t count, const float* p, int64_t ldp,
                        const float* correction, float* o, int64_t ldo) {
  __m512 acc[RB][DV];
#pragma GCC unroll 8
  for (int i = 0; i < RB; ++i) {
    const __m512 c = _mm512_set1_ps(correction[i]);
#pragma GCC unroll 8
    for (int w = 0; w < DV; ++w) acc[i][w] = _mm512_mul_ps(_mm512_loadu_ps(o + i * ldo + 16 * w), c);
  }
  for (int64_t j = 0; j < count; ++j) {
    __m512 v[DV];
#pragma GCC unroll 8
    for (int w = 0; w < DV; ++w) v[w] = _mm512_loadu_ps(vals[j] + 16 * w);
#pragma GCC unroll 8
    for (int i = 0; i < RB; ++i) {
      const __m512 pb = _mm512_set1_ps(p[j * ldp + i]);
#pragma GCC unroll 8
      for (int w = 0; w < DV; ++w) acc[i][w] = _mm512_fmadd_ps(pb, v[w], acc[i][w]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < RB; ++i)
#pragma GCC unroll 8
    for (int w = 0; w < DV; ++w) _mm512_storeu_ps(o + i * ldo + 16 * w, acc[i][w]);
}

template <int DV>
inline void values_rows(const float* const* vals, int64_t count, const float* p, int64_t rows,
                        const float* correction, float* o, int64_t ldo) {
  for (int64_t r = 0; r < rows; r += kRowsPerStep) {
    const float* pr = p + r;
    float* orow = o + r * ldo;
    const float* c = correction + r;
    switch (std::min<int64_t>(kRowsPerStep, rows - r)) {
      case 1: values_tile<1, DV>(vals, count, pr, rows, c, orow, ldo); break;
      case 2: values_tile<2, DV>(vals, count, pr, rows, c, orow, ldo); break;
      case 3: values_tile<3, DV>(vals, count, pr, rows, c, orow, ldo); break;
      case 4: values_tile<4, DV>(vals, count, pr, rows, c, orow, ldo); break;
      case 5: values_tile<5, DV>(vals, count, pr, rows, c, orow, ldo); break;
      default: values_tile<6, DV>(vals, count, pr, rows, c, orow, ldo); break;
    }
  }
}

// o = o * correction + p^T V over `count` keys, in slices of up to 64 dims (4 vectors).
inline void values(const float* const* vals, int64_t count, const float* p, int64_t rows,
                   const float* correction, float* o, int64_t dim, const float** shifted) {
  for (int64_t w = 0; w < dim / 16; w += kMaxDimVecs) {
    for (int64_t j = 0; j < count; ++j) shifted[j] = vals[j] + 16 * w;
    float* ow = o + 16 * w;
    switch (std::min<int64_t>(kMaxDimVecs, dim / 16 - w)) {
      case 1: values_rows<1>(shifted, count, p, rows, correction, ow, dim); break;
      case 2: values_rows<2>(shifted, count, p, rows, correction, ow, dim); break;
      case 3: values_rows<3>(shifted, count, p, rows, correction, ow, dim); break;
      default: values_rows<4>(shifted, count, p, rows, correction, ow, dim); break;
    }
  }
}

// 2^x for 16 lanes with x <= 0 (scores minus their running max, in base-2 units): x = n + f,
// |f| <= 1/2, 2^f by its degree-6 Taylor polynomial (relative error ~1e-7), scaled by 2^n.
// Cheaper than a natural exp: the log2(e) factor is folded into the query scale.
inline __m512 exp2_neg_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));  // e^-87: the smallest normal float
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 y = _mm512_set1_ps(1.5403530393e-4f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.3333558147e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6181291076e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5504108665e-2f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022650696e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718056e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

// Online softmax over one tile of scores st[j][r] (keys first..first+count, base-2 units),
// rows across lanes: st becomes the probabilities 2^(s - new max), 0 where a row may not
// see a key (position > the row's; only checked when Masked, on tiles that straddle the
// diagonal); m, l and each row's rescale factor `correction` advance.
template <bool Masked>
inline void softmax_tile(float* st, int64_t count, int64_t vecs, int64_t first,
                         const int32_t* positions, float* m, float* l, float* correction) {
  const int64_t ld = 16 * vecs;
  for (int64_t v = 0; v < vecs; ++v) {
    const __m512i pos = _mm512_loadu_si512(positions + 16 * v);
    auto seen = [&](int64_t j) -> __mmask16 {
      if constexpr (!Masked) return 0xFFFF;
      return _mm512_cmple_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(first + j)), pos);
    };
    const __m512 old_max = _mm512_loadu_ps(m + 16 * v);
    __m512 new_max = old_max;
    for (int64_t j = 0; j < count; ++j) {
      const __m512 s = _mm512_loadu_ps(st + j * ld + 16 * v);
      new_max = Masked ? _mm512_mask_max_ps(new_max, seen(j), new_max, s)
                       : _mm512_max_ps(new_max, s);
    }
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < count; ++j) {
      float* s = st + j * ld + 16 * v;
      __m512 e = exp2_neg_ps(_mm512_sub_ps(_mm512_loadu_ps(s), new_max));
      if constexpr (Masked) e = _mm512_maskz_mov_ps(seen(j), e);
      _mm512_storeu_ps(s, e);
      sum = _mm512_add_ps(sum, e);
    }
    // Before the first tile m = -inf: the factor is ~0 and multiplies zeros.
    const __m512 c = exp2_neg_ps(_mm512_sub_ps(old_max, new_max));
    _mm512_storeu_ps(correction + 16 * v, c);
    _mm512_storeu_ps(l + 16 * v, _mm512_fmadd_ps(_mm512_loadu_ps(l + 16 * v), c, sum));
    _mm512_storeu_ps(m + 16 * v, new_max);
  }
}

// One step's tensors and shapes, as the items read them.
template <typename scalar_t>
struct Problem {
  const scalar_t* q;
  scalar_t* out;
  const scalar_t* k_base;  // cache[0]: [kv_heads, num_slots, dim]
  const scalar_t* v_base;  // cache[1]
  const int32_t *tables, *starts, *qlens, *clens;
  int64_t q_stride, o_stride, num_slots, max_blocks, group, dim, block_size;
  float scale2;  // the softmax scale times log2(e): scores in base-2 units
};

struct Item {
  int64_t seq, kv_head, first_query, num_queries, work;
};

// Per-thread buffers, reused across items.
struct Scratch {
  std::vector<float> qt, st, o, m, l, correction, ktile, vtile;
  std::vector<int32_t> positions;
  std::vector<const float*> keys, vals, shifted;
};

// Rows r of one item: query token i = r / group, head kv_head * group + r % group. float32
// K/V with 16-aligned head dims are read in place; other dtypes and head dims are copied
// tile by tile into float buffers padded to 16 lanes.
template <typename scalar_t>
void attend_item(const Problem<scalar_t>& pb, const Item& item, Scratch& w) {
  constexpr bool kInPlace = std::is_same_v<scalar_t, float>;
  const int64_t dim = pb.dim, group = pb.group;
  const bool in_place = kInPlace && dim % 16 == 0;
  const int64_t width = (dim + 15) / 16 * 16;  // o's row length
  const int64_t rows_used = item.num_queries * group;
  const int64_t vecs = (rows_used + 15) / 16, rows = 16 * vecs;
  w.qt.assign(dim * rows, 0.f);
  w.o.assign(rows * width, 0.f);
  w.st.resize(kTileKeys * rows);
  w.m.assign(rows, kNegInf);
  w.l.assign(rows, 0.f);
  w.correction.resize(rows);
  w.positions.resize(rows);
  const int64_t query_len = pb.qlens[item.seq], ctx = pb.clens[item.seq];
  const int64_t first_token = pb.starts[item.seq] + item.first_query;
  // Query token i sits at position ctx - query_len + first_query + i and sees keys <= it.
  const int64_t first_pos = ctx - query_len + item.first_query;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = std::min(r, rows_used - 1) / group;  // padding rows copy the last one
    w.positions[r] = static_cast<int32_t>(first_pos + i);
    if (r >= rows_used) continue;
    const int64_t head = item.kv_head * group + r % group;
    const scalar_t* src = pb.q + (first_token + i) * pb.q_stride + head * dim;
    for (int64_t d = 0; d < dim; ++d) w.qt[d * rows + r] = static_cast<float>(src[d]) * pb.scale2;
  }
  const scalar_t* k_head = pb.k_base + item.kv_head * pb.num_slots * dim;
  const scalar_t* v_head = pb.v_base + item.kv_head * pb.num_slots * dim;
  const int32_t* table = pb.tables + item.seq * pb.max_blocks;
  const int64_t last_pos = first_pos + item.num_queries - 1;
  w.keys.resize(kTileKeys);
  w.vals.resize(kTileKeys);
  w.shifted.resize(kTileKeys);
  if (!in_place) {
    w.ktile.assign(kTileKeys * width, 0.f);
    w.vtile.assign(kTileKeys * width, 0.f);
  }
  for (int64_t first = 0; first <= last_pos; first += kTileKeys) {
    const int64_t count = std::min(kTileKeys, last_pos + 1 - first);
    for (int64_t j = 0; j < count; ++j) {
      const int64_t p = first + j;
      const int64_t slot = static_cast<int64_t>(table[p / pb.block_size]) * pb.block_size +
                           p % pb.block_size;
      const scalar_t* kr = k_head + slot * dim;
      const scalar_t* vr = v_head + slot * dim;
      if constexpr (kInPlace) {
        if (in_place) {
          w.keys[j] = kr;
          w.vals[j] = vr;
          continue;
        }
      }
      float* kt = w.ktile.data() + j * width;
      float* vt = w.vtile.data() + j * width;
      for (int64_t d = 0; d < dim; ++d) {
        kt[d] = static_cast<float>(kr[d]);
        vt[d] = static_cast<float>(vr[d]);
      }
      w.keys[j] = kt;
      w.vals[j] = vt;
    }
    scores(w.keys.data(), count, w.qt.data(), vecs, w.st.data(), dim);
    if (first + count - 1 > first_pos)  // the tile reaches past some row's position
      softmax_tile<true>(w.st.data(), count, vecs, first, w.positions.data(), w.m.data(),
                         w.l.data(), w.correction.data());
    else
      softmax_tile<false>(w.st.data(), count, vecs, first, w.positions.data(), w.m.data(),
                          w.l.data(), w.correction.data());
    values(w.vals.data(), count, w.st.data(), rows, w.correction.data(), w.o.data(), width,
           w.shifted.data());
  }
  for (int64_t r = 0; r < rows_used; ++r) {
    const int64_t i = r / group, head = item.kv_head * group + r % group;
    scalar_t* dst = pb.out + (first_token + i) * pb.o_stride + head * dim;
    const float inv = 1.f / w.l[r];
    for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<scalar_t>(w.o[r * width + d] * inv);
  }
}

template <typename scalar_t>
void attend(const at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
            const at::Tensor& block_tables, const at::Tensor& query_starts,
            const at::Tensor& query_lens, const at::Tensor& context_lens, int64_t block_size,
            double scale) {
  const int64_t kv_heads = kv_cache.size(1), num_slots = kv_cache.size(2), dim = q.size(2);
  const scalar_t* k_base = kv_cache.data_ptr<scalar_t>();
  const Problem<scalar_t> pb{
      q.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), k_base,
      k_base + kv_heads * num_slots * dim, block_tables.data_ptr<int32_t>(),
      query_starts.data_ptr<int32_t>(), query_lens.data_ptr<int32_t>(),
      context_lens.data_ptr<int32_t>(), q.stride(0), out.stride(0), num_slots,
      block_tables.size(1), q.size(1) / kv_heads, dim, block_size,
      static_cast<float>(scale * 1.4426950408889634)};
  const int64_t queries_per_item = std::max<int64_t>(1, kTargetRows / pb.group);
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
#pragma omp parallel num_threads(at::get_num_threads())
  {
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t n = 0; n < num_items; ++n) attend_item<scalar_t>(pb, items[n], scratch);
  }
}
#endif

void prefill_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                       const at::Tensor& block_tables, const at::Tensor& query_starts,
                       const at::Tensor& query_lens, const at::Tensor& context_lens,
                       int64_t block_size, double scale) {
  vlmserve_paged::check_inputs(out, q, kv_cache, block_tables, query_starts, query_lens,
                               context_lens);
#if defined(__AVX512F__)
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(),
                                  "prefill_attention", [&] {
                                    attend<scalar_t>(out, q, kv_cache, block_tables,
                                                     query_starts, query_lens, context_lens,
                                                     block_size, scale);
                                  });
#else
  TORCH_CHECK(false, "prefill_attention needs AVX-512");
#endif
}

}  // namespace

TORCH_LIBRARY(vlmserve_prefill, m) {
  m.def(
      "prefill_attention(Tensor(a!) out, Tensor q, Tensor kv_cache, Tensor block_tables, "
      "Tensor query_starts, Tensor query_lens, Tensor context_lens, int block_size, "
      "float scale) -> ()");
}

TORCH_LIBRARY_IMPL(vlmserve_prefill, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
