// Paged decode attention for CPU: one query token per sequence, reading K/V straight out of
// the block table. The torch path gathers K/V into a dense buffer first and SDPA reads it
// again, which triples the memory traffic that bounds decode attention.
//
// Layout (as in torch_backend.py): k_cache/v_cache [num_blocks, block_size, num_kv_heads,
// head_dim]; q/out [num_seqs, num_heads, head_dim] with the last dim contiguous; block_table
// int32 [num_seqs, max_blocks]; seq_lens int32 [num_seqs]. Accumulates in fp32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <vector>

namespace {

// Tokens ahead to prefetch K/V rows (about 3 KB of fp32 rows for SmolLM2); 2-16 measured,
// 4 fastest by a little at 48 decodes.
constexpr int64_t kPrefetch = 4;

template <typename scalar_t>
void decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& block_table,
                      const at::Tensor& seq_lens, double scale) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_table.size(1);
  const int64_t q_seq = q.stride(0), q_head = q.stride(1);
  const int64_t o_seq = out.stride(0), o_head = out.stride(1);
  const int64_t c_block = k_cache.stride(0), c_tok = k_cache.stride(1), c_head = k_cache.stride(2);
  const scalar_t* q_data = q.data_ptr<scalar_t>();
  const scalar_t* k_data = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_data = v_cache.data_ptr<scalar_t>();
  scalar_t* o_data = out.data_ptr<scalar_t>();
  const int32_t* tables = block_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);

  // A work item is a sequence and a run of its KV heads, handed out dynamically since lengths
  // vary a lot. All heads at once reads each block as one contiguous run, which the hardware
  // prefetcher streams; split by head only when there are too few sequences to go round.
  const int64_t threads = at::get_num_threads();
  const int64_t heads_per_item = num_seqs >= 2 * threads ? num_kv_heads : 1;
  const int64_t items_per_seq = num_kv_heads / heads_per_item;
  const int64_t num_items = num_seqs * items_per_seq;
  const int64_t heads = heads_per_item * group;  // query heads per item
  const int64_t row_bytes = heads_per_item * head_dim * static_cast<int64_t>(sizeof(scalar_t));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> qf(heads * head_dim), acc(heads * head_dim), scores, inv_sum(heads);
    for (int64_t item = next++; item < num_items; item = next++) {
      const int64_t seq = item / items_per_seq;
      const int64_t kv0 = (item % items_per_seq) * heads_per_item;  // first KV head
      const int64_t len = lens[seq];
      const int32_t* table = tables + seq * max_blocks;
      scores.resize(heads * len);
      // Token t's row of this item's heads in `cache`, with the row kPrefetch tokens on
      // requested from memory: blocks are scattered, so the hardware prefetcher alone
      // restarts at every block.
      auto row_at = [&](const scalar_t* cache, int64_t t) {
        if (t + kPrefetch < len) {
          const int64_t u = t + kPrefetch;
          const char* ahead = reinterpret_cast<const char*>(
              cache + table[u / block_size] * c_block + (u % block_size) * c_tok + kv0 * c_head);
          for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(ahead + b);
        }
        return cache + table[t / block_size] * c_block + (t % block_size) * c_tok + kv0 * c_head;
      };
      for (int64_t h = 0; h < heads; ++h) {
        const scalar_t* src = q_data + seq * q_seq + (kv0 * group + h) * q_head;
        for (int64_t d = 0; d < head_dim; ++d) qf[h * head_dim + d] = static_cast<float>(src[d]) * fscale;
      }
      for (int64_t t = 0; t < len; ++t) {
        const scalar_t* row = row_at(k_data, t);
        for (int64_t h = 0; h < heads; ++h) {
          const scalar_t* k = row + (h / group) * c_head;
          const float* qh = qf.data() + h * head_dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < head_dim; ++d) s += qh[d] * static_cast<float>(k[d]);
          scores[h * len + t] = s;
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        float* sh = scores.data() + h * len;
        float m = sh[0];
        for (int64_t t = 1; t < len; ++t) m = std::max(m, sh[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
          sh[t] = std::exp(sh[t] - m);
          sum += sh[t];
        }
        inv_sum[h] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const scalar_t* row = row_at(v_data, t);
        for (int64_t h = 0; h < heads; ++h) {
          const scalar_t* v = row + (h / group) * c_head;
          const float p = scores[h * len + t];
          float* ah = acc.data() + h * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ah[d] += p * static_cast<float>(v[d]);
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        scalar_t* dst = o_data + seq * o_seq + (kv0 * group + h) * o_head;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[h * head_dim + d] * inv_sum[h]);
      }
    }
  });
}

void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_table,
                            const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "head_dim must be contiguous");
  TORCH_CHECK(k_cache.strides() == v_cache.strides(), "k_cache and v_cache must share a layout");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
              block_table.is_contiguous() && seq_lens.is_contiguous(), "block_table/seq_lens: contiguous int32");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == out.scalar_type(), "dtype mismatch");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_attention<scalar_t>(out, q, k_cache, v_cache, block_table, seq_lens, scale);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(treadle, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_table, Tensor seq_lens, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(treadle, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
