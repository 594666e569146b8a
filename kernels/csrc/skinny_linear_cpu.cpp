// A linear layer for a few rows (decode batches), float32 on the CPU:
//   out[m, n] = dot(x[m, :], weight[n, :]) (+ bias[n])
// with the weight in nn.Linear's own [out, in] layout.
//
// A decode step with a few sequences reads every weight once for a handful of rows: the
// GEMM is bound by the weight stream, yet BLAS GEMMs (MKL, oneDNN) block and pack for
// large batches and stream the weights well below a plain read's bandwidth at a few rows
// (benchmarks/skinny_linear.py). Here each thread streams a share of the weight's rows, NB
// rows at a time, and multiplies each group with all the input rows while it is in L1: a
// register tile of MR input rows x NB weight rows of vector partial sums. The weight is
// read exactly once, prefetched well ahead; the inputs (a few KB) stay in L1.
//
// Registered as torch.ops.vlmserve_skinny.linear; kernels/packed_linear.py builds it on
// first use (PackedLinear's small-batch path). Rounding: float32 products summed lane by
// lane, then across lanes (an order of its own: within a few ulp of BLAS).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "vec.h"

namespace {

namespace vec = vlmserve_vec;

#if VLMSERVE_VEC_LANES

constexpr int64_t L = VLMSERVE_VEC_LANES;
constexpr int MR = 4;  // input rows a tile
// Weight rows a tile: MR x NB accumulators + NB weight vectors fit the register file
// (AVX-512: 24 + 6 of 32; AVX2: 12 + 3 of 16).
constexpr int NB = L == 16 ? 6 : 3;
// Software prefetch this many floats (8 KB) ahead of the weight rows being read: without
// it the FMAs and the weight stream do not overlap (nearer or farther ahead was slower
// where it was tuned; benchmarks/skinny_linear.py).
constexpr int64_t PF = 2048;

// out[m * os + n] for m < R, n < C: R input rows against C weight rows, K long.
template <int R, int C>
inline void tile(const float* x, int64_t xs, const float* w, int64_t K, const float* bias,
                 float* out, int64_t os) {
  vec::vfloat acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = vec::zero();
  const int64_t body = K - K % L;
  for (int64_t k = 0; k < body; k += L) {
    vec::vfloat wv[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      if (k % 16 == 0)  // once a 64-byte line
        _mm_prefetch(reinterpret_cast<const char*>(w + c * K + k + PF), _MM_HINT_T0);
      wv[c] = vec::load(w + c * K + k);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const vec::vfloat xv = vec::load(x + r * xs + k);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = vec::fmadd(xv, wv[c], acc[r][c]);
    }
  }
  if (body < K) {
    const vec::vmask m = vec::first_lanes(K - body);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const vec::vfloat xv = vec::maskz_load(m, x + r * xs + body);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        acc[r][c] = vec::fmadd(xv, vec::maskz_load(m, w + c * K + body), acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
      out[r * os + c] = vec::reduce_add(acc[r][c]) + (bias ? bias[c] : 0.f);
}

// All input rows against weight rows [n, n + C).
template <int C>
inline void rows(const float* x, int64_t xs, int64_t M, const float* w, int64_t K,
                 const float* bias, float* out, int64_t os) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) tile<MR, C>(x + m * xs, xs, w, K, bias, out + m * os, os);
  switch (M - m) {
    case 3: tile<3, C>(x + m * xs, xs, w, K, bias, out + m * os, os); break;
    case 2: tile<2, C>(x + m * xs, xs, w, K, bias, out + m * os, os); break;
    case 1: tile<1, C>(x + m * xs, xs, w, K, bias, out + m * os, os); break;
    default: break;
  }
}

#endif

void linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
            const c10::optional<at::Tensor>& bias) {
  for (const at::Tensor* t : {&out, &x, &weight})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 2 &&
                    t->stride(1) == 1,
                "skinny linear: CPU float32 [rows, width] tensors with dense rows");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K && weight.is_contiguous(), "weight: contiguous [out, in]");
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "out: [rows, out]");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == at::kFloat,
                "bias: [out] float32");
    b = bias->data_ptr<float>();
  }
#if VLMSERVE_VEC_LANES
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  const int64_t groups = N / NB;
  // At least ~64 KB of weight a task, so the threads' start costs stay small.
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / (NB * K));
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n = g * NB;
      rows<NB>(xp, xs, M, wp + n * K, K, b ? b + n : nullptr, op + n, os);
    }
  });
  for (int64_t n = groups * NB; n < N; ++n)  // the last N % NB weight rows
    rows<1>(xp, xs, M, wp + n * K, K, b ? b + n : nullptr, op + n, os);
#else
  TORCH_CHECK(false, "skinny linear needs AVX2 or AVX-512");
#endif
}

// The float lanes the kernel was built for; 0: it cannot run on this CPU.
int64_t vector_lanes() { return vlmserve_vec::kLanes; }

}  // namespace

TORCH_LIBRARY(vlmserve_skinny, m) {
  m.def("vector_lanes() -> int", &vector_lanes);
  m.def("linear(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias) -> ()");
}

TORCH_LIBRARY_IMPL(vlmserve_skinny, CPU, m) { m.impl("linear", &linear); }
