// What both AMX tile kernels share (paged_prefill_amx.cpp and paged_decode_amx.cpp): the tile
// configuration, the permission to use the tiles, and the interleaves that
// turn two rows of bf16 (or fp32 rounded to bf16) into the pairs a bf16 product wants.
#pragma once

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#include <ATen/ATen.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>

namespace treadle::amx {

// Every tile 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int i = 0; i < 8; ++i) {
      bytes_per_row[i] = 64;
      rows[i] = 16;
    }
  }
};

// Whether this process may use the tiles: Linux hands them out on request (arch_prctl), once
// per process; a tile instruction without the permission dies with SIGILL. TREADLE_AMX=0
// keeps the vector kernels (tests, comparisons) and never asks.
inline bool tiles_permitted() {
  const char* off = std::getenv("TREADLE_AMX");
  if (off && off[0] == '0') return false;
  constexpr long kReqPermission = 0x1023, kTileData = 18;   // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  static const bool permitted = syscall(SYS_arch_prctl, kReqPermission, kTileData) == 0;
  return permitted;
}

// Word indices for the interleaves below: kIdx[2n] = n, kIdx[2n + 1] = offset + n.
template <int16_t kOffset>
struct PairOrder {
  alignas(64) static constexpr int16_t kIdx[32] = {
      0, kOffset, 1, kOffset + 1, 2, kOffset + 2, 3, kOffset + 3, 4, kOffset + 4, 5, kOffset + 5,
      6, kOffset + 6, 7, kOffset + 7, 8, kOffset + 8, 9, kOffset + 9, 10, kOffset + 10, 11, kOffset + 11,
      12, kOffset + 12, 13, kOffset + 13, 14, kOffset + 14, 15, kOffset + 15};
};

// Word n of the result holds bf16(lo[n]) in its low half, bf16(hi[n]) in its high half (rounded
// to nearest even): two rows of P (keys 2r and 2r + 1) as the pairs a bf16 product wants.
inline __m512i interleave_bf16(__m512 lo, __m512 hi) {
  return _mm512_permutexvar_epi16(_mm512_load_si512(PairOrder<16>::kIdx), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

// The same for two bf16 V rows of 32 dims each: words 0-15 of `low` pair dims 0-15, `high` 16-31.
inline void interleave_rows(__m512i a, __m512i b, __m512i& low, __m512i& high) {
  const __m512i order = _mm512_load_si512(PairOrder<32>::kIdx);
  low = _mm512_permutex2var_epi16(a, order, b);
  high = _mm512_permutex2var_epi16(a, _mm512_add_epi16(order, _mm512_set1_epi16(16)), b);
}

}  // namespace treadle::amx
#endif
