// Paged attention on the CPU, reading K/V straight from the block table (no gather).
//
// Registered as torch.ops.vlmserve.paged_attention; kernels/cpu_attention.py builds this
// file with torch.utils.cpp_extension on first use.
//
// Layout (kernels/attention.py): a layer's cache is [2 (k, v), num_kv_heads, num_slots,
// head_dim] with slot = block * block_size + offset, so one block of one head is
// block_size * head_dim contiguous elements.
//
// One work item is (sequence, kv head): its query_len * group query rows (group = query
// heads per kv head) walk the sequence's blocks once with an online softmax, so each K/V
// block is read once for all the rows that share it. Query row i of a sequence sits at
// position context_len - query_len + i and sees positions <= it; with a sliding window w
// (> 0) only those > it - w, and blocks wholly before the first row's window are skipped
// (a hybrid KV pool may have reused them). With fewer items than threads (a decode of one
// sequence with one KV head: Gemma 3 270M's batch 1) each item's blocks are split into
// shares, each with its own running max and sum, merged at the end (flash-decoding).
// In bfloat16 on a CPU with AMX an item of at most 16 rows may run on tiles instead
// (paged_amx.h; `amx`, as calibrated in kernels/cpu_attention.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <immintrin.h>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "paged_amx.h"
#include "paged_inputs.h"
#include "vec.h"

namespace {

namespace vec = vlmserve_vec;
using vec::kLanes;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// The fewest blocks a share of a split context gets (attend: fewer items than threads).
constexpr int64_t kMinShareBlocks = 4;

inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

#if VLMSERVE_VEC_LANES
// Register tiles (AVX2: 16 vector registers, AVX-512: 32): R rows x J keys of partial dot
// products in score_tile, R rows x D dim vectors of accumulators in value_tile. Enough
// independent FMA chains to keep both FMA ports busy: with one chain a dot product (or a
// value row) waits out every FMA's latency, far below the memory bandwidth.
constexpr int kTileRows = 4;
constexpr int kTileKeys = kLanes == 16 ? 4 : 3;  // AVX-512: a 16-token block in 4 tiles
constexpr int kTileDims = kLanes == 16 ? 4 : 2;

// A vector of K/V values, float32 or bfloat16 in the cache (widened in registers).
inline vec::vfloat load_kv(const float* p) { return vec::load(p); }
inline vec::vfloat load_kv(const at::BFloat16* p) {
  return vec::load_bf16(reinterpret_cast<const uint16_t*>(p));
}

// p[r * block_size + j] = dot(qs[r], kb[j]) for r < R, j < J (dim a multiple of kLanes).
template <int R, int J, typename kv_t>
inline void score_tile(const float* qs, const kv_t* kb, float* p, int64_t dim,
                       int64_t block_size, const kv_t* ahead) {
  vec::vfloat acc[R][J];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) acc[r][j] = vec::zero();
  for (int64_t d = 0; d < dim; d += kLanes) {
    if (ahead != nullptr && (d * sizeof(kv_t)) % 64 == 0)
#pragma GCC unroll 8
      for (int j = 0; j < J; ++j) prefetch(ahead + j * dim + d);
    vec::vfloat kv[J];
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) kv[j] = load_kv(kb + j * dim + d);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const vec::vfloat qv = vec::load(qs + r * dim + d);
#pragma GCC unroll 8
      for (int j = 0; j < J; ++j) acc[r][j] = vec::fmadd(qv, kv[j], acc[r][j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) p[r * block_size + j] = vec::reduce_add(acc[r][j]);
}

template <int R, typename kv_t>
inline void score_rows(const float* qs, const kv_t* kb, float* p, int64_t dim, int64_t count,
                       int64_t block_size, const kv_t* ahead) {
  auto at = [&](int64_t j) { return ahead == nullptr ? nullptr : ahead + j * dim; };
  int64_t j = 0;
  for (; j + kTileKeys <= count; j += kTileKeys)
    score_tile<R, kTileKeys>(qs, kb + j * dim, p + j, dim, block_size, at(j));
  for (; j < count; ++j) score_tile<R, 1>(qs, kb + j * dim, p + j, dim, block_size, at(j));
}

// acc[r, d0 + i] = acc[r, d0 + i] * correction[r] + sum_j p[r, j] v[j, d0 + i] for r < R
// and the D vectors from d0.
template <int R, int D, typename kv_t>
inline void value_tile(const float* p, const kv_t* vb, const float* correction, float* acc,
                       int64_t dim, int64_t count, int64_t block_size, const kv_t* ahead) {
  vec::vfloat a[R][D];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int i = 0; i < D; ++i)
      a[r][i] = vec::mul(vec::load(acc + r * dim + i * kLanes), vec::set1(correction[r]));
  for (int64_t j = 0; j < count; ++j) {
    if (ahead != nullptr)
      for (int64_t b = 0; b < int64_t(D * kLanes * sizeof(kv_t)); b += 64)
        prefetch(reinterpret_cast<const char*>(ahead + j * dim) + b);
    vec::vfloat vv[D];
#pragma GCC unroll 8
    for (int i = 0; i < D; ++i) vv[i] = load_kv(vb + j * dim + i * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const vec::vfloat pj = vec::set1(p[r * block_size + j]);
#pragma GCC unroll 8
      for (int i = 0; i < D; ++i) a[r][i] = vec::fmadd(pj, vv[i], a[r][i]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int i = 0; i < D; ++i) vec::store(acc + r * dim + i * kLanes, a[r][i]);
}

template <int R, typename kv_t>
inline void value_rows(const float* p, const kv_t* vb, const float* correction, float* acc,
                       int64_t dim, int64_t count, int64_t block_size, const kv_t* ahead) {
  auto at = [&](int64_t d) { return ahead == nullptr ? nullptr : ahead + d; };
  int64_t d = 0;
  for (; d + kTileDims * kLanes <= dim; d += kTileDims * kLanes)
    value_tile<R, kTileDims>(p, vb + d, correction, acc + d, dim, count, block_size, at(d));
  for (; d < dim; d += kLanes)
    value_tile<R, 1>(p, vb + d, correction, acc + d, dim, count, block_size, at(d));
}

// f.template operator()<R>(r) over `rows` in tiles of kTileRows rows and the remainder.
template <typename F>
inline void for_row_tiles(int64_t rows, F&& f) {
  int64_t r = 0;
  for (; r + kTileRows <= rows; r += kTileRows) f.template operator()<kTileRows>(r);
  switch (rows - r) {
    case 3: f.template operator()<3>(r); break;
    case 2: f.template operator()<2>(r); break;
    case 1: f.template operator()<1>(r); break;
    default: break;
  }
}
#endif

// Scores of `rows` query rows against one block's keys: p[r * block_size + j] for the first
// `count` keys (p is [rows, block_size]; callers mask positions past `last`).
template <typename kv_t>
inline void block_scores(const float* qs, const kv_t* kb, float* p, int64_t rows, int64_t dim,
                         int64_t count, int64_t block_size, const kv_t* ahead) {
#if VLMSERVE_VEC_LANES
  if (dim % kLanes == 0) {
    for_row_tiles(rows, [&]<int R>(int64_t r) {
      score_rows<R>(qs + r * dim, kb, p + r * block_size, dim, count, block_size,
                    r == 0 ? ahead : nullptr);
    });
    return;
  }
#endif
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < count; ++j) {
      float sum = 0.f;
      for (int64_t d = 0; d < dim; ++d) sum += qs[r * dim + d] * static_cast<float>(kb[j * dim + d]);
      p[r * block_size + j] = sum;
    }
}

// One query row's scores over a block, p[0, count), of which the first `visible` may be
// seen: p becomes exp(p - new max) (0 past `visible`), and the row's running max `m`, sum
// `l` and the factor its accumulator must be rescaled by (`correction`) advance.
inline void softmax_block_row(float* p, int64_t count, int64_t visible, float& m, float& l,
                              float& correction) {
#if VLMSERVE_VEC_LANES
  vec::vfloat vmax = vec::set1(kNegInf);
  for (int64_t j = 0; j < visible; j += kLanes) {
    const vec::vmask in = vec::first_lanes(visible - j);
    vmax = vec::mask_max(vmax, in, vec::maskz_load(in, p + j));
  }
  const float new_max = std::max(m, vec::reduce_max(vmax));
  const vec::vfloat shift = vec::set1(new_max);
  vec::vfloat sum = vec::zero();
  for (int64_t j = 0; j < count; j += kLanes) {
    const vec::vmask seen = vec::first_lanes(visible - j);
    const vec::vfloat e =
        vec::maskz(seen, vec::exp_ps(vec::sub(vec::maskz_load(seen, p + j), shift)));
    vec::mask_store(p + j, vec::first_lanes(count - j), e);
    sum = vec::add(sum, e);
  }
  const float total = vec::reduce_add(sum);
#else
  float block_max = kNegInf;
  for (int64_t j = 0; j < visible; ++j) block_max = std::max(block_max, p[j]);
  const float new_max = std::max(m, block_max);
  float total = 0.f;
  for (int64_t j = 0; j < count; ++j) {
    p[j] = j < visible ? std::exp(p[j] - new_max) : 0.f;
    total += p[j];
  }
#endif
  correction = std::exp(m - new_max);  // m = -inf before the first block: 0
  m = new_max;
  l = l * correction + total;
}

// acc[r] = acc[r] * correction[r] + sum_j p[r, j] v[j] over the block's first `count` rows.
template <typename kv_t>
inline void block_values(const float* p, const kv_t* vb, const float* correction, float* acc,
                         int64_t rows, int64_t dim, int64_t count, int64_t block_size,
                         const kv_t* ahead) {
#if VLMSERVE_VEC_LANES
  if (dim % kLanes == 0) {
    for_row_tiles(rows, [&]<int R>(int64_t r) {
      value_rows<R>(p + r * block_size, vb, correction + r, acc + r * dim, dim, count,
                    block_size, r == 0 ? ahead : nullptr);
    });
    return;
  }
#endif
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < dim; ++d) {
      float a = acc[r * dim + d] * correction[r];
      for (int64_t j = 0; j < count; ++j)
        a += p[r * block_size + j] * static_cast<float>(vb[j * dim + d]);
      acc[r * dim + d] = a;
    }
}

// One (sequence, kv head): `rows` query rows (scaled, float) over `ctx` positions, with an
// online softmax across blocks. K/V blocks are read in place, a float32 or bfloat16 cache
// widened in registers (float16 is converted into `kbuf`/`vbuf` first, a block at a time).
// Only the blocks [block_begin, block_end) (a share of the context: see attend's split).
template <typename cache_t>
void attend_one(const float* qs, float* acc, const int64_t* last, const int64_t* lo,
                int64_t rows, int64_t dim,
                int64_t ctx, int64_t block_size, const int32_t* table, const cache_t* k_head,
                const cache_t* v_head, float* kbuf, float* vbuf, float* p, float* m, float* l,
                float* correction, int64_t block_begin, int64_t block_end, bool spread) {
  const int64_t stop = std::min(ctx, block_end * block_size);
  for (int64_t first = block_begin * block_size; first < stop; first += block_size) {
    const int64_t count = std::min(block_size, ctx - first);
    const int64_t slot = static_cast<int64_t>(table[first / block_size]) * block_size;
    constexpr bool in_place = std::is_same_v<cache_t, float> || std::is_same_v<cache_t, at::BFloat16>;
    using kv_t = std::conditional_t<in_place, cache_t, float>;
    const kv_t* kb;
    const kv_t* vb;
    if constexpr (in_place) {
      kb = k_head + slot * dim;
      vb = v_head + slot * dim;
    } else {
      vlmserve_paged::to_float(k_head + slot * dim, kbuf, count * dim);
      vlmserve_paged::to_float(v_head + slot * dim, vbuf, count * dim);
      kb = kbuf;
      vb = vbuf;
    }
    // Blocks sit at random pages, where the hardware prefetcher stops: the next block is
    // fetched (into L2) while this one is computed. `spread`: a line at a time, as the
    // loops pass the same line of this block (on a Zen 4 a burst of a block's 256 lines
    // at once stalls the loads of the block in hand: 1.6x slower from memory); else the
    // whole block at once (a float16 cache always: it is converted a block at a time).
    // Which is faster is calibrated per CPU (kernels/cpu_attention.py).
    const int64_t here = first / block_size;
    const int64_t num_blocks = std::min(block_end, (ctx + block_size - 1) / block_size);
    const kv_t* k_ahead = nullptr;
    const kv_t* v_ahead = nullptr;
    if (here + 1 < num_blocks) {
      const int64_t next = static_cast<int64_t>(table[here + 1]) * block_size * dim;
      if constexpr (in_place) {
        if (spread) {
          k_ahead = k_head + next;
          v_ahead = v_head + next;
        }
      }
      if (k_ahead == nullptr) {
        for (int64_t off = 0; off < block_size * dim; off += 64 / sizeof(cache_t)) {
          prefetch(k_head + next + off);
          prefetch(v_head + next + off);
        }
      }
    }
    block_scores(qs, kb, p, rows, dim, count, block_size, k_ahead);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t visible = std::max<int64_t>(0, std::min(count, last[r] - first + 1));
      const int64_t skip = std::clamp<int64_t>(lo[r] - first, 0, count);  // before the window
      if (visible <= skip) {  // all of this block lies past the row's position or window
        correction[r] = 1.f;
        std::fill(p + r * block_size, p + r * block_size + count, 0.f);
        continue;
      }
      float* pr = p + r * block_size;
      softmax_block_row(pr + skip, count - skip, visible - skip, m[r], l[r], correction[r]);
      std::fill(pr, pr + skip, 0.f);
    }
    block_values(p, vb, correction, acc, rows, dim, count, block_size, v_ahead);
  }
}

#if VLMSERVE_PAGED_AMX
using AmxScratch = vlmserve_paged_amx::Scratch;
inline bool amx_enabled() { return vlmserve_amx::enabled(); }
#else
struct AmxScratch {};
inline bool amx_enabled() { return false; }
#endif

// A thread's buffers for its items.
struct ThreadScratch {
  std::vector<float> qs, p, correction, kbuf, vbuf;  // the vector path's
  std::vector<int64_t> q_at, last, lo;
  AmxScratch amx;
  explicit ThreadScratch(int64_t block_elems) : kbuf(block_elems), vbuf(block_elems) {}
};

// scalar_t: q's and out's dtype; cache_t: the cache's.
template <typename scalar_t, typename cache_t>
void attend(const at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
            const at::Tensor& block_tables, const at::Tensor& query_starts,
            const at::Tensor& query_lens, const at::Tensor& context_lens, int64_t block_size,
            double scale, int64_t window, bool amx, bool spread) {
  const int64_t num_seqs = query_starts.size(0);
  const int64_t num_heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = kv_cache.size(1), num_slots = kv_cache.size(2);
  const int64_t group = num_heads / kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const cache_t* k_base = kv_cache.data_ptr<cache_t>();
  const cache_t* v_base = k_base + kv_heads * num_slots * dim;
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* starts = query_starts.data_ptr<int32_t>();
  const int32_t* qlens = query_lens.data_ptr<int32_t>();
  const int32_t* clens = context_lens.data_ptr<int32_t>();
  const int64_t q_stride = q.stride(0), o_stride = out.stride(0);
  const int64_t num_items = num_seqs * kv_heads;

  // Most work first, so the dynamic schedule ends balanced.
  std::vector<int64_t> order(num_items);
  for (int64_t i = 0; i < num_items; ++i) order[i] = i;
  auto work = [&](int64_t item) {
    const int64_t s = item / kv_heads;
    return static_cast<int64_t>(clens[s]) * qlens[s];
  };
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return work(a) > work(b); });
  const float fscale = static_cast<float>(scale);

  // Where each query row of an item sits in q, its last visible position and the first
  // inside its window.
  auto bounds_of = [&](int64_t item, std::vector<int64_t>& q_at, std::vector<int64_t>& last,
                       std::vector<int64_t>& lo) {
    const int64_t seq = item / kv_heads, h = item % kv_heads;
    const int64_t q_len = qlens[seq], ctx = clens[seq], start = starts[seq];
    const int64_t rows = q_len * group;
    q_at.resize(rows);
    last.resize(rows);
    lo.resize(rows);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = r / group, head = h * group + r % group;
      q_at[r] = (start + i) * q_stride + head * dim;
      last[r] = ctx - q_len + i;
      lo[r] = window > 0 ? std::max<int64_t>(0, last[r] - window + 1) : 0;
    }
    return rows;
  };
  // The same, and the query rows scaled in float32 (the vector path's).
  auto rows_of = [&](int64_t item, std::vector<float>& qs, std::vector<int64_t>& q_at,
                     std::vector<int64_t>& last, std::vector<int64_t>& lo) {
    const int64_t rows = bounds_of(item, q_at, last, lo);
    qs.resize(rows * dim);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t d = 0; d < dim; ++d)
        qs[r * dim + d] = static_cast<float>(q_ptr[q_at[r] + d]) * fscale;
    return rows;
  };
  // An item runs on AMX tiles where asked (calibrated: kernels/cpu_attention.py) and it
  // can: bfloat16 q and cache, head dims a multiple of 32, blocks of 16k tokens, <= 16 rows.
  constexpr bool kBf16 =
      std::is_same_v<scalar_t, at::BFloat16> && std::is_same_v<cache_t, at::BFloat16>;
  const bool amx_shape =
      kBf16 && amx && dim % 32 == 0 && block_size % 16 == 0 && amx_enabled();
  // One item's share [begin, end) of blocks: acc (zeros), m (-inf) and l (0) advanced.
  auto run_item = [&](int64_t item, float* acc, float* m, float* l, int64_t begin, int64_t end,
                      ThreadScratch& w) {
    const int64_t seq = item / kv_heads, h = item % kv_heads;
#if VLMSERVE_PAGED_AMX
    if constexpr (kBf16) {
      if (amx_shape && qlens[seq] * group <= 16) {
        const int64_t rows = bounds_of(item, w.q_at, w.last, w.lo);
        const auto* k_head = reinterpret_cast<const uint16_t*>(k_base + h * num_slots * dim);
        const auto* v_head = reinterpret_cast<const uint16_t*>(v_base + h * num_slots * dim);
        vlmserve_paged_amx::attend(reinterpret_cast<const uint16_t*>(q_ptr), w.q_at.data(),
                                   rows, dim, w.last.data(), w.lo.data(), clens[seq],
                                   block_size, tables + seq * max_blocks, k_head, v_head,
                                   fscale, begin, end, acc, m, l, w.amx);
        return;
      }
    }
#endif
    const int64_t rows = rows_of(item, w.qs, w.q_at, w.last, w.lo);
    w.p.resize(rows * block_size);
    w.correction.resize(rows);
    attend_one<cache_t>(w.qs.data(), acc, w.last.data(), w.lo.data(), rows, dim, clens[seq],
                        block_size, tables + seq * max_blocks, k_base + h * num_slots * dim,
                        v_base + h * num_slots * dim, w.kbuf.data(), w.vbuf.data(), w.p.data(),
                        m, l, w.correction.data(), begin, end, spread);
  };
  auto write_rows = [&](int64_t item, int64_t rows, const float* acc, const float* l) {
    const int64_t seq = item / kv_heads, h = item % kv_heads, start = starts[seq];
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = r / group, head = h * group + r % group;
      scalar_t* dst = o_ptr + (start + i) * o_stride + head * dim;
      const float inv = 1.f / l[r];
      for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<scalar_t>(acc[r * dim + d] * inv);
    }
  };
  // Each item's blocks: from the one holding its first row's window start to the end.
  auto block_range = [&](int64_t item) {
    const int64_t seq = item / kv_heads, ctx = clens[seq];
    const int64_t first_last = ctx - qlens[seq];
    const int64_t lo0 = window > 0 ? std::max<int64_t>(0, first_last - window + 1) : 0;
    return std::pair<int64_t, int64_t>{lo0 / block_size, (ctx + block_size - 1) / block_size};
  };

  // Fewer items than threads (a decode of one or two sequences with few KV heads): split
  // each item's blocks into shares, one task each, with their own running max and sum,
  // then merge the shares (flash-decoding): otherwise all but one thread would wait.
  const int64_t threads = at::get_num_threads();
  int64_t shares = 1;
  if (num_items < threads) {
    shares = (threads + num_items - 1) / num_items;
    for (int64_t item = 0; item < num_items; ++item) {
      const auto [b0, b1] = block_range(item);
      shares = std::min(shares, (b1 - b0) / kMinShareBlocks);
    }
  }
  if (shares > 1) {
    std::vector<int64_t> offset(num_items + 1, 0);  // each item's rows in the scratch
    for (int64_t item = 0; item < num_items; ++item)
      offset[item + 1] = offset[item] + qlens[item / kv_heads] * group;
    const int64_t total_rows = offset[num_items];
    std::vector<float> accs(shares * total_rows * dim, 0.f), ms(shares * total_rows, kNegInf),
        ls(shares * total_rows, 0.f);
#pragma omp parallel num_threads(threads)
    {
      ThreadScratch w(block_size * dim);
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < num_items * shares; ++task) {
        const int64_t item = task / shares, share = task % shares;
        const auto [b0, b1] = block_range(item);
        const int64_t begin = b0 + (b1 - b0) * share / shares;
        const int64_t end = b0 + (b1 - b0) * (share + 1) / shares;
        const int64_t row0 = share * total_rows + offset[item];
        run_item(item, accs.data() + row0 * dim, ms.data() + row0, ls.data() + row0, begin, end,
                 w);
      }
    }
    // Merge: each share's sum and accumulator rescaled to the rows' overall max.
    for (int64_t item = 0; item < num_items; ++item) {
      const int64_t rows = offset[item + 1] - offset[item];
      std::vector<float> acc(rows * dim, 0.f), l(rows, 0.f);
      for (int64_t r = 0; r < rows; ++r) {
        float m = kNegInf;
        for (int64_t sh = 0; sh < shares; ++sh)
          m = std::max(m, ms[sh * total_rows + offset[item] + r]);
        for (int64_t sh = 0; sh < shares; ++sh) {
          const int64_t row = sh * total_rows + offset[item] + r;
          if (ms[row] == kNegInf) continue;  // this share saw nothing of the row
          const float f = std::exp(ms[row] - m);
          l[r] += ls[row] * f;
          for (int64_t d = 0; d < dim; ++d) acc[r * dim + d] += accs[row * dim + d] * f;
        }
      }
      write_rows(item, rows, acc.data(), l.data());
    }
    return;
  }

#pragma omp parallel num_threads(threads)
  {
    ThreadScratch w(block_size * dim);
    std::vector<float> acc, m, l;
#pragma omp for schedule(dynamic, 1)
    for (int64_t n = 0; n < num_items; ++n) {
      const int64_t item = order[n];
      const int64_t rows = qlens[item / kv_heads] * group;
      acc.assign(rows * dim, 0.f);
      m.assign(rows, kNegInf);
      l.assign(rows, 0.f);
      const auto [b0, b1] = block_range(item);
      run_item(item, acc.data(), m.data(), l.data(), b0, b1, w);
      write_rows(item, rows, acc.data(), l.data());
    }
  }
}

void paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                     const at::Tensor& block_tables, const at::Tensor& query_starts,
                     const at::Tensor& query_lens, const at::Tensor& context_lens,
                     int64_t block_size, double scale, int64_t window, bool amx,
                     bool spread) {
  vlmserve_paged::check_inputs(out, q, kv_cache, block_tables, query_starts, query_lens,
                               context_lens);
  vlmserve_paged::dispatch_dtypes(q, kv_cache, [&](auto q_t, auto cache_t) {
    attend<decltype(q_t), decltype(cache_t)>(out, q, kv_cache, block_tables, query_starts,
                                             query_lens, context_lens, block_size, scale, window, amx,
                                             spread);
  });
}

}  // namespace

TORCH_LIBRARY(vlmserve, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor q, Tensor kv_cache, Tensor block_tables, "
      "Tensor query_starts, Tensor query_lens, Tensor context_lens, int block_size, "
      "float scale, int window=0, bool amx=False, bool spread=True) -> ()");
}

TORCH_LIBRARY_IMPL(vlmserve, CPU, m) { m.impl("paged_attention", &paged_attention); }
