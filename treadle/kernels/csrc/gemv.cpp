// Linear layers at a few rows (decode at small batch): y[M, N] = x[M, K] @ w[N, K]^T + bias.
//
// At a handful of rows a linear layer is bound by reading its weight from memory once, not by
// arithmetic. oneDNN's GEMM, tuned for large M, reached about half of the copy bandwidth at
// M = 1 here; this streams each weight row once, in order (which the hardware prefetcher
// follows), and multiplies it against every row of x while it is in L1. Accumulates in fp32
// and rounds once to the output dtype, as a GEMM does.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

namespace {

constexpr int64_t kMaxRows = 8;   // rows of x handled at once; more rows go to the GEMM
constexpr int64_t kLanes = 16;    // one 512-bit vector of fp32
// Output columns per parallel task: whole cache lines of y, and enough weight rows (>= 16 KB)
// that a task's start-up is noise.
constexpr int64_t kGrain = 16;

inline float to_float(float v) { return v; }
inline float to_float(double v) { return static_cast<float>(v); }
inline float to_float(c10::BFloat16 v) {
  uint16_t raw;
  std::memcpy(&raw, &v, sizeof(raw));
  const uint32_t bits = static_cast<uint32_t>(raw) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float to_float(c10::Half v) { return static_cast<float>(v); }

template <typename scalar_t>
void gemv_impl(at::Tensor& y, const at::Tensor& x, const at::Tensor& w, const at::Tensor* bias) {
  const int64_t rows = x.size(0), k = x.size(1), n = w.size(0);
  const int64_t k_vec = k / kLanes * kLanes;
  // x in fp32 once: every weight row is multiplied against all of it.
  std::vector<float> xf(rows * k);
  const scalar_t* xd = x.data_ptr<scalar_t>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < k; ++i) xf[r * k + i] = to_float(xd[r * x.stride(0) + i]);
  const scalar_t* wd = w.data_ptr<scalar_t>();
  const scalar_t* bd = bias ? bias->data_ptr<scalar_t>() : nullptr;
  scalar_t* yd = y.data_ptr<scalar_t>();
  const int64_t ys = y.stride(0);
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    float acc[kMaxRows][kLanes];
    for (int64_t col = begin; col < end; ++col) {
      const scalar_t* wrow = wd + col * k;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < kLanes; ++j) acc[r][j] = 0.f;
      // One vector of the weight row, then every row of x against it: separate accumulators
      // per row keep the adds independent.
      for (int64_t i = 0; i < k_vec; i += kLanes) {
        float wv[kLanes];
#pragma omp simd
        for (int64_t j = 0; j < kLanes; ++j) wv[j] = to_float(wrow[i + j]);
        for (int64_t r = 0; r < rows; ++r) {
          const float* xr = xf.data() + r * k + i;
#pragma omp simd
          for (int64_t j = 0; j < kLanes; ++j) acc[r][j] += xr[j] * wv[j];
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        float sum = 0.f;
        for (int64_t j = 0; j < kLanes; ++j) sum += acc[r][j];
        for (int64_t i = k_vec; i < k; ++i) sum += xf[r * k + i] * to_float(wrow[i]);
        if (bd) sum += to_float(bd[col]);
        yd[r * ys + col] = static_cast<scalar_t>(sum);
      }
    }
  });
}

at::Tensor small_rows_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.size(0) <= kMaxRows, "small_rows_linear takes at most ", kMaxRows, " rows");
  TORCH_CHECK(x.stride(1) == 1 && w.is_contiguous(), "x rows and w must be contiguous");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "x and w must share a dtype");
  const at::Tensor* b = nullptr;
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    bias_c = bias->contiguous();
    TORCH_CHECK(bias_c.numel() == w.size(0) && bias_c.scalar_type() == w.scalar_type(), "bad bias");
    b = &bias_c;
  }
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "small_rows_linear", [&] {
    gemv_impl<scalar_t>(y, x, w, b);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(treadle, m) {
  m.def("small_rows_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(treadle, CPU, m) { m.impl("small_rows_linear", &small_rows_linear); }
