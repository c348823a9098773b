// What both decode kernels share (paged_decode.cpp, and paged_decode_amx.cpp on AMX tiles):
// how a step splits into work items, and each item's row offsets in the caches.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace treadle::decode {

// KV heads per work item (an item is a sequence and a run of its KV heads, handed out
// dynamically since lengths vary a lot): all of them, up to `most`, so that each block is read
// as one contiguous run the hardware prefetcher streams; one when there are too few sequences
// for the threads to go round.
inline int64_t kv_heads_per_item(int64_t num_seqs, int64_t num_kv_heads, int64_t most) {
  return num_seqs >= 2 * at::get_num_threads() ? std::min(num_kv_heads, most) : 1;
}

// offs[t]: token t's row in the caches (KV head 0) for the `len` tokens of the sequence whose
// block table is `table`. Once per item: a division per row read measured as costly as the
// rest of the work.
inline void row_offsets(const int32_t* table, int64_t len, int64_t block_size, int64_t c_block, int64_t c_tok,
                        std::vector<int64_t>& offs) {
  offs.resize(len);
  for (int64_t t0 = 0, b = 0; t0 < len; t0 += block_size, ++b) {
    const int64_t base = table[b] * c_block;
    for (int64_t i = 0; i < std::min(block_size, len - t0); ++i) offs[t0 + i] = base + i * c_tok;
  }
}

}  // namespace treadle::decode
