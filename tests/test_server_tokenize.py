"""/tokenize against the chat request it stands for, on a tokenizer that adds a BOS (as Llama
3's does): with `messages`, /tokenize ignored `add_special_tokens`, so the count it reported
was not that of the prompt /v1/chat/completions ran with the same flag (vLLM honours it).
And max_completion_tokens: 0 was refused naming max_tokens, a field the client never sent."""
import json
import shutil

import pytest

from tests.test_server import Server
from tests.tiny_models import tiny_checkpoint_dir

MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bos") / "model"
    shutil.copytree(tiny_checkpoint_dir("llama", tmp_path_factory), folder)
    tok = json.loads((folder / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}
    tok["post_processor"] = {   # a tokenizer that adds a BOS, as Llama 3's does
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}}}
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    srv = Server(str(folder), tmp_path_factory.mktemp("log"))
    yield srv
    srv.stop()


def test_tokenize_messages_honours_add_special_tokens(server):
    for add in (False, True):
        status, tok = server.request("POST", "/tokenize", {"messages": MESSAGES,
                                                           "add_special_tokens": add})
        assert status == 200, tok
        status, chat = server.request("POST", "/v1/chat/completions", {
            "messages": MESSAGES, "max_tokens": 1, "add_special_tokens": add,
            "return_token_ids": True})
        assert status == 200, chat
        assert tok["tokens"] == chat["prompt_token_ids"], f"add_special_tokens={add}"


def test_max_completion_tokens_error_names_the_field_sent(server):
    status, body = server.request("POST", "/v1/chat/completions", {
        "messages": MESSAGES, "max_completion_tokens": 0})
    assert status == 400
    assert body["error"]["param"] == "max_completion_tokens", body
