// Paged prefill (extend) attention for CPU: spans of queries, each attending to the tokens
// cached before it plus itself, all read from the cache through the block table (a span's
// own K/V are written there before attention runs). The torch path gathers each span's
// blocks into a dense buffer, builds a mask and calls SDPA per span: per-call overhead that
// dominates the short spans of speculative verification.
//
// Layout (as in torch_backend.py): k_cache/v_cache [num_blocks, block_size, num_kv_heads,
// head_dim]; q/out [tokens, num_heads, head_dim] with the last dim contiguous; block_table
// int32 [spans, max_blocks]; query_start int32 [spans + 1] (span s owns rows
// query_start[s]..query_start[s+1]); context_lens int32 [spans]. Query i of span s sits at
// position context_lens[s] + i and sees keys 0..context_lens[s] + i (causal, bottom-right
// aligned). Accumulates in fp32. With a sliding window (window > 0) it sees only keys
// position - window + 1..position: key tiles wholly before an item's window are skipped, and
// the tiles that reach below some lane's window mask those keys. softcap > 0 caps the scores
// (softcap * tanh(score / softcap), Gemma 2) before the mask.
//
// Flash style: a work item is a tile of query rows of one span, times the query heads of one
// KV head. Its queries sit side by side in the vector lanes (transposed once per item), so
// both products are the same micro-kernel, a lane vector times broadcast scalars: scores
// [key][query] += k[key][d] * q[d][query], and acc[d][query] += v[key][d] * p[key][query].
// Keys come in tiles of kKeys, each converted to fp32 once (read in place when it already is)
// and used by every query of the item, with an online softmax across tiles, lane by lane.
// Both products are fused multiply-adds where the CPU has them, as in the decode kernel. With
// AVX512-BF16, bf16 scores come from q and k as stored, two products per instruction, and so
// does P V: V's rows are paired by key as they are read, P is rounded to bf16 (as the AMX
// kernel rounds it) and paired the same way, and the softmax's exp is computed inline.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"
#include "prefill_items.h"
#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// Queries per lane vector: one AVX-512 register of fp32 (two AVX2 ones).
constexpr int64_t kLanes = 16;
// Keys per tile, and how many of them one pass of the QK micro-kernel keeps in registers. With
// AVX-512's 32 registers all 16, so each q vector load serves 16 multiply-adds (4 prompts of
// 512, fp32: 1.16x over 8; 32-key tiles or 96-query items were slower, docs/performance-log.md).
// AVX2 has 16 registers, half as wide.
constexpr int64_t kKeys = 16;
#ifdef __AVX512F__
constexpr int64_t kKeyBlock = 16;
#else
constexpr int64_t kKeyBlock = 8;
#endif
// head_dim entries per pass of the PV micro-kernel; V rows are padded to a multiple of it.
constexpr int64_t kDimBlock = 8;
// Query vectors (rows x the group's heads) per work item: enough that a K/V tile serves many
// queries; the item's buffers (q, acc: 12 KiB each at head_dim 64) stay in L1/L2.
constexpr int64_t kItemQueries = 48;
// The widest head whose bf16 P V comes from pairs (a row of zeros stands in for keys past the
// end of a span).
constexpr int64_t kMaxPairedDim = 256;
using treadle::prefill::Item;
using treadle::prefill::kExpFloor;
using treadle::prefill::kMasked;
using treadle::prefill::round_up;

// a * b + c with one rounding where the CPU fuses them; elsewhere std::fma is a slow library call.
inline float madd(float a, float b, float c) {
#ifdef __FMA__
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

#ifdef __AVX512F__
// The online softmax of one lane vector over a tile: p (kKeys scores per lane, kMasked where
// masked) becomes e^(p - max), 0 where masked; m and l, the lanes' running max and sum, take
// the tile in; returns alpha = e^(old max - new max), by which what came before is rescaled.
// The inline exp: libmvec's is a call that spills the loop's registers.
inline __m512 online_softmax(float (*p)[kLanes], float* m, float* l) {
  const __m512 old_max = _mm512_loadu_ps(m);
  __m512 mx = old_max;
  for (int64_t j = 0; j < kKeys; ++j) mx = _mm512_max_ps(mx, _mm512_load_ps(p[j]));
  const __m512 floor = _mm512_set1_ps(kExpFloor), masked = _mm512_set1_ps(kMasked);
  const __m512 alpha = treadle::vec::exp_nonpositive(_mm512_max_ps(_mm512_sub_ps(old_max, mx), floor));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < kKeys; ++j) {
    const __m512 s = _mm512_load_ps(p[j]);
    const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s, masked, _CMP_NEQ_OQ),
                                         treadle::vec::exp_nonpositive(_mm512_max_ps(_mm512_sub_ps(s, mx), floor)));
    _mm512_store_ps(p[j], e);
    sum = _mm512_add_ps(sum, e);
  }
  _mm512_storeu_ps(m, mx);
  _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), alpha, sum));
  return alpha;
}
#endif

#ifdef __AVX512BF16__
// bf16 scores from pairs, for one lane vector and kKeyBlock keys: q as [d / 2][lane] pairs
// (`width` words apart), k as [key][d / 2] pairs (`key_stride` words apart). VDPBF16PS
// multiplies two pairs exactly and adds both products in fp32, so one instruction covers two
// d where the fp32 path needs two multiply-adds.
inline void score_pairs(const uint32_t* qp, int64_t width, const uint32_t* kp, int64_t key_stride,
                        int64_t half_dim, float scale, float (*s)[kLanes]) {
  __m512 acc[kKeyBlock];
  for (int64_t j = 0; j < kKeyBlock; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t d2 = 0; d2 < half_dim; ++d2) {
    const __m512bh q = (__m512bh)_mm512_loadu_si512(qp + d2 * width);
    for (int64_t j = 0; j < kKeyBlock; ++j)
      acc[j] = _mm512_dpbf16_ps(acc[j], q, (__m512bh)_mm512_set1_epi32(static_cast<int>(kp[j * key_stride + d2])));
  }
  for (int64_t j = 0; j < kKeyBlock; ++j) _mm512_storeu_ps(s[j], _mm512_mul_ps(acc[j], _mm512_set1_ps(scale)));
}

// Word indices for _mm512_permutex2var_epi16(a, idx, b) that interleave 16 words of a with 16
// of b, a's first: from `first` on, a[i] goes to word 2i and b[i] to word 2i + 1.
inline __m512i interleave_words(int first) {
  alignas(64) uint16_t idx[32];
  for (int i = 0; i < 16; ++i) {
    idx[2 * i] = static_cast<uint16_t>(first + i);
    idx[2 * i + 1] = static_cast<uint16_t>(32 + first + i);
  }
  return _mm512_load_si512(idx);
}

// V rows r0 and r1 (keys 2kp and 2kp + 1) as pairs of keys: word d of dst holds r0[d] in its
// low half and r1[d] in its high half, one B operand of VDPBF16PS per d. head_dim % 32 == 0.
inline void pair_rows(const uint16_t* r0, const uint16_t* r1, int64_t head_dim, uint32_t* dst) {
  const __m512i lo = interleave_words(0), hi = interleave_words(16);
  for (int64_t d = 0; d < head_dim; d += 32) {
    const __m512i a = _mm512_loadu_si512(r0 + d), b = _mm512_loadu_si512(r1 + d);
    _mm512_storeu_si512(dst + d, _mm512_permutex2var_epi16(a, lo, b));
    _mm512_storeu_si512(dst + d + 16, _mm512_permutex2var_epi16(a, hi, b));
  }
}

// acc[d0 + dd] rows of one lane vector, in registers while a key tile goes by.
constexpr int64_t kPairDims = 16;

// acc[d][lane] = alpha * acc + sum over keys of v[key][d] p[key][lane] for one lane vector,
// with P rounded to bf16 and both operands in key pairs (vp from pair_rows); acc is
// [head_dim][width] from this lane vector's column.
inline void pv_pairs(const float (*p)[kLanes], __m512 alpha, float* acc, int64_t width, const uint32_t* vp,
                     int64_t head_dim) {
  // Pair words: key 2kp's value in the low half of word i, key 2kp + 1's in the high half.
  alignas(64) static const uint16_t kPairIdx[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i pair_idx = _mm512_load_si512(kPairIdx);
  __m512bh pp[kKeys / 2];
  for (int64_t kp = 0; kp < kKeys / 2; ++kp)
    pp[kp] = (__m512bh)_mm512_permutexvar_epi16(
        pair_idx, (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(p[2 * kp + 1]), _mm512_load_ps(p[2 * kp])));
  for (int64_t d0 = 0; d0 < head_dim; d0 += kPairDims) {
    __m512 a[kPairDims];
    for (int64_t dd = 0; dd < kPairDims; ++dd) a[dd] = _mm512_mul_ps(_mm512_loadu_ps(acc + (d0 + dd) * width), alpha);
    for (int64_t kp = 0; kp < kKeys / 2; ++kp)
      for (int64_t dd = 0; dd < kPairDims; ++dd)
        a[dd] = _mm512_dpbf16_ps(a[dd], pp[kp],
                                 (__m512bh)_mm512_set1_epi32(static_cast<int>(vp[kp * head_dim + d0 + dd])));
    for (int64_t dd = 0; dd < kPairDims; ++dd) _mm512_storeu_ps(acc + (d0 + dd) * width, a[dd]);
  }
}
#endif

template <typename scalar_t>
void prefill_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& block_table,
                       const at::Tensor& query_start, const at::Tensor& context_lens, double scale,
                       int64_t window, double softcap) {
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t num_spans = context_lens.size(0), max_blocks = block_table.size(1);
  const int64_t q_tok = q.stride(0), q_head = q.stride(1);
  const int64_t o_tok = out.stride(0), o_head = out.stride(1);
  const int64_t c_block = k_cache.stride(0), c_tok = k_cache.stride(1), c_head = k_cache.stride(2);
  const scalar_t* q_data = q.data_ptr<scalar_t>();
  const scalar_t* k_data = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_data = v_cache.data_ptr<scalar_t>();
  scalar_t* o_data = out.data_ptr<scalar_t>();
  const int32_t* tables = block_table.data_ptr<int32_t>();
  const int32_t* starts = query_start.data_ptr<int32_t>();
  const int32_t* ctx_lens = context_lens.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale), fcap = static_cast<float>(softcap);

  const int64_t rows_per_item = std::max<int64_t>(1, kItemQueries / group);
  const std::vector<Item> items = treadle::prefill::make_items(starts, ctx_lens, num_spans, num_kv_heads, rows_per_item,
                                                               max_blocks * block_size, q.size(0));

  const int64_t max_width = round_up(rows_per_item * group, kLanes);
  const int64_t dim_pad = round_up(head_dim, kDimBlock);
  const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(scalar_t));
  // fp32 tiles that lie in one block need no copy (V's rows then need no padding either).
  const bool in_place = std::is_same_v<scalar_t, float> && block_size % kKeys == 0 && head_dim == dim_pad;
  // bf16 scores straight from bf16 pairs, where the CPU has AVX512-BF16 (q and k stay as
  // stored; the scale comes after). qt and kt then hold pairs.
  const bool paired = treadle::vec::kPairedBf16 && std::is_same_v<scalar_t, c10::BFloat16> && head_dim % 2 == 0;
  const int64_t half_dim = head_dim / 2;
  // P V from pairs too, where V's rows are whole vectors of pairs.
  const bool paired_pv = paired && head_dim % 32 == 0 && head_dim <= kMaxPairedDim;
  const int64_t threads = at::get_num_threads();
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    // Scratch from ATen's allocator, 64-byte aligned (a lane vector misaligned straddles two
    // cache lines on every access), carved at multiples of kLanes floats. Per query lane: q
    // (scaled) and acc, [d][lane]; the running max and sum; its position. Then the key tile
    // in fp32, [key][d]; V's padding columns stay zero, so acc's do too. Then the queries
    // in, and the outputs out, [lane][d], to be transposed.
    at::Tensor scratch = at::zeros({(head_dim + 2 * dim_pad + 2) * max_width + 2 * kKeys * dim_pad}, at::kFloat);
    at::Tensor positions = at::empty({max_width}, at::kInt);
    float* qt = scratch.data_ptr<float>();
    float* acc = qt + head_dim * max_width;
    float* m = acc + dim_pad * max_width;
    float* l = m + max_width;
    float* kt = l + max_width;
    float* vt = kt + kKeys * dim_pad;
    float* rows_in_out = vt + kKeys * dim_pad;
    int32_t* pos = positions.data_ptr<int32_t>();
    alignas(64) float p[kKeys][kLanes];
    for (int64_t idx = next++; idx < static_cast<int64_t>(items.size()); idx = next++) {
      const Item& it = items[idx];
      const int64_t ctx = ctx_lens[it.span];
      const int32_t* table = tables + it.span * max_blocks;
      const int64_t first_row = starts[it.span] + it.row0;
      const int64_t first_head = it.kv_head * group;
      // Lane i holds row row0 + i / group, head first_head + i % group. Padding lanes (zero
      // queries, position -1) are computed along and never written.
      const int64_t lanes = (it.row1 - it.row0) * group, width = round_up(lanes, kLanes);
      for (int64_t i = 0; i < width; ++i) {
        pos[i] = i < lanes ? static_cast<int32_t>(ctx + it.row0 + i / group) : -1;
        m[i] = kMasked;
        l[i] = 0.f;
      }
      // Each lane's query as a row, then transposed into lanes: fp32 and scaled, or (paired)
      // the stored bf16 pairs, moved as 32-bit words.
      const int64_t q_words = paired ? half_dim : head_dim;
      for (int64_t i = 0; i < lanes; ++i) {
        const scalar_t* src = q_data + (first_row + i / group) * q_tok + (first_head + i % group) * q_head;
        float* dst = rows_in_out + i * q_words;
        if (paired) {
          std::memcpy(dst, src, head_dim * sizeof(scalar_t));
          continue;
        }
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(src[d]) * fscale;
      }
      std::fill(rows_in_out + lanes * q_words, rows_in_out + width * q_words, 0.f);
      treadle::vec::transpose(rows_in_out, q_words, qt, width, width, q_words);
      std::fill(acc, acc + dim_pad * width, 0.f);

      const int64_t end = ctx + it.row1;  // the item's last row sees keys 0..end-1
      auto row_of = [&](int64_t t) {        // token t's row of this KV head in the cache
        return table[t / block_size] * c_block + (t % block_size) * c_tok + it.kv_head * c_head;
      };
      // The first row sees keys from ctx + row0 - window + 1 on; tiles start on multiples of
      // kKeys, so that a whole fp32 tile still lies in one block.
      const int64_t first_key = window > 0 ? std::max<int64_t>(0, ctx + it.row0 - window + 1) / kKeys * kKeys : 0;
      for (int64_t t0 = first_key; t0 < end; t0 += kKeys) {
        // The tile's K and V rows, kv_stride floats apart. A whole fp32 tile inside one
        // block is read where it lies; any other is converted into kt/vt first.
        const float *kr0, *vr0;
        int64_t kv_stride;
        if (in_place && t0 + kKeys <= end) {
          kr0 = reinterpret_cast<const float*>(k_data) + row_of(t0);
          vr0 = reinterpret_cast<const float*>(v_data) + row_of(t0);
          kv_stride = c_tok;
        } else {
          kr0 = kt;
          vr0 = vt;
          kv_stride = dim_pad;
          // Keys past `end` are zeros, not whatever the cache holds there: p is 0 for them,
          // but 0 times a stale NaN is still NaN.
#ifdef __AVX512BF16__
          if (paired_pv) {   // K's rows as stored; V's rows paired by key into vt
            static const uint16_t zeros[kMaxPairedDim] = {};
            const uint16_t* v_rows[kKeys];
            for (int64_t j = 0; j < kKeys; ++j) {
              const int64_t t = t0 + j;
              const int64_t off = t < end ? row_of(t) : -1;
              std::memcpy(kt + j * dim_pad, off < 0 ? static_cast<const void*>(zeros) : k_data + off,
                          head_dim * sizeof(scalar_t));
              v_rows[j] = off < 0 ? zeros : reinterpret_cast<const uint16_t*>(v_data + off);
            }
            for (int64_t kp = 0; kp < kKeys / 2; ++kp)
              pair_rows(v_rows[2 * kp], v_rows[2 * kp + 1], head_dim, reinterpret_cast<uint32_t*>(vt) + kp * head_dim);
          } else
#endif
          for (int64_t j = 0; j < kKeys; ++j) {
            float* kr = kt + j * dim_pad;
            float* vr = vt + j * dim_pad;
            const int64_t t = t0 + j;
            if (t >= end) {
              std::fill(kr, kr + head_dim, 0.f);
              std::fill(vr, vr + head_dim, 0.f);
              continue;
            }
            const int64_t off = row_of(t);
            if (paired) {
              std::memcpy(kr, k_data + off, head_dim * sizeof(scalar_t));
            } else {
#pragma omp simd
              for (int64_t d = 0; d < head_dim; ++d) kr[d] = static_cast<float>(k_data[off + d]);
            }
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) vr[d] = static_cast<float>(v_data[off + d]);
          }
        }
        // The next tile's rows, requested while this one computes: blocks are scattered, so
        // the hardware prefetcher alone restarts at every block.
        for (int64_t t = t0 + kKeys; t < std::min(t0 + 2 * kKeys, end); ++t) {
          const int64_t ahead = row_of(t);
          for (int64_t byte = 0; byte < row_bytes; byte += 64) {
            __builtin_prefetch(reinterpret_cast<const char*>(k_data + ahead) + byte);
            __builtin_prefetch(reinterpret_cast<const char*>(v_data + ahead) + byte);
          }
        }
        const int32_t key0 = static_cast<int32_t>(t0);
        for (int64_t b = 0; b < width; b += kLanes) {
          // Scores of kKeyBlock keys at a time in registers: per d, one q vector load serves
          // kKeyBlock broadcast multiply-adds.
          for (int64_t j0 = 0; j0 < kKeys; j0 += kKeyBlock) {
            alignas(64) float s[kKeyBlock][kLanes] = {};
#ifdef __AVX512BF16__
            if (paired)
              score_pairs(reinterpret_cast<const uint32_t*>(qt) + b, width,
                          reinterpret_cast<const uint32_t*>(kr0) + j0 * kv_stride, kv_stride, half_dim, fscale, s);
            else
#endif
            for (int64_t d = 0; d < head_dim; ++d) {
              const float* qd = &qt[d * width + b];
              for (int64_t j = 0; j < kKeyBlock; ++j) {
                const float kd = kr0[(j0 + j) * kv_stride + d];
#pragma omp simd
                for (int64_t i = 0; i < kLanes; ++i) s[j][i] = madd(kd, qd[i], s[j][i]);
              }
            }
            if (fcap > 0.f)
              for (int64_t j = 0; j < kKeyBlock; ++j)
                for (int64_t i = 0; i < kLanes; ++i) s[j][i] = fcap * std::tanh(s[j][i] / fcap);
            // Some lane's window starts past this key block's first key: mask below windows too.
            if (window > 0 && key0 + j0 <= end - 1 - window) {
              const int32_t w = static_cast<int32_t>(window);
              for (int64_t j = 0; j < kKeyBlock; ++j) {
                const int32_t key = key0 + static_cast<int32_t>(j0 + j);
#pragma omp simd
                for (int64_t i = 0; i < kLanes; ++i)
                  p[j0 + j][i] = key <= pos[b + i] && key > pos[b + i] - w ? s[j][i] : kMasked;
              }
              continue;
            }
            for (int64_t j = 0; j < kKeyBlock; ++j) {
              const int32_t key = key0 + static_cast<int32_t>(j0 + j);
#pragma omp simd
              for (int64_t i = 0; i < kLanes; ++i) p[j0 + j][i] = key <= pos[b + i] ? s[j][i] : kMasked;
            }
          }
#ifdef __AVX512F__
          const __m512 alpha_vec = online_softmax(p, m + b, l + b);
#ifdef __AVX512BF16__
          if (paired_pv) {
            pv_pairs(p, alpha_vec, acc + b, width, reinterpret_cast<const uint32_t*>(vr0), head_dim);
            continue;
          }
#endif
          alignas(64) float alpha[kLanes];
          _mm512_store_ps(alpha, alpha_vec);
#else
          // Online softmax, lane-wise: rescale what came before by exp(old max - new max).
          float mx[kLanes], alpha[kLanes], sum[kLanes];
#pragma omp simd
          for (int64_t i = 0; i < kLanes; ++i) mx[i] = m[b + i];
          for (int64_t j = 0; j < kKeys; ++j)
#pragma omp simd
            for (int64_t i = 0; i < kLanes; ++i) mx[i] = std::max(mx[i], p[j][i]);
#pragma omp simd
          for (int64_t i = 0; i < kLanes; ++i) {
            alpha[i] = std::exp(std::max(m[b + i] - mx[i], kExpFloor));
            m[b + i] = mx[i];
            sum[i] = 0.f;
          }
          for (int64_t j = 0; j < kKeys; ++j)
#pragma omp simd
            for (int64_t i = 0; i < kLanes; ++i) {
              const float e = std::exp(std::max(p[j][i] - mx[i], kExpFloor));
              p[j][i] = p[j][i] == kMasked ? 0.f : e;
              sum[i] += p[j][i];
            }
#pragma omp simd
          for (int64_t i = 0; i < kLanes; ++i) l[b + i] = l[b + i] * alpha[i] + sum[i];
#endif
          // acc[d][lane] = alpha * acc + sum over keys of v[key][d] * p[key][lane], kDimBlock
          // rows of acc in registers while the tile's keys go by.
          for (int64_t d0 = 0; d0 < dim_pad; d0 += kDimBlock) {
            float a[kDimBlock][kLanes];
            for (int64_t dd = 0; dd < kDimBlock; ++dd)
#pragma omp simd
              for (int64_t i = 0; i < kLanes; ++i) a[dd][i] = acc[(d0 + dd) * width + b + i] * alpha[i];
            // Unrolled, or GCC keeps `a` on the stack: up to 1.4x slower at head_dim 64.
#pragma GCC unroll 16
            for (int64_t j = 0; j < kKeys; ++j)
              for (int64_t dd = 0; dd < kDimBlock; ++dd) {
                const float vd = vr0[j * kv_stride + d0 + dd];
#pragma omp simd
                for (int64_t i = 0; i < kLanes; ++i) a[dd][i] = madd(vd, p[j][i], a[dd][i]);
              }
            for (int64_t dd = 0; dd < kDimBlock; ++dd)
#pragma omp simd
              for (int64_t i = 0; i < kLanes; ++i) acc[(d0 + dd) * width + b + i] = a[dd][i];
          }
        }
      }
      treadle::vec::transpose(acc, width, rows_in_out, dim_pad, dim_pad, width);
      for (int64_t i = 0; i < lanes; ++i) {
        scalar_t* dst = o_data + (first_row + i / group) * o_tok + (first_head + i % group) * o_head;
        const float* src = rows_in_out + i * dim_pad;
        const float inv = 1.f / l[i];
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(src[d] * inv);
      }
    }
  });
}

}  // namespace

namespace treadle {

void paged_prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_table,
                             const at::Tensor& query_start, const at::Tensor& context_lens, double scale,
                             int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 4 && q.sizes() == out.sizes(), "bad shapes");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "head_dim must be contiguous");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(),
              "k_cache and v_cache must share a layout");
  TORCH_CHECK(k_cache.size(3) == q.size(2), "q and the cache disagree on head_dim");
  for (const at::Tensor* t : {&block_table, &query_start, &context_lens})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(),
                "block_table/query_start/context_lens: contiguous int32");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == context_lens.size(0) &&
              query_start.size(0) == context_lens.size(0) + 1, "one block table row and context length per span");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == out.scalar_type() &&
              q.scalar_type() == v_cache.scalar_type(), "dtype mismatch");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap: 0 (none) or positive");
  // The tile kernel knows neither a window nor soft-capping: such layers take the vector kernel.
  if (window == 0 && softcap == 0 && treadle::prefill_tiles_ready(q, k_cache)) {
    treadle::prefill_attention_tiles(out, q, k_cache, v_cache, block_table, query_start, context_lens, scale);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_prefill_attention", [&] {
    prefill_attention<scalar_t>(out, q, k_cache, v_cache, block_table, query_start, context_lens, scale, window,
                                softcap);
  });
}

}  // namespace treadle

TORCH_LIBRARY_FRAGMENT(treadle, m) {
  m.def("paged_prefill_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_table, Tensor query_start, Tensor context_lens, float scale, int window=0, "
        "float softcap=0.) -> ()");
}

TORCH_LIBRARY_IMPL(treadle, CPU, m) { m.impl("paged_prefill_attention", &treadle::paged_prefill_attention); }
