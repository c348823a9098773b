"""IncrementalDetokenizer: incremental text equals a full decode; stop strings; hold-back."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treadle.engine.detokenizer import IncrementalDetokenizer, rust_decode
from treadle.models.loader import load_tokenizer, prepare_model
from treadle.sampling_params import SamplingParams

FFFD = "\ufffd"
PROPERTY = settings(max_examples=50, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tok():
    """The embedded SmolLM2 tokenizer (byte-level BPE), from the converted model folder."""
    return load_tokenizer(prepare_model(None))


@pytest.fixture(scope="module")
def ordinary_ids(tok) -> range:
    """Ids of ordinary (non-special) tokens: SmolLM2's 17 special tokens come first."""
    special = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    assert special == set(range(17))
    return range(17, len(tok))


def full_decode(tok, ids, skip_special_tokens=True) -> str:
    return tok.decode(ids, skip_special_tokens=skip_special_tokens)


def stream(tok, prompt_ids, ids, chunks=None, *, finish=True, **params):
    """Feeds `ids` (one at a time, or in the given chunk sizes) and collects delta texts."""
    detok = IncrementalDetokenizer(tok, list(prompt_ids), SamplingParams(**params))
    sizes = chunks or [1] * len(ids)
    deltas, pos, stop = [], 0, None
    for size in sizes:
        if pos >= len(ids):
            break
        stop = detok.update(ids[pos:pos + size], stop_terminated=False)
        pos += size
        deltas.append(detok.get_next_output_text(finished=stop is not None, delta=True))
        if stop is not None:
            break
    if finish and stop is None:
        deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return detok, deltas, stop


# -- incremental == full decode -----------------------------------------------------------------
TEXTS = [
    "The quick brown fox jumps over the lazy dog. 1234567890!",
    "  leading spaces,\ttabs\nand\n\nnewlines   ",
    "日本語のテキスト、中文字符和한국어",
    "Emoji: 😀🎉👍🏽 flags 🇯🇵🇫🇷 family 👨‍👩‍👧‍👦 zwj",
    "naïve café — “quotes” Ελληνικά кириллица ∑∫√ ＡＢＣ",
]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tok, text):
    ids = tok.encode(text)
    detok, deltas, _ = stream(tok, tok.encode("Say:"), ids)
    assert "".join(deltas) == detok.output_text == full_decode(tok, ids) == text
    assert detok.token_ids == ids


def test_split_characters_come_out_whole(tok):
    text = "日本語 😀🎉👍🏽"
    ids = tok.encode(text)
    # The point of the test: some tokens are only part of a character.
    assert any(FFFD in tok.decode([i]) for i in ids)
    _, deltas, _ = stream(tok, [], ids)
    assert all(FFFD not in d for d in deltas)
    assert "".join(deltas) == text


@pytest.mark.parametrize("chunks", [[2] * 40, [3, 1, 5, 7, 100], [100]])
def test_multi_token_updates(tok, chunks):
    text = TEXTS[3] + TEXTS[2]
    ids = tok.encode(text)
    _, deltas, _ = stream(tok, [], ids, chunks)
    assert "".join(deltas) == text


def test_leading_space_of_first_token_is_kept(tok):
    ids = tok.encode(" world")
    detok, deltas, _ = stream(tok, tok.encode("Hello"), ids)
    assert "".join(deltas) == " world"


def test_half_character_at_the_end_is_flushed_as_replacement_char(tok):
    ids = tok.encode("ab 😀")
    cut = ids[:-1]                       # the emoji's last byte(s) never arrive
    assert full_decode(tok, cut).endswith(FFFD)
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    detok.update(cut, stop_terminated=False)
    assert detok.get_next_output_text(finished=False, delta=False) == "ab"  # held while running
    assert detok.get_next_output_text(finished=True, delta=False) == full_decode(tok, cut)
    assert detok.get_next_output_text(finished=True, delta=False) == full_decode(tok, cut)  # idempotent


def test_prompt_ending_mid_character_does_not_swallow_output(tok):
    ids = tok.encode("日本語")
    # Prompt = first token of "日" (half a character); output = the rest of it and more.
    detok, deltas, _ = stream(tok, ids[:1], ids[1:])
    assert "".join(deltas) == full_decode(tok, ids[1:])


@PROPERTY
@given(data=st.data())
def test_property_incremental_equals_full_decode(tok, ordinary_ids, data):
    ids = data.draw(st.lists(st.sampled_from(ordinary_ids), min_size=1, max_size=24), label="ids")
    prompt = data.draw(st.lists(st.sampled_from(ordinary_ids), max_size=8), label="prompt")
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=len(ids), max_size=len(ids)), label="chunks")
    detok, deltas, _ = stream(tok, prompt, ids, chunks)
    assert "".join(deltas) == detok.output_text == full_decode(tok, ids)


@PROPERTY
@given(data=st.data(), skip=st.booleans())
def test_property_with_special_tokens(tok, ordinary_ids, data, skip):
    token = st.one_of(st.sampled_from(ordinary_ids), st.integers(0, 16))
    ids = data.draw(st.lists(token, min_size=1, max_size=16), label="ids")
    prompt = data.draw(st.lists(token, max_size=6), label="prompt")
    detok, deltas, _ = stream(tok, prompt, ids, skip_special_tokens=skip)
    assert "".join(deltas) == full_decode(tok, ids, skip_special_tokens=skip)


def byte_fallback_tokenizer():
    """A SentencePiece-style tokenizer with byte fallback (Llama 2's, Mistral's, Gemma's
    decoder): special tokens 0-2, the 256 byte tokens 3-258, then a few words."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for word in ["▁", "▁Hello", "▁world", "▁x", "a", "é"]:
        vocab[word] = len(vocab)
    inner = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True,
                                 fuse_unk=True))
    inner.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    inner.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                       decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def final_only_against_step_by_step(tok, prompt, ids, chunks, eos, **params):
    texts = []
    for kind in ("cumulative", "final_only"):
        detok = IncrementalDetokenizer(tok, prompt, SamplingParams(output_kind=kind, **params))
        assert detok._at_end == (kind == "final_only")
        pos = 0
        for size in chunks:
            new = ids[pos:pos + size]
            pos += size
            if new:
                detok.update(new, stop_terminated=eos and pos >= len(ids))
        texts.append((detok.get_next_output_text(finished=True, delta=False), detok.token_ids))
    assert texts[0] == texts[1]
    assert texts[1][1] == ids


def test_final_only_with_byte_fallback_keeps_the_characters_before_a_bad_byte_run():
    # 你好世界 in byte tokens, then a character cut short (max_tokens): one decode of the run
    # gives U+FFFD for every byte; step by step, the four characters came out whole first.
    tok = byte_fallback_tokenizer()
    ids = [3 + b for b in "你好世界".encode()] + [3 + 0xE5, 3 + 0xA5]
    assert tok.decode(ids).count("\ufffd") == len(ids)
    final_only_against_step_by_step(tok, [259 + 1], ids, [1] * len(ids), eos=False)
    detok = IncrementalDetokenizer(tok, [], SamplingParams(output_kind="final_only"))
    detok.update(ids, stop_terminated=False)
    assert detok.get_next_output_text(finished=True, delta=False).startswith("你好世界")


@PROPERTY
@given(data=st.data(), skip=st.booleans(), eos=st.booleans())
def test_property_final_only_with_byte_fallback(data, skip, eos):
    tok = byte_fallback_tokenizer()
    token = st.integers(0, len(tok) - 1)
    ids = data.draw(st.lists(token, min_size=1, max_size=24), label="ids")
    prompt = data.draw(st.lists(token, max_size=6), label="prompt")
    if eos:
        ids.append(tok.eos_token_id)
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=len(ids), max_size=len(ids)), label="chunks")
    final_only_against_step_by_step(tok, prompt, ids, chunks, eos, skip_special_tokens=skip)


@PROPERTY
@given(data=st.data(), skip=st.booleans(), eos=st.booleans(), include=st.booleans())
def test_property_final_only_decodes_at_the_end_to_the_same_text(tok, ordinary_ids, data, skip,
                                                                 eos, include):
    """A final-only output with no stop strings decodes once, at the end: the same text and ids
    as decoding step by step, half characters, special tokens and a stop token included."""
    token = st.one_of(st.sampled_from(ordinary_ids), st.integers(0, 16))
    ids = data.draw(st.lists(token, min_size=1, max_size=24), label="ids")
    prompt = data.draw(st.lists(token, max_size=6), label="prompt")
    if eos:
        ids.append(tok.eos_token_id)
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=len(ids), max_size=len(ids)), label="chunks")
    final_only_against_step_by_step(tok, prompt, ids, chunks, eos, skip_special_tokens=skip,
                                    include_stop_str_in_output=include)


def test_final_only_with_stop_strings_still_looks_for_them(tok):
    params = SamplingParams(output_kind="final_only", stop=["fox"])
    detok = IncrementalDetokenizer(tok, [], params)
    assert not detok._at_end
    assert detok.update(tok.encode(TEXTS[0]), stop_terminated=False) == "fox"
    assert detok.get_next_output_text(finished=True, delta=False) == "The quick brown "


# -- stop tokens --------------------------------------------------------------------------------
def test_stop_terminated_leaves_out_eos_text(tok):
    ids = tok.encode("Hi there") + [tok.eos_token_id]
    for include, expected in ((False, "Hi there"), (True, "Hi there<|im_end|>")):
        detok = IncrementalDetokenizer(tok, [], SamplingParams(
            skip_special_tokens=False, include_stop_str_in_output=include))
        detok.update(ids[:-1], stop_terminated=False)
        assert detok.update(ids[-1:], stop_terminated=True) is None
        assert detok.get_next_output_text(finished=True, delta=False) == expected
        assert detok.token_ids == ids    # the stop token is still an output id


def test_stop_token_id_of_an_ordinary_token(tok):
    ids = tok.encode("The quick brown fox")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop_token_ids=[ids[-1]]))
    detok.update(ids, stop_terminated=True)  # all in one step, the stop token last
    assert detok.get_next_output_text(finished=True, delta=False) == "The quick brown"


# -- stop strings -------------------------------------------------------------------------------
SENTENCE = "The quick brown fox jumps over the lazy dog."


def test_stop_string_spanning_tokens(tok):
    ids = tok.encode(SENTENCE)
    assert not any("own f" in tok.decode([i]) for i in ids)   # it really spans " brown"/" fox"
    detok, deltas, stop = stream(tok, [], ids, stop=["own f"])
    assert stop == "own f"
    assert detok.output_text == "".join(deltas) == "The quick br"
    assert len(detok.token_ids) == 4      # stopped at " fox"; later tokens never fed


def test_include_stop_str_in_output(tok):
    detok, deltas, stop = stream(tok, [], tok.encode(SENTENCE), stop=["own f"],
                                 include_stop_str_in_output=True)
    assert stop == "own f"
    assert detok.output_text == "".join(deltas) == "The quick brown f"


def test_earliest_stop_string_wins(tok):
    detok, _, stop = stream(tok, [], tok.encode(SENTENCE), chunks=[100], stop=["lazy", "fox", "quick"])
    assert stop == "quick" and detok.output_text == "The "


def test_stop_string_inside_one_token_and_multibyte(tok):
    text = "価格は😀です。次へ"
    ids = tok.encode(text)
    detok, deltas, stop = stream(tok, [], ids, stop=["です"])
    assert stop == "です" and "".join(deltas) == "価格は😀"


def test_update_after_stop_string_raises(tok):
    ids = tok.encode(SENTENCE)
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["fox"]))
    assert detok.update(ids, stop_terminated=False) == "fox"
    assert detok.stop_string_matched == "fox"
    with pytest.raises(RuntimeError, match="stop string"):
        detok.update(ids[:1], stop_terminated=False)


def test_stop_strings_wait_for_min_tokens(tok):
    ids = tok.encode("a b a b a b")          # one token per letter/space-letter
    assert len(ids) == 6
    detok, _, stop = stream(tok, [], ids, stop=["b"], min_tokens=3)
    # " b" at token 2 is ignored (2 <= min_tokens); the one completed by token 4 stops it.
    assert stop == "b" and detok.output_text == "a b a " and len(detok.token_ids) == 4


def test_hold_back_while_running(tok):
    ids = tok.encode("Hello world, goodbye")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["world!"]))  # 6 chars: hold 5
    detok.update(ids[:2], stop_terminated=False)                              # "Hello world"
    assert detok.get_next_output_text(finished=False, delta=False) == "Hello "
    assert detok.get_next_output_text(finished=False, delta=True) == "Hello "
    assert detok.get_next_output_text(finished=False, delta=True) == ""
    detok.update(ids[2:], stop_terminated=False)                              # no match
    assert detok.get_next_output_text(finished=True, delta=True) == "world, goodbye"
    # Nothing is held back when the stop string would be kept anyway.
    kept = IncrementalDetokenizer(tok, [], SamplingParams(stop=["world!"], include_stop_str_in_output=True))
    kept.update(ids[:2], stop_terminated=False)
    assert kept.get_next_output_text(finished=False, delta=True) == "Hello world"


@PROPERTY
@given(data=st.data(), include=st.booleans())
def test_property_stop_strings_and_hold_back(tok, ordinary_ids, data, include):
    """Whatever a client sees while running is a prefix of the final text (so never the start
    of a stop string that is later cut), and the final text ends just before (or after) the
    first occurrence of the stop string."""
    ids = data.draw(st.lists(st.sampled_from(ordinary_ids), min_size=2, max_size=20), label="ids")
    full = full_decode(tok, ids)
    clean = [i for i, c in enumerate(full) if c != FFFD]
    if not clean:
        return
    start = data.draw(st.sampled_from(clean), label="start")
    length = data.draw(st.integers(1, 6), label="length")
    stop = full[start:start + length].split(FFFD)[0]
    other = data.draw(st.sampled_from(["\x00never\x00", "zzqzzqzzq"]), label="other")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=[other, stop],
                                                           include_stop_str_in_output=include))
    seen, cumulative = "", ""
    for i, t in enumerate(ids):
        matched = detok.update([t], stop_terminated=False)
        if matched is not None:
            break
        seen += detok.get_next_output_text(finished=False, delta=True)
        now = detok.get_next_output_text(finished=False, delta=False)
        assert now.startswith(cumulative)
        cumulative = now
    seen += detok.get_next_output_text(finished=True, delta=True)
    final = detok.get_next_output_text(finished=True, delta=False)
    pos = full.find(stop)
    assert matched in (None, stop)
    assert seen == final == full[:pos + len(stop) if include else pos]


def _run_steps(tok, ids: list[int], sizes: list[int], params: SamplingParams):
    """Feeds `ids` in steps of the given sizes, as the engine would with 1 + k tokens a step."""
    detok = IncrementalDetokenizer(tok, [], params)
    deltas, pos, stop = [], 0, None
    for size in sizes:
        step = ids[pos:pos + size]
        pos += size
        if not step:
            break
        stop = detok.update(step, stop_terminated=False)
        deltas.append(detok.get_next_output_text(finished=stop is not None, delta=True))
        if stop is not None:
            break
    if stop is None:
        deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return detok.token_ids, "".join(deltas), stop


@PROPERTY
@given(data=st.data(), include=st.booleans(), min_tokens=st.integers(0, 8))
def test_property_multi_token_steps_equal_single_token_steps(tok, ordinary_ids, data, include,
                                                             min_tokens):
    """A step of several tokens (speculative decoding) ends exactly where single-token steps
    end: the same ids (cut at the token that completes the stop string), text and stop reason,
    min_tokens counted per token."""
    ids = data.draw(st.lists(st.sampled_from(ordinary_ids), min_size=2, max_size=24), label="ids")
    full = full_decode(tok, ids)
    stops = []
    for _ in range(data.draw(st.integers(1, 3), label="num_stops")):
        start = data.draw(st.integers(0, max(len(full) - 1, 0)), label="start")
        stop = full[start:start + data.draw(st.integers(1, 5), label="length")].split(FFFD)[0]
        if stop:
            stops.append(stop)
    if not stops:
        return
    sizes = data.draw(st.lists(st.integers(1, 6), min_size=len(ids), max_size=len(ids)), label="sizes")
    params = SamplingParams(stop=stops, include_stop_str_in_output=include, min_tokens=min_tokens,
                            max_tokens=64)
    assert _run_steps(tok, ids, sizes, params) == _run_steps(tok, ids, [1] * len(ids), params)


def test_stop_string_inside_a_multi_token_step_cuts_the_ids(tok):
    ids = tok.encode("a b a b a b")
    one_step, text, stop = _run_steps(tok, ids, [6], SamplingParams(stop=[" a"]))
    assert (one_step, text, stop) == (ids[:3], "a b", " a")
    # min_tokens counts tokens, not steps: " a" at token 3 is too early, the one at token 5 stops.
    one_step, text, stop = _run_steps(tok, ids, [6], SamplingParams(stop=[" a"], min_tokens=3))
    assert (one_step, text, stop) == (ids[:5], "a b a b", " a")


class _SentencePieceLike:
    """A stub tokenizer whose decode drops the leading space of the whole text, like
    SentencePiece/Metaspace decoders do: the reason the first window holds prompt tokens."""

    pieces = ["<s>", "▁Hello", "▁world", "!", "▁again"]

    def decode(self, ids, skip_special_tokens=True, **kwargs) -> str:
        text = "".join(self.pieces[i] for i in ids if not (skip_special_tokens and i == 0))
        return text.replace("▁", " ").removeprefix(" ")


def test_prompt_context_keeps_the_space_a_sentencepiece_decoder_strips():
    tok = _SentencePieceLike()
    detok, deltas, _ = stream(tok, [0, 1], [2, 3, 4])
    assert "".join(deltas) == " world! again"
    assert tok.decode([2, 3, 4]) == "world! again"   # what decoding the output alone gives


def test_the_rust_decode_serves_only_where_transformers_would_call_it_alone(tok):
    """The Rust tokenizer's decode is taken for a plain fast tokenizer (the properties above
    hold it to transformers' decode); a class with a `_decode` of its own keeps the wrapper."""
    assert rust_decode(tok) is not None
    assert IncrementalDetokenizer(tok, [], SamplingParams())._rust_decode is not None

    class Own(type(tok)):
        def _decode(self, token_ids, **kwargs):
            return "own"

    own = copy.copy(tok)
    own.__class__ = Own
    assert rust_decode(own) is None
    _, deltas, _ = stream(own, [], [1000, 1001])
    # Own._decode ran (every window decodes to "own", so no text is new); the Rust decode
    # would have given the two tokens' text.
    assert "".join(deltas) == ""
    assert rust_decode(_SentencePieceLike()) is None
