// The argument checks shared by the paged attention kernels (paged_attention_cpu.cpp,
// prefill_attention_cpu.cpp), which take the same inputs: out and q [num_tokens, heads,
// dim] with dense rows, the layer's cache [2, kv_heads, slots, dim], int32 metadata.
#pragma once

#include <ATen/ATen.h>

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
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "q, kv_cache and out must share a dtype");
  for (const auto* t : {&block_tables, &query_starts, &query_lens, &context_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "int32 metadata expected");
  }
  TORCH_CHECK(block_tables.size(0) == query_starts.size(0), "one block-table row per sequence");
}

}  // namespace vlmserve_paged
