"""Deferred steps (worker/deferred_step.py): under async scheduling a step's sampled tokens stay
on the device, the next step's rows at their positions (and its penalties' token counts) take
them there, and they reach the host only while that next step runs. On a GPU the in-process
executor does this by itself; here the runner is told to (`allow_deferred_steps`), so the same
code runs on CPU tensors.

Held to transformers: greedy output, with a repetition penalty (counted over tokens still on the
device) and prompt logprobs in the same deferred steps; a slot given to a new request while the
last tenant's token was still on the device (the slot must not get it: vLLM's runner leaked
exactly such a token into the next tenant); preemption. Seeded sampling with every sampling
feature must draw the same tokens deferred or not. Grammars under deferred steps are held to
transformers in test_structured_outputs.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.family_support import PretrainedReference
from treadle import LLM, SamplingParams
from treadle.engine.errors import EngineDeadError
from treadle.worker.deferred_step import DeferredStep


class Watch:
    """Counts what the runner's deferred steps did: steps deferred, input rows that took a
    deferred token from the device, and tokens not written because their slot's request left."""

    def __init__(self, runner) -> None:
        self.deferred = self.patched_rows = self.dropped = 0
        self.host_steps = 0   # steps that sampled and still waited for their tokens
        self.runner = runner
        execute, finish = runner.execute_model, DeferredStep.finish
        tokens_for = DeferredStep.device_tokens_for

        def counted_execute(so):
            out = execute(so)
            self.deferred += isinstance(out, DeferredStep)
            self.host_steps += not isinstance(out, DeferredStep) and any(out.sampled_token_ids)
            return out

        def counted_tokens_for(step, *args):
            found = tokens_for(step, *args)
            self.patched_rows += 0 if found is None else len(found[0])
            return found

        def counted_finish(step, *args):
            if step.output is None:
                self.dropped += len(step.dropped & set(step.slots.tolist()))
            return finish(step, *args)

        runner.execute_model = counted_execute
        self._restore = [(DeferredStep, "finish", finish), (DeferredStep, "device_tokens_for", tokens_for)]
        DeferredStep.finish, DeferredStep.device_tokens_for = counted_finish, counted_tokens_for

    def close(self) -> None:
        for owner, name, value in self._restore:
            setattr(owner, name, value)


@pytest.fixture
def deferred_llm(llama):
    """An engine with async scheduling whose runner defers its steps, and its Watch."""
    llm = LLM(llama, dtype="float32", async_scheduling=True, block_size=16, num_kv_blocks=40,
              max_num_seqs=4, max_num_batched_tokens=24)
    runner = llm.engine.core.executor.worker.runner
    assert runner.allow_deferred_steps()
    watch = Watch(runner)
    try:
        yield llm, watch
    finally:
        watch.close()
        llm.engine.core.scheduler.kv_cache.assert_no_leaks()
        llm.shutdown()


PROMPTS = [list(range(5, 25)), list(range(60, 67)), [9, 8, 7, 6, 5, 4] * 5, list(range(200, 212))]


def test_greedy_output_with_penalties_and_prompt_logprobs_matches_transformers(deferred_llm, llama):
    llm, watch = deferred_llm
    ref = PretrainedReference(llama)
    want = [ref.greedy(p, 16) for p in PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert watch.deferred > 10 and watch.patched_rows > 20 and watch.host_steps == 0
    # A repetition penalty counts the output so far, the last token still on the device; prompt
    # logprobs come down with the samples. Every step that samples still defers.
    penalized = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.6)
    logprobs = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    deferred_before = watch.deferred
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        [greedy, penalized, logprobs, penalized], use_tqdm=False)
    penalized_want = [ref.greedy(PROMPTS[i], 16, repetition_penalty=1.6) for i in (1, 3)]
    assert penalized_want != [want[1], want[3]], "the penalty changes nothing: no evidence"
    assert [list(o.outputs[0].token_ids) for o in outs] == [
        want[0], penalized_want[0], want[2][:4], penalized_want[1]]
    got = [lp[t].logprob for lp, t in zip(outs[2].prompt_logprobs[1:], PROMPTS[2][1:])]
    torch.testing.assert_close(torch.tensor(got), ref.prompt_logprobs(PROMPTS[2]), rtol=0, atol=1e-4)
    assert watch.deferred > deferred_before + 10 and watch.host_steps == 0


def test_a_reused_slot_never_gets_the_last_tenants_deferred_token(deferred_llm, llama):
    llm, watch = deferred_llm
    engine = llm.engine
    ref = PretrainedReference(llama)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, params)
    engine.add_request("b", {"prompt_token_ids": PROMPTS[1]}, params)
    for _ in range(6):
        engine.step()
    # "a" leaves with a step of its in flight; "c" arrives and takes its slot.
    engine.abort_request("a")
    engine.add_request("c", {"prompt_token_ids": PROMPTS[2]}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    assert done["b"] == ref.greedy(PROMPTS[1], 20) and done["c"] == ref.greedy(PROMPTS[2], 20)
    assert watch.dropped >= 1, "no deferred token was held back from a slot its request left"
    assert watch.deferred > 10


def test_preemption_under_deferred_steps_matches_transformers(llama):
    ref = PretrainedReference(llama)
    prompts = [list(range(10 + 7 * i, 50 + 7 * i)) for i in range(4)]
    want = [ref.greedy(p, 24) for p in prompts]
    with LLM(llama, dtype="float32", async_scheduling=True, block_size=16, num_kv_blocks=9,
             max_num_seqs=4, max_num_batched_tokens=16) as llm:
        runner = llm.engine.core.executor.worker.runner
        assert runner.allow_deferred_steps()
        watch = Watch(runner)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        finally:
            watch.close()
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        assert llm.get_stats().num_preemptions > 0 and watch.deferred > 10


def test_seeded_sampling_draws_the_same_tokens_deferred_or_not(llama):
    params = [SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, seed=s, max_tokens=16,
                             ignore_eos=True, logprobs=2) for s in (1, 2, 3, 4)]
    # Penalties over the output on the device, min_tokens, a bias, prompt logprobs.
    params[1] = SamplingParams(temperature=1.0, seed=2, max_tokens=16, ignore_eos=True, logprobs=1,
                               frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3)
    params[2] = SamplingParams(temperature=0.8, seed=3, max_tokens=16, min_tokens=8, logprobs=1,
                               logit_bias={7: 3.0}, prompt_logprobs=2)
    runs = []
    for defer in (False, True):
        with LLM(llama, dtype="float32", async_scheduling=True, block_size=16, max_num_seqs=4,
                 max_num_batched_tokens=24) as llm:
            if defer:
                assert llm.engine.core.executor.worker.runner.allow_deferred_steps()
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
            runs.append([(list(o.outputs[0].token_ids), [sorted(lp) for lp in o.outputs[0].logprobs],
                          [sorted(lp) if lp else None for lp in o.prompt_logprobs or []]) for o in outs])
    assert runs[0] == runs[1]


def test_a_deferred_step_that_fails_ends_the_engine_with_its_error(llama):
    """Deferred steps run on the engine's own thread (executor/uniproc.py); a failure in one
    comes out where the step's output is asked for, as an EngineDeadError naming it, as it did
    from the worker thread."""
    with LLM(llama, dtype="float32", async_scheduling=True, block_size=16, num_kv_blocks=40) as llm:
        runner = llm.engine.core.executor.worker.runner
        assert runner.allow_deferred_steps()
        forward, calls = runner._forward, []

        def failing_forward(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("the device fell over")
            return forward(*args, **kwargs)

        runner._forward = failing_forward
        with pytest.raises(EngineDeadError, match="a model step failed: .*the device fell over"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                         SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)


def test_only_the_in_process_executor_on_one_rank_without_drafts_defers(llama):
    with LLM(llama, dtype="float32", async_scheduling=True, num_kv_blocks=16, block_size=16,
             speculative_config={"method": "ngram", "num_speculative_tokens": 2}) as llm:
        runner = llm.engine.core.executor.worker.runner
        assert not runner.defer_steps   # on a CPU nothing defers unless told
        assert not runner.allow_deferred_steps()   # drafts are proposed from host tokens


def test_a_deferred_steps_tokens_start_for_the_host_before_the_next_step_is_queued(
        deferred_llm, llama, monkeypatch):
    """Each deferred step queues the copy of its tokens to the host as it samples, ahead of the
    next step's forward pass. Queued when `finish` waits instead, the copy runs after that whole
    pass, and the wait with it: on the H200, async scheduling was slower than none (TPOT 2.69 ms
    against 2.30 at batch 1), finish waiting 1.34 ms a step."""
    from treadle.worker import deferred_step, model_runner

    llm, watch = deferred_llm
    events: list[str] = []
    copy, forward = deferred_step.HostCopy, model_runner.ModelRunner._forward

    class RecordedCopy(copy):
        def __init__(self, tensors):
            events.append("copy")
            super().__init__(tensors)

    def recorded_forward(runner, *args, **kwargs):
        events.append("forward")
        return forward(runner, *args, **kwargs)

    monkeypatch.setattr(deferred_step, "HostCopy", RecordedCopy)
    monkeypatch.setattr(model_runner.ModelRunner, "_forward", recorded_forward)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}], greedy, use_tqdm=False)
    assert list(outs[0].outputs[0].token_ids) == PretrainedReference(llama).greedy(PROMPTS[0], 12)
    assert watch.deferred >= 12 and events.count("copy") == watch.deferred
    # One request, each step sampling: every forward pass but the first follows a copy.
    assert events[0] == "forward" and "forward,forward" not in ",".join(events), events
