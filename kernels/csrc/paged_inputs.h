// The argument checks shared by the paged attention kernels (paged_attention_cpu.cpp,
// prefill_attention_cpu.cpp), which take the same inputs: out and q [num_tokens, heads,
// dim] with dense rows, the layer's cache [2, kv_heads, slots, dim], int32 metadata; and
// the dispatch over (q dtype, cache dtype): the cache is q's dtype, float32 or bfloat16
// (--kv-cache-dtype), read as float32.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <type_traits>

#include "vec.h"

namespace vlmserve_paged {

inline void check_inputs(const at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                         const at::Tensor& block_tables, const at::Tensor& query_starts,
                         const at::Tensor& query_lens, const at::Tensor& context_lens) {
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out: [num_tokens, heads, dim]");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q rows must be dense");
  TORCH_CHECK(out.stride(2) == 1 && out.stride(1) == out.size(2), "out rows must be dense");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache: contiguous [2, kv_heads, slots, dim]");
  TORCH_CHECK(kv_cache.size(3) == q.size(2) && q.size(1) % kv_cache.size(1) == 0,
              "head dims or head counts do not match");
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "q and out must share a dtype");
  TORCH_CHECK(kv_cache.scalar_type() == q.scalar_type() || kv_cache.scalar_type() == at::kFloat ||
                  kv_cache.scalar_type() == at::kBFloat16,
              "kv_cache: q's dtype, float32 or bfloat16");
  for (const auto* t : {&block_tables, &query_starts, &query_lens, &context_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "int32 metadata expected");
  }
  TORCH_CHECK(block_tables.size(0) == query_starts.size(0), "one block-table row per sequence");
}

// dst[i] = float(src[i]) for i < n: bfloat16 a vector at a time (vec.h's widen_bf16).
template <typename cache_t>
inline void to_float(const cache_t* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<cache_t, at::BFloat16>) {
    vlmserve_vec::widen_bf16(reinterpret_cast<const uint16_t*>(src), dst, n);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

// f(q_t{}, cache_t{}) with q_t the dtype of q (float32, bfloat16, float16) and cache_t the
// cache's (q's own, float32 or bfloat16; check_inputs has checked it is one of them).
template <typename q_t, typename F>
inline void dispatch_cache(const at::Tensor& q, const at::Tensor& kv_cache, F&& f) {
  const at::ScalarType cache = kv_cache.scalar_type();
  if (cache == q.scalar_type())
    f(q_t{}, q_t{});
  else if (cache == at::kFloat)
    f(q_t{}, float{});
  else
    f(q_t{}, at::BFloat16{});
}

template <typename F>
inline void dispatch_dtypes(const at::Tensor& q, const at::Tensor& kv_cache, F&& f) {
  switch (q.scalar_type()) {
    case at::kFloat: return dispatch_cache<float>(q, kv_cache, f);
    case at::kBFloat16: return dispatch_cache<at::BFloat16>(q, kv_cache, f);
    case at::kHalf: return dispatch_cache<at::Half>(q, kv_cache, f);
    default: TORCH_CHECK(false, "q: float32, bfloat16 or float16, not ", q.scalar_type());
  }
}

}  // namespace vlmserve_paged
