"""Weight-only int8 (quantization="int8"): the kernel, the quantizer, and the engine against
transformers running the same dequantized weights."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_support import needs_kernels
from tests.reference import HFReference
from treadle import LLM, SamplingParams
from treadle.models.linear import INT8_GROUP, INT8_ROWS, Int8Weight
from treadle.models.loader import iter_hf_weights


def _dequantized(weight: torch.Tensor) -> torch.Tensor:
    """What quantization="int8" makes of a transformers weight (rows are quantized on their
    own, so q, k and v apart equal the fused qkv)."""
    copy = weight.float().clone()
    Int8Weight.quantize(copy)
    return copy


def test_quantize_rounds_each_group_to_its_scale():
    torch.manual_seed(0)
    weight = torch.randn(8, 4 * INT8_GROUP)
    weight[3, :INT8_GROUP] = 0.0            # an all-zero group
    original = weight.clone()
    packed = Int8Weight.quantize(weight)
    q, scales = packed.tensors
    assert q.dtype == torch.int8 and q.shape == weight.shape and scales.shape == (8, 4)
    assert int(q.abs().max()) == 127
    groups = (original - weight).abs().view(8, 4, INT8_GROUP)
    assert bool((groups <= scales[..., None] / 2 * (1 + 1e-6)).all())
    assert torch.equal(weight, (q.float().view(8, 4, INT8_GROUP) * scales[..., None]).view_as(weight))
    assert torch.equal(weight, packed.dequantize())
    assert bool((weight[3, :INT8_GROUP] == 0).all())
    # An unchanged weight keeps its quantization; a changed one is quantized again.
    assert Int8Weight.quantize(weight, packed) is packed
    weight.mul_(2)
    assert Int8Weight.quantize(weight, packed) is not packed


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, INT8_ROWS])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_kernel_equals_the_dense_kernel_on_dequantized_weights(rows, bias):
    torch.manual_seed(rows)
    weight = torch.randn(200, 6 * INT8_GROUP)
    q, scales = Int8Weight.quantize(weight).tensors      # weight is now dequantized
    x = torch.randn(rows, weight.shape[1])
    b = torch.randn(weight.shape[0]) if bias else None
    got = torch.ops.treadle.int8_rows_linear(x, q, scales, b)
    assert torch.equal(got, torch.ops.treadle.small_rows_linear(x, weight, b))
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_int8_kernel_refuses_bad_inputs():
    q, scales = Int8Weight.quantize(torch.randn(16, 64)).tensors
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.treadle.int8_rows_linear(torch.randn(1, 48), torch.zeros(16, 48, dtype=torch.int8),
                                           torch.ones(16, 1), None)
    with pytest.raises(RuntimeError, match="scales"):
        torch.ops.treadle.int8_rows_linear(torch.randn(1, 64), q, scales[:, :1].contiguous(), None)
    with pytest.raises(RuntimeError, match="at most"):
        torch.ops.treadle.int8_rows_linear(torch.randn(9, 64), q, scales, None)


@pytest.mark.parametrize("kwargs,match", [
    ({"quantization": "int4"}, "quantization must be None, 'int8' or 'gguf'"),
    ({"quantization": "int8", "dtype": "bfloat16"}, "float32"),
])
def test_bad_quantization_is_refused(smollm2_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(smollm2_path, **kwargs)


@pytest.fixture(scope="module")
def int8_llm(smollm2_path):
    llm = LLM(smollm2_path, quantization="int8", dtype="float32", max_model_len=512, block_size=16, num_kv_blocks=128)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def dequantized_reference(smollm2_path):
    overrides = [(name, _dequantized(w)) for name, w in iter_hf_weights(smollm2_path)
                 if w.dim() == 2 and w.shape[1] % INT8_GROUP == 0]
    assert any("embed_tokens" in name for name, _ in overrides)   # the tied head
    return HFReference(smollm2_path, overrides)


@needs_kernels
def test_int8_engine_equals_transformers_on_the_dequantized_weights(int8_llm, dequantized_reference):
    def int8_layers(worker):
        model = worker.runner.model
        mlp = model.model.layers[0].mlp.gate_up_proj
        return isinstance(mlp.quantized, Int8Weight) and mlp.native and model._quantized_head is not None

    assert int8_llm.collective_rpc(int8_layers) == [True]
    tok = int8_llm.get_tokenizer()
    prompts = [tok.encode(t) for t in ("The capital of France is", "def fibonacci(n):",
                                       "Once upon a time, in a small village,", "1, 2, 3, 5, 8,")]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    # One request at a time (1 row: the int8 kernel), then all four together (4 rows, still the
    # int8 kernel), with prefills through the GEMM on the dequantized weights throughout.
    alone = [int8_llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
    together = int8_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, a, t in zip(prompts, alone, together):
        expected = dequantized_reference.greedy(p, 24)
        assert list(a.outputs[0].token_ids) == expected
        assert list(t.outputs[0].token_ids) == expected


@needs_kernels
def test_int8_follows_a_weight_update(int8_llm, smollm2_path):
    name = "model.layers.0.mlp.down_proj.weight"
    original = dict(iter_hf_weights(smollm2_path))[name]

    def update(worker, tensor):
        layers = worker.runner.model.model.layers
        before = (layers[0].mlp.down_proj.quantized, layers[1].mlp.down_proj.quantized)
        worker.runner.model.load_weights([(name, tensor)], strict=False)
        after = (layers[0].mlp.down_proj.quantized, layers[1].mlp.down_proj.quantized)
        dequantized = after[0].dequantize()
        # The updated layer is quantized again, from the new weight; the others are kept.
        return (after[0] is not before[0], after[1] is before[1],
                torch.equal(layers[0].mlp.down_proj.weight, dequantized),
                torch.equal(dequantized, _dequantized(tensor)))

    try:
        assert int8_llm.collective_rpc(update, args=(original * 1.5,)) == [(True, True, True, True)]
    finally:
        assert int8_llm.collective_rpc(update, args=(original,)) == [(True, True, True, True)]


def _tied_rows(worker) -> dict[str, torch.Tensor | None]:
    """Given to collective_rpc: the first rows of this stage's embedding and head, if it has them."""
    model = worker.runner.model
    embed = model.model.embed_tokens
    return {"embed": embed.weight[:4].clone() if embed is not None else None,
            "head": model._head_weight()[:4].clone() if model.ctx.is_last_stage else None}


@needs_kernels
def test_int8_two_stages_equal_transformers_on_the_dequantized_weights(tiny_checkpoints):
    """The first stage holds the tied embedding alone: it must quantize it as the last stage
    quantizes the head, or the stages would run two different models. (A tiny model: SmolLM2's
    embedding, from a GGUF, is already on the int8 grid.)"""
    path = tiny_checkpoints["llama"]
    weights = dict(iter_hf_weights(path))
    original = weights["model.embed_tokens.weight"][:4]
    expected_rows = _dequantized(original)
    assert not torch.equal(original, expected_rows)
    reference = HFReference(path, [(name, _dequantized(w)) for name, w in weights.items()
                                   if w.dim() == 2 and w.shape[1] % INT8_GROUP == 0])
    prompts = [list(range(10, 10 + n)) for n in (7, 40)]
    # A step budget of max_model_len (both prompts fit one step, as in the default 2,048): the
    # last stage warms its head's GEMM (49,152 rows) up to the budget at start-up.
    with LLM(path, quantization="int8", pipeline_parallel_size=2, max_model_len=128,
             max_num_batched_tokens=128, block_size=16, num_kv_blocks=32) as llm:
        first, last = llm.collective_rpc(_tied_rows)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                               use_tqdm=False)
    assert first["head"] is None and last["embed"] is None
    assert torch.equal(first["embed"], expected_rows) and torch.equal(last["head"], expected_rows)
    for p, out in zip(prompts, outputs):
        assert list(out.outputs[0].token_ids) == reference.greedy(p, 12)
