// AVX-512 helpers for the kernels: loads as fp32 and a 16 x 16 transpose (compiled only where
// the CPU has AVX-512), and whether bf16 products can come from pairs.
#pragma once

namespace treadle::vec {
// VDPBF16PS (AVX512-BF16) multiplies two bf16 pairs exactly and adds both products in fp32.
#ifdef __AVX512BF16__
constexpr bool kPairedBf16 = true;
#else
constexpr bool kPairedBf16 = false;
#endif
}  // namespace treadle::vec

#ifdef __AVX512F__
#include <ATen/ATen.h>
#include <immintrin.h>

#include <array>
#include <cstdint>

namespace treadle::vec {

// 16 consecutive values as fp32 (each conversion is exact).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {   // bf16 is fp32's top half
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Lane indices for _mm512_permutex2var_ps(a, idx, b) that swap bit `bit` of the row index with
// the same bit of the column index, for rows i (bit clear, kLow) and i + bit (kHigh): 0-15 pick
// from row i, 16-31 from row i + bit.
constexpr std::array<int32_t, 16> swap_indices(int bit, bool high) {
  std::array<int32_t, 16> idx{};
  for (int c = 0; c < 16; ++c) {
    if (high) idx[c] = (c & bit) ? 16 + c : c + bit;
    else idx[c] = (c & bit) ? 16 + c - bit : c;
  }
  return idx;
}

template <int Bit>
inline void swap_round(__m512 (&r)[16]) {
  static constexpr std::array<int32_t, 16> kLow = swap_indices(Bit, false), kHigh = swap_indices(Bit, true);
  const __m512i low = _mm512_loadu_si512(kLow.data()), high = _mm512_loadu_si512(kHigh.data());
  for (int i = 0; i < 16; ++i) {
    if (i & Bit) continue;
    const __m512 a = r[i], b = r[i + Bit];
    r[i] = _mm512_permutex2var_ps(a, low, b);
    r[i + Bit] = _mm512_permutex2var_ps(a, high, b);
  }
}

// dst[c * ld_dst + r] = src[r * ld_src + c] for a 16 x 16 block: four rounds, each swapping one
// bit of the row index with the same bit of the column index.
inline void transpose16(const float* src, int64_t ld_src, float* dst, int64_t ld_dst) {
  __m512 r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * ld_src);
  swap_round<1>(r);
  swap_round<2>(r);
  swap_round<4>(r);
  swap_round<8>(r);
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * ld_dst, r[i]);
}

}  // namespace treadle::vec
#endif
