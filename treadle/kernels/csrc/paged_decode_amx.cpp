// bf16 paged decode attention on AMX tiles, called by paged_decode.cpp where the CPU has them:
// the same inputs and layout, one query per sequence. Decode reads every K/V byte once for a
// few multiply-adds, so what bounds it is the instructions spent per byte: the vector kernel's
// score pass costs about a dozen per K row, this one a fraction of a tile instruction.
//
// A work item is a sequence and a run of its KV heads whose query heads fit 16 lanes (for
// SmolLM2, all three KV heads and their nine query heads):
// - scores [token][lane], 16 tokens per tile: A = 16 K rows of one KV head (32 dims per step),
//   read where they lie in the cache; B = that KV head's queries as bf16 pairs [d / 2][lane],
//   zero in the lanes of the other KV heads. The item's KV heads accumulate into one tile, so
//   each lane ends with its own head's score (the other terms are exact zeros);
// - softmax lane by lane, with the row sums in fp32; P is rounded to bf16 for the product
//   with V, as in the prefill tile kernel;
// - out += P V with VDPBF16PS on pairs of tokens: (p_t, p_t+1) times (v_t[d], v_t+1[d]).
// Scores of slots past the sequence's end (stale, possibly NaN) are never read, and their V
// rows are read as zeros.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "amx.h"
#include "decode_items.h"
#include "ops.h"
#include "prefill_items.h"   // the softmax's constants
#include "vec.h"

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#include <algorithm>
#include <atomic>
#include <vector>

namespace {

using bf16 = c10::BFloat16;
constexpr int64_t kLanes = 16;        // tokens per score tile, and query heads per item at most
// Tokens ahead to request V rows from memory: 32 beat 16 and 64 by 2-5%. K is asked for
// during the previous item's V passes (decode_items.h, KAhead); asking for it a few tiles
// ahead within its own score pass was 7% slower.
constexpr int64_t kPrefetch = 32;
using treadle::prefill::kExpFloor;
using treadle::prefill::kMasked;

struct Step {
  const bf16 *q, *k, *v;
  bf16* out;
  const int32_t *tables, *lens;
  int64_t group, block_size, max_blocks, q_seq, q_head, o_seq, o_head, c_block, c_tok, c_head;
  float scale;
};

// An item's softmax, lane by lane: its max, then p = exp(scale * (s - max)) as pairs of tokens
// rounded to bf16 (pairs[t / 2][lane]), and 1 / the fp32 sum of the unrounded p; the scaled
// max and the sum kept for merging parts. The p are computed during the item's first V pass,
// pair by pair as that pass uses them, not in a pass of their own between the scores and V,
// where no K or V streamed from memory while the arithmetic ran: decode attention alone 5%
// faster (docs/performance-log.md).
struct Softmax {
  const float* scores = nullptr;   // [token][lane], unscaled
  int64_t len = 0;
  __m512 mx, scale, sum;
  alignas(64) float inv_sum[kLanes], max[kLanes], total[kLanes];

  void start(const float* s, int64_t n, float sc) {
    scores = s;
    len = n;
    mx = lane_max();
    scale = _mm512_set1_ps(sc);
    sum = _mm512_setzero_ps();
  }

  // Tokens t and t + 1 into their pair row (t even; a token past the end gives p = 0).
  void pair(int64_t t, uint32_t* pairs) {
    const __m512 p0 = p(t), p1 = t + 1 < len ? p(t + 1) : _mm512_setzero_ps();
    sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
    _mm512_storeu_si512(pairs + (t / 2) * kLanes, treadle::amx::interleave_bf16(p0, p1));
  }

  void finish() {
    _mm512_storeu_ps(inv_sum, _mm512_div_ps(_mm512_set1_ps(1.f), sum));
    _mm512_storeu_ps(max, _mm512_mul_ps(mx, scale));
    _mm512_storeu_ps(total, sum);
  }

 private:
  __m512 p(int64_t t) const {   // max() also turns a NaN into the floor
    const __m512 x = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(scores + t * kLanes), mx), scale);
    return treadle::vec::exp_nonpositive(_mm512_max_ps(x, _mm512_set1_ps(kExpFloor)));
  }

  // Each lane's largest score, in four chains: one chain waited on each max in turn.
  __m512 lane_max() const {
    __m512 m[4];
    for (auto& x : m) x = _mm512_set1_ps(kMasked);
    int64_t t = 0;
    for (; t + 4 <= len; t += 4)
      for (int i = 0; i < 4; ++i) m[i] = _mm512_max_ps(m[i], _mm512_loadu_ps(scores + (t + i) * kLanes));
    for (; t < len; ++t) m[0] = _mm512_max_ps(m[0], _mm512_loadu_ps(scores + t * kLanes));
    return _mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3]));
  }
};

// out[HT heads][32 * kHalves dims] for KV head g, its first lane h0: sum over token pairs of
// (p_t, p_t+1) . (v_t, v_t+1), then divided by the lane's sum. Accumulators in registers. Cast
// into dst, or kept whole in `part_row` (decode_items.h) when the sequence is split. The
// item's first pass (`fresh`) computes the softmax's pairs as it goes.
template <int kHalves, int HT>
__attribute__((noinline)) void accumulate_v(const Step& st, const int64_t* offs, int64_t len, int64_t kv_head,
                                            int64_t h0, uint32_t* pairs, Softmax& softmax, bool fresh,
                                            bf16* const* dst, float* part_row, treadle::decode::KAhead& ahead) {
  constexpr int D = 2 * kHalves;   // vectors of 16 fp32 in a head's output
  __m512 acc[HT][D];
  for (int i = 0; i < HT; ++i)
    for (int d = 0; d < D; ++d) acc[i][d] = _mm512_setzero_ps();
  const bf16* v = st.v + kv_head * st.c_head;
  for (int64_t t = 0; t < len; t += 2) {
    if (fresh) softmax.pair(t, pairs);
    ahead.step();
    if (t + kPrefetch + 1 < len) {
      for (int u = 0; u < 2; ++u) {
        const char* row = reinterpret_cast<const char*>(v + offs[t + kPrefetch + u]);
        for (int b = 0; b < kHalves; ++b) __builtin_prefetch(row + 64 * b);
      }
    }
    const bf16* r0 = v + offs[t];
    const bf16* r1 = t + 1 < len ? v + offs[t + 1] : nullptr;
    __m512bh vp[D];
    for (int b = 0; b < kHalves; ++b) {
      const __m512i a = _mm512_loadu_si512(r0 + 32 * b);
      const __m512i c = r1 ? _mm512_loadu_si512(r1 + 32 * b) : _mm512_setzero_si512();
      __m512i low, high;
      treadle::amx::interleave_rows(a, c, low, high);
      vp[2 * b] = (__m512bh)low;
      vp[2 * b + 1] = (__m512bh)high;
    }
    const uint32_t* pt = pairs + (t / 2) * kLanes + h0;
    for (int i = 0; i < HT; ++i) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pt[i]));
      for (int d = 0; d < D; ++d) acc[i][d] = _mm512_dpbf16_ps(acc[i][d], p, vp[d]);
    }
  }
  if (fresh) softmax.finish();
  for (int i = 0; i < HT; ++i) {
    const __m512 inv = _mm512_set1_ps(softmax.inv_sum[h0 + i]);
    for (int d = 0; d < D; ++d) {
      const __m512 o = _mm512_mul_ps(acc[i][d], inv);
      if (part_row) _mm512_storeu_ps(part_row + (h0 + i) * 16 * D + 16 * d, o);
      else   // rounded to nearest even, as torch's cast
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst[i] + 16 * d), (__m256i)_mm512_cvtneps_pbh(o));
    }
  }
}

// accumulate_v on the widest tile of at most HT heads that `left` heads fill.
template <int kHalves, int HT>
void accumulate_v_tile(const Step& st, const int64_t* offs, int64_t len, int64_t kv_head, int64_t h0, int64_t left,
                       uint32_t* pairs, Softmax& softmax, bool fresh, bf16* const* dst, float* part_row,
                       treadle::decode::KAhead& ahead) {
  if constexpr (HT > 1) {
    if (left < HT)
      return accumulate_v_tile<kHalves, HT - 1>(st, offs, len, kv_head, h0, left, pairs, softmax, fresh, dst,
                                                part_row, ahead);
  }
  accumulate_v<kHalves, HT>(st, offs, len, kv_head, h0, pairs, softmax, fresh, dst, part_row, ahead);
}

// One thread's items (decode_items.h), with its scratch: the queries' B tiles, the scores,
// the softmax, P's pairs.
template <int kHalves>
class SeqWork {
 public:
  explicit SeqWork(const Step& st) : st_(st) {}

  void run(const treadle::decode::WorkItem& w, const treadle::decode::WorkItem* after,
           treadle::decode::Parts& parts) {
    len_ = w.t1 - w.t0;
    if (len_ <= 0) return;
    if (after != nullptr)
      ahead_.aim(*after, st_.tables, st_.max_blocks, st_.block_size, st_.c_block, st_.c_tok, st_.c_head, st_.k,
                 sizeof(bf16), w.kv_heads * ((len_ + 1) / 2));
    else
      ahead_.clear();
    kv0_ = w.kv0;
    kv_heads_ = w.kv_heads;
    lanes_ = w.kv_heads * st_.group;
    treadle::decode::row_offsets(st_.tables + w.seq * st_.max_blocks, w.t0, w.t1, st_.block_size, st_.c_block,
                                 st_.c_tok, offs_);
    queries(w.seq);
    scores();
    softmax_.start(scores_.data(), len_, st_.scale);
    pairs_.resize((len_ + 1) / 2 * kLanes);
    float* part_row = treadle::decode::part_row(w, st_.group, parts);
    for (int64_t g = 0; g < kv_heads_; ++g) {
      for (int64_t h = g * st_.group; h < (g + 1) * st_.group; h += kHeadTile) {
        bf16* dst[kHeadTile];
        for (int64_t i = 0; i < std::min<int64_t>(kHeadTile, (g + 1) * st_.group - h); ++i)
          dst[i] = st_.out + w.seq * st_.o_seq + (kv0_ * st_.group + h + i) * st_.o_head;
        accumulate_v_tile<kHalves, kHeadTile>(st_, offs_.data(), len_, kv0_ + g, h, (g + 1) * st_.group - h,
                                              pairs_.data(), softmax_, h == 0, dst, part_row, ahead_);
      }
    }
    treadle::decode::keep_softmax(w, st_.group, softmax_.max, softmax_.total, parts);
  }

 private:
  // Heads per register tile of accumulate_v: its accumulators and a token pair's V fit in 32
  // vector registers.
  static constexpr int kHeadTile = kHalves == 2 ? 4 : 2;

  // B tiles [KV head][step][d / 2][lane]: lane j holds query head kv0 * group + j's dims
  // 32 * step + 2r, 2r + 1 in row r (a pair is one 32-bit word of the query as stored) in its
  // own KV head's tiles and zeros in the others'.
  void queries(int64_t seq) {
    qt_.assign(kv_heads_ * kHalves * kLanes * kLanes, 0u);
    for (int64_t j = 0; j < lanes_; ++j) {
      const auto* q = reinterpret_cast<const uint32_t*>(st_.q + seq * st_.q_seq + (kv0_ * st_.group + j) * st_.q_head);
      uint32_t* tiles = qt_.data() + (j / st_.group) * kHalves * kLanes * kLanes;
      for (int64_t r = 0; r < kHalves * kLanes; ++r) tiles[r * kLanes + j] = q[r];
    }
  }

  // scores_[t][lane] = K[t] . q[lane] (unscaled), two 16-token tiles at a time into tiles 0-1,
  // K rows in 2-3, queries in 4. A block of a multiple of 16 tokens holds whole tiles, so the
  // rows of the last tile past the end are slots of the sequence's own last block.
  void scores() {
    const int64_t tiles = (len_ + kLanes - 1) / kLanes;
    scores_.resize(tiles * kLanes * kLanes);
    const int64_t stride = st_.c_tok * static_cast<int64_t>(sizeof(bf16));
    for (int64_t j = 0; j < tiles; j += 2) {
      const bool two = j + 1 < tiles;
      _tile_zero(0);
      if (two) _tile_zero(1);
      for (int64_t g = 0; g < kv_heads_; ++g)
        for (int s = 0; s < kHalves; ++s) {
          const int64_t col = (kv0_ + g) * st_.c_head + 32 * s;
          _tile_loadd(4, qt_.data() + (g * kHalves + s) * kLanes * kLanes, 64);
          _tile_loadd(2, st_.k + offs_[j * kLanes] + col, stride);
          _tile_dpbf16ps(0, 2, 4);
          if (two) {
            _tile_loadd(3, st_.k + offs_[(j + 1) * kLanes] + col, stride);
            _tile_dpbf16ps(1, 3, 4);
          }
        }
      _tile_stored(0, scores_.data() + j * kLanes * kLanes, 64);
      if (two) _tile_stored(1, scores_.data() + (j + 1) * kLanes * kLanes, 64);
    }
  }

  const Step& st_;
  std::vector<int64_t> offs_;
  treadle::decode::KAhead ahead_;   // the next item's K, asked for during the V passes
  std::vector<uint32_t> qt_, pairs_;
  std::vector<float> scores_;
  Softmax softmax_;
  int64_t len_ = 0, kv0_ = 0, kv_heads_ = 0, lanes_ = 0;
};

template <int kHalves>
void decode_attention_tiles(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_table, const at::Tensor& seq_lens, double scale) {
  const int64_t num_seqs = q.size(0), num_kv_heads = k_cache.size(2), group = q.size(1) / num_kv_heads;
  const Step st{q.data_ptr<bf16>(), k_cache.data_ptr<bf16>(), v_cache.data_ptr<bf16>(), out.data_ptr<bf16>(),
                block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), group, k_cache.size(1),
                block_table.size(1), q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
                k_cache.stride(1), k_cache.stride(2), static_cast<float>(scale)};
  // As many of a sequence's KV heads per item as fill 16 lanes.
  treadle::decode::Parts parts;
  const std::vector<treadle::decode::WorkItem> items = treadle::decode::plan_items(
      st.lens, num_seqs, q.size(1), num_kv_heads, q.size(2), std::max<int64_t>(1, kLanes / group),
      treadle::decode::kPartTokensTiles, parts);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    static const treadle::amx::TileConfig config;
    _tile_loadconfig(&config);
    SeqWork<kHalves> work(st);
    treadle::decode::run_items(items, next, [&](const treadle::decode::WorkItem& w,
                                                const treadle::decode::WorkItem* after) { work.run(w, after, parts); });
    _tile_release();
  });
  if (!parts.out.empty()) treadle::decode::merge_parts(parts, st.lens, num_seqs, st.out, st.o_seq, st.o_head);
}

}  // namespace

namespace treadle {

bool decode_tiles_ready(const at::Tensor& q, const at::Tensor& k_cache) {
  if (q.scalar_type() != at::kBFloat16 || (q.size(2) != 64 && q.size(2) != 128) ||
      q.size(1) / k_cache.size(2) > kLanes || k_cache.size(1) % kLanes != 0)
    return false;
  return treadle::amx::tiles_permitted();
}

void decode_attention_tiles(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                            double scale) {
  if (q.size(2) == 64) ::decode_attention_tiles<2>(out, q, k_cache, v_cache, block_table, seq_lens, scale);
  else ::decode_attention_tiles<4>(out, q, k_cache, v_cache, block_table, seq_lens, scale);
}

}  // namespace treadle

#else

namespace treadle {
bool decode_tiles_ready(const at::Tensor&, const at::Tensor&) { return false; }
void decode_attention_tiles(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, double) {
  TORCH_CHECK(false, "built without AMX tiles");
}
}  // namespace treadle

#endif
