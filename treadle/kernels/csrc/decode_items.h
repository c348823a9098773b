// What both decode kernels share (paged_decode.cpp, and paged_decode_amx.cpp on AMX tiles):
// how a step splits into work items, each item's row offsets in the caches, and where its
// results go.
//
// A sequence longer than a part (kPartTokens*) is split into parts of that many tokens, each its own
// work items, whose results are merged once all are done (merge_parts). Unsplit, a lone long
// sequence made one item per KV head: three items for two threads with SmolLM2, one thread
// idle for a third of the attention. The split follows the length alone, so a sequence's
// result does not depend on the sequences batched beside it.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

namespace treadle::decode {

// Tokens per part, by kernel. Multiples of 16, so that the tile kernel's score tiles start on
// a part's first token, and large enough that a part's fixed costs (its queries, its merge,
// its V passes starting cold) stay small beside reading its K and V.
constexpr int64_t kPartTokensVec = 512, kPartTokensTiles = 1024;

inline int64_t num_parts(int64_t len, int64_t part_tokens) {
  return std::max<int64_t>(1, (len + part_tokens - 1) / part_tokens);
}

// A sequence of `len` tokens attends to its last `window` (0: to all of them): the decode
// query sits at len - 1, and keys at len - 1 - window and before are out of its window.
inline int64_t window_start(int64_t len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, len - window) : 0;
}

struct WorkItem {
  int64_t seq, kv0, kv_heads;  // a sequence and a run of its KV heads
  int64_t t0, t1;              // its tokens
  int64_t part;                // its row in Parts, or -1: the whole sequence, written to out
};

// The results of split sequences' parts, per part row and query head: the output normalized
// within the part (head_dim floats), the part's largest scaled score, and its sum of exp.
struct Parts {
  int64_t num_heads = 0, head_dim = 0, part_tokens = 0, window = 0;
  std::vector<int64_t> first;   // per sequence: its first part row, or -1 when it is whole
  std::vector<float> out, max, sum;

  float* out_of(int64_t row, int64_t h) { return out.data() + (row * num_heads + h) * head_dim; }
};

// The step's work items, and `parts` sized for them; each sequence's tokens from
// window_start on. An item holds all of a sequence's KV heads
// (up to `most`), so that each block is read as one contiguous run the hardware prefetcher
// streams, unless there are too few items for the threads to go round: then one KV head each.
inline std::vector<WorkItem> plan_items(const int32_t* lens, int64_t num_seqs, int64_t num_heads,
                                        int64_t num_kv_heads, int64_t head_dim, int64_t most, int64_t part_tokens,
                                        Parts& parts, int64_t window = 0) {
  parts.part_tokens = part_tokens;
  parts.num_heads = num_heads;
  parts.head_dim = head_dim;
  parts.window = window;
  parts.first.assign(num_seqs, -1);
  int64_t rows = 0, spans = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t n = num_parts(lens[s] - window_start(lens[s], window), part_tokens);
    if (n > 1) {
      parts.first[s] = rows;
      rows += n;
    }
    spans += n;
  }
  parts.out.resize(rows * num_heads * head_dim);
  parts.max.resize(rows * num_heads);
  parts.sum.resize(rows * num_heads);
  const int64_t per_item = spans >= 2 * at::get_num_threads() ? std::min(num_kv_heads, most) : 1;
  std::vector<WorkItem> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = lens[s], start = window_start(len, window), n = num_parts(len - start, part_tokens);
    for (int64_t p = 0; p < n; ++p)
      for (int64_t kv0 = 0; kv0 < num_kv_heads; kv0 += per_item)
        items.push_back({s, kv0, std::min(per_item, num_kv_heads - kv0), start + p * part_tokens,
                         std::min(len, start + (p + 1) * part_tokens), n > 1 ? parts.first[s] + p : -1});
  }
  return items;
}

// offs[t - t0]: token t's row in the caches (KV head 0), for tokens t0..t1 of the sequence whose
// block table is `table`. Once per item: a division per row read measured as costly as the
// rest of the work.
inline void row_offsets(const int32_t* table, int64_t t0, int64_t t1, int64_t block_size, int64_t c_block,
                        int64_t c_tok, std::vector<int64_t>& offs) {
  offs.resize(std::max<int64_t>(0, t1 - t0));
  for (int64_t t = t0; t < t1;) {
    const int64_t b = t / block_size, base = table[b] * c_block, end = std::min(t1, (b + 1) * block_size);
    for (; t < end; ++t) offs[t - t0] = base + (t - b * block_size) * c_tok;
  }
}

// The K rows of a thread's next item, asked for into L2 a few lines at a time while the
// current item runs its V pass, so that the next score pass reads them from L2 rather than
// waiting on memory with the arithmetic idle. Decode attention alone, 64 sequences: 7%
// faster on tiles, 5% in the bf16 vector kernel, 2-4% in fp32 (docs/performance-log.md). A
// prefetch never faults, so a wrong address would cost time, not correctness.
class KAhead {
 public:
  // Aims at item `w`'s K rows in `k` (elements of `elem` bytes), to be asked for over `steps`
  // calls of step().
  void aim(const WorkItem& w, const int32_t* tables, int64_t max_blocks, int64_t block_size, int64_t c_block,
           int64_t c_tok, int64_t c_head, const void* k, int64_t elem, int64_t steps) {
    row_offsets(tables + w.seq * max_blocks, w.t0, w.t1, block_size, c_block, c_tok, offs_);
    k_ = static_cast<const char*>(k) + w.kv0 * c_head * elem;
    elem_ = elem;
    lines_per_row_ = std::max<int64_t>(1, w.kv_heads * c_head * elem / 64);
    const int64_t lines = static_cast<int64_t>(offs_.size()) * lines_per_row_;
    per_step_ = (lines + steps - 1) / std::max<int64_t>(1, steps);
    row_ = line_ = 0;
  }
  void clear() { offs_.clear(); row_ = line_ = 0; }

  // The next per_step_ lines, walked by row and line. A division per line took about half of
  // the V pass's samples with the caches in L3 (the kernel 12% faster without; level from
  // memory, docs/performance-log.md).
  void step() {
    const int64_t rows = static_cast<int64_t>(offs_.size());
    int64_t row = row_, line = line_;
    for (int64_t n = per_step_; n > 0 && row < rows; --n) {
      __builtin_prefetch(k_ + offs_[row] * elem_ + 64 * line, 0, 2);
      if (++line == lines_per_row_) {
        line = 0;
        ++row;
      }
    }
    row_ = row;
    line_ = line;
  }

 private:
  std::vector<int64_t> offs_;
  const char* k_ = nullptr;
  int64_t elem_ = 0, lines_per_row_ = 1, per_step_ = 0, row_ = 0, line_ = 0;  // row_, line_: the next line asked for
};

// Runs run(item, next item or nullptr) over the step's items on this thread, taking items from
// `next` (shared by the threads). With enough items to go round, a thread takes its next item
// before running the one it holds, so that run() can ask for its K ahead; with few, taking
// ahead could leave a thread idle, so it does not.
template <typename Run>
void run_items(const std::vector<WorkItem>& items, std::atomic<int64_t>& next, Run&& run) {
  const int64_t n = static_cast<int64_t>(items.size());
  if (n < 4 * at::get_num_threads()) {
    for (int64_t idx = next++; idx < n; idx = next++) run(items[idx], nullptr);
    return;
  }
  for (int64_t idx = next++; idx < n;) {
    const int64_t after = next++;
    run(items[idx], after < n ? &items[after] : nullptr);
    idx = after;
  }
}

// Where an item of a split sequence writes its output: its part row, at its first query head.
inline float* part_row(const WorkItem& it, int64_t group, Parts& parts) {
  return it.part < 0 ? nullptr : parts.out_of(it.part, it.kv0 * group);
}

// An item of a split sequence keeps each of its query heads' largest scaled score and sum of
// exp for merge_parts.
inline void keep_softmax(const WorkItem& it, int64_t group, const float* max, const float* sum, Parts& parts) {
  if (it.part < 0) return;
  const int64_t at = it.part * parts.num_heads + it.kv0 * group;
  std::copy(max, max + it.kv_heads * group, parts.max.data() + at);
  std::copy(sum, sum + it.kv_heads * group, parts.sum.data() + at);
}

// out for every split sequence: its parts' outputs weighted by each part's share of the whole
// softmax, exp(max_p - max) * sum_p over the sum of those.
template <typename scalar_t>
void merge_parts(Parts& parts, const int32_t* lens, int64_t num_seqs, scalar_t* out, int64_t o_seq, int64_t o_head) {
  const int64_t heads = parts.num_heads, hd = parts.head_dim;
  at::parallel_for(0, num_seqs * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(hd), weight;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = i / heads, h = i % heads, row0 = parts.first[s];
      if (row0 < 0) continue;
      const int64_t n = num_parts(lens[s] - window_start(lens[s], parts.window), parts.part_tokens);
      float top = parts.max[row0 * heads + h], total = 0.f;
      for (int64_t p = 1; p < n; ++p) top = std::max(top, parts.max[(row0 + p) * heads + h]);
      weight.resize(n);
      for (int64_t p = 0; p < n; ++p) {
        weight[p] = std::exp(parts.max[(row0 + p) * heads + h] - top) * parts.sum[(row0 + p) * heads + h];
        total += weight[p];
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = 0; p < n; ++p) {
        const float* o = parts.out_of(row0 + p, h);
        for (int64_t d = 0; d < hd; ++d) acc[d] += weight[p] * o[d];
      }
      scalar_t* dst = out + s * o_seq + h * o_head;
      for (int64_t d = 0; d < hd; ++d) dst[d] = static_cast<scalar_t>(acc[d] / total);
    }
  });
}

}  // namespace treadle::decode
