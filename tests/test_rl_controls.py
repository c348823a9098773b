"""The RL controls on the real engine: pause/resume in its three modes, weight updates and
reloads, sleep/wake, collective_rpc, plus streaming details (delta outputs, abort, closing a
stream early). Greedy output is checked token by token against transformers.

Pauses land "mid-generation" deterministically: the consumer of one stream starts the pause
once that stream has produced k tokens.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from tests.kv_fixtures import core_request
from tests.reference import HFReference
from tests.test_correctness import TEXTS
from treadle import (LLM, AsyncLLM, EngineBusyError, EngineDeadError, RequestOutputKind,
                     SamplingParams)
from treadle.engine.core import EngineCore
from treadle.engine.weights import ServedWeights
from treadle.models.loader import load_tokenizer

ENGINE_ARGS = {"block_size": 16, "num_kv_blocks": 256, "max_num_seqs": 2}
MAX_TOKENS = 40
LONG_TEXT = TEXTS[3] + " " + TEXTS[2]   # 54 tokens with SmolLM2's tokenizer: three whole blocks
DOWN_PROJ = "model.layers.0.mlp.down_proj.weight"
K_PROJ = "model.layers.1.self_attn.k_proj.weight"   # part of a fused qkv parameter


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(llama) -> list[list[int]]:
    tok = load_tokenizer(llama)
    return [tok.encode(t) for t in TEXTS[:3]]


@pytest.fixture(scope="module")
def long_prompt(llama) -> list[int]:
    return load_tokenizer(llama).encode(LONG_TEXT)


def prefix_hit(prompt: list[int]) -> int:
    """The tokens a repeat of `prompt` finds cached: its whole blocks of 16, one token left to
    compute (48 with SmolLM2's tokenizer; the GPU machines' fallback tokenizer makes more)."""
    return (len(prompt) - 1) // ENGINE_ARGS["block_size"] * ENGINE_ARGS["block_size"]


def run_engine(path: str, body, **engine_args):
    """asyncio.run(body(engine)) on a fresh AsyncLLM, always shut down afterwards."""
    engine = AsyncLLM(path, **{**ENGINE_ARGS, **engine_args})
    try:
        return asyncio.run(body(engine))
    finally:
        engine.shutdown()


def assert_no_leaks(engine: AsyncLLM) -> None:
    # A step in flight when the last stream ended (an abort's) drains on the engine's thread.
    deadline = time.monotonic() + 5
    while not engine.core.is_idle() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.core.is_idle()
    assert not engine.output_processor.requests
    engine.core.scheduler.kv_cache.assert_no_leaks()


async def consume(engine: AsyncLLM, rid: str, ids: list[int], params: SamplingParams | None = None,
                  on_output=None, **kwargs):
    """Run one request to its end; returns the final RequestOutput."""
    final = None
    async for out in engine.generate({"prompt_token_ids": ids}, params or greedy(), rid, **kwargs):
        final = out
        if on_output is not None:
            on_output(out)
    assert final is not None and final.finished
    return final


async def started(engine: AsyncLLM, rid: str, ids: list[int], params: SamplingParams
                  ) -> asyncio.Task:
    """A request run to its end on a task of its own, once its first output is out."""
    first = asyncio.Event()
    task = asyncio.create_task(consume(engine, rid, ids, params, on_output=lambda o: first.set()))
    await first.wait()
    return task


async def assert_busy(engine: AsyncLLM, ids: list[int]) -> None:
    with pytest.raises(EngineBusyError):
        async for _ in engine.generate({"prompt_token_ids": ids}, greedy(4)):
            pass


def start_when(k: int, rid: str, make_coro, tasks: list[asyncio.Task]):
    """An on_output callback starting make_coro() once request `rid` has k tokens (once)."""
    def on_output(out):
        if out.request_id == rid and len(out.outputs[0].token_ids) >= k and not tasks:
            tasks.append(asyncio.create_task(make_coro()))
    return on_output


def perturbed(original: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(original[K_PROJ].shape, generator=gen) * original[K_PROJ].std()
    return [(DOWN_PROJ, original[DOWN_PROJ] * 4.0), (K_PROJ, original[K_PROJ] + noise)]


# -- pause: abort ------------------------------------------------------------------------

@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("k", [1, 6])
def test_pause_abort_mid_generation(llama, reference, prompts, k, async_scheduling):
    ref = reference(llama)

    async def body(engine: AsyncLLM):
        pauses: list[asyncio.Task] = []
        trigger = start_when(k, "0", lambda: engine.pause_generation(mode="abort"), pauses)
        # max_num_seqs=2: request 2 is still waiting when the pause comes.
        finals = await asyncio.gather(*(consume(engine, str(i), p, on_output=trigger)
                                        for i, p in enumerate(prompts)))
        await pauses[0]
        assert await engine.is_paused()
        for p, final in zip(prompts, finals):
            c = final.outputs[0]
            assert c.finish_reason == "abort"
            assert c.token_ids == ref.greedy(p, MAX_TOKENS)[:len(c.token_ids)]
        assert len(finals[0].outputs[0].token_ids) >= k
        assert len(finals[0].outputs[0].token_ids) < MAX_TOKENS
        assert finals[2].outputs[0].token_ids == []   # never scheduled
        await assert_busy(engine, prompts[0])
        await engine.reset_prefix_cache()
        assert_no_leaks(engine)

        await engine.resume_generation()
        assert not await engine.is_paused()
        final = await consume(engine, "after", prompts[1])
        assert final.outputs[0].token_ids == ref.greedy(prompts[1], MAX_TOKENS)
        assert final.outputs[0].finish_reason == "length"
        assert_no_leaks(engine)

    run_engine(llama, body, async_scheduling=async_scheduling)


# -- pause: wait -------------------------------------------------------------------------

@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("k", [1, 6])
def test_pause_wait_lets_requests_finish(llama, reference, prompts, k, async_scheduling):
    ref = reference(llama)

    async def body(engine: AsyncLLM):
        checks: list[asyncio.Task] = []

        async def pause_and_probe():
            pause = asyncio.create_task(engine.pause_generation(mode="wait"))
            await asyncio.sleep(0)   # the pause takes effect for new requests at once
            assert await engine.is_paused()
            await assert_busy(engine, prompts[0])
            assert not pause.done()   # still waiting for the running requests
            await pause
            # It returns once the engine is idle: every request has finished.
            assert engine.core.is_idle() and not engine.output_processor.requests
            await assert_busy(engine, prompts[0])

        trigger = start_when(k, "0", pause_and_probe, checks)
        finals = await asyncio.gather(*(consume(engine, str(i), p, on_output=trigger)
                                        for i, p in enumerate(prompts)))
        await checks[0]
        for p, final in zip(prompts, finals):
            assert final.outputs[0].finish_reason == "length"
            assert final.outputs[0].token_ids == ref.greedy(p, MAX_TOKENS)
        assert await engine.is_paused()
        assert_no_leaks(engine)
        await engine.resume_generation()
        final = await consume(engine, "after", prompts[0], greedy(8))
        assert final.outputs[0].token_ids == ref.greedy(prompts[0], 8)
        assert_no_leaks(engine)

    run_engine(llama, body, async_scheduling=async_scheduling)


# -- pause: keep -------------------------------------------------------------------------

@pytest.mark.parametrize("clear_cache", [True, False])
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("k", [1, 5])
def test_pause_keep_freezes_and_resumes_token_exact(llama, reference, prompts, long_prompt, k,
                                                    async_scheduling, clear_cache, on_device):
    ref = reference(llama)
    counts: dict[str, int] = {}
    finished: set[str] = set()

    def track(out):
        counts[out.request_id] = len(out.outputs[0].token_ids)
        if out.finished:
            finished.add(out.request_id)

    async def body(engine: AsyncLLM):
        checks: list[asyncio.Task] = []

        async def pause_probe_resume():
            await engine.pause_generation(mode="keep", clear_cache=clear_cache)
            assert await engine.is_paused()
            await asyncio.sleep(0.05)   # tokens computed before the pause reach their streams
            frozen = dict(counts)
            assert "0" not in finished and counts["0"] >= k
            # A new request is accepted while kept, and waits for the resume.
            late = asyncio.create_task(consume(engine, "late", long_prompt, greedy(12), on_output=track))
            await asyncio.sleep(0.2)
            assert dict(counts) == frozen and "late" not in counts
            assert not late.done()
            await engine.resume_generation()
            assert not await engine.is_paused()
            return await late

        trigger = start_when(k, "0", pause_probe_resume, checks)
        finals = await asyncio.gather(*(consume(engine, str(i), p, on_output=lambda o: (track(o), trigger(o)))
                                        for i, p in enumerate(prompts)))
        late = await checks[0]
        for p, final in zip(prompts, finals):
            assert final.outputs[0].finish_reason == "length"
            assert final.outputs[0].token_ids == ref.greedy(p, MAX_TOKENS)
        assert late.outputs[0].token_ids == ref.greedy(long_prompt, 12)
        preemptions = engine.core.scheduler.num_preemptions
        assert (preemptions > 0) if clear_cache else (preemptions == 0)
        assert_no_leaks(engine)

    run_engine(llama, body, async_scheduling=async_scheduling, **on_device)


# -- pause: idempotent and concurrent ----------------------------------------------------

def test_pause_resume_idempotent_and_concurrent(llama, reference, prompts):
    ref = reference(llama)

    async def body(engine: AsyncLLM):
        # Idle engine: twice in a row, and concurrently.
        await engine.resume_generation()   # not paused: a no-op
        assert not await engine.is_paused()
        await engine.pause_generation(mode="abort")
        await engine.pause_generation(mode="abort")
        assert await engine.is_paused()
        await asyncio.gather(engine.resume_generation(), engine.resume_generation())
        assert not await engine.is_paused()
        with pytest.raises(ValueError):
            await engine.pause_generation(mode="freeze")
        assert not await engine.is_paused()

        # Mid-generation: two keep pauses at once, then two resumes at once.
        checks: list[asyncio.Task] = []

        async def double_pause():
            await asyncio.gather(engine.pause_generation(mode="keep"),
                                 engine.pause_generation(mode="keep"))
            assert await engine.is_paused()
            await asyncio.sleep(0.02)
            await asyncio.gather(engine.resume_generation(), engine.resume_generation())
            assert not await engine.is_paused()

        trigger = start_when(3, "0", double_pause, checks)
        finals = await asyncio.gather(*(consume(engine, str(i), p, on_output=trigger)
                                        for i, p in enumerate(prompts)))
        await checks[0]
        for p, final in zip(prompts, finals):
            assert final.outputs[0].token_ids == ref.greedy(p, MAX_TOKENS)
        assert engine.core.scheduler.num_preemptions > 0
        assert_no_leaks(engine)

    run_engine(llama, body, async_scheduling=True)


# -- weights -----------------------------------------------------------------------------

@pytest.mark.parametrize("async_scheduling", [False, True])
def test_weight_changes_refused_while_running_unpaused(llama, reference, prompts, original_weights,
                                                       async_scheduling):
    ref = reference(llama)

    async def body(engine: AsyncLLM):
        checks: list[asyncio.Task] = []

        async def probe():
            for attempt in (lambda: engine.update_weights(perturbed(original_weights)),
                            lambda: engine.load_weights(llama),
                            lambda: engine.sleep(level=1)):
                with pytest.raises(RuntimeError, match="pause"):
                    await attempt()
            assert await engine.get_weight_version() == 0
            # Paused (keep), the same update goes through; restoring it leaves the output exact.
            await engine.pause_generation(mode="keep")
            assert await engine.update_weights(perturbed(original_weights)) == 2
            assert await engine.update_weights(original_weights.items()) == len(original_weights)
            assert await engine.get_weight_version() == 2
            await engine.resume_generation()

        trigger = start_when(2, "0", probe, checks)
        finals = await asyncio.gather(*(consume(engine, str(i), p, on_output=trigger)
                                        for i, p in enumerate(prompts[:2])))
        await checks[0]
        for p, final in zip(prompts, finals):
            assert final.outputs[0].token_ids == ref.greedy(p, MAX_TOKENS)
        assert finals[0].weight_version == 2
        assert_no_leaks(engine)

    run_engine(llama, body, async_scheduling=async_scheduling)


def test_update_weights_changes_output_and_restore_is_exact(llama, reference, long_prompt,
                                                            original_weights):
    ref = reference(llama)
    expected = ref.greedy(long_prompt, 16)

    async def body(engine: AsyncLLM):
        ids = iter(range(100))

        async def run() -> tuple[list[int], int, object]:
            out = await consume(engine, f"r{next(ids)}", long_prompt, greedy(16))
            return out.outputs[0].token_ids, out.num_cached_tokens, out.weight_version

        assert await engine.get_weight_version() == 0
        assert await run() == (expected, 0, 0)
        assert await run() == (expected, prefix_hit(long_prompt), 0)   # a prefix hit: whole blocks, one token left

        # Each perturbation alone changes the greedy output, and drops the prefix cache.
        for i, (name, tensor) in enumerate(perturbed(original_weights), start=1):
            assert await engine.update_weights([(name, tensor)]) == 1
            assert await engine.get_weight_version() == 2 * i - 1
            tokens, cached, version = await run()
            assert tokens != expected, f"perturbing {name} did not change the output"
            assert (cached, version) == (0, 2 * i - 1)
            assert await run() == (tokens, prefix_hit(long_prompt), 2 * i - 1)   # deterministic, and cached again

            # Putting the original tensor back restores the output exactly.
            assert await engine.update_weights([(name, original_weights[name])],
                                               weight_version=f"v{i}") == 1
            assert await engine.get_weight_version() == f"v{i}"
            assert await run() == (expected, 0, f"v{i}")
            await engine.update_weights([], weight_version=2 * i)   # back to ints
        assert_no_leaks(engine)

    run_engine(llama, body)


def test_update_weights_while_kept_recomputes_with_new_weights(llama, reference, prompts,
                                                               original_weights):
    """Kept requests whose KV was dropped continue on the new weights: the tokens before the
    pause are the reference's, the rest what the new weights give for prompt + those tokens."""
    ref = reference(llama)

    async def body(engine: AsyncLLM):
        checks: list[asyncio.Task] = []

        async def update():
            await engine.pause_generation(mode="keep", clear_cache=True)
            await engine.update_weights(perturbed(original_weights), weight_version="new")
            await engine.resume_generation()

        versions: set = set()
        trigger = start_when(4, "0", update, checks)
        final = await consume(engine, "0", prompts[0], greedy(24),
                              on_output=lambda o: (versions.add(o.weight_version), trigger(o)))
        await checks[0]
        tokens = final.outputs[0].token_ids
        assert final.weight_version == "new" and versions >= {0, "new"}
        expected = ref.greedy(prompts[0], 24)
        split = next(i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b)
        assert split >= 4
        cont = await consume(engine, "cont", prompts[0] + tokens[:split], greedy(24 - split),
                             cache_salt="fresh")
        assert cont.num_cached_tokens == 0
        assert tokens[split:] == cont.outputs[0].token_ids
        assert_no_leaks(engine)

    run_engine(llama, body)


def test_no_prefix_hit_on_kv_computed_before_a_weight_update(llama, prompts, original_weights):
    """keep with clear_cache=False: a request holds a partly filled block across the update.
    That block fills after the update and enters the prefix cache, yet its first tokens' KV came
    from the old weights; a new request must not be served that KV."""
    prompt = prompts[0]   # 13 tokens: block 0 (32 tokens) is still partly filled at the update

    async def body(engine: AsyncLLM):
        checks: list[asyncio.Task] = []

        async def update():
            await engine.pause_generation(mode="keep", clear_cache=False)
            # The precondition: request 0 holds block 0 only partly filled, across the update.
            assert core_request(engine, "0").num_computed_tokens < 32
            await engine.update_weights(perturbed(original_weights))
            await engine.resume_generation()

        trigger = start_when(1, "0", update, checks)
        first = await consume(engine, "0", prompt, greedy(30), on_output=trigger)
        await checks[0]
        follow_up = prompt + first.outputs[0].token_ids[:24]   # 37 tokens: block 0 is whole
        fresh = await consume(engine, "fresh", follow_up, greedy(16), cache_salt="fresh")
        assert fresh.num_cached_tokens == 0
        shared = await consume(engine, "shared", follow_up, greedy(16))
        assert shared.outputs[0].token_ids == fresh.outputs[0].token_ids, \
            f"served KV from the old weights ({shared.num_cached_tokens} cached tokens)"
        assert shared.num_cached_tokens == 0, "a prefix computed with the old weights was hit"
        assert_no_leaks(engine)

    run_engine(llama, body, block_size=32)


@pytest.mark.parametrize("bad", ["unknown_name", "wrong_shape"])
def test_failed_update_leaves_weights_untouched(llama, reference, long_prompt, original_weights, bad):
    """An update with an unknown name or a wrong shape in it is refused as a whole: the tensors
    before the bad one are not applied, so served output, prefix cache and weight_version stay
    consistent with one another."""
    ref = reference(llama)
    expected = ref.greedy(long_prompt, 16)
    bad_entry = {"unknown_name": ("model.layers.0.mlp.no_such_proj.weight", torch.zeros(3)),
                 "wrong_shape": (K_PROJ, torch.zeros(3, 3))}[bad]

    async def body(engine: AsyncLLM):
        await consume(engine, "warm", long_prompt, greedy(16))
        with pytest.raises(ValueError):
            await engine.update_weights([(DOWN_PROJ, original_weights[DOWN_PROJ] * 4.0), bad_entry])
        assert await engine.get_weight_version() == 0
        out = await consume(engine, "after", long_prompt, greedy(16))
        assert out.num_cached_tokens == prefix_hit(long_prompt)   # nothing changed, so the cache is still good
        assert out.outputs[0].token_ids == expected, "part of a refused update was applied"
        fresh = await consume(engine, "fresh", long_prompt, greedy(16), cache_salt="x")
        assert fresh.outputs[0].token_ids == expected, "part of a refused update was applied"
        assert_no_leaks(engine)

    run_engine(llama, body)


@pytest.mark.parametrize("change", ["update_weights", "load_weights"])
def test_a_change_that_fails_after_copying_ends_the_engine(llama, long_prompt, original_weights,
                                                           monkeypatch, change):
    """A change that fails once its tensors are copied in (re-packing or recapturing graphs:
    an out-of-memory on a GPU, injected here) left the model holding part of it, under the
    old identity: a prompt cached before it was served from the old weights' KV (a helper's
    find). Such an engine now serves nothing more; a change refused before its first copy
    still leaves everything as it was (test_failed_update_leaves_weights_untouched)."""
    from treadle.models.llama import LlamaForCausalLM

    async def body(engine: AsyncLLM):
        await consume(engine, "warm", long_prompt, greedy(8))   # its KV in the prefix cache

        def failing(self):
            raise RuntimeError("CUDA out of memory (injected)")

        monkeypatch.setattr(LlamaForCausalLM, "pack_weights", failing)
        with pytest.raises(EngineDeadError, match="changed in part.*injected"):
            if change == "update_weights":
                await engine.update_weights([(DOWN_PROJ, original_weights[DOWN_PROJ] * 4.0)])
            else:
                await engine.load_weights(llama)
        with pytest.raises(EngineDeadError):
            await consume(engine, "after", long_prompt, greedy(8))

    run_engine(llama, body)


def test_weights_moved_to_host_by_sleep_are_not_changed_there(llama, prompts, original_weights):
    """On a GPU, sleep(level=1) moves the weights to host memory; changed there, they would
    be packed for the CPU and come back without their device copies. The device is the CPU
    here, told that it offloads."""
    new = [(DOWN_PROJ, original_weights[DOWN_PROJ] * 2.0)]

    async def body(engine: AsyncLLM):
        await engine.collective_rpc(lambda w: setattr(w.runner.on_device, "offloads_weights", True))
        await engine.sleep(level=1)
        for change in (engine.update_weights(new), engine.load_weights(llama)):
            with pytest.raises(RuntimeError, match=r"call wake_up\(tags=\['weights'\]\) before"):
                await change
        await engine.wake_up(tags=["weights"])
        await engine.update_weights(new)
        await engine.wake_up()
        out = await consume(engine, "p", prompts[0], greedy(16))
        assert out.outputs[0].token_ids == HFReference(llama, new).greedy(prompts[0], 16)
        assert_no_leaks(engine)

    run_engine(llama, body)


def test_load_weights_restores(llama, reference, prompts, original_weights):
    ref = reference(llama)

    async def body(engine: AsyncLLM):
        await engine.update_weights(perturbed(original_weights))
        out = await consume(engine, "p", prompts[0], greedy(16))
        assert out.outputs[0].token_ids != ref.greedy(prompts[0], 16)
        assert await engine.load_weights(llama) == len(original_weights)
        assert await engine.get_weight_version() == 2
        out = await consume(engine, "r", prompts[0], greedy(16))
        assert out.outputs[0].token_ids == ref.greedy(prompts[0], 16)
        assert out.weight_version == 2
        assert await engine.load_weights(llama, weight_version="ckpt") == len(original_weights)
        assert await engine.get_weight_version() == "ckpt"
        assert_no_leaks(engine)

    run_engine(llama, body)


# -- sleep / wake_up ---------------------------------------------------------------------

def test_sleep_level1_wake_up_identical(llama, reference, prompts):
    ref = reference(llama)

    async def body(engine: AsyncLLM):
        before = await consume(engine, "before", prompts[1], greedy(16))
        await engine.sleep(level=1)
        assert engine.core.asleep
        # A request made while asleep waits for the wake-up.
        late = asyncio.create_task(consume(engine, "late", prompts[2], greedy(16)))
        await asyncio.sleep(0.1)
        assert not late.done()
        await engine.wake_up()
        assert not engine.core.asleep
        after = await consume(engine, "after", prompts[1], greedy(16))
        assert after.outputs[0].token_ids == before.outputs[0].token_ids == ref.greedy(prompts[1], 16)
        assert (await late).outputs[0].token_ids == ref.greedy(prompts[2], 16)
        # The KV cache was dropped, and the prefix cache with it.
        assert after.num_cached_tokens == 0
        # Waking by parts: nothing runs until both are back.
        await engine.sleep(level=1)
        await engine.wake_up(tags=["weights"])
        assert engine.core.asleep == {"kv_cache"}
        await engine.wake_up(tags=["kv_cache"])
        out = await consume(engine, "parts", prompts[0], greedy(16))
        assert out.outputs[0].token_ids == ref.greedy(prompts[0], 16)
        with pytest.raises(ValueError):
            await engine.wake_up(tags=["gpu"])
        assert_no_leaks(engine)

    run_engine(llama, body)


@pytest.mark.parametrize("reload", ["load_weights", "update_weights"])
def test_sleep_level2_needs_reload(llama, reference, prompts, original_weights, reload):
    ref = reference(llama)

    async def body(engine: AsyncLLM):
        await engine.sleep(level=2)
        with pytest.raises(RuntimeError):
            await engine.wake_up()
        with pytest.raises(RuntimeError):   # still: a failed wake-up changes nothing
            await engine.wake_up()
        if reload == "load_weights":
            await engine.load_weights(llama)
        else:
            with pytest.raises(ValueError):   # a subset cannot bring the weights back
                await engine.update_weights([(DOWN_PROJ, original_weights[DOWN_PROJ])])
            await engine.update_weights(original_weights.items())
        await engine.wake_up()
        out = await consume(engine, "r", prompts[0], greedy(16))
        assert out.outputs[0].token_ids == ref.greedy(prompts[0], 16)
        assert_no_leaks(engine)

    run_engine(llama, body)


def test_sleep_while_kept_then_wake_resumes_token_exact(llama, reference, prompts):
    """Asleep with requests kept: their KV goes with the cache; after wake_up and resume they
    recompute and finish exactly."""
    ref = reference(llama)

    async def body(engine: AsyncLLM):
        checks: list[asyncio.Task] = []

        async def nap():
            await engine.pause_generation(mode="keep", clear_cache=False)
            await engine.sleep(level=1)
            await engine.wake_up()
            await engine.resume_generation()

        trigger = start_when(3, "0", nap, checks)
        finals = await asyncio.gather(*(consume(engine, str(i), p, on_output=trigger)
                                        for i, p in enumerate(prompts[:2])))
        await checks[0]
        for p, final in zip(prompts, finals):
            assert final.outputs[0].token_ids == ref.greedy(p, MAX_TOKENS)
        assert engine.core.scheduler.num_preemptions > 0
        assert_no_leaks(engine)

    run_engine(llama, body)


def test_pause_wait_while_asleep_with_kept_requests_does_not_hang(llama, prompts):
    """pause(mode="wait") cannot finish requests while the engine sleeps; it must say so
    (EngineCore.pause raises RuntimeError) rather than wait forever."""

    async def body(engine: AsyncLLM):
        checks: list[asyncio.Task] = []

        async def keep_and_sleep():
            await engine.pause_generation(mode="keep")
            await engine.sleep(level=1)

        trigger = start_when(2, "0", keep_and_sleep, checks)
        gen = asyncio.create_task(consume(engine, "0", prompts[0], on_output=trigger))
        while not checks:
            await asyncio.sleep(0.01)
        await checks[0]
        try:
            with pytest.raises(RuntimeError):   # today: TimeoutError, it waits forever
                await asyncio.wait_for(engine.pause_generation(mode="wait"), timeout=3)
        finally:
            await engine.wake_up()
            await engine.resume_generation()
        assert (await gen).outputs[0].finish_reason == "length"

    run_engine(llama, body)


def test_cancelled_pause_wait_leaves_engine_usable(llama, reference, prompts):
    """A pause(mode="wait") given up on (a timeout, a cancelled task) must not break the engine
    once the requests it waited for are done."""
    ref = reference(llama)

    async def body(engine: AsyncLLM):
        running = await started(engine, "long", prompts[0], greedy(100))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(engine.pause_generation(mode="wait"), timeout=0.01)
        await engine.resume_generation()
        assert not await engine.is_paused()
        final = await running
        assert final.outputs[0].token_ids == ref.greedy(prompts[0], 100)
        await asyncio.sleep(0.05)
        out = await asyncio.wait_for(consume(engine, "next", prompts[1], greedy(8)), timeout=10)
        assert out.outputs[0].token_ids == ref.greedy(prompts[1], 8)
        assert_no_leaks(engine)

    run_engine(llama, body)


# -- collective_rpc ----------------------------------------------------------------------

def test_collective_rpc(llama):
    async def body(engine: AsyncLLM):
        assert await engine.collective_rpc(lambda w: w.runner.num_blocks) == [256]
        assert await engine.collective_rpc("determine_num_blocks") == [256]
        assert await engine.collective_rpc(lambda w, a, b=0: a + b, args=(1,), kwargs={"b": 2}) == [3]

    run_engine(llama, body)
    run_engine(llama, body, async_scheduling=True)


# -- streaming details ---------------------------------------------------------------------

def test_delta_outputs_concatenate_to_cumulative(llama, reference, prompts):
    ref = reference(llama)
    delta = greedy(24)
    delta.output_kind = RequestOutputKind.DELTA

    async def body(engine: AsyncLLM):
        cumulative, (pieces, texts, n_outputs) = await asyncio.gather(
            consume(engine, "cum", prompts[0], greedy(24)),
            collect_deltas(engine, prompts[0], delta))
        assert n_outputs > 1
        assert pieces == cumulative.outputs[0].token_ids == ref.greedy(prompts[0], 24)
        assert "".join(texts) == cumulative.outputs[0].text
        assert_no_leaks(engine)

    async def collect_deltas(engine, ids, params):
        pieces, texts, n = [], [], 0
        async for out in engine.generate({"prompt_token_ids": ids}, params, "delta"):
            pieces += out.outputs[0].token_ids
            texts.append(out.outputs[0].text)
            n += 1
        assert out.finished and out.outputs[0].finish_reason == "length"
        return pieces, texts, n

    run_engine(llama, body, async_scheduling=True)


def test_delta_stream_with_n_samples_loses_nothing(llama, prompts):
    params = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=16, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    cumulative = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=16, ignore_eos=True)

    async def body(engine: AsyncLLM):
        pieces: dict[int, list[int]] = {0: [], 1: [], 2: []}
        finished: set[int] = set()
        async for out in engine.generate({"prompt_token_ids": prompts[0]}, params, "d"):
            for c in out.outputs:
                pieces[c.index] += c.token_ids
                if c.finish_reason is not None:
                    finished.add(c.index)
        full = await consume(engine, "c", prompts[0], cumulative)
        assert finished == {0, 1, 2}
        assert [pieces[i] for i in range(3)] == [c.token_ids for c in full.outputs]
        assert all(len(p) == 16 for p in pieces.values())

    run_engine(llama, body, async_scheduling=True)


def test_request_id_like_another_requests_sample_id_is_its_own(llama, reference, prompts):
    async def body(engine: AsyncLLM):
        params = SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=40, ignore_eos=True)
        running = await started(engine, "x", prompts[0], params)   # x, two samples
        other = await consume(engine, "0_x", prompts[1])
        assert other.outputs[0].token_ids == reference(llama).greedy(prompts[1], MAX_TOKENS)
        out = await running
        assert [c.finish_reason for c in out.outputs] == ["length", "length"]
        assert_no_leaks(engine)

    run_engine(llama, body)


@pytest.mark.parametrize("how", ["reset_prefix_cache", "pause_keep", "pause_wait"])
def test_an_id_reused_after_a_drain_gets_only_its_own_tokens(llama, reference, prompts, how):
    """A drain (a cache reset with running requests, a pause) holds the step in flight's
    outputs until the next step. A request aborted then, and a new one under its id before that
    step, must not take the old one's held outputs: outputs go out by id (a helper's hunt; the
    new request got the old one's first token, or all of them and a finish)."""
    from treadle.config import EngineArgs
    from treadle.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(model=llama, async_scheduling=True))
    engine.add_request("r", {"prompt_token_ids": prompts[0]}, greedy(30))
    for _ in range(4):
        engine.step()
    if how == "reset_prefix_cache":
        assert engine.reset_prefix_cache(reset_running_requests=True)
    else:
        engine.core.pause(how.removeprefix("pause_"), clear_cache=False)
    assert engine.core._pending, "the drained step's outputs wait for the next step"
    engine.abort_request("r")
    engine.add_request("r", {"prompt_token_ids": prompts[1]}, greedy(8))
    engine.core.resume()
    final = [out for _ in range(100) if engine.has_unfinished_requests()
             for out in engine.step() if out.finished]
    assert [out.outputs[0].token_ids for out in final] == [reference(llama).greedy(prompts[1], 8)]
    engine.core.scheduler.kv_cache.assert_no_leaks()


def test_aborted_delta_stream_ends_with_only_what_is_new(llama, reference, prompts):
    # Room for many steps after the abort is sent, so it lands before the request finishes.
    delta = greedy(200)
    delta.output_kind = RequestOutputKind.DELTA

    async def body(engine: AsyncLLM):
        pieces, finals, aborts = [], [], []
        async for out in engine.generate({"prompt_token_ids": prompts[0]}, delta, "d"):
            pieces += out.outputs[0].token_ids
            finals.append(out.outputs[0].finish_reason)
            if len(pieces) >= 5 and not aborts:
                aborts.append(asyncio.create_task(engine.abort("d")))
        await aborts[0]
        assert finals[-1] == "abort" and all(f is None for f in finals[:-1])
        # The abort's output carries no token twice: the pieces are the stream's tokens once.
        assert len(pieces) < 200
        assert pieces == reference(llama).greedy(prompts[0], len(pieces))
        assert_no_leaks(engine)

    run_engine(llama, body, async_scheduling=True)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_one_request(llama, reference, prompts, async_scheduling):
    ref = reference(llama)

    async def body(engine: AsyncLLM):
        aborts: list[asyncio.Task] = []
        trigger = start_when(3, "a", lambda: engine.abort("a"), aborts)
        a, b = await asyncio.gather(consume(engine, "a", prompts[0], on_output=trigger),
                                    consume(engine, "b", prompts[1]))
        await aborts[0]
        assert a.outputs[0].finish_reason == "abort"
        n = len(a.outputs[0].token_ids)
        assert 3 <= n < MAX_TOKENS
        assert a.outputs[0].token_ids == ref.greedy(prompts[0], MAX_TOKENS)[:n]
        assert b.outputs[0].finish_reason == "length"
        assert b.outputs[0].token_ids == ref.greedy(prompts[1], MAX_TOKENS)
        await engine.abort("no-such-request")   # unknown ids are ignored
        await engine.reset_prefix_cache()
        assert_no_leaks(engine)

    run_engine(llama, body, async_scheduling=async_scheduling)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_closing_stream_early_frees_blocks(llama, prompts, async_scheduling):
    async def body(engine: AsyncLLM):
        gen = engine.generate({"prompt_token_ids": prompts[2]}, greedy(), "closed")
        async for out in gen:
            if len(out.outputs[0].token_ids) >= 3:
                break
        assert engine.core.scheduler.kv_cache.req_to_blocks   # still held: nothing closed it yet
        await gen.aclose()
        assert not engine.output_processor.requests
        await engine.reset_prefix_cache()   # a barrier: runs on the engine thread after the abort
        assert not engine.core.scheduler.requests
        assert_no_leaks(engine)
        # The id is free again.
        out = await consume(engine, "closed", prompts[2], greedy(4))
        assert len(out.outputs[0].token_ids) == 4

    run_engine(llama, body, async_scheduling=async_scheduling)


# -- the offline LLM ---------------------------------------------------------------------

def test_llm_rl_controls(llama, reference, long_prompt, original_weights):
    ref = reference(llama)
    expected = ref.greedy(long_prompt, 16)
    llm = LLM(llama, block_size=16, num_kv_blocks=256)
    kv = llm.engine.core.scheduler.kv_cache

    def run():
        out = llm.generate({"prompt_token_ids": long_prompt}, greedy(16), use_tqdm=False)[0]
        return out.outputs[0].token_ids, out.num_cached_tokens, out.weight_version

    assert run() == (expected, 0, 0)
    assert run() == (expected, prefix_hit(long_prompt), 0)
    assert llm.reset_prefix_cache() is True
    assert run() == (expected, 0, 0)

    assert llm.update_weights(perturbed(original_weights), weight_version="v2") == 2
    assert llm.get_weight_version() == "v2"
    tokens, cached, version = run()
    assert tokens != expected and (cached, version) == (0, "v2")
    assert llm.update_weights(original_weights.items(), weight_version=7) == len(original_weights)
    assert run() == (expected, 0, 7)
    llm.update_weights(perturbed(original_weights))
    assert llm.get_weight_version() == 8
    assert llm.load_weights(llama) == len(original_weights)
    assert llm.get_weight_version() == 9
    assert run() == (expected, 0, 9)

    llm.sleep(level=1)
    llm.wake_up()
    assert run() == (expected, 0, 9)
    llm.sleep(level=2)
    with pytest.raises(RuntimeError):
        llm.wake_up()
    llm.load_weights(llama)
    llm.wake_up()
    assert run()[0] == expected

    assert llm.collective_rpc(lambda w: w.runner.num_blocks) == [256]
    assert llm.collective_rpc("determine_num_blocks") == [256]
    kv.assert_no_leaks()


def test_llm_generate_while_asleep_does_not_spin(llama, prompts):
    """Offline generate with the engine asleep can never progress; it must raise instead of
    looping forever. (step() is capped here so that a regression fails instead of hanging.)"""
    llm = LLM(llama, block_size=16, num_kv_blocks=256)
    llm.sleep(level=1)
    step, calls = llm.engine.step, [0]

    def capped_step():
        calls[0] += 1
        if calls[0] > 10_000:
            raise AssertionError("LLM.generate spins forever while the engine sleeps")
        return step()

    llm.engine.step = capped_step
    with pytest.raises(RuntimeError):
        llm.generate({"prompt_token_ids": prompts[0]}, greedy(4), use_tqdm=False)


def test_an_unlabelled_change_counts_up_an_int_label_only():
    """After a label of true, an unlabelled change was labelled 2 (a bool is an int)."""
    assert ServedWeights(label=3).transferred("digest", None).label == 4
    assert ServedWeights(label=True).transferred("digest", None).label is None
    assert ServedWeights(label="v1").transferred("digest", None).label is None


def test_outputs_held_across_a_weight_change_keep_their_weights_label(llama, reference, prompts,
                                                                      original_weights):
    """LLMEngine stepped by hand: a pause drains the step in flight, and its tokens wait for
    the next step(). They were made by the weights served then, and say so, even where the
    weights changed before that step (they took the later label)."""
    llm = LLM(llama, async_scheduling=True, block_size=16)
    engine, core = llm.engine, llm.engine.core
    params = greedy()
    params.output_kind = RequestOutputKind.DELTA
    engine.add_request("r", {"prompt_token_ids": prompts[0]}, params)
    tokens, labels = [], []

    def step() -> None:
        for out in engine.step():
            tokens.extend(out.outputs[0].token_ids)
            labels.extend([out.weight_version] * len(out.outputs[0].token_ids))

    while len(tokens) < 3:
        step()
    assert core.batch_queue   # a step in flight: the pause drains it
    core.pause(mode="keep", clear_cache=False)
    old = len(tokens) + 1   # the step drained holds one token for r
    core.update_weights(perturbed(original_weights), weight_version="new")
    core.resume()
    while engine.has_unfinished_requests():
        step()
    assert labels[:old] == [0] * old and set(labels[old:]) == {"new"}
    assert tokens[:old] == reference(llama).greedy(prompts[0], old)
    llm.engine.core.drain()
    llm.engine.core.scheduler.kv_cache.assert_no_leaks()


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_a_pause_given_up_while_the_core_pauses_leaves_it_as_it_says(llama, reference, prompts,
                                                                     mode, monkeypatch):
    """A pause_generation that times out (or is cancelled) while the engine thread already
    pauses (draining a long step): the core's pause still happens. AsyncLLM once went back to
    "not paused" while the core stayed paused, and no request ran again, with nothing to say
    why, until a resume."""
    ref = reference(llama)

    original = EngineCore.pause

    def slow_pause(core, *args, **kwargs):
        time.sleep(0.5)   # stands in for a drain waiting on a long step in flight
        return original(core, *args, **kwargs)

    # AsyncLLM calls the core's methods by name, through the class.
    monkeypatch.setattr(EngineCore, "pause", slow_pause)

    async def body(engine: AsyncLLM):
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(engine.pause_generation(mode=mode), timeout=0.2)
        await asyncio.sleep(0.6)   # the core's pause is done by now, and undone
        assert not await engine.is_paused() and not engine.core.paused
        out = await asyncio.wait_for(consume(engine, "next", prompts[1], greedy(8)), timeout=30)
        assert out.outputs[0].token_ids == ref.greedy(prompts[1], 8)
        assert_no_leaks(engine)

    run_engine(llama, body)


def test_sleep_is_refused_while_requests_wait_to_run_unpaused(llama, reference, prompts):
    """pause(keep, clear_cache) puts every request back in the waiting queue; a pause("wait")
    then lets them run again. A sleep at that moment passed its check (none was running yet),
    and the engine fell asleep under the pause("wait"), which never returned."""
    ref = reference(llama)

    async def body(engine: AsyncLLM):
        running = await started(engine, "r", prompts[0], greedy(200))
        await engine.pause_generation(mode="keep", clear_cache=True)
        wait = asyncio.create_task(engine.pause_generation(mode="wait"))
        await asyncio.sleep(0)   # pause("wait") lets the kept request run again
        with pytest.raises(RuntimeError, match="sleep needs a paused or idle engine"):
            await engine.sleep(1)
        await asyncio.wait_for(wait, timeout=60)
        final = await running
        assert final.outputs[0].token_ids == ref.greedy(prompts[0], 200)
        await engine.resume_generation()
        assert_no_leaks(engine)

    run_engine(llama, body)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("before", ["reset_running_requests", "pause_wait_after_keep"])
def test_weight_change_refused_while_requests_wait_to_run_unpaused(llama, reference, prompts,
                                                                   before, async_scheduling):
    """A weight change with requests that have produced tokens waiting to run, none running,
    the engine unpaused: reset_prefix_cache(reset_running_requests=True), or pause("wait")
    letting requests kept by pause("keep", clear_cache=True) run again. The check looked at
    running requests alone, so a change queued right behind either went through (over HTTP, a
    reset and an /update_weights_from_disk sent together: 200 in 4 of 10 tries, each stream
    carrying tokens of both weight versions). Both calls run as one on the engine thread, as
    they do queued back to back, so that no step comes between them."""
    ref = reference(llama)

    async def body(engine):
        tasks = [await started(engine, str(i), p, greedy(MAX_TOKENS * 3))
                 for i, p in enumerate(prompts[:2])]
        if before == "pause_wait_after_keep":
            await engine.pause_generation(mode="keep", clear_cache=True)

        def then_change(core):
            if before == "reset_running_requests":
                assert core.reset_prefix_cache(reset_running_requests=True)
            else:   # what pause("wait") does first: kept requests may run again
                core.prepare_to_finish_requests()
            assert not core.paused and core.has_unfinished_requests()
            try:
                core.load_weights(llama, "changed unpaused")
            except RuntimeError as e:
                return str(e)
            return None

        refusal = await engine._call(then_change)
        finals = await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
        assert refusal is not None and "paused or idle" in refusal, (
            "a weight change went through while requests that had produced tokens were "
            f"waiting to run, unpaused; weight_version now {await engine.get_weight_version()!r}")
        for p, final in zip(prompts, finals):
            assert final.outputs[0].token_ids == ref.greedy(p, MAX_TOKENS * 3)
            assert final.weight_version == 0
        await engine.resume_generation()
        assert_no_leaks(engine)

    run_engine(llama, body, async_scheduling=async_scheduling)


def test_an_abort_cuts_a_waiting_pause_short(llama, prompts):
    """pause("abort") while a pause("wait") waits for the requests: it queued behind it and
    returned only once they had all run to max_tokens (over HTTP, nothing can cancel the first
    /pause?mode=wait), so a trainer could not turn a drain into an abort."""
    async def body(engine: AsyncLLM):
        long = await started(engine, "long", prompts[0], greedy(900))
        wait = asyncio.create_task(engine.pause_generation(mode="wait"))
        await asyncio.sleep(0.1)
        await asyncio.wait_for(engine.pause_generation(mode="abort"), timeout=10)
        assert (await long).outputs[0].finish_reason == "abort"
        await wait
        await engine.resume_generation()
        assert_no_leaks(engine)

    run_engine(llama, body)
