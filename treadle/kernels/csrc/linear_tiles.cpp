// bf16 linear layers on AMX tiles: y[M, N] = x[M, K] @ w[N, K]^T + bias, from a couple of rows
// (decode) to about a thousand (prefill chunks).
//
// From a few rows to a few dozen a bf16 linear is bound by reading its weight: oneDNN's GEMM
// read SmolLM2's weights at 13-15 GB/s at 8-32 rows here, where the tiles stream them at the
// memory's 20-23. From a few hundred rows it is bound by the tile products, 2.0-2.5 TFLOP/s
// here against oneDNN's 1.1-2.2 at 288-1,024 rows (it leads again from about 2,048;
// models/linear.py's TILE_ROWS). Each thread takes a range of output-block pairs (two weight
// streams), in groups that stay in L2 while every two 16-row blocks of x go by, so each
// weight is read from memory once and y is written in whole lines (docs/performance-log.md).
//
// The weight is packed once (pack_linear_tiles) as the B tiles of the product: for each block
// of 16 outputs and each 32 inputs, a 1 KB tile whose row r holds, for each output n, the
// pair (w[n][2r], w[n][2r + 1]). The A tiles (16 rows x 32 inputs) are read from x's rows
// where they lie; a last, partial block of rows from a copy padded with zero rows.
// Accumulates in fp32 and rounds once, adding the bias first, as a GEMM does.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "amx.h"
#include "ops.h"
#include "vec.h"

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
// Bytes of weights a thread keeps in its L2 (2 MiB on the Xeons measured) while rows of x
// go by them.
constexpr int64_t kL2Share = 512 << 10;

// Tiles 0-3 accumulate C for (rows m, outputs n) in the order (0,0) (0,1) (1,0) (1,1); A tiles
// 4 and 5 hold two 16-row blocks of x, B tiles 6 and 7 the two output blocks' weights. MB: how
// many of the two row blocks are live; a0 and a1 point at their first rows, `stride` bytes
// apart. `b`: the first output block's tiles (the second one `blocks_in` tiles on).
template <int MB>
void product(const uint16_t* a0, int64_t stride0, const uint16_t* a1, int64_t stride1, const uint16_t* b,
             int64_t blocks_in, float* c) {
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
    _tile_loadd(4, a0 + kb * kTileIn, stride0);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (MB > 1) {
      _tile_loadd(5, a1 + kb * kTileIn, stride1);
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

// A row's 32 outputs of a pair of output blocks, c0 and c1 (16 fp32 each), as 32 bf16
// (nearest even) in one 64-byte store, after adding 32 bias values (bf16) if there are any.
inline void store_row_pair(const float* c0, const float* c1, const uint16_t* bias, uint16_t* y) {
  __m512 lo = _mm512_loadu_ps(c0), hi = _mm512_loadu_ps(c1);
  if (bias) {
    const __m512i raw = _mm512_loadu_si512(bias);
    lo = _mm512_add_ps(lo, treadle::vec::widen_bf16(_mm512_castsi512_si256(raw)));
    hi = _mm512_add_ps(hi, treadle::vec::widen_bf16(_mm512_extracti64x4_epi64(raw, 1)));
  }
  _mm512_storeu_si512(y, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

}  // namespace
#endif

namespace treadle {

// Whether this process runs bf16 weights of w's shape on AMX tiles.
static bool amx_fits(const at::Tensor& w) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
  return w.scalar_type() == at::kBFloat16 && shape_fits(w) && treadle::amx::tiles_permitted();
#else
  (void)w;
  return false;
#endif
}

// The three entry points below hand fp32 over to linear_panels.cpp's AVX-512 kernel, and bf16
// without AMX tiles to linear_pairs.cpp's AVX512-BF16 kernel, so that a weight's blocked copy
// and its routing (models/linear.py, the layer stack) are one for all. The packed copy's rank
// says which kernel it is for: 4 for tiles, 3 for panels and pairs.
bool linear_tiles_ready(const at::Tensor& w) {
  if (w.scalar_type() == at::kFloat) return linear_panels_ready(w);
  return amx_fits(w) || linear_pairs_ready(w);
}

at::Tensor pack_linear_tiles(const at::Tensor& w) {
  if (w.scalar_type() == at::kFloat) return pack_linear_panels(w);
  if (!amx_fits(w) && linear_pairs_ready(w)) return pack_linear_pairs(w);
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
  if (x.scalar_type() == at::kFloat) return panels_linear(x, packed, bias);
  if (packed.dim() == 3) return pairs_linear(x, packed, bias);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x: bf16 [M, K], rows contiguous");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
              packed.size(0) % 2 == 0 && packed.size(2) == kTileOut && packed.size(3) == kTileIn,
              "packed: from pack_linear_tiles");
  const int64_t m = x.size(0), k = x.size(1), blocks_out = packed.size(0), blocks_in = packed.size(1);
  const int64_t n = blocks_out * kTileOut;
  TORCH_CHECK(blocks_in * kTileIn == k, "x has ", k, " inputs, the packed weight ", blocks_in * kTileIn);
  const at::Tensor bias_holder = linear_bias(bias, at::kBFloat16, n);
  const uint16_t* bias_ptr =
      bias_holder.defined() ? reinterpret_cast<const uint16_t*>(bias_holder.data_ptr()) : nullptr;
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
  TORCH_CHECK(treadle::amx::tiles_permitted(), "tiles_linear: this process may not use AMX tiles");
  // A tiles are read straight from x's rows; the rows of a last, partial row block from a
  // copy with zero rows after them.
  const int64_t blocks_rows = (m + kTileOut - 1) / kTileOut, whole = m / kTileOut;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const int64_t x_stride = x.stride(0);
  at::Tensor tail;
  if (whole < blocks_rows) {
    tail = at::zeros({kTileOut, k}, x.options());
    tail.narrow(0, 0, m - whole * kTileOut).copy_(x.narrow(0, whole * kTileOut, m - whole * kTileOut));
  }
  const uint16_t* tail_ptr = tail.defined() ? reinterpret_cast<const uint16_t*>(tail.data_ptr()) : nullptr;
  auto rows_of = [&](int64_t rb, int64_t& stride_bytes) {   // row block rb's first row
    if (rb < whole) {
      stride_bytes = x_stride * 2;
      return xp + rb * kTileOut * x_stride;
    }
    stride_bytes = k * 2;
    return tail_ptr;
  };
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t pair_bytes = 2 * k * kTileOut * 2;   // two output blocks' weights
  const int64_t group_pairs = std::max<int64_t>(1, kL2Share / pair_bytes);
  at::parallel_for(0, blocks_out / 2, 1, [&](int64_t begin, int64_t end) {
    static const treadle::amx::TileConfig config;
    _tile_loadconfig(&config);
    alignas(64) float c[4 * 256];
    // A group of weight pairs stays in L2 while every two row blocks of x (in L1) go by it,
    // each row's outputs written left to right: each weight is read from memory once, and
    // y is written in whole, consecutive lines.
    for (int64_t group = begin; group < end; group += group_pairs) {
      const int64_t group_end = std::min(end, group + group_pairs);
      for (int64_t rb = 0; rb < blocks_rows; rb += 2) {
        const int live = static_cast<int>(std::min<int64_t>(2, blocks_rows - rb));
        int64_t s0 = 0, s1 = 0;
        const uint16_t* a0 = rows_of(rb, s0);
        const uint16_t* a1 = live == 2 ? rows_of(rb + 1, s1) : a0;
        for (int64_t pair = group; pair < group_end; ++pair) {
          const int64_t nb = 2 * pair;
          const uint16_t* b = wp + nb * blocks_in * kTileElems;
          if (live == 2) product<2>(a0, s0, a1, s1, b, blocks_in, c);
          else product<1>(a0, s0, a1, s1, b, blocks_in, c);
          const uint16_t* bias_pair = bias_ptr ? bias_ptr + nb * kTileOut : nullptr;
          for (int i = 0; i < live; ++i) {
            const int64_t row0 = (rb + i) * kTileOut, rows = std::min(kTileOut, m - row0);
            for (int64_t r = 0; r < rows; ++r)
              store_row_pair(c + 2 * i * 256 + r * kTileOut, c + (2 * i + 1) * 256 + r * kTileOut, bias_pair,
                             yp + (row0 + r) * n + nb * kTileOut);
          }
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
