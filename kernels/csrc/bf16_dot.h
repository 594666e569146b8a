// bfloat16 pair dot products (AVX-512 BF16's vdpbf16ps) for the attention kernels in this
// folder: each float32 lane accumulates a[2i] * b[2i] + a[2i + 1] * b[2i + 1], two
// bfloat16 products per lane and instruction, float32 accumulation, so a bfloat16 matrix
// product runs at twice the FMAs' rate. Operands are 32-bit lanes holding a pair of
// bfloat16 values (the first in the low half), the pair running along the summed index:
// two consecutive head dims of a query or key, or two consecutive keys' probabilities and
// values. kBf16Dot (and VLMSERVE_BF16_DOT) is false where the CPU lacks the instruction (the kernels then widen to
// float32 and use FMAs).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace vlmserve_bf16 {

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define VLMSERVE_BF16_DOT 1
constexpr bool kBf16Dot = true;

using vpair = __m512i;  // 16 lanes of bfloat16 pairs

inline __m512 dot(__m512 acc, vpair a, vpair b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}
inline vpair load(const uint32_t* p) { return _mm512_loadu_si512(p); }
inline void store(uint32_t* p, vpair v) { _mm512_storeu_si512(p, v); }
// The pair `bits` (first value in the low half) in every lane.
inline vpair set1(uint32_t bits) { return _mm512_set1_epi32(static_cast<int32_t>(bits)); }
// The pair p[0], p[1] in every lane.
inline vpair broadcast(const uint16_t* p) {
  int32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return _mm512_set1_epi32(bits);
}
// Lane i: (a[i], b[i]) for the first n <= 16 bfloat16 values of each (raw bits), zero pairs
// past n (nothing past a[n - 1] or b[n - 1] is read).
inline vpair interleave(const uint16_t* a, const uint16_t* b, int64_t n = 16) {
  const __mmask16 m = n >= 16 ? static_cast<__mmask16>(0xFFFF)
                              : static_cast<__mmask16>((1u << n) - 1);
  const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, a));
  const __m512i hi = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, b));
  return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}
// Lane i: (a[i], b[i]) rounded to bfloat16 (nearest even).
inline vpair round_interleave(__m512 a, __m512 b) {
  const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a));
  const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(b));
  return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}
#else
#define VLMSERVE_BF16_DOT 0
constexpr bool kBf16Dot = false;
#endif

}  // namespace vlmserve_bf16
