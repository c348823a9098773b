"""Sampler rules on small hand-made logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from treadle.sampling_params import SamplingParams
from treadle.worker.sampler import Sampler, SamplingRow, apply_logit_bias

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
    s = Sampler(torch.device("cpu"))
    logits = torch.tensor([base])
    s._apply_penalties(logits[0], row(prompt=[0], output=[1, 1, 2], repetition_penalty=2.0))
    # Seen tokens (prompt 0, output 1 and 2): positive logits halve, negative ones double.
    assert logits[0].tolist() == [0.5, -2.0, 1.0, 0.5, 0, 0, 0, 0]
    logits = torch.tensor([base])
    s._apply_penalties(logits[0], row(prompt=[0], output=[1, 1, 2], frequency_penalty=0.5,
                                      presence_penalty=0.25))
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
