// AVX-512 helpers the kernels share (compiled only where the CPU has AVX-512).
#pragma once

#ifdef __AVX512F__
#include <ATen/ATen.h>
#include <immintrin.h>

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

}  // namespace treadle::vec
#endif
