// Fused elementwise ops of the decoder layer on the CPU, float32 or bfloat16 (bfloat16 in
// and out, float32 inside, each output rounded once): each reads its inputs once and writes
// its outputs once, where the eager ops they replace make 3-6 passes.
//
// Registered as torch.ops.vlmserve_fused.*; kernels/fused_ops.py builds this file on first use
// (kernels/cpu_build.py, with -ffp-contract=off) and holds the eager reference of each op.
// Rounding: rope and the residual add round exactly as the eager ops; the RMS reduction
// and exp in silu are summed / approximated in their own order (within a few ulp).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <vector>

#include "vec.h"

namespace {

namespace vec = vlmserve_vec;

using bf16 = at::BFloat16;

// A [rows, width] CPU tensor of `dtype` whose rows are dense (any row stride).
void check_rows(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype &&
                  (dtype == at::kFloat || dtype == at::kBFloat16),
              name, ": CPU float32 or bfloat16, all tensors of one dtype");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": [rows, width] with dense rows");
}

// f(T{}) for T the tensors' element type (float or bf16; check_rows has checked it).
template <typename F>
inline void dispatch(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kFloat)
    f(float{});
  else
    f(bf16{});
}

// Rounds a float32 result to T (to nearest even for bfloat16; nothing for float).
template <typename T>
inline T round_to(float v) {
  return static_cast<T>(v);
}

#if VLMSERVE_VEC_LANES
// The first n elements of p (all lanes for n >= kLanes) as float32, and their store.
inline vec::vfloat load_first(const float* p, int64_t n) {
  return vec::maskz_load(vec::first_lanes(n), p);
}
inline vec::vfloat load_first(const bf16* p, int64_t n) {
  const auto* bits = reinterpret_cast<const uint16_t*>(p);
  return n >= vec::kLanes ? vec::load_bf16(bits) : vec::load_bf16_first(bits, n);
}
inline void store_first(float* p, vec::vfloat v, int64_t n) {
  vec::mask_store(p, vec::first_lanes(n), v);
}
inline void store_first(bf16* p, vec::vfloat v, int64_t n) {
  auto* bits = reinterpret_cast<uint16_t*>(p);
  if (n >= vec::kLanes)
    vec::store_bf16(bits, v);
  else
    vec::store_bf16_first(bits, v, n);
}
// v rounded to T and widened back (what static_cast<float>(round_to<T>(v)) gives a lane).
inline vec::vfloat rounded(vec::vfloat v, float) { return v; }
inline vec::vfloat rounded(vec::vfloat v, bf16) { return vec::round_bf16(v); }
#endif

// out = weight * (x * rsqrt(mean(x^2) + eps)), row by row (transformers' LlamaRMSNorm:
// normalised in float32, rounded to T before the weight multiplies it).
template <typename T>
inline void rms_row(T* out, const T* x, const T* w, int64_t n, float eps) {
#if VLMSERVE_VEC_LANES
  // Vector loops: the scalar ones' bfloat16 conversions kept the compiler from vectorizing
  // them (4x a copy's time on an [2048, 640] prefill norm).
  vec::vfloat acc = vec::zero();
  for (int64_t i = 0; i < n; i += vec::kLanes) {
    const vec::vfloat v = load_first(x + i, n - i);
    acc = vec::fmadd(v, v, acc);
  }
  const float sum = vec::reduce_add(acc);
  const vec::vfloat inv = vec::set1(1.f / std::sqrt(sum / static_cast<float>(n) + eps));
  for (int64_t i = 0; i < n; i += vec::kLanes) {
    const vec::vfloat normed = rounded(vec::mul(load_first(x + i, n - i), inv), T{});
    store_first(out + i, vec::mul(load_first(w + i, n - i), normed), n - i);
  }
#else
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    sum += v * v;
  }
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    const float normed = static_cast<float>(round_to<T>(static_cast<float>(x[i]) * inv));
    out[i] = round_to<T>(static_cast<float>(w[i]) * normed);
  }
#endif
}

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x", x.scalar_type());
  check_rows(out, "out", x.scalar_type());
  TORCH_CHECK(out.sizes() == x.sizes() && weight.is_contiguous() &&
                  weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "rms_norm: out like x, weight [width] of x's dtype");
  const int64_t n = x.size(1), xs = x.stride(0), os = out.stride(0);
  dispatch(x, [&](auto t) {
    using T = decltype(t);
    const T* xp = x.data_ptr<T>();
    const T* w = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) rms_row(op + r * os, xp + r * xs, w, n, eps);
    });
  });
}

// residual += x; x = rms_norm(residual): the layer's skip connection and the next norm in
// one pass (vLLM's fused_add_rms_norm).
// (In bfloat16 the sum is rounded to bfloat16, as the eager add, before it is normalised.)
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  check_rows(x, "x", x.scalar_type());
  check_rows(residual, "residual", x.scalar_type());
  TORCH_CHECK(residual.sizes() == x.sizes() && weight.is_contiguous() &&
                  weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "fused_add_rms_norm: residual like x, weight [width] of x's dtype");
  const int64_t n = x.size(1), xs = x.stride(0), rs = residual.stride(0);
  dispatch(x, [&](auto t) {
    using T = decltype(t);
    T* xp = x.data_ptr<T>();
    T* rp = residual.data_ptr<T>();
    const T* w = weight.data_ptr<T>();
    at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        T* xr = xp + r * xs;
        T* rr = rp + r * rs;
#if VLMSERVE_VEC_LANES
        for (int64_t i = 0; i < n; i += vec::kLanes)
          store_first(rr + i, vec::add(load_first(xr + i, n - i), load_first(rr + i, n - i)),
                      n - i);
#else
        for (int64_t i = 0; i < n; ++i)
          rr[i] = round_to<T>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
#endif
        rms_row(xr, rr, w, n, eps);
      }
    });
  });
}

// dst = rope(src) for one head: src * cos + rotate_half(src) * sin (as rotary_embedding).
template <typename T>
inline void rope_row(T* dst, const T* src, const T* c, const T* s, int64_t half) {
#if VLMSERVE_VEC_LANES
  for (int64_t i = 0; i < half; i += vec::kLanes) {
    const int64_t m = half - i;
    const vec::vfloat a = load_first(src + i, m), b = load_first(src + i + half, m);
    // a c - b s is a c + (-b) s exactly (products rounded, then the sum: no FMA)
    store_first(dst + i, vec::sub(vec::mul(a, load_first(c + i, m)),
                                  vec::mul(b, load_first(s + i, m))), m);
    store_first(dst + i + half, vec::add(vec::mul(b, load_first(c + i + half, m)),
                                         vec::mul(a, load_first(s + i + half, m))), m);
  }
#else
  for (int64_t i = 0; i < half; ++i) {
    const float a = static_cast<float>(src[i]), b = static_cast<float>(src[i + half]);
    dst[i] = round_to<T>(a * static_cast<float>(c[i]) + (-b) * static_cast<float>(s[i]));
    dst[i + half] = round_to<T>(b * static_cast<float>(c[i + half]) +
                                a * static_cast<float>(s[i + half]));
  }
#endif
}

// In place on q [tokens, heads, dim] and k [tokens, kv_heads, dim] (rows may be views into
// one fused qkv output): x * cos + rotate_half(x) * sin, cos/sin [tokens, dim], the
// rotate-half (GPT-NeoX) layout Llama and Qwen2 use. All of one dtype (float32 or bfloat16;
// bfloat16: products and sum in float32, rounded once).
void rotary_embedding(at::Tensor& q, at::Tensor& k, const at::Tensor& cos,
                      const at::Tensor& sin) {
  const at::ScalarType dtype = q.scalar_type();
  for (const auto* t : {&q, &k}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == dtype && t->dim() == 3 &&
                    t->stride(2) == 1 && t->stride(1) == t->size(2) &&
                    (dtype == at::kFloat || dtype == at::kBFloat16),
                "q, k: float32 or bfloat16 [tokens, heads, dim] with dense heads");
  }
  const int64_t dim = q.size(2), half = dim / 2, tokens = q.size(0);
  TORCH_CHECK(k.size(2) == dim && k.size(0) == tokens && dim % 2 == 0, "q and k do not match");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == tokens &&
                  cos.size(1) == dim && sin.sizes() == cos.sizes() &&
                  cos.scalar_type() == dtype && sin.scalar_type() == dtype,
              "cos, sin: contiguous [tokens, dim] of q's dtype");
  const int64_t qh = q.size(1), kh = k.size(1), qs = q.stride(0), ks = k.stride(0);
  dispatch(q, [&](auto t) {
    using T = decltype(t);
    T* qp = q.data_ptr<T>();
    T* kp = k.data_ptr<T>();
    const T* cp = cos.data_ptr<T>();
    const T* sp = sin.data_ptr<T>();
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const T* c = cp + t * dim;
        const T* s = sp + t * dim;
        for (int64_t h = 0; h < qh + kh; ++h) {
          T* x = h < qh ? qp + t * qs + h * dim : kp + t * ks + (h - qh) * dim;
          rope_row(x, x, c, s, half);  // in place: element i reads and writes only i, i + half
        }
      }
    });
  });
}

// The attention's inputs from the fused projection's output qkv [tokens, (heads + 2 kv_heads)
// * dim] in one pass: q's heads (RMS-normed by q_weight where given: Gemma 3's QK-norm, then
// RoPE) into q_out [tokens, heads, dim]; k's (k_weight's norm, RoPE) and v's into the cache
// [2, kv_heads, slots, dim] at slots[token]. The same roundings as rms_norm, then
// rotary_embedding, then the cache write (the unfused path): bit-identical outputs.
void qkv_to_cache(at::Tensor& q_out, at::Tensor& kv_cache, const at::Tensor& qkv,
                  const c10::optional<at::Tensor>& q_weight,
                  const c10::optional<at::Tensor>& k_weight, double eps, const at::Tensor& cos,
                  const at::Tensor& sin, const at::Tensor& slots) {
  const at::ScalarType dtype = qkv.scalar_type();
  check_rows(qkv, "qkv", dtype);
  const int64_t tokens = qkv.size(0), heads = q_out.size(1), dim = q_out.size(2);
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                  kv_cache.scalar_type() == dtype && kv_cache.size(3) == dim,
              "kv_cache: contiguous [2, kv_heads, slots, dim] of qkv's dtype");
  const int64_t kv_heads = kv_cache.size(1), num_slots = kv_cache.size(2), half = dim / 2;
  TORCH_CHECK(q_out.dim() == 3 && q_out.is_contiguous() && q_out.scalar_type() == dtype &&
                  q_out.size(0) == tokens && dim % 2 == 0 &&
                  qkv.size(1) == (heads + 2 * kv_heads) * dim,
              "q_out: contiguous [tokens, heads, dim]; qkv [tokens, (heads + 2 kv_heads) dim]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                  cos.size(0) == tokens && cos.size(1) == dim && sin.sizes() == cos.sizes() &&
                  cos.scalar_type() == dtype && sin.scalar_type() == dtype,
              "cos, sin: contiguous [tokens, dim] of qkv's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1 &&
                  slots.size(0) == tokens, "slots: int64 [tokens]");
  for (const auto* w : {&q_weight, &k_weight})
    TORCH_CHECK(!w->has_value() || ((*w)->is_contiguous() && (*w)->numel() == dim &&
                                    (*w)->scalar_type() == dtype),
                "q/k norm weights: [dim] of qkv's dtype");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot ", sp[t], " outside the cache");
  dispatch(qkv, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = qkv.data_ptr<T>();
    T* qp = q_out.data_ptr<T>();
    T* kp = kv_cache.data_ptr<T>();
    T* vp = kp + kv_heads * num_slots * dim;
    const T* qw = q_weight.has_value() ? q_weight->data_ptr<T>() : nullptr;
    const T* kw = k_weight.has_value() ? k_weight->data_ptr<T>() : nullptr;
    const T* cp = cos.data_ptr<T>();
    const T* snp = sin.data_ptr<T>();
    const int64_t xs = qkv.stride(0);
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      std::vector<T> normed(dim);
      for (int64_t t = begin; t < end; ++t) {
        const T* row = xp + t * xs;
        const T* c = cp + t * dim;
        const T* s = snp + t * dim;
        for (int64_t h = 0; h < heads + kv_heads; ++h) {
          const bool is_q = h < heads;
          const T* src = row + h * dim;
          const T* w = is_q ? qw : kw;
          if (w != nullptr) {
            rms_row(normed.data(), src, w, dim, static_cast<float>(eps));
            src = normed.data();
          }
          T* dst = is_q ? qp + (t * heads + h) * dim
                        : kp + ((h - heads) * num_slots + sp[t]) * dim;
          rope_row(dst, src, c, s, half);
        }
        for (int64_t h = 0; h < kv_heads; ++h)
          std::copy(row + (heads + kv_heads + h) * dim, row + (heads + kv_heads + h + 1) * dim,
                    vp + (h * num_slots + sp[t]) * dim);
      }
    });
  });
}


// out [rows, n] = act(gate_up[:, :n]) * gate_up[:, n:] (bfloat16: in float32, rounded once)
// for act(x) = x / (1 + e^-z(x)): SiLU (z = x) or GELU-tanh (z = 2 sqrt(2/pi) (x + 0.044715
// x^3), since 0.5 (1 + tanh(y)) = 1 / (1 + e^-2y): Gemma's gated MLP).
template <bool kGelu>
void act_and_mul(at::Tensor& out, const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up", gate_up.scalar_type());
  check_rows(out, "out", gate_up.scalar_type());
  const int64_t n = out.size(1);
  TORCH_CHECK(gate_up.size(1) == 2 * n && gate_up.size(0) == out.size(0),
              "act_and_mul: gate_up [rows, 2n], out [rows, n]");
  const int64_t gs = gate_up.stride(0), os = out.stride(0);
  // 2 sqrt(2 / pi) and 2 sqrt(2 / pi) 0.044715: z = x (kA + kB x^2)
  constexpr float kA = 1.5957691216057308f, kB = 0.0713548162726009f;
  dispatch(out, [&](auto t) {
    using T = decltype(t);
    const T* gp = gate_up.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, out.size(0), 4, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* g = gp + r * gs;
        const T* u = g + n;
        T* o = op + r * os;
#if VLMSERVE_VEC_LANES
        const vec::vfloat one = vec::set1(1.f);
        for (int64_t i = 0; i < n; i += vec::kLanes) {
          const vec::vfloat x = load_first(g + i, n - i);
          vec::vfloat z = x;
          if constexpr (kGelu) z = vec::mul(x, vec::add(vec::set1(kA), vec::mul(vec::set1(kB),
                                                                              vec::mul(x, x))));
          const vec::vfloat act = vec::div(x, vec::add(one, vec::exp_ps(vec::sub(vec::zero(), z))));
          store_first(o + i, vec::mul(act, load_first(u + i, n - i)), n - i);
        }
#else
        for (int64_t i = 0; i < n; ++i) {
          const float x = static_cast<float>(g[i]);
          const float z = kGelu ? x * (kA + kB * (x * x)) : x;
          o[i] = round_to<T>(x / (1.f + std::exp(-z)) * static_cast<float>(u[i]));
        }
#endif
      }
    });
  });
}

void silu_and_mul(at::Tensor& out, const at::Tensor& gate_up) {
  act_and_mul<false>(out, gate_up);
}
void gelu_tanh_and_mul(at::Tensor& out, const at::Tensor& gate_up) {
  act_and_mul<true>(out, gate_up);
}

}  // namespace

TORCH_LIBRARY(vlmserve_fused, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def("gelu_tanh_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def(
      "qkv_to_cache(Tensor(a!) q_out, Tensor(b!) kv_cache, Tensor qkv, Tensor? q_weight, "
      "Tensor? k_weight, float eps, Tensor cos, Tensor sin, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(vlmserve_fused, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("gelu_tanh_and_mul", &gelu_tanh_and_mul);
  m.impl("qkv_to_cache", &qkv_to_cache);
}
