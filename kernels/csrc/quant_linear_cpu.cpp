// Linear layers on weights stored as GGUF blocks (Q4_0, Q5_0, Q8_0, Q4_K, Q6_K), on the CPU.
// Registered as torch.ops.vlmserve_quant.*; kernels/quant_linear.py builds it on first use.
//
// - dequantize: rows of blocks -> float32 (or bfloat16: that float32 rounded to nearest
//   even), bit-identical to gguf.quants.dequantize: the same float32 operations in the
//   same order (-ffp-contract=off: no fused multiply-add the source does not write).
// - linear: out[m, n] = sum_k x[m, k] W[n, k] (+ bias[n]) for a few rows of x, as
//   llama.cpp's CPU backend does it: each row of x quantized once a call to int8 (a float
//   scale per 32 values for the legacy blocks, Q8_0-style; per 256 with the sums of each
//   16 for the K-quants, Q8_K-style), then integer dot products per weight block
//   (int32, exact), scaled and summed in float32 across blocks. Unsigned weight codes
//   times signed activations: AVX-512 VNNI / AVX-VNNI `dpbusd` (4 products a 32-bit lane),
//   AVX2 `maddubs` + `madd`, or scalar loops (`isa` picks one at run time, for tests).
//   Codes stored with an offset (Q4_0's q - 8, Q5_0's q - 16, Q6_K's q - 32) are
//   multiplied unsigned and the offset times the activation block's sum subtracted in
//   int32; Q8_0's signed codes take the sign trick (|w| times x with w's sign); Q4_K's
//   mins come from the activation's per-16 sums. Each thread takes a share of the weight's
//   rows; each weight block is unpacked once and used for every row of x.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include "amx.h"
#include "vec.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <vector>

// AVX-512 with its bfloat16 conversions: a row decodes straight to bfloat16 (AMX CPUs have
// them all, as do Zen 4 and 5).
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX2__)
#define VLMSERVE_DEQUANT_BF16 1
#else
#define VLMSERVE_DEQUANT_BF16 0
#endif

namespace {

enum QType : int64_t { Q4_0 = 2, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };
// Q8_0 with its rows repacked 16 at a time for the AVX-512 VNNI kernel (`pack_rows`): rows
// [0, N / 16 * 16) in tiles, tile t holding rows 16t .. 16t + 15 in their 16 * row_bytes
// bytes as the nb blocks' 16 float16 scales (row i's at 2i), then per block 8 vectors of
// 64 bytes, vector g's 32-bit lane i codes 4g .. 4g + 3 of row i as w + 128 (unsigned);
// the rows after the last whole tile as stored. Same bytes, same size; the other paths read
// a row back through `RowReader`.
constexpr int64_t kTiled = 1000;  // a packed block type's name: kTiled + the stored one's
constexpr int64_t Q8_0_X16 = kTiled + Q8_0;
// Q5_0 likewise (`Q5_0_X16`), a block of the 16 rows as their 16 float16 scales, their
// fifth bits (row i's 32-bit word at 4i, as stored), then 4 vectors of 64 bytes, vector h's
// lane i byte c holding the low 4 bits of codes 8h + c (low nibble) and 8h + 4 + c (high);
// the fifth bits are put back per vector of codes by a bit shuffle (AVX-512 BITALG).
constexpr int64_t Q5_0_X16 = kTiled + Q5_0;
enum Isa : int64_t { SCALAR = 0, AVX2 = 1, AVX_VNNI = 2, AVX512_VNNI = 3 };

struct Layout {
  int64_t block, bytes;  // values a block, bytes a block
};
Layout layout(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return {32, 18};
    case Q5_0:
    case Q5_0_X16: return {32, 22};
    case Q8_0:
    case Q8_0_X16: return {32, 34};
    case Q4_K: return {256, 144};
    case Q6_K: return {256, 210};
    default: TORCH_CHECK(false, "quantized linear: unsupported block type ", qtype);
  }
}
inline bool is_k(int64_t qtype) { return qtype == Q4_K || qtype == Q6_K; }

// The two-halves 8 x 8 transpose of 32-bit words: z[j]'s lane i (i < 8) becomes out[i]'s
// lane j, and lane 8 + i out[i]'s lane 8 + j. It packs a Q8_0_X16 block (z[i]: rows i and
// i + 8, out[g]: their words g) and, being its own inverse, unpacks it.
#if defined(__AVX512F__) && defined(__AVX512BW__)
inline void transpose_halves(const __m512i* z, __m512i* out) {
  __m512i u[8], v[8];
  for (int i = 0; i < 8; i += 2) {
    u[i] = _mm512_unpacklo_epi32(z[i], z[i + 1]);
    u[i + 1] = _mm512_unpackhi_epi32(z[i], z[i + 1]);
  }
  for (int q = 0; q < 8; q += 4) {  // v[q + j]: rows q .. q + 3, words j (and j + 4, 128 bits up)
    v[q] = _mm512_unpacklo_epi64(u[q], u[q + 2]);
    v[q + 1] = _mm512_unpackhi_epi64(u[q], u[q + 2]);
    v[q + 2] = _mm512_unpacklo_epi64(u[q + 1], u[q + 3]);
    v[q + 3] = _mm512_unpackhi_epi64(u[q + 1], u[q + 3]);
  }
  const __m512i low = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0);
  const __m512i high = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
  for (int j = 0; j < 4; ++j) {
    out[j] = _mm512_permutex2var_epi64(v[j], low, v[4 + j]);
    out[j + 4] = _mm512_permutex2var_epi64(v[j], high, v[4 + j]);
  }
}
#endif

// 16 rows of Q8_0 blocks (row_bytes apart) -> a Q8_0_X16 tile of nb blocks, and back.
inline void q8_pack_tile(const uint8_t* rows, int64_t row_bytes, int64_t nb, uint8_t* tile) {
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* blk = tile + b * 544;
    for (int64_t i = 0; i < 16; ++i) std::memcpy(blk + 2 * i, rows + i * row_bytes + b * 34, 2);
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512i z[8], t[8];
    for (int i = 0; i < 8; ++i) {
      const uint8_t* lo = rows + i * row_bytes + b * 34 + 2;
      z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo))),
                                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + 8 * row_bytes)), 1);
    }
    transpose_halves(z, t);
    for (int g = 0; g < 8; ++g)
      _mm512_storeu_si512(blk + 32 + 64 * g, _mm512_xor_si512(t[g], _mm512_set1_epi8(static_cast<char>(0x80))));
#else
    for (int64_t i = 0; i < 16; ++i)
      for (int64_t k = 0; k < 32; ++k)
        blk[32 + 64 * (k / 4) + 4 * i + k % 4] = rows[i * row_bytes + b * 34 + 2 + k] ^ 0x80;
#endif
  }
}

inline void q8_unpack_tile(const uint8_t* tile, int64_t nb, uint8_t* rows, int64_t row_bytes) {
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = tile + b * 544;
    for (int64_t i = 0; i < 16; ++i) std::memcpy(rows + i * row_bytes + b * 34, blk + 2 * i, 2);
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512i z[8], t[8];
    for (int g = 0; g < 8; ++g) z[g] = _mm512_loadu_si512(blk + 32 + 64 * g);
    transpose_halves(z, t);
    for (int i = 0; i < 8; ++i) {
      const __m512i codes = _mm512_xor_si512(t[i], _mm512_set1_epi8(static_cast<char>(0x80)));
      uint8_t* lo = rows + i * row_bytes + b * 34 + 2;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), _mm512_castsi512_si256(codes));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + 8 * row_bytes), _mm512_extracti64x4_epi64(codes, 1));
    }
#else
    for (int64_t i = 0; i < 16; ++i)
      for (int64_t k = 0; k < 32; ++k)
        rows[i * row_bytes + b * 34 + 2 + k] = blk[32 + 64 * (k / 4) + 4 * i + k % 4] ^ 0x80;
#endif
  }
}

// 16 rows of Q5_0 blocks (row_bytes apart) -> a Q5_0_X16 tile of nb blocks (at load, byte
// by byte), and back (for the paths other than the int-dot kernel's).
inline int q5_nibble(const uint8_t* qs, int k) { return k < 16 ? qs[k] & 15 : qs[k - 16] >> 4; }

inline void q5_pack_tile(const uint8_t* rows, int64_t row_bytes, int64_t nb, uint8_t* tile) {
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* blk = tile + b * 352;
    for (int64_t i = 0; i < 16; ++i) {
      const uint8_t* src = rows + i * row_bytes + b * 22;
      std::memcpy(blk + 2 * i, src, 2);
      std::memcpy(blk + 32 + 4 * i, src + 2, 4);
      for (int h = 0; h < 4; ++h)
        for (int c = 0; c < 4; ++c)
          blk[96 + 64 * h + 4 * i + c] =
              static_cast<uint8_t>(q5_nibble(src + 6, 8 * h + c) | q5_nibble(src + 6, 8 * h + 4 + c) << 4);
    }
  }
}

inline void q5_unpack_tile(const uint8_t* tile, int64_t nb, uint8_t* rows, int64_t row_bytes) {
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = tile + b * 352;
    for (int64_t i = 0; i < 16; ++i) {
      uint8_t* dst = rows + i * row_bytes + b * 22;
      std::memcpy(dst, blk + 2 * i, 2);
      std::memcpy(dst + 2, blk + 32 + 4 * i, 4);
#if defined(__SSE2__)
      // row i's 4 words: byte 4h + c holds codes 8h + c (low) and 8h + 4 + c (high), so
      // the low and high nibbles' words interleaved are codes 0-15 and 16-31 in order
      int32_t word[4];
      for (int h = 0; h < 4; ++h) std::memcpy(word + h, blk + 96 + 64 * h + 4 * i, 4);
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(word));
      const __m128i low = _mm_set1_epi8(15);
      const __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
      const __m128i first = _mm_unpacklo_epi32(lo, hi), last = _mm_unpackhi_epi32(lo, hi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 6), _mm_or_si128(first, _mm_slli_epi16(last, 4)));
#else
      uint8_t nib[32];
      for (int h = 0; h < 4; ++h)
        for (int c = 0; c < 4; ++c) {
          const uint8_t v = blk[96 + 64 * h + 4 * i + c];
          nib[8 * h + c] = v & 15, nib[8 * h + 4 + c] = v >> 4;
        }
      for (int j = 0; j < 16; ++j) dst[6 + j] = static_cast<uint8_t>(nib[j] | nib[j + 16] << 4);
#endif
    }
  }
}

inline void pack_tile(int64_t qtype, const uint8_t* rows, int64_t row_bytes, int64_t nb, uint8_t* tile) {
  qtype == Q8_0 ? q8_pack_tile(rows, row_bytes, nb, tile) : q5_pack_tile(rows, row_bytes, nb, tile);
}
inline void unpack_tile(int64_t qtype, const uint8_t* tile, int64_t nb, uint8_t* rows, int64_t row_bytes) {
  qtype == Q8_0 ? q8_unpack_tile(tile, nb, rows, row_bytes) : q5_unpack_tile(tile, nb, rows, row_bytes);
}

// A weight's rows in their stored layout: in place, or (a tiled weight's tiled rows, of
// block type `qtype`) from their tile unpacked into a buffer of 16 rows, a tile at a time
// (each thread its own reader).
class RowReader {
 public:
  RowReader(const uint8_t* w, int64_t N, int64_t row_bytes, bool tiled, int64_t qtype)
      : w_(w), tiled_rows_(tiled ? N / 16 * 16 : 0), row_bytes_(row_bytes), qtype_(qtype),
        buffer_(tiled ? 16 * row_bytes : 0) {}
  const uint8_t* row(int64_t n) {
    if (n >= tiled_rows_) return w_ + n * row_bytes_;
    if (n / 16 != tile_) {
      tile_ = n / 16;
      const int64_t nb = row_bytes_ / layout(qtype_).bytes;
      unpack_tile(qtype_, w_ + tile_ * 16 * row_bytes_, nb, buffer_.data(), row_bytes_);
    }
    return buffer_.data() + n % 16 * row_bytes_;
  }

 private:
  const uint8_t* w_;
  int64_t tiled_rows_, row_bytes_, qtype_, tile_ = -1;
  std::vector<uint8_t> buffer_;
};

// A kernel's block type and whether its rows are tiled: Q8_0_X16 -> (Q8_0, true).
inline bool untiled_qtype(int64_t& qtype) {
  if (qtype != Q8_0_X16 && qtype != Q5_0_X16) return false;
  qtype -= kTiled;
  return true;
}

// Whether the int-dot kernel runs `qtype` (Q8_0, Q5_0) packed in this build.
bool packable(int64_t qtype) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#if defined(__AVX512BITALG__)
  if (qtype == Q5_0) return true;
#endif
  return qtype == Q8_0;
#else
  return false;
#endif
}

// In place, every whole tile of 16 rows of a Q8_0 or Q5_0 weight [N, row_bytes] (pack) or back.
void repack(const at::Tensor& blocks, int64_t qtype, bool pack) {
  TORCH_CHECK(qtype == Q8_0 || qtype == Q5_0, "repack: Q8_0 or Q5_0, not ", qtype);
  const int64_t bytes = layout(qtype).bytes;
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
                  blocks.size(1) % bytes == 0, "repack: contiguous uint8 [rows, block bytes]");
  const int64_t row_bytes = blocks.size(1), nb = row_bytes / bytes;
  uint8_t* w = blocks.data_ptr<uint8_t>();
  at::parallel_for(0, blocks.size(0) / 16, 64, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> tmp(16 * row_bytes);
    for (int64_t t = begin; t < end; ++t) {
      uint8_t* tile = w + t * 16 * row_bytes;
      if (pack)
        pack_tile(qtype, tile, row_bytes, nb, tmp.data());
      else
        unpack_tile(qtype, tile, nb, tmp.data(), row_bytes);
      std::memcpy(tile, tmp.data(), tmp.size());
    }
  });
}
void pack_rows(const at::Tensor& blocks, int64_t qtype) { repack(blocks, qtype, true); }
void unpack_rows(const at::Tensor& blocks, int64_t qtype) { repack(blocks, qtype, false); }

inline float f16(const uint8_t* p) {  // exact
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// Q4_K's 6-bit scales and mins of its 8 sub-blocks, packed in 12 bytes (gguf's
// Q4_K.get_scale_min).
inline void k4_scales(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 2) & 0x30);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
  }
}

// -- dequantization: one block -> float32, as gguf's numpy decoders compute it -------------

void dequant_block(int64_t qtype, const uint8_t* b, float* y) {
  switch (qtype) {
    case Q4_0: {  // d * (q - 8)
      const float d = f16(b);
      for (int j = 0; j < 16; ++j) {
        y[j] = d * static_cast<float>((b[2 + j] & 15) - 8);
        y[j + 16] = d * static_cast<float>((b[2 + j] >> 4) - 8);
      }
      break;
    }
    case Q5_0: {  // d * (q - 16), q's fifth bit from the 32-bit word qh
      const float d = f16(b);
      uint32_t qh;
      std::memcpy(&qh, b + 2, 4);
      const uint8_t* qs = b + 6;
      for (int j = 0; j < 16; ++j) {
        const int lo = (qs[j] & 15) | (((qh >> j) & 1) << 4);
        const int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        y[j] = d * static_cast<float>(lo - 16);
        y[j + 16] = d * static_cast<float>(hi - 16);
      }
      break;
    }
    case Q8_0: {  // q * d
      const float d = f16(b);
      for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(static_cast<int8_t>(b[2 + j])) * d;
      break;
    }
    case Q4_K: {  // (d * sc) * q - (dmin * m) per sub-block of 32
      const float d = f16(b), dmin = f16(b + 2);
      uint8_t sc[8], mn[8];
      k4_scales(b + 4, sc, mn);
      const uint8_t* qs = b + 16;
      for (int j = 0; j < 8; ++j) {
        const float ds = d * static_cast<float>(sc[j]);
        const float dm = dmin * static_cast<float>(mn[j]);
        const uint8_t* q = qs + 32 * (j / 2);
        const int shift = 4 * (j % 2);
        for (int l = 0; l < 32; ++l) {
          const float prod = ds * static_cast<float>((q[l] >> shift) & 15);
          y[32 * j + l] = prod - dm;
        }
      }
      break;
    }
    case Q6_K: {  // (d * sc) * (q - 32) per 16, q: 4 low bits from ql, 2 high from qh
      const uint8_t *ql = b, *qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = f16(b + 208);
      for (int i = 0; i < 256; ++i) {
        const int h = i / 128, e = i % 128, k = e / 32;
        const uint8_t lb = ql[h * 64 + e % 64];
        const int lo = e < 64 ? (lb & 15) : (lb >> 4);
        const int hi = (qh[h * 32 + e % 32] >> (2 * k)) & 3;
        y[i] = (d * static_cast<float>(sc[i / 16])) * static_cast<float>((lo | (hi << 4)) - 32);
      }
      break;
    }
    default: TORCH_CHECK(false, "unsupported block type ", qtype);
  }
}

// A row's K values from its blocks, as dequant_block computes them (vectorized with AVX2),
// and float32 -> bfloat16 as at::BFloat16 rounds (to nearest even; a NaN to 0x7FC0).
void dequant_row(int64_t qtype, const uint8_t* src, int64_t K, float* y);
void round_bf16(const float* y, int64_t n, at::BFloat16* out);
#if VLMSERVE_DEQUANT_BF16
void dequant_row_bf16(int64_t qtype, const uint8_t* src, int64_t K, at::BFloat16* out);
#endif

template <typename T>
void dequant_rows(T* out, const uint8_t* blocks, int64_t N, int64_t row_bytes, const int64_t* index,
                  int64_t count, int64_t K, int64_t qtype) {
  const bool tiled = untiled_qtype(qtype);
  at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(std::is_same_v<T, float> || VLMSERVE_DEQUANT_BF16 ? 0 : K);  // round_bf16's
    RowReader reader(blocks, N, row_bytes, tiled, qtype);
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* src = reader.row(index ? index[r] : r);
      if constexpr (std::is_same_v<T, float>) {
        dequant_row(qtype, src, K, out + r * K);
      } else {
#if VLMSERVE_DEQUANT_BF16
        dequant_row_bf16(qtype, src, K, out + r * K);
#else
        dequant_row(qtype, src, K, row.data());
        round_bf16(row.data(), K, out + r * K);
#endif
      }
    }
  });
}

void dequantize(const at::Tensor& out, const at::Tensor& blocks, int64_t qtype,
                const c10::optional<at::Tensor>& rows) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "blocks: contiguous uint8 [rows, bytes]");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous(), "out: contiguous [rows, in]");
  const Layout lay = layout(qtype);
  const int64_t K = out.size(1), count = out.size(0);
  TORCH_CHECK(K % lay.block == 0 && blocks.size(1) == K / lay.block * lay.bytes,
              "blocks do not hold rows of ", K, " values");
  const int64_t* index = nullptr;
  if (rows.has_value()) {
    TORCH_CHECK(rows->scalar_type() == at::kLong && rows->is_contiguous() &&
                    rows->numel() == count, "rows: contiguous int64, one per output row");
    index = rows->data_ptr<int64_t>();
    for (int64_t r = 0; r < count; ++r)
      TORCH_CHECK(index[r] >= 0 && index[r] < blocks.size(0), "row index out of range");
  } else {
    TORCH_CHECK(count == blocks.size(0), "out: one row per weight row");
  }
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  if (out.scalar_type() == at::kFloat)
    dequant_rows(out.data_ptr<float>(), src, blocks.size(0), blocks.size(1), index, count, K, qtype);
  else if (out.scalar_type() == at::kBFloat16)
    dequant_rows(out.data_ptr<at::BFloat16>(), src, blocks.size(0), blocks.size(1), index, count, K,
                 qtype);
  else
    TORCH_CHECK(false, "dequantize: float32 or bfloat16 out");
}

// -- the activations, quantized once a call -------------------------------------------------

// x's rows as int8 with a float32 scale per `group` values (32, or 256 for the K-quants)
// and, per 16 values, their sum times `offset` (the legacy blocks' weight offset: Q4_0 8,
// Q5_0 16, Q8_0 0, folded into the block's integer sum) or, for the K-quants, their sum.
struct QuantRows {
  int64_t M, K, group;
  std::vector<int8_t> q;      // [M, K]
  std::vector<float> scale;   // [M, K / group]
  std::vector<int32_t> sums;  // [M, K / 16] (K-quants) or [M, K / 32] (offset * sum)
  std::vector<int16_t> sums16;  // K-quants: the same sums as int16 (|sum| <= 16 * 127)
  // The legacy blocks: per block 8 int32 lanes, the first -offset * sum (the unsigned
  // codes' offset: Q4_0 8, Q5_0 16, Q8_0 128 as w + 128), the others 0: the integer dot
  // product's starting value (one load); and 8 lanes of the block's scale (a vector operand).
  std::vector<int32_t> start;
  std::vector<float> scale8;
  // Q4_0 / Q5_0 on AVX-512 VNNI (`grouped`): x four blocks at a time as the codes unpack,
  // per group of 4 blocks 64 bytes of each block's first 16 values, then 64 of its last
  // 16; per group 16 int32 lanes (a block's 4: -offset * sum, 0, 0, 0) and 16 float32
  // lanes (the block's scale 4 times). A last group of fewer blocks is padded with zeros.
  int64_t groups = 0;
  std::vector<int8_t> xg;      // [M, groups * 128]
  std::vector<int32_t> start4; // [M, groups * 16]
  std::vector<float> scale4;   // [M, groups * 16]
  // Q4_K at one row of x on AVX-512 VNNI: x's 32-value sub-blocks in the order 0, 2, 1, 3,
  // 4, 6, 5, 7 of each 256 (as dot_rows_k512 unpacks the codes).
  std::vector<int8_t> xk;      // [M, K]
};

template <typename T>
QuantRows quantize_rows(const T* x, int64_t xs, int64_t M, int64_t K, int64_t qtype,
                        bool grouped, bool k_grouped) {
  const bool k = is_k(qtype);
  const int64_t group = k ? 256 : 32;
  const int32_t offset = qtype == Q4_0 ? 8 : qtype == Q5_0 ? 16 : 0;
  QuantRows r{M, K, group, std::vector<int8_t>(M * K), std::vector<float>(M * K / group),
              std::vector<int32_t>(M * K / (k ? 16 : 32)), std::vector<int16_t>(k ? M * K / 16 : 0),
              std::vector<int32_t>(k ? 0 : M * K / 32 * 8), std::vector<float>(k ? 0 : M * K / 32 * 8)};
  const int32_t start_offset = qtype == Q8_0 ? 128 : offset;
  if (grouped) {
    r.groups = (K / 32 + 3) / 4;
    r.xg.assign(M * r.groups * 128, 0);
    r.start4.assign(M * r.groups * 16, 0);
    r.scale4.assign(M * r.groups * 16, 0.f);
  }
  if (k_grouped) r.xk.resize(M * K);
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> v(group);
    for (int64_t m = begin; m < end; ++m)
      for (int64_t g = 0; g < K / group; ++g) {
        float amax = 0.f;
        for (int64_t i = 0; i < group; ++i) {
          v[i] = static_cast<float>(x[m * xs + g * group + i]);
          amax = std::max(amax, std::fabs(v[i]));
        }
        const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
        r.scale[m * (K / group) + g] = d;
        int8_t* q = r.q.data() + m * K + g * group;
        for (int64_t i = 0; i < group; ++i) q[i] = static_cast<int8_t>(std::nearbyint(v[i] * id));
        for (int64_t s = 0; s < group / 16; ++s) {
          int32_t sum = 0;
          for (int i = 0; i < 16; ++i) sum += q[16 * s + i];
          if (k) r.sums[m * (K / 16) + g * 16 + s] = sum, r.sums16[m * (K / 16) + g * 16 + s] = sum;
          else r.sums[m * (K / 32) + g] += offset * sum;  // zeroed at construction
        }
        if (k_grouped)
          for (int j = 0; j < 8; ++j)  // sub-block j at position 0, 2, 1, 3, 4, 6, 5, 7
            std::memcpy(r.xk.data() + m * K + g * 256 + 32 * ((j / 4) * 4 + (j % 2) * 2 + (j % 4) / 2),
                        q + 32 * j, 32);
        if (!k) {
          int32_t sum = 0;
          for (int i = 0; i < 32; ++i) sum += q[i];
          r.start[(m * (K / 32) + g) * 8] = -start_offset * sum;
          for (int i = 0; i < 8; ++i) r.scale8[(m * (K / 32) + g) * 8 + i] = d;
          if (grouped) {
            const int64_t at = m * r.groups + g / 4, lane = g % 4;
            std::memcpy(r.xg.data() + at * 128 + 16 * lane, q, 16);
            std::memcpy(r.xg.data() + at * 128 + 64 + 16 * lane, q + 16, 16);
            r.start4[at * 16 + 4 * lane] = -offset * sum;
            for (int i = 0; i < 4; ++i) r.scale4[at * 16 + 4 * lane + i] = d;
          }
        }
      }
  });
  return r;
}

// -- the integer dot products ----------------------------------------------------------------

constexpr int64_t kRowChunk = 32;  // rows of x a pass over a weight row (their sums on the stack)
constexpr int64_t kRegRows = 4;    // rows of x whose accumulators stay in registers
constexpr int kWeightRows = 4;     // weight rows a pass over x (AVX-512 VNNI)
constexpr int kTileRows = 8;       // rows of x a pass over a packed tile (tile_rows)
// tile_rows's prefetch distance: a tile's compute (a fifth of its time at one row of x
// on a Zen 4) and its reads overlapped only from about 24 KB (8 and 16 KB: 10-20% slower).
constexpr int64_t kTileAhead = 24576;

// Software prefetch on a pass's first rows of x (a decode, or a decode and its drafts): the
// weight bytes kAheadBytes on from those being read are requested into L1 a share at a
// time. A pass over 4 weight rows covers a few hundred bytes to a few KB, and the weights
// of a layer a few hundred KB: streams too short for the hardware prefetcher to run ahead
// of. Without it (Gemma 3 270M's Q4_K_M decode step on a Zen 4) the layers' linears read
// their weights at about half the rate of a float32 sum over as many bytes, and the
// 262k-row LM head at about that rate; with it, the layers at 3/4 of it and the head above
// it. The distance is a latency-bandwidth product (2-8 KB measured alike for the layers, 8
// best for the head; 32 KB lost), not a crossover.
constexpr int64_t kAheadBytes = 8192;
struct Ahead {
  const char* p = nullptr;  // a cache line's start
  int64_t lines = 0;        // a step's share
  inline void step() {
    for (int64_t l = 0; l < lines; ++l) __builtin_prefetch(p + 64 * l, 0, 3);
    p += 64 * lines;
  }
};
// `bytes` from `next`, over `steps` steps.
inline Ahead ahead(const uint8_t* next, int64_t bytes, int64_t steps) {
  const auto at = reinterpret_cast<uintptr_t>(next);
  const int64_t lines = (static_cast<int64_t>(at % 64) + bytes + 63) / 64;
  return {reinterpret_cast<const char*>(at - at % 64), (lines + steps - 1) / steps};
}

int64_t best_isa() {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return AVX512_VNNI;
#elif defined(__AVXVNNI__)
  return AVX_VNNI;
#elif defined(__AVX2__)
  return AVX2;
#else
  return SCALAR;
#endif
}

// Whether this build has the int-dot path `isa` (AVX-VNNI, say, only where -march=native
// found it); an `isa` it lacks runs the best one below it.
bool has_isa(int64_t isa) {
  if (isa == AVX_VNNI) {
#if defined(__AVXVNNI__)
    return true;
#else
    return false;
#endif
  }
  return isa >= SCALAR && isa <= best_isa();
}

// A block's weight codes as stored, unsigned (Q8_0: signed), 32 or 256 of them.
void codes(int64_t qtype, const uint8_t* b, int32_t* q) {
  switch (qtype) {
    case Q4_0:
      for (int j = 0; j < 16; ++j) q[j] = b[2 + j] & 15, q[j + 16] = b[2 + j] >> 4;
      break;
    case Q5_0: {
      uint32_t qh;
      std::memcpy(&qh, b + 2, 4);
      for (int j = 0; j < 16; ++j) {
        q[j] = (b[6 + j] & 15) | (((qh >> j) & 1) << 4);
        q[j + 16] = (b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      }
      break;
    }
    case Q8_0:
      for (int j = 0; j < 32; ++j) q[j] = static_cast<int8_t>(b[2 + j]);
      break;
    case Q4_K:
      for (int j = 0; j < 8; ++j)
        for (int l = 0; l < 32; ++l) q[32 * j + l] = (b[16 + 32 * (j / 2) + l] >> (4 * (j % 2))) & 15;
      break;
    case Q6_K:
      for (int i = 0; i < 256; ++i) {
        const int h = i / 128, e = i % 128;
        const uint8_t lb = b[h * 64 + e % 64];
        const int hi = (b[128 + h * 32 + e % 32] >> (2 * (e / 32))) & 3;
        q[i] = (e < 64 ? (lb & 15) : (lb >> 4)) | (hi << 4);
      }
      break;
  }
}

// The scalar loops: rows [m0, m0 + rows) of xq against one weight row, into sums.
void dot_row_scalar(int64_t qtype, const uint8_t* w, int64_t K, const QuantRows& xq,
                    int64_t m0, int64_t rows, float* sums) {
  const Layout lay = layout(qtype);
  const int64_t nb = K / lay.block;
  int32_t q[256];
  for (int64_t r = 0; r < rows; ++r) sums[r] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * lay.bytes;
    codes(qtype, blk, q);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t m = m0 + r;
      const int8_t* x = xq.q.data() + m * K + b * lay.block;
      const float dx = xq.scale[m * nb + b];
      if (qtype == Q4_K) {
        uint8_t sc[8], mn[8];
        k4_scales(blk + 4, sc, mn);
        const int32_t* bs = xq.sums.data() + m * (K / 16) + b * 16;
        int32_t isum = 0, msum = 0;
        for (int j = 0; j < 8; ++j) {
          int32_t s = 0;
          for (int l = 0; l < 32; ++l) s += q[32 * j + l] * x[32 * j + l];
          isum += sc[j] * s;
          msum += mn[j] * (bs[2 * j] + bs[2 * j + 1]);
        }
        sums[r] += (f16(blk) * dx) * static_cast<float>(isum) -
                   (f16(blk + 2) * dx) * static_cast<float>(msum);
      } else if (qtype == Q6_K) {
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        const int32_t* bs = xq.sums.data() + m * (K / 16) + b * 16;
        int32_t isum = 0;
        for (int s = 0; s < 16; ++s) {
          int32_t t = 0;
          for (int l = 0; l < 16; ++l) t += q[16 * s + l] * x[16 * s + l];
          isum += sc[s] * (t - 32 * bs[s]);
        }
        sums[r] += (f16(blk + 208) * dx) * static_cast<float>(isum);
      } else {
        int32_t isum = -xq.sums[m * nb + b];
        for (int l = 0; l < 32; ++l) isum += q[l] * x[l];
        sums[r] += (f16(blk) * dx) * static_cast<float>(isum);
      }
    }
  }
}

#if defined(__AVX2__)

// acc + the sums of each 4 products u * s (u unsigned, s signed bytes), a 32-bit lane each.
template <int64_t ISA>
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  if constexpr (ISA == AVX512_VNNI) return _mm256_dpbusd_epi32(acc, u, s);
#endif
#if defined(__AVXVNNI__)
  if constexpr (ISA == AVX_VNNI) return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
  const __m256i pairs = _mm256_maddubs_epi16(u, s);  // no saturation: |u| <= 128, |s| <= 127
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// acc + the sums of each 2 products of 16-bit lanes a * b.
template <int64_t ISA>
inline __m256i dpwssd(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  if constexpr (ISA == AVX512_VNNI) return _mm256_dpwssd_epi32(acc, a, b);
#endif
#if defined(__AVXVNNI__)
  if constexpr (ISA == AVX_VNNI) return _mm256_dpwssd_avx_epi32(acc, a, b);
#endif
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
}

inline __m256 fmadd(__m256 a, __m256 b, __m256 c) {
#if defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);
#else
  return _mm256_add_ps(_mm256_mul_ps(a, b), c);
#endif
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i load32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// 16 bytes of nibble pairs -> 32 bytes: the low nibbles, then the high ones.
inline __m256i nibbles32(const uint8_t* p) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i shifted = _mm256_srlv_epi16(both, _mm256_setr_epi64x(0, 0, 0x0004000400040004, 0x0004000400040004));
  return _mm256_and_si256(shifted, _mm256_set1_epi8(15));
#else
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i low = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low), _mm_and_si128(q, low));
#endif
}

// codes | 16 in the bytes j where bit j of the 32-bit word at p is set (Q5_0's fifth bits).
inline __m256i with_fifth_bits(__m256i codes, const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm256_mask_add_epi8(codes, static_cast<__mmask32>(bits), codes, _mm256_set1_epi8(16));
#else
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i all_but = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);  // byte i: all bits but i
  const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, all_but), _mm256_set1_epi64x(-1));
  return _mm256_or_si256(codes, _mm256_and_si256(set, _mm256_set1_epi8(16)));
#endif
}

template <int64_t ISA, int R>
void dot_row_legacy(int64_t qtype, const uint8_t* w, int64_t K, const QuantRows& xq, int64_t m0,
                    float* sums) {
  const int64_t nb = K / 32, bytes = layout(qtype).bytes;
  __m256 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * bytes;
    const float d = f16(blk);
    if (qtype == Q8_0) {  // signed codes: |w| times x with w's sign
      const __m256i signs = load32(blk + 2);
      const __m256i u = _mm256_abs_epi8(signs);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t m = m0 + r;
        const __m256i x = _mm256_sign_epi8(load32(xq.q.data() + m * K + b * 32), signs);
        const __m256i dot = dpbusd<ISA>(_mm256_setzero_si256(), u, x);
        acc[r] = fmadd(_mm256_set1_ps(d * xq.scale[m * nb + b]), _mm256_cvtepi32_ps(dot), acc[r]);
      }
      continue;
    }
    // Q4_0 / Q5_0: the unsigned codes; the offset times x's sum starts the integer sum
    const __m256i u = qtype == Q4_0 ? nibbles32(blk + 2) : with_fifth_bits(nibbles32(blk + 6), blk + 2);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      const __m256i x = load32(xq.q.data() + m * K + b * 32);
      const __m256i dot = dpbusd<ISA>(load32(xq.start.data() + (m * nb + b) * 8), u, x);
      acc[r] = fmadd(_mm256_set1_ps(d * xq.scale[m * nb + b]), _mm256_cvtepi32_ps(dot), acc[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) sums[r] = hsum(acc[r]);
}

// Q4_K's 8 scales (bytes 0-7) and 8 mins (bytes 8-15) from its 12 packed bytes (as
// k4_scales, on 32-bit words).
inline void k4_scales_words(const uint8_t* s, uint32_t* out) {
  constexpr uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
  uint32_t u[3];
  std::memcpy(u, s, 12);
  out[0] = u[0] & k1;
  out[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
  out[2] = u[1] & k1;
  out[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
}

template <int64_t ISA, int R>
void dot_row_k(int64_t qtype, const uint8_t* w, int64_t K, const QuantRows& xq, int64_t m0,
               float* sums) {
  const int64_t nb = K / 256, bytes = layout(qtype).bytes;
  const __m256i low = _mm256_set1_epi8(15), two = _mm256_set1_epi8(3);
  __m256 acc[R], mins[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), mins[r] = _mm256_setzero_ps();
  alignas(32) int16_t sc16[16];
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * bytes;
    __m256i u[8], scale[8];  // 8 groups of 32 codes (unsigned), their 16-bit scales
    __m256i mins16 = _mm256_setzero_si256(), sc_all = _mm256_setzero_si256();
    float d, dmin = 0.f;
    if (qtype == Q4_K) {
      d = f16(blk), dmin = f16(blk + 2);
      alignas(16) uint32_t words[4];
      k4_scales_words(blk + 4, words);
      const __m128i both = _mm_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<__m128i*>(words)));
      _mm_store_si128(reinterpret_cast<__m128i*>(sc16), both);  // the 8 scales
      const __m128i mn = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<__m128i*>(words + 2)));
      // each min twice: it scales two of x's 16-sums
      mins16 = _mm256_set_m128i(_mm_unpackhi_epi16(mn, mn), _mm_unpacklo_epi16(mn, mn));
      for (int c = 0; c < 4; ++c) {
        const __m256i q = load32(blk + 16 + 32 * c);
        u[2 * c] = _mm256_and_si256(q, low);
        u[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
      }
      for (int j = 0; j < 8; ++j) scale[j] = _mm256_set1_epi16(sc16[j]);
    } else {  // Q6_K: 4 low bits from ql, 2 high ones from qh; a signed scale per 16
      d = f16(blk + 208);
      for (int h = 0; h < 2; ++h) {
        const __m256i l0 = load32(blk + 64 * h), l1 = load32(blk + 64 * h + 32);
        const __m256i hb = load32(blk + 128 + 32 * h);
        const __m256i lows[4] = {_mm256_and_si256(l0, low), _mm256_and_si256(l1, low),
                                 _mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                                 _mm256_and_si256(_mm256_srli_epi16(l1, 4), low)};
        for (int k = 0; k < 4; ++k) {
          const __m256i high = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * k), two);
          u[4 * h + k] = _mm256_or_si256(lows[k], _mm256_slli_epi16(high, 4));
        }
      }
      sc_all = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
      _mm256_store_si256(reinterpret_cast<__m256i*>(sc16), sc_all);
      for (int g = 0; g < 8; ++g)
        scale[g] = _mm256_set_m128i(_mm_set1_epi16(sc16[2 * g + 1]), _mm_set1_epi16(sc16[2 * g]));
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      const int8_t* x = xq.q.data() + m * K + b * 256;
      const __m256i bs = load32(xq.sums16.data() + m * (K / 16) + b * 16);  // x's 16-sums
      const float dx = xq.scale[m * nb + b];
      __m256i isum = _mm256_setzero_si256();
      for (int g = 0; g < 8; ++g)
        isum = dpwssd<ISA>(isum, _mm256_maddubs_epi16(u[g], load32(x + 32 * g)), scale[g]);
      if (qtype == Q6_K)  // the codes' offset: 32 * sum_s sc_s * (x's sum s)
        isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(_mm256_madd_epi16(sc_all, bs), 5));
      acc[r] = fmadd(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(isum), acc[r]);
      if (qtype == Q4_K)
        mins[r] = fmadd(_mm256_set1_ps(dmin * dx), _mm256_cvtepi32_ps(_mm256_madd_epi16(mins16, bs)),
                        mins[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) sums[r] = hsum(_mm256_sub_ps(acc[r], mins[r]));
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// The legacy blocks two at a time in 512-bit vectors (AVX-512 VNNI): unsigned codes (Q8_0's
// as w + 128), the offsets' sums as the dot product's start, the scales as vectors.
inline __m256i legacy_codes(int64_t qtype, const uint8_t* blk) {
  if (qtype == Q4_0) return nibbles32(blk + 2);
  if (qtype == Q5_0) return with_fifth_bits(nibbles32(blk + 6), blk + 2);
  return _mm256_xor_si256(load32(blk + 2), _mm256_set1_epi8(static_cast<char>(0x80)));
}

template <int R>
void dot_row_legacy512(int64_t qtype, const uint8_t* w, int64_t K, const QuantRows& xq,
                       int64_t m0, float* sums) {
  const int64_t nb = K / 32, bytes = layout(qtype).bytes;
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b += 2) {
    const bool pair = b + 1 < nb;
    const uint8_t* blk = w + b * bytes;
    const __m256i u0 = legacy_codes(qtype, blk);
    const __m256i u1 = pair ? legacy_codes(qtype, blk + bytes) : _mm256_setzero_si256();
    const __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(u0), u1, 1);
    const float d1 = pair ? f16(blk + bytes) : 0.f;
    const __m512 dv = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(f16(blk))),
                                         _mm256_set1_ps(d1), 1);
    const __mmask16 lanes = pair ? 0xFFFF : 0x00FF;  // a last odd block: its half only
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t i = (m0 + r) * nb + b;
      const __m512i x = _mm512_maskz_loadu_epi32(lanes, xq.q.data() + i * 32);
      const __m512i start = _mm512_maskz_loadu_epi32(lanes, xq.start.data() + i * 8);
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, u, x));
      const __m512 dx = _mm512_maskz_loadu_ps(lanes, xq.scale8.data() + i * 8);
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dot, dv), dx, acc[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) sums[r] = _mm512_reduce_add_ps(acc[r]);
}

// Q4_0 / Q5_0 four blocks at a time (x as quantize_rows groups it): the 4 blocks' 16 code
// bytes in one 512-bit vector, split into low and high nibbles (each block's first and last
// 16 codes), Q5_0's fifth bits added under two 64-bit masks, and the 4 blocks' scales
// widened from float16 together.
struct Group4 {
  __m512i lo, hi;  // codes, unsigned
  __m512 d;        // each block's scale in its 4 lanes
};

// The group of 4 blocks at p (`bytes` apart). Each block's first 8 bytes (its scale and,
// Q5_0, its fifth bits) are gathered in one vector and shuffled into the 4 scales, the
// fifth bits of the 4 blocks' first 16 codes and of their last 16 (64-bit masks).
template <int64_t QT>
inline Group4 group4(const uint8_t* p, int64_t bytes) {
  constexpr int64_t at = QT == Q5_0 ? 6 : 2;
  const __m512i low = _mm512_set1_epi8(15);
  __m512i q = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + at)));
  q = _mm512_inserti32x4(q, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + bytes + at)), 1);
  q = _mm512_inserti32x4(q, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * bytes + at)), 2);
  q = _mm512_inserti32x4(q, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 3 * bytes + at)), 3);
  Group4 g{_mm512_and_si512(q, low), _mm512_and_si512(_mm512_srli_epi16(q, 4), low), {}};
  // [block 0's bytes 0-7, block 1's | block 2's, block 3's]
  int64_t head[4];
  for (int j = 0; j < 4; ++j) std::memcpy(head + j, p + j * bytes, 8);
  const __m128i h01 = _mm_set_epi64x(head[1], head[0]), h23 = _mm_set_epi64x(head[3], head[2]);
  // per 128-bit lane: the 2 scales, the 2 first-16 masks, the 2 last-16 masks (2 bytes each)
  const __m256i picked = _mm256_shuffle_epi8(
      _mm256_set_m128i(h23, h01),
      _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, -1, -1, -1, -1,
                       0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, -1, -1, -1, -1));
  // dwords: [d01, d23, lo01, lo23, hi01, hi23, -, -]
  const __m256i packed = _mm256_permutevar8x32_epi32(picked, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  const __m128i first = _mm256_castsi256_si128(packed);
  if constexpr (QT == Q5_0) {
    const __m512i sixteen = _mm512_set1_epi8(16);
    const uint64_t mlo = static_cast<uint64_t>(_mm_extract_epi64(first, 1));
    const uint64_t mhi = static_cast<uint64_t>(_mm_cvtsi128_si64(_mm256_extracti128_si256(packed, 1)));
    g.lo = _mm512_mask_add_epi8(g.lo, mlo, g.lo, sixteen);
    g.hi = _mm512_mask_add_epi8(g.hi, mhi, g.hi, sixteen);
  }
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  g.d = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_cvtph_ps(first)));
  return g;
}

// NR weight rows (row_bytes apart) against R rows of x: sums[n * R + r]. Each group of x
// is loaded once for the NR weight rows. A last group of fewer than 4 blocks is read from
// a zero-padded copy (x's padding is zero too).
template <int64_t QT, int R, int NR>
void dot_rows_g4(const uint8_t* w, int64_t row_bytes, int64_t K,
                 const QuantRows& xq, int64_t m0, float* sums, Ahead next = {}) {
  constexpr int64_t bytes = QT == Q5_0 ? 22 : 18;
  const int64_t nb = K / 32, groups = xq.groups;
  __m512 acc[NR][R];
#pragma GCC unroll 16
  for (int n = 0; n < NR; ++n)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[n][r] = _mm512_setzero_ps();
  uint8_t padded[NR][4 * 22];
  for (int64_t g = 0; g < groups; ++g) {
    next.step();
    Group4 c[NR];
    const bool full = 4 * g + 4 <= nb;
#pragma GCC unroll 16
    for (int n = 0; n < NR; ++n) {
      const uint8_t* p = w + n * row_bytes + 4 * g * bytes;
      if (!full) {
        std::memset(padded[n], 0, sizeof(padded[n]));
        std::memcpy(padded[n], p, (nb - 4 * g) * bytes);
        p = padded[n];
      }
      c[n] = group4<QT>(p, bytes);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t i = (m0 + r) * groups + g;
      const int8_t* x = xq.xg.data() + i * 128;
      const __m512i start = _mm512_loadu_si512(xq.start4.data() + i * 16);
      const __m512i xlo = _mm512_loadu_si512(x), xhi = _mm512_loadu_si512(x + 64);
      const __m512 dx = _mm512_loadu_ps(xq.scale4.data() + i * 16);
#pragma GCC unroll 16
      for (int n = 0; n < NR; ++n) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start, c[n].lo, xlo), c[n].hi, xhi);
        acc[n][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(c[n].d, dx), acc[n][r]);
      }
    }
  }
#pragma GCC unroll 16
  for (int n = 0; n < NR; ++n)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) sums[n * R + r] = _mm512_reduce_add_ps(acc[n][r]);
}

// Q8_0 on AVX-512 VNNI: NR weight rows against R rows of x, two blocks a 512-bit vector (the
// codes as w + 128, unsigned; x's start lanes take off 128 times its block sums), each pair
// of x's blocks loaded once for the NR weight rows and each pair of weight blocks once for
// the R rows of x. A last odd block: its half of the lanes only. The 262k-row LM head and
// embedding of the real file are Q8_0: at one row of x one weight row a pass read them at
// about half the rate the bfloat16 head reads its bytes.
template <int R, int NR>
void dot_rows_q8(const uint8_t* w, int64_t row_bytes, int64_t K, const QuantRows& xq,
                 int64_t m0, float* sums, Ahead next = {}) {
  constexpr int64_t bytes = 34;
  const int64_t nb = K / 32;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  __m512 acc[NR][R];
#pragma GCC unroll 16
  for (int n = 0; n < NR; ++n)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[n][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b += 2) {
    next.step();
    const bool pair = b + 1 < nb;
    const __mmask16 lanes = pair ? 0xFFFF : 0x00FF;
    __m512i u[NR];
    __m512 d[NR];
#pragma GCC unroll 16
    for (int n = 0; n < NR; ++n) {
      const uint8_t* blk = w + n * row_bytes + b * bytes;
      uint16_t h[2] = {0, 0};
      std::memcpy(h, blk, 2);
      __m256i hi = _mm256_setzero_si256();
      if (pair) std::memcpy(h + 1, blk + bytes, 2), hi = _mm256_xor_si256(load32(blk + bytes + 2), flip);
      u[n] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_xor_si256(load32(blk + 2), flip)), hi, 1);
      d[n] = _mm512_cvtph_ps(_mm256_set_m128i(_mm_set1_epi16(static_cast<short>(h[1])),
                                              _mm_set1_epi16(static_cast<short>(h[0]))));
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t i = (m0 + r) * nb + b;
      const __m512i x = _mm512_maskz_loadu_epi32(lanes, xq.q.data() + i * 32);
      const __m512i start = _mm512_maskz_loadu_epi32(lanes, xq.start.data() + i * 8);
      const __m512 dx = _mm512_maskz_loadu_ps(lanes, xq.scale8.data() + i * 8);
#pragma GCC unroll 16
      for (int n = 0; n < NR; ++n)
        acc[n][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, u[n], x)),
                                    _mm512_mul_ps(d[n], dx), acc[n][r]);
    }
  }
#pragma GCC unroll 16
  for (int n = 0; n < NR; ++n)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) sums[n * R + r] = _mm512_reduce_add_ps(acc[n][r]);
}

// Q8_0_X16 / Q5_0_X16 on AVX-512 VNNI: a tile of 16 weight rows, rows in the lanes,
// against R rows of x from m0: one dpbusd takes 4 codes of the 16 weight rows against 4 of
// a row of x (broadcast), and a block's scaling is one convert, one multiply and one fused
// multiply-add for its 16 rows: 12 instructions a block a row of x for 16 x 32 weights,
// where dot_rows_q8 spends 32 on the stored layout (a convert, a multiply and a fused
// multiply-add each dpbusd) and a horizontal sum a row. So the 262k-row LM head of the real
// file stays at the memory's rate for more rows of x (a decode and its drafts, or a batch).
// sums[r][i] for weight row i; the same float32 sequence over the blocks whatever rows of
// x a row is among. x's start value takes off the codes' offset (128, Q5_0's 16) times its
// block's sum. Q5_0_X16's codes are its nibbles with the fifth bits shuffled in, once a
// block for the R rows of x.
template <int64_t QT, int R>
void tile_rows(const uint8_t* tile, int64_t nb, const QuantRows& xq, int64_t m0,
               float (*sums)[16], bool ahead) {
  constexpr int64_t bytes = QT == Q8_0 ? 544 : 352;
  constexpr int lines = (bytes + 63) / 64;
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = tile + b * bytes;
    if (ahead)  // a block's lines kTileAhead on, non-temporal (measured: T0 hints lost)
      for (int l = 0; l < lines; ++l) __builtin_prefetch(blk + kTileAhead + 64 * l, 0, 0);
    const __m512 d = _mm512_cvtph_ps(load32(blk));
    __m512i codes[8];
    if constexpr (QT == Q8_0) {
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) codes[g] = _mm512_loadu_si512(blk + 32 + 64 * g);
    } else {
#if defined(__AVX512BITALG__)
      const __m512i low = _mm512_set1_epi8(15), sixteen = _mm512_set1_epi8(16);
      const __m512i bits = _mm512_loadu_si512(blk + 32);
      // byte j of a vector: bit 4g + j % 4 of its row's word (32 bits up for odd rows)
      const __m512i at = _mm512_set_epi32(
          0x23222120, 0x03020100, 0x23222120, 0x03020100, 0x23222120, 0x03020100, 0x23222120, 0x03020100,
          0x23222120, 0x03020100, 0x23222120, 0x03020100, 0x23222120, 0x03020100, 0x23222120, 0x03020100);
#pragma GCC unroll 4
      for (int h = 0; h < 4; ++h) {
        const __m512i nib = _mm512_loadu_si512(blk + 96 + 64 * h);
        codes[2 * h] = _mm512_and_si512(nib, low);
        codes[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(nib, 4), low);
      }
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        const __mmask64 fifth = _mm512_bitshuffle_epi64_mask(bits, _mm512_add_epi8(at, _mm512_set1_epi8(4 * g)));
        codes[g] = _mm512_mask_add_epi8(codes[g], fifth, codes[g], sixteen);
      }
#endif
    }
    // two chains a row where the rows alone are too few to hide dpbusd's latency
    constexpr int C = R < 4 ? 2 : 1;
    __m512i s[C][R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      s[0][r] = _mm512_set1_epi32(xq.start[((m0 + r) * nb + b) * 8]);
      if constexpr (C == 2) s[1][r] = _mm512_setzero_si512();
    }
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t x4;
        std::memcpy(&x4, xq.q.data() + ((m0 + r) * nb + b) * 32 + 4 * g, 4);
        s[g % C][r] = _mm512_dpbusd_epi32(s[g % C][r], codes[g], _mm512_set1_epi32(x4));
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      if constexpr (C == 2) s[0][r] = _mm512_add_epi32(s[0][r], s[1][r]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[0][r]),
                               _mm512_mul_ps(d, _mm512_set1_ps(xq.scale[(m0 + r) * nb + b])), acc[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(sums[r], acc[r]);
}

// Q4_K / Q6_K on AVX-512 VNNI: a superblock's codes 64 a vector, each 16-bit pair of
// products scaled by its sub-block's scale inside the dot product, NR weight rows a pass
// over R rows of x (each weight block decoded once for the R rows: a decode and its drafts'
// verification rows run the same arithmetic row by row, hence the same sums). Q4_K's
// vectors hold the low nibbles of its first 64 code bytes (sub-blocks 0 and 2), their high
// nibbles (1 and 3), then 4 and 6, 5 and 7, so its x is grouped to match (`xk`); Q6_K's
// are in order.
struct KIndex {  // the 16-bit scale of each 16-bit lane of the 4 vectors (vpermw)
  alignas(64) int16_t q4[4][32];
  alignas(64) int16_t q6[4][32];
};
inline const KIndex& k_index() {
  static const KIndex t = [] {
    KIndex k{};
    for (int v = 0; v < 4; ++v)
      for (int l = 0; l < 32; ++l) {
        const int a = (v / 2) * 4 + v % 2;  // Q4_K: sub-blocks a (lanes 0-15) and a + 2
        k.q4[v][l] = static_cast<int16_t>(l < 16 ? a : a + 2);
        k.q6[v][l] = static_cast<int16_t>(4 * v + l / 8);  // Q6_K: 16 values a scale
      }
    return k;
  }();
  return t;
}

template <int64_t QT, int NR, int R = 1>
void dot_rows_k512(const uint8_t* w, int64_t row_bytes, int64_t K, const QuantRows& xq,
                   int64_t m0, float* sums, Ahead next = {}) {
  constexpr int64_t bytes = QT == Q4_K ? 144 : 210;
  const int64_t nb = K / 256;
  const int8_t* xs = (QT == Q4_K ? xq.xk.data() : xq.q.data()) + m0 * K;
  const int16_t* xsums = xq.sums16.data() + m0 * (K / 16);  // x's 16-sums, in order
  const float* xscale = xq.scale.data() + m0 * nb;
  const KIndex& index = k_index();
  const __m512i low = _mm512_set1_epi8(15), two = _mm512_set1_epi8(3);
  // Q6_K's high bits: per 16-bit lane, the shift that brings a 32-value group's 2 bits down
  const __m512i shift_a = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
  const __m512i shift_b = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
  __m512 acc[NR][R];
#pragma GCC unroll 8
  for (int n = 0; n < NR; ++n)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[n][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    next.step();
#pragma GCC unroll 8
    for (int n = 0; n < NR; ++n) {
      const uint8_t* blk = w + n * row_bytes + b * bytes;
      __m512i u[4], sc, scale[4];
      float d;
      __m256i weights16;  // Q4_K: each min twice (it scales two 16-sums); Q6_K: the scales
      if constexpr (QT == Q4_K) {
        d = f16(blk);
        alignas(16) uint32_t words[4];
        k4_scales_words(blk + 4, words);
        sc = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<__m128i*>(words))));
        const __m128i mn = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<__m128i*>(words + 2)));
        weights16 = _mm256_set_m128i(_mm_unpackhi_epi16(mn, mn), _mm_unpacklo_epi16(mn, mn));
        for (int c = 0; c < 2; ++c) {
          const __m512i q = _mm512_loadu_si512(blk + 16 + 64 * c);
          u[2 * c] = _mm512_and_si512(q, low);
          u[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(q, 4), low);
        }
      } else {
        d = f16(blk + 208);
        weights16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
        sc = _mm512_castsi256_si512(weights16);
        for (int h = 0; h < 2; ++h) {
          const __m512i l = _mm512_loadu_si512(blk + 64 * h);
          const __m512i hb = _mm512_broadcast_i64x4(load32(blk + 128 + 32 * h));
          const __m512i high_a = _mm512_and_si512(_mm512_srlv_epi16(hb, shift_a), two);
          const __m512i high_b = _mm512_and_si512(_mm512_srlv_epi16(hb, shift_b), two);
          u[2 * h] = _mm512_or_si512(_mm512_and_si512(l, low), _mm512_slli_epi16(high_a, 4));
          u[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), low),
                                         _mm512_slli_epi16(high_b, 4));
        }
      }
      for (int v = 0; v < 4; ++v)
        scale[v] = _mm512_permutexvar_epi16(_mm512_load_si512(QT == Q4_K ? index.q4[v] : index.q6[v]), sc);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int8_t* x = xs + r * K + b * 256;
        // Q4_K: mins * x's sums; Q6_K: 32 * scales * x's sums
        const __m256i correction = _mm256_madd_epi16(weights16, load32(xsums + r * (K / 16) + b * 16));
        const float dx = xscale[r * nb + b];
        __m512i isum = _mm512_setzero_si512();
        for (int v = 0; v < 4; ++v)
          isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(u[v], _mm512_loadu_si512(x + 64 * v)), scale[v]);
        if constexpr (QT == Q6_K)
          isum = _mm512_sub_epi32(isum, _mm512_zextsi256_si512(_mm256_slli_epi32(correction, 5)));
        acc[n][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(d * dx), acc[n][r]);
        if constexpr (QT == Q4_K)
          acc[n][r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(_mm512_zextsi256_si512(correction)),
                                       _mm512_set1_ps(f16(blk + 2) * dx), acc[n][r]);
      }
    }
  }
#pragma GCC unroll 8
  for (int n = 0; n < NR; ++n)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) sums[n * R + r] = _mm512_reduce_add_ps(acc[n][r]);
}

// f(std::integral_constant<int, min(n, Max)>) for a runtime n >= 1.
template <int Max = 4, typename F>
inline void vlmserve_with_rows(int64_t n, F&& f) {
  if constexpr (Max > 1) {
    if (n < Max) return vlmserve_with_rows<Max - 1>(n, f);
  }
  f(std::integral_constant<int, Max>{});
}
#endif

template <int64_t ISA>
void dot_row_isa(int64_t qtype, const uint8_t* w, int64_t K, const QuantRows& xq, int64_t m0,
                 int64_t rows, float* sums) {
  for (; rows > 0; m0 += kRegRows, rows -= kRegRows, sums += kRegRows) {
    const bool k = is_k(qtype);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    if constexpr (ISA == AVX512_VNNI) {
      if (!k) {
        vlmserve_with_rows(std::min<int64_t>(rows, kRegRows), [&](auto n) {
          if (xq.groups && qtype == Q5_0)
            dot_rows_g4<Q5_0, decltype(n)::value, 1>(w, 0, K, xq, m0, sums);
          else if (xq.groups)
            dot_rows_g4<Q4_0, decltype(n)::value, 1>(w, 0, K, xq, m0, sums);
          else
            dot_row_legacy512<decltype(n)::value>(qtype, w, K, xq, m0, sums);
        });
        continue;
      }
    }
#endif
    switch (std::min<int64_t>(rows, kRegRows)) {
      case 1: k ? dot_row_k<ISA, 1>(qtype, w, K, xq, m0, sums)
                : dot_row_legacy<ISA, 1>(qtype, w, K, xq, m0, sums); break;
      case 2: k ? dot_row_k<ISA, 2>(qtype, w, K, xq, m0, sums)
                : dot_row_legacy<ISA, 2>(qtype, w, K, xq, m0, sums); break;
      case 3: k ? dot_row_k<ISA, 3>(qtype, w, K, xq, m0, sums)
                : dot_row_legacy<ISA, 3>(qtype, w, K, xq, m0, sums); break;
      default: k ? dot_row_k<ISA, 4>(qtype, w, K, xq, m0, sums)
                 : dot_row_legacy<ISA, 4>(qtype, w, K, xq, m0, sums);
    }
  }
}
#endif

#if defined(__AVX2__)
// A row's blocks decoded 32 codes at a time (AVX2): sink(at, q, offset, s0, s1, m, is_signed)
// is handed the values at..at+31 as codes q (bytes), each (s * float(q - offset)) - m with
// s = s0 for the first 16 and s1 for the last, which are dequant_block's float32 operations
// (its Q8_0's q * d and Q4_0's d * (q - 8) alike: a product is commutative, x - 0 is x).
template <class Sink>
inline void decode_row(int64_t qtype, const uint8_t* src, int64_t K, Sink&& sink) {
  const Layout lay = layout(qtype);
  const __m256i low = _mm256_set1_epi8(15), two = _mm256_set1_epi8(3);
  for (int64_t b = 0, at = 0; b < K / lay.block; ++b, src += lay.bytes, at += lay.block) {
    switch (qtype) {
      case Q4_0: sink(at, nibbles32(src + 2), 8, f16(src), f16(src), 0.f, false); break;
      case Q5_0:
        sink(at, with_fifth_bits(nibbles32(src + 6), src + 2), 16, f16(src), f16(src), 0.f, false);
        break;
      case Q8_0: sink(at, load32(src + 2), 0, f16(src), f16(src), 0.f, true); break;
      case Q4_K: {  // (d * sc) * q - dmin * m per sub-block of 32
        const float d = f16(src), dmin = f16(src + 2);
        uint8_t sc[8], mn[8];
        k4_scales(src + 4, sc, mn);
        for (int j = 0; j < 8; ++j) {
          const __m256i q = load32(src + 16 + 32 * (j / 2));
          const float ds = d * static_cast<float>(sc[j]);
          sink(at + 32 * j, _mm256_and_si256(j % 2 ? _mm256_srli_epi16(q, 4) : q, low), 0, ds, ds,
               dmin * static_cast<float>(mn[j]), false);
        }
        break;
      }
      case Q6_K: {  // (d * sc) * (q - 32) per 16; the values of half h, 32 a quarter k
        const int8_t* sc = reinterpret_cast<const int8_t*>(src + 192);
        const float d = f16(src + 208);
        for (int h = 0; h < 2; ++h)
          for (int k = 0; k < 4; ++k) {
            const __m256i lb = load32(src + 64 * h + 32 * (k % 2));
            const __m256i lo = _mm256_and_si256(k < 2 ? lb : _mm256_srli_epi16(lb, 4), low);
            const __m256i hb = _mm256_srli_epi16(load32(src + 128 + 32 * h), 2 * k);
            const __m256i q = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(hb, two), 4));
            const int i = 128 * h + 32 * k;
            sink(at + i, q, 32, d * static_cast<float>(sc[i / 16]),
                 d * static_cast<float>(sc[i / 16 + 1]), 0.f, false);
          }
        break;
      }
      default: TORCH_CHECK(false, "unsupported block type ", qtype);
    }
  }
}

// 8 codes (the low 8 bytes of c) minus `offset`, as float32.
inline __m256 codes8(__m128i c, int32_t offset, bool is_signed) {
  const __m256i v = is_signed ? _mm256_cvtepi8_epi32(c) : _mm256_cvtepu8_epi32(c);
  return _mm256_cvtepi32_ps(_mm256_sub_epi32(v, _mm256_set1_epi32(offset)));
}

// 8 floats -> their bfloat16 bits in 32-bit lanes (at::BFloat16's rounding).
inline __m256i bf16_bits(const float* p) {
  const __m256 x = _mm256_loadu_ps(p);
  const __m256i u = _mm256_castps_si256(x);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(_mm256_srli_epi32(_mm256_add_epi32(u, bias), 16),
                            _mm256_set1_epi32(0x7FC0), nan);
}
#endif

void dequant_row(int64_t qtype, const uint8_t* src, int64_t K, float* y) {
#if defined(__AVX2__)
  decode_row(qtype, src, K, [y](int64_t at, __m256i q, int32_t offset, float s0, float s1, float m,
                                bool is_signed) {
    const __m128i half[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
    for (int i = 0; i < 4; ++i) {
      const __m256 v = codes8(i % 2 ? _mm_srli_si128(half[i / 2], 8) : half[i / 2], offset, is_signed);
      _mm256_storeu_ps(y + at + 8 * i, _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(i < 2 ? s0 : s1), v),
                                                     _mm256_set1_ps(m)));
    }
  });
#else
  const Layout lay = layout(qtype);
  for (int64_t b = 0; b < K / lay.block; ++b) dequant_block(qtype, src + b * lay.bytes, y + b * lay.block);
#endif
}

void round_bf16(const float* y, int64_t n, at::BFloat16* out) {
  int64_t k = 0;
#if defined(__AVX2__)
  for (; k + 16 <= n; k += 16)  // packus interleaves the 128-bit lanes; the permute restores them
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), _mm256_permute4x64_epi64(
        _mm256_packus_epi32(bf16_bits(y + k), bf16_bits(y + k + 8)), 0xD8));
#endif
  for (; k < n; ++k) out[k] = at::BFloat16(y[k]);  // round to nearest even
}

#if VLMSERVE_DEQUANT_BF16
// One weight row's blocks (K values) -> bfloat16 in one pass: round_bf16 of dequant_row's
// values bit for bit (VCVTNE2PS2BF16 rounds to nearest even, as at::BFloat16 does; it
// would flush a denormal, which no block's product is, and keep a NaN's payload, which
// round_bf16 makes 0x7FC0).
void dequant_row_bf16(int64_t qtype, const uint8_t* src, int64_t K, at::BFloat16* out) {
  decode_row(qtype, src, K, [out](int64_t at, __m256i q, int32_t offset, float s0, float s1,
                                  float m, bool is_signed) {
    const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
    const __m512i off = _mm512_set1_epi32(offset);
    const __m512i a = is_signed ? _mm512_cvtepi8_epi32(q0) : _mm512_cvtepu8_epi32(q0);
    const __m512i b = is_signed ? _mm512_cvtepi8_epi32(q1) : _mm512_cvtepu8_epi32(q1);
    const __m512 mv = _mm512_set1_ps(m);
    const __m512 lo = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(s0), _mm512_cvtepi32_ps(_mm512_sub_epi32(a, off))), mv);
    const __m512 hi = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(s1), _mm512_cvtepi32_ps(_mm512_sub_epi32(b, off))), mv);
    _mm512_storeu_si512(out + at, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
  });
}
#endif

// Rows [m0, m0 + rows) of xq against one weight row w (K values), with instruction set isa.
inline void dot_row(int64_t isa, int64_t qtype, const uint8_t* w, int64_t K, const QuantRows& xq,
                    int64_t m0, int64_t rows, float* sums) {
#if defined(__AVX2__)
  switch (isa) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    case AVX512_VNNI: return dot_row_isa<AVX512_VNNI>(qtype, w, K, xq, m0, rows, sums);
#endif
#if defined(__AVXVNNI__)
    case AVX_VNNI: return dot_row_isa<AVX_VNNI>(qtype, w, K, xq, m0, rows, sums);
#endif
    case SCALAR: return dot_row_scalar(qtype, w, K, xq, m0, rows, sums);
    default: return dot_row_isa<AVX2>(qtype, w, K, xq, m0, rows, sums);
  }
#else
  dot_row_scalar(qtype, w, K, xq, m0, rows, sums);
#endif
}

template <typename T, typename O>
void run_linear(O* out, int64_t os, const T* x, int64_t xs, int64_t M, const uint8_t* w,
                int64_t N, int64_t K, int64_t qtype, const T* bias, int64_t isa) {
  const bool tiled = untiled_qtype(qtype);
  bool grouped = false;  // Q4_0 / Q5_0 four blocks at a time (AVX-512 VNNI)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  grouped = isa == AVX512_VNNI && (qtype == Q4_0 || qtype == Q5_0);
  const bool k512 = isa == AVX512_VNNI && is_k(qtype);  // Q4_K / Q6_K
#else
  const bool k512 = false;
#endif
  const QuantRows xq = quantize_rows(x, xs, M, K, qtype, grouped, k512 && qtype == Q4_K);
  const Layout lay = layout(qtype);
  const int64_t row_bytes = K / lay.block * lay.bytes;
  const int64_t grain = std::max<int64_t>(1, 16384 / row_bytes);
  const int64_t rows_ahead = std::max<int64_t>(1, kAheadBytes / row_bytes);
  const int64_t passes_ahead = std::max<int64_t>(1, kAheadBytes / (kWeightRows * row_bytes));
  // The 4-weight-row pass passes_ahead on from the one at row n, over `steps` (none past
  // the last weight row).
  const auto next_pass = [&](int64_t n, int64_t steps) {
    return n + (passes_ahead + 1) * kWeightRows <= N
               ? ahead(w + (n + passes_ahead * kWeightRows) * row_bytes, kWeightRows * row_bytes, steps)
               : Ahead{};
  };
  int64_t first = 0;  // the weight rows before it ran as tiles
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  if (tiled && isa == AVX512_VNNI && packable(qtype)) {
    first = N / 16 * 16;
    const int64_t nb = K / 32, tile_bytes = 16 * row_bytes;
    at::parallel_for(0, N / 16, std::max<int64_t>(1, grain / 16), [&](int64_t begin, int64_t end) {
      float sums[kTileRows][16];
      for (int64_t t = begin; t < end; ++t) {
        const uint8_t* tile = w + t * tile_bytes;
        for (int64_t m0 = 0; m0 < M; m0 += kTileRows)
          vlmserve_with_rows<kTileRows>(M - m0, [&](auto r) {
            constexpr int R = decltype(r)::value;
            const bool ahead = m0 == 0 && (t + 1) * tile_bytes + kTileAhead <= N / 16 * tile_bytes;
            if (qtype == Q8_0)
              tile_rows<Q8_0, R>(tile, nb, xq, m0, sums, ahead);
#if defined(__AVX512BITALG__)  // packable: Q5_0 only with it
            else
              tile_rows<Q5_0, R>(tile, nb, xq, m0, sums, ahead);
#endif
            for (int64_t i = 0, n = t * 16; i < 16; ++i, ++n) {
              const float b = bias ? static_cast<float>(bias[n]) : 0.f;
              for (int q = 0; q < R; ++q) out[(m0 + q) * os + n] = O(sums[q][i] + b);
            }
          });
      }
    });
  }
#endif
  at::parallel_for(first, N, grain, [&](int64_t begin, int64_t end) {
    float sums[kRowChunk];
    RowReader reader(w, N, row_bytes, tiled, qtype);
    int64_t n = begin;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    // NR weight rows from `first` against x's rows, up to four at a time (the first pass
    // prefetching `next`): kernel(r, m0, ahead) fills sums[j * R + q] for R = r's rows.
    const auto passes = [&](auto nr, int64_t first, Ahead next, auto&& kernel) {
      constexpr int NR = decltype(nr)::value;
      for (int64_t m0 = 0; m0 < M; m0 += kRegRows)
        vlmserve_with_rows(std::min<int64_t>(kRegRows, M - m0), [&](auto r) {
          constexpr int R = decltype(r)::value;
          kernel(r, m0, m0 == 0 ? next : Ahead{});
          for (int j = 0; j < NR; ++j) {
            const float b = bias ? static_cast<float>(bias[first + j]) : 0.f;
            for (int q = 0; q < R; ++q) out[(m0 + q) * os + first + j] = O(sums[j * R + q] + b);
          }
        });
    };
    constexpr std::integral_constant<int, kWeightRows> four{};
    if (xq.groups)  // Q4_0 / Q5_0
      for (; n + kWeightRows <= end; n += kWeightRows)
        passes(four, n, next_pass(n, xq.groups), [&](auto r, int64_t m0, Ahead ahead_next) {
          constexpr int R = decltype(r)::value;
          const uint8_t* rows = w + n * row_bytes;
          if (qtype == Q5_0)
            dot_rows_g4<Q5_0, R, kWeightRows>(rows, row_bytes, K, xq, m0, sums, ahead_next);
          else
            dot_rows_g4<Q4_0, R, kWeightRows>(rows, row_bytes, K, xq, m0, sums, ahead_next);
        });
    if (k512) {  // the weight rows left over one at a time
      const auto k_pass = [&](auto nr, int64_t first, Ahead next) {
        constexpr int NR = decltype(nr)::value;
        passes(nr, first, next, [&](auto r, int64_t m0, Ahead ahead_next) {
          constexpr int R = decltype(r)::value;
          const uint8_t* rows = w + first * row_bytes;
          if (qtype == Q4_K)
            dot_rows_k512<Q4_K, NR, R>(rows, row_bytes, K, xq, m0, sums, ahead_next);
          else
            dot_rows_k512<Q6_K, NR, R>(rows, row_bytes, K, xq, m0, sums, ahead_next);
        });
      };
      for (; n + kWeightRows <= end; n += kWeightRows) k_pass(four, n, next_pass(n, K / 256));
      for (; n < end; ++n) k_pass(std::integral_constant<int, 1>{}, n, Ahead{});
    }
    if (isa == AVX512_VNNI && qtype == Q8_0)
      for (; n + kWeightRows <= end; n += kWeightRows)
        passes(four, n, next_pass(n, (K / 32 + 1) / 2), [&](auto r, int64_t m0, Ahead ahead_next) {
          dot_rows_q8<decltype(r)::value, kWeightRows>(w + n * row_bytes, row_bytes, K, xq, m0, sums,
                                                      ahead_next);
        });
#endif
    for (; n < end; ++n) {
      if (M == 1 && n + rows_ahead < N) ahead(w + (n + rows_ahead) * row_bytes, row_bytes, 1).step();
      for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
        const int64_t rows = std::min<int64_t>(kRowChunk, M - m0);
        dot_row(isa, qtype, reader.row(n), K, xq, m0, rows, sums);
        const float b = bias ? static_cast<float>(bias[n]) : 0.f;
        for (int64_t r = 0; r < rows; ++r) out[(m0 + r) * os + n] = O(sums[r] + b);
      }
    }
  });
}

void linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& blocks, int64_t qtype,
            const c10::optional<at::Tensor>& bias, int64_t isa) {
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "quantized linear: float32 or "
              "bfloat16 x, not ", dtype);
  TORCH_CHECK(out.scalar_type() == dtype || out.scalar_type() == at::kFloat,
              "quantized linear: out in x's dtype or float32");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1,
              "quantized linear: [rows, width] tensors with dense rows");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "blocks: contiguous uint8 [out, bytes]");
  const Layout lay = layout(qtype);
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0);
  TORCH_CHECK(K % lay.block == 0 && blocks.size(1) == K / lay.block * lay.bytes,
              "blocks do not hold rows of ", K, " values");
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "out: [rows, out]");
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == dtype,
                "bias: [out] in x's dtype");
  isa = std::min<int64_t>(isa, best_isa());
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  if (M == 0 || N == 0) return;
  if (dtype == at::kFloat) {
    const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    run_linear(out.data_ptr<float>(), out.stride(0), x.data_ptr<float>(), x.stride(0), M, w, N,
               K, qtype, b, isa);
  } else {
    using bf16 = at::BFloat16;
    const bf16* b = bias.has_value() ? bias->data_ptr<bf16>() : nullptr;
    if (out.scalar_type() == at::kFloat)
      run_linear(out.data_ptr<float>(), out.stride(0), x.data_ptr<bf16>(), x.stride(0), M, w, N,
                 K, qtype, b, isa);
    else
      run_linear(out.data_ptr<bf16>(), out.stride(0), x.data_ptr<bf16>(), x.stride(0), M, w, N,
                 K, qtype, b, isa);
  }
}

#if VLMSERVE_AMX
// The tile path on AMX (`amx_linear`): per 16 weight rows, their blocks dequantized once
// into a bfloat16 buffer [16][K] (as `dequantize` rounds them) that is the A operand as it
// lies, x's rows the B operand (bfloat16 pairs, packed once a call), so C holds 16 weight
// rows by 16 rows of x, float32 sums written out transposed. No copy of the weight outlives
// its 16 rows, and the sums are never rounded to bfloat16 on the way (float32 out: the LM
// head's logits). Tiles (amx.h's layout): C 0-3, A 4, B 5-7.
namespace amx {

constexpr int64_t kXRows = 64;  // rows of x a pass over a weight buffer (the 4 C tiles)

// x [M, K] bfloat16 -> B tiles [ceil(M / 16)][K / 32][16][16] of 32-bit pairs: tile (t, s)
// row e holds (x[16t + c][32s + 2e], x[16t + c][32s + 2e + 1]) in lane c; zeros past M.
vlmserve_vec::LineVector<uint32_t> x_tiles(const at::BFloat16* x, int64_t xs, int64_t M, int64_t K) {
  const int64_t steps = K / 32;
  vlmserve_vec::LineVector<uint32_t> b((M + 15) / 16 * steps * 256, 0);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t s = 0; s < steps; ++s)
      for (int64_t e = 0; e < 16; ++e)
        std::memcpy(&b[((r / 16 * steps + s) * 16 + e) * 16 + r % 16], x + r * xs + 32 * s + 2 * e, 4);
  return b;
}

// C_j = the 16 weight rows at w (a row K values; A, shared) times x's B tiles j =
// 0..XT-1; C_j to buf + 256 j, [weight row][row of x].
template <int XT>
inline void weight_rows(const at::BFloat16* w, int64_t K, const uint32_t* xb, int64_t steps,
                        float* buf) {
  vlmserve_amx::tile_pass<XT, true>(w, 64, 2 * K, xb, steps, buf);
}

}  // namespace amx

// The AMX path's loop: every tile of 16 weight rows (a thread's share in increasing order)
// against every row of x; sink(r, n0, lanes, sums) takes row r's float32 sums (+ bias) for
// weight rows n0.. (`lanes` of them). Each thread makes its sink with make_sink() and calls
// its finish() after its last tile.
template <class MakeSink>
void amx_tiles(const at::BFloat16* x, int64_t xs, int64_t M, const uint8_t* w, int64_t N,
               int64_t K, int64_t qtype, const at::BFloat16* bias, MakeSink&& make_sink) {
  const bool tiled = untiled_qtype(qtype);
  const Layout lay = layout(qtype);
  const int64_t row_bytes = K / lay.block * lay.bytes, steps = K / 32, tiles = (N + 15) / 16;
  const auto xb = amx::x_tiles(x, xs, M, K);
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    vlmserve_amx::configure();
    auto sink = make_sink();
    vlmserve_vec::LineVector<at::BFloat16> a(16 * K);  // the 16 weight rows, bfloat16
    RowReader reader(w, N, row_bytes, tiled, qtype);
    alignas(64) float buf[4 * 256];
    const __m512i column = _mm512_mullo_epi32(_mm512_set1_epi32(16), _mm512_setr_epi32(
        0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));  // [weight row][row of x]
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = 16 * t, cols = std::min<int64_t>(16, N - n0);
      for (int64_t c = 0; c < 16; ++c) {
        at::BFloat16* row = a.data() + c * K;
        if (c >= cols) {
          std::fill(row, row + K, at::BFloat16(0.f));
          continue;
        }
        if (n0 + 16 + c < N)  // the next tile's row, while this one's is decoded
          for (int64_t l = 0; l < row_bytes; l += 64)
            __builtin_prefetch(w + (n0 + 16 + c) * row_bytes + l, 0, 3);
        dequant_row_bf16(qtype, reader.row(n0 + c), K, row);
      }
      const __mmask16 lanes = static_cast<__mmask16>((1u << cols) - 1);
      __m512 bias_v = _mm512_setzero_ps();
      if (bias) {
        alignas(64) float b[16] = {};
        for (int64_t c = 0; c < cols; ++c) b[c] = static_cast<float>(bias[n0 + c]);
        bias_v = _mm512_load_ps(b);
      }
      for (int64_t r0 = 0; r0 < M; r0 += amx::kXRows) {
        const int64_t rows = std::min(amx::kXRows, M - r0);
        const uint32_t* xr = xb.data() + r0 / 16 * steps * 256;
        switch ((rows + 15) / 16) {
          case 1: amx::weight_rows<1>(a.data(), K, xr, steps, buf); break;
          case 2: amx::weight_rows<2>(a.data(), K, xr, steps, buf); break;
          case 3: amx::weight_rows<3>(a.data(), K, xr, steps, buf); break;
          default: amx::weight_rows<4>(a.data(), K, xr, steps, buf); break;
        }
        for (int64_t r = 0; r < rows; ++r)
          sink(r0 + r, n0, lanes,
               _mm512_add_ps(_mm512_i32gather_ps(column, buf + (r / 16) * 256 + r % 16, 4), bias_v));
      }
    }
    sink.finish();
    _tile_release();
  });
}

template <typename O>
struct StoreSums {  // amx_linear: the sums into out's rows
  O* out;
  int64_t os;
  void operator()(int64_t r, int64_t n0, __mmask16 lanes, __m512 sums) const {
    if constexpr (std::is_same_v<O, float>)
      _mm512_mask_storeu_ps(out + r * os + n0, lanes, sums);
    else
      _mm256_mask_storeu_epi16(out + r * os + n0, lanes, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(sums)));
  }
  void finish() const {}
};

struct ArgmaxSums {  // amx_argmax: per thread, amx.h's lanes, merged at the end
  vlmserve_amx::LaneArgmax lanes;
  vlmserve_amx::Best* best;  // [M], shared by the threads (under `mutex`)
  std::mutex* mutex;
  void operator()(int64_t r, int64_t n0, __mmask16 valid, __m512 sums) { lanes.update(r, n0, valid, sums); }
  void finish() {
    const std::lock_guard<std::mutex> lock(*mutex);
    lanes.merge_into(best);
  }
};
#endif

// Whether this build runs the tile path on AMX tiles (`amx_linear`), and Linux allows it.
bool amx_available() {
#if VLMSERVE_AMX
  return vlmserve_amx::enabled();
#else
  return false;
#endif
}

// The AMX ops' operands checked: bfloat16 x [M, K] with dense rows, W's blocks [N, bytes]
// holding rows of K values (a multiple of 32); {M, K, N}.
std::array<int64_t, 3> amx_operands(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype,
                                    const char* name) {
  TORCH_CHECK(amx_available(), "quantized ", name, ": no AMX tiles in this build or process");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1,
              "quantized ", name, ": bfloat16 x [rows, width] with dense rows");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "blocks: contiguous uint8 [out, bytes]");
  const Layout lay = layout(qtype);
  const int64_t K = x.size(1);
  TORCH_CHECK(K % lay.block == 0 && K % 32 == 0 && blocks.size(1) == K / lay.block * lay.bytes,
              "blocks do not hold rows of ", K, " values");
  return {x.size(0), K, blocks.size(0)};
}

// out [M, N] (float32, or bfloat16 like x) = x [M, K] bfloat16 @ W^T (+ bias), W's blocks
// dequantized 16 rows at a time onto AMX tiles.
void amx_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& blocks,
                int64_t qtype, const c10::optional<at::Tensor>& bias) {
  const std::array<int64_t, 3> shape = amx_operands(x, blocks, qtype, "amx_linear");
  const int64_t M = shape[0], K = shape[1], N = shape[2];
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "quantized amx_linear: out float32 or bfloat16 [rows, out] with dense rows");
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "out: [rows, out]");
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == at::kBFloat16,
                "bias: [out] bfloat16");
  if (M == 0 || N == 0) return;
#if VLMSERVE_AMX
  const at::BFloat16* b = bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr;
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  if (out.scalar_type() == at::kFloat)
    amx_tiles(xp, x.stride(0), M, w, N, K, qtype, b, [&] { return StoreSums<float>{out.data_ptr<float>(), out.stride(0)}; });
  else
    amx_tiles(xp, x.stride(0), M, w, N, K, qtype, b, [&] {
      return StoreSums<at::BFloat16>{out.data_ptr<at::BFloat16>(), out.stride(0)};
    });
#endif
}

// out [M] int64: torch.argmax over N of amx_linear's float32 sums (x [M, K] bfloat16 @ W^T),
// no sums written anywhere: greedy decoding's tokens straight from a quantized LM head.
void amx_argmax(const at::Tensor& out, const at::Tensor& x, const at::Tensor& blocks, int64_t qtype) {
  const std::array<int64_t, 3> shape = amx_operands(x, blocks, qtype, "amx_argmax");
  const int64_t M = shape[0], K = shape[1], N = shape[2];
  TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous() && out.numel() == M,
              "quantized amx_argmax: out int64 [rows]");
  TORCH_CHECK(N > 0 && N < (int64_t{1} << 31), "quantized amx_argmax: 1 to 2^31 - 1 weight rows");
  if (M == 0) return;
#if VLMSERVE_AMX
  std::vector<vlmserve_amx::Best> best(M, vlmserve_amx::Best{0.0f, -1});
  std::mutex mutex;
  amx_tiles(x.data_ptr<at::BFloat16>(), x.stride(0), M, blocks.data_ptr<uint8_t>(), N, K, qtype,
            nullptr, [&] { return ArgmaxSums{vlmserve_amx::LaneArgmax(M), best.data(), &mutex}; });
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < M; ++r) o[r] = best[r].index;
#endif
}

}  // namespace

TORCH_LIBRARY(vlmserve_quant, m) {
  m.def("best_isa() -> int", &best_isa);
  m.def("has_isa(int isa) -> bool", &has_isa);
  m.def("dequantize(Tensor(a!) out, Tensor blocks, int qtype, Tensor? rows) -> ()");
  m.def("linear(Tensor(a!) out, Tensor x, Tensor blocks, int qtype, Tensor? bias, int isa) -> ()");
  m.def("amx_available() -> bool", &amx_available);
  m.def("amx_linear(Tensor(a!) out, Tensor x, Tensor blocks, int qtype, Tensor? bias) -> ()");
  m.def("amx_argmax(Tensor(a!) out, Tensor x, Tensor blocks, int qtype) -> ()");
  m.def("packable(int qtype) -> bool", &packable);
  m.def("pack_rows(Tensor(a!) blocks, int qtype) -> ()");
  m.def("unpack_rows(Tensor(a!) blocks, int qtype) -> ()");
}

TORCH_LIBRARY_IMPL(vlmserve_quant, CPU, m) {
  m.impl("dequantize", &dequantize);
  m.impl("linear", &linear);
  m.impl("amx_linear", &amx_linear);
  m.impl("amx_argmax", &amx_argmax);
  m.impl("pack_rows", &pack_rows);
  m.impl("unpack_rows", &unpack_rows);
}
