// What both prefill kernels share (paged_prefill.cpp, and paged_prefill_amx.cpp on AMX tiles):
// their work items, the check that each span fits, and the constants of their softmax.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace treadle::prefill {

// Below any score, yet finite: -ffast-math assumes no inf.
constexpr float kMasked = -1e30f;
// exp's argument is kept above this, where exp is still a normal float (1.6e-38, nothing
// next to the row's largest term, 1): libmvec's vector exp takes a slow scalar path for
// lanes far out of range, such as masked keys. Masked keys get p = 0 by a select instead.
constexpr float kExpFloor = -87.f;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

struct Item {
  int64_t span, kv_head, row0, row1;  // rows row0..row1 of the span
};

// Items of up to rows_per_item rows for every span and KV head, from the last rows of each
// span back: those see the most keys, and handing them out first leaves the short ones to
// even out the threads at the end. Each span must fit the num_rows query rows and its block
// table (max_tokens slots).
inline std::vector<Item> make_items(const int32_t* starts, const int32_t* ctx_lens, int64_t num_spans,
                                    int64_t num_kv_heads, int64_t rows_per_item, int64_t max_tokens,
                                    int64_t num_rows) {
  std::vector<Item> items;
  for (int64_t s = 0; s < num_spans; ++s) {
    const int64_t rows = starts[s + 1] - starts[s], ctx = ctx_lens[s];
    TORCH_CHECK(rows >= 0 && ctx >= 0 && ctx + rows <= max_tokens && starts[s] >= 0 && starts[s + 1] <= num_rows,
                "span ", s, " does not fit its rows or its block table");
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t row1 = rows; row1 > 0; row1 -= rows_per_item)
        items.push_back({s, h, std::max<int64_t>(0, row1 - rows_per_item), row1});
  }
  return items;
}

}  // namespace treadle::prefill
