"""A GGUF file's own blocks (quantization="gguf"): the kernel against gguf's dequantizer, and
the engine on the embedded Q4_1 file against transformers on the same file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from tests.kernel_support import needs_kernels
from treadle import LLM, SamplingParams
from treadle.models import gguf_weights
from treadle.models.gguf_weights import GGUF_ROWS, GgufWeight
from treadle.models.loader import iter_hf_weights

TYPES = [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1]


def _blocks(ggml_type: GGMLQuantizationType, rows: int, blocks_per_row: int, seed: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks as gguf writes them, the weight gguf's own dequantizer makes of them)."""
    cols = blocks_per_row * 32
    blocks = quantize(np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32), ggml_type)
    return torch.from_numpy(blocks.copy()), torch.from_numpy(dequantize(blocks, ggml_type).reshape(rows, cols))


@needs_kernels
@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, GGUF_ROWS, 6, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_the_dense_kernel_on_the_dequantized_weights(ggml_type, rows, bias):
    blocks, weight = _blocks(ggml_type, 72, 18, seed=rows)
    x = torch.randn(rows, weight.shape[1])
    b = torch.randn(weight.shape[0]) if bias else None
    got = torch.ops.treadle.gguf_rows_linear(x, blocks, int(ggml_type), b)
    assert torch.equal(got, torch.ops.treadle.small_rows_linear(x, weight, b))
    ref = torch.nn.functional.linear(x, weight, b)   # another summation order
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()))


@needs_kernels
def test_kernel_refuses_bad_inputs():
    blocks, _ = _blocks(GGMLQuantizationType.Q4_1, 16, 2, seed=0)
    run = torch.ops.treadle.gguf_rows_linear
    with pytest.raises(RuntimeError, match="ggml_type must be"):
        run(torch.randn(1, 64), blocks, int(GGMLQuantizationType.Q4_K), None)   # not read directly
    with pytest.raises(RuntimeError, match="blocks: contiguous uint8"):
        run(torch.randn(1, 64), blocks, int(GGMLQuantizationType.Q8_0), None)   # 34-byte blocks expected
    with pytest.raises(RuntimeError, match="multiple of 32"):
        run(torch.randn(1, 48), blocks, int(GGMLQuantizationType.Q4_1), None)
    with pytest.raises(RuntimeError, match="at most"):
        run(torch.randn(9, 64), blocks, int(GGMLQuantizationType.Q4_1), None)
    with pytest.raises(RuntimeError, match="bias"):
        run(torch.randn(1, 64), blocks, int(GGMLQuantizationType.Q4_1), torch.randn(15))


def test_gguf_needs_a_gguf_file_in_float32(tiny_checkpoints, smollm2_path):
    with pytest.raises(ValueError, match="must be a .gguf file"):
        LLM(tiny_checkpoints["llama"], quantization="gguf")
    with pytest.raises(ValueError, match="float32"):
        LLM(smollm2_path, quantization="gguf", dtype="bfloat16")
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        LLM(smollm2_path, quantization="gguf", tensor_parallel_size=2)


@pytest.fixture(scope="module")
def gguf_llm(smollm2_path):
    llm = LLM(smollm2_path, quantization="gguf", dtype="float32", max_model_len=512, block_size=16,
              num_kv_blocks=128)
    yield llm
    llm.shutdown()


PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompts(llm: LLM) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok.encode(t) for t in ("The capital of France is", "def fibonacci(n):",
                                    "Once upon a time, in a small village,", "1, 2, 3, 5, 8,")]


@needs_kernels
def test_every_linear_and_the_head_read_the_files_blocks(gguf_llm):
    def copies(worker):
        model = worker.runner.model
        linears = [m for layer in model.model.layers
                   for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                             layer.mlp.down_proj)]
        types = {m.quantized.ggml_type for m in linears if isinstance(m.quantized, GgufWeight) and m.native}
        head = model._quantized_head
        return len(linears), sum(isinstance(m.quantized, GgufWeight) for m in linears), types, head.ggml_type

    # SmolLM2's file: every layer's weights in Q4_1, the tied embedding (the head) in Q8_0.
    assert gguf_llm.collective_rpc(copies) == [(120, 120, {gguf_weights.Q4_1}, gguf_weights.Q8_0)]


@needs_kernels
def test_engine_equals_transformers_on_the_file(gguf_llm, smollm2_path, reference):
    prompts = _prompts(gguf_llm)
    # One request at a time (1 row: the blocks' kernel), then all four together (4 rows, still
    # it), with prefills through the GEMM on the dequantized weights throughout.
    alone = [gguf_llm.generate([{"prompt_token_ids": p}], PARAMS, use_tqdm=False)[0] for p in prompts]
    together = gguf_llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    for p, a, t in zip(prompts, alone, together):
        expected = reference(smollm2_path).greedy(p, 24)
        assert list(a.outputs[0].token_ids) == expected
        assert list(t.outputs[0].token_ids) == expected


@needs_kernels
def test_the_layer_stack_computes_the_python_layers_bits(gguf_llm):
    model = gguf_llm.engine.core.executor.worker.runner.model
    prompts = _prompts(gguf_llm)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)

    def run():
        outs = gguf_llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    assert model.layer_stack is not None
    with_stack = run()
    stack, model.layer_stack = model.layer_stack, None
    try:
        assert run() == with_stack   # token ids and every logprob, bit for bit
    finally:
        model.layer_stack = stack


@needs_kernels
def test_a_weight_update_drops_the_copies_it_changes(gguf_llm, smollm2_path):
    name = "model.layers.0.mlp.down_proj.weight"
    original = dict(iter_hf_weights(smollm2_path))[name]

    def update(worker, tensor):
        layers = worker.runner.model.model.layers
        worker.runner.model.load_weights([(name, tensor)], strict=False)
        return layers[0].mlp.down_proj.quantized is None, isinstance(layers[1].mlp.down_proj.quantized, GgufWeight)

    try:
        # A changed weight no longer equals its blocks: it runs unquantized, the others keep theirs.
        assert gguf_llm.collective_rpc(update, args=(original * 1.5,)) == [(True, True)]
    finally:
        assert gguf_llm.collective_rpc(update, args=(original,)) == [(False, True)]


def _stage_copies(worker) -> tuple[bool, int, bool]:
    model = worker.runner.model
    linears = sum(isinstance(m.quantized, GgufWeight) for m in model.modules() if hasattr(m, "quantized"))
    return model.ctx.is_last_stage, linears, model._quantized_head is not None


@needs_kernels
def test_two_pipeline_stages_read_their_own_layers_blocks(smollm2_path, reference):
    # A step budget of max_model_len (the default is 2,048), as one prompt never needs more: the
    # last stage warms its head's GEMM (49,152 x 576, a Linear there) at every row count up to
    # the budget at start-up, which at 2,048 rows was most of this test's time.
    llm = LLM(smollm2_path, quantization="gguf", dtype="float32", max_model_len=256, block_size=16,
              num_kv_blocks=64, pipeline_parallel_size=2, max_num_batched_tokens=256)
    try:
        # 15 layers of 4 linears each; the last stage's tied head (its own copy of the
        # embedding, a Linear) reads the embedding's Q8_0 blocks, and only it scores.
        assert llm.collective_rpc(_stage_copies) == [(False, 60, False), (True, 61, True)]
        prompt = _prompts(llm)[0]
        out = llm.generate([{"prompt_token_ids": prompt}], PARAMS, use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == reference(smollm2_path).greedy(prompt, 24)
    finally:
        llm.shutdown()
