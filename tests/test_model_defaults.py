"""What applies to every request that does not say otherwise: the model's generation config
(models/generation_config.py), and a server's chat template and default template variables.

The generation config is applied as vLLM applies it: its temperature, top_p, top_k, min_p,
repetition_penalty and max_new_tokens are the defaults of requests that leave them unset, and
every EOS it names ends a request. transformers reads the same file in `generate`, so a folder
whose generation config asks for greedy decoding with a repetition penalty and names a second EOS
is its own reference: treadle's output with no sampling parameters at all must be transformers'
with none either. A real `treadle serve` of that folder, driven by the openai SDK, must apply them
to what a client leaves unset and keep what it sets; with `--chat-template` (a file) and
`--default-chat-template-kwargs`, its prompts must be what jinja renders from that template.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil

import pytest
import torch
import transformers

from tests.test_server import MODEL, Server
from treadle import LLM, SamplingParams
from treadle.entrypoints.chat_template import load_chat_template
from treadle.entrypoints.openai.serving_chat import check_default_template_kwargs
from treadle.models.generation_config import GenerationDefaults, load_generation_defaults
from treadle.models.loader import load_tokenizer

PROMPT = [1, 40, 41, 42, 43, 40, 41, 42, 43, 40, 41]
# A chat template of the operator's, reading a variable of its own.
TEMPLATE = ("{% for m in messages %}{{ greeting }} {{ m['content'] }}"
            "{% if m.reasoning_content %} {{ m.reasoning_content }}{% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}w60{% endif %}")
PENALTY = 1.6
MAX_NEW = 12


def _generate(model, **kwargs) -> list[int]:
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    return out[0, len(PROMPT):].tolist()


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoints, tmp_path_factory) -> dict:
    """The tiny Llama with a generation config: greedy, a repetition penalty, MAX_NEW tokens, and
    a second EOS that the penalized greedy output reaches at its 8th token. Also what
    transformers generates from it, with and without the file's settings."""
    path = tmp_path_factory.mktemp("generation_config") / "llama"
    shutil.copytree(tiny_checkpoints["llama"], path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = model.config.eos_token_id
    penalized = _generate(model, do_sample=False, repetition_penalty=PENALTY, max_new_tokens=MAX_NEW,
                          min_new_tokens=MAX_NEW)
    plain = _generate(model, do_sample=False, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW)
    assert penalized != plain and eos not in penalized, "the tiny model gives this test no evidence"
    second_eos = penalized[7]
    assert second_eos not in penalized[:7]
    (path / "generation_config.json").write_text(json.dumps({
        "do_sample": False, "temperature": 0.0, "repetition_penalty": PENALTY,
        "max_new_tokens": MAX_NEW, "bos_token_id": 1, "eos_token_id": [eos, second_eos],
        "transformers_version": transformers.__version__}))
    # transformers from the folder: its generate reads the file.
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference = _generate(model)
    assert reference == penalized[:8], "transformers did not take the file's settings"
    return {"path": str(path), "reference": reference, "penalized": penalized, "plain": plain,
            "second_eos": second_eos}


def test_the_file_sets_defaults_and_eos_tokens(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.0,
        "max_new_tokens": 64, "eos_token_id": [2, 7, 2], "bos_token_id": 1, "pad_token_id": 0}))
    got = load_generation_defaults(str(tmp_path))
    assert got.sampling == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.0}
    assert got.max_tokens == 64 and got.eos_token_ids == (2, 7)
    # vLLM's "vllm": the engine's own defaults; the model's EOS tokens still end requests.
    engine_own = load_generation_defaults(str(tmp_path), "vllm")
    assert (engine_own.sampling, engine_own.max_tokens, engine_own.eos_token_ids) == ({}, None, (2, 7))
    over = load_generation_defaults(str(tmp_path), "auto", '{"temperature": 0.0, "repetition_penalty": 1.1}')
    assert over.sampling["temperature"] == 0.0 and over.sampling["repetition_penalty"] == 1.1
    assert load_generation_defaults(str(tmp_path), "vllm", {"top_k": 5}).sampling == {"top_k": 5}
    # Another folder's file.
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text('{"temperature": 0.3}')
    assert load_generation_defaults(str(tmp_path), str(other)).sampling == {"temperature": 0.3}
    # A model without the file has no defaults; its EOS tokens are config.json's.
    empty = tmp_path / "empty"
    empty.mkdir()
    assert load_generation_defaults(str(empty), config_eos=[2, 9]) == GenerationDefaults(eos_token_ids=(2, 9))


@pytest.mark.parametrize("source, overrides, message", [
    ("nowhere", None, "generation_config must be 'auto', 'vllm' or a folder"),
    ("", None, "generation_config must be"),
    ("auto", {"temperature": -1.0}, "temperature"),
    ("auto", {"top_p": 1.5}, "top_p"),
    ("auto", {"max_new_tokens": 0}, "max_new_tokens must be"),
    ("auto", {"max_tokens": 5}, r"unknown keys \['max_tokens'\]; known: .*max_new_tokens"),
    ("auto", "{not json", "override_generation_config is not valid JSON"),
    ("auto", [1], "override_generation_config must be a dict"),
])
def test_bad_settings_are_refused_naming_them(tmp_path, source, overrides, message):
    with pytest.raises(ValueError, match=message):
        load_generation_defaults(str(tmp_path), source, overrides)


def test_a_bad_value_in_the_models_file_is_refused_at_start(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"top_k": -3}')
    with pytest.raises(ValueError, match="generation config's defaults are invalid: top_k"):
        load_generation_defaults(str(tmp_path))
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, "x"]}')
    with pytest.raises(ValueError, match="eos_token_id must be token ids"):
        load_generation_defaults(str(tmp_path))


def test_generate_without_parameters_equals_transformers_reading_the_same_file(model_dir):
    with LLM(model_dir["path"], dtype="float32", block_size=16, num_kv_blocks=16) as llm:
        # max_tokens None: max_new_tokens, or the end of the context if that comes first.
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.repetition_penalty, defaults.max_tokens) == (
            0.0, PENALTY, None)
        out = llm.generate({"prompt_token_ids": PROMPT}, use_tqdm=False)[0].outputs[0]
        assert list(out.token_ids) == model_dir["reference"]
        assert (out.finish_reason, out.stop_reason) == ("stop", model_dir["second_eos"])
        # ignore_eos runs past the second EOS too.
        run_on = SamplingParams(temperature=0.0, repetition_penalty=PENALTY, max_tokens=MAX_NEW,
                                ignore_eos=True)
        out = llm.generate({"prompt_token_ids": PROMPT}, run_on, use_tqdm=False)[0].outputs[0]
        assert list(out.token_ids) == model_dir["penalized"] and out.finish_reason == "length"
    with LLM(model_dir["path"], dtype="float32", block_size=16, num_kv_blocks=16,
             generation_config="vllm") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
        greedy = SamplingParams(temperature=0.0, repetition_penalty=PENALTY, max_tokens=MAX_NEW)
        out = llm.generate({"prompt_token_ids": PROMPT}, greedy, use_tqdm=False)[0].outputs[0]
        assert list(out.token_ids) == model_dir["reference"], "the model's second EOS must still stop it"


def test_max_new_tokens_bounds_a_request_without_max_tokens_within_the_context(model_dir):
    args = {"dtype": "float32", "block_size": 16, "num_kv_blocks": 16, "max_model_len": 20}
    with LLM(model_dir["path"], **args, override_generation_config={"max_new_tokens": 3}) as llm:
        out = llm.generate({"prompt_token_ids": PROMPT}, use_tqdm=False)[0].outputs[0]
        assert list(out.token_ids) == model_dir["penalized"][:3] and out.finish_reason == "length"
    # More than the context holds: the context ends it, not an error.
    with LLM(model_dir["path"], **args, override_generation_config={"max_new_tokens": 4096,
                                                                    "repetition_penalty": 1.0}) as llm:
        params = llm.get_default_sampling_params()
        params.ignore_eos = True
        out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 20 - len(PROMPT) and out.finish_reason == "length"


def test_async_generate_without_parameters_takes_the_models_defaults(model_dir):
    from treadle.engine.async_llm import AsyncLLM

    async def run() -> list[int]:
        engine = AsyncLLM(model_dir["path"], dtype="float32", block_size=16, num_kv_blocks=16)
        try:
            async for out in engine.generate({"prompt_token_ids": PROMPT}, request_id="r"):
                last = out
            return list(last.outputs[0].token_ids)
        finally:
            engine.shutdown()

    assert asyncio.run(run()) == model_dir["reference"]


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("server")
    (folder / "template.jinja").write_text(TEMPLATE)
    srv = Server(model_dir["path"], folder, "--override-generation-config", '{"max_new_tokens": 5}',
                 "--chat-template", str(folder / "template.jinja"),
                 "--default-chat-template-kwargs", '{"greeting": "w50"}')
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _complete(client, extra: dict | None = None, **kwargs):
    resp = client.completions.create(model=MODEL, prompt=PROMPT,
                                     extra_body={"return_token_ids": True, **(extra or {})}, **kwargs)
    return resp.choices[0]


def test_the_server_applies_the_models_defaults_to_what_a_client_leaves_unset(client, model_dir):
    # Greedy with the penalty, and max_tokens from the override of max_new_tokens.
    choice = _complete(client)
    assert choice.token_ids == model_dir["penalized"][:5] and choice.finish_reason == "length"
    # The client's max_tokens wins; the second EOS stops it.
    choice = _complete(client, max_tokens=MAX_NEW)
    assert choice.token_ids == model_dir["reference"] and choice.finish_reason == "stop"
    # So do its sampling fields: no penalty.
    choice = _complete(client, {"repetition_penalty": 1.0, "ignore_eos": True}, max_tokens=7)
    assert choice.token_ids == model_dir["plain"][:7]
    # Chat takes the same defaults: five tokens, as the override says.
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w40 w41"}])
    assert resp.usage.completion_tokens == 5 and resp.choices[0].finish_reason == "length"


def test_the_servers_chat_template_and_default_variables(server, model_dir):
    tokenizer = load_tokenizer(model_dir["path"])
    messages = [{"role": "user", "content": "w40 w41"}]

    def render(messages: list[dict], greeting: str) -> str:   # transformers' own rendering
        return tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False,
                                             add_generation_prompt=True, greeting=greeting)

    def tokens(greeting: str) -> list[int]:
        return tokenizer.encode(render(messages, greeting), add_special_tokens=False)

    status, body = server.request("POST", "/tokenize", {"messages": messages})
    assert status == 200 and body["tokens"] == tokens("w50")
    # A request's own value wins over the server's default.
    status, body = server.request("POST", "/tokenize", {"messages": messages,
                                                        "chat_template_kwargs": {"greeting": "w51"}})
    assert status == 200 and body["tokens"] == tokens("w51")
    assert server.request("GET", "/tokenizer_info")[1]["chat_template"] == TEMPLATE
    # A replayed assistant turn's reasoning (either name) reaches the template as
    # reasoning_content, as interleaved-thinking templates read it.
    for name in ("reasoning", "reasoning_content"):
        messages = [{"role": "user", "content": "w40"},
                    {"role": "assistant", "content": "w41", name: "w42 w43"}]
        status, body = server.request("POST", "/tokenize", {"messages": messages})
        text = render([messages[0], {"role": "assistant", "content": "w41",
                                     "reasoning_content": "w42 w43"}], "w50")
        assert status == 200 and body["tokens"] == tokenizer.encode(text, add_special_tokens=False)
        assert "w42 w43" in text


def test_a_chat_template_from_a_file_or_inline_is_checked_before_use(tmp_path):
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    assert load_chat_template(str(tmp_path / "t.jinja")) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    with pytest.raises(ValueError, match="neither a file nor a template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not parse: line 1"):
        load_chat_template("{% for m in messages %}{{ m }}")
    # transformers' own tag parses as it renders.
    marked = "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
    assert load_chat_template(marked) == marked


def test_default_template_variables_the_template_never_reads_are_dropped_with_a_warning(caplog):
    variables = frozenset({"messages", "greeting", "add_generation_prompt"})
    with caplog.at_level(logging.WARNING):
        kept = check_default_template_kwargs({"greeting": "x", "enable_thinking": False}, variables)
    assert kept == {"greeting": "x"} and "does not read `enable_thinking`" in caplog.text
    for key in ("tokenize", "messages", "add_generation_prompt"):
        with pytest.raises(ValueError, match=f"may not set `{key}`"):
            check_default_template_kwargs({key: True}, variables)
