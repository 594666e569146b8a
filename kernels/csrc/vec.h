// The SIMD layer shared by the CPU kernels in this folder: one float vector type of
// kLanes lanes with the few operations the kernels use, written for AVX-512 (16 lanes) and
// for AVX2 + FMA (8 lanes), so each kernel is written once and -march=native picks the
// widest (kernels/cpu_build.py hashes every header here into each kernel's build
// directory, so a change rebuilds them all). kLanes (and the macro VLMSERVE_VEC_LANES) is 0
// where neither is available: the kernels then take their scalar loops, or say they
// cannot run.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <type_traits>
#include <vector>

namespace vlmserve_vec {

// std::allocator on 64-byte (cache line) boundaries: an AMX tile's 64-byte rows that start
// off a line take two lines each, and tile loads from such buffers ran about 3x slower on
// an AMX Xeon (std::vector's memory is 16-byte aligned).
template <typename T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(std::size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
  }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const LineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAllocator<U>&) const { return false; }  // C++17 asks for both
};
template <typename T>
using LineVector = std::vector<T, LineAllocator<T>>;

#if defined(__AVX512F__)

#define VLMSERVE_VEC_LANES 16
constexpr int kLanes = 16;
using vfloat = __m512;
using vmask = __mmask16;  // one bit a lane

inline vfloat load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, vfloat v) { _mm512_storeu_ps(p, v); }
inline vfloat set1(float x) { return _mm512_set1_ps(x); }
inline vfloat zero() { return _mm512_setzero_ps(); }
inline vfloat add(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
inline vfloat sub(vfloat a, vfloat b) { return _mm512_sub_ps(a, b); }
inline vfloat mul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
inline vfloat div(vfloat a, vfloat b) { return _mm512_div_ps(a, b); }
inline vfloat max(vfloat a, vfloat b) { return _mm512_max_ps(a, b); }
inline vfloat min(vfloat a, vfloat b) { return _mm512_min_ps(a, b); }
inline vfloat fmadd(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
inline vfloat fnmadd(vfloat a, vfloat b, vfloat c) { return _mm512_fnmadd_ps(a, b, c); }
inline float reduce_add(vfloat v) { return _mm512_reduce_add_ps(v); }
inline float reduce_max(vfloat v) { return _mm512_reduce_max_ps(v); }
inline vfloat round(vfloat x) {
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
// y * 2^n for integral n in [-126, 127].
inline vfloat scale2(vfloat y, vfloat n) { return _mm512_scalef_ps(y, n); }

// The first n lanes (all of them for n >= kLanes, none for n <= 0).
inline vmask first_lanes(int64_t n) {
  return n >= 16 ? static_cast<vmask>(0xFFFF)
                 : static_cast<vmask>(n <= 0 ? 0u : (1u << n) - 1);
}
inline vmask all_lanes() { return static_cast<vmask>(0xFFFF); }
// Lanes where x <= p[lane].
inline vmask le(int32_t x, const int32_t* p) {
  return _mm512_cmple_epi32_mask(_mm512_set1_epi32(x), _mm512_loadu_si512(p));
}
inline vfloat maskz_load(vmask m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
inline void mask_store(float* p, vmask m, vfloat v) { _mm512_mask_storeu_ps(p, m, v); }
inline vfloat maskz(vmask m, vfloat v) { return _mm512_maskz_mov_ps(m, v); }
// max(a, b) in the lanes of m, a elsewhere.
inline vfloat mask_max(vfloat a, vmask m, vfloat b) { return _mm512_mask_max_ps(a, m, a, b); }

// kLanes bfloat16 values (raw bits) widened to float32: exact.
inline vfloat load_bf16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// v rounded to bfloat16 (to nearest even; NaN stays NaN), kept as float32.
inline vfloat round_bf16(vfloat v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_and_si512(
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))),
      _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(
      r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000)));
}
// float32 -> bfloat16 bits, rounded to nearest even (NaN stays NaN).
inline void store_bf16(uint16_t* p, vfloat v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#else
  const __m512i r = _mm512_srli_epi32(_mm512_castps_si512(round_bf16(v)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
#endif
}

#elif defined(__AVX2__) && defined(__FMA__)

#define VLMSERVE_VEC_LANES 8
constexpr int kLanes = 8;
using vfloat = __m256;
using vmask = __m256;  // all bits set in a lane that is in

inline vfloat load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, vfloat v) { _mm256_storeu_ps(p, v); }
inline vfloat set1(float x) { return _mm256_set1_ps(x); }
inline vfloat zero() { return _mm256_setzero_ps(); }
inline vfloat add(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
inline vfloat sub(vfloat a, vfloat b) { return _mm256_sub_ps(a, b); }
inline vfloat mul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
inline vfloat div(vfloat a, vfloat b) { return _mm256_div_ps(a, b); }
inline vfloat max(vfloat a, vfloat b) { return _mm256_max_ps(a, b); }
inline vfloat min(vfloat a, vfloat b) { return _mm256_min_ps(a, b); }
inline vfloat fmadd(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
inline vfloat fnmadd(vfloat a, vfloat b, vfloat c) { return _mm256_fnmadd_ps(a, b, c); }
inline float reduce_add(vfloat v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float reduce_max(vfloat v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vfloat round(vfloat x) {
  return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
// y * 2^n for integral n in [-126, 127]: 2^n built from its exponent bits.
inline vfloat scale2(vfloat y, vfloat n) {
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

inline vmask first_lanes(int64_t n) {
  const int32_t k = n >= 8 ? 8 : (n <= 0 ? 0 : static_cast<int32_t>(n));
  return _mm256_castsi256_ps(
      _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}
inline vmask all_lanes() { return _mm256_castsi256_ps(_mm256_set1_epi32(-1)); }
// Lanes where x <= p[lane], i.e. p[lane] > x - 1 (x >= 0 here: no overflow).
inline vmask le(int32_t x, const int32_t* p) {
  const __m256i pos = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(pos, _mm256_set1_epi32(x - 1)));
}
inline vfloat maskz_load(vmask m, const float* p) {
  return _mm256_maskload_ps(p, _mm256_castps_si256(m));
}
inline void mask_store(float* p, vmask m, vfloat v) {
  _mm256_maskstore_ps(p, _mm256_castps_si256(m), v);
}
inline vfloat maskz(vmask m, vfloat v) { return _mm256_and_ps(m, v); }
inline vfloat mask_max(vfloat a, vmask m, vfloat b) {
  return _mm256_blendv_ps(a, _mm256_max_ps(a, b), m);
}

// kLanes bfloat16 values (raw bits) widened to float32: exact.
inline vfloat load_bf16(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
// v rounded to bfloat16 (to nearest even; NaN stays NaN), kept as float32.
inline vfloat round_bf16(vfloat v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(
      _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))),
      _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_castsi256_ps(_mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), nan));
}
// float32 -> bfloat16 bits, rounded to nearest even (NaN stays NaN).
inline void store_bf16(uint16_t* p, vfloat v) {
  const __m256i r = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(v)), 16);
  // 32-bit lanes -> 16-bit: packus works per 128-bit half, so put the halves back in order
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

#else

#define VLMSERVE_VEC_LANES 0
constexpr int kLanes = 0;

#endif

#if VLMSERVE_VEC_LANES

// The first n < kLanes bfloat16 values (zeros past them), and their store: the tails.
inline vfloat load_bf16_first(const uint16_t* p, int64_t n) {
  alignas(64) uint16_t tmp[kLanes] = {};
  for (int64_t i = 0; i < n; ++i) tmp[i] = p[i];
  return load_bf16(tmp);
}
inline void store_bf16_first(uint16_t* p, vfloat v, int64_t n) {
  alignas(64) uint16_t tmp[kLanes];
  store_bf16(tmp, v);
  for (int64_t i = 0; i < n; ++i) p[i] = tmp[i];
}

// e^x a vector at a time, Cephes' single-precision expf (about 1 ulp): x = n ln2 + r,
// |r| <= ln2 / 2, a degree-6 polynomial for e^r, scaled by 2^n. Saturates outside
// [-87.3, 88.3] (below: ~0).
inline vfloat exp_ps(vfloat x) {
  x = min(max(x, set1(-87.3f)), set1(88.3f));
  const vfloat n = round(mul(x, set1(1.44269504088896341f)));
  vfloat r = fnmadd(n, set1(0.693359375f), x);
  r = fnmadd(n, set1(-2.12194440e-4f), r);
  vfloat y = set1(1.9875691500e-4f);
  y = fmadd(y, r, set1(1.3981999507e-3f));
  y = fmadd(y, r, set1(8.3334519073e-3f));
  y = fmadd(y, r, set1(4.1665795894e-2f));
  y = fmadd(y, r, set1(1.6666665459e-1f));
  y = fmadd(y, r, set1(5.0000001201e-1f));
  y = fmadd(y, mul(r, r), add(r, set1(1.f)));
  return scale2(y, n);
}

// 2^x with x <= 0 (scores minus their running max, in base-2 units): x = n + f, |f| <= 1/2,
// 2^f by its degree-6 Taylor polynomial (relative error ~1e-7), scaled by 2^n. Cheaper
// than a natural exp where the log2(e) factor can be folded into a scale before.
inline vfloat exp2_neg_ps(vfloat x) {
  x = max(x, set1(-126.f));  // 2^-126: the smallest normal float
  const vfloat n = round(x);
  const vfloat f = sub(x, n);
  vfloat y = set1(1.5403530393e-4f);
  y = fmadd(y, f, set1(1.3333558147e-3f));
  y = fmadd(y, f, set1(9.6181291076e-3f));
  y = fmadd(y, f, set1(5.5504108665e-2f));
  y = fmadd(y, f, set1(2.4022650696e-1f));
  y = fmadd(y, f, set1(6.9314718056e-1f));
  y = fmadd(y, f, set1(1.f));
  return scale2(y, n);
}

#endif

// dst[i] = the float32 value of the bfloat16 bits src[i] for i < n (a shift: exact), a
// vector at a time.
inline void widen_bf16(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if VLMSERVE_VEC_LANES
  for (; i + kLanes <= n; i += kLanes) store(dst + i, load_bf16(src + i));
#endif
  for (; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &bits, sizeof(bits));
  }
}

// Calls f(std::integral_constant<int, n>{}) for a runtime 1 <= n <= Max: the micro-kernels'
// tails, one instantiation per size.
template <int Max, typename F>
inline void with_size(int64_t n, F&& f) {
  if (n == Max) return f(std::integral_constant<int, Max>{});
  if constexpr (Max > 1) with_size<Max - 1>(n, static_cast<F&&>(f));
}

}  // namespace vlmserve_vec
