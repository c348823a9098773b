// Fused elementwise ops for CPU: each makes one pass over memory where the torch expression
// it replaces makes three to five. They follow transformers' op order and round to the
// tensor's dtype where transformers does, computing in fp32 in between.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"
#include "vec.h"

#include <climits>
#include <cstring>
#include <cmath>
#include <type_traits>

namespace {

// Rows per parallel task: keep small (decode) batches on one thread.
int64_t grain_rows(int64_t row_len) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_len, 1)); }

template <typename T>
inline T round_to(float x) { return static_cast<T>(x); }

// One row: o = silu(gate) * up, silu(g) = g / (1 + e^-g) rounded to the dtype first, as
// transformers computes it.
template <typename scalar_t>
void silu_and_mul_row(const scalar_t* gate, const scalar_t* up, scalar_t* o, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  // e = e^-|g|, an argument exp_nonpositive takes (kept above its floor): then silu(g) is
  // g / (1 + e) for g >= 0 and g e / (1 + e) for g < 0, and no lane overflows. A NaN stays NaN.
  if constexpr (!std::is_same_v<scalar_t, double>) {
    const __m512 one = _mm512_set1_ps(1.f), floor = _mm512_set1_ps(-87.f), zero = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
      const __m512 g = treadle::vec::load16(gate + i);
      const __m512 neg_abs = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(g), _mm512_set1_epi32(INT32_MIN)));
      const __m512 e = treadle::vec::exp_nonpositive(_mm512_max_ps(neg_abs, floor));
      const __m512 top = _mm512_mask_mul_ps(g, _mm512_cmp_ps_mask(g, zero, _CMP_LT_OQ), g, e);
      // 1 / (1 + e) from rcp14 and a Newton step (within an ulp or two), as a division's
      // throughput would bound the loop.
      const __m512 d = _mm512_add_ps(one, e);
      __m512 r = _mm512_rcp14_ps(d);
      r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
      const __m512 silu = treadle::vec::round16<scalar_t>(_mm512_mul_ps(top, r));
      treadle::vec::store16(o + i, _mm512_mul_ps(silu, treadle::vec::load16(up + i)));
    }
  }
#endif
  // The same rewrite without AVX-512 (and for the tail): e^-g itself overflows past g = -88,
  // and under -ffast-math glibc's vector exp then returns garbage (NaN on an AVX2 Zen 3).
  for (; i < n; ++i) {
    const float g = static_cast<float>(gate[i]);
    const float e = std::exp(std::max(-std::fabs(g), -87.f));
    const float s = static_cast<float>(round_to<scalar_t>((g < 0.f ? g * e : g) / (1.f + e)));
    o[i] = round_to<scalar_t>(s * static_cast<float>(up[i]));
  }
}

// x: [rows, 2 * n] -> out: [rows, n] = silu(x[:, :n]) * x[:, n:]
template <typename scalar_t>
void silu_and_mul_impl(at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  const int64_t xs = x.stride(0), os = out.stride(0);
  const scalar_t* xd = x.data_ptr<scalar_t>();
  scalar_t* od = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, grain_rows(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_and_mul_row(xd + r * xs, xd + r * xs + n, od + r * os, n);
  });
}

// One row: o = weight * round(src * rsqrt(mean(src^2) + eps)), RMSNorm as transformers
// computes it (in fp32, rounded to the dtype before the weight). Never inlined: one compiled
// sum of squares for every caller, so a norm after a fused add has the same bits as alone.
template <typename scalar_t>
__attribute__((noinline)) void rms_norm_row(const scalar_t* src, const scalar_t* w, scalar_t* o, int64_t d, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < d; ++i) sum += static_cast<float>(src[i]) * static_cast<float>(src[i]);
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(d) + eps);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i)
    o[i] = round_to<scalar_t>(static_cast<float>(w[i]) *
                              static_cast<float>(round_to<scalar_t>(static_cast<float>(src[i]) * inv)));
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
  at::parallel_for(0, rows, grain_rows(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      rms_norm_row(xd + (r / inner) * s0 + (r % inner) * s1, w, od + r * d, d, static_cast<float>(eps));
  });
}

// sum = round(x + residual) and out = RMSNorm(sum), row by row in one pass: the residual add
// before each norm of a decoder layer, as transformers rounds it (the add in the dtype).
template <typename scalar_t>
void add_rms_norm_impl(at::Tensor& sum, at::Tensor& out, const at::Tensor& x, const at::Tensor& residual,
                       const at::Tensor& weight, double eps) {
  const int64_t d = x.size(1), xs = x.stride(0), rs = residual.stride(0);
  const scalar_t* xd = x.data_ptr<scalar_t>();
  const scalar_t* rd = residual.data_ptr<scalar_t>();
  const scalar_t* w = weight.data_ptr<scalar_t>();
  scalar_t* sd = sum.data_ptr<scalar_t>();
  scalar_t* od = out.data_ptr<scalar_t>();
  at::parallel_for(0, x.size(0), grain_rows(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* s = sd + r * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i)
        s[i] = round_to<scalar_t>(static_cast<float>(xd[r * xs + i]) + static_cast<float>(rd[r * rs + i]));
      rms_norm_row(s, w, od + r * d, d, static_cast<float>(eps));
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

// Each token's new K and V ([T, kv_heads, head_dim], a token's heads side by side) into its
// slot of the cache [2, blocks, block_size, kv_heads, head_dim]: what index_copy_ does, as a
// copy of a token's heads at once. Shared by the Python layers and the layer stack; in place
// it took as long as index_copy_ (the first writes to fresh cache pages dominate both).
void write_kv_(at::Tensor cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_mapping) {
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.stride(3) == cache.size(4) && cache.stride(4) == 1,
              "write_kv_: cache [2, blocks, block_size, kv_heads, head_dim], each slot's heads contiguous");
  for (const at::Tensor* x : {&k, &v})
    TORCH_CHECK(x->dim() == 3 && x->size(1) == cache.size(3) && x->size(2) == cache.size(4) &&
                x->stride(1) == x->size(2) && x->stride(2) == 1 && x->scalar_type() == cache.scalar_type() &&
                x->size(0) == k.size(0), "write_kv_: k and v [T, kv_heads, head_dim] in the cache's dtype, each token's heads contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.numel() == k.size(0), "write_kv_: one int64 slot per token");
  const int64_t elem = k.element_size(), block_size = cache.size(2);
  const int64_t bytes = k.size(1) * k.size(2) * elem;
  char* base = static_cast<char*>(cache.data_ptr());
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < k.size(0); ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < cache.size(1) * block_size, "cache slot ", slots[t], " out of range");
  // Both threads from a few hundred tokens on: the first writes to fresh cache pages fault.
  at::parallel_for(0, k.size(0), 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t at = ((slots[t] / block_size) * cache.stride(1) + (slots[t] % block_size) * cache.stride(2)) * elem;
      std::memcpy(base + at, static_cast<const char*>(k.data_ptr()) + t * k.stride(0) * elem, bytes);
      std::memcpy(base + at + cache.stride(0) * elem, static_cast<const char*>(v.data_ptr()) + t * v.stride(0) * elem, bytes);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && residual.sizes() == x.sizes() && residual.stride(1) == 1 &&
              residual.scalar_type() == x.scalar_type(), "add_rms_norm: x and residual [rows, d], d contiguous, one dtype");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
              weight.scalar_type() == x.scalar_type(), "add_rms_norm: weight [d] in x's dtype");
  at::Tensor sum = at::empty(x.sizes(), x.options()), out = at::empty(x.sizes(), x.options());
  DISPATCH(x.scalar_type(), "add_rms_norm", [&] { add_rms_norm_impl<scalar_t>(sum, out, x, residual, weight, eps); });
  return {sum, out};
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
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("write_kv_(Tensor(a!) cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(treadle, CPU, m) {
  m.impl("silu_and_mul", &treadle::silu_and_mul);
  m.impl("rms_norm", &treadle::rms_norm);
  m.impl("add_rms_norm", &treadle::add_rms_norm);
  m.impl("rope_", &treadle::rope_);
  m.impl("write_kv_", &treadle::write_kv_);
}
