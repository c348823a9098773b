"""N-gram speculative decoding: the proposer's rules, output identical to plain decoding and to
transformers, acceptance statistics, and request slots that carry nothing between tenants."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.test_correctness import TEXTS, greedy, prompt_ids
from treadle import LLM, SamplingParams
from treadle.config import SpeculativeConfig
from treadle.worker.request_state import RequestSlots
from treadle.worker.sampler import Sampler, SamplingRow
from treadle.worker.spec_decode.ngram import NgramProposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


# -- the proposer ------------------------------------------------------------------------
def propose(tokens: list[int], min_n: int = 2, max_n: int = 4, k: int = 3) -> list[int]:
    return NgramProposer(min_n, max_n, k).propose(np.array(tokens))


def test_proposer_follows_the_matching_ngram():
    assert propose([1, 2, 3, 4, 1, 2, 3], min_n=2, max_n=2) == [4, 1, 2]


def test_proposer_prefers_the_longest_ngram():
    # The 2-gram [7, 8] first occurs before 1; the 3-gram [6, 7, 8] only before 2.
    assert propose([7, 8, 1, 6, 7, 8, 2, 9, 6, 7, 8], min_n=2, max_n=3, k=1) == [2]
    assert propose([7, 8, 1, 6, 7, 8, 2, 9, 6, 7, 8], min_n=2, max_n=2, k=1) == [1]


def test_proposer_takes_the_earliest_occurrence():
    assert propose([5, 6, 1, 5, 6, 2, 5, 6], min_n=2, max_n=2, k=1) == [1]


def test_proposer_without_a_match_proposes_nothing():
    assert propose([1, 2, 3, 4, 5]) == []
    assert propose([4]) == []
    assert propose([3, 3], min_n=2) == []   # the only 2-gram is the suffix itself


def test_proposer_stops_at_the_end_of_the_sequence():
    assert propose([1, 2, 9, 1, 2], min_n=2, max_n=2, k=5) == [9, 1, 2]


def test_proposer_on_a_batch_of_mixed_lengths():
    proposer = NgramProposer(2, 4, 2)
    batch = [np.array(t) for t in ([1, 2, 1], [1, 2, 3, 1, 2], list(range(50)) + [10, 11], [8, 9])]
    assert [proposer.propose(t) for t in batch] == [[], [3, 1], [12, 13], []]


@pytest.mark.parametrize("bad", [{"method": "eagle"}, {"num_speculative_tokens": 0},
                                 {"prompt_lookup_min": 5, "prompt_lookup_max": 2}, {"k": 3}, "{not json"])
def test_bad_speculative_config_is_a_clear_error(tiny_checkpoints, bad):
    with pytest.raises(ValueError, match="speculative_config|num_speculative_tokens|prompt_lookup"):
        LLM(tiny_checkpoints["llama"], speculative_config=bad)


# -- exactness on the real engine ---------------------------------------------------------
REPETITIVE = ("Copy the list exactly.\nList: apple, banana, cherry, apple, banana, cherry, apple, "
              "banana, cherry.\nCopy: apple, banana, cherry, apple,")


def run_greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(max_tokens), use_tqdm=False)
    llm.engine.core.scheduler.kv_cache.assert_no_leaks()
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("config", [{}, {"async_scheduling": True},
                                    {"block_size": 8, "num_kv_blocks": 12, "max_num_batched_tokens": 32}])
def test_tiny_models_spec_decode_match_transformers(tiny_checkpoints, reference, arch, config):
    path = tiny_checkpoints[arch]
    llm = LLM(path, speculative_config=NGRAM, **config)
    # A prompt that repeats itself gets drafts; the random-looking ones mostly none.
    prompts = prompt_ids(llm) + [[11, 12, 13, 14, 15] * 6]
    got = run_greedy(llm, prompts, 40)
    assert got == [reference(path).greedy(p, 40) for p in prompts]
    assert llm.engine.core.scheduler.spec_stats.num_drafts > 0


@pytest.fixture(scope="module")
def smollm2_spec(smollm2_path):
    return LLM(smollm2_path, speculative_config=NGRAM, max_num_batched_tokens=64)


def test_smollm2_spec_decode_is_token_exact_and_accepts_drafts(smollm2_spec, smollm2_path, reference):
    tok = smollm2_spec.get_tokenizer()
    prompts = [tok.encode(REPETITIVE), tok.encode(TEXTS[1]), tok.encode(TEXTS[3])]
    got = run_greedy(smollm2_spec, prompts, 32)
    ref = reference(smollm2_path)
    assert got == [ref.greedy(p, 32) for p in prompts]
    stats = smollm2_spec.get_stats().spec_decoding
    assert stats.num_accepted_tokens > 0 and stats.acceptance_rate > 0.3
    assert stats.accepted_per_position[0] >= stats.accepted_per_position[-1]


def test_a_request_can_turn_drafts_off(smollm2_spec, smollm2_path, reference):
    """extra_args["speculative_decoding"] = False (vLLM's vllm_xargs over HTTP): that request
    gets no drafts, and its output is the same."""
    prompt = smollm2_spec.get_tokenizer().encode(REPETITIVE)
    drafts = smollm2_spec.get_stats().spec_decoding.num_draft_tokens
    off = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                         extra_args={"speculative_decoding": False})
    out = smollm2_spec.generate([{"prompt_token_ids": prompt}], off, use_tqdm=False)[0]
    assert smollm2_spec.get_stats().spec_decoding.num_draft_tokens == drafts
    assert out.outputs[0].token_ids == reference(smollm2_path).greedy(prompt, 24)
    smollm2_spec.generate([{"prompt_token_ids": prompt}], greedy(24), use_tqdm=False)
    assert smollm2_spec.get_stats().spec_decoding.num_draft_tokens > drafts   # drafts on


def test_smollm2_spec_decode_under_preemption_and_async(smollm2_path, reference):
    llm = LLM(smollm2_path, speculative_config=NGRAM, async_scheduling=True,
              max_num_batched_tokens=32, block_size=16, num_kv_blocks=10, max_num_seqs=4)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(REPETITIVE)] + prompt_ids(llm)[:3]
    got = run_greedy(llm, prompts, 32)
    ref = reference(smollm2_path)
    assert got == [ref.greedy(p, 32) for p in prompts]
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert llm.engine.core.scheduler.spec_stats.num_accepted_tokens > 0


def test_stop_inside_accepted_drafts_truncates_there(tiny_checkpoints, reference):
    path = tiny_checkpoints["llama"]
    prompt = [11, 12, 13, 14, 15] * 6
    plain = reference(path).greedy(prompt, 30)
    stop_at = 7
    llm = LLM(path, speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[plain[stop_at]])
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    first = plain.index(plain[stop_at])
    assert out.token_ids == plain[:first + 1] and out.finish_reason == "stop"
    for max_tokens in (1, 2, 4, 7):
        out = llm.generate({"prompt_token_ids": prompt}, greedy(max_tokens), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == plain[:max_tokens] and out.finish_reason == "length"
    llm.engine.core.scheduler.kv_cache.assert_no_leaks()


def test_seeded_sampling_is_identical_with_and_without_drafts(tiny_checkpoints):
    path = tiny_checkpoints["qwen2"]
    prompts = [{"prompt_token_ids": [11, 12, 13, 14, 15] * 6}, {"prompt_token_ids": list(range(200, 230))}]
    params = [SamplingParams(temperature=0.7, top_p=0.95, max_tokens=30, seed=s, ignore_eos=True,
                             repetition_penalty=1.1) for s in (1, 2)]
    # Both prompts (60 tokens) fit one step of 128, as they did the default 2,048: the untied
    # head's GEMM (49,152 rows) is warmed only up to the budget at start-up.
    plain = LLM(path, max_num_batched_tokens=128).generate(prompts, params, use_tqdm=False)
    spec_llm = LLM(path, speculative_config=NGRAM, max_num_batched_tokens=128)
    spec = spec_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert spec_llm.engine.core.scheduler.spec_stats.num_drafts > 0


def test_verification_keeps_the_target_distribution():
    """Per position, a draft d survives with probability p(d), and the emitted token follows p:
    the law of rejection sampling against a one-hot draft. 4,000 seeds on a 5-token vocabulary."""
    p = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    logits = p.log()[None, :]
    sampler = Sampler(torch.device("cpu"))
    params = SamplingParams(temperature=1.0)
    draft, trials = 1, 4000
    counts = np.zeros(5)
    accepted = 0
    for seed in range(trials):
        row = SamplingRow(params, seed, np.array([0]), np.array([], dtype=np.int64), None)
        token = sampler(logits.clone(), [row])[0][0]
        counts[token] += 1
        accepted += token == draft
    expected = p.numpy() * trials
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.5, f"chi-square {chi2:.1f} over 4 degrees of freedom (p < 0.001)"
    assert abs(accepted / trials - float(p[draft])) < 0.03


# -- slots carry nothing from their previous tenant -------------------------------------
def run_reused_slots(llm: LLM) -> tuple[list[list[int]], list[list[int]]]:
    """A batch runs to completion so every slot holds stale state, then follow-ups arrive
    already partly computed (prefix-cache hits on the first turn) and take those slots."""
    tok = llm.get_tokenizer()
    first = [tok.encode(t) for t in TEXTS[:4]]
    outs = run_greedy(llm, first, 24)
    follow_ups = [p + o + tok.encode(" Again:") + p[:12] for p, o in zip(first, outs)]
    follow_ups = follow_ups[1:] + follow_ups[:1]   # each lands in another request's slot
    results = llm.generate([{"prompt_token_ids": p} for p in follow_ups], greedy(24), use_tqdm=False)
    assert all(r.num_cached_tokens > 0 for r in results), "follow-ups must arrive with KV present"
    llm.engine.core.scheduler.kv_cache.assert_no_leaks()
    return follow_ups, [r.outputs[0].token_ids for r in results]


@pytest.mark.parametrize("spec", [None, NGRAM])
def test_reused_slots_start_from_their_own_tokens(tiny_checkpoints, reference, spec, monkeypatch):
    path = tiny_checkpoints["llama"]
    ref = reference(path)
    prompts, got = run_reused_slots(LLM(path, block_size=16, speculative_config=spec))
    assert got == [ref.greedy(p, 24) for p in prompts]

    # RequestSlots.add as a buggy runner would write it: the computed prefix is copied, but the
    # tokens past it (the last sampled token a resumed request arrives with) stay the old
    # tenant's. The same run must then fail the comparison.
    real_add = RequestSlots.add

    def leaky_add(self: RequestSlots, new, step: int = 0) -> int:
        slot = self._free[-1]
        stale = self.token_ids[slot].copy()
        real_add(self, new, step)
        self.token_ids[slot, new.num_computed_tokens:len(new.token_ids)] = \
            stale[new.num_computed_tokens:len(new.token_ids)]
        return slot

    monkeypatch.setattr(RequestSlots, "add", leaky_add)
    prompts, got = run_reused_slots(LLM(path, block_size=16, speculative_config=spec))
    assert got != [ref.greedy(p, 24) for p in prompts]


@pytest.mark.parametrize("given, bounds", [({"prompt_lookup_max": 1}, (1, 1)),
                                           ({"prompt_lookup_min": 5}, (5, 5)), ({}, (2, 4))])
def test_one_ngram_bound_given_sets_the_other_as_vllm_does(given, bounds):
    """{"prompt_lookup_max": 1} was refused, naming a minimum of 2 the user never wrote."""
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, **given})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == bounds
