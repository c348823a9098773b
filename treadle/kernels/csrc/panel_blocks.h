// How the panel kernels (linear_panels.cpp in fp32, linear_pairs.cpp in bf16 pairs) walk a
// linear: each thread takes a range of the weight's panels (32 outputs each, packed once); for
// each panel the rows of x go by in blocks of near-equal size (13 rows with at most 12 per
// block: 7 and 6, not 12 and 1), each block asking for its share of the thread's next panel
// into L2, so that memory streams while a panel already in L2 is multiplied.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>

namespace treadle::panels {

// Asks for `lines` lines from `ahead` into L2, spread evenly over a block's `steps` calls of
// step() (its steps along the inputs): the block's share of the next panel.
class AheadLines {
 public:
  AheadLines(const char* ahead, int64_t lines, int64_t steps) : ahead_(ahead), lines_(lines), steps_(steps) {}
  void step() {
    for (due_ += lines_; due_ >= steps_; due_ -= steps_, ++asked_) __builtin_prefetch(ahead_ + 64 * asked_, 0, 2);
  }

 private:
  const char* ahead_;
  int64_t lines_, steps_, asked_ = 0, due_ = 0;  // asked_: lines asked for so far
};

// Calls block(panel, first row, rows, ahead, ahead_lines) for every panel and block of rows:
// `ahead_lines` lines from `ahead` (nullptr for a thread's last panel) are this block's share
// of the next panel. Panels are `panel_bytes` apart from `w`.
template <typename Block>
void for_each_block(int64_t m, int64_t most_rows, int64_t panels, const void* w, int64_t panel_bytes,
                    Block&& block) {
  const int64_t blocks = (m + most_rows - 1) / most_rows, panel_lines = panel_bytes / 64;
  const char* base = static_cast<const char*>(w);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const char* next = p + 1 < end ? base + (p + 1) * panel_bytes : nullptr;
      for (int64_t b = 0, row = 0; b < blocks; ++b) {
        const int64_t rows = (m - row) / (blocks - b);
        const int64_t first = panel_lines * b / blocks, last = panel_lines * (b + 1) / blocks;
        block(p, row, rows, next ? next + 64 * first : nullptr, next ? last - first : 0);
        row += rows;
      }
    }
  });
}

}  // namespace treadle::panels
