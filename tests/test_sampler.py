"""Sampler rules on small hand-made logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from treadle.core.scheduler_output import TokenLogprobs
from treadle.sampling_params import SamplingParams
from treadle.worker.sampler import (Sampler, SamplingRow, apply_logit_bias, apply_penalties,
                                    batched_logprobs)

V = 8


def row(prompt=(), output=(), eos=None, seed=0, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), seed, np.array(prompt, dtype=np.int64),
                       np.array(output, dtype=np.int64), eos)


def sample(logits, *rows):
    tokens, lps = Sampler(torch.device("cpu"))(torch.tensor(logits, dtype=torch.float32), list(rows))
    return tokens, lps


def test_greedy_takes_the_argmax():
    tokens, _ = sample([[0, 1, 5, 2, 0, 0, 0, 0], [9, 1, 0, 0, 0, 0, 0, 0]],
                       row(temperature=0), row(temperature=0))
    assert tokens == [2, 0]


def test_bf16_logits_give_what_their_fp32_widening_gives():
    """Rows that only take the argmax read bf16 logits as they are; min_tokens, penalties and
    logprobs work on the fp32 widening. Mixed in any batch, the answers are the fp32 ones."""
    torch.manual_seed(0)
    logits = torch.randn(4, 300).to(torch.bfloat16)
    logits[0, 7] = logits[0, 9] = 100.0   # a tie: the first index wins
    logits[2, 5] = logits[2].max() + 1    # a lead that the penalty below takes away
    rows = [row(temperature=0),
            row(temperature=0, eos=int(logits[1].argmax()), min_tokens=3, output=[1]),
            row(temperature=0, output=[5, 5], frequency_penalty=2.0),
            row(temperature=0, logprobs=2)]
    s = Sampler(torch.device("cpu"))
    assert s(logits[:1], rows[:1])[0] == [7]
    for batch in ([0], [1], [2], [0, 3], [0, 1, 2, 3]):
        got = s(logits[batch], [rows[i] for i in batch])
        assert got == s(logits[batch].float(), [rows[i] for i in batch])
    # min_tokens and the penalty moved rows 1 and 2 off their argmax
    assert s(logits[1:3], rows[1:3])[0] != logits[1:3].float().argmax(dim=-1).tolist()


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    logits = [[0, 0, 9, 8, 1, 0, 0, 0]]
    assert sample(logits, row(temperature=0, eos=2, min_tokens=2, stop_token_ids=[3], output=[5]))[0] == [4]
    assert sample(logits, row(temperature=0, eos=2, min_tokens=2, output=[5, 5]))[0] == [2]


def test_penalties_follow_the_openai_and_ctrl_rules():
    base = [1.0, -1.0, 2.0, 0.5, 0, 0, 0, 0]
    logits = torch.tensor([base])
    apply_penalties(logits, [row(prompt=[0], output=[1, 1, 2], repetition_penalty=2.0)])
    # Seen tokens (prompt 0, output 1 and 2): positive logits halve, negative ones double.
    assert logits[0].tolist() == [0.5, -2.0, 1.0, 0.5, 0, 0, 0, 0]
    logits = torch.tensor([base])
    apply_penalties(logits, [row(prompt=[0], output=[1, 1, 2], frequency_penalty=0.5,
                                 presence_penalty=0.25)])
    # Output counts only: token 1 twice, token 2 once; the prompt is not penalised.
    assert logits[0].tolist() == pytest.approx([1.0, -1.0 - 1.0 - 0.25, 2.0 - 0.5 - 0.25, 0.5, 0, 0, 0, 0])


def test_top_k_top_p_min_p_restrict_the_support():
    logits = [[4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0]]
    for seed in range(30):
        assert sample(logits, row(temperature=1.0, top_k=2, seed=seed))[0][0] in (0, 1)
        # p(0) ~ 0.64, p(1) ~ 0.24: top_p 0.7 keeps exactly those two.
        assert sample(logits, row(temperature=1.0, top_p=0.7, seed=seed))[0][0] in (0, 1)
        # min_p 0.3 keeps tokens with p >= 0.3 * p_max: tokens 0 and 1 (0.24 / 0.64 = 0.37).
        assert sample(logits, row(temperature=1.0, min_p=0.3, seed=seed))[0][0] in (0, 1)


def test_sampling_matches_the_softmax_distribution():
    logits = torch.tensor([1.0, 0.0, 2.0, -1.0, 0.5, 0.0, -2.0, 1.5])
    counts = np.zeros(V)
    n = 4000
    tokens, _ = Sampler(torch.device("cpu"))(logits.repeat(n, 1), [row(temperature=1.0, seed=s) for s in range(n)])
    for t in tokens:
        counts[t] += 1
    expected = torch.softmax(logits, -1).numpy() * n
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 24.3, (counts, expected)   # chi-square, 7 dof, p = 0.001


def test_seeded_draw_depends_only_on_seed_and_position():
    logits = [[0.1] * V]
    a = [sample(logits, row(temperature=1.0, seed=5, output=[1] * k))[0][0] for k in range(20)]
    b = [sample(logits * 2, row(temperature=1.0, seed=5, output=[1] * k),
                row(temperature=1.0, seed=9))[0][0] for k in range(20)]
    assert a == b
    assert len(set(a)) > 1


def test_logprobs_report_rank_and_top_tokens():
    logits = [[3.0, 1.0, 2.0, 0.0, 0, 0, 0, 0]]
    _, lps = sample(logits, row(temperature=0, logprobs=2))
    ref = torch.log_softmax(torch.tensor(logits[0]), -1)
    assert lps[0].token_ids == [0, 0, 2] and lps[0].rank == 1
    assert lps[0].logprobs == pytest.approx([ref[0].item(), ref[0].item(), ref[2].item()])


def test_logit_bias_is_added_per_row_before_penalties():
    """One index_put_ over the batch: each row gets its own biases, rows without none."""
    logits = torch.zeros(3, V)
    rows = [row(logit_bias={1: 2.5, 4: -1.0}), row(), row(logit_bias={"7": 100})]
    apply_logit_bias(logits, rows)
    expected = torch.zeros(3, V)
    expected[0, 1], expected[0, 4], expected[2, 7] = 2.5, -1.0, 100.0
    assert torch.equal(logits, expected)
    # Greedy: a bias forces a token, -100 forbids the argmax.
    base = [[0, 1, 5, 2, 0, 0, 0, 0]] * 3
    tokens, _ = sample(base, row(temperature=0, logit_bias={6: 10}),
                       row(temperature=0, logit_bias={2: -100}), row(temperature=0))
    assert tokens == [6, 3, 2]
    # vLLM's order: the bias, then the repetition penalty (a positive logit is divided).
    got, _ = sample([[0, 0, 0, 2.5, 0, 0, 0, 0]],
                    row(temperature=0, output=[6], repetition_penalty=2.0, logit_bias={6: 3.5}))
    assert got == [3]   # 3.5 / 2 < 2.5; penalising first would leave token 6 at 0 + 3.5


def test_logit_bias_reaches_sampled_rows_and_keeps_raw_logprobs():
    logits = [[5.0, 0, 0, 0, 0, 0, 0, 0]]
    for seed in range(10):
        assert sample(logits, row(temperature=1.0, seed=seed, logit_bias={0: -100}))[0][0] != 0
    tokens, lps = sample(logits, row(temperature=0, logprobs=1, logit_bias={3: 50}))
    assert tokens == [3]
    raw = torch.log_softmax(torch.tensor(logits[0]), dim=-1)
    assert lps[0].logprobs[0] == pytest.approx(float(raw[3]))   # as vLLM's raw_logprobs


def test_seeded_sampling_over_positions_matches_the_softmax_distribution():
    """One seed, its first 4,000 output positions: what decoding one request draws."""
    logits = torch.tensor([1.0, 0.0, 2.0, -1.0, 0.5, 0.0, -2.0, 1.5])
    n = 4000
    rows = [SamplingRow(SamplingParams(temperature=1.0), 1234, np.zeros(1, dtype=np.int64),
                        np.broadcast_to(np.int64(0), (k,)), None) for k in range(n)]
    tokens, _ = Sampler(torch.device("cpu"))(logits.repeat(n, 1), rows)
    counts = np.bincount(tokens, minlength=V)
    expected = torch.softmax(logits, -1).numpy() * n
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 24.3, (counts, expected)   # chi-square, 7 dof, p = 0.001


def test_a_seeded_row_samples_the_same_whatever_its_batch_and_row():
    """Each row alone, then all together in shuffled orders beside unseeded, greedy and
    penalised company: the same tokens and the same logprobs."""
    torch.manual_seed(0)
    vocab = 300
    logits = torch.randn(6, vocab) * 3
    rows = [row(temperature=0.8, top_p=0.9, seed=1, output=[3, 4]),
            row(temperature=1.0, top_k=20, seed=2, logprobs=3),
            row(temperature=1.3, min_p=0.05, seed=3, output=[7] * 5, presence_penalty=0.5),
            row(temperature=0, logprobs=1, prompt=[1, 2], repetition_penalty=1.2),
            row(temperature=0.7, seed=5, output=[9], min_tokens=4, eos=int(logits[4].argmax())),
            row(temperature=1.0, seed=6, logit_bias={10: 2.0}, frequency_penalty=0.3, output=[10])]
    s = Sampler(torch.device("cpu"))
    alone = [s(logits[i:i + 1].clone(), [rows[i]]) for i in range(len(rows))]
    alone_tokens = [a[0][0] for a in alone]
    alone_lps = [a[1][0] for a in alone]
    rng = np.random.default_rng(0)
    for _ in range(5):
        order = rng.permutation(len(rows)).tolist()
        tokens, lps = s(logits[order].clone(), [rows[i] for i in order])
        assert tokens == [alone_tokens[i] for i in order]
        assert lps == [alone_lps[i] for i in order]
    # Moving the row to another output position moves its draw.
    later = [s(logits[:1].clone(), [row(temperature=1.0, seed=1, output=[0] * k)])[0][0]
             for k in range(30)]
    assert len(set(later)) > 1


def test_penalties_on_a_batch_equal_them_one_row_at_a_time():
    torch.manual_seed(1)
    vocab = 50
    rows = [row(prompt=[1, 2, 3, 40], output=[5, 5, 6], repetition_penalty=1.5),
            row(output=[7], frequency_penalty=0.7),
            row(),   # no penalty: untouched
            row(prompt=list(range(30)), output=[], repetition_penalty=0.8, presence_penalty=-0.4),
            row(output=[1, 1, 1, 49, 2, 2], frequency_penalty=-1.0, presence_penalty=1.5)]
    logits = torch.randn(len(rows), vocab)
    batched = logits.clone()
    apply_penalties(batched, rows)
    for i, r in enumerate(rows):
        one = logits[i:i + 1].clone()
        apply_penalties(one, [r])
        assert torch.equal(batched[i], one[0]), i
    assert torch.equal(batched[2], logits[2])


def test_min_tokens_bans_per_row_in_one_batch():
    logits = torch.tensor([[0, 0, 9, 8, 1, 0, 0, 0]] * 3, dtype=torch.float32)
    tokens, _ = Sampler(torch.device("cpu"))(logits, [
        row(temperature=0, eos=2, min_tokens=2, stop_token_ids=[3], output=[5]),
        row(temperature=0, eos=2, min_tokens=2, output=[5, 5]),           # reached
        row(temperature=0, eos=2, min_tokens=3, ignore_eos=True, output=[])])
    assert tokens == [4, 2, 2]


def test_logprobs_of_a_batch_are_each_rows_own():
    """Rows asking for none, zero, one or three top logprobs, greedy and sampled: each gets the
    chosen token's raw logprob and rank, then its own top-n."""
    torch.manual_seed(2)
    logits = torch.randn(5, 40)
    nums = [None, 0, 1, 3, 2]
    rows = [row(temperature=0 if i % 2 else 1.0, seed=i, logprobs=n) for i, n in enumerate(nums)]
    tokens, lps = Sampler(torch.device("cpu"))(logits.clone(), rows)
    raw = torch.log_softmax(logits, dim=-1)
    assert lps[0] is None
    for i in range(1, 5):
        chosen, n = raw[i, tokens[i]], nums[i]
        top = raw[i].topk(n) if n else None
        assert lps[i].token_ids == [tokens[i]] + (top.indices.tolist() if n else [])
        assert lps[i].logprobs == [float(chosen)] + (top.values.tolist() if n else [])
        assert lps[i].rank == int((raw[i] > chosen).sum()) + 1


def test_sample_keeps_its_results_on_the_device():
    """`Sampler.sample` returns tensors; `__call__` is the same results as lists."""
    logits = torch.randn(3, 20)
    rows = [row(temperature=1.0, seed=4, logprobs=2), row(temperature=0),
            row(temperature=0.5, seed=8)]
    s = Sampler(torch.device("cpu"))
    out = s.sample(logits.clone(), rows)
    assert out.token_ids.dtype == torch.long and out.token_ids.shape == (3,)
    assert out.logprobs is not None and out.logprob_rows == [0]
    assert out.to_lists() == s(logits.clone(), rows)


def test_greedy_rows_take_the_argmax_without_an_fp32_copy(monkeypatch):
    logits = torch.randn(4, 64).to(torch.bfloat16)
    expected = logits.float().argmax(dim=-1).tolist()

    def no_copy(self, *args, **kwargs):
        raise AssertionError("greedy rows widened to fp32")

    monkeypatch.setattr(torch.Tensor, "float", no_copy)
    assert Sampler(torch.device("cpu"))(logits, [row(temperature=0)] * 4)[0] == expected


def token_logprobs(logprobs: torch.Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    """One row's logprobs the plain way: the reference for the batched form."""
    chosen = logprobs[token_id]
    rank = int((logprobs > chosen).sum().item()) + 1
    ids, values = [token_id], [float(chosen)]
    if num_top > 0:
        top_vals, top_ids = logprobs.topk(num_top)
        ids += top_ids.tolist()
        values += top_vals.tolist()
    return TokenLogprobs(token_ids=ids, logprobs=values, rank=rank)


def test_prompt_logprobs_in_one_batch_equal_them_row_by_row():
    torch.manual_seed(3)
    lps = torch.log_softmax(torch.randn(7, 100) * 2, dim=-1)
    targets = [3, 99, 0, 50, 50, 7, 12]
    for num_top in (0, 1, 4):
        batch = batched_logprobs(lps, torch.tensor(targets), [num_top] * len(targets))
        assert batch.to_lists() == [token_logprobs(lps[j], t, num_top) for j, t in enumerate(targets)]
    # Rows keeping different numbers of top tokens, as requests asking for different ones do.
    tops = [0, 3, 1, 5, 0, 2, 4]
    assert batched_logprobs(lps, torch.tensor(targets), tops).to_lists() == [
        token_logprobs(lps[j], t, n) for j, (t, n) in enumerate(zip(targets, tops))]


def test_a_step_of_plain_argmax_slots_skips_its_rows_and_samples_the_same(monkeypatch):
    """`Sampler.sample_slots` takes the argmax without building rows exactly where every row
    would be a plain argmax (`RequestSlots.argmax_from`: greedy, nothing that edits or reads
    the logits, min_tokens reached), and gives what `sample` over the rows gives, every time."""
    from treadle.core.scheduler_output import NewRequestData
    from treadle.worker import sampler as sampler_module
    from treadle.worker.request_state import RequestSlots

    tenants = [SamplingParams(temperature=0), SamplingParams(temperature=0, min_tokens=3),
               SamplingParams(temperature=0, logprobs=1), SamplingParams(temperature=0.7),
               SamplingParams(temperature=0, repetition_penalty=1.2),
               SamplingParams(temperature=0, logit_bias={3: 5.0}),
               SamplingParams(temperature=0, allowed_token_ids=[1, 2]),
               SamplingParams(temperature=0), SamplingParams(temperature=0)]
    slots = RequestSlots(len(tenants), 32, 4)
    for i, params in enumerate(tenants):
        if i == 7:   # as the engine sets it from `bad_words`
            params.bad_words_token_ids = [[4]]
        slots.add(NewRequestData(f"r{i}", [5, 6, 7, 1], 3, params, [[1]], 0, generator_seed=i, eos_token_id=2))
    built = []
    rows_of = sampler_module.sampling_rows
    monkeypatch.setattr(sampler_module, "sampling_rows", lambda *a: built.append(1) or rows_of(*a))
    s = Sampler(torch.device("cpu"))
    torch.manual_seed(1)
    logits = torch.randn(len(tenants), V)
    for batch in ([0], [0, 8], [1], [0, 1], [2], [3], [4], [5], [6], [7], list(range(len(tenants)))):
        ids = np.array(batch)
        built.clear()
        fast = s.sample_slots(logits[batch].clone(), slots, ids).to_lists()
        plain = all(sampler_module._argmax_only(r) for r in rows_of(slots, ids))
        assert (not built) == plain == (batch in ([0], [0, 8])), batch
        assert fast == s(logits[batch].clone(), rows_of(slots, ids)), batch
    # Slot 1's min_tokens (3) is reached at its third output token: from then on, plain.
    slots.append_tokens(np.array([1]), np.array([2]), [6, 6])
    built.clear()
    s.sample_slots(logits[[0, 1]].clone(), slots, np.array([0, 1]))
    assert not built


def test_append_tokens_writes_each_slots_tokens_after_its_own():
    from treadle.core.scheduler_output import NewRequestData
    from treadle.worker.request_state import RequestSlots

    slots = RequestSlots(3, 16, 2)
    for i, n in enumerate((2, 5, 3)):
        slots.add(NewRequestData(f"r{i}", list(range(10 * i, 10 * i + n)), n,
                                 SamplingParams(), [[1]], 0, generator_seed=0))
    slots.append_tokens(np.array([2, 0]), np.array([3, 1]), [7, 8, 9, 4])
    assert slots.num_tokens.tolist() == [3, 5, 6]
    assert slots.token_ids[2, :7].tolist() == [20, 21, 22, 7, 8, 9, 0]
    assert slots.token_ids[0, :4].tolist() == [0, 1, 4, 0]
    assert slots.token_ids[1, :6].tolist() == [10, 11, 12, 13, 14, 0]
