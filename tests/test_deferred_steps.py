"""Deferred steps (worker/deferred_step.py): under async scheduling a plain step's sampled tokens
stay on the device, the next step's rows at their positions take them there, and they reach the
host only while that next step runs. On a GPU the in-process executor does this by itself; here
the runner is told to (`allow_deferred_steps`), so the same code runs on CPU tensors.

Held to transformers: greedy output, batched with requests that cannot be deferred (penalties,
prompt logprobs) and force the host path between deferred steps; a slot given to a new request
while the last tenant's token was still on the device (the slot must not get it: vLLM's runner
leaked exactly such a token into the next tenant); preemption; and seeded sampling, which must
draw the same tokens deferred or not.
"""

from __future__ import annotations

import pytest

from tests.family_support import PretrainedReference
from treadle import LLM, SamplingParams
from treadle.worker.deferred_step import DeferredStep


class Watch:
    """Counts what the runner's deferred steps did: steps deferred, input rows that took a
    deferred token from the device, and tokens not written because their slot's request left."""

    def __init__(self, runner) -> None:
        self.deferred = self.patched_rows = self.dropped = 0
        self.runner = runner
        execute, finish = runner.execute_model, DeferredStep.finish
        tokens_for = DeferredStep.device_tokens_for

        def counted_execute(so):
            out = execute(so)
            self.deferred += isinstance(out, DeferredStep)
            return out

        def counted_tokens_for(step, *args):
            found = tokens_for(step, *args)
            self.patched_rows += 0 if found is None else len(found[0])
            return found

        def counted_finish(step, slots):
            if step.output is None:
                self.dropped += len(step.dropped & set(step.slots.tolist()))
            return finish(step, slots)

        runner.execute_model = counted_execute
        self._restore = [(DeferredStep, "finish", finish), (DeferredStep, "device_tokens_for", tokens_for)]
        DeferredStep.finish, DeferredStep.device_tokens_for = counted_finish, counted_tokens_for

    def close(self) -> None:
        for owner, name, value in self._restore:
            setattr(owner, name, value)


@pytest.fixture
def deferred_llm(llama):
    """An engine with async scheduling whose runner defers plain steps, and its Watch."""
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


def test_greedy_output_matches_transformers_with_plain_and_host_steps_mixed(deferred_llm, llama):
    llm, watch = deferred_llm
    ref = PretrainedReference(llama)
    want = [ref.greedy(p, 16) for p in PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert watch.deferred > 10 and watch.patched_rows > 20
    # Requests that read tokens on the host (prompt logprobs: their targets) come in between:
    # each step of theirs finishes the deferred one first.
    host = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    deferred_before = watch.deferred
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [greedy, host, greedy, host],
                        use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [want[0], want[1][:4], want[2], want[3][:4]]
    assert outs[1].prompt_logprobs is not None
    # Once the prompt-logprob requests end, the plain ones defer again.
    assert watch.deferred > deferred_before


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
    runs = []
    for defer in (False, True):
        with LLM(llama, dtype="float32", async_scheduling=True, block_size=16, max_num_seqs=4,
                 max_num_batched_tokens=24) as llm:
            if defer:
                assert llm.engine.core.executor.worker.runner.allow_deferred_steps()
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
            runs.append([(list(o.outputs[0].token_ids),
                          [sorted(lp) for lp in o.outputs[0].logprobs]) for o in outs])
    assert runs[0] == runs[1]


def test_only_the_in_process_executor_on_one_rank_without_drafts_defers(llama):
    with LLM(llama, dtype="float32", async_scheduling=True, num_kv_blocks=16, block_size=16,
             speculative_config={"method": "ngram", "num_speculative_tokens": 2}) as llm:
        runner = llm.engine.core.executor.worker.runner
        assert not runner.defer_steps   # on a CPU nothing defers unless told
        assert not runner.allow_deferred_steps()   # drafts are proposed from host tokens
