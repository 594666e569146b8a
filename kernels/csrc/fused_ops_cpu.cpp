// Fused elementwise ops of the decoder layer on the CPU, float32: each reads its inputs
// once and writes its outputs once, where the eager ops they replace make 3-6 passes.
//
// Registered as torch.ops.vlmserve_fused.*; kernels/fused_ops.py builds this file on first use
// (kernels/cpu_build.py, with -ffp-contract=off) and holds the eager reference of each op.
// Rounding: rope and the residual add round exactly as the eager ops; the RMS reduction
// and exp in silu are summed / approximated in their own order (within a few ulp).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>
#include <cmath>

#include "vec.h"

namespace {

namespace vec = vlmserve_vec;

// A [rows, width] float32 CPU tensor whose rows are dense (any row stride).
void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, ": CPU float32");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": [rows, width] with dense rows");
}

// out = weight * (x * rsqrt(mean(x^2) + eps)), row by row (transformers' LlamaRMSNorm in
// float32: the product by the inverse rms is rounded before the weight multiplies it).
inline void rms_row(float* out, const float* x, const float* w, int64_t n, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(out.sizes() == x.sizes() && weight.is_contiguous() &&
                  weight.numel() == x.size(1) && weight.scalar_type() == at::kFloat,
              "rms_norm: out like x, weight [width] float32");
  const int64_t n = x.size(1), xs = x.stride(0), os = out.stride(0);
  const float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_row(op + r * os, xp + r * xs, w, n, eps);
  });
}

// residual += x; x = rms_norm(residual): the layer's skip connection and the next norm in
// one pass (vLLM's fused_add_rms_norm).
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && weight.is_contiguous() &&
                  weight.numel() == x.size(1) && weight.scalar_type() == at::kFloat,
              "fused_add_rms_norm: residual like x, weight [width] float32");
  const int64_t n = x.size(1), xs = x.stride(0), rs = residual.stride(0);
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = xp + r * xs;
      float* rr = rp + r * rs;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) rr[i] = xr[i] + rr[i];
      rms_row(xr, rr, w, n, eps);
    }
  });
}

// In place on q [tokens, heads, dim] and k [tokens, kv_heads, dim] (rows may be views into
// one fused qkv output): x * cos + rotate_half(x) * sin, cos/sin [tokens, dim], the
// rotate-half (GPT-NeoX) layout Llama and Qwen2 use.
void rotary_embedding(at::Tensor& q, at::Tensor& k, const at::Tensor& cos,
                      const at::Tensor& sin) {
  for (const auto* t : {&q, &k}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 3 &&
                    t->stride(2) == 1 && t->stride(1) == t->size(2),
                "q, k: float32 [tokens, heads, dim] with dense heads");
  }
  const int64_t dim = q.size(2), half = dim / 2, tokens = q.size(0);
  TORCH_CHECK(k.size(2) == dim && k.size(0) == tokens && dim % 2 == 0, "q and k do not match");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == tokens &&
                  cos.size(1) == dim && sin.sizes() == cos.sizes() &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "cos, sin: contiguous float32 [tokens, dim]");
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t qh = q.size(1), kh = k.size(1), qs = q.stride(0), ks = k.stride(0);
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * dim;
      const float* s = sp + t * dim;
      for (int64_t h = 0; h < qh + kh; ++h) {
        float* x = h < qh ? qp + t * qs + h * dim : kp + t * ks + (h - qh) * dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x[i], b = x[i + half];
          x[i] = a * c[i] + (-b) * s[i];
          x[i + half] = b * c[i + half] + a * s[i + half];
        }
      }
    }
  });
}

// out [rows, n] = silu(gate_up[:, :n]) * gate_up[:, n:], silu(x) = x / (1 + e^-x).
void silu_and_mul(at::Tensor& out, const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  check_rows(out, "out");
  const int64_t n = out.size(1);
  TORCH_CHECK(gate_up.size(1) == 2 * n && gate_up.size(0) == out.size(0),
              "silu_and_mul: gate_up [rows, 2n], out [rows, n]");
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t gs = gate_up.stride(0), os = out.stride(0);
  at::parallel_for(0, out.size(0), 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gp + r * gs;
      const float* u = g + n;
      float* o = op + r * os;
#if VLMSERVE_VEC_LANES
      const vec::vfloat one = vec::set1(1.f);
      for (int64_t i = 0; i < n; i += vec::kLanes) {
        const vec::vmask lanes = vec::first_lanes(n - i);
        const vec::vfloat x = vec::maskz_load(lanes, g + i);
        const vec::vfloat silu = vec::div(x, vec::add(one, vec::exp_ps(vec::sub(vec::zero(), x))));
        vec::mask_store(o + i, lanes, vec::mul(silu, vec::maskz_load(lanes, u + i)));
      }
#else
      for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
#endif
    }
  });
}

}  // namespace

TORCH_LIBRARY(vlmserve_fused, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
}

TORCH_LIBRARY_IMPL(vlmserve_fused, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
}
