// A GGUF file's blocks of weights as ggml lays them out, read by the few-row kernel
// (gemv.cpp's gguf_rows_linear). A row of a weight is its blocks side by side:
//   Q8_0  (32 weights, 34 B): fp16 d, 32 int8 q;                       w = d q
//   Q4_0  (32 weights, 18 B): fp16 d, 16 B of nibbles;                 w = d (q - 8)
//   Q4_1  (32 weights, 20 B): fp16 d, fp16 m, 16 B of nibbles;         w = d q + m
//   Q4_K (256 weights, 144 B): fp16 d, fp16 dmin, 8 six-bit scales and mins packed in 12 B,
//         128 B of nibbles;                                             w = (d sc) q - dmin mn
//   Q6_K (256 weights, 210 B): 128 B of low nibbles, 64 B of high bit pairs, 16 int8
//         scales, fp16 d;                                               w = (d sc) (q - 32)
// Every product of d (11 bits) with a scale, a min or a 4- or 8-bit q is exact in fp32, so each
// weight is rounded where gguf's own dequantizer (gguf.quants) rounds it, once: at the + m or
// - dmin mn, or in Q6_K at the product with its 6-bit q. The kernel multiplies by exactly the
// dequantized weights, and computes the model transformers loads from the file.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace treadle::gguf {

enum Type : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14 };

constexpr bool supported(int64_t type) {
  return type == kQ4_0 || type == kQ4_1 || type == kQ8_0 || type == kQ4_K || type == kQ6_K;
}
constexpr int64_t block_weights(int64_t type) { return type == kQ4_K || type == kQ6_K ? 256 : 32; }
constexpr int64_t block_bytes(int64_t type) {
  switch (type) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ8_0: return 34;
    case kQ4_K: return 144;
    default: return 210;   // kQ6_K
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

// Q4_K's six-bit scale and min of sub-block g (of 8) from its 12 packed bytes.
inline void q4k_scale_min(const uint8_t* packed, int g, int& scale, int& min) {
  if (g < 4) {
    scale = packed[g] & 63;
    min = packed[g + 4] & 63;
  } else {
    scale = (packed[g + 4] & 0xF) | ((packed[g - 4] >> 6) << 4);
    min = (packed[g + 4] >> 4) | ((packed[g] >> 6) << 4);
  }
}

// The rows of a [N, K] weight stored as blocks of one type. Weights come 32 at a time (a
// block, or a sub-block of a K-quant's 256), as two vectors of 16.
template <int64_t Type>
struct Rows {
  const uint8_t* blocks;
  int64_t blocks_per_row;
  static constexpr int64_t kWeights = block_weights(Type), kBytes = block_bytes(Type);
  static constexpr int kVectors = 2;

  const uint8_t* block(int64_t col, int64_t i) const {
    return blocks + (col * blocks_per_row + i / kWeights) * kBytes;
  }
  static int sub_block(int64_t i) { return static_cast<int>(i % kWeights / 32); }

  // Weight i of row col, one at a time (CPUs without AVX-512).
  float at(int64_t col, int64_t i) const {
    const uint8_t* b = block(col, i);
    const int g = sub_block(i), j = static_cast<int>(i % 32);
    if constexpr (Type == kQ8_0) return half_at(b) * static_cast<float>(static_cast<int8_t>(b[2 + j]));
    if constexpr (Type == kQ4_0 || Type == kQ4_1) {
      const uint8_t* qs = b + (Type == kQ4_1 ? 4 : 2);
      const int q = j < 16 ? qs[j] & 0xF : qs[j - 16] >> 4;
      if constexpr (Type == kQ4_0) return half_at(b) * static_cast<float>(q - 8);
      return half_at(b) * static_cast<float>(q) + half_at(b + 2);
    }
    if constexpr (Type == kQ4_K) {
      int scale, min;
      q4k_scale_min(b + 4, g, scale, min);
      const int q = (b[16 + g / 2 * 32 + j] >> (g % 2 * 4)) & 0xF;
      return half_at(b) * static_cast<float>(scale) * static_cast<float>(q) -
             half_at(b + 2) * static_cast<float>(min);
    }
    const int t = g % 4;   // kQ6_K
    const int low = (b[g / 4 * 64 + (t & 1) * 32 + j] >> (t >> 1) * 4) & 0xF;
    const int high = (b[128 + g / 4 * 32 + j] >> 2 * t) & 3;
    const float scale = half_at(b + 208) * static_cast<float>(static_cast<int8_t>(b[192 + 2 * g + j / 16]));
    return scale * static_cast<float>((low | high << 4) - 32);
  }

  void load16(int64_t col, int64_t i, float* out) const {
    for (int64_t j = 0; j < 16; ++j) out[j] = at(col, i + j);
  }

#ifdef __AVX512F__
  // Weights i .. i + 31 (i a multiple of 32).
  void loadv(int64_t col, int64_t i, __m512* out) const {
    const uint8_t* b = block(col, i);
    [[maybe_unused]] const int g = sub_block(i);
    if constexpr (Type == kQ8_0) {
      const __m512 d = _mm512_set1_ps(_cvtsh_ss(load_bits(b)));
      out[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load16(b + 2))), d);
      out[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load16(b + 18))), d);
    } else if constexpr (Type == kQ4_0 || Type == kQ4_1) {
      const __m512 d = _mm512_set1_ps(_cvtsh_ss(load_bits(b)));
      const __m512i bytes = _mm512_cvtepu8_epi32(load16(b + (Type == kQ4_1 ? 4 : 2)));
      __m512i lo = _mm512_and_si512(bytes, _mm512_set1_epi32(0xF)), hi = _mm512_srli_epi32(bytes, 4);
      if constexpr (Type == kQ4_0) {
        lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(8));
        hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(8));
      }
      out[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(lo), d);
      out[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(hi), d);
      if constexpr (Type == kQ4_1) {
        const __m512 m = _mm512_set1_ps(_cvtsh_ss(load_bits(b + 2)));
        out[0] = _mm512_add_ps(out[0], m);
        out[1] = _mm512_add_ps(out[1], m);
      }
    } else if constexpr (Type == kQ4_K) {
      int scale, min;
      q4k_scale_min(b + 4, g, scale, min);
      const __m512 ds = _mm512_set1_ps(_cvtsh_ss(load_bits(b)) * static_cast<float>(scale));
      const __m512 dm = _mm512_set1_ps(_cvtsh_ss(load_bits(b + 2)) * static_cast<float>(min));
      const uint8_t* qs = b + 16 + g / 2 * 32;
      const __m128i shift = _mm_cvtsi32_si128(g % 2 * 4);
      for (int v = 0; v < 2; ++v) {
        const __m512i q = _mm512_and_si512(_mm512_srl_epi32(_mm512_cvtepu8_epi32(load16(qs + 16 * v)), shift),
                                           _mm512_set1_epi32(0xF));
        out[v] = _mm512_sub_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q), ds), dm);
      }
    } else {   // kQ6_K
      const int t = g % 4;
      const uint8_t* low = b + g / 4 * 64 + (t & 1) * 32;
      const uint8_t* high = b + 128 + g / 4 * 32;
      const __m128i low_shift = _mm_cvtsi32_si128((t >> 1) * 4), high_shift = _mm_cvtsi32_si128(2 * t);
      const float d = _cvtsh_ss(load_bits(b + 208));
      for (int v = 0; v < 2; ++v) {
        const __m512i l = _mm512_and_si512(_mm512_srl_epi32(_mm512_cvtepu8_epi32(load16(low + 16 * v)), low_shift),
                                           _mm512_set1_epi32(0xF));
        const __m512i h = _mm512_and_si512(_mm512_srl_epi32(_mm512_cvtepu8_epi32(load16(high + 16 * v)), high_shift),
                                           _mm512_set1_epi32(3));
        const __m512i q = _mm512_sub_epi32(_mm512_or_si512(l, _mm512_slli_epi32(h, 4)), _mm512_set1_epi32(32));
        const float scale = d * static_cast<float>(static_cast<int8_t>(b[192 + 2 * g + v]));
        out[v] = _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(scale));
      }
    }
    asm("" : "+v"(out[0]), "+v"(out[1]));   // keep x * w from being reassociated (-ffast-math)
  }

 private:
  static unsigned short load_bits(const uint8_t* p) {
    unsigned short bits;
    std::memcpy(&bits, p, sizeof(bits));
    return bits;
  }
  static __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
#endif
};

}  // namespace treadle::gguf
