// Greedy sampling's argmax over logits rows (fp32, bf16 or fp16), as torch.argmax(dim=-1)
// answers it: the first index of the maximum, or of the first NaN where a row has one. torch's
// CPU argmax compares one value at a time (2 ms for 64 rows of a 49,152-token vocabulary on 2
// cores); this takes the maximum 16 lanes at a time, then finds its first index. Half-width
// rows are widened exactly in registers, so a bf16 model's greedy step need not first copy its
// logits to fp32 (12 MB at 64 rows) to get the same answer.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

#include "vec.h"

namespace {

// Rows below which one thread takes them all: a row of a large vocabulary is ~10 us.
constexpr int64_t kGrainRows = 4;

#if defined(__AVX512F__) && defined(__AVX512BW__)
using treadle::vec::load16;

// The first `lanes` of 16 values as fp32, zeros past them.
inline __m512 load_tail(const float* p, __mmask16 lanes) { return _mm512_maskz_loadu_ps(lanes, p); }
inline __m512 load_tail(const c10::BFloat16* p, __mmask16 lanes) {
  return treadle::vec::widen_bf16(_mm256_maskz_loadu_epi16(lanes, p));
}
inline __m512 load_tail(const c10::Half* p, __mmask16 lanes) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, p)); }

// The first index of the first NaN, or -1. The kernels build with -ffast-math, so `x != x`
// may fold away; the unordered compare instruction does not.
template <typename T>
int64_t first_nan(const T* x, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load16(x + i);
    const __mmask16 m = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    if (m) return i + __builtin_ctz(m);
  }
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 v = load_tail(x + i, tail);
    const __mmask16 m = _mm512_mask_cmp_ps_mask(tail, v, v, _CMP_UNORD_Q);
    if (m) return i + __builtin_ctz(m);
  }
  return -1;
}

// One pass for the maximum, noting any NaN on the way (then the first NaN answers), and one
// for the maximum's first index.
template <typename T>
int64_t row_argmax(const T* x, int64_t n) {
  const int64_t full = n / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - full)) - 1);
  __m512 best = _mm512_set1_ps(static_cast<float>(x[0]));
  __mmask16 nan = 0;
  for (int64_t i = 0; i < full; i += 16) {
    const __m512 v = load16(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, v);
  }
  if (tail) {  // lanes past the row keep `best`
    const __m512 v = _mm512_mask_mov_ps(best, tail, load_tail(x + full, tail));
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, v);
  }
  if (nan) return first_nan(x, n);
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
  for (int64_t i = 0; i < full; i += 16) {
    const __mmask16 m = _mm512_cmp_ps_mask(load16(x + i), top, _CMP_EQ_OQ);
    if (m) return i + __builtin_ctz(m);
  }
  // top is one of the values: not in the full vectors, so in the tail
  return full + __builtin_ctz(_mm512_mask_cmp_ps_mask(tail, load_tail(x + full, tail), top, _CMP_EQ_OQ));
}

template <typename T>
void argmax_each_row(const at::Tensor& logits, at::Tensor& out) {
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  const T* x = logits.data_ptr<T>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = row_argmax(x + r * stride, n);
  });
}
#endif

}  // namespace

namespace treadle {

at::Tensor argmax_rows(const at::Tensor& logits) {
  const at::ScalarType dtype = logits.scalar_type();
  TORCH_CHECK(logits.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf) &&
              logits.stride(1) == 1, "argmax_rows: fp32, bf16 or fp16 [rows, vocab] with contiguous rows");
  TORCH_CHECK(logits.size(1) > 0, "argmax_rows: an empty row has no argmax");
#if !(defined(__AVX512F__) && defined(__AVX512BW__))
  return logits.argmax(1);  // scalar compares under -ffast-math could not be trusted with NaN
#else
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  if (dtype == at::kFloat) argmax_each_row<float>(logits, out);
  else if (dtype == at::kBFloat16) argmax_each_row<c10::BFloat16>(logits, out);
  else argmax_each_row<c10::Half>(logits, out);
  return out;
#endif
}

}  // namespace treadle

TORCH_LIBRARY_FRAGMENT(treadle, m) { m.def("argmax_rows(Tensor logits) -> Tensor"); }

TORCH_LIBRARY_IMPL(treadle, CPU, m) { m.impl("argmax_rows", &treadle::argmax_rows); }
