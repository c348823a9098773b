"""The offline API end to end on the embedded model: inputs, outputs, sampling, errors."""

from __future__ import annotations

import pytest
import torch

from treadle import LLM, SamplingParams
from treadle.config import EngineArgs, default_block_size


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(smollm2_path)


def no_leaks(llm: LLM) -> None:
    llm.engine.core.scheduler.kv_cache.assert_no_leaks()
    assert not llm.engine.output_processor.requests


def test_prompt_forms_and_input_order(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("The capital of France is")
    params = SamplingParams(temperature=0, max_tokens=6)
    outs = llm.generate(["The capital of France is", {"prompt": "The capital of France is"},
                         {"prompt_token_ids": ids}, "1, 2, 3,"], params, use_tqdm=False)
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert outs[0].prompt == "The capital of France is" and outs[2].prompt is None
    assert outs[2].prompt_token_ids == ids
    assert outs[3].outputs[0].text != outs[0].outputs[0].text
    for o in outs:
        c = o.outputs[0]
        assert o.finished and c.finish_reason in ("stop", "length") and c.index == 0
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    no_leaks(llm)


def test_chat_uses_the_template_and_stops_at_eos(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    c = out.outputs[0]
    assert "Paris" in c.text
    assert c.finish_reason == "stop" and c.stop_reason is None   # EOS
    assert c.token_ids[-1] == llm.get_tokenizer().eos_token_id
    assert "<|im_end|>" not in c.text
    no_leaks(llm)


def test_chat_template_kwargs_reach_the_template(llm):
    """vLLM's LLM.chat(chat_template_kwargs=...): variables the template reads; chat()'s own
    arguments are refused, not passed twice."""
    template = "{{ greeting }}{% for m in messages %} {{ m['content'] }}{% endfor %}:"
    ask = [{"role": "user", "content": "one two"}]
    params = SamplingParams(temperature=0, max_tokens=1)
    out = llm.chat(ask, params, use_tqdm=False, chat_template=template,
                   chat_template_kwargs={"greeting": "Counting"})[0]
    assert out.prompt == "Counting one two:"
    with pytest.raises(ValueError, match=r"chat_template_kwargs must not set \['tokenize'\]"):
        llm.chat(ask, params, chat_template_kwargs={"tokenize": True})


def test_stop_strings_truncate_text(llm):
    base = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert " 6," in base.outputs[0].text, base.outputs[0].text
    out = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=12, stop=[" 6"]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == " 6"
    assert out.text == base.outputs[0].text.split(" 6")[0]
    kept = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=12, stop=[" 6"],
                                                      include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == out.text + " 6"
    no_leaks(llm)


def test_stop_token_ids_and_min_tokens(llm):
    tok = llm.get_tokenizer()
    base = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=8),
                        use_tqdm=False)[0].outputs[0]
    stop_id = base.token_ids[2]
    out = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    first = base.token_ids.index(stop_id)
    assert out.token_ids == base.token_ids[:first + 1] and out.stop_reason == stop_id
    # min_tokens bans EOS until reached: the chat reply runs past its natural end.
    params = SamplingParams(temperature=0, max_tokens=30, min_tokens=25)
    c = llm.chat([{"role": "user", "content": "Say hi."}], params, use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) >= 25
    assert tok.eos_token_id not in c.token_ids[:24]


def test_logprobs_and_prompt_logprobs(llm, smollm2_path, reference):
    tok = llm.get_tokenizer()
    ids = tok.encode("The quick brown fox jumps over the lazy dog")
    out = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2),
                       use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 5
    for tid, entry in zip(c.token_ids, c.logprobs):
        assert tid in entry and entry[tid].rank == 1          # greedy picks the top token
        assert 3 <= len(entry) <= 4
        assert all(lp.logprob <= 0 for lp in entry.values())
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    expected = reference(smollm2_path).prompt_logprobs(ids)
    got = torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    assert torch.allclose(got, expected, atol=1e-4), (got, expected)
    no_leaks(llm)


def test_a_delivered_output_keeps_its_prompt_logprobs(llama):
    """Streamed outputs during a chunked prefill: each keeps the prompt logprobs it had when
    delivered, as it keeps its tokens, while later chunks fill in the request's own list (a
    helper's hunt: the output processor handed out that list itself)."""
    from treadle.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(model=llama, max_num_batched_tokens=8))
    engine.add_request("r", {"prompt_token_ids": list(range(1000, 1030))},   # 4 chunks
                       SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                                      prompt_logprobs=0))
    delivered = []
    while engine.has_unfinished_requests():
        delivered += [(out, list(out.prompt_logprobs)) for out in engine.step()]
    assert None in delivered[0][1][1:], "the first output came before the prompt was scored"
    assert all(out.prompt_logprobs == snapshot for out, snapshot in delivered)


def test_n_samples_share_the_prompt_and_differ(llm):
    params = SamplingParams(temperature=1.0, max_tokens=8, n=4, seed=7)
    out = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    no_leaks(llm)


def test_seeded_sampling_is_independent_of_the_batch(llm):
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=12, seed=1234)
    alone = llm.generate("Tell me a story about a dragon", params, use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate(
        ["Hello there", "Tell me a story about a dragon", "def add(a, b):"],
        [SamplingParams(temperature=1.0, max_tokens=20), params,
         SamplingParams(temperature=0.5, max_tokens=5, seed=3)], use_tqdm=False)
    assert crowd[1].outputs[0].token_ids == alone
    other_seed = llm.generate("Tell me a story about a dragon",
                              SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=12, seed=99),
                              use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone


def test_penalties_change_the_output(llm):
    prompt = "1, 2, 3, 1, 2, 3, 1, 2, 3,"
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    # (presence_penalty's exact effect is pinned in test_sampler; here it is too weak to bite.)
    for kwargs in ({"repetition_penalty": 1.8}, {"frequency_penalty": 2.0}):
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, **kwargs), use_tqdm=False)[0]
        assert out.outputs[0].token_ids != base.outputs[0].token_ids, kwargs


@pytest.mark.parametrize("bad, field", [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"min_p": 2.0}, "min_p"),
])
def test_invalid_sampling_params_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad)


def test_invalid_inputs_are_rejected_without_leaking(llm):
    vocab = llm.engine.config.model.vocab_size
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate({"prompt_token_ids": [1, vocab]}, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [5] * llm.engine.config.model.max_model_len}, use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate("hi", SamplingParams(logprobs=1000), use_tqdm=False)
    # A bad prompt among good ones adds none of them.
    with pytest.raises(ValueError):
        llm.generate(["fine", ""], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    with pytest.raises(TypeError, match="unknown engine arguments"):
        LLM(not_an_arg=1)
    with pytest.raises(ValueError, match="tokenized"):
        llm.generate("lone surrogate \ud800", use_tqdm=False)
    # A top_k past the vocabulary means "no top-k", not an overflow on the engine's thread.
    out = llm.generate("hi", SamplingParams(top_k=2**63 - 1, max_tokens=2, seed=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    no_leaks(llm)


def test_prompt_too_big_for_the_kv_cache_is_rejected(smollm2_path):
    small = LLM(smollm2_path, num_kv_blocks=4, block_size=16)
    # The cache holds 48 tokens; max_model_len, not set, is lowered to that.
    assert small.engine.config.model.max_model_len == 48
    with pytest.raises(ValueError, match="max_model_len"):
        small.generate({"prompt_token_ids": [5] * 60}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"max_tokens must be in \[1, 8\] for this prompt, got 100"):
        small.generate({"prompt_token_ids": [5] * 40}, SamplingParams(max_tokens=100), use_tqdm=False)
    out = small.generate({"prompt_token_ids": [5] * 40}, SamplingParams(max_tokens=8, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]   # exactly the room left
    assert out.finish_reason == "length" and len(out.token_ids) == 8
    no_leaks(small)
    # Set by the user, it is refused instead, naming both numbers (as vLLM does).
    with pytest.raises(ValueError, match=r"max_model_len \(2048\) is more than the KV cache can "
                                         r"hold \(48 tokens"):
        LLM(smollm2_path, num_kv_blocks=4, block_size=16, max_model_len=2048)


def test_max_tokens_past_the_context_names_the_numbers(llm):
    context = llm.engine.config.model.max_model_len
    for max_tokens in (context - 9, 10**12, 2**63, 2**80):
        with pytest.raises(ValueError, match=(
                rf"maximum context length is {context} tokens. However, you requested "
                rf"{10 + max_tokens} tokens \(10 in the messages, {max_tokens} in the completion\)"
                rf".*max_tokens must be in \[1, {context - 10}\]")):
            llm.generate({"prompt_token_ids": [5] * 10}, SamplingParams(max_tokens=max_tokens),
                         use_tqdm=False)
    no_leaks(llm)


def test_reset_prefix_cache(llm):
    llm.generate("Some prompt long enough to fill a block or two of the cache, surely. " * 12,
                 SamplingParams(max_tokens=2), use_tqdm=False)   # two blocks of 128
    assert llm.engine.core.scheduler.kv_cache.pool.hash_to_block
    assert llm.reset_prefix_cache() is True
    assert not llm.engine.core.scheduler.kv_cache.pool.hash_to_block


def test_max_tokens_none_runs_to_max_model_len(smollm2_path):
    small = LLM(smollm2_path, max_model_len=24)
    out = small.generate({"prompt_token_ids": [5] * 20}, SamplingParams(max_tokens=None, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_cache_salt_separates_prefix_caches(llm):
    text = "A prompt long enough to fill a couple of 128-token blocks in the prefix cache, " * 16
    params = SamplingParams(temperature=0, max_tokens=2)
    llm.reset_prefix_cache()
    first = llm.generate({"prompt": text, "cache_salt": "alice"}, params, use_tqdm=False)[0]
    other = llm.generate({"prompt": text, "cache_salt": "bob"}, params, use_tqdm=False)[0]
    same = llm.generate({"prompt": text, "cache_salt": "alice"}, params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and other.num_cached_tokens == 0
    assert same.num_cached_tokens >= 2 * llm.engine.core.scheduler.kv_cache.block_size
    assert first.outputs[0].token_ids == other.outputs[0].token_ids == same.outputs[0].token_ids
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt": text, "cache_salt": 3}, params, use_tqdm=False)
    no_leaks(llm)


def test_priority_policy_runs_urgent_requests_first(smollm2_path):
    prio = LLM(smollm2_path, scheduling_policy="priority", max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    order = []
    engine = prio.engine
    for rid, p in (("late", 5), ("urgent", 0), ("middle", 2)):
        engine.add_request(rid, "Hello", params, priority=p)
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["urgent", "middle", "late"]
    with pytest.raises(ValueError, match="priorities"):
        prio.generate(["a", "b"], params, priority=[1], use_tqdm=False)
    outs = prio.generate(["a", "b"], params, priority=[1, 0], use_tqdm=False)
    assert [o.prompt for o in outs] == ["a", "b"]


def test_an_id_like_another_requests_sample_is_its_own(llm):
    """Engine-core ids are the engine's (invariant 6): a client's "0_x" is not request x's
    first sample, and neither takes the other's tokens."""
    engine = llm.engine
    engine.add_request("x", "Hello", SamplingParams(n=2, max_tokens=2, temperature=0.8, seed=0))
    engine.add_request("0_x", "Hello", SamplingParams(max_tokens=3, temperature=0))
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    assert sorted(finals) == ["0_x", "x"]
    assert [len(c.token_ids) for c in finals["x"].outputs] == [2, 2]
    assert [len(c.token_ids) for c in finals["0_x"].outputs] == [3]
    no_leaks(llm)


def test_block_size_defaults_to_128_on_cpu_as_vllm(llm, tiny_checkpoints):
    assert llm.engine.config.cache.block_size == 128 == default_block_size("cpu")
    assert default_block_size("cuda") == 16
    assert EngineArgs(model=tiny_checkpoints["llama"], block_size=16).create_config().cache.block_size == 16
    for bad in (0, -16, 2.5):
        with pytest.raises(ValueError, match="block_size"):
            EngineArgs(model=tiny_checkpoints["llama"], block_size=bad).create_config()


def test_async_scheduling_defaults_to_on_for_cuda_only(llm, tiny_checkpoints):
    """None (the default) is on for one CUDA device with no drafts and no connector, where an
    H200 made 1.4x the output tokens with it, and off on CPUs, whose host and model share the
    cores; anything but a bool or None is refused."""
    from treadle.config import _async_scheduling

    assert llm.engine.config.scheduler.async_scheduling is False
    assert _async_scheduling(None, "cuda") and _async_scheduling(None, "cuda:1")
    assert not _async_scheduling(None, "cpu") and _async_scheduling(True, "cpu")
    assert not _async_scheduling(False, "cuda")
    # Not where it was not measured faster: drafts, a KV connector, more than one worker.
    assert not _async_scheduling(None, "cuda", measured=False) and _async_scheduling(True, "cuda", False)
    with pytest.raises(ValueError, match="async_scheduling must be true, false or None"):
        EngineArgs(model=tiny_checkpoints["llama"], async_scheduling="yes").create_config()


def test_cached_tokens_of_n_samples_are_the_prompts_once(tiny_checkpoints):
    """Usage counts an n > 1 request's prompt once, so its cached tokens are those of the sample
    that computed the prompt; the samples admitted after it find its blocks cached."""
    prompt = list(range(100, 180))   # 80 tokens: 5 blocks of 16, 64 tokens a hit can reach
    params = SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=4)
    with LLM(tiny_checkpoints["llama"], block_size=16, max_num_batched_tokens=32) as llm:
        first = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        again = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        no_leaks(llm)
    assert len(first.outputs) == 3 and first.num_cached_tokens == 0
    assert again.num_cached_tokens == 64


def test_chat_takes_what_vllms_llm_chat_takes(llm):
    """Content parts (joined as the server joins them), continue_final_message and tools."""
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    as_text = llm.chat([{"role": "user", "content": "Hi\nthere"}], params, use_tqdm=False)[0]
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                    {"type": "text", "text": "there"}]}],
                     params, use_tqdm=False)[0]
    assert parts.prompt_token_ids == as_text.prompt_token_ids
    with pytest.raises(ValueError, match="only text content parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], params,
                 use_tqdm=False)
    with pytest.raises(ValueError, match="a text content part needs its text as a string"):
        llm.chat([{"role": "user", "content": [{"type": "text", "text": 5}]}], params,
                 use_tqdm=False)
    out = llm.chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}],
                   params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert out[0].prompt.endswith("Hel")
    tools = [{"type": "function", "function": {"name": "lookup", "description": "Find a word",
                                               "parameters": {"type": "object"}}}]
    names = ("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
             "{% for m in messages %}{{ m.content }}{% endfor %}")
    with_tools = llm.chat([{"role": "user", "content": "Hi"}], params, use_tqdm=False,
                          tools=tools, chat_template=names)[0]
    assert with_tools.prompt == "[lookup]Hi"
