// bf16 linear layers at decode sizes on CPUs with AVX512-BF16 but no AMX tiles: y[M, N] =
// x[M, K] @ w[N, K]^T + bias, from one row to a few hundred (models/linear.py's PAIR_ROWS).
//
// There oneDNN's bf16 GEMM ran SmolLM2's linears well below the CPU's bf16 rate, and at a few
// rows it read the weights at a fraction of the memory's speed (docs/performance-log.md, "Lever:
// bf16 linear layers from pairs"). VDPBF16PS multiplies two bf16 pairs exactly and adds both
// products to an fp32 lane, 32 multiply-adds per instruction where fp32 takes 16.
//
// The weight is packed once (pack_linear_pairs) as panels of 32 outputs: panel p holds, for
// each pair of inputs (2i, 2i + 1), the 32 outputs' pairs side by side, so one step of i reads
// two vectors. As in the fp32 panels (linear_panels.cpp, panel_blocks.h), each thread takes a
// range of panels, the rows go by each panel in blocks of at most 12 with their 24
// accumulators in registers, and the next panel is requested into L2 meanwhile. Sums run over
// the input pairs in order, and the bias is added before the one rounding to bf16, as a GEMM
// does.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops.h"
#include "panel_blocks.h"
#include "vec.h"

#include <cstring>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 32;      // outputs per panel: two vectors of 16 fp32 sums
constexpr int64_t kMostRows = 12;   // rows per block: 24 accumulators of 32 vector registers

bool shape_fits(const at::Tensor& w) {
  return w.dim() == 2 && w.size(0) % kPanel == 0 && w.size(1) % 2 == 0 && w.size(1) > 0;
}

#ifdef __AVX512BF16__
inline __m512 load_bias(const uint16_t* b) {
  return treadle::vec::widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
}

// y[MR rows][32 outputs] = x[MR rows] . panel + bias, the accumulators in registers, while
// `ahead_lines` lines of the next panel from `ahead` are requested into L2.
template <int MR>
__attribute__((noinline)) void block(const uint16_t* x, int64_t x_stride, const uint16_t* panel, int64_t pairs,
                                     uint16_t* y, int64_t y_stride, const uint16_t* bias, const char* ahead,
                                     int64_t ahead_lines) {
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  treadle::panels::AheadLines next(ahead, ahead_lines, pairs);
  for (int64_t i = 0; i < pairs; ++i) {
    next.step();
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + i * 2 * kPanel);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + i * 2 * kPanel + kPanel);
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * x_stride + 2 * i, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xb, w0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xb, w1);
    }
  }
  if (bias) {
    const __m512 b0 = load_bias(bias), b1 = load_bias(bias + 16);
    for (int m = 0; m < MR; ++m) {
      acc[m][0] = _mm512_add_ps(acc[m][0], b0);
      acc[m][1] = _mm512_add_ps(acc[m][1], b1);
    }
  }
  for (int m = 0; m < MR; ++m)
    _mm512_storeu_si512(y + m * y_stride, (__m512i)_mm512_cvtne2ps_pbh(acc[m][1], acc[m][0]));
}

using BlockFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, uint16_t*, int64_t, const uint16_t*,
                        const char*, int64_t);
constexpr BlockFn kBlocks[kMostRows + 1] = {nullptr,   block<1>,  block<2>,  block<3>, block<4>,
                                            block<5>,  block<6>,  block<7>,  block<8>, block<9>,
                                            block<10>, block<11>, block<12>};
#endif

}  // namespace

namespace treadle {

bool linear_pairs_ready(const at::Tensor& w) {
#ifdef __AVX512BF16__
  return w.scalar_type() == at::kBFloat16 && shape_fits(w);
#else
  (void)w;
  return false;
#endif
}

at::Tensor pack_linear_pairs(const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && shape_fits(w),
              "pack_linear_pairs: a bf16 [N, K] weight with N a multiple of 32 and K even");
  const int64_t n = w.size(0), k = w.size(1);
  // [panel][output][pair][2] -> [panel][pair][output][2]
  return w.reshape({n / kPanel, kPanel, k / 2, 2}).transpose(1, 2).contiguous().reshape(
      {n / kPanel, k / 2, 2 * kPanel});
}

at::Tensor pairs_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x: bf16 [M, K], rows contiguous");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
              packed.size(2) == 2 * kPanel, "packed: from pack_linear_pairs");
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0), n = panels * kPanel;
  TORCH_CHECK(packed.size(1) * 2 == k, "x has ", k, " inputs, the packed weight ", packed.size(1) * 2);
  const at::Tensor bias_holder = linear_bias(bias, at::kBFloat16, n);
  const uint16_t* bias_ptr =
      bias_holder.defined() ? reinterpret_cast<const uint16_t*>(bias_holder.data_ptr()) : nullptr;
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
#ifdef __AVX512BF16__
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t x_stride = x.stride(0), pairs = k / 2, panel_elems = k * kPanel;
  treadle::panels::for_each_block(m, kMostRows, panels, wp, panel_elems * 2,
                                  [&](int64_t p, int64_t row, int64_t rows, const char* ahead, int64_t lines) {
    kBlocks[rows](xp + row * x_stride, x_stride, wp + p * panel_elems, pairs, yp + row * n + p * kPanel, n,
                  bias_ptr ? bias_ptr + p * kPanel : nullptr, ahead, lines);
  });
#else
  TORCH_CHECK(false, "pairs_linear: built without AVX512-BF16");
#endif
  return y;
}

}  // namespace treadle

TORCH_LIBRARY_FRAGMENT(treadle, m) {
  m.def("linear_pairs_ready(Tensor w) -> bool");
  m.def("pack_linear_pairs(Tensor w) -> Tensor");
  m.def("pairs_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(treadle, CPU, m) {
  m.impl("linear_pairs_ready", &treadle::linear_pairs_ready);
  m.impl("pack_linear_pairs", &treadle::pack_linear_pairs);
  m.impl("pairs_linear", &treadle::pairs_linear);
}
