// Linear layers at a few rows (decode at small batch): y[M, N] = x[M, K] @ w[N, K]^T + bias.
//
// At a handful of rows a linear layer is bound by reading its weight from memory once, not by
// arithmetic. oneDNN's GEMM, tuned for large M, reached about half of the copy bandwidth at
// M = 1 here; this streams each weight row once, each thread along up to eight sequential runs
// of rows (which the hardware prefetcher follows), and multiplies it against every row of x while it
// is in L1. Accumulates in fp32 and rounds once to the output dtype, as a GEMM does.
//
// `int8_rows_linear` is the same loop over weight-only int8 rows (opt-in quantization): a
// quarter of the fp32 bytes to stream at batch 1. `gguf_rows_linear` runs over a GGUF file's
// own blocks (gguf_blocks.h): a fifth to a quarter of them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "gguf_blocks.h"
#include "ops.h"
#include "vec.h"

#include <cstring>
#include <type_traits>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
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

// The weight rows in their stored form, read 16 at a time as fp32.
template <typename scalar_t>
struct DenseRows {
  const scalar_t* w;
  int64_t k;
  void load16(int64_t col, int64_t i, float* out) const {
    const scalar_t* src = w + col * k + i;
#pragma omp simd
    for (int64_t j = 0; j < kLanes; ++j) out[j] = to_float(src[j]);
  }
  float at(int64_t col, int64_t i) const { return to_float(w[col * k + i]); }
#ifdef __AVX512F__
  __m512 load16v(int64_t col, int64_t i) const {
    if constexpr (std::is_same_v<scalar_t, double>) {   // rounded to fp32 one by one
      float out[kLanes];
      load16(col, i, out);
      return _mm512_loadu_ps(out);
    } else {
      return treadle::vec::load16(w + col * k + i);
    }
  }
#elif defined(__AVX2__)
  treadle::vec::Lanes16 lanes16(int64_t col, int64_t i) const {
    if constexpr (std::is_same_v<scalar_t, double>) {
      float out[kLanes];
      load16(col, i, out);
      return treadle::vec::load16(static_cast<const float*>(out));
    } else {
      return treadle::vec::load16(w + col * k + i);
    }
  }
#endif
};

// Weight-only int8: q[N, K] with one fp32 scale per kGroup weights of a row. Each weight is
// q * scale in fp32 (one rounding), exactly the dequantized tensor the rest of the model
// multiplies by, so this kernel and the GEMM compute the same model.
constexpr int64_t kGroup = 32;
struct Int8Rows {
  const int8_t* q;
  const float* scales;
  int64_t k;
  void load16(int64_t col, int64_t i, float* out) const {
    const int8_t* src = q + col * k + i;
    const float scale = scales[(col * k + i) / kGroup];
#pragma omp simd
    for (int64_t j = 0; j < kLanes; ++j) out[j] = static_cast<float>(src[j]) * scale;
  }
  float at(int64_t col, int64_t i) const { return static_cast<float>(q[col * k + i]) * scales[(col * k + i) / kGroup]; }
#ifdef __AVX512F__
  __m512 load16v(int64_t col, int64_t i) const {
    const __m512i wide = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + col * k + i)));
    __m512 weight = _mm512_mul_ps(_mm512_cvtepi32_ps(wide), _mm512_set1_ps(scales[(col * k + i) / kGroup]));
    // Without this fence -ffast-math may reassociate x * (q * scale) into (x * scale) * q,
    // and the kernel would no longer compute the dequantized model exactly.
    asm("" : "+v"(weight));
    return weight;
  }
#elif defined(__AVX2__)
  treadle::vec::Lanes16 lanes16(int64_t col, int64_t i) const {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + col * k + i));
    const __m256 scale = _mm256_set1_ps(scales[(col * k + i) / kGroup]);
    __m256 lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), scale);
    __m256 hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8))), scale);
    asm("" : "+x"(lo), "+x"(hi));   // as above: no reassociating x * (q * scale)
    return {lo, hi};
  }
#endif
};

// The last steps of one output: the weights past the last whole vector, then the bias.
template <typename scalar_t, typename Rows>
inline scalar_t finish(float sum, const float* xr, const Rows& w, int64_t col, int64_t k_vec, int64_t k,
                       const scalar_t* bias) {
  for (int64_t i = k_vec; i < k; ++i) sum += xr[i] * w.at(col, i);
  if (bias) sum += to_float(bias[col]);
  return static_cast<scalar_t>(sum);
}

template <typename scalar_t, typename Rows>
void columns_plain(const float* xf, int64_t rows, int64_t k, const Rows& w, int64_t begin, int64_t end,
                   const scalar_t* bias, scalar_t* y, int64_t ys) {
  const int64_t k_vec = k / kLanes * kLanes;
  float acc[kMaxRows][kLanes];
  for (int64_t col = begin; col < end; ++col) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < kLanes; ++j) acc[r][j] = 0.f;
    // One vector of the weight row, then every row of x against it: separate accumulators
    // per row keep the adds independent.
    for (int64_t i = 0; i < k_vec; i += kLanes) {
      float wv[kLanes];
      w.load16(col, i, wv);
      for (int64_t r = 0; r < rows; ++r) {
        const float* xr = xf + r * k + i;
#pragma omp simd
        for (int64_t j = 0; j < kLanes; ++j) acc[r][j] += xr[j] * wv[j];
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      float sum = 0.f;
      for (int64_t j = 0; j < kLanes; ++j) sum += acc[r][j];
      y[r * ys + col] = finish(sum, xf + r * k, w, col, k_vec, k, bias);
    }
  }
}

#ifdef __AVX512F__
// S output columns at once, `gap` columns apart, against R rows of x, every accumulator in a
// register (R * S <= 16). Far-apart columns are S separate streams of weight rows: each core
// then keeps more reads in flight, which a plain pass (one stream per core, accumulators the
// compiler kept in memory) left at about 80% of the read bandwidth.
template <int R, int S, typename scalar_t, typename Rows>
inline void columns_avx512(const float* xf, int64_t k, const Rows& w, int64_t col, int64_t gap,
                           const scalar_t* bias, scalar_t* y, int64_t ys) {
  const int64_t k_vec = k / kLanes * kLanes;
  __m512 acc[R][S];
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s) acc[r][s] = _mm512_setzero_ps();
  if constexpr (requires { Rows::kVectors; }) {
    // A block of kVectors vectors per load (k_vec is then a multiple of the block): each
    // stream's block goes into every row's sum before the next stream's is loaded, which adds
    // the same products in the same order as the loop below.
    constexpr int V = Rows::kVectors;
    for (int64_t i = 0; i < k_vec; i += V * kLanes) {
      for (int s = 0; s < S; ++s) {
        __m512 wv[V];
        w.loadv(col + s * gap, i, wv);
        for (int r = 0; r < R; ++r)
          for (int v = 0; v < V; ++v) {
            acc[r][s] = _mm512_add_ps(acc[r][s], _mm512_mul_ps(_mm512_loadu_ps(xf + r * k + i + v * kLanes), wv[v]));
            asm("" : "+v"(acc[r][s]));   // -ffast-math would otherwise add the block's products first
          }
      }
    }
  } else {
    for (int64_t i = 0; i < k_vec; i += kLanes) {
      __m512 wv[S];
      for (int s = 0; s < S; ++s) wv[s] = w.load16v(col + s * gap, i);
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_loadu_ps(xf + r * k + i);
        for (int s = 0; s < S; ++s) acc[r][s] = _mm512_add_ps(acc[r][s], _mm512_mul_ps(xv, wv[s]));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s)
      y[r * ys + col + s * gap] = finish(_mm512_reduce_add_ps(acc[r][s]), xf + r * k, w, col + s * gap,
                                         k_vec, k, bias);
}

// Streams per thread at R rows of x: as many as R * S <= 16 accumulators allow, at most 8. At
// batch 1 on a Xeon, 8 streams against 2 took a decode step from 13.9 to 11.6 ms in bf16 and
// 22.0 to 19.7 in fp32; 12 were no faster (docs/performance-log.md).
template <int R>
constexpr int kStreams = R <= 2 ? 8 : (R <= 4 ? 4 : 2);

// Streams per thread over GGUF blocks, whose decoding costs more registers: 8 streams at 2
// rows of x took 8.9 ms for SmolLM2's layers where 4 took 5.4 (docs/performance-log.md).
template <int R>
constexpr int kBlockStreams = R == 1 ? 8 : (R <= 4 ? 4 : 2);

// A thread's columns [begin, end): kStreams (or kBlockStreams) streams over as many equal
// parts, then the columns left over one at a time.
template <int R, typename scalar_t, typename Rows>
void columns_avx512_range(const float* xf, int64_t k, const Rows& w, int64_t begin, int64_t end,
                          const scalar_t* bias, scalar_t* y, int64_t ys) {
  constexpr int S = requires { Rows::kVectors; } ? kBlockStreams<R> : kStreams<R>;
  const int64_t part = (end - begin) / S;
  for (int64_t col = begin; col < begin + part; ++col)
    columns_avx512<R, S>(xf, k, w, col, part, bias, y, ys);
  for (int64_t col = begin + S * part; col < end; ++col) columns_avx512<R, 1>(xf, k, w, col, 0, bias, y, ys);
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2: the AVX-512 kernel above with each 16-lane accumulator in two 256-bit halves, added and
// reduced in its order (vec::Lanes16), so that an AVX2 CPU computes the same bits. With 16
// registers of 8 lanes instead of 32 of 16, fewer streams fit: R * S accumulators take twice
// as many registers each.
template <typename Rows>
inline treadle::vec::Lanes16 lanes16(const Rows& w, int64_t col, int64_t i) { return w.lanes16(col, i); }
template <int64_t Type>
inline treadle::vec::Lanes16 lanes16(const treadle::gguf::Rows<Type>& w, int64_t col, int64_t i) {
  treadle::vec::Lanes16 out;
  w.halves16(col, i, out.lo, out.hi);
  return out;
}

template <int R, int S, typename scalar_t, typename Rows>
inline void columns_avx2(const float* xf, int64_t k, const Rows& w, int64_t col, int64_t gap,
                         const scalar_t* bias, scalar_t* y, int64_t ys) {
  namespace v = treadle::vec;
  const int64_t k_vec = k / kLanes * kLanes;
  v::Lanes16 acc[R][S];
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s) acc[r][s] = v::zero16();
  for (int64_t i = 0; i < k_vec; i += kLanes) {
    v::Lanes16 wv[S];
    for (int s = 0; s < S; ++s) wv[s] = lanes16(w, col + s * gap, i);
    for (int r = 0; r < R; ++r) {
      const v::Lanes16 xv = v::load16(xf + r * k + i);
      for (int s = 0; s < S; ++s) acc[r][s] = v::add_product(acc[r][s], xv, wv[s]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s)
      y[r * ys + col + s * gap] = finish(v::reduce_add(acc[r][s]), xf + r * k, w, col + s * gap, k_vec, k, bias);
}

template <int R>
constexpr int kAvx2Streams = R == 1 ? 4 : (R == 2 ? 2 : 1);

template <int R, typename scalar_t, typename Rows>
void columns_avx2_range(const float* xf, int64_t k, const Rows& w, int64_t begin, int64_t end,
                        const scalar_t* bias, scalar_t* y, int64_t ys) {
  constexpr int S = kAvx2Streams<R>;
  const int64_t part = (end - begin) / S;
  for (int64_t col = begin; col < begin + part; ++col) columns_avx2<R, S>(xf, k, w, col, part, bias, y, ys);
  for (int64_t col = begin + S * part; col < end; ++col) columns_avx2<R, 1>(xf, k, w, col, 0, bias, y, ys);
}
#endif

template <typename scalar_t, typename Rows>
void gemv_impl(at::Tensor& y, const at::Tensor& x, const Rows& w, int64_t n, const at::Tensor* bias) {
  const int64_t rows = x.size(0), k = x.size(1);
  // x in fp32 once: every weight row is multiplied against all of it.
  std::vector<float> xf(rows * k);
  const scalar_t* xd = x.data_ptr<scalar_t>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < k; ++i) xf[r * k + i] = to_float(xd[r * x.stride(0) + i]);
  const scalar_t* bd = bias ? bias->data_ptr<scalar_t>() : nullptr;
  scalar_t* yd = y.data_ptr<scalar_t>();
  const int64_t ys = y.stride(0);
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
#ifdef __AVX512F__
    switch (rows) {
#define TREADLE_ROWS_CASE(R) \
      case R: return columns_avx512_range<R>(xf.data(), k, w, begin, end, bd, yd, ys);
      TREADLE_ROWS_CASE(1) TREADLE_ROWS_CASE(2) TREADLE_ROWS_CASE(3) TREADLE_ROWS_CASE(4)
      TREADLE_ROWS_CASE(5) TREADLE_ROWS_CASE(6) TREADLE_ROWS_CASE(7) TREADLE_ROWS_CASE(8)
#undef TREADLE_ROWS_CASE
    }
#elif defined(__AVX2__)
    switch (rows) {
#define TREADLE_ROWS_CASE(R) \
      case R: return columns_avx2_range<R>(xf.data(), k, w, begin, end, bd, yd, ys);
      TREADLE_ROWS_CASE(1) TREADLE_ROWS_CASE(2) TREADLE_ROWS_CASE(3) TREADLE_ROWS_CASE(4)
      TREADLE_ROWS_CASE(5) TREADLE_ROWS_CASE(6) TREADLE_ROWS_CASE(7) TREADLE_ROWS_CASE(8)
#undef TREADLE_ROWS_CASE
    }
#endif
    columns_plain(xf.data(), rows, k, w, begin, end, bd, yd, ys);
  });
}

// The bias, checked against n outputs and the dtype; nullptr without one.
const at::Tensor* checked_bias(const c10::optional<at::Tensor>& bias, int64_t n, at::ScalarType dtype,
                               at::Tensor& holder) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  holder = bias->contiguous();
  TORCH_CHECK(holder.numel() == n && holder.scalar_type() == dtype, "bad bias");
  return &holder;
}

}  // namespace

namespace treadle {

at::Tensor small_rows_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.size(0) <= kMaxRows, "small_rows_linear takes at most ", kMaxRows, " rows");
  TORCH_CHECK(x.stride(1) == 1 && w.is_contiguous(), "x rows and w must be contiguous");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "x and w must share a dtype");
  at::Tensor holder;
  const at::Tensor* b = checked_bias(bias, w.size(0), w.scalar_type(), holder);
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "small_rows_linear", [&] {
    gemv_impl<scalar_t>(y, x, DenseRows<scalar_t>{w.data_ptr<scalar_t>(), w.size(1)}, w.size(0), b);
  });
  return y;
}

at::Tensor int8_rows_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                            const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(1) == q.size(1), "x [M, K] and q [N, K] expected");
  TORCH_CHECK(x.size(0) <= kMaxRows, "int8_rows_linear takes at most ", kMaxRows, " rows");
  TORCH_CHECK(q.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat, "q int8, scales float32");
  TORCH_CHECK(q.size(1) % kGroup == 0, "K must be a multiple of ", kGroup);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == q.size(0) && scales.size(1) == q.size(1) / kGroup,
              "scales [N, K / ", kGroup, "] expected");
  TORCH_CHECK(x.stride(1) == 1 && q.is_contiguous() && scales.is_contiguous(), "x rows, q and scales must be contiguous");
  at::Tensor holder;
  const at::Tensor* b = checked_bias(bias, q.size(0), x.scalar_type(), holder);
  at::Tensor y = at::empty({x.size(0), q.size(0)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_rows_linear", [&] {
    gemv_impl<scalar_t>(y, x, Int8Rows{q.data_ptr<int8_t>(), scales.data_ptr<float>(), q.size(1)}, q.size(0), b);
  });
  return y;
}

at::Tensor gguf_rows_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t ggml_type,
                            const c10::optional<at::Tensor>& bias) {
  namespace g = treadle::gguf;
  TORCH_CHECK(g::supported(ggml_type), "ggml_type must be Q4_0 (2), Q4_1 (3) or Q8_0 (8), got ", ggml_type);
  const int64_t weights = g::kBlock, bytes = g::block_bytes(ggml_type);
  TORCH_CHECK(x.dim() == 2 && blocks.dim() == 2 && x.size(1) % weights == 0, "x [M, K] with K a multiple of ",
              weights, " and blocks [N, K / ", weights, " * ", bytes, "] expected");
  const int64_t per_row = x.size(1) / weights;
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous() && blocks.size(1) == per_row * bytes,
              "blocks: contiguous uint8 [N, ", per_row, " * ", bytes, "] for K = ", x.size(1));
  TORCH_CHECK(x.size(0) <= kMaxRows, "gguf_rows_linear takes at most ", kMaxRows, " rows");
  TORCH_CHECK(x.stride(1) == 1, "x rows must be contiguous");
  at::Tensor holder;
  const at::Tensor* b = checked_bias(bias, blocks.size(0), x.scalar_type(), holder);
  at::Tensor y = at::empty({x.size(0), blocks.size(0)}, x.options());
  const uint8_t* data = blocks.data_ptr<uint8_t>();
  const int64_t n = blocks.size(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gguf_rows_linear", [&] {
    switch (ggml_type) {
      case g::kQ8_0: return gemv_impl<scalar_t>(y, x, g::Rows<g::kQ8_0>{data, per_row}, n, b);
      case g::kQ4_0: return gemv_impl<scalar_t>(y, x, g::Rows<g::kQ4_0>{data, per_row}, n, b);
      default: return gemv_impl<scalar_t>(y, x, g::Rows<g::kQ4_1>{data, per_row}, n, b);
    }
  });
  return y;
}

}  // namespace treadle

TORCH_LIBRARY_FRAGMENT(treadle, m) {
  m.def("small_rows_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("int8_rows_linear(Tensor x, Tensor q, Tensor scales, Tensor? bias) -> Tensor");
  m.def("gguf_rows_linear(Tensor x, Tensor blocks, int ggml_type, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(treadle, CPU, m) {
  m.impl("small_rows_linear", &treadle::small_rows_linear);
  m.impl("int8_rows_linear", &treadle::int8_rows_linear);
  m.impl("gguf_rows_linear", &treadle::gguf_rows_linear);
}
