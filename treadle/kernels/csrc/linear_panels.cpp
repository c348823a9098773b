// fp32 linear layers at decode sizes with AVX-512: y[M, N] = x[M, K] @ w[N, K]^T + bias, from a
// couple of rows to about a hundred (models/linear.py's PANEL_ROWS).
//
// There oneDNN's packed fp32 GEMM ran at 0.10-0.27 TFLOP/s on SmolLM2's shapes (8-48 rows),
// against about 0.4 for large GEMMs on the same cores: a decode step of 48 sequences spent
// 1.4-1.7 ms per layer in its linears. This kernel keeps up to 12 rows' outputs for 32 outputs
// in 24 registers while the weight goes by once, which takes 0.9-1.2 ms (docs/performance-log.md).
//
// The weight is packed once (pack_linear_panels) as panels of 32 outputs: panel p holds, for
// each input k, w[32p .. 32p + 31][k] side by side, so one step of k reads two vectors. Each
// thread takes a range of panels; for each panel, the rows go by in blocks of at most 12, each
// block's x in L1 and the panel in L2 after the first block, while the next panel is requested
// from memory (panel_blocks.h; without that, a decode step of 16 sequences was 30% longer).
// Sums run over k in order, one fused multiply-add per term, and the bias is added last, as a
// GEMM does.
#include <ATen/ATen.h>

#include "ops.h"
#include "panel_blocks.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 32;   // outputs per panel: two vectors of 16 fp32
constexpr int64_t kMostRows = 12;   // rows per block: 24 accumulators of 32 vector registers

bool shape_fits(const at::Tensor& w) { return w.dim() == 2 && w.size(0) % kPanel == 0 && w.size(1) > 0; }

#ifdef __AVX512F__
// y[MR rows][32 outputs] = x[MR rows] . panel + bias, the accumulators in registers. Meanwhile
// `ahead_lines` lines from `ahead` (a share of the next panel) are requested into L2, spread
// over the loop, so that memory streams while a panel already in L2 is multiplied.
template <int MR>
__attribute__((noinline)) void block(const float* x, int64_t x_stride, const float* panel, int64_t k, float* y,
                                     int64_t y_stride, const float* bias, const char* ahead, int64_t ahead_lines) {
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  treadle::panels::AheadLines next(ahead, ahead_lines, k);
  for (int64_t i = 0; i < k; ++i) {
    next.step();
    const __m512 w0 = _mm512_loadu_ps(panel + i * kPanel), w1 = _mm512_loadu_ps(panel + i * kPanel + 16);
    for (int m = 0; m < MR; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * x_stride + i]);
      acc[m][0] = _mm512_fmadd_ps(xb, w0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(xb, w1, acc[m][1]);
    }
  }
  if (bias) {
    const __m512 b0 = _mm512_loadu_ps(bias), b1 = _mm512_loadu_ps(bias + 16);
    for (int m = 0; m < MR; ++m) {
      acc[m][0] = _mm512_add_ps(acc[m][0], b0);
      acc[m][1] = _mm512_add_ps(acc[m][1], b1);
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm512_storeu_ps(y + m * y_stride, acc[m][0]);
    _mm512_storeu_ps(y + m * y_stride + 16, acc[m][1]);
  }
}

using BlockFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, const float*, const char*,
                        int64_t);
constexpr BlockFn kBlocks[kMostRows + 1] = {nullptr,   block<1>,  block<2>,  block<3>, block<4>,
                                            block<5>,  block<6>,  block<7>,  block<8>, block<9>,
                                            block<10>, block<11>, block<12>};
#endif

}  // namespace

namespace treadle {

bool linear_panels_ready(const at::Tensor& w) {
#ifdef __AVX512F__
  return w.scalar_type() == at::kFloat && shape_fits(w);
#else
  (void)w;
  return false;
#endif
}

at::Tensor pack_linear_panels(const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && shape_fits(w),
              "pack_linear_panels: an fp32 [N, K] weight with N a multiple of 32");
  return w.reshape({w.size(0) / kPanel, kPanel, w.size(1)}).transpose(1, 2).contiguous();
}

at::Tensor panels_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x: fp32 [M, K], rows contiguous");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.is_contiguous() &&
              packed.size(2) == kPanel, "packed: from pack_linear_panels");
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0), n = panels * kPanel;
  TORCH_CHECK(packed.size(1) == k, "x has ", k, " inputs, the packed weight ", packed.size(1));
  const at::Tensor bias_holder = linear_bias(bias, at::kFloat, n);
  const float* bias_ptr = bias_holder.defined() ? bias_holder.data_ptr<float>() : nullptr;
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
#ifdef __AVX512F__
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  treadle::panels::for_each_block(m, kMostRows, panels, wp, k * kPanel * static_cast<int64_t>(sizeof(float)),
                                  [&](int64_t p, int64_t row, int64_t rows, const char* ahead, int64_t lines) {
    kBlocks[rows](xp + row * x_stride, x_stride, wp + p * k * kPanel, k, yp + row * n + p * kPanel, n,
                  bias_ptr ? bias_ptr + p * kPanel : nullptr, ahead, lines);
  });
#else
  TORCH_CHECK(false, "panels_linear: built without AVX-512");
#endif
  return y;
}

}  // namespace treadle
