"""A step waits for the GPU once: for its sampled tokens (and logprobs and prompt logprobs),
copied into pinned memory and waited on through an event (treadle/device_copy.py). Everything
else a step sends up (token ids, positions, block tables, slot mappings, sampling parameters,
row indices) goes from pinned memory without waiting. On a GPU the steps run under
torch.cuda.set_sync_debug_mode("error"), which raises at any other wait, with every sampling
feature the batched sampler has; greedy rows stay token-identical to transformers, prompt
logprobs equal theirs. On the CPU the same code is the suite's."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.family_support import PretrainedReference
from tests.gpu import shared_gpu
from treadle import LLM, SamplingParams
from treadle.device_copy import HostCopy, sanctioned_sync, to_device, to_host


def test_copies_on_a_cpu_are_the_host_tensors_themselves():
    values = torch.arange(4).numpy()
    up = to_device(values, torch.device("cpu"))
    assert up.data_ptr() == values.__array_interface__["data"][0]
    assert to_device([1.5, 2.0], torch.device("cpu")).dtype == torch.float32
    assert to_device([1, 2], torch.device("cpu"), torch.int32).dtype == torch.int32
    (down,) = to_host(up)
    assert down is up
    with sanctioned_sync():   # no CUDA: nothing to exempt, and nothing fails
        pass


# Prompt logprobs for two requests in the same steps, keeping different numbers of top tokens,
# one over two chunks.
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=4),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=7, max_tokens=12,
                   ignore_eos=True),
    SamplingParams(temperature=0.7, repetition_penalty=1.2, frequency_penalty=0.3,
                   presence_penalty=0.2, seed=3, max_tokens=12, ignore_eos=True, prompt_logprobs=1),
    SamplingParams(temperature=0.0, logprobs=3, logit_bias={11: 2.0}, min_tokens=4, max_tokens=12),
]
PROMPTS = [list(range(5, 21)), list(range(40, 47)), list(range(100, 140)), [9, 8, 7]]


def run(path: str, device: str, backend: str, strict: bool, deferred: bool = False) -> list:
    """Every sampling feature in one batch, with chunked prefill; with `strict`, each step
    under set_sync_debug_mode("error"); with `deferred`, under async scheduling with each
    step's tokens left on the device until the next step is queued (worker/deferred_step.py:
    the penalties count them there)."""
    with LLM(path, device=device, attention_backend=backend, dtype="float32", block_size=16,
             max_num_seqs=8, max_num_batched_tokens=32, async_scheduling=deferred,
             **shared_gpu(device)) as llm:
        runner = llm.engine.core.executor.worker.runner
        assert runner.allow_deferred_steps() if deferred else not runner.defer_steps
        if deferred and device == "cuda":   # deferred steps run on the engine's thread, no other
            assert llm.engine.core.executor._thread is None
        execute = runner.execute_model
        steps, threads = [], set()

        def checked(scheduler_output):
            threads.add(threading.get_ident())
            if strict:
                torch.cuda.set_sync_debug_mode("error")
            try:
                return execute(scheduler_output)
            finally:
                if strict:
                    torch.cuda.set_sync_debug_mode(0)
                steps.append(scheduler_output.total_num_scheduled_tokens)

        runner.execute_model = checked
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    # Chunked prefill (a 40-token prompt over 32-token steps), decodes, both in one step.
    assert len(steps) > 10 and max(steps) == 32
    if deferred:   # they wait for nothing, so the engine runs them itself (executor/uniproc.py)
        assert threads == {threading.get_ident()}
    ref = PretrainedReference(path)
    assert list(outs[0].outputs[0].token_ids) == ref.greedy(PROMPTS[0], 12)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert len(outs[3].outputs[0].logprobs) == 12 and len(outs[3].outputs[0].logprobs[0]) >= 3
    for i, num_top in ((0, 4), (2, 1)):
        ids, lps = PROMPTS[i], outs[i].prompt_logprobs
        assert lps[0] is None and len(lps) == len(ids)
        assert all(num_top <= len(entry) <= num_top + 1 for entry in lps[1:])
        got = torch.tensor([lps[j][ids[j]].logprob for j in range(1, len(ids))])
        torch.testing.assert_close(got, ref.prompt_logprobs(ids), rtol=0, atol=1e-3)
    assert outs[1].prompt_logprobs is None
    return [(list(o.outputs[0].token_ids),
             [sorted(lp.items()) for lp in o.outputs[0].logprobs or []],
             [sorted(lp.items()) if lp else None for lp in o.prompt_logprobs or []]) for o in outs]


def test_every_sampling_feature_in_one_batch_on_the_cpu(llama):
    """Deferred steps (penalties counting a token still on the device, prompt logprobs brought
    down with the next step's samples) give every row what waiting for each step gives."""
    assert run(llama, "cpu", "torch", strict=False) == run(llama, "cpu", "torch", strict=False,
                                                           deferred=True)


@pytest.mark.gpu
@pytest.mark.parametrize("backend,deferred", [("triton", False), ("torch", False), ("triton", True)])
def test_a_step_waits_for_the_gpu_only_for_its_sampled_tokens(tiny_checkpoints, backend, deferred):
    run(tiny_checkpoints["llama"], "cuda", backend, strict=True, deferred=deferred)


@pytest.mark.gpu
def test_a_host_copy_waits_only_for_what_was_queued_before_it():
    """A deferred step's HostCopy is made before the next step is queued; its wait must not
    wait for that step (about a second of GPU sleep here)."""
    values = torch.arange(8, device="cuda")
    copy = HostCopy([values])
    torch.cuda._sleep(2_000_000_000)
    start = time.perf_counter()
    host = copy.wait()
    waited = time.perf_counter() - start
    assert host[0].tolist() == list(range(8))
    assert not torch.cuda.current_stream().query(), "the sleep was over before the wait: no evidence"
    assert waited < 0.2, f"waited {waited:.2f} s: for work queued after the copy"
    torch.cuda.synchronize()
