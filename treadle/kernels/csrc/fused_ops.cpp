// Fused elementwise ops for CPU: each makes one pass over memory where the torch expression
// it replaces makes three to five. They follow transformers' op order and round to the
// tensor's dtype where transformers does, computing in fp32 in between.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"

#include <cmath>

namespace {

// Rows per parallel task: keep small (decode) batches on one thread.
int64_t grain_rows(int64_t row_len) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_len, 1)); }

template <typename T>
inline T round_to(float x) { return static_cast<T>(x); }

// x: [rows, 2 * n] -> out: [rows, n] = silu(x[:, :n]) * x[:, n:]
template <typename scalar_t>
void silu_and_mul_impl(at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  const int64_t xs = x.stride(0), os = out.stride(0);
  const scalar_t* xd = x.data_ptr<scalar_t>();
  scalar_t* od = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, grain_rows(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* gate = xd + r * xs;
      const scalar_t* up = gate + n;
      scalar_t* o = od + r * os;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float g = static_cast<float>(gate[i]);
        const float s = static_cast<float>(round_to<scalar_t>(g / (1.f + std::exp(-g))));
        o[i] = round_to<scalar_t>(s * static_cast<float>(up[i]));
      }
    }
  });
}

// Rows of length d at x + (r / inner) * s0 + (r % inner) * s1.
template <typename scalar_t>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t d = x.size(-1);
  const int64_t inner = x.dim() == 3 ? x.size(1) : 1;
  const int64_t rows = x.numel() / d;
  const int64_t s0 = x.stride(0), s1 = x.dim() == 3 ? x.stride(1) : 0;
  const scalar_t* xd = x.data_ptr<scalar_t>();
  const scalar_t* w = weight.data_ptr<scalar_t>();
  scalar_t* od = out.data_ptr<scalar_t>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* src = xd + (r / inner) * s0 + (r % inner) * s1;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < d; ++i) sum += static_cast<float>(src[i]) * static_cast<float>(src[i]);
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(d) + feps);
      scalar_t* o = od + r * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i)
        o[i] = round_to<scalar_t>(static_cast<float>(w[i]) *
                                  static_cast<float>(round_to<scalar_t>(static_cast<float>(src[i]) * inv)));
    }
  });
}

// In place, rotate-half RoPE on x [T, H, D] (any stride over T and H) with cos/sin [T, D]
// already in x's dtype: x * cos + rotate_half(x) * sin, rounding each product as torch does.
template <typename scalar_t>
void rope_impl(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  scalar_t* xd = x.data_ptr<scalar_t>();
  const scalar_t* cd = cos.data_ptr<scalar_t>();
  const scalar_t* sd = sin.data_ptr<scalar_t>();
  at::parallel_for(0, tokens, grain_rows(heads * d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* c = cd + t * d;
      const scalar_t* s = sd + t * d;
      for (int64_t h = 0; h < heads; ++h) {
        scalar_t* v = xd + t * s0 + h * s1;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float lo = static_cast<float>(v[i]), hi = static_cast<float>(v[i + half]);
          const float a = static_cast<float>(round_to<scalar_t>(lo * static_cast<float>(c[i])));
          const float b = static_cast<float>(round_to<scalar_t>(-hi * static_cast<float>(s[i])));
          const float e = static_cast<float>(round_to<scalar_t>(hi * static_cast<float>(c[i + half])));
          const float f = static_cast<float>(round_to<scalar_t>(lo * static_cast<float>(s[i + half])));
          v[i] = round_to<scalar_t>(a + b);
          v[i + half] = round_to<scalar_t>(e + f);
        }
      }
    }
  });
}

}  // namespace

#define DISPATCH(t, name, ...) AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, t, name, __VA_ARGS__)

namespace treadle {

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "silu_and_mul: x [rows, 2n], rows contiguous");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  DISPATCH(x.scalar_type(), "silu_and_mul", [&] { silu_and_mul_impl<scalar_t>(out, x); });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1, "rms_norm: x [rows, d] or [t, h, d], d contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.is_contiguous() &&
              weight.scalar_type() == x.scalar_type(), "rms_norm: weight [d] in x's dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  DISPATCH(x.scalar_type(), "rms_norm", [&] { rms_norm_impl<scalar_t>(out, x, weight, eps); });
  return out;
}

void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "rope_: x [t, h, d], d even and contiguous");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == x.size(0) * x.size(2) &&
              sin.numel() == cos.numel() && cos.scalar_type() == x.scalar_type() &&
              sin.scalar_type() == x.scalar_type(), "rope_: cos/sin [t, d] contiguous, in x's dtype");
  DISPATCH(x.scalar_type(), "rope_", [&] { rope_impl<scalar_t>(x, cos, sin); });
}

}  // namespace treadle

TORCH_LIBRARY_FRAGMENT(treadle, m) {
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(treadle, CPU, m) {
  m.impl("silu_and_mul", &treadle::silu_and_mul);
  m.impl("rms_norm", &treadle::rms_norm);
  m.impl("rope_", &treadle::rope_);
}
