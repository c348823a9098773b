// AVX-512 helpers for the kernels: loads as fp32, an inline exp and a 16 x 16 transpose
// (compiled only where the CPU has AVX-512), their AVX2 stand-ins for 16 lanes (`Lanes16`),
// whether bf16 products can come from pairs, and a transpose of any shape.
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
#include <type_traits>

namespace treadle::vec {

// 16 bf16 words as fp32, exactly: bf16 is fp32's top half.
inline __m512 widen_bf16(__m256i words) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(words), 16));
}

// 16 consecutive values as fp32 (each conversion is exact).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 fp32 values as bf16, rounded to nearest even as torch's casts round.
inline __m256i bf16_words(__m512 x) {
#ifdef __AVX512BF16__
  return (__m256i)_mm512_cvtneps_pbh(x);
#else
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i top = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  top = _mm512_mask_mov_epi32(top, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(top);
#endif
}
inline __m256i half_words(__m512 x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

// Stores 16 fp32 values in the tensor's dtype.
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(c10::BFloat16* p, __m512 x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_words(x)); }
inline void store16(c10::Half* p, __m512 x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), half_words(x)); }

// x rounded to T and back: the value a T tensor would hold.
template <typename T>
inline __m512 round16(__m512 x) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return widen_bf16(bf16_words(x));
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return _mm512_cvtph_ps(half_words(x));
  } else {
    return x;
  }
}

// e^x for x in [-87, 0] (a little above 0 is fine too): 2^n e^r with n = round(x / ln 2) and
// |r| <= ln 2 / 2, e^r from its Taylor series to the 6th power (relative error below 2e-7).
// Inline, where libmvec's vector exp is a call that spills the loop's registers.
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);   // ln 2 in two parts, so
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);         // r keeps its low bits
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// 2^x for x in [-125, 0] (a little above 0 is fine too): 2^n 2^r with n = round(x) and
// |r| <= 1/2, 2^r from the Taylor series of e^(r ln 2) to the 6th power (relative error below
// 2e-7). For a softmax whose scale already holds log2(e): one FMA makes its argument.
inline __m512 exp2_nonpositive(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530393381608e-4f);
  for (const float c : {1.3333558146428443e-3f, 9.618129107628477e-3f, 5.550410866482158e-2f,
                        0.2402265069591007f, 0.6931471805599453f, 1.f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
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

#if defined(__AVX2__) && !defined(__AVX512F__)
#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstring>

namespace treadle::vec {

// Without AVX-512 (an AVX2 CPU): 16 fp32 lanes as two 256-bit halves, so that a kernel keeps
// the AVX-512 version's 16-lane accumulators, and with them its sums, bit for bit.
struct Lanes16 {
  __m256 lo, hi;
};

inline Lanes16 zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Lanes16 load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 widen_bf16(__m128i words) {   // exact: bf16 is fp32's top half
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(words), 16));
}
inline Lanes16 load16(const c10::BFloat16* p) {
  const __m128i* q = reinterpret_cast<const __m128i*>(p);
  return {widen_bf16(_mm_loadu_si128(q)), widen_bf16(_mm_loadu_si128(q + 1))};
}
inline Lanes16 load16(const c10::Half* p) {
#ifdef __F16C__
  const __m128i* q = reinterpret_cast<const __m128i*>(p);
  return {_mm256_cvtph_ps(_mm_loadu_si128(q)), _mm256_cvtph_ps(_mm_loadu_si128(q + 1))};
#else
  float out[16];
  for (int j = 0; j < 16; ++j) out[j] = static_cast<float>(p[j]);
  return load16(out);
#endif
}

// acc + x * w, lane by lane, the product rounded before the add (no FMA), as AVX-512's
// _mm512_add_ps(acc, _mm512_mul_ps(x, w)).
inline Lanes16 add_product(Lanes16 acc, Lanes16 x, Lanes16 w) {
  return {_mm256_add_ps(acc.lo, _mm256_mul_ps(x.lo, w.lo)), _mm256_add_ps(acc.hi, _mm256_mul_ps(x.hi, w.hi))};
}

// The sum of the 16 lanes in _mm512_reduce_add_ps's order (GCC's): the halves, then the
// quarters, then lanes {0, 1} + {2, 3}, then the last two.
inline float reduce_add(Lanes16 v) {
  const __m256 halves = _mm256_add_ps(v.hi, v.lo);
  const __m128 quarters = _mm_add_ps(_mm256_extractf128_ps(halves, 1), _mm256_castps256_ps128(halves));
  const __m128 pairs = _mm_add_ps(quarters, _mm_shuffle_ps(quarters, quarters, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(pairs) + _mm_cvtss_f32(_mm_shuffle_ps(pairs, pairs, _MM_SHUFFLE(1, 1, 1, 1)));
}

}  // namespace treadle::vec
#endif

#include <algorithm>
#include <cstdint>

namespace treadle::vec {

// dst[c * ld_dst + r] = src[r * ld_src + c] for r < rows, c < cols; with AVX-512, whole 16 x 16
// blocks go through registers. The values (or 32-bit words) are moved, never changed.
inline void transpose(const float* src, int64_t ld_src, float* dst, int64_t ld_dst, int64_t rows, int64_t cols) {
  for (int64_t r0 = 0; r0 < rows; r0 += 16)
    for (int64_t c0 = 0; c0 < cols; c0 += 16) {
      const float* s = src + r0 * ld_src + c0;
      float* d = dst + c0 * ld_dst + r0;
#ifdef __AVX512F__
      if (r0 + 16 <= rows && c0 + 16 <= cols) {
        treadle::vec::transpose16(s, ld_src, d, ld_dst);
        continue;
      }
#endif
      for (int64_t i = 0; i < std::min<int64_t>(16, rows - r0); ++i)
        for (int64_t j = 0; j < std::min<int64_t>(16, cols - c0); ++j) d[j * ld_dst + i] = s[i * ld_src + j];
    }
}

}  // namespace treadle::vec
