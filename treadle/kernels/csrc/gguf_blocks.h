// A GGUF file's blocks of 32 weights as ggml lays them out, read by the few-row kernel
// (gemv.cpp's gguf_rows_linear). A row of a weight is its blocks side by side:
//   Q8_0 (34 B): fp16 d, 32 int8 q;                  w = d q
//   Q4_0 (18 B): fp16 d, 16 B of nibbles;            w = d (q - 8)
//   Q4_1 (20 B): fp16 d, fp16 m, 16 B of nibbles;    w = d q + m
// A block's byte j holds weight j in its low nibble and weight j + 16 in its high one. Every
// d q is exact in fp32 (11 bits of d times at most 8 of q), so each weight is the one gguf's
// own dequantizer (gguf.quants) computes, rounded once where m is added: the kernel multiplies
// by exactly the dequantized weights, and computes the model transformers loads from the file.
// (Q4_K and Q6_K read this way ran no faster than fp32 at one row; docs/performance-log.md.)
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace treadle::gguf {

enum Type : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

constexpr int64_t kBlock = 32;   // weights per block
constexpr bool supported(int64_t type) { return type == kQ4_0 || type == kQ4_1 || type == kQ8_0; }
constexpr int64_t block_bytes(int64_t type) { return type == kQ8_0 ? 34 : type == kQ4_0 ? 18 : 20; }

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

// The rows of a [N, K] weight stored as blocks of one type.
template <int64_t Type>
struct Rows {
  const uint8_t* blocks;
  int64_t blocks_per_row;
  static constexpr int64_t kBytes = block_bytes(Type);
  static constexpr int64_t kQuants = Type == kQ4_1 ? 4 : 2;   // the quants' offset in a block

  const uint8_t* block(int64_t col, int64_t i) const { return blocks + (col * blocks_per_row + i / kBlock) * kBytes; }

  // Weight i of row col (a row's last weights past a whole vector).
  float at(int64_t col, int64_t i) const {
    const uint8_t* b = block(col, i);
    const int64_t j = i % kBlock;
    if constexpr (Type == kQ8_0) return half_at(b) * static_cast<float>(static_cast<int8_t>(b[2 + j]));
    const int q = j < 16 ? b[kQuants + j] & 0xF : b[kQuants + j - 16] >> 4;
    if constexpr (Type == kQ4_0) return half_at(b) * static_cast<float>(q - 8);
    return half_at(b) * static_cast<float>(q) + half_at(b + 2);
  }
  // Weights i .. i + 15 (i a multiple of 16: half a block), as `at` computes each, with the
  // block's scales converted once (CPUs without AVX-512: 16 `at` calls, each converting them,
  // made a SmolLM2 Q4_1 decode step about 190 ms on an AVX2 Zen 3).
  void load16(int64_t col, int64_t i, float* out) const {
#ifdef __AVX2__
    __m256 w0, w1;
    halves16(col, i, w0, w1);
    _mm256_storeu_ps(out, w0);
    _mm256_storeu_ps(out + 8, w1);
#else
    const uint8_t* b = block(col, i);
    const float d = half_at(b);
    if constexpr (Type == kQ8_0) {
      const int8_t* q = reinterpret_cast<const int8_t*>(b + 2 + i % kBlock);
#pragma omp simd
      for (int64_t j = 0; j < 16; ++j) out[j] = d * static_cast<float>(q[j]);
    } else {
      const uint8_t* q = b + kQuants;
      const int shift = i % kBlock ? 4 : 0;   // the second half: the high nibbles
      const int offset = Type == kQ4_0 ? 8 : 0;
#pragma omp simd
      for (int64_t j = 0; j < 16; ++j) out[j] = d * static_cast<float>(((q[j] >> shift) & 0xF) - offset);
      if constexpr (Type == kQ4_1) {
        // d q rounded before m is added, as `at` and gguf's dequantizer do: the barrier keeps
        // -ffast-math from fusing the two into one multiply-add.
        asm volatile("" : : "r"(out) : "memory");
        const float m = half_at(b + 2);
#pragma omp simd
        for (int64_t j = 0; j < 16; ++j) out[j] += m;
      }
    }
#endif
    // The weights are what the kernel multiplies x by: no reassociating x * (d q) (-ffast-math).
    asm volatile("" : : "r"(out) : "memory");
  }

#ifdef __AVX2__
  // The same 16 weights in two vectors of 8: the quants widened to int32, converted and scaled.
  void halves16(int64_t col, int64_t i, __m256& w0, __m256& w1) const {
    const uint8_t* b = block(col, i);
    const float d = half_at(b);
    __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (Type == kQ8_0 ? 2 + i % kBlock : kQuants)));
    __m256i lo, hi;
    if constexpr (Type == kQ8_0) {
      lo = _mm256_cvtepi8_epi32(q);
      hi = _mm256_cvtepi8_epi32(_mm_srli_si128(q, 8));
    } else {
      if (i % kBlock) q = _mm_srli_epi16(q, 4);   // the second half: the high nibbles
      q = _mm_and_si128(q, _mm_set1_epi8(0xF));
      lo = _mm256_cvtepu8_epi32(q);
      hi = _mm256_cvtepu8_epi32(_mm_srli_si128(q, 8));
      if constexpr (Type == kQ4_0) {
        lo = _mm256_sub_epi32(lo, _mm256_set1_epi32(8));
        hi = _mm256_sub_epi32(hi, _mm256_set1_epi32(8));
      }
    }
    w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(lo), _mm256_set1_ps(d));
    w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(hi), _mm256_set1_ps(d));
    if constexpr (Type == kQ4_1) {
      asm("" : "+x"(w0), "+x"(w1));   // d q rounded before m is added (no fused multiply-add)
      const __m256 m = _mm256_set1_ps(half_at(b + 2));
      w0 = _mm256_add_ps(w0, m);
      w1 = _mm256_add_ps(w1, m);
    }
    asm("" : "+x"(w0), "+x"(w1));   // keep x * w from being reassociated (-ffast-math)
  }
#endif

#ifdef __AVX512F__
  // A whole block, weights i .. i + 31 (i a multiple of 32), as two vectors.
  static constexpr int kVectors = 2;
  void loadv(int64_t col, int64_t i, __m512* out) const {
    const uint8_t* b = block(col, i);
    const __m512 d = half16(b);
    __m512i lo, hi;
    if constexpr (Type == kQ8_0) {
      lo = _mm512_cvtepi8_epi32(load16(b + 2));
      hi = _mm512_cvtepi8_epi32(load16(b + 18));
    } else {
      const __m512i bytes = _mm512_cvtepu8_epi32(load16(b + kQuants));
      lo = _mm512_and_si512(bytes, _mm512_set1_epi32(0xF));
      hi = _mm512_srli_epi32(bytes, 4);
      if constexpr (Type == kQ4_0) {
        lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(8));
        hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(8));
      }
    }
    out[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(lo), d);
    out[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(hi), d);
    if constexpr (Type == kQ4_1) {
      const __m512 m = half16(b + 2);
      out[0] = _mm512_add_ps(out[0], m);
      out[1] = _mm512_add_ps(out[1], m);
    }
    asm("" : "+v"(out[0]), "+v"(out[1]));   // keep x * w from being reassociated (-ffast-math)
  }

 private:
  // The fp16 at p in every lane, widened by the vector conversion: with a scalar _cvtsh_ss
  // per block the Q4_1 kernel ran 2.3x slower here (docs/performance-log.md).
  static __m512 half16(const uint8_t* p) {
    short bits;
    std::memcpy(&bits, p, sizeof(bits));
    return _mm512_cvtph_ps(_mm256_set1_epi16(bits));
  }
  static __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
#endif
};

}  // namespace treadle::gguf
