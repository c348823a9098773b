// The kernels' entry points, for C++ callers (layer_stack.cpp); Python reaches the same
// functions as torch.ops.treadle.*, registered beside each definition.
#pragma once

#include <ATen/ATen.h>

namespace treadle {

// The bias a linear kernel adds: contiguous and checked to be `dtype` (fp32 or bf16) [n];
// undefined where there is none. The caller holds it while the kernel reads it.
inline at::Tensor linear_bias(const c10::optional<at::Tensor>& bias, at::ScalarType dtype, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  at::Tensor b = bias->contiguous();
  TORCH_CHECK(b.scalar_type() == dtype && b.numel() == n, "bias: ", dtype == at::kFloat ? "fp32" : "bf16", " [N]");
  return b;
}

// gemv.cpp: y = x @ w.T + bias at up to 8 rows of x, dense, weight-only int8, or over a GGUF
// file's Q4_0, Q4_1 or Q8_0 blocks (gguf_blocks.h; ggml_type 2, 3 or 8).
at::Tensor small_rows_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
at::Tensor int8_rows_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                            const c10::optional<at::Tensor>& bias);
at::Tensor gguf_rows_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t ggml_type,
                            const c10::optional<at::Tensor>& bias);

// linear_tiles.cpp: y = x @ w.T + bias in bf16 on AMX tiles, over the weight as
// pack_linear_tiles packs it, where linear_tiles_ready says the CPU, the process and the
// weight's shape allow. In fp32 the same three calls run linear_panels.cpp's kernel.
bool linear_tiles_ready(const at::Tensor& w);
at::Tensor pack_linear_tiles(const at::Tensor& w);
at::Tensor tiles_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);

// linear_panels.cpp: the same in fp32 with AVX-512, over the weight as panels of 32 outputs.
bool linear_panels_ready(const at::Tensor& w);
at::Tensor pack_linear_panels(const at::Tensor& w);
at::Tensor panels_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);

// linear_pairs.cpp: the same in bf16 with AVX512-BF16 pairs, where there are no AMX tiles, over
// the weight as panels of 32 outputs; the three tiles entry points hand bf16 over to it there.
bool linear_pairs_ready(const at::Tensor& w);
at::Tensor pack_linear_pairs(const at::Tensor& w);
at::Tensor pairs_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);

// linear_bf16x3.cpp: the same in fp32 on AMX tiles, each operand split into three bf16 parts,
// over the weight as pack_linear_bf16x3 packs it (prefill sizes).
bool linear_bf16x3_ready(const at::Tensor& w);
at::Tensor pack_linear_bf16x3(const at::Tensor& w);
at::Tensor bf16x3_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);

// fused_ops.cpp
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// (x + residual, RMSNorm(x + residual)), the sum rounded to the dtype first.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);
void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin);
void write_kv_(at::Tensor cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_mapping);

// paged_decode.cpp: one query token per sequence against its paged K/V; within its last
// `window` tokens where window > 0, with scores soft-capped where softcap > 0.
void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_table,
                            const at::Tensor& seq_lens, double scale, int64_t window = 0, double softcap = 0);

// paged_prefill.cpp: prefill chunks (causal, after any cached context), all of a step's in one
// call; rows of q counted from the first chunk's first. window and softcap as for decode.
void paged_prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_table,
                             const at::Tensor& query_start, const at::Tensor& context_lens, double scale,
                             int64_t window = 0, double softcap = 0);

// paged_decode_amx.cpp: the same on AMX tiles in bf16, where the CPU has them and this process
// may use them, head_dim is 64 or 128, a KV head has at most 16 query heads and a block holds
// a multiple of 16 tokens. Called by paged_decode_attention, which checks its inputs first.
bool decode_tiles_ready(const at::Tensor& q, const at::Tensor& k_cache);
void decode_attention_tiles(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_table,
                            const at::Tensor& seq_lens, double scale);

// paged_prefill_amx.cpp: bf16 prefill attention on AMX tiles, where the CPU has them and this
// process may use them (asked once), head_dim is 64 or 128 and a KV head has at most 48 query
// heads. Called by paged_prefill_attention, which checks its inputs first.
bool prefill_tiles_ready(const at::Tensor& q, const at::Tensor& k_cache);
void prefill_attention_tiles(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_table,
                             const at::Tensor& query_start, const at::Tensor& context_lens, double scale);

}  // namespace treadle
