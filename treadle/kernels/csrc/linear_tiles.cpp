// bf16 linear layers on AMX tiles at decode batch sizes: y[M, N] = x[M, K] @ w[N, K]^T + bias.
//
// From a few rows to a few dozen, a bf16 linear is bound by reading its weight, and a tile
// product (16 rows x 16 outputs x 32 inputs) is cheap beside that. oneDNN's GEMM read
// SmolLM2's weights at 13-15 GB/s at 8-32 rows here, where one core streams 27 GB/s; this
// keeps each thread on two weight streams, each output tile's weights read once per 32 rows
// of x (docs/benchmarks.md). Above a few dozen rows the tiles wait on their own loads, and
// oneDNN takes over (models/linear.py's TILE_ROWS).
//
// The weight is packed once (pack_linear_tiles) as the B tiles of the product: for each block
// of 16 outputs and each 32 inputs, a 1 KB tile whose row r holds, for each output n, the
// pair (w[n][2r], w[n][2r + 1]). x is packed per call as A tiles (16 rows x 32 inputs, rows
// past M zero). Accumulates in fp32 and rounds once, adding the bias first, as a GEMM does.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "amx.h"
#include "ops.h"

#include <algorithm>
#include <cstring>

namespace {

constexpr int64_t kTileOut = 16, kTileIn = 32, kTileElems = kTileOut * kTileIn;

bool shape_fits(const at::Tensor& w) {
  // Output blocks go in pairs (two weight streams per thread).
  return w.dim() == 2 && w.size(0) % (2 * kTileOut) == 0 && w.size(1) % kTileIn == 0 && w.size(1) > 0;
}

}  // namespace

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
namespace {

// Tokens of weight tiles ahead to request from memory, per stream.
constexpr int64_t kPrefetchTiles = 4;

// Tiles 0-3 accumulate C for (rows m, outputs n) in the order (0,0) (0,1) (1,0) (1,1); A tiles
// 4 and 5 hold two 16-row blocks of x, B tiles 6 and 7 the two output blocks' weights. MB: how
// many of the two row blocks are live. `a`: x's packed tiles for the first row block (the
// second one `a_step` elements on), `b`: the first output block's tiles (the second one
// `blocks_in` tiles on).
template <int MB>
void product(const uint16_t* a, int64_t a_step, const uint16_t* b, int64_t blocks_in, float* c) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (MB > 1) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const uint16_t* b1 = b + blocks_in * kTileElems;
  for (int64_t kb = 0; kb < blocks_in; ++kb) {
    const char* ahead0 = reinterpret_cast<const char*>(b + (kb + kPrefetchTiles) * kTileElems);
    const char* ahead1 = reinterpret_cast<const char*>(b1 + (kb + kPrefetchTiles) * kTileElems);
    for (int line = 0; line < 1024; line += 64) {
      _mm_prefetch(ahead0 + line, _MM_HINT_T0);
      _mm_prefetch(ahead1 + line, _MM_HINT_T0);
    }
    _tile_loadd(6, b + kb * kTileElems, 64);
    _tile_loadd(7, b1 + kb * kTileElems, 64);
    _tile_loadd(4, a + kb * kTileElems, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (MB > 1) {
      _tile_loadd(5, a + a_step + kb * kTileElems, 64);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 64);
  _tile_stored(1, c + 256, 64);
  if constexpr (MB > 1) {
    _tile_stored(2, c + 512, 64);
    _tile_stored(3, c + 768, 64);
  }
}

// 16 fp32 -> 16 bf16 (nearest even), after adding 16 bias values (bf16) if there are any.
inline void store_row(const float* c, const uint16_t* bias, uint16_t* y) {
  __m512 v = _mm512_loadu_ps(c);
  if (bias) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias));
    v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)_mm512_cvtneps_pbh(v));
}

}  // namespace
#endif

namespace treadle {

bool linear_tiles_ready(const at::Tensor& w) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
  return w.scalar_type() == at::kBFloat16 && shape_fits(w) && treadle::amx::tiles_permitted();
#else
  (void)w;
  return false;
#endif
}

at::Tensor pack_linear_tiles(const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && shape_fits(w),
              "pack_linear_tiles: a bf16 [N, K] weight with N a multiple of 32 and K of 32");
  const at::Tensor wc = w.contiguous();
  const int64_t n = w.size(0), k = w.size(1), blocks_out = n / kTileOut, blocks_in = k / kTileIn;
  at::Tensor out = at::empty({blocks_out, blocks_in, kTileOut, kTileIn}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wc.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, blocks_out, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb)
      for (int64_t kb = 0; kb < blocks_in; ++kb) {
        uint16_t* tile = dst + (nb * blocks_in + kb) * kTileElems;
        for (int64_t r = 0; r < kTileOut; ++r)      // pair row r: inputs 2r and 2r + 1
          for (int64_t o = 0; o < kTileOut; ++o)
            for (int64_t p = 0; p < 2; ++p)
              tile[r * kTileIn + 2 * o + p] = src[(nb * kTileOut + o) * k + kb * kTileIn + 2 * r + p];
      }
  });
  return out;
}

at::Tensor tiles_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x: bf16 [M, K], rows contiguous");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
              packed.size(0) % 2 == 0 && packed.size(2) == kTileOut && packed.size(3) == kTileIn,
              "packed: from pack_linear_tiles");
  const int64_t m = x.size(0), k = x.size(1), blocks_out = packed.size(0), blocks_in = packed.size(1);
  const int64_t n = blocks_out * kTileOut;
  TORCH_CHECK(blocks_in * kTileIn == k, "x has ", k, " inputs, the packed weight ", blocks_in * kTileIn);
  const uint16_t* bias_ptr = nullptr;
  at::Tensor bias_holder;
  if (bias.has_value() && bias->defined()) {
    bias_holder = bias->contiguous();
    TORCH_CHECK(bias_holder.scalar_type() == at::kBFloat16 && bias_holder.numel() == n, "bias: bf16 [N]");
    bias_ptr = reinterpret_cast<const uint16_t*>(bias_holder.data_ptr());
  }
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
  TORCH_CHECK(treadle::amx::tiles_permitted(), "tiles_linear: this process may not use AMX tiles");
  // x as A tiles: [row block][input block][16 rows][32 inputs], rows past m zero.
  const int64_t blocks_rows = (m + kTileOut - 1) / kTileOut;
  at::Tensor a = at::empty({blocks_rows, blocks_in, kTileOut, kTileIn}, x.options());
  {
    const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
    uint16_t* ad = reinterpret_cast<uint16_t*>(a.data_ptr());
    for (int64_t r = 0; r < blocks_rows * kTileOut; ++r)
      for (int64_t kb = 0; kb < blocks_in; ++kb) {
        uint16_t* dst = ad + ((r / kTileOut) * blocks_in + kb) * kTileElems + (r % kTileOut) * kTileIn;
        if (r < m) std::memcpy(dst, xs + r * x.stride(0) + kb * kTileIn, kTileIn * sizeof(uint16_t));
        else std::memset(dst, 0, kTileIn * sizeof(uint16_t));
      }
  }
  const uint16_t* ap = reinterpret_cast<const uint16_t*>(a.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t a_step = blocks_in * kTileElems;
  at::parallel_for(0, blocks_out / 2, 1, [&](int64_t begin, int64_t end) {
    static const treadle::amx::TileConfig config;
    _tile_loadconfig(&config);
    alignas(64) float c[4 * 256];
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t nb = 2 * pair;
      const uint16_t* b = wp + nb * blocks_in * kTileElems;
      for (int64_t rb = 0; rb < blocks_rows; rb += 2) {   // two row blocks at a time
        const int live = static_cast<int>(std::min<int64_t>(2, blocks_rows - rb));
        if (live == 2) product<2>(ap + rb * a_step, a_step, b, blocks_in, c);
        else product<1>(ap + rb * a_step, a_step, b, blocks_in, c);
        for (int i = 0; i < live; ++i) {
          const int64_t row0 = (rb + i) * kTileOut, rows = std::min(kTileOut, m - row0);
          for (int j = 0; j < 2; ++j)
            for (int64_t r = 0; r < rows; ++r)
              store_row(c + (2 * i + j) * 256 + r * kTileOut, bias_ptr ? bias_ptr + (nb + j) * kTileOut : nullptr,
                        yp + (row0 + r) * n + (nb + j) * kTileOut);
        }
      }
    }
    _tile_release();
  });
#else
  TORCH_CHECK(false, "tiles_linear: built without AMX tiles");
#endif
  return y;
}

}  // namespace treadle

TORCH_LIBRARY_FRAGMENT(treadle, m) {
  m.def("linear_tiles_ready(Tensor w) -> bool");
  m.def("pack_linear_tiles(Tensor w) -> Tensor");
  m.def("tiles_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(treadle, CPU, m) {
  m.impl("linear_tiles_ready", &treadle::linear_tiles_ready);
  m.impl("pack_linear_tiles", &treadle::pack_linear_tiles);
  m.impl("tiles_linear", &treadle::tiles_linear);
}
