"""Async scheduling on the real engine: greedy output stays token-identical to transformers,
whether steps overlap or not, and however often generation is frozen, its cache dropped and
its requests recomputed mid-run."""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import ENGINE_ARGS_ON
from tests.test_correctness import TEXTS, assert_matches_reference, greedy, prompt_ids
from treadle import LLM, AsyncLLM, SamplingParams


ARCHS = ["llama", "qwen2", "qwen3"]
CONFIGS = [{}, {"max_num_batched_tokens": 32},
           {"block_size": 8, "num_kv_blocks": 12, "max_num_batched_tokens": 32}]
# Every pair on the CPU; on CUDA, where async scheduling is the default that every engine test
# runs with, each architecture once and each config once (a case takes about a minute there).
ASYNC_CASES = ([pytest.param(arch, config, "cpu", id=f"cpu-config{i}-{arch}")
                for i, config in enumerate(CONFIGS) for arch in ARCHS]
               + [pytest.param(arch, config, "cuda", id=f"cuda-config{i}-{arch}", marks=pytest.mark.gpu)
                  for i, (arch, config) in enumerate(zip(ARCHS, CONFIGS))])


@pytest.mark.parametrize("arch,config,device", ASYNC_CASES)
def test_tiny_models_async_match_transformers(tiny_checkpoints, reference, arch, config, device):
    path = tiny_checkpoints[arch]
    with LLM(path, async_scheduling=True, **config, **ENGINE_ARGS_ON[device]) as llm:
        assert_matches_reference(llm, reference(path), prompt_ids(llm), max_tokens=40)
        assert llm.engine.core.scheduler.num_in_flight_tokens() == 0


def run_with_resets(llm: LLM, prompts: list[list[int]], max_tokens: int, reset_at: set[int],
                    drain: bool = True) -> list[list[int]]:
    """Step the engine by hand, resetting running requests and the prefix cache at given steps.

    drain=False resets the scheduler with the async step still in flight, so the real runner's
    output for it arrives stale and must be dropped token for token."""
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, greedy(max_tokens))
    results: dict[str, list[int]] = {}
    step = total_stale = 0
    while engine.has_unfinished_requests():
        if step in reset_at:
            if drain:
                assert llm.reset_prefix_cache(reset_running_requests=True)
            else:
                in_flight = engine.core.scheduler.num_in_flight_tokens()
                assert engine.core.scheduler.reset_prefix_cache(reset_running_requests=True)
                stale = sum(r.num_stale_output_tokens for r in engine.core.scheduler.requests.values())
                assert stale == in_flight
                total_stale += stale
            assert engine.core.scheduler.kv_cache.pool.hash_to_block == {}
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        step += 1
    engine.core.scheduler.kv_cache.assert_no_leaks()
    assert drain or total_stale > 0, "no output was in flight at any reset"
    return [results[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("async_scheduling,drain", [(False, True), (True, True), (True, False)])
def test_reset_running_requests_mid_run_is_token_exact(tiny_checkpoints, reference, async_scheduling,
                                                       drain, on_device):
    path = tiny_checkpoints["qwen3"]
    with LLM(path, async_scheduling=async_scheduling, max_num_batched_tokens=32, **on_device) as llm:
        prompts = prompt_ids(llm)
        got = run_with_resets(llm, prompts, 30, reset_at={1, 4, 5, 17, 30}, drain=drain)
        assert got == [reference(path).greedy(p, 30) for p in prompts]
        assert llm.engine.core.scheduler.num_preemptions >= 3 * len(prompts)


@pytest.fixture(scope="module")
def smollm2_prompts(smollm2_path):
    from treadle.models.loader import load_tokenizer, prepare_model
    tok = load_tokenizer(prepare_model(smollm2_path))
    return [tok.encode(t) for t in TEXTS]


async def _generate_with_pauses(engine: AsyncLLM, prompts: list[list[int]], max_tokens: int,
                                pause_after: tuple[int, ...]) -> list[list[int]]:
    """Pause (keep, clear the cache) whenever request 0 reaches one of `pause_after` tokens (or
    passes it: a stream that lags takes several steps' tokens in one output)."""
    params = greedy(max_tokens)
    pauses: list[asyncio.Task] = []

    async def pause_then_resume() -> None:
        await engine.pause_generation(mode="keep", clear_cache=True)
        assert await engine.is_paused()
        await asyncio.sleep(0.02)
        await engine.resume_generation()

    async def run(i: int) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate({"prompt_token_ids": prompts[i]}, params, request_id=str(i)):
            tokens = out.outputs[0].token_ids
            if i == 0 and len(pauses) < len(pause_after) and len(tokens) >= pause_after[len(pauses)]:
                pauses.append(asyncio.create_task(pause_then_resume()))
        return tokens

    results = await asyncio.gather(*(run(i) for i in range(len(prompts))))
    await asyncio.gather(*pauses)
    assert len(pauses) == len(pause_after)
    return results


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_smollm2_pause_keep_clear_cache_resume_is_token_exact(smollm2_path, smollm2_prompts, reference,
                                                              async_scheduling):
    engine = AsyncLLM(smollm2_path, async_scheduling=async_scheduling, max_num_batched_tokens=64)
    try:
        got = asyncio.run(_generate_with_pauses(engine, smollm2_prompts, 24, pause_after=(1, 6, 7, 15)))
        engine.core.scheduler.kv_cache.assert_no_leaks()
        assert engine.core.scheduler.num_preemptions > 0   # the pauses really dropped running KV
    finally:
        engine.shutdown()
    ref = reference(smollm2_path)
    for p, tokens in zip(smollm2_prompts, got):
        assert tokens == ref.greedy(p, 24)


def test_smollm2_async_under_preemption(smollm2_path, reference):
    llm = LLM(smollm2_path, async_scheduling=True, max_num_batched_tokens=32, block_size=16, num_kv_blocks=14,
              max_num_seqs=4)
    assert_matches_reference(llm, reference(smollm2_path), prompt_ids(llm), max_tokens=32)
    assert llm.engine.core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5])
def test_async_schedules_no_token_past_max_tokens(tiny_checkpoints, max_tokens):
    llm = LLM(tiny_checkpoints["llama"], async_scheduling=True)
    scheduled = []
    schedule = llm.engine.core.scheduler.schedule

    def recording_schedule():
        out = schedule()
        scheduled.append(out.total_num_scheduled_tokens)
        return out

    llm.engine.core.scheduler.schedule = recording_schedule
    prompt = list(range(300, 321))
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == max_tokens
    assert sum(scheduled) == len(prompt) + max_tokens - 1
