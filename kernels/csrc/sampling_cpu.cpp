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
//
// Registered as torch.ops.vlmserve_sampling.*; kernels/sampling_cpu.py builds this file on
// first use (kernels/cpu_build.py, -ffp-contract=off) and holds the plain-torch references.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>
#include <cstdint>
#include <limits>
#include <tuple>

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

void check_logits(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 &&
                  t.stride(1) == 1,
              name, ": a CPU float32 [rows, vocab] tensor with dense rows");
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

}  // namespace

TORCH_LIBRARY(vlmserve_sampling, m) {
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> Tensor");
  m.def("shift_scale(Tensor logits, Tensor top, Tensor temperature) -> (Tensor, Tensor)");
  m.def("zero_neg_inf_(Tensor(a!) weights, Tensor logits, Tensor rows) -> ()");
}

TORCH_LIBRARY_IMPL(vlmserve_sampling, CPU, m) {
  m.impl("apply_token_bitmask", &apply_token_bitmask);
  m.impl("shift_scale", &shift_scale);
  m.impl("zero_neg_inf_", &zero_neg_inf_);
}
