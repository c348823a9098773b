// Paged decode attention for CPU: one query token per sequence, reading K/V straight out of
// the block table. The torch path gathers K/V into a dense buffer first and SDPA reads it
// again, which triples the memory traffic that bounds decode attention.
//
// Layout (as in torch_backend.py): k_cache/v_cache [num_blocks, block_size, num_kv_heads,
// head_dim]; q/out [num_seqs, num_heads, head_dim] with the last dim contiguous; block_table
// int32 [num_seqs, max_blocks]; seq_lens int32 [num_seqs]. Accumulates in fp32. A sliding
// window (window > 0) reads only each sequence's last `window` tokens; softcap > 0 caps the
// scores as Gemma 2 does.
//
// Three passes per work item: scores (q . k for every token), softmax, then the sum of p * v.
// With AVX-512 and head_dim 64 or 128, the first pass scores 16 tokens at a time (a KV
// head's queries in registers; bf16 from pairs where the CPU has AVX512-BF16) and sums their
// products in one tree of shuffles, and the third keeps each head's accumulator in registers
// while the tokens go by. At head_dim 64 the per-token reductions, not the bytes,
// bounded the plain loops (docs/performance-log.md); they stay for other CPUs and head sizes.
// In bf16 on a CPU with AMX tiles, paged_decode_amx.cpp takes the call (decode_tiles_ready).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "decode_items.h"
#include "ops.h"
#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

// Tokens ahead to prefetch K/V rows: one tile of the score pass (16 tokens, 12 KB of fp32
// rows for SmolLM2). 4-32 measured at 64 decodes: fp32 level, bf16 about 10% faster from 16.
constexpr int64_t kPrefetch = 16;

// One call's tensors, and the rows of one sequence's cache.
template <typename scalar_t>
struct Call {
  const scalar_t *q, *k, *v;
  scalar_t* out;
  const int32_t *tables, *lens;
  int64_t group, head_dim, max_blocks, block_size;
  int64_t q_seq, q_head, o_seq, o_head, c_block, c_tok, c_head;
  float scale;
  float softcap;  // scores become softcap * tanh(score / softcap) before the softmax; 0: none
};

// A work item (decode_items.h): a sequence's tokens t0..t0 + len and a run of its KV heads,
// with its heads' scaled queries in qf and room for their scores. offs[t] is token t0 + t's
// row in the caches. Its output goes to out, or to `part_row` [head][head_dim] (decode_items.h)
// when the sequence is split.
template <typename scalar_t>
struct Item {
  const Call<scalar_t>& c;
  const int64_t* offs;
  int64_t seq, kv0, kv_heads, len;
  float* part_row;
  treadle::decode::KAhead* ahead;   // the thread's next item's K, asked for during the V pass

  // Token t's row in `cache` at KV head kv0 + g, with the row kPrefetch tokens on requested
  // from memory (`bytes` of it): blocks are scattered, so the hardware prefetcher alone
  // restarts at every block.
  const scalar_t* row(const scalar_t* cache, int64_t t, int64_t g, int64_t bytes) const {
    if (t + kPrefetch < len) {
      const char* ahead = reinterpret_cast<const char*>(at(cache, t + kPrefetch, g));
      for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(ahead + b);
    }
    return at(cache, t, g);
  }
  const scalar_t* at(const scalar_t* cache, int64_t t, int64_t g) const {
    return cache + offs[t] + (kv0 + g) * c.c_head;
  }
  scalar_t* out(int64_t h) const { return c.out + seq * c.o_seq + (kv0 * c.group + h) * c.o_head; }
  // Head h's output, normalized: cast into out, or kept whole in the part's row.
  void store(int64_t h, const float* o) const {
    if (part_row) return (void)std::copy(o, o + c.head_dim, part_row + h * c.head_dim);
    scalar_t* dst = out(h);
    for (int64_t d = 0; d < c.head_dim; ++d) dst[d] = static_cast<scalar_t>(o[d]);
  }
  const scalar_t* query(int64_t h) const { return c.q + seq * c.q_seq + (kv0 * c.group + h) * c.q_head; }
};

// scores[h * len + t] = exp(s - max) in place, s soft-capped first where softcap > 0 (Gemma 2);
// for each of `heads` heads, max and sum (for merging parts) and 1 / sum.
void softmax(float* scores, int64_t heads, int64_t len, float softcap, float* max, float* sum_exp, float* inv_sum) {
  for (int64_t h = 0; h < heads; ++h) {
    float* sh = scores + h * len;
    if (softcap > 0.f)
      for (int64_t t = 0; t < len; ++t) sh[t] = softcap * std::tanh(sh[t] / softcap);
    float m = sh[0];
    for (int64_t t = 1; t < len; ++t) m = std::max(m, sh[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      sh[t] = std::exp(sh[t] - m);
      sum += sh[t];
    }
    max[h] = m;
    sum_exp[h] = sum;
    inv_sum[h] = 1.f / sum;
  }
}

// Any CPU, any head_dim: a dot product per token and head, then p * v row by row.
template <typename scalar_t>
void attend_plain(const Item<scalar_t>& it, const float* qf, float* scores, float* acc, float* max, float* sum,
                  float* inv_sum) {
  const Call<scalar_t>& c = it.c;
  const int64_t heads = it.kv_heads * c.group, hd = c.head_dim, len = it.len;
  const int64_t bytes = it.kv_heads * c.c_head * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t t = 0; t < len; ++t) {
    const scalar_t* row = it.row(c.k, t, 0, bytes);
    for (int64_t h = 0; h < heads; ++h) {
      const scalar_t* k = row + (h / c.group) * c.c_head;
      const float* qh = qf + h * hd;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < hd; ++d) s += qh[d] * static_cast<float>(k[d]);
      scores[h * len + t] = s;
    }
  }
  softmax(scores, heads, len, c.softcap, max, sum, inv_sum);
  std::fill(acc, acc + heads * hd, 0.f);
  for (int64_t t = 0; t < len; ++t) {
    it.ahead->step();
    const scalar_t* row = it.row(c.v, t, 0, bytes);
    for (int64_t h = 0; h < heads; ++h) {
      const scalar_t* v = row + (h / c.group) * c.c_head;
      const float p = scores[h * len + t];
      float* ah = acc + h * hd;
#pragma omp simd
      for (int64_t d = 0; d < hd; ++d) ah[d] += p * static_cast<float>(v[d]);
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t d = 0; d < hd; ++d) acc[h * hd + d] *= inv_sum[h];
    it.store(h, acc + h * hd);
  }
}

#ifdef __AVX512F__
using treadle::vec::load16;

// Lane i of the result is the sum of the 16 lanes of v[i]: a tree of 15 adds, each halving
// the vectors left, where 16 separate horizontal sums take 4 shuffles and 4 adds apiece.
inline __m512 sum_lanes16(const float* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: v[2i], v[2i+1], v[2i], v[2i+1]
    const __m512 x = _mm512_loadu_ps(v + 32 * i), y = _mm512_loadu_ps(v + 32 * i + 16);
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
  }
  for (int i = 0; i < 4; ++i)    // per 128-bit lane: v[4i] .. v[4i+3]
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)    // 128-bit lanes: v[8i..8i+3] twice, v[8i+4..8i+7] twice
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// acc += p * v for HT heads of KV head g (first query head h0), over every token, with the
// accumulators in registers; then out = acc / sum. Not inlined: inlined into the caller's
// loop, GCC 12 stored every accumulator to the stack on every token.
template <typename scalar_t, int D, int HT>
__attribute__((noinline)) void accumulate_v(const Item<scalar_t>& it, int64_t g, int64_t h0, const float* scores,
                                            const float* inv_sum) {
  const int64_t len = it.len, bytes = D * 16 * static_cast<int64_t>(sizeof(scalar_t));
  __m512 acc[HT][D];
  for (int i = 0; i < HT; ++i)
    for (int d = 0; d < D; ++d) acc[i][d] = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; ++t) {
    it.ahead->step();
    const scalar_t* row = it.row(it.c.v, t, g, bytes);
    __m512 v[D];
    for (int d = 0; d < D; ++d) v[d] = load16(row + 16 * d);
    for (int i = 0; i < HT; ++i) {
      const __m512 p = _mm512_set1_ps(scores[(h0 + i) * len + t]);
      for (int d = 0; d < D; ++d) acc[i][d] = _mm512_fmadd_ps(p, v[d], acc[i][d]);
    }
  }
  alignas(64) float tmp[D * 16];
  for (int i = 0; i < HT; ++i) {
    const __m512 inv = _mm512_set1_ps(inv_sum[h0 + i]);
    for (int d = 0; d < D; ++d) _mm512_store_ps(tmp + 16 * d, _mm512_mul_ps(acc[i][d], inv));
    it.store(h0 + i, tmp);
  }
}

// Heads per register tile of accumulate_v: HT x D accumulators plus D rows of v fit in the
// 32 vector registers.
template <int D>
constexpr int kHeadTile = D <= 4 ? 4 : 2;

// accumulate_v on the widest tile of at most HT heads that `left` heads fill.
template <typename scalar_t, int D, int HT>
void accumulate_v_tile(const Item<scalar_t>& it, int64_t g, int64_t h0, int64_t left, const float* scores,
                       const float* inv_sum) {
  if constexpr (HT > 1) {
    if (left < HT) return accumulate_v_tile<scalar_t, D, HT - 1>(it, g, h0, left, scores, inv_sum);
  }
  accumulate_v<scalar_t, D, HT>(it, g, h0, scores, inv_sum);
}

template <typename scalar_t, int D>
void accumulate_v_tiles(const Item<scalar_t>& it, int64_t g, const float* scores, const float* inv_sum) {
  const int64_t group = it.c.group;
  for (int64_t h = 0; h < group; h += kHeadTile<D>)
    accumulate_v_tile<scalar_t, D, kHeadTile<D>>(it, g, g * group + h, group - h, scores, inv_sum);
}

// The unreduced products q . k of HT query heads (the first h0, all on the KV head at k_off in
// a row) with the n tokens whose K rows are in `rows`: 16 lanes at part + (h * 16 + j) * 16.
// The tile's queries stay in registers, so a K row is loaded once per tile, not once per head.
template <typename scalar_t, int D, int HT>
void products(const scalar_t* const* rows, int64_t n, int64_t k_off, int64_t h0, const float* qf, float* part) {
  __m512 q[HT][D];
  for (int i = 0; i < HT; ++i)
    for (int d = 0; d < D; ++d) q[i][d] = _mm512_loadu_ps(qf + (h0 + i) * 16 * D + 16 * d);
  for (int64_t j = 0; j < n; ++j) {
    __m512 k[D];
    for (int d = 0; d < D; ++d) k[d] = load16(rows[j] + k_off + 16 * d);
    for (int i = 0; i < HT; ++i) {
      __m512 s = _mm512_mul_ps(q[i][0], k[0]);
      for (int d = 1; d < D; ++d) s = _mm512_fmadd_ps(q[i][d], k[d], s);
      _mm512_storeu_ps(part + ((h0 + i) * 16 + j) * 16, s);
    }
  }
}

#ifdef __AVX512BF16__
// bf16 products from pairs, with q and k as stored (the scale comes after the sum): VDPBF16PS
// multiplies two pairs exactly and adds both products in fp32, so a 64-wide head takes two
// instructions where the fp32 path converts four vectors and does four multiply-adds. As in
// the prefill kernel.
template <int D, int HT>
void products_pairs(const c10::BFloat16* const* rows, int64_t n, int64_t k_off, int64_t h0,
                    const c10::BFloat16* q0, int64_t q_head, float* part) {
  constexpr int P = D / 2;  // vectors of 16 pairs in a head's row
  __m512bh q[HT][P];
  for (int i = 0; i < HT; ++i)
    for (int p = 0; p < P; ++p) q[i][p] = (__m512bh)_mm512_loadu_si512(q0 + (h0 + i) * q_head + 32 * p);
  for (int64_t j = 0; j < n; ++j) {
    __m512bh k[P];
    for (int p = 0; p < P; ++p) k[p] = (__m512bh)_mm512_loadu_si512(rows[j] + k_off + 32 * p);
    for (int i = 0; i < HT; ++i) {
      __m512 s = _mm512_setzero_ps();
      for (int p = 0; p < P; ++p) s = _mm512_dpbf16_ps(s, q[i][p], k[p]);
      _mm512_storeu_ps(part + ((h0 + i) * 16 + j) * 16, s);
    }
  }
}
#endif

template <typename scalar_t>
constexpr bool kPairs = treadle::vec::kPairedBf16 && std::is_same_v<scalar_t, c10::BFloat16>;

// products (or products_pairs) on the widest tile of at most HT heads that `left` heads fill.
template <typename scalar_t, int D, int HT>
void products_tile(const Item<scalar_t>& it, const scalar_t* const* rows, int64_t n, int64_t g, int64_t h0,
                   int64_t left, const float* qf, float* part) {
  if constexpr (HT > 1) {
    if (left < HT) return products_tile<scalar_t, D, HT - 1>(it, rows, n, g, h0, left, qf, part);
  }
#ifdef __AVX512BF16__
  if constexpr (kPairs<scalar_t>) {
    return products_pairs<D, HT>(rows, n, g * it.c.c_head, h0, it.query(0), it.c.q_head, part);
  }
#endif
  products<scalar_t, D, HT>(rows, n, g * it.c.c_head, h0, qf, part);
}

// head_dim = 16 * D. `part` holds 16 fp32 vectors per head: one tile's unreduced products. In
// a last tile of n < 16 tokens, rows n to 15 keep an earlier tile's products: lane j of the
// sum comes from row j alone, and lanes from n on are never stored.
template <typename scalar_t, int D>
void attend_avx512(const Item<scalar_t>& it, const float* qf, float* scores, float* part, float* max, float* sum,
                   float* inv_sum) {
  const Call<scalar_t>& c = it.c;
  const int64_t heads = it.kv_heads * c.group, len = it.len;
  const int64_t bytes = it.kv_heads * c.c_head * static_cast<int64_t>(sizeof(scalar_t));
  const __m512 scale = _mm512_set1_ps(kPairs<scalar_t> ? c.scale : 1.f);  // qf is scaled already
  const scalar_t* rows[16];
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, len - t0);
    for (int64_t j = 0; j < n; ++j) {
      rows[j] = it.row(c.k, t0 + j, 0, bytes);
      // In 16-bit caches, the tile's V rows are asked for into L2 now: the V pass then finds
      // them there, and memory serves two streams during the score pass where it served one
      // (64 sequences of 640 tokens, Zen 5: 7% faster; fp32 level to slower, docs/performance-log.md).
      if constexpr (sizeof(scalar_t) == 2) {
        const char* v_row = reinterpret_cast<const char*>(it.at(c.v, t0 + j, 0));
        for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(v_row + b, 0, 2);
      }
    }
    for (int64_t g = 0; g < it.kv_heads; ++g)
      for (int64_t h = 0; h < c.group; h += kHeadTile<D>)
        products_tile<scalar_t, D, kHeadTile<D>>(it, rows, n, g, g * c.group + h, c.group - h, qf, part);
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
    for (int64_t h = 0; h < heads; ++h) {
      const __m512 sum = sum_lanes16(part + h * 256);
      _mm512_mask_storeu_ps(scores + h * len + t0, mask, kPairs<scalar_t> ? _mm512_mul_ps(sum, scale) : sum);
    }
  }
  softmax(scores, heads, len, c.softcap, max, sum, inv_sum);
  for (int64_t g = 0; g < it.kv_heads; ++g) accumulate_v_tiles<scalar_t, D>(it, g, scores, inv_sum);
}
#endif

template <typename scalar_t>
void decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& block_table,
                      const at::Tensor& seq_lens, double scale, int64_t window, double softcap) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(2);
  const Call<scalar_t> c{q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                         out.data_ptr<scalar_t>(), block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                         num_heads / num_kv_heads, head_dim, block_table.size(1), k_cache.size(1),
                         q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                         k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), static_cast<float>(scale),
                         static_cast<float>(softcap)};
  int vec_dims = 0;  // D of attend_avx512, or 0 for the plain loops (and for double)
#ifdef __AVX512F__
  if ((head_dim == 64 || head_dim == 128) && !std::is_same_v<scalar_t, double>)
    vec_dims = static_cast<int>(head_dim / 16);
#endif

  const int64_t threads = at::get_num_threads();
  treadle::decode::Parts parts;
  const std::vector<treadle::decode::WorkItem> items =
      treadle::decode::plan_items(c.lens, num_seqs, num_heads, num_kv_heads, head_dim, num_kv_heads,
                                  treadle::decode::kPartTokensVec, parts, window);
  const int64_t max_heads = (items.empty() ? 0 : items[0].kv_heads) * c.group;  // query heads per item
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> qf(max_heads * head_dim), acc(max_heads * head_dim), scores;
    std::vector<float> max(max_heads), sum(max_heads), inv_sum(max_heads);
    std::vector<float> part(vec_dims ? max_heads * 256 : 0);
    std::vector<int64_t> offs;
    treadle::decode::KAhead ahead;
    treadle::decode::run_items(items, next, [&](const treadle::decode::WorkItem& w,
                                                const treadle::decode::WorkItem* after) {
      treadle::decode::row_offsets(c.tables + w.seq * c.max_blocks, w.t0, w.t1, c.block_size, c.c_block, c.c_tok,
                                   offs);
      // The V steps that call ahead.step(): a token per KV head on AVX-512, a token in the plain loops.
      if (after != nullptr)
        ahead.aim(*after, c.tables, c.max_blocks, c.block_size, c.c_block, c.c_tok, c.c_head, c.k,
                  sizeof(scalar_t), (vec_dims ? w.kv_heads : 1) * (w.t1 - w.t0));
      else
        ahead.clear();
      const Item<scalar_t> it{c, offs.data(), w.seq, w.kv0, w.kv_heads, w.t1 - w.t0,
                              treadle::decode::part_row(w, c.group, parts), &ahead};
      const int64_t heads = w.kv_heads * c.group;
      scores.resize(heads * it.len);
      for (int64_t h = 0; h < heads; ++h) {
        const scalar_t* src = it.query(h);
        for (int64_t d = 0; d < head_dim; ++d) qf[h * head_dim + d] = static_cast<float>(src[d]) * c.scale;
      }
      bool done = false;
#ifdef __AVX512F__
      if constexpr (!std::is_same_v<scalar_t, double>) {
        if (vec_dims == 4) {
          attend_avx512<scalar_t, 4>(it, qf.data(), scores.data(), part.data(), max.data(), sum.data(), inv_sum.data());
          done = true;
        } else if (vec_dims == 8) {
          attend_avx512<scalar_t, 8>(it, qf.data(), scores.data(), part.data(), max.data(), sum.data(), inv_sum.data());
          done = true;
        }
      }
#endif
      if (!done)
        attend_plain<scalar_t>(it, qf.data(), scores.data(), acc.data(), max.data(), sum.data(), inv_sum.data());
      treadle::decode::keep_softmax(w, c.group, max.data(), sum.data(), parts);
    });
  });
  if (!parts.out.empty()) treadle::decode::merge_parts(parts, c.lens, num_seqs, c.out, c.o_seq, c.o_head);
}

}  // namespace

namespace treadle {

void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_table,
                            const at::Tensor& seq_lens, double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "head_dim must be contiguous");
  TORCH_CHECK(k_cache.strides() == v_cache.strides(), "k_cache and v_cache must share a layout");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
              block_table.is_contiguous() && seq_lens.is_contiguous(), "block_table/seq_lens: contiguous int32");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == out.scalar_type(), "dtype mismatch");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(seq_lens.numel() == q.size(0) && block_table.size(0) >= q.size(0), "a length and a table per sequence");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t s = 0; s < q.size(0); ++s)
    TORCH_CHECK(lens[s] >= 0 && lens[s] <= block_table.size(1) * k_cache.size(1), "sequence ", s,
                " does not fit its block table");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap: 0 (none) or positive");
  // The tile kernel knows neither a window nor soft-capping: such layers take the vector kernel.
  if (window == 0 && softcap == 0 && decode_tiles_ready(q, k_cache))
    return decode_attention_tiles(out, q, k_cache, v_cache, block_table, seq_lens, scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_attention<scalar_t>(out, q, k_cache, v_cache, block_table, seq_lens, scale, window, softcap);
  });
}

}  // namespace treadle

TORCH_LIBRARY_FRAGMENT(treadle, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_table, Tensor seq_lens, float scale, int window=0, float softcap=0.) -> ()");
}

TORCH_LIBRARY_IMPL(treadle, CPU, m) { m.impl("paged_decode_attention", &treadle::paged_decode_attention); }
