// bf16 paged prefill attention on AMX tiles (Intel Sapphire Rapids and later), called by
// paged_prefill.cpp where the CPU has them: the same inputs, spans and causal rule, the same
// work items (a tile of query rows of one span times the query heads of one KV head), but the
// products run as tile multiplies (TDPBF16PS: a 16 x 32 bf16 tile times a 32 x 16 one into a
// 16 x 16 fp32 tile, each product exact, summed in fp32): 2.9-3.6x faster than the vector
// kernel's bf16 path on a Xeon with AMX (docs/performance-log.md). TREADLE_AMX=0 turns it off.
//
// Per item, keys go by in chunks of up to kChunk:
// - scores, keys x queries: A = 16 keys of K, read where they lie in the cache (a whole
//   16-token block); B = the item's queries as bf16 pairs [d / 2][query], built once per item;
// - an online softmax, lane by lane over the queries, as in the vector kernel; P is rounded to
//   bf16 for the product with V, as torch's flash attention does for bf16 (the row sums stay
//   fp32);
// - out, transposed (head_dim x queries): A = V^T [d][key], whose rows hold consecutive keys,
//   so key pairs come as a bf16 product wants them; B = P as [key pair][query], the softmax's
//   two rows of a pair interleaved, stored as they come. Each thread builds V^T once for a
//   run of items of one span and KV head; out is transposed back once per item. (P as the A side would need a transpose of P per item and chunk, and V packed per
//   item and chunk: 7-8% more time at 512 tokens, docs/performance-log.md.)
// Keys past the span's end (stale slots of its last block, possibly NaN) get p = 0 by a select
// and are zeros in V^T.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "amx.h"
#include "ops.h"
#include "prefill_items.h"
#include "vec.h"

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;         // queries per tile column block, keys per tile row block
constexpr int64_t kChunk = 64;         // keys per softmax round (per rescale of the output)
constexpr int64_t kItemQueries = 48;   // query vectors per item: three tile blocks
constexpr int64_t kMaxBlocks = kItemQueries / kLanes;
using treadle::prefill::Item;
using treadle::prefill::kExpFloor;
using treadle::prefill::kMasked;
using treadle::prefill::round_up;
constexpr float kLog2e = 1.44269504f;
constexpr float kExp2Floor = kExpFloor * kLog2e;   // the vector kernel's floor, in log2 units
using treadle::vec::exp2_nonpositive;
using treadle::amx::interleave_bf16;
using treadle::amx::interleave_rows;

// One side of a tile product: up to two tiles, `first[i]`, each taking its k-th step
// `k_step` bytes on, rows `stride` bytes apart.
struct Tiles {
  const void* first[2];
  int64_t stride, k_step;
  const char* at(int i, int64_t k) const { return static_cast<const char*>(first[i]) + k * k_step; }
};

// C[i][j] = (C[i][j] if accumulate, else 0) + sum over k < steps of A[i][k] B[k][j], for i < rows
// and j < cols (each 1 or 2): four independent accumulators (tiles 0-3) where one would make
// every multiply wait for the one before. A in tiles 4-5, B in 6-7.
inline void multiply(const Tiles& a, const Tiles& b, int64_t steps, float* const (&c)[2][2], int64_t c_stride,
                     int rows, int cols, bool accumulate) {
#define TREADLE_C(i, j, tile)                                          \
  if (i < rows && j < cols) {                                          \
    if (accumulate) _tile_loadd(tile, c[i][j], c_stride);              \
    else _tile_zero(tile);                                             \
  }
  TREADLE_C(0, 0, 0) TREADLE_C(0, 1, 1) TREADLE_C(1, 0, 2) TREADLE_C(1, 1, 3)
#undef TREADLE_C
  for (int64_t k = 0; k < steps; ++k) {
    _tile_loadd(4, a.at(0, k), a.stride);
    _tile_loadd(6, b.at(0, k), b.stride);
    _tile_dpbf16ps(0, 4, 6);
    if (cols > 1) {
      _tile_loadd(7, b.at(1, k), b.stride);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (rows > 1) {
      _tile_loadd(5, a.at(1, k), a.stride);
      _tile_dpbf16ps(2, 5, 6);
      if (cols > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c[0][0], c_stride);
  if (cols > 1) _tile_stored(1, c[0][1], c_stride);
  if (rows > 1) _tile_stored(2, c[1][0], c_stride);
  if (rows > 1 && cols > 1) _tile_stored(3, c[1][1], c_stride);
}

// Where a step's tensors are, and how they are laid out (see paged_prefill.cpp).
struct Step {
  int64_t group, block_size, max_blocks, q_tok, q_head, o_tok, o_head, c_block, c_tok, c_head;
  const c10::BFloat16 *q, *k, *v;
  c10::BFloat16* out;
  const int32_t *tables, *starts, *ctx_lens;
  float scale;

  int64_t keys(int64_t span) const { return ctx_lens[span] + starts[span + 1] - starts[span]; }
  int64_t row_of(int64_t span, int64_t kv_head, int64_t t) const {   // token t's cache row
    return tables[span * max_blocks + t / block_size] * c_block + (t % block_size) * c_tok + kv_head * c_head;
  }
};

// V^T of one span's KV head: [d][key] as bf16 words of two keys, each row padded with zeros
// to whole chunks (kChunk / 2 words a chunk). Each thread keeps the last one it built: items
// of one span and KV head come one after another, so a thread builds each about once.
template <int64_t kDim>
class TransposedV {
 public:
  // The rows for (span, kv_head), built unless they are the last ones built.
  const uint32_t* rows(const Step& st, int64_t span, int64_t kv_head) {
    if (span != span_ || kv_head != kv_head_) {
      span_ = span;
      kv_head_ = kv_head;
      words_per_row_ = round_up(st.keys(span), kChunk) / 2;
      if (words_.numel() < kDim * words_per_row_) words_ = at::empty({kDim * words_per_row_}, at::kInt);
      pack(st);
    }
    return reinterpret_cast<const uint32_t*>(words_.data_ptr<int32_t>());
  }
  int64_t words_per_row() const { return words_per_row_; }

 private:
  // 16 key pairs at a time: interleaved into [pair][d] words, then transposed into place.
  void pack(const Step& st) {
    alignas(64) uint32_t block[16 * kDim];
    const int64_t keys = st.keys(span_);
    uint32_t* dst = reinterpret_cast<uint32_t*>(words_.data_ptr<int32_t>());
    for (int64_t w0 = 0; w0 < words_per_row_; w0 += 16) {
      for (int64_t r = 0; r < 16; ++r) {
        const int64_t t = 2 * (w0 + r);
        const c10::BFloat16* v0 = t < keys ? st.v + st.row_of(span_, kv_head_, t) : nullptr;
        const c10::BFloat16* v1 = t + 1 < keys ? st.v + st.row_of(span_, kv_head_, t + 1) : nullptr;
        for (int64_t d = 0; d < kDim; d += 32) {
          const __m512i a = v0 ? _mm512_loadu_si512(v0 + d) : _mm512_setzero_si512();
          const __m512i b = v1 ? _mm512_loadu_si512(v1 + d) : _mm512_setzero_si512();
          __m512i low, high;
          interleave_rows(a, b, low, high);
          _mm512_store_si512(block + r * kDim + d, low);
          _mm512_store_si512(block + r * kDim + d + 16, high);
        }
      }
      treadle::vec::transpose(reinterpret_cast<const float*>(block), kDim, reinterpret_cast<float*>(dst + w0),
                              words_per_row_, 16, kDim);
    }
  }

  int64_t span_ = -1, kv_head_ = -1, words_per_row_ = 0;
  at::Tensor words_ = at::empty({0}, at::kInt);
};

// One thread's work on items, chunk by chunk, in stages: chunk c + 1's scores are issued
// before chunk c's softmax reads its own, and the previous chunk's fold sits between P's
// stores and the tile loads of P V (a tile load of data vector stores just wrote waits for
// them to drain). Scores are double-buffered for it.
template <int kHalves>
class ItemWork {
 public:
  static constexpr int64_t kDim = 32 * kHalves, kHalfDim = kDim / 2, kDimBlocks = kDim / kLanes;

  ItemWork(const Step& st, int64_t max_width)
      : st_(st), max_width_(max_width),
        scratch_(at::zeros({max_width * kHalfDim * 2 + 2 * kChunk * max_width + kMaxBlocks * (kChunk / 2) * kLanes +
                            2 * max_width * kDim + kChunk * kHalfDim + 5 * max_width},
                           at::kFloat)) {
    // Per thread, 64-byte aligned: queries as rows, then as pairs [d / 2][lane]; two chunks'
    // scores [key][lane]; P as B tiles [block][key pair][16 queries]; the output [d][lane] and
    // a chunk's P V; a chunk's K tiles where they are not read in place; per lane the running
    // max and sum, two chunks' rescales, and the position.
    float* f = scratch_.data_ptr<float>();
    q_rows_ = f;
    qt_ = reinterpret_cast<uint32_t*>(q_rows_ + max_width * kHalfDim);
    s_[0] = reinterpret_cast<float*>(qt_ + max_width * kHalfDim);
    s_[1] = s_[0] + kChunk * max_width;
    pb_ = reinterpret_cast<uint32_t*>(s_[1] + kChunk * max_width);
    acc_ = reinterpret_cast<float*>(pb_ + kMaxBlocks * (kChunk / 2) * kLanes);
    pv_ = acc_ + max_width * kDim;
    k_tile_ = reinterpret_cast<c10::BFloat16*>(pv_ + max_width * kDim);
    m_ = reinterpret_cast<float*>(k_tile_ + kChunk * kDim);
    l_ = m_ + max_width;
    alpha_[0] = l_ + max_width;
    alpha_[1] = alpha_[0] + max_width;
    pos_ = reinterpret_cast<int32_t*>(alpha_[1] + max_width);
  }

  void run(const Item& it) {
    start(it);
    const int64_t chunks = (end_ + kChunk - 1) / kChunk;
    scores(0);
    for (int64_t c = 0; c < chunks; ++c) {
      if (c + 1 < chunks) scores(c + 1);
      softmax(c);
      if (c > 0) fold(c - 1);
      product(c);
    }
    fold(chunks - 1);
    finish();
  }

 private:
  int64_t tiles_of(int64_t c) const { return (std::min(kChunk, end_ - c * kChunk) + kLanes - 1) / kLanes; }
  int64_t row_of(int64_t t) const { return st_.row_of(span_, kv_head_, t); }

  // The item's queries as bf16 pairs [d / 2][lane] (lane i: row row0 + i / group, head
  // first_head + i % group; padding lanes are zeros at position -1, computed and never written).
  void start(const Item& it) {
    const int64_t ctx = st_.ctx_lens[it.span];
    span_ = it.span;
    kv_head_ = it.kv_head;
    vt_ = transposed_v_.rows(st_, it.span, it.kv_head);
    vt_words_ = transposed_v_.words_per_row();
    first_row_ = st_.starts[it.span] + it.row0;
    first_head_ = it.kv_head * st_.group;
    lanes_ = (it.row1 - it.row0) * st_.group;
    width_ = round_up(lanes_, kLanes);
    blocks_ = width_ / kLanes;
    end_ = ctx + it.row1;   // the item's last row sees keys 0..end - 1
    for (int64_t i = 0; i < width_; ++i) {
      pos_[i] = i < lanes_ ? static_cast<int32_t>(ctx + it.row0 + i / st_.group) : -1;
      m_[i] = kMasked;
      l_[i] = 0.f;
    }
    for (int64_t i = 0; i < lanes_; ++i)
      std::memcpy(q_rows_ + i * kHalfDim,
                  st_.q + (first_row_ + i / st_.group) * st_.q_tok + (first_head_ + i % st_.group) * st_.q_head,
                  kDim * sizeof(c10::BFloat16));
    std::fill(q_rows_ + lanes_ * kHalfDim, q_rows_ + width_ * kHalfDim, 0.f);
    treadle::vec::transpose(q_rows_, kHalfDim, reinterpret_cast<float*>(qt_), width_, width_, kHalfDim);
    std::fill(acc_, acc_ + width_ * kDim, 0.f);
  }

  // Chunk c's raw scores [key][query]: A = K (16 keys x 32 dims per step), B = the queries'
  // pairs. K tiles are read where they lie when a tile fills (part of) one block; else
  // copied, with zeros past the end. Keys past the end read in place are stale slots of the
  // span's last block: the softmax masks their scores by a select, whatever they hold.
  void scores(int64_t c) {
    const int64_t t0 = c * kChunk, tiles = tiles_of(c);
    const bool in_place = st_.block_size % kLanes == 0;
    const int64_t k_stride = in_place ? st_.c_tok * 2 : kDim * 2;
    const c10::BFloat16* k_rows[kChunk / kLanes];
    for (int64_t j = 0; j < tiles; ++j) {
      const int64_t t = t0 + j * kLanes;
      if (in_place) {
        k_rows[j] = st_.k + row_of(t);
        continue;
      }
      c10::BFloat16* tile = k_tile_ + j * kLanes * kDim;
      for (int64_t r = 0; r < kLanes; ++r) {
        c10::BFloat16* dst = tile + r * kDim;
        if (t + r < end_) std::memcpy(dst, st_.k + row_of(t + r), kDim * sizeof(c10::BFloat16));
        else std::memset(dst, 0, kDim * sizeof(c10::BFloat16));
      }
      k_rows[j] = tile;
    }
    float* s = s_[c & 1];
    const int64_t ld = width_ * 4;
    for (int64_t j = 0; j < tiles; j += 2)
      for (int64_t b = 0; b < blocks_; b += 2) {
        const int rows = std::min<int64_t>(2, tiles - j), cols = std::min<int64_t>(2, blocks_ - b);
        const Tiles k_side{{k_rows[j], k_rows[j + rows - 1]}, k_stride, 64};
        const Tiles q_side{{qt_ + b * kLanes, qt_ + (b + cols - 1) * kLanes}, ld, 16 * ld};
        float* const o = s + j * kLanes * width_ + b * kLanes;
        float* const out[2][2] = {{o, o + kLanes}, {o + kLanes * width_, o + kLanes * width_ + kLanes}};
        multiply(k_side, q_side, kHalves, out, ld, rows, cols, false);
      }
  }

  // Online softmax, lane by lane, over chunk c's scaled scores s * scale. Keys a lane may not
  // see (later positions, or stale slots past the end, whatever they hold) are left out of
  // its max by a mask and get p = 0 by a select; a chunk every lane of the block sees in full
  // skips both. P goes out as the B tiles of the product with V: rows of keys 2r and 2r + 1
  // interleaved into words, row r of [pair][query].
  void softmax(int64_t c) {
    const int64_t t0 = c * kChunk, rows = tiles_of(c) * kLanes, pair_blocks = (rows + 31) / 32;
    // In log2 units: the scale holds log2(e), and m_ keeps each lane's running max as such.
    const __m512 scale = _mm512_set1_ps(st_.scale * kLog2e), floor = _mm512_set1_ps(kExp2Floor);
    for (int64_t b = 0; b < blocks_; ++b) {
      const float* sb = s_[c & 1] + b * kLanes;
      const __m512i lane_pos = _mm512_loadu_si512(pos_ + b * kLanes);
      const bool masked = t0 + rows - 1 > pos_[b * kLanes];   // lane 0 has the block's least
      auto seen = [&](int64_t r) {
        return _mm512_cmple_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(t0 + r)), lane_pos);
      };
      // Four running maxima (rows is a multiple of 16): one would chain every row's max to
      // the one before.
      __m512 maxima[4];
      for (__m512& m : maxima) m = _mm512_set1_ps(kMasked);
      for (int64_t r = 0; r < rows; r += 4)
        for (int64_t i = 0; i < 4; ++i) {
          const __m512 v = _mm512_loadu_ps(sb + (r + i) * width_);
          maxima[i] = masked ? _mm512_mask_max_ps(maxima[i], seen(r + i), maxima[i], v) : _mm512_max_ps(maxima[i], v);
        }
      const __m512 raw_max = _mm512_max_ps(_mm512_max_ps(maxima[0], maxima[1]), _mm512_max_ps(maxima[2], maxima[3]));
      const __m512 old_max = _mm512_loadu_ps(m_ + b * kLanes);
      const __m512 mx = _mm512_max_ps(old_max, _mm512_mul_ps(raw_max, scale));
      const __m512 alpha = exp2_nonpositive(_mm512_max_ps(_mm512_sub_ps(old_max, mx), floor));
      _mm512_storeu_ps(alpha_[c & 1] + b * kLanes, alpha);
      _mm512_storeu_ps(m_ + b * kLanes, mx);
      auto probability = [&](int64_t r) {
        const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(sb + r * width_), scale, mx);
        const __m512 e = exp2_nonpositive(_mm512_max_ps(x, floor));   // max() also turns a NaN into the floor
        return masked ? _mm512_maskz_mov_ps(seen(r), e) : e;
      };
      __m512 sum = _mm512_setzero_ps();
      uint32_t* pb = pb_ + b * (kChunk / 2) * kLanes;
      for (int64_t pair = 0; pair < pair_blocks * kLanes; ++pair) {
        __m512 p0 = _mm512_setzero_ps(), p1 = p0;
        if (2 * pair < rows) {   // rows is even: 2 pair + 1 is a row too
          p0 = probability(2 * pair);
          p1 = probability(2 * pair + 1);
          sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
        }
        _mm512_store_si512(pb + pair * kLanes, interleave_bf16(p0, p1));
      }
      _mm512_storeu_ps(l_ + b * kLanes, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(l_ + b * kLanes), alpha), sum));
    }
  }

  // pv[d][query] = V^T[d][key] P^T[key][query] for chunk c: A = V^T (16 dims x 32 keys per
  // step), B = P's pairs. Into fresh tiles; fold() adds them to the output later.
  void product(int64_t c) {
    const int64_t steps = (tiles_of(c) + 1) / 2;
    const uint32_t* vt = vt_ + c * (kChunk / 2);
    for (int64_t d = 0; d < kDimBlocks; d += 2)
      for (int64_t b = 0; b < blocks_; b += 2) {
        const int cols = std::min<int64_t>(2, blocks_ - b);
        const Tiles v_side{{vt + d * kLanes * vt_words_, vt + (d + 1) * kLanes * vt_words_}, vt_words_ * 4, 64};
        const uint32_t* p_first = pb_ + b * (kChunk / 2) * kLanes;
        const Tiles p_side{{p_first, p_first + (cols - 1) * (kChunk / 2) * kLanes}, 64, kLanes * 64};
        float* const o = pv_ + d * kLanes * width_ + b * kLanes;
        float* const out[2][2] = {{o, o + kLanes}, {o + kLanes * width_, o + kLanes * width_ + kLanes}};
        multiply(v_side, p_side, steps, out, width_ * 4, 2, cols, false);
      }
  }

  // acc = acc * alpha + pv, column i by lane i's rescale for chunk c: its P V into the output.
  void fold(int64_t c) {
    for (int64_t q = 0; q < width_; q += kLanes) {
      const __m512 a = _mm512_loadu_ps(alpha_[c & 1] + q);
      for (int64_t i = q; i < kDim * width_; i += width_)
        _mm512_storeu_ps(acc_ + i, _mm512_fmadd_ps(_mm512_loadu_ps(acc_ + i), a, _mm512_loadu_ps(pv_ + i)));
    }
  }

  // out = acc / l, transposed back to [query][d] (in pv_, free by now).
  void finish() {
    for (int64_t q = 0; q < width_; q += kLanes) {
      const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_loadu_ps(l_ + q));
      for (int64_t i = q; i < kDim * width_; i += width_) _mm512_storeu_ps(acc_ + i, _mm512_mul_ps(_mm512_loadu_ps(acc_ + i), inv));
    }
    treadle::vec::transpose(acc_, width_, pv_, kDim, kDim, width_);
    for (int64_t i = 0; i < lanes_; ++i) {
      c10::BFloat16* dst = st_.out + (first_row_ + i / st_.group) * st_.o_tok + (first_head_ + i % st_.group) * st_.o_head;
      for (int64_t d = 0; d < kDim; d += kLanes)   // rounded to nearest even, as torch's cast
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(pv_ + i * kDim + d)));
    }
  }

  const Step& st_;
  TransposedV<kDim> transposed_v_;
  int64_t max_width_;
  at::Tensor scratch_;
  float *q_rows_, *s_[2], *acc_, *pv_, *m_, *l_, *alpha_[2];
  uint32_t *qt_, *pb_;
  c10::BFloat16* k_tile_;
  int32_t* pos_;
  // The item at hand.
  const uint32_t* vt_ = nullptr;   // its span's V^T for its KV head, vt_words_ words a row
  int64_t span_ = 0, vt_words_ = 0, kv_head_ = 0, first_row_ = 0, first_head_ = 0, lanes_ = 0, width_ = 0, blocks_ = 0, end_ = 0;
};

template <int kHalves>
void prefill_attention_tiles(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_table,
                             const at::Tensor& query_start, const at::Tensor& context_lens, double scale) {
  using bf16 = c10::BFloat16;
  const Step st{q.size(1) / k_cache.size(2), k_cache.size(1), block_table.size(1), q.stride(0), q.stride(1),
                out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                q.data_ptr<bf16>(), k_cache.data_ptr<bf16>(), v_cache.data_ptr<bf16>(), out.data_ptr<bf16>(),
                block_table.data_ptr<int32_t>(), query_start.data_ptr<int32_t>(), context_lens.data_ptr<int32_t>(),
                static_cast<float>(scale)};
  const int64_t rows_per_item = std::max<int64_t>(1, kItemQueries / st.group);
  const std::vector<Item> items = treadle::prefill::make_items(st.starts, st.ctx_lens, context_lens.size(0),
                                                               k_cache.size(2), rows_per_item,
                                                               st.max_blocks * st.block_size, q.size(0));
  const int64_t max_width = round_up(rows_per_item * st.group, kLanes);
  TORCH_CHECK(max_width <= kItemQueries, "an item holds at most ", kItemQueries, " queries");
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    static const treadle::amx::TileConfig config;   // tiles 0-3 accumulate, 4-5 hold A, 6-7 B (multiply())
    _tile_loadconfig(&config);
    ItemWork<kHalves> work(st, max_width);
    for (int64_t idx = next++; idx < static_cast<int64_t>(items.size()); idx = next++) work.run(items[idx]);
    _tile_release();
  });
}

}  // namespace

namespace treadle {

bool prefill_tiles_ready(const at::Tensor& q, const at::Tensor& k_cache) {
  if (q.scalar_type() != at::kBFloat16 || (q.size(2) != 64 && q.size(2) != 128) ||
      q.size(1) / k_cache.size(2) > kItemQueries)
    return false;
  return treadle::amx::tiles_permitted();   // asked only by a process that would use them
}

void prefill_attention_tiles(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_table,
                             const at::Tensor& query_start, const at::Tensor& context_lens, double scale) {
  if (q.size(2) == 64)
    ::prefill_attention_tiles<2>(out, q, k_cache, v_cache, block_table, query_start, context_lens, scale);
  else
    ::prefill_attention_tiles<4>(out, q, k_cache, v_cache, block_table, query_start, context_lens, scale);
}

}  // namespace treadle

#else

namespace treadle {
bool prefill_tiles_ready(const at::Tensor&, const at::Tensor&) { return false; }
void prefill_attention_tiles(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, double) {
  TORCH_CHECK(false, "built without AMX tiles");
}
}  // namespace treadle

#endif
