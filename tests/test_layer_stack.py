"""The layer stack (models/layer_stack.py): a stage's layers in one C++ call per step. It must
compute the Python layers' bits exactly, so greedy tokens and every logprob agree with the
stack on and off: for each architecture, with int8, in bf16 (on AMX tiles or bf16 pairs where
the CPU has them), at batch sizes on each side of the few-row kernels' limits (the stack then takes
oneDNN's packed GEMM, as the Python layers do), and in
steps of prefill chunks alone and of chunks beside decodes; and it must actually run."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_support import HAS_AMX, HAS_AVX512, HAS_PAIRS, needs_kernels
from treadle import LLM, SamplingParams
from treadle.models import layer_stack, linear


PROMPTS = [[1, 2, 3, 4, 5], [100, 200, 300], [7] * 11, [42, 17, 99, 5, 23, 64, 1000],
           [5, 4, 3], [900, 901], [31, 41, 59, 26, 53], [2718, 28]]
assert len(PROMPTS) > max(linear.SMALL_ROWS, linear.INT8_ROWS)
LONG = [list(range(10 + i, 10 + i + n)) for i, n in enumerate((37, 61, 23))]   # chunked at 16 tokens


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int = 12) -> list[tuple[list[int], list]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _runs(llm: LLM) -> list:
    """Batch 1, the few-row kernels' largest batch, one past both limits; then long prompts in
    16-token chunks beside the decodes of short ones."""
    return ([_generate(llm, [p])[0] for p in PROMPTS[:3]] + _generate(llm, PROMPTS[:linear.SMALL_ROWS])
            + _generate(llm, PROMPTS) + _generate(llm, PROMPTS[:2] + LONG, max_tokens=20))


@needs_kernels
@pytest.mark.parametrize("arch, quantization, dtype", [("llama", None, "float32"), ("qwen2", None, "float32"),
                                                       ("qwen3", None, "float32"), ("llama", "int8", "float32"),
                                                       ("llama", None, "bfloat16")])   # on AMX tiles or pairs, where there are
def test_stack_computes_the_python_layers_bits(tiny_checkpoints, monkeypatch, arch, quantization, dtype):
    steps = []   # (decodes, prefill rows) of each step the stack ran
    run_stack = layer_stack.forward

    def counted(stack, h, cos, sin, kv_caches, meta):
        steps.append((meta.num_decodes, h.shape[0] - meta.num_decodes))
        return run_stack(stack, h, cos, sin, kv_caches, meta)

    monkeypatch.setattr(layer_stack, "forward", counted)
    llm = LLM(tiny_checkpoints[arch], quantization=quantization, enable_prefix_caching=False,
              max_num_batched_tokens=16, block_size=16, dtype=dtype)
    model = llm.engine.core.executor.worker.runner.model
    try:
        assert model.layer_stack is not None and model.layer_stack.num_layers() == 3
        tiled = model.model.layers[0].mlp.down_proj.tiles is not None
        assert tiled == ((HAS_AMX or HAS_PAIRS) if dtype == "bfloat16" else HAS_AVX512)   # AMX tiles or pairs, fp32 panels
        with_stack = _runs(llm)
        decode_rows = {d for d, p in steps if p == 0}
        assert {1, linear.SMALL_ROWS, len(PROMPTS)} <= decode_rows
        assert any(d == 0 and p > 0 for d, p in steps)    # prefill chunks alone
        assert any(d > 0 and p > 0 for d, p in steps)     # chunks beside decodes
        stack, model.layer_stack = model.layer_stack, None
        steps.clear()
        without = _runs(llm)
        assert not steps
        assert with_stack == without   # token ids and every logprob, bit for bit
        model.layer_stack = stack
    finally:
        llm.shutdown()


@needs_kernels
def test_a_weight_update_rebuilds_the_stack(tiny_checkpoints):
    """load_weights re-packs and re-quantizes: the stack must read the new weights, not a
    snapshot of the old int8 copies."""
    from treadle.models.loader import iter_hf_weights

    llm = LLM(tiny_checkpoints["llama"], quantization="int8", enable_prefix_caching=False)
    model = llm.engine.core.executor.worker.runner.model
    try:
        before = model.layer_stack
        weights = {n: t * 1.5 if "mlp" in n else t for n, t in iter_hf_weights(tiny_checkpoints["llama"])}
        model.load_weights(weights.items())
        assert model.layer_stack is not before
        with_stack = _generate(llm, PROMPTS[:1])
        model.layer_stack = None
        assert _generate(llm, PROMPTS[:1]) == with_stack
    finally:
        llm.shutdown()


@needs_kernels
def test_start_up_warms_the_head_only_for_the_rows_a_step_samples(tiny_checkpoints, monkeypatch):
    """The untied head's GEMM is warmed up to the rows a step samples (max_num_seqs), the other
    linears up to the step budget: warming the head (49,152 rows here) to the budget cost most
    of a start-up."""
    seen: list[tuple[int, int]] = []   # (rows, output features) of every GEMM start-up ran
    run = linear.linear
    monkeypatch.setattr(linear, "linear",
                        lambda x, weight, *a: seen.append((x.shape[0], weight.shape[0])) or run(x, weight, *a))
    path = tiny_checkpoints["qwen3"]   # untied
    with LLM(path, max_num_seqs=8, max_num_batched_tokens=512) as llm:
        vocab = llm.engine.config.model.hf_config.vocab_size
        model = llm.engine.core.executor.worker.runner.model
        assert model.lm_head is not None
        # With AMX tiles an fp32 weight runs AVX-512 panels, then bf16x3 past them, and keeps
        # no oneDNN copy: nothing of it to warm up.
        packed = any(m.packed is not None for m in model.modules()
                     if isinstance(m, linear.Linear) and m is not model.lm_head)
    assert max((rows for rows, out in seen if out == vocab), default=0) <= linear.gemm_rows(8)
    others = [rows for rows, out in seen if out != vocab]
    assert (max(others) == 512) if packed else not others


@needs_kernels
def test_stack_pads_gemm_rows_as_the_python_layers_do():
    """Its packed GEMMs run at linear.gemm_rows' counts: the kernels warmed up at load, and the
    same bits as the Python layers at every row count."""
    for rows in range(1, 4097):
        assert torch.ops.treadle.gemm_rows(rows) == linear.gemm_rows(rows), rows


@needs_kernels
def test_stack_refuses_what_it_cannot_run():
    stack = torch.classes.treadle.LayerStack(4, 2, 16, 1e-6, 0.25, 4, 2, 96)   # hidden 64: q 64, k and v 32
    qkv, o, gate_up, down = torch.zeros(128, 64), torch.zeros(64, 64), torch.zeros(256, 64), torch.zeros(64, 128)
    with pytest.raises(RuntimeError, match="add_layer first"):
        stack.add_linear(qkv, None, None, None, -1, 0, None, None, None)
    stack.add_layer(torch.ones(64), torch.ones(64), None, None)
    with pytest.raises(RuntimeError, match="needs q and either scales"):
        stack.add_linear(qkv, None, torch.zeros(128, 64, dtype=torch.int8), None, -1, 6, None, None, None)
    stack.add_linear(qkv, None, None, None, -1, 0, None, None, None)
    one = torch.ones(1, dtype=torch.int32)

    def forward(caches, slot, tokens=1, decode=(torch.zeros(1, 1, dtype=torch.int32), one), prefill=(None,) * 3):
        return stack.forward(torch.zeros(tokens, 64), torch.ones(tokens, 1, 16), torch.zeros(tokens, 1, 16), caches,
                             torch.tensor([slot] * tokens), *decode, *prefill)

    cache = torch.zeros(2, 4, 16, 2, 16)   # 4 blocks of 16 slots
    with pytest.raises(RuntimeError, match="lacks linears"):
        forward([cache], 0)
    for weight in (o, gate_up, down):
        stack.add_linear(weight, None, None, None, -1, 0, None, None, None)
    with pytest.raises(RuntimeError, match="one KV cache per layer"):
        forward([], 0)
    with pytest.raises(RuntimeError, match="out of range"):
        forward([cache], 64)
    with pytest.raises(RuntimeError, match="block table and lengths"):
        forward([cache], 0, decode=(None, one))
    with pytest.raises(RuntimeError, match="cover the step's tokens"):
        forward([cache], 0, tokens=2)
    prefill = (torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
               torch.zeros(1, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="query starts and context lengths"):
        forward([cache], 0, prefill=prefill[:2] + (None,))
    assert forward([cache], 63).shape == (1, 64)
    assert forward([cache], 63, tokens=2, prefill=prefill).shape == (2, 64)   # a decode, then a chunk of 1
    assert forward([cache], 63, decode=(None, None), prefill=prefill).shape == (1, 64)
