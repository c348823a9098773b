"""Exactness on the engine's seams, checked against transformers wherever a reference exists:
priority preemption under KV pressure (with drafts and async scheduling), n > 1 greedy,
speculation with stop strings and min_tokens, continuations after a weight update; and the
engine's own contracts: pause("wait") with outputs pending, and a runner that breaks the
scheduler's decision of who samples.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re

import pytest

from tests.reference import HFReference
from tests.test_correctness import TEXTS
from tests.test_rl_controls import perturbed
from tests.test_spec_decode import NGRAM, REPETITIVE
from treadle import LLM, AsyncLLM, EngineDeadError, SamplingParams
from treadle.config import EngineArgs
from treadle.engine.llm_engine import LLMEngine
from treadle.models.loader import load_tokenizer

REPEATING = [11, 12, 13, 14, 15] * 6   # drafts find matches in it


@pytest.fixture(scope="module")
def prompts(llama) -> list[list[int]]:
    tok = load_tokenizer(llama)
    return [tok.encode(t) for t in TEXTS] + [REPEATING]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run_steps(engine: LLMEngine, arrivals: dict[int, list[tuple[str, list[int], int]]],
              params: SamplingParams, max_steps: int = 2000) -> dict[str, list[int]]:
    """Steps the engine, adding (id, prompt, priority) requests at the given step numbers."""
    done: dict[str, list[int]] = {}
    for step in range(max_steps):
        for rid, prompt, priority in arrivals.get(step, []):
            engine.add_request(rid, {"prompt_token_ids": prompt}, params, priority=priority)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if step > max(arrivals) and not engine.has_unfinished_requests():
            return done
    raise AssertionError("the engine did not finish")


# -- priority preemption -----------------------------------------------------------------------
@pytest.mark.parametrize("config", [{}, {"async_scheduling": True},
                                    {"speculative_config": NGRAM},
                                    {"speculative_config": NGRAM, "async_scheduling": True}])
def test_priority_preemption_under_kv_pressure_matches_transformers(llama, reference, prompts,
                                                                     config):
    """Low-priority requests run first; urgent ones arrive while they decode and take their
    blocks, some after the victims were already given tokens in the same step."""
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=llama, scheduling_policy="priority", block_size=4, num_kv_blocks=30,
        max_num_batched_tokens=32, **config))
    arrivals = {0: [("low0", prompts[3], 2), ("low1", prompts[5], 2)],
                3: [("high0", prompts[0], 0), ("mid0", prompts[4], 1)],
                6: [("high1", prompts[1], 0), ("low2", prompts[2], 2)],
                9: [("high2", prompts[5][:17], 0)]}
    done = run_steps(engine, arrivals, greedy(24))
    ref = reference(llama)
    expected = {rid: ref.greedy(p, 24) for batch in arrivals.values() for rid, p, _ in batch}
    assert done == expected
    assert engine.core.scheduler.num_preemptions > 0
    engine.core.scheduler.kv_cache.assert_no_leaks()


# -- n > 1 -------------------------------------------------------------------------------------
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_n_greedy_samples_all_match_transformers(llama, reference, prompts, async_scheduling):
    llm = LLM(llama, async_scheduling=async_scheduling, num_kv_blocks=40, block_size=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]],
                        greedy(20, n=3), use_tqdm=False)
    ref = reference(llama)
    for p, out in zip(prompts[:3], outs):
        assert [c.token_ids for c in out.outputs] == [ref.greedy(p, 20)] * 3
        assert [c.index for c in out.outputs] == [0, 1, 2]
    llm.engine.core.scheduler.kv_cache.assert_no_leaks()


# -- speculation with stop strings and min_tokens ----------------------------------------------
def stop_reference(tok, ids: list[int], stop: str, min_tokens: int) -> tuple[list[int], str]:
    """Where single-token decoding stops on `stop`: the first token after min_tokens whose text
    completes an occurrence of it; the output is the ids up to that token, the text before it."""
    before = ""
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        pos = text.find(stop, max(0, len(before) - len(stop) + 1))
        if n > min_tokens and pos != -1:
            return ids[:n], text[:pos]
        before = text
    raise AssertionError(f"{stop!r} never completes after {min_tokens} tokens")


def count_core_tokens(llm: LLM) -> dict[str, int]:
    """Counts, per request, the tokens the engine core hands to the output processor."""
    counts: dict[str, int] = {}
    step = llm.engine.core.step

    def counting_step():
        outputs = step()
        for out in outputs:
            counts[out.request_id] = counts.get(out.request_id, 0) + len(out.new_token_ids)
        return outputs

    llm.engine.core.step = counting_step
    return counts


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_spec_with_stop_strings_is_field_for_field_plain_decoding(smollm2_path, reference,
                                                                  async_scheduling):
    """A stop string that completes inside a 1 + k step cuts the text, the ids, the logprobs
    and the token count where plain decoding would; min_tokens counts tokens, not steps.

    SmolLM2 copies a list, so most drafts are accepted. The stop strings are the texts of
    tokens that recur in its output, each tried as is and with min_tokens past some of its
    occurrences."""
    # A step budget of 256 tokens holds the prompt (under 50) whole, as the default 2,048
    # does; the engines only warm their GEMMs up to it at start-up.
    plain = LLM(smollm2_path, async_scheduling=async_scheduling, max_num_seqs=4,
                max_num_batched_tokens=256)
    spec = LLM(smollm2_path, async_scheduling=async_scheduling, max_num_seqs=4,
               max_num_batched_tokens=256,
               speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    tok = plain.get_tokenizer()
    prompt = tok.encode(REPETITIVE)
    plain_ids = reference(smollm2_path).greedy(prompt, 32)
    pieces = [tok.decode([t]) for t in plain_ids]
    recurring = sorted({p for p in pieces if p.strip() and pieces.count(p) > 2},
                       key=pieces.count, reverse=True)[:2]
    assert recurring, "the reference output does not repeat itself"
    cases = [(piece, min_tokens) for piece in recurring
             for min_tokens in [0] + [i + 1 for i, p in enumerate(pieces) if p == piece][1:-1:2]]
    core_tokens = count_core_tokens(spec)
    num_cut = 0
    for stop, min_tokens in cases:
        ids, text = stop_reference(tok, plain_ids, stop, min_tokens)
        params = greedy(32, stop=[stop], min_tokens=min_tokens, logprobs=2)
        core_tokens.clear()
        outs = [llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
                for llm in (plain, spec)]
        for out in outs:
            assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == (
                ids, text, "stop", stop), (stop, min_tokens)
            assert [next(iter(lp)) for lp in out.logprobs] == ids
        for a, b in zip(outs[0].logprobs, outs[1].logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-3 for t in a)
        num_cut += sum(core_tokens.values()) > len(ids)
    assert num_cut > 0, "no stop string completed inside a multi-token step"
    for llm in (plain, spec):
        llm.engine.core.scheduler.kv_cache.assert_no_leaks()


# -- continuations after a weight update -------------------------------------------------------
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_continuation_after_update_weights_matches_transformers_on_the_new_weights(
        llama, reference, prompts, original_weights, async_scheduling):
    """A request kept across a weight update: its tokens before the pause are the old model's,
    the rest what transformers with the perturbed weights gives for prompt + those tokens."""
    new_weights = perturbed(original_weights)
    new_ref = HFReference(llama, new_weights)
    prompt, total = prompts[0], 24

    async def body(engine: AsyncLLM) -> tuple[list[int], int]:
        updated: list[asyncio.Task] = []
        num_old = 0

        async def update() -> None:
            await engine.pause_generation(mode="keep", clear_cache=True)
            await engine.update_weights(new_weights, weight_version="new")
            await engine.resume_generation()

        final = None
        async for out in engine.generate({"prompt_token_ids": prompt}, greedy(total),
                                         request_id="r"):
            final = out
            if out.weight_version == 0:
                num_old = len(out.outputs[0].token_ids)
            if num_old >= 4 and not updated:
                updated.append(asyncio.create_task(update()))
        await updated[0]
        return final.outputs[0].token_ids, num_old

    engine = AsyncLLM(llama, async_scheduling=async_scheduling, max_num_seqs=2)
    try:
        tokens, num_old = asyncio.run(body(engine))
    finally:
        engine.shutdown()
    assert 4 <= num_old < total
    assert tokens[:num_old] == reference(llama).greedy(prompt, num_old)
    assert tokens[num_old:] == new_ref.greedy(prompt + tokens[:num_old], total - num_old)
    assert tokens != reference(llama).greedy(prompt, total), "the update changed nothing"


# -- the engine's own contracts ----------------------------------------------------------------
def test_pause_wait_hands_out_pending_outputs_once(llama, reference, prompts):
    """EngineCore.pause("wait") with outputs already pending (here from draining a step in
    flight, which takes async scheduling): each comes out once, so every request's tokens are
    exactly transformers' tokens."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=llama, async_scheduling=True))
    core = engine.core
    for i, p in enumerate(prompts[:3]):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, greedy(12))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    outputs = core.step() + core.step() + core.step()
    core.drain()
    assert core._pending, "the drain should leave outputs pending"
    core.pause("wait", clear_cache=False)
    outputs += core.take_pending_outputs()
    for out in outputs:   # engine-core ids: the client's and a number (invariant 6)
        tokens[out.request_id.rsplit("-", 1)[0]] += out.new_token_ids
    ref = reference(llama)
    assert tokens == {f"r{i}": ref.greedy(p, 12) for i, p in enumerate(prompts[:3])}
    core.scheduler.kv_cache.assert_no_leaks()


def drop_first_sample_of(runner, rid: str, at_step: int) -> None:
    """Makes the model runner return no token for the client's request `rid` on its
    `at_step`-th step (the runner knows it as `rid-<n>`: engine/input_processor.py)."""
    execute, count = runner.execute_model, [0]

    def execute_model(so):
        out = execute(so)
        count[0] += 1
        clients = [r.rsplit("-", 1)[0] for r in out.req_ids]
        if count[0] == at_step and rid in clients:
            sampled = list(out.sampled_token_ids)
            sampled[clients.index(rid)] = []
            out = dataclasses.replace(out, sampled_token_ids=sampled)
        return out

    runner.execute_model = execute_model


def test_a_sampling_request_without_a_token_is_an_engine_error(llama, prompts):
    llm = LLM(llama)
    drop_first_sample_of(llm.engine.core.executor.worker.runner, "1", at_step=3)
    with pytest.raises(EngineDeadError, match=r"request 1-\d+ was scheduled to sample 1 token"):
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], greedy(8), use_tqdm=False)


def test_a_request_that_finished_before_a_refused_output_is_freed(llama, prompts):
    """Request 0 finishes in the step whose output for request 1 is refused: it is freed
    all the same, not left finished in the running list holding its blocks."""
    llm = LLM(llama)
    drop_first_sample_of(llm.engine.core.executor.worker.runner, "1", at_step=2)
    with pytest.raises(EngineDeadError, match=r"request 1-\d+ was scheduled to sample 1 token"):
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], [greedy(2), greedy(8)],
                     use_tqdm=False)
    scheduler = llm.engine.core.scheduler   # and request 1 was aborted as generate() failed
    assert not scheduler.requests and not scheduler.running
    scheduler.kv_cache.assert_no_leaks()


def test_a_sampling_request_without_a_token_ends_async_streams_with_an_error(llama, prompts):
    """The stream ends with finish_reason "error" and the reason; the engine is then dead."""
    engine = AsyncLLM(llama, async_scheduling=True)
    drop_first_sample_of(engine.core.executor.worker.runner, "r", at_step=3)

    async def body() -> None:
        final = None
        async for final in engine.generate({"prompt_token_ids": prompts[0]}, greedy(8),
                                           request_id="r"):
            pass
        assert final.finished and final.outputs[0].finish_reason == "error"
        assert re.search(r"request r-\d+ was scheduled to sample", final.outputs[0].stop_reason)
        with pytest.raises(EngineDeadError, match=r"request r-\d+ was scheduled to sample"):
            await engine.check_health()

    try:
        asyncio.run(asyncio.wait_for(body(), timeout=60))
    finally:
        engine.shutdown()
