// fp32 linear layers at prefill sizes on AMX tiles: y[M, N] = x[M, K] @ w[N, K]^T + bias, each
// fp32 operand split into three bf16 parts (x = x_hi + x_mid + x_lo, the same for w), whose
// products the tiles multiply exactly and sum in fp32.
//
// Above about a hundred rows an fp32 linear is bound by its multiplies, and oneDNN's packed
// fp32 GEMM ran at 0.21-0.45 TFLOP/s here, where the tiles multiply bf16 at several TFLOP/s.
// Splitting a float into three bf16 keeps its 24 significant bits (8 and a sign each, each part
// the nearest bf16 to what the ones before it left); of the nine products of the parts this
// kernel sums the six that reach fp32's precision (hi.hi, hi.mid, mid.hi, mid.mid, hi.lo,
// lo.hi). Those left out come to at most 2^-23 of the product, about one fp32 rounding of it,
// and each product of two bf16 is exact in fp32. So the result differs from an fp32 GEMM's by
// about as much as two fp32 GEMMs that sum in other orders differ, as the panels and oneDNN
// do (tests/test_linear_bf16x3.py holds it to a float64 GEMM beside oneDNN's error).
//
// The weight is packed once (pack_linear_bf16x3) as the B tiles of the tile kernel
// (linear_tiles.cpp), the three parts of each block of 16 outputs and 32 inputs side by side.
// x is split per call into its parts, laid out as A tiles the same way, with zero rows up to a
// multiple of 16. Each thread takes a range of output-block pairs, in groups that stay in L2
// while every two 16-row blocks of x go by; the tiles start from the bias and are stored
// straight into y. Parts below 2^-126 count as zero, as in any bf16 product on these units:
// far below fp32's rounding of a sum.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "amx.h"
#include "ops.h"
#include "vec.h"

#include <algorithm>

namespace {

constexpr int64_t kTileOut = 16, kTileIn = 32, kTileElems = kTileOut * kTileIn, kParts = 3;

bool shape_fits(const at::Tensor& w) {
  return w.dim() == 2 && w.size(0) % (2 * kTileOut) == 0 && w.size(1) % kTileIn == 0 && w.size(1) > 0;
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
// Bytes of weights a thread keeps in its L2 (2 MiB on the Xeons measured) while rows of x go by.
constexpr int64_t kL2Share = 1 << 20;

// 32 floats as three times 32 bf16 whose sum is them: each part the nearest bf16 to what the
// parts before it left over (exact differences in fp32).
inline void split32(const float* v, uint16_t* hi, uint16_t* mid, uint16_t* lo) {
  __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
  uint16_t* parts[kParts] = {hi, mid, lo};
  for (int p = 0; p < kParts; ++p) {
    const __m512i part = (__m512i)_mm512_cvtne2ps_pbh(b, a);
    _mm512_storeu_si512(parts[p], part);
    a = _mm512_sub_ps(a, treadle::vec::widen_bf16(_mm512_castsi512_si256(part)));
    b = _mm512_sub_ps(b, treadle::vec::widen_bf16(_mm512_extracti64x4_epi64(part, 1)));
  }
}

// Tiles 0-3 accumulate C for (row block i, output block j) in the order (0,0) (0,1) (1,0)
// (1,1); tiles 4 and 5 hold a part of the two row blocks of x, 6 and 7 a part of the two
// output blocks' weights. a and b: the first row block's and the first output block's tiles,
// three per 32 inputs (the second block's `blocks_in` * 3 tiles on, for each). Each 32 inputs
// run the six products, the small ones first, while the next 32 inputs' tiles are requested.
template <int MB>
void product(const uint16_t* a, const uint16_t* b, int64_t blocks_in, const float* bias, float* c0,
             int64_t stride0, float* c1, int64_t stride1) {
  if (bias) {   // every row starts from the bias (a tile read with a stride of 0)
    _tile_loadd(0, bias, 0);
    _tile_loadd(1, bias + kTileOut, 0);
    if constexpr (MB > 1) {
      _tile_loadd(2, bias, 0);
      _tile_loadd(3, bias + kTileOut, 0);
    }
  } else {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (MB > 1) {
      _tile_zero(2);
      _tile_zero(3);
    }
  }
  const uint16_t* a1 = a + blocks_in * kParts * kTileElems;
  const uint16_t* b1 = b + blocks_in * kParts * kTileElems;
  auto load_a = [&](int part, int64_t kb) {
    _tile_loadd(4, a + (kb * kParts + part) * kTileElems, 64);
    if constexpr (MB > 1) _tile_loadd(5, a1 + (kb * kParts + part) * kTileElems, 64);
  };
  auto load_b = [&](int part, int64_t kb) {
    _tile_loadd(6, b + (kb * kParts + part) * kTileElems, 64);
    _tile_loadd(7, b1 + (kb * kParts + part) * kTileElems, 64);
  };
  auto multiply = [&]() {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (MB > 1) {
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  };
  for (int64_t kb = 0; kb < blocks_in; ++kb) {
    const int64_t ahead = (kb + 1) * kParts * kTileElems;
    for (int line = 0; line < kParts * kTileElems * 2; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(b + ahead) + line, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(b1 + ahead) + line, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(a + ahead) + line, _MM_HINT_T0);
      if constexpr (MB > 1) _mm_prefetch(reinterpret_cast<const char*>(a1 + ahead) + line, _MM_HINT_T0);
    }
    load_a(2, kb);   // lo . hi
    load_b(0, kb);
    multiply();
    load_a(1, kb);   // mid . hi
    multiply();
    load_b(1, kb);   // mid . mid
    multiply();
    load_a(0, kb);   // hi . mid
    multiply();
    load_b(2, kb);   // hi . lo
    multiply();
    load_b(0, kb);   // hi . hi
    multiply();
  }
  _tile_stored(0, c0, stride0);
  _tile_stored(1, c0 + kTileOut, stride0);
  if constexpr (MB > 1) {
    _tile_stored(2, c1, stride1);
    _tile_stored(3, c1 + kTileOut, stride1);
  }
}
#endif

}  // namespace

namespace treadle {

bool linear_bf16x3_ready(const at::Tensor& w) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
  return w.scalar_type() == at::kFloat && shape_fits(w) && treadle::amx::tiles_permitted();
#else
  (void)w;
  return false;
#endif
}

at::Tensor pack_linear_bf16x3(const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && shape_fits(w),
              "pack_linear_bf16x3: an fp32 [N, K] weight with N a multiple of 32 and K of 32");
  const at::Tensor wc = w.contiguous();
  const int64_t n = w.size(0), k = w.size(1), blocks_out = n / kTileOut, blocks_in = k / kTileIn;
  // The parts of the weight, row by row, then laid out as tiles.
  at::Tensor hi = wc.to(at::kBFloat16), rest = wc - hi.to(at::kFloat);
  at::Tensor mid = rest.to(at::kBFloat16), lo = (rest - mid.to(at::kFloat)).to(at::kBFloat16);
  at::Tensor parts = at::stack({hi, mid, lo});   // [3, N, K]
  // tile[nb][kb][p][r][2o + q] = part p of w[16 nb + o][32 kb + 2r + q]
  return parts.view({kParts, blocks_out, kTileOut, blocks_in, kTileOut, 2})
      .permute({1, 3, 0, 4, 2, 5})
      .contiguous()
      .view({blocks_out, blocks_in, kParts, kTileOut, kTileIn});
}

at::Tensor bf16x3_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x: fp32 [M, K], rows contiguous");
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
              packed.size(0) % 2 == 0 && packed.size(2) == kParts && packed.size(3) == kTileOut &&
              packed.size(4) == kTileIn, "packed: from pack_linear_bf16x3");
  const int64_t m = x.size(0), k = x.size(1), blocks_out = packed.size(0), blocks_in = packed.size(1);
  const int64_t n = blocks_out * kTileOut;
  TORCH_CHECK(blocks_in * kTileIn == k, "x has ", k, " inputs, the packed weight ", blocks_in * kTileIn);
  const at::Tensor bias_holder = linear_bias(bias, at::kFloat, n);
  const float* bias_ptr = bias_holder.defined() ? bias_holder.data_ptr<float>() : nullptr;
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
  TORCH_CHECK(treadle::amx::tiles_permitted(), "bf16x3_linear: this process may not use AMX tiles");
  const int64_t blocks_rows = (m + kTileOut - 1) / kTileOut, rows_padded = blocks_rows * kTileOut;
  // x's parts as A tiles, laid out as the weight's: [row block][32 inputs][part][16 rows][32].
  at::Tensor xs = at::empty({blocks_rows, blocks_in, kParts, kTileOut, kTileIn}, x.options().dtype(at::kBFloat16));
  if (m < rows_padded) xs.select(0, blocks_rows - 1).zero_();   // the zero rows of a last, partial block
  uint16_t* xsp = reinterpret_cast<uint16_t*>(xs.data_ptr());
  const float* xp = x.data_ptr<float>();
  const int64_t x_stride = x.stride(0), block_elems = blocks_in * kParts * kTileElems;
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      uint16_t* row = xsp + (r / kTileOut) * block_elems + (r % kTileOut) * kTileIn;
      for (int64_t kb = 0; kb < blocks_in; ++kb) {
        uint16_t* hi = row + kb * kParts * kTileElems;
        split32(xp + r * x_stride + kb * kTileIn, hi, hi + kTileElems, hi + 2 * kTileElems);
      }
    }
  });
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  float* yp = y.data_ptr<float>();
  const int64_t pair_bytes = 2 * blocks_in * kParts * kTileElems * 2;
  const int64_t group_pairs = std::max<int64_t>(1, kL2Share / pair_bytes);
  at::parallel_for(0, blocks_out / 2, 1, [&](int64_t begin, int64_t end) {
    static const treadle::amx::TileConfig config;
    _tile_loadconfig(&config);
    alignas(64) float tail[kTileOut * 2 * kTileOut];   // a last, partial row block's outputs
    for (int64_t group = begin; group < end; group += group_pairs) {
      const int64_t group_end = std::min(end, group + group_pairs);
      for (int64_t rb = 0; rb < blocks_rows; rb += 2) {
        const int live = static_cast<int>(std::min<int64_t>(2, blocks_rows - rb));
        const uint16_t* a = xsp + rb * block_elems;
        const int64_t row0 = rb * kTileOut, rows_last = std::min(kTileOut, m - (rb + live - 1) * kTileOut);
        for (int64_t pair = group; pair < group_end; ++pair) {
          const int64_t nb = 2 * pair;
          const uint16_t* b = wp + nb * blocks_in * kParts * kTileElems;
          const float* bias_pair = bias_ptr ? bias_ptr + nb * kTileOut : nullptr;
          // Whole row blocks straight into y; a partial last one by way of `tail`.
          float* y_rows[2] = {yp + row0 * n + nb * kTileOut, yp + (row0 + kTileOut) * n + nb * kTileOut};
          float* c[2] = {y_rows[0], y_rows[1]};
          int64_t strides[2] = {n * 4, n * 4};
          if (rows_last < kTileOut) {
            c[live - 1] = tail;
            strides[live - 1] = 2 * kTileOut * 4;
          }
          if (live == 2) product<2>(a, b, blocks_in, bias_pair, c[0], strides[0], c[1], strides[1]);
          else product<1>(a, b, blocks_in, bias_pair, c[0], strides[0], nullptr, 0);
          if (rows_last < kTileOut)
            for (int64_t r = 0; r < rows_last; ++r)
              std::copy_n(tail + r * 2 * kTileOut, 2 * kTileOut, y_rows[live - 1] + r * n);
        }
      }
    }
    _tile_release();
  });
#else
  TORCH_CHECK(false, "bf16x3_linear: built without AMX tiles");
#endif
  return y;
}

}  // namespace treadle

TORCH_LIBRARY_FRAGMENT(treadle, m) {
  m.def("linear_bf16x3_ready(Tensor w) -> bool");
  m.def("pack_linear_bf16x3(Tensor w) -> Tensor");
  m.def("bf16x3_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(treadle, CPU, m) {
  m.impl("linear_bf16x3_ready", &treadle::linear_bf16x3_ready);
  m.impl("pack_linear_bf16x3", &treadle::pack_linear_bf16x3);
  m.impl("bf16x3_linear", &treadle::bf16x3_linear);
}
