// The sampler's CPU kernels, float32 logits [rows, vocab] with dense rows.
//
// - apply_token_bitmask (structured outputs): set to -inf, in place, the logits of the
//   tokens a row's grammar refuses, on the listed rows only, in one pass over each row. The
//   bitmask is xgrammar's: int32 words, bit t % 32 of word t / 32 set when token t is
//   allowed. xgrammar's own CPU kernel walks the refused tokens one bit scan at a time
//   (about as many steps as the vocabulary where a JSON key allows a handful); here a word
//   of 32 tokens is two masked 16-lane stores (AVX-512), and an all-allowed word costs
//   nothing. The same pass says whether a row allows any token at all.
// - shift_scale / zero_neg_inf_ (temperature weights, vlmserve/sample/ops.py): torch's exp
//   leaves its vector path for a whole vector when one lane is out of range, and -inf
//   (a masked token) is: a masked row's exp costs 3-4x a plain one. shift_scale writes
//   (logits - top) / T with 0 where the logit is -inf (the same two IEEE operations torch
//   does, so every other lane is bitwise torch's), torch's exp runs on that, and
//   zero_neg_inf_ sets the -inf lanes' weights to exp(-inf) = 0.
// - argmax (greedy): torch.argmax over the listed rows (the first maximum; a NaN counts as
//   the largest, so the first NaN), without gathering them first. torch's argmax carries
//   an index through a scalar-ish reduction (3x its amax over [64, 262144]); here each
//   chunk of a row takes two vector passes while it sits in the L2 cache: its maximum (and
//   whether it holds a NaN), then the first lane equal to it (or the first NaN). Rows and
//   chunks of rows are the parallel units, so a few rows still use every core.
// - nucleus_sizes (top-p, vlmserve/sample/ops.py): per row a number of candidates that
//   surely holds its top-p nucleus, from one pass: the weights' count and mass per bin of
//   their leading 12 bits (sign, exponent, 3 mantissa bits: 4,096 bins, in L1), walked
//   down from the top until the mass reaches top_p. A row whose nucleus outgrows the first
//   guess of candidates then takes one topk of that many, not a guess widened 8x at a
//   time, each a topk over the whole vocabulary (FlashInfer's sampler also works on a
//   candidate set, without sorting the vocabulary).
//
// Registered as torch.ops.vlmserve_sampling.*; kernels/sampling_cpu.py builds this file on
// first use (kernels/cpu_build.py, -ffp-contract=off) and holds the plain-torch references.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <limits>
#include <algorithm>
#include <cstring>
#include <tuple>
#include <vector>

#include "vec.h"

namespace {

// The listed rows' refused tokens -> -inf. logits: [num_rows, vocab] float32, dense rows;
// bitmask: [>= max(rows) + 1, >= ceil(vocab / 32)] int32, dense rows; rows: [n] int64.
// Returns [n] bool: whether the row allows any token below vocab.
at::Tensor apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask,
                               const at::Tensor& rows) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                  logits.dim() == 2 && logits.stride(1) == 1,
              "logits: a CPU float32 [rows, vocab] tensor with dense rows");
  TORCH_CHECK(bitmask.device().is_cpu() && bitmask.scalar_type() == at::kInt &&
                  bitmask.dim() == 2 && bitmask.stride(1) == 1,
              "bitmask: a CPU int32 [rows, words] tensor with dense rows");
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kLong && rows.dim() == 1,
              "rows: a CPU int64 vector");
  const int64_t vocab = logits.size(1);
  TORCH_CHECK(bitmask.size(1) * 32 >= vocab, "bitmask: ", bitmask.size(1),
              " words cover fewer than the ", vocab, " tokens of the logits");
  const int64_t n = rows.size(0);
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < logits.size(0) && row_ids[i] < bitmask.size(0),
                "row ", row_ids[i], " is outside the logits or the bitmask");
  }
  at::Tensor allowed_any = at::empty({n}, at::kBool);
  bool* any_out = allowed_any.data_ptr<bool>();
  float* logits_data = logits.data_ptr<float>();
  const auto* mask_data = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const int64_t logits_stride = logits.stride(0), mask_stride = bitmask.stride(0);
  const int64_t num_words = (vocab + 31) / 32;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = logits_data + row_ids[i] * logits_stride;
      const uint32_t* words = mask_data + row_ids[i] * mask_stride;
      uint32_t any = 0;
      for (int64_t w = 0; w < num_words; ++w) {
        const int64_t base = w * 32;
        const int64_t width = vocab - base < 32 ? vocab - base : 32;
        // The bits of tokens below vocab; the rest of the last word is never read.
        const uint32_t valid = width == 32 ? 0xFFFFFFFFu : (1u << width) - 1u;
        const uint32_t allowed = words[w] & valid;
        any |= allowed;
        const uint32_t refused = ~allowed & valid;
        if (refused == 0) continue;
#if defined(__AVX512F__)
        const __m512 fill = _mm512_set1_ps(neg_inf);
        _mm512_mask_storeu_ps(row + base, static_cast<__mmask16>(refused & 0xFFFFu), fill);
        _mm512_mask_storeu_ps(row + base + 16, static_cast<__mmask16>(refused >> 16), fill);
#else
        for (int64_t b = 0; b < width; ++b) {
          if ((refused >> b) & 1u) row[base + b] = neg_inf;
        }
#endif
      }
      any_out[i] = any != 0;
    }
  });
  return allowed_any;
}

// `bf16`: bfloat16 allowed too (argmax_rows alone).
void check_logits(const at::Tensor& t, const char* name, bool bf16 = false) {
  const bool dtype = t.scalar_type() == at::kFloat || (bf16 && t.scalar_type() == at::kBFloat16);
  TORCH_CHECK(t.device().is_cpu() && dtype && t.dim() == 2 && t.stride(1) == 1,
              name, ": a CPU ", bf16 ? "float32 or bfloat16" : "float32",
              " [rows, vocab] tensor with dense rows");
}

// (out [rows, vocab], has_neg_inf [rows] bool): out = (logits - top) / temperature per row,
// 0 where the logit is -inf. top: [rows, 1] float32; temperature: [rows] float32.
std::tuple<at::Tensor, at::Tensor> shift_scale(const at::Tensor& logits, const at::Tensor& top,
                                               const at::Tensor& temperature) {
  check_logits(logits, "logits");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(top.scalar_type() == at::kFloat && top.numel() == rows && top.is_contiguous(),
              "top: float32, one per row");
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && temperature.numel() == rows &&
                  temperature.is_contiguous(),
              "temperature: float32, one per row");
  at::Tensor out = at::empty({rows, vocab}, logits.options());
  at::Tensor has_neg_inf = at::empty({rows}, at::kBool);
  const float* l_data = logits.data_ptr<float>();
  const float* top_data = top.data_ptr<float>();
  const float* t_data = temperature.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  bool* flags = has_neg_inf.data_ptr<bool>();
  const int64_t stride = logits.stride(0);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* l = l_data + r * stride;
      float* o = out_data + r * vocab;
      const float m = top_data[r], t = t_data[r];
      int any = 0;
#pragma omp simd reduction(| : any)
      for (int64_t j = 0; j < vocab; ++j) {
        const bool masked = l[j] == neg_inf;
        any |= masked;
        o[j] = masked ? 0.f : (l[j] - m) / t;
      }
      flags[r] = any != 0;
    }
  });
  return {out, has_neg_inf};
}

// weights = 0 where logits is -inf, on the rows flagged (shift_scale's has_neg_inf).
void zero_neg_inf_(at::Tensor& weights, const at::Tensor& logits, const at::Tensor& rows) {
  check_logits(weights, "weights");
  check_logits(logits, "logits");
  TORCH_CHECK(weights.sizes() == logits.sizes(), "weights and logits: one shape");
  TORCH_CHECK(rows.scalar_type() == at::kBool && rows.numel() == logits.size(0),
              "rows: one bool per row");
  const int64_t vocab = logits.size(1);
  const float* l_data = logits.data_ptr<float>();
  float* w_data = weights.data_ptr<float>();
  const bool* flags = rows.data_ptr<bool>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, logits.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (!flags[r]) continue;
      const float* l = l_data + r * logits.stride(0);
      float* w = w_data + r * weights.stride(0);
#pragma omp simd
      for (int64_t j = 0; j < vocab; ++j) {
        w[j] = l[j] == neg_inf ? 0.f : w[j];
      }
    }
  });
}


// One chunk's candidate for its row's argmax: the first maximum of the chunk, or its first
// NaN (nan: then it wins over any value).
struct ChunkMax {
  float value;
  int64_t index;
  bool nan;
};

// NaN tracking a vector at a time: one unordered compare covers two vectors.
#if defined(__AVX512F__)
using NanSeen = __mmask16;
inline NanSeen nan_none() { return 0; }
inline NanSeen nan_add(NanSeen seen, __m512 a, __m512 b) {
  return seen | _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q);
}
inline bool nan_any(NanSeen seen) { return seen != 0; }
// Bits of the lanes where v equals m.
inline uint32_t lanes_equal(__m512 v, __m512 m) { return _mm512_cmp_ps_mask(v, m, _CMP_EQ_OQ); }
#elif defined(__AVX2__) && defined(__FMA__)
using NanSeen = __m256;
inline NanSeen nan_none() { return _mm256_setzero_ps(); }
inline NanSeen nan_add(NanSeen seen, __m256 a, __m256 b) {
  return _mm256_or_ps(seen, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
}
inline bool nan_any(NanSeen seen) { return _mm256_movemask_ps(seen) != 0; }
inline uint32_t lanes_equal(__m256 v, __m256 m) {
  return _mm256_movemask_ps(_mm256_cmp_ps(v, m, _CMP_EQ_OQ));
}
#endif

// The first maximum of x[0, n) (or its first NaN); n >= 1.
ChunkMax chunk_argmax(const float* x, int64_t n) {
  float best = x[0];
#if VLMSERVE_VEC_LANES
  namespace vec = vlmserve_vec;
  constexpr int kL = vec::kLanes;
  if (n >= 4 * kL) {
    int64_t i = 0;
    // Pass 1: the maximum, four accumulators deep; NaNs are seen by an unordered compare
    // (max_ps keeps or drops a NaN depending on the operand order).
    vec::vfloat m0 = vec::load(x), m1 = m0, m2 = m0, m3 = m0;
    NanSeen seen = nan_none();
    for (; i + 4 * kL <= n; i += 4 * kL) {
      const vec::vfloat a = vec::load(x + i), b = vec::load(x + i + kL);
      const vec::vfloat c = vec::load(x + i + 2 * kL), d = vec::load(x + i + 3 * kL);
      seen = nan_add(nan_add(seen, a, b), c, d);
      m0 = vec::max(m0, a), m1 = vec::max(m1, b), m2 = vec::max(m2, c), m3 = vec::max(m3, d);
    }
    best = vec::reduce_max(vec::max(vec::max(m0, m1), vec::max(m2, m3)));
    bool nan = nan_any(seen);
    for (int64_t j = i; j < n; ++j) {
      nan |= std::isnan(x[j]);
      best = x[j] > best ? x[j] : best;
    }
    if (!nan) {
      // Pass 2: the first lane equal to the maximum (the chunk is still in cache).
      const vec::vfloat m = vec::set1(best);
      int64_t j = 0;
      for (; j + kL <= n; j += kL) {
        const uint32_t bits = lanes_equal(vec::load(x + j), m);
        if (bits) return {best, j + __builtin_ctz(bits), false};
      }
      for (; j < n; ++j)
        if (x[j] == best) return {best, j, false};
      // Not reached: best is one of x's values.
    }
    // A NaN: the scalar scan below finds the first.
    best = x[0];
  }
#endif
  // torch.argmax's rule, element by element: a NaN wins at once; else the first larger.
  int64_t index = 0;
  if (std::isnan(best)) return {best, 0, true};
  for (int64_t i = 1; i < n; ++i) {
    const float v = x[i];
    if (std::isnan(v)) return {v, i, true};
    if (v > best) best = v, index = i;
  }
  return {best, index, false};
}

// [n] int64: torch.argmax of each listed row of logits [num_rows, vocab] (float32, or
// bfloat16 as a GEMM writes them: each chunk widened first, exactly; dense rows). rows: [n]
// int64.
at::Tensor argmax_rows(const at::Tensor& logits, const at::Tensor& rows) {
  const bool bf16 = logits.scalar_type() == at::kBFloat16;
  check_logits(logits, "logits", bf16);
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kLong && rows.dim() == 1,
              "rows: a CPU int64 vector");
  const int64_t vocab = logits.size(1), n = rows.size(0);
  TORCH_CHECK(vocab > 0, "argmax over an empty vocabulary");
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < logits.size(0), "row ", row_ids[i],
                " is outside the logits");
  }
  // 16k floats (64 KiB) a chunk: both passes in L2, and 16 units a row at 262k.
  constexpr int64_t kChunk = 16384;
  const int64_t num_chunks = (vocab + kChunk - 1) / kChunk;
  std::vector<ChunkMax> found(n * num_chunks);
  const float* data = bf16 ? nullptr : logits.data_ptr<float>();
  const at::BFloat16* data16 = bf16 ? logits.data_ptr<at::BFloat16>() : nullptr;
  const int64_t stride = logits.stride(0);
  // At least 1M columns a thread (~0.1 ms): less is over before a thread is woken, and on
  // a busy machine waking one can cost a scheduler tick.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 20) / std::min(vocab, kChunk));
  at::parallel_for(0, n * num_chunks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> wide(bf16 ? kChunk : 0);  // a bfloat16 chunk widened (in L2)
    for (int64_t u = begin; u < end; ++u) {
      const int64_t r = u / num_chunks, start = (u % num_chunks) * kChunk;
      const int64_t len = vocab - start < kChunk ? vocab - start : kChunk;
      const float* x = data + row_ids[r] * stride + start;
      if (bf16) {
        vlmserve_vec::widen_bf16(reinterpret_cast<const uint16_t*>(data16) +
                                     row_ids[r] * stride + start, wide.data(), len);
        x = wide.data();
      }
      ChunkMax c = chunk_argmax(x, len);
      c.index += start;
      found[u] = c;
    }
  });
  at::Tensor out = at::empty({n}, at::kLong);
  int64_t* out_data = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    ChunkMax best = found[r * num_chunks];  // chunks in order: ties keep the earlier
    for (int64_t c = 1; c < num_chunks && !best.nan; ++c) {
      const ChunkMax& next = found[r * num_chunks + c];
      if (next.nan || next.value > best.value) best = next;
    }
    out_data[r] = best.index;
  }
  return out;
}


// An order-preserving key of a float: keys compare as unsigned integers in the order
// -NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN.
inline uint32_t order_key(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return (bits >> 31) ? ~bits : bits | 0x80000000u;
}
constexpr int kBinShift = 20;
constexpr int kBins = 1 << (32 - kBinShift);  // a bin: the key's leading 12 bits
inline uint32_t bin_of(float v) { return order_key(v) >> kBinShift; }

void check_weights(const at::Tensor& weights, const at::Tensor& rows) {
  check_logits(weights, "weights");
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kLong && rows.dim() == 1,
              "rows: a CPU int64 vector");
  const int64_t* ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < weights.size(0), "row ", ids[i],
                " is outside the weights");
  }
}

// [n] int64: per listed row, a number of its largest weights that holds its top-p nucleus
// with a margin: the weights of the highest bins whose mass reaches top_p of the row's
// total and 1e-5 more, then one more weight; at most vocab; 1 for a row whose total is not
// finite (a failed row). top_p: [n] float32 in (0, 1).
at::Tensor nucleus_sizes(const at::Tensor& weights, const at::Tensor& rows,
                         const at::Tensor& top_p) {
  check_weights(weights, rows);
  const int64_t vocab = weights.size(1), n = rows.size(0);
  TORCH_CHECK(top_p.scalar_type() == at::kFloat && top_p.numel() == n && top_p.is_contiguous(),
              "top_p: float32, one per row");
  at::Tensor out = at::empty({n}, at::kLong);
  const float* data = weights.data_ptr<float>();
  const int64_t* ids = rows.data_ptr<int64_t>();
  const float* p_data = top_p.data_ptr<float>();
  int64_t* out_data = out.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> counts;
    std::vector<double> mass;
    for (int64_t r = begin; r < end; ++r) {
      const float* w = data + ids[r] * weights.stride(0);
      counts.assign(kBins, 0);
      mass.assign(kBins, 0.0);
      double total = 0.0;
      for (int64_t j = 0; j < vocab; ++j) {
        const uint32_t b = bin_of(w[j]);
        ++counts[b];
        mass[b] += w[j];
        total += w[j];
      }
      if (!std::isfinite(total)) {
        out_data[r] = 1;
        continue;
      }
      const double wanted = static_cast<double>(p_data[r]) * (1.0 + 1e-5) * total;
      int64_t seen = 0;
      double reached = 0.0;
      for (int64_t b = kBins - 1; b >= 0 && !(reached >= wanted && seen > 0); --b) {
        seen += counts[b];
        reached += mass[b];
      }
      out_data[r] = std::min<int64_t>(vocab, seen + 1);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(vlmserve_sampling, m) {
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> Tensor");
  m.def("shift_scale(Tensor logits, Tensor top, Tensor temperature) -> (Tensor, Tensor)");
  m.def("zero_neg_inf_(Tensor(a!) weights, Tensor logits, Tensor rows) -> ()");
  m.def("argmax_rows(Tensor logits, Tensor rows) -> Tensor");
  m.def("nucleus_sizes(Tensor weights, Tensor rows, Tensor top_p) -> Tensor");
}

TORCH_LIBRARY_IMPL(vlmserve_sampling, CPU, m) {
  m.impl("apply_token_bitmask", &apply_token_bitmask);
  m.impl("shift_scale", &shift_scale);
  m.impl("zero_neg_inf_", &zero_neg_inf_);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("nucleus_sizes", &nucleus_sizes);
}
