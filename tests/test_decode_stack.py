"""The decode stack (models/decode_stack.py): a stage's layers in one C++ call for steps of
decodes only. It must compute the Python layers' bits exactly, so greedy tokens and every
logprob agree with the stack on and off, for each architecture, with int8, and at batch sizes
on each side of the few-row kernels' limits (the stack then takes oneDNN's packed GEMM, as the
Python layers do); and it must actually run."""

from __future__ import annotations

import pytest
import torch

from treadle import LLM, SamplingParams
from treadle.kernels.cpu import cpu_kernels_available
from treadle.models import decode_stack, linear

CPU = torch.device("cpu")
needs_native = pytest.mark.skipif(not cpu_kernels_available(CPU), reason="the C++ kernels did not build here")

PROMPTS = [[1, 2, 3, 4, 5], [100, 200, 300], [7] * 11, [42, 17, 99, 5, 23, 64, 1000],
           [5, 4, 3], [900, 901], [31, 41, 59, 26, 53], [2718, 28]]
assert len(PROMPTS) > max(linear.SMALL_ROWS, linear.INT8_ROWS)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@needs_native
@pytest.mark.parametrize("arch, quantization", [("llama", None), ("qwen2", None), ("qwen3", None),
                                                ("llama", "int8")])
def test_stack_computes_the_python_layers_bits(tiny_checkpoints, monkeypatch, arch, quantization):
    calls = []
    run_stack = decode_stack.forward

    def counted(*args, **kwargs):
        calls.append(args[1].shape[0])
        return run_stack(*args, **kwargs)

    monkeypatch.setattr(decode_stack, "forward", counted)
    llm = LLM(tiny_checkpoints[arch], quantization=quantization, enable_prefix_caching=False)
    model = llm.engine.core.executor.worker.runner.model
    try:
        assert model.decode_stack is not None and model.decode_stack.num_layers() == 3
        # Batch 1, then the few-row kernels' largest batch, then one past both limits.
        with_stack = ([_generate(llm, [p])[0] for p in PROMPTS[:3]]
                      + _generate(llm, PROMPTS[:linear.SMALL_ROWS]) + _generate(llm, PROMPTS))
        assert {1, linear.SMALL_ROWS, len(PROMPTS)} <= set(calls)
        stack, model.decode_stack = model.decode_stack, None
        calls.clear()
        without = ([_generate(llm, [p])[0] for p in PROMPTS[:3]]
                   + _generate(llm, PROMPTS[:linear.SMALL_ROWS]) + _generate(llm, PROMPTS))
        assert not calls
        assert with_stack == without   # token ids and every logprob, bit for bit
        model.decode_stack = stack
    finally:
        llm.shutdown()


@needs_native
def test_a_weight_update_rebuilds_the_stack(tiny_checkpoints):
    """load_weights re-packs and re-quantizes: the stack must read the new weights, not a
    snapshot of the old int8 copies."""
    from treadle.models.loader import iter_hf_weights

    llm = LLM(tiny_checkpoints["llama"], quantization="int8", enable_prefix_caching=False)
    model = llm.engine.core.executor.worker.runner.model
    try:
        before = model.decode_stack
        weights = {n: t * 1.5 if "mlp" in n else t for n, t in iter_hf_weights(tiny_checkpoints["llama"])}
        model.load_weights(weights.items())
        assert model.decode_stack is not before
        with_stack = _generate(llm, PROMPTS[:1])
        model.decode_stack = None
        assert _generate(llm, PROMPTS[:1]) == with_stack
    finally:
        llm.shutdown()


@needs_native
def test_stack_refuses_what_it_cannot_run():
    stack = torch.classes.treadle.DecodeStack(4, 2, 16, 1e-6, 0.25, 4, 6)   # hidden 64: q 64, k and v 32
    qkv, o, gate_up, down = torch.zeros(128, 64), torch.zeros(64, 64), torch.zeros(256, 64), torch.zeros(64, 128)
    with pytest.raises(RuntimeError, match="add_layer first"):
        stack.add_linear(qkv, None, None, None, None)
    stack.add_layer(torch.ones(64), torch.ones(64), None, None)
    with pytest.raises(RuntimeError, match="both q and scales"):
        stack.add_linear(qkv, None, torch.zeros(128, 64, dtype=torch.int8), None, None)
    stack.add_linear(qkv, None, None, None, None)

    def forward(caches, slot):
        return stack.forward(torch.zeros(1, 64), torch.ones(1, 1, 16), torch.zeros(1, 1, 16), caches,
                             torch.tensor([slot]), torch.zeros(1, 1, dtype=torch.int32),
                             torch.ones(1, dtype=torch.int32))

    cache = torch.zeros(2, 4, 16, 2, 16)   # 4 blocks of 16 slots
    with pytest.raises(RuntimeError, match="lacks linears"):
        forward([cache], 0)
    for weight in (o, gate_up, down):
        stack.add_linear(weight, None, None, None, None)
    with pytest.raises(RuntimeError, match="one KV cache per layer"):
        forward([], 0)
    with pytest.raises(RuntimeError, match="out of range"):
        forward([cache], 64)
    assert forward([cache], 63).shape == (1, 64)
