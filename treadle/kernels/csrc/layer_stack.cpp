// A pipeline stage's decoder layers for a step, in one call.
//
// At batch 1 a layer is a dozen small ops around four weight reads. From Python each op costs
// a module call, the dispatcher and its views: about 5 ms of a 24 ms SmolLM2 step, against 16
// ms of weight reads; a step with prefill chunks pays the same again, on top of its GEMMs, and
// holds the GIL the server's thread wants meanwhile. This runs the same kernels in the same
// order from C++, so its output is the Python path's, bit for bit (tests/test_layer_stack.py);
// only the interpreter is gone.
//
// `LayerStack` holds the stage's weights (the tensors themselves, so in-place weight loads
// show through; the model builds a new stack whenever it re-packs or re-quantizes).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "ops.h"

namespace {

// Rows up to which the dense few-row kernel serves, and from which and up to which the tile
// kernel does (models/linear.py's SMALL_ROWS and tile_rows()). A quantized copy carries its
// own limit.
struct RowLimits {
  int64_t small_rows, tile_from_rows, tile_rows;
};

// models/linear.py's gemm_rows: the row count a packed GEMM runs at (rounded up to 1/16 of its
// power of two and to a multiple of 8), so that oneDNN compiles kernels for a few counts only.
int64_t gemm_rows(int64_t rows) {
  int bits = 0;
  while ((rows >> bits) > 0) ++bits;   // Python's int.bit_length
  const int64_t step = std::max<int64_t>(8, int64_t{1} << std::max(0, bits - 5));
  return (rows + step - 1) / step * step;
}

// oneDNN's GEMM on a packed weight as models/linear.py runs it: zero rows up to gemm_rows,
// the op through the dispatcher, the rows asked for back.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  const int64_t rows = x.size(0), padded = gemm_rows(rows);
  const at::Tensor input = padded == rows ? x : at::cat({x, x.new_zeros({padded - rows, x.size(1)})});
  torch::jit::Stack stack{input, packed, bias.has_value() ? c10::IValue(*bias) : c10::IValue(),
                          c10::IValue(std::string("none")), c10::IValue(c10::List<c10::optional<at::Scalar>>()),
                          c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  const at::Tensor out = stack[0].toTensor();
  return padded == rows ? out : out.narrow(0, 0, rows);
}

struct StackLinear {
  at::Tensor weight;
  c10::optional<at::Tensor> bias;
  // A weight-only copy for a few rows, where the model has one: int8 q with its scales
  // (ggml_type -1), or a GGUF file's blocks of that ggml type; it serves up to quant_rows rows.
  c10::optional<at::Tensor> q, scales;
  int64_t ggml_type, quant_rows;
  c10::optional<at::Tensor> packed;      // oneDNN's packed copy, where there is one
  c10::optional<at::Tensor> tiles;       // AMX tiles or pairs (bf16), or AVX-512 panels (fp32), where there are any
  c10::optional<at::Tensor> bf16x3;      // fp32 in three bf16 parts on AMX tiles, past the panels' rows

  // The same choice as models/linear.py's linear(), so the same bits.
  at::Tensor operator()(const at::Tensor& x, const RowLimits& limits) const {
    const int64_t rows = x.size(0);
    if (q.has_value() && rows <= quant_rows)
      return ggml_type < 0 ? treadle::int8_rows_linear(x, *q, *scales, bias)
                           : treadle::gguf_rows_linear(x, *q, ggml_type, bias);
    if (tiles.has_value() && rows >= limits.tile_from_rows && rows <= limits.tile_rows)
      return treadle::tiles_linear(x, *tiles, bias);
    if (bf16x3.has_value() && rows > limits.tile_rows) return treadle::bf16x3_linear(x, *bf16x3, bias);
    if (rows <= limits.small_rows) return treadle::small_rows_linear(x, weight, bias);
    return packed.has_value() ? packed_linear(x, *packed, bias) : at::linear(x, weight, bias);
  }
};

struct StackLayer {
  at::Tensor input_norm, post_attention_norm;
  c10::optional<at::Tensor> q_norm, k_norm;   // Qwen3's per-head norms
  std::vector<StackLinear> linears;            // qkv, o, gate_up, down
  int64_t window = 0;                          // its sliding window (Mistral); 0: none
};

class LayerStack : public torch::CustomClassHolder {
 public:
  LayerStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
             int64_t small_rows, int64_t tile_from_rows, int64_t tile_rows)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale),
        limits_{small_rows, tile_from_rows, tile_rows} {}

  void add_layer(at::Tensor input_norm, at::Tensor post_attention_norm, c10::optional<at::Tensor> q_norm,
                 c10::optional<at::Tensor> k_norm) {
    TORCH_CHECK(layers_.empty() || layers_.back().linears.size() == 4, "the previous layer lacks linears");
    layers_.push_back({input_norm, post_attention_norm, q_norm, k_norm, {}});
  }

  // The current layer attends within a sliding window of `window` tokens.
  void set_window(int64_t window) {
    TORCH_CHECK(!layers_.empty() && window > 0, "add_layer first; a window is positive");
    layers_.back().window = window;
  }

  // The current layer's next linear: qkv, o, gate_up, down, in that order.
  void add_linear(at::Tensor weight, c10::optional<at::Tensor> bias, c10::optional<at::Tensor> q,
                  c10::optional<at::Tensor> scales, int64_t ggml_type, int64_t quant_rows,
                  c10::optional<at::Tensor> packed, c10::optional<at::Tensor> tiles,
                  c10::optional<at::Tensor> bf16x3) {
    TORCH_CHECK(!layers_.empty() && layers_.back().linears.size() < 4, "add_layer first, then its 4 linears");
    TORCH_CHECK(q.has_value() == (scales.has_value() || ggml_type >= 0),
                "a quantized copy needs q and either scales (int8) or a ggml type (GGUF blocks)");
    layers_.back().linears.push_back({weight, bias, q, scales, ggml_type, quant_rows, packed, tiles, bf16x3});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // h [T, hidden] -> h after every layer for a step laid out as the attention metadata lays it
  // out (attention/torch_backend.py): decodes first, with their block tables and lengths
  // (counting the new token), then prefill chunks, with theirs, their query starts (from the
  // first chunk's first row) and their cached context lengths; either part may be absent.
  // cos/sin [T, 1, head_dim] in h's dtype.
  at::Tensor forward(at::Tensor h, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> kv_caches,
                     at::Tensor slot_mapping, c10::optional<at::Tensor> decode_block_table,
                     c10::optional<at::Tensor> seq_lens, c10::optional<at::Tensor> prefill_block_table,
                     c10::optional<at::Tensor> query_start, c10::optional<at::Tensor> context_lens) const {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "one KV cache per layer");
    TORCH_CHECK(layers_.empty() || layers_.back().linears.size() == 4, "the last layer lacks linears");
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                slot_mapping.numel() == h.size(0), "slot_mapping: one int64 slot per token");
    TORCH_CHECK(decode_block_table.has_value() == seq_lens.has_value(), "decodes need a block table and lengths");
    TORCH_CHECK(prefill_block_table.has_value() == query_start.has_value() &&
                query_start.has_value() == context_lens.has_value(),
                "prefill chunks need a block table, query starts and context lengths");
    const int64_t t = h.size(0), q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    const int64_t decodes = seq_lens.has_value() ? seq_lens->numel() : 0;
    int64_t prefill_rows = 0;
    if (query_start.has_value()) {
      TORCH_CHECK(query_start->scalar_type() == at::kInt && query_start->dim() == 1 && query_start->numel() > 1 &&
                  query_start->is_contiguous(), "query_start: contiguous int32, one more than the chunks");
      prefill_rows = query_start->data_ptr<int32_t>()[query_start->numel() - 1];
    }
    TORCH_CHECK(decodes + prefill_rows == t, "the decodes and prefill chunks must cover the step's tokens");
    // As the Python layers: each layer's output x and the residual stream apart, added by the
    // next norm (add_rms_norm).
    at::Tensor x = h, residual, normed;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const StackLayer& layer = layers_[i];
      const at::Tensor& cache = kv_caches[i];
      TORCH_CHECK(cache.dim() == 5 && cache.size(3) == num_kv_heads_ && cache.size(4) == head_dim_ &&
                  cache.stride(3) == head_dim_ && cache.stride(4) == 1 && cache.scalar_type() == h.scalar_type(),
                  "KV cache [2, blocks, block_size, kv_heads, head_dim], each slot's heads side by side");
      if (residual.defined()) {
        std::tie(residual, normed) = treadle::add_rms_norm(x, residual, layer.input_norm, eps_);
      } else {
        residual = x;
        normed = treadle::rms_norm(x, layer.input_norm, eps_);
      }
      const at::Tensor qkv = layer.linears[0](normed, limits_);
      at::Tensor q, k;
      if (!layer.q_norm.has_value()) {   // q and k side by side: one RoPE pass over both
        at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({t, num_heads_ + num_kv_heads_, head_dim_});
        treadle::rope_(qk, cos, sin);
        q = qk.narrow(1, 0, num_heads_);
        k = qk.narrow(1, num_heads_, num_kv_heads_);
      } else {
        q = treadle::rms_norm(qkv.narrow(1, 0, q_size).view({t, num_heads_, head_dim_}), *layer.q_norm, eps_);
        k = treadle::rms_norm(qkv.narrow(1, q_size, kv_size).view({t, num_kv_heads_, head_dim_}), *layer.k_norm, eps_);
        treadle::rope_(q, cos, sin);
        treadle::rope_(k, cos, sin);
      }
      treadle::write_kv_(cache, k, qkv.narrow(1, q_size + kv_size, kv_size).view({t, num_kv_heads_, head_dim_}), slot_mapping);
      at::Tensor attn = at::empty({t, num_heads_, head_dim_}, h.options());
      const at::Tensor k_cache = cache.select(0, 0), v_cache = cache.select(0, 1);
      if (decodes > 0)
        treadle::paged_decode_attention(attn.narrow(0, 0, decodes), q.narrow(0, 0, decodes), k_cache, v_cache,
                                        *decode_block_table, *seq_lens, scale_, layer.window);
      if (prefill_rows > 0)
        treadle::paged_prefill_attention(attn.narrow(0, decodes, prefill_rows), q.narrow(0, decodes, prefill_rows),
                                         k_cache, v_cache, *prefill_block_table, *query_start, *context_lens, scale_,
                                         layer.window);
      std::tie(residual, normed) =
          treadle::add_rms_norm(layer.linears[1](attn.view({t, q_size}), limits_), residual, layer.post_attention_norm, eps_);
      x = layer.linears[3](treadle::silu_and_mul(layer.linears[2](normed, limits_)), limits_);
    }
    return residual.defined() ? x + residual : x;
  }

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  RowLimits limits_;
  std::vector<StackLayer> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(treadle, m) {
  m.class_<LayerStack>("LayerStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, int64_t, int64_t, int64_t>())
      .def("add_layer", &LayerStack::add_layer)
      .def("set_window", &LayerStack::set_window)
      .def("add_linear", &LayerStack::add_linear)
      .def("num_layers", &LayerStack::num_layers)
      .def("forward", &LayerStack::forward);
  // For the test that holds it to models/linear.py's.
  m.def("gemm_rows(int rows) -> int", [](int64_t rows) { return gemm_rows(rows); });
}
