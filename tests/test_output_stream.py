"""A request's outputs merge while their consumer is busy (engine/output_stream.py), and nothing
is lost or reordered by it: unit cases on built outputs, then AsyncLLM with a consumer that
lags, against transformers."""

from __future__ import annotations

import asyncio

from tests.test_rl_controls import assert_no_leaks, greedy, prompts, run_engine  # noqa: F401
from treadle import RequestOutputKind, SamplingParams
from treadle.engine.errors import EngineDeadError
from treadle.engine.output_stream import OutputStream
from treadle.engine.weights import ServedWeights
from treadle.outputs import CompletionOutput, Logprob, RequestOutput


WEIGHTS = ServedWeights()


def output(samples: list[CompletionOutput], finished: bool = False,
           prompt_logprobs=None) -> RequestOutput:
    return RequestOutput(request_id="r", prompt="p", prompt_token_ids=[1, 2], outputs=samples,
                         finished=finished, prompt_logprobs=prompt_logprobs)


def sample(index: int, text: str, ids: list[int], finish: str | None = None,
           logprobs: bool = False) -> CompletionOutput:
    lps = [{t: Logprob(-0.5 * t)} for t in ids] if logprobs else None
    return CompletionOutput(index=index, text=text, token_ids=ids, logprobs=lps,
                            finish_reason=finish)


def drain(stream: OutputStream) -> list:
    async def take():
        got = [await stream.get()]
        while stream._items:
            got.append(await stream.get())
        return got
    return asyncio.run(take())


def test_cumulative_outputs_merge_to_the_latest():
    stream = OutputStream(RequestOutputKind.CUMULATIVE)
    outs = [output([sample(0, "a" * k, list(range(k)))], finished=k == 3) for k in (1, 2, 3)]
    for out in outs:
        stream.put(out, WEIGHTS)
    assert len(stream._items) == 1   # a consumer that stops reading holds one output
    assert drain(stream) == [outs[-1]]


def test_delta_outputs_merge_sample_by_sample():
    stream = OutputStream(RequestOutputKind.DELTA)
    prompt_lps = [None, {2: Logprob(-1.0)}]
    stream.put(output([sample(0, "he", [5], logprobs=True), sample(1, "x", [9], logprobs=True)],
                      prompt_logprobs=prompt_lps), WEIGHTS)
    stream.put(output([sample(1, "y", [8], finish="length", logprobs=True)]), WEIGHTS)
    stream.put(output([sample(0, "llo", [6, 7], finish="stop", logprobs=True)], finished=True),
               WEIGHTS)
    [merged] = drain(stream)
    assert merged.finished and merged.prompt_logprobs == prompt_lps
    first, second = merged.outputs
    assert (first.index, first.text, first.token_ids, first.finish_reason) == (0, "hello", [5, 6, 7], "stop")
    assert (second.index, second.text, second.token_ids, second.finish_reason) == (1, "xy", [9, 8], "length")
    assert [list(lp) for lp in first.logprobs] == [[5], [6], [7]]
    assert [list(lp) for lp in second.logprobs] == [[9], [8]]


def test_many_delta_outputs_merge_as_they_arrive():
    # One output held however many arrive; its lists grow in place, its text joins once.
    stream = OutputStream(RequestOutputKind.DELTA)
    for t in range(5000):
        stream.put(output([sample(0, "ab", [t, t + 1])]), WEIGHTS)
    assert len(stream._items) == 1
    [merged] = drain(stream)
    assert merged.outputs[0].text == "ab" * 5000
    assert merged.outputs[0].token_ids == [i for t in range(5000) for i in (t, t + 1)]


def test_outputs_of_different_weights_stay_apart_whatever_their_labels():
    # A trainer reads which weights made which tokens: a merge never crosses a weight update,
    # even one that kept the label (labels are the user's, and repeat).
    stream = OutputStream(RequestOutputKind.DELTA)
    first, second = ServedWeights(), ServedWeights().transferred("digest", 0)
    assert first.label == second.label == 0
    for weights, ids in ((first, [3]), (first, [4]), (second, [5]), (second, [6])):
        stream.put(output([sample(0, str(ids[0]), ids)]), weights)
    got = drain(stream)
    assert [o.outputs[0].token_ids for o in got] == [[3, 4], [5, 6]]


def test_an_error_comes_after_the_outputs_queued_before_it():
    stream = OutputStream(RequestOutputKind.DELTA)
    stream.put(output([sample(0, "a", [3])]), WEIGHTS)
    stream.put(output([sample(0, "b", [4])]), WEIGHTS)
    stream.put(EngineDeadError("gone"))
    first, error = drain(stream)
    assert first.outputs[0].token_ids == [3, 4] and isinstance(error, EngineDeadError)


def test_a_waiting_consumer_wakes_for_the_next_output():
    async def body():
        stream = OutputStream(RequestOutputKind.DELTA)
        waiter = asyncio.create_task(stream.get())
        await asyncio.sleep(0.01)
        assert not waiter.done()
        stream.put(output([sample(0, "a", [3])]), WEIGHTS)
        return await asyncio.wait_for(waiter, 1.0)

    assert asyncio.run(body()).outputs[0].token_ids == [3]


def test_a_lagging_consumer_gets_every_token_in_fewer_outputs(llama, reference, prompts):  # noqa: F811
    ref = reference(llama)
    n_params = SamplingParams(n=2, temperature=0.8, seed=11, max_tokens=24, ignore_eos=True,
                              logprobs=1, output_kind=RequestOutputKind.DELTA)

    async def lagging(engine, rid, ids, params):
        outs = []
        async for out in engine.generate({"prompt_token_ids": ids}, params, rid):
            outs.append(out)
            await asyncio.sleep(0.05)   # the engine steps on meanwhile
        return outs

    async def body(engine):
        greedy_outs, delta_outs = await asyncio.gather(
            lagging(engine, "g", prompts[0], greedy(24)),
            lagging(engine, "d", prompts[1], n_params))
        # Cumulative: the last output holds the whole greedy sequence, as transformers makes it.
        assert len(greedy_outs) < 24 and greedy_outs[-1].finished
        assert greedy_outs[-1].outputs[0].token_ids == ref.greedy(prompts[0], 24)
        # Delta: each sample's pieces, joined, are what an unhurried consumer gets.
        pieces = {0: [], 1: []}
        logprob_counts = {0: 0, 1: 0}
        for out in delta_outs:
            for c in out.outputs:
                pieces[c.index] += c.token_ids
                logprob_counts[c.index] += len(c.logprobs)
        assert len(delta_outs) < 24 and delta_outs[-1].finished
        whole = []
        async for out in engine.generate({"prompt_token_ids": prompts[1]},
                                         SamplingParams(n=2, temperature=0.8, seed=11,
                                                        max_tokens=24, ignore_eos=True), "c"):
            whole = [c.token_ids for c in out.outputs]
        assert [pieces[0], pieces[1]] == whole and logprob_counts == {0: 24, 1: 24}
        assert_no_leaks(engine)

    run_engine(llama, body)


def test_a_stream_that_waits_across_a_weight_update_gets_two_outputs(llama, reference, prompts,  # noqa: F811
                                                                     original_weights):
    """Paused in keep mode with the consumer not reading, the weights updated under the same
    label (0, the first weights' too), then resumed: the outputs before and after stay apart."""
    ref = reference(llama)
    params = greedy(200)
    params.output_kind = RequestOutputKind.DELTA

    async def body(engine):
        gen = engine.generate({"prompt_token_ids": prompts[0]}, params, "r")
        first = await anext(gen)
        while not engine._streams["r"]._items:   # made by the first weights, not read yet
            await asyncio.sleep(0.001)
        await engine.pause_generation(mode="keep", clear_cache=False)
        assert await engine.update_weights(original_weights.items(), weight_version=0)
        await engine.resume_generation()
        while not engine.core.is_idle():   # the request runs to its end, unread
            await asyncio.sleep(0.01)
        rest = [out async for out in gen]
        assert len(rest) == 2 and rest[-1].finished
        assert {o.weight_version for o in rest} == {0}
        ids = [t for out in (first, *rest) for t in out.outputs[0].token_ids]
        assert ids == ref.greedy(prompts[0], 200)   # the same tensors: the same tokens
        assert_no_leaks(engine)

    run_engine(llama, body)
