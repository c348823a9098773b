"""SamplingParams: defaults, normalisation, and every validation rule naming its field."""

from __future__ import annotations

import math

import numpy as np
import pytest

from treadle.sampling_params import RequestOutputKind, SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens) == (16, 0)
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.skip_special_tokens and p.spaces_between_special_tokens
    assert p.output_kind is RequestOutputKind.CUMULATIVE


# -- normalisation ------------------------------------------------------------------------------
def test_top_k_minus_one_means_disabled():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=0).top_k == 0
    assert SamplingParams(top_k=40).top_k == 40


@pytest.mark.parametrize("stop, expected", [
    (None, []), ("###", ["###"]), (["a", "bc"], ["a", "bc"]), (("a",), ["a"]),
])
def test_stop_becomes_a_list(stop, expected):
    assert SamplingParams(stop=stop).stop == expected


@pytest.mark.parametrize("ids, expected", [(None, []), ([2, 0], [2, 0]), ((7,), [7])])
def test_stop_token_ids_become_a_list(ids, expected):
    assert SamplingParams(stop_token_ids=ids).stop_token_ids == expected


def test_lists_are_copied_not_shared():
    stop, ids = ["x"], [3]
    p = SamplingParams(stop=stop, stop_token_ids=ids)
    stop.append("y")
    ids.append(4)
    assert p.stop == ["x"] and p.stop_token_ids == [3]


@pytest.mark.parametrize("kind, expected", [
    ("cumulative", RequestOutputKind.CUMULATIVE), ("delta", RequestOutputKind.DELTA),
    ("final_only", RequestOutputKind.FINAL_ONLY), ("DELTA", RequestOutputKind.DELTA),
    (RequestOutputKind.FINAL_ONLY, RequestOutputKind.FINAL_ONLY),
])
def test_output_kind_accepts_strings(kind, expected):
    assert SamplingParams(output_kind=kind).output_kind is expected


def test_numpy_numbers_become_python_numbers():
    p = SamplingParams(n=np.int64(2), max_tokens=np.int32(5), temperature=np.float32(0.5),
                       stop_token_ids=[np.int64(7)], seed=np.int64(3))
    assert type(p.n) is int and type(p.max_tokens) is int and type(p.seed) is int
    assert type(p.temperature) is float and type(p.stop_token_ids[0]) is int


def test_int_given_for_a_float_field_is_fine():
    p = SamplingParams(temperature=0, top_p=1, repetition_penalty=2)
    assert p.temperature == 0.0 and isinstance(p.temperature, float)


# -- validation: (kwargs, field named in the message) -------------------------------------------
BAD = [
    ({"temperature": -1}, "temperature must be >= 0 and at most 3.4e\\+38 \\(float32's largest\\), got -1"),
    ({"temperature": -0.01}, "temperature"),
    ({"temperature": math.inf}, "temperature must be >= 0 and at most 3.4e"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": "0.5"}, "temperature"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": -0.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\]"),
    ({"frequency_penalty": math.nan}, "frequency_penalty"),
    ({"repetition_penalty": 0}, r"repetition_penalty must be > 0, in \[1e-06, 1e\+06\], got 0"),
    ({"repetition_penalty": 1e-30}, "repetition_penalty must be > 0, in"),
    ({"repetition_penalty": 1e7}, "repetition_penalty"),
    ({"temperature": 1e39}, r"temperature must be >= 0 and at most 3.4e\+38 \(float32's largest\)"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": math.inf}, "repetition_penalty must be > 0, in"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1 or None, got 0"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 16.0}, r"max_tokens .*\(float\)"),
    ({"max_tokens": True}, r"max_tokens .*\(bool\)"),
    ({"min_tokens": -1}, "min_tokens must be an integer >= 0"),
    ({"min_tokens": 20}, r"min_tokens must be <= max_tokens \(16\), got 20"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"min_tokens": 1.5}, "min_tokens"),
    ({"n": 0}, "n must be an integer >= 1, got 0"),
    ({"n": True}, r"n must be an integer >= 1, got True \(bool\)"),
    ({"n": 2.0}, "n must"),
    ({"logprobs": -1}, "logprobs must be an integer >= 0 or None"),
    ({"logprobs": 1.0}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs must be an integer >= 0 or None"),
    ({"prompt_logprobs": False}, "prompt_logprobs"),
    ({"seed": 1.5}, "seed must be an integer or None"),
    ({"seed": "42"}, "seed"),
    ({"bad_words": ["fine", "half \ud800"]}, "bad_words: 'half \\\\ud800' is not valid Unicode text"),
    ({"stop": ""}, "stop must hold non-empty strings"),
    ({"stop": ["ok", ""]}, "stop must hold non-empty strings"),
    ({"stop": ["ok", 3]}, "stop must hold non-empty strings"),
    ({"stop": 5}, "stop must be a string, a list of strings or None"),
    ({"stop_token_ids": [-1]}, "stop_token_ids must hold integers >= 0"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": 2}, "stop_token_ids must be a list"),
    ({"ignore_eos": 1}, "ignore_eos must be a bool"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output must be a bool"),
    ({"skip_special_tokens": None}, "skip_special_tokens must be a bool"),
    ({"spaces_between_special_tokens": 0}, "spaces_between_special_tokens must be a bool"),
    ({"output_kind": "streaming"}, "output_kind must be .*cumulative, delta, final_only"),
    ({"output_kind": 1}, "output_kind"),
    ({"logit_bias": [1, 2]}, r"logit_bias must be a dict of token id -> bias in \[-100, 100\]"),
    ({"logit_bias": {"abc": 1}}, r"logit_bias keys must be token ids \(integers >= 0\), got 'abc'"),
    ({"logit_bias": {-3: 1}}, r"logit_bias keys must be token ids \(integers >= 0\), got -3"),
    ({"logit_bias": {1.0: 1}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {"5": 100.5}}, r"logit_bias\['5'\] must be in \[-100, 100\], got 100.5"),
    ({"logit_bias": {5: -101}}, r"logit_bias\[5\] must be in \[-100, 100\], got -101"),
    ({"logit_bias": {5: math.nan}}, r"logit_bias\[5\] must be in \[-100, 100\]"),
    ({"logit_bias": {5: "1"}}, r"logit_bias\[5\] must be in \[-100, 100\], got '1' \(str\)"),
    ({"logit_bias": {5: 1, "5": 2}}, "logit_bias names token 5 twice"),
]


@pytest.mark.parametrize("kwargs, message", BAD, ids=[str(k) for k, _ in BAD])
def test_invalid_values_raise_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


GOOD = [
    {"temperature": 0.0}, {"temperature": 1e-6}, {"temperature": 5.0},
    {"top_p": 1.0}, {"top_p": 1e-9}, {"top_k": 1}, {"min_p": 0.0}, {"min_p": 1.0},
    {"presence_penalty": -2.0}, {"presence_penalty": 2.0}, {"frequency_penalty": -2},
    {"repetition_penalty": 1e-3}, {"repetition_penalty": 2.0}, {"repetition_penalty": 3.0},
    {"max_tokens": None}, {"max_tokens": 1}, {"min_tokens": 16}, {"max_tokens": None, "min_tokens": 1000},
    {"n": 8}, {"logprobs": 0}, {"prompt_logprobs": 0}, {"logprobs": 20},
    {"seed": 0}, {"seed": -7}, {"seed": 2**62}, {"stop": ["\n"]}, {"stop_token_ids": [0]},
    {"logit_bias": {0: -100, 7: 100.0}}, {"logit_bias": {}},
]


@pytest.mark.parametrize("kwargs", GOOD, ids=[str(k) for k in GOOD])
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


# -- derived properties -------------------------------------------------------------------------
def test_greedy_and_sampling_type():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=5e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy
    assert SamplingParams(temperature=0, seed=3).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=0.7).sampling_type is SamplingType.RANDOM
    assert SamplingParams(temperature=0.7, seed=3).sampling_type is SamplingType.RANDOM_SEED


def test_max_stop_len():
    assert SamplingParams().max_stop_len == 0
    assert SamplingParams(stop=["a", "abcd", "xy"]).max_stop_len == 4


def test_clone_is_deep_and_equal():
    p = SamplingParams(temperature=0.3, stop=["x"], stop_token_ids=[5], output_kind="delta")
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("y")
    q.stop_token_ids.append(6)
    q.output_kind = RequestOutputKind.FINAL_ONLY
    assert p.stop == ["x"] and p.stop_token_ids == [5] and p.output_kind is RequestOutputKind.DELTA


def test_logit_bias_keys_become_ints():
    """JSON object keys are strings: "12" is token 12, as in OpenAI's API; an empty dict is off."""
    assert SamplingParams(logit_bias={"12": 3, 4: -1.5}).logit_bias == {12: 3.0, 4: -1.5}
    assert SamplingParams(logit_bias={np.int64(3): np.float32(2)}).logit_bias == {3: 2.0}
    assert SamplingParams(logit_bias={}).logit_bias is None
