// A linear layer for a few rows (decode batches) on the CPU, float32 or bfloat16:
//   out[m, n] = dot(x[m, :], weight[n, :]) (+ bias[n])
// with the weight in nn.Linear's own [out, in] layout. bfloat16 sums in float32: with
// AVX-512 BF16 by `vdpbf16ps` (32 products a vector, pairs added into 16 float lanes),
// elsewhere each bfloat16 vector widened to float32 (exact) and FMA'd as the float32 path;
// the output is rounded to bfloat16 once, to nearest even, or written as the float32 sums
// (a float32 `out`: the LM head's logits, which sampling reads in float32).
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

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx.h"
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

// out[m * os + n] for m < R, n < C: R input rows against C weight rows, K long. O: float
// (the bfloat16 tiles below also write bfloat16).
template <int R, int C, typename O>
inline void tile(const float* x, int64_t xs, const float* w, int64_t K, const float* bias,
                 O* out, int64_t os) {
  static_assert(std::is_same_v<O, float>, "float32 in, float32 out");
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

using bf16 = at::BFloat16;

#if defined(__AVX512BF16__)
// bfloat16 elements a vdpbf16ps step (two per float lane).
constexpr int64_t LB = 32;
// Software prefetch: the weight rows PFT tiles on (C rows each, contiguous after these),
// C lines a step in address order, so the tile two on is in L1 when its turn comes. One
// line a row at 8 KB ahead of each row, as the float32 path does, presents the memory with
// C interleaved streams: at one row of x (decode) on a Zen 4 the Gemma 3 270M head (262k
// rows of 640) read at 22 GB/s that way and 27 this way, the layers' shapes 23 and 28, a
// float32 sum 30-33 (in-process A/B, 1-3 tiles ahead alike). Past the weight's last tile
// the prefetches touch memory that is never read (a prefetch does not fault).
constexpr int64_t PFT = 2;

inline __m512bh bf16_vec(const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh bf16_vec_first(const bf16* p, int64_t n) {  // n < LB; zeros past them
  return (__m512bh)_mm512_maskz_loadu_epi16(static_cast<__mmask32>((1u << n) - 1u), p);
}

// The bfloat16 tile with native dot products: as `tile`, LB elements a step. O: the
// output's type, bf16 (rounded once) or float (the float32 sums as they are: the LM head's
// logits).
template <int R, int C, typename O>
inline void tile(const bf16* x, int64_t xs, const bf16* w, int64_t K, const bf16* bias,
                 O* out, int64_t os) {
  __m512 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t body = K - K % LB;
  for (int64_t k = 0; k < body; k += LB) {
    __m512bh wv[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(w + PFT * C * K + k * C + c * LB), _MM_HINT_T0);
      wv[c] = bf16_vec(w + c * K + k);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = bf16_vec(x + r * xs + k);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
  }
  if (body < K) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = bf16_vec_first(x + r * xs + body, K - body);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, bf16_vec_first(w + c * K + body, K - body));
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
      out[r * os + c] = O(_mm512_reduce_add_ps(acc[r][c]) +
                          (bias ? static_cast<float>(bias[c]) : 0.f));
}
#else
// The bfloat16 tile without native bfloat16: each vector widened to float32 (exact), then
// the float32 path's FMAs. O: as above.
template <int R, int C, typename O>
inline void tile(const bf16* x, int64_t xs, const bf16* w, int64_t K, const bf16* bias,
                 O* out, int64_t os) {
  const auto* xb = reinterpret_cast<const uint16_t*>(x);
  const auto* wb = reinterpret_cast<const uint16_t*>(w);
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
      if (k % 32 == 0)  // once a 64-byte line
        _mm_prefetch(reinterpret_cast<const char*>(wb + c * K + k + 2 * PF), _MM_HINT_T0);
      wv[c] = vec::load_bf16(wb + c * K + k);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const vec::vfloat xv = vec::load_bf16(xb + r * xs + k);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = vec::fmadd(xv, wv[c], acc[r][c]);
    }
  }
  if (body < K) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const vec::vfloat xv = vec::load_bf16_first(xb + r * xs + body, K - body);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        acc[r][c] = vec::fmadd(xv, vec::load_bf16_first(wb + c * K + body, K - body), acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
      out[r * os + c] = O(vec::reduce_add(acc[r][c]) +
                          (bias ? static_cast<float>(bias[c]) : 0.f));
}
#endif

// All input rows against weight rows [n, n + C); T: float or bf16 in, O: out (T, or float
// for bf16 in).
template <int C, typename T, typename O>
inline void rows(const T* x, int64_t xs, int64_t M, const T* w, int64_t K, const T* bias, O* out,
                 int64_t os) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) tile<MR, C, O>(x + m * xs, xs, w, K, bias, out + m * os, os);
  switch (M - m) {
    case 3: tile<3, C, O>(x + m * xs, xs, w, K, bias, out + m * os, os); break;
    case 2: tile<2, C, O>(x + m * xs, xs, w, K, bias, out + m * os, os); break;
    case 1: tile<1, C, O>(x + m * xs, xs, w, K, bias, out + m * os, os); break;
    default: break;
  }
}

template <typename T, typename O>
void run(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const T* b) {
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  O* op = out.data_ptr<O>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  const int64_t groups = N / NB;
  // At least ~64 KB of weight a task, so the threads' start costs stay small.
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / (NB * K * int64_t(sizeof(T))));
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n = g * NB;
      rows<NB>(xp, xs, M, wp + n * K, K, b ? b + n : nullptr, op + n, os);
    }
  });
  for (int64_t n = groups * NB; n < N; ++n)  // the last N % NB weight rows
    rows<1>(xp, xs, M, wp + n * K, K, b ? b + n : nullptr, op + n, os);
}

#endif

void linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
            const c10::optional<at::Tensor>& bias) {
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "skinny linear: float32 or bfloat16, not ", dtype);
  // out: x's dtype, or float32 for bfloat16 x (the sums unrounded)
  const bool float_out = out.scalar_type() == at::kFloat;
  TORCH_CHECK(out.scalar_type() == dtype || float_out,
              "skinny linear: out in x's dtype or float32");
  for (const at::Tensor* t : {&out, &x, &weight})
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 2 && t->stride(1) == 1,
                "skinny linear: CPU [rows, width] tensors with dense rows");
  TORCH_CHECK(weight.scalar_type() == dtype, "skinny linear: weight in x's dtype");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K && weight.is_contiguous(), "weight: contiguous [out, in]");
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "out: [rows, out]");
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == dtype,
                "bias: [out] of x's dtype");
#if VLMSERVE_VEC_LANES
  if (dtype == at::kFloat) {
    run<float, float>(out, x, weight, bias.has_value() ? bias->data_ptr<float>() : nullptr);
  } else {
    const bf16* b = bias.has_value() ? bias->data_ptr<bf16>() : nullptr;
    if (float_out)
      run<bf16, float>(out, x, weight, b);
    else
      run<bf16, bf16>(out, x, weight, b);
  }
#else
  TORCH_CHECK(false, "skinny linear needs AVX2 or AVX-512");
#endif
}


#if VLMSERVE_AMX
// bfloat16 x [M, K] times a weight [N, K] on AMX tiles at tens of rows: the LM head's
// float32 logits (on an AMX Xeon 10% under oneDNN's packed GEMM plus the float32 widening
// in the engine at 64 rows of the 262k head), or only each row's argmax (greedy decoding);
// calibration decides where each runs.
// The weight is packed once (`amx_pack`) as 16-column tiles of bfloat16 pairs: tile (n, s)
// holds columns 16n..16n+15 at K indices 32s..32s+31 as B operand, 1 KB contiguous, so a
// thread streams its columns once, front to back; x is packed per call as A tiles (64 rows
// a pass, `column_tiles`) and the 16 x 16 float sums go out through a small buffer.
// Tiles (amx.h's layout): C 0-3, B 4, A 5-7.
namespace amx {
using vlmserve_amx::configure;
using vlmserve_amx::enabled;

// C_r += A(r, s) B(n, s) over the K steps for RT row tiles (x's A tiles at a, the column
// tile's B at b, shared); C_r stored to buf[r].
template <int RT>
inline void column_tile(const uint16_t* a, const uint16_t* b, int64_t steps, float* buf) {
  vlmserve_amx::tile_pass<RT, false>(b, 1024, 64, a, steps, buf);
}

}  // namespace amx

// weight [N, K] (N a multiple of 16, K of 32) -> [N / 16, K / 32, 16, 32]: tile (n, s), row
// e, holds (w[16n + c][32s + 2e], w[16n + c][32s + 2e + 1]) for c = 0..15.
at::Tensor amx_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 &&
                  weight.is_contiguous() && weight.size(0) % 16 == 0 && weight.size(1) % 32 == 0,
              "amx_pack: contiguous bfloat16 [N, K], N % 16 == 0, K % 32 == 0");
  const int64_t N = weight.size(0), K = weight.size(1), steps = K / 32;
  at::Tensor packed = at::empty({N / 16, steps, 16, 32}, weight.options());
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  auto* p = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, N / 16, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t s = 0; s < steps; ++s)
        for (int64_t e = 0; e < 16; ++e)
          for (int64_t c = 0; c < 16; ++c) {
            const uint16_t* src = w + (16 * n + c) * K + 32 * s + 2 * e;
            uint16_t* dst = p + ((n * steps + s) * 16 + e) * 32 + 2 * c;
            dst[0] = src[0], dst[1] = src[1];
          }
  });
  return packed;
}

// x's rows as A tiles [rows / 16][steps][16][32] (rounded up, zero rows past them).
vlmserve_vec::LineVector<uint16_t> pack_rows(const at::Tensor& x) {
  const int64_t rows = x.size(0), steps = x.size(1) / 32, rt = (rows + 15) / 16;
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  vlmserve_vec::LineVector<uint16_t> a(rt * steps * 512, 0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t s = 0; s < steps; ++s)
      std::memcpy(a.data() + ((r / 16 * steps + s) * 16 + r % 16) * 32,
                  xs + r * x.stride(0) + 32 * s, 64);
  return a;
}

// Column tiles a chunk (kChunk x 16 columns: 640 KB of weight at K = 640, within L2) and
// rows a block (four row tiles: the C tiles there are): every block of x's rows passes over
// a chunk while it is in L2, so the weight is read from memory once whatever the rows (at
// 128 rows of the 262k head on an AMX Xeon 34 ms against about 43 for two passes).
constexpr int64_t kChunk = 32, kBlockRows = 64;

// Inside a parallel region: this thread's share of the chunks, emit(r0, rows, n, buf) for
// each block of rows r0 .. r0 + rows - 1 and column tile n, buf the 16 x 16 float sums of
// the block's row tile t at buf + 256 t (row r0 + i at buf + 16 i). Each thread's chunks
// are contiguous and in order: a row meets its columns in increasing order on a thread.
template <class Emit>
void column_tiles(const uint16_t* a, int64_t M, const uint16_t* b, int64_t steps,
                  int64_t tiles, Emit&& emit) {
  amx::configure();
  alignas(64) float buf[4 * 256];
  const int64_t chunks = (tiles + kChunk - 1) / kChunk;
#pragma omp for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t n1 = std::min(tiles, (c + 1) * kChunk);
    for (int64_t r0 = 0; r0 < M; r0 += kBlockRows) {
      const int64_t rows = std::min(kBlockRows, M - r0);
      const uint16_t* ar = a + r0 / 16 * steps * 512;
      for (int64_t n = c * kChunk; n < n1; ++n) {
        const uint16_t* bn = b + n * steps * 512;
        switch ((rows + 15) / 16) {
          case 1: amx::column_tile<1>(ar, bn, steps, buf); break;
          case 2: amx::column_tile<2>(ar, bn, steps, buf); break;
          case 3: amx::column_tile<3>(ar, bn, steps, buf); break;
          default: amx::column_tile<4>(ar, bn, steps, buf); break;
        }
        emit(r0, rows, n, static_cast<const float*>(buf));
      }
    }
  }
  _tile_release();
}

void check_amx_operands(const at::Tensor& x, const at::Tensor& packed, const char* name) {
  TORCH_CHECK(amx::enabled(), name, ": the AMX tile state was refused");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1 &&
                  packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 &&
                  packed.size(1) * 32 == x.size(1),
              name, ": bfloat16 x [M, K] with dense rows and amx_pack's weight for K");
}

// out [M, N] float32 = x [M, K] bfloat16 @ weight^T, the weight as amx_pack made it.
void amx_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed) {
  check_amx_operands(x, packed, "amx_linear");
  const int64_t M = x.size(0), steps = x.size(1) / 32, tiles = packed.size(0), N = tiles * 16;
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(0) == M &&
                  out.size(1) == N,
              "amx_linear: out contiguous float32 [M, N]");
  const auto* b = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  float* o = out.data_ptr<float>();
  const auto a = pack_rows(x);
#pragma omp parallel num_threads(at::get_num_threads())
  column_tiles(a.data(), M, b, steps, tiles,
               [&](int64_t r0, int64_t rows, int64_t n, const float* buf) {
                 for (int64_t r = 0; r < rows; ++r)
                   _mm512_storeu_ps(o + (r0 + r) * N + 16 * n, _mm512_load_ps(buf + 16 * r));
               });
}

// out [M] int64: argmax over N of x [M, K] @ weight^T (amx_linear's float32 sums, the same
// pick as torch.argmax of amx_linear's output) without writing the [M, N] sums anywhere:
// greedy decoding's token ids straight from the LM head. Each thread keeps, per row and
// lane, the first maximum of the columns it multiplies (16 lanes: columns 16n + lane),
// then the lanes and the threads are merged in torch.argmax's order.
void amx_argmax(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed) {
  check_amx_operands(x, packed, "amx_argmax");
  const int64_t M = x.size(0), steps = x.size(1) / 32, tiles = packed.size(0);
  TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous() && out.dim() == 1 &&
                  out.size(0) == M && tiles > 0,
              "amx_argmax: out contiguous int64 [M], a weight of at least 16 rows");
  const auto* b = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const auto a = pack_rows(x);
  std::vector<vlmserve_amx::Best> best(M, vlmserve_amx::Best{0.0f, -1});
#pragma omp parallel num_threads(at::get_num_threads())
  {
    vlmserve_amx::LaneArgmax mine(M);  // N < 2^31 (amx_pack's [N / 16])
    column_tiles(a.data(), M, b, steps, tiles,
                 [&](int64_t r0, int64_t rows, int64_t n, const float* buf) {
                   for (int64_t r = 0; r < rows; ++r)
                     mine.update(r0 + r, 16 * n, 0xFFFF, _mm512_load_ps(buf + 16 * r));
                 });
#pragma omp critical(vlmserve_amx_argmax)
    mine.merge_into(best.data());
  }
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < M; ++r) o[r] = best[r].index;
}
#endif

bool amx_linear_available() {
#if VLMSERVE_AMX
  return amx::enabled();
#else
  return false;
#endif
}

// Whether the bfloat16 path has native dot products (AVX-512 BF16) in this build.
bool native_bf16() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// The float lanes the kernel was built for; 0: it cannot run on this CPU.
int64_t vector_lanes() { return vlmserve_vec::kLanes; }

}  // namespace

TORCH_LIBRARY(vlmserve_skinny, m) {
  m.def("vector_lanes() -> int", &vector_lanes);
  m.def("native_bf16() -> bool", &native_bf16);
  m.def("linear(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias) -> ()");
  m.def("amx_available() -> bool", &amx_linear_available);
#if VLMSERVE_AMX
  m.def("amx_pack(Tensor weight) -> Tensor");
  m.def("amx_linear(Tensor(a!) out, Tensor x, Tensor packed) -> ()");
  m.def("amx_argmax(Tensor(a!) out, Tensor x, Tensor packed) -> ()");
#endif
}

TORCH_LIBRARY_IMPL(vlmserve_skinny, CPU, m) {
  m.impl("linear", &linear);
#if VLMSERVE_AMX
  m.impl("amx_pack", &amx_pack);
  m.impl("amx_linear", &amx_linear);
  m.impl("amx_argmax", &amx_argmax);
#endif
}
