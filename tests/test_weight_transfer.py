"""Weights streamed from a trainer process (vLLM's weight-transfer protocol, issue 46).

A real trainer process holds the tiny Llama's weights and is rank 0 of the transfer group; the
engine's workers (one, two pipeline stages, three tensor shards) receive its broadcasts. Greedy
output after a transfer equals transformers on the weights sent; sending the originals back
restores the output exactly. Bad update_infos are refused before any weight changes, and a
trainer that dies or stalls mid-broadcast leaves the engine on its old weights, healthy, and
ready for a new group. Over HTTP, a real `treadle serve` with the API key.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import Any

import pytest
import torch

from tests.reference import HFReference
from tests.test_correctness import TEXTS
from tests.test_server import MODEL, Server, StreamReader, assert_error
from tests.weight_trainer import Trainer, perturbed
from treadle import LLM, AsyncLLM, EngineArgs, SamplingParams
from treadle.engine.weight_transfer import WeightTransferError
from treadle.engine.weights import ServedWeights
from treadle.models.loader import default_model_path, iter_hf_weights, load_tokenizer
from treadle.rl import WeightSender

# A step budget of 256 tokens holds every prompt here (50 tokens in all) in one step, as the
# default 2,048 did; each rank warms its GEMMs up to it at start-up, and a last stage's head
# (the tied embedding's copy, 49,152 rows) took most of a two-stage engine's start at 2,048.
ENGINE_ARGS = {"block_size": 16, "num_kv_blocks": 64, "max_num_seqs": 4, "max_num_batched_tokens": 256}
GLOO = {"backend": "gloo"}
MAX_TOKENS = 10


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def as_served(pairs: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """What an fp32 engine holds after receiving `pairs` (cast on the way in)."""
    return [(name, t.to(torch.float32)) for name, t in pairs]


def staged_and_held_bytes(worker) -> tuple[int, int]:
    """(bytes a worker's receiver stages, bytes of its model)."""
    staged = sum(t.numel() * t.element_size() for _, t in worker.weight_receiver.staged
                 if t is not None)
    return staged, sum(p.numel() * p.element_size() for p in worker.runner.model.parameters())


def send_staging_only_what_each_rank_holds(llm: LLM, trainer: Trainer, seed: int) -> None:
    """Start a round and receive the whole model, packed: each rank stages only its part of it
    (a pipeline stage, nothing of another's layers; a tensor shard, its shard: ranks once
    staged the whole model until the round ended), with no view keeping a packed buffer alive."""
    llm.start_weight_update()
    info = trainer.call("send", seed, torch.float32, None, True, "send")
    llm.update_weights({"update_info": info})
    assert trainer.call()[0] == "sent"
    for staged, held in llm.collective_rpc(staged_and_held_bytes):
        assert staged <= held, (staged, held)


@pytest.fixture
def trainer_for():
    """trainer_for(path, engine_world_size) -> a Trainer, stopped after the test."""
    started: list[Trainer] = []

    def make(path: str, engine_world_size: int) -> Trainer:
        trainer = Trainer(dict(iter_hf_weights(path)), 1 + engine_world_size)
        started.append(trainer)
        return trainer

    yield make
    for trainer in started:
        trainer.stop()


@pytest.fixture(scope="module")
def prompts(llama) -> list[list[int]]:
    tok = load_tokenizer(llama)
    return [tok.encode(t) for t in TEXTS[:3]]


def generate(llm: LLM, prompts: list[list[int]]):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)


def assert_exact(outputs, prompts, ref: HFReference) -> None:
    for ids, out in zip(prompts, outputs):
        assert list(out.outputs[0].token_ids) == ref.greedy(ids, MAX_TOKENS), ids


# -- configuration ---------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, message", [
    ({"backend": "tcp"}, "weight_transfer_config.backend must be one of gloo, nccl; got 'tcp'"),
    ('{"backend": ', "weight_transfer_config is not valid JSON"),
    ({"backend": "gloo", "port": 1}, "weight_transfer_config has unknown keys ['port']"),
    ({"timeout_s": 0}, "weight_transfer_config.timeout_s must be a number of seconds > 0"),
    ({"backend": "nccl"}, "backend 'nccl' needs a CUDA device"),
])
def test_bad_config_names_the_field(llama, spec, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        EngineArgs(model=llama, device="cpu", weight_transfer_config=spec).create_config()


# -- one worker --------------------------------------------------------------------------------------
def test_requests_run_while_the_workers_wait_for_the_trainer(llama, reference, prompts,
                                                             original_weights, trainer_for):
    """The workers join the trainer's group on threads of their own. A trainer that never comes
    ends init_weight_transfer_engine with an error at its timeout, and a request sent meanwhile
    runs to its end, exactly, long before: the join once held the engine's thread for the whole
    timeout. Then a real trainer's group and round, all through AsyncLLM (the server's path)."""
    with socket.socket() as s:   # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ref = reference(llama)

    async def body(engine: AsyncLLM) -> None:
        start = time.monotonic()
        joining = asyncio.create_task(engine.init_weight_transfer_engine({"init_info": {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 2, "timeout": 8}}))
        await asyncio.sleep(0.2)
        final = None
        async for out in engine.generate({"prompt_token_ids": prompts[0]}, greedy(40), "r"):
            final = out
        assert final.outputs[0].token_ids == ref.greedy(prompts[0], 40)
        assert not joining.done(), f"the request waited for the join ({time.monotonic() - start:.1f} s)"
        # A retry meanwhile is refused as a state conflict (409 over HTTP), and the join goes
        # on: it once gave the first join up, which then ended with "no weight transfer group".
        with pytest.raises(RuntimeError, match="a join of the trainer's group is under way") as e:
            await engine.init_weight_transfer_engine({"init_info": {
                "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                "world_size": 2, "timeout": 8}})
        assert not isinstance(e.value, WeightTransferError)
        await asyncio.sleep(0.3)
        assert not joining.done()
        with pytest.raises(WeightTransferError, match=f"could not join the trainer's group at 127.0.0.1:{port}"):
            await joining
        with pytest.raises(RuntimeError, match="call init_weight_transfer_engine first"):
            await engine.start_weight_update()

        trainer = trainer_for(llama, 1)
        await engine.init_weight_transfer_engine({"init_info": trainer.call("group", 60)})
        assert trainer.call() == "connected"
        await engine.start_weight_update()
        info = trainer.call("send", 7, torch.float32, None, False, "send")
        assert await engine.update_weights({"update_info": info}) == len(trainer.names)
        assert trainer.call() == ("sent", len(trainer.names))
        assert await engine.finish_weight_update("sent") == len(trainer.names)
        final = None
        async for out in engine.generate({"prompt_token_ids": prompts[1]}, greedy(), "after"):
            final = out
        sent = HFReference(llama, as_served(perturbed(original_weights, 7)))
        assert final.outputs[0].token_ids == sent.greedy(prompts[1], MAX_TOKENS)
        assert final.weight_version == "sent"

    engine = AsyncLLM(llama, weight_transfer_config=GLOO, **ENGINE_ARGS)
    try:
        asyncio.run(body(engine))
    finally:
        engine.shutdown()


def test_one_worker(llama, reference, prompts, original_weights, trainer_for):
    """Without the config each call says how to enable it. With it: unpacked, packed in bf16
    over two update calls, and the trainer broadcasting by itself; each output equals
    transformers on the weights sent, and the identity equals in-process update_weights'."""
    with LLM(llama, **ENGINE_ARGS) as llm:
        for call in (lambda: llm.init_weight_transfer_engine({"init_info": {}}),
                     llm.start_weight_update, llm.finish_weight_update,
                     lambda: llm.update_weights({"update_info": {}})):
            with pytest.raises(RuntimeError, match="weight_transfer_config=.*--weight-transfer-config"):
                call()

    with LLM(llama, weight_transfer_config=GLOO, **ENGINE_ARGS) as llm:
        first = generate(llm, prompts)
        assert_exact(first, prompts, reference(llama))
        with pytest.raises(RuntimeError, match="call init_weight_transfer_engine first"):
            llm.start_weight_update()
        trainer = trainer_for(llama, 1)
        trainer.group(llm.init_weight_transfer_engine)
        with pytest.raises(RuntimeError, match="call start_weight_update first"):
            llm.update_weights({"update_info": {"names": [], "dtype_names": [], "shapes": []}})

        sent = perturbed(original_weights, seed=1)
        assert trainer.transfer(llm, seed=1, weight_version="v1") == len(original_weights)
        assert llm.engine.core.weights.identity == ServedWeights().updated(sent, None).identity
        outputs = generate(llm, prompts)
        assert_exact(outputs, prompts, HFReference(llama, sent))
        assert [o.outputs[0].token_ids for o in outputs] != [o.outputs[0].token_ids for o in first]
        assert outputs[0].weight_version == "v1" and llm.get_weight_version() == "v1"
        assert outputs[0].num_cached_tokens == 0   # the prefix cache went with the old weights

        sent = as_served(perturbed(original_weights, seed=2, dtype=torch.bfloat16))
        info = trainer.call("send", 2, torch.bfloat16, trainer.names, True, "send")
        llm.start_weight_update()
        llm.update_weights({"update_info": {**info, "weight_version": "v2"}})
        assert trainer.call()[0] == "sent"
        assert llm.finish_weight_update() == len(original_weights)
        assert llm.get_weight_version() == "v2"
        assert_exact(generate(llm, prompts), prompts, HFReference(llama, sent))
        # Packed in two parts, from the trainer's own broadcasts: the originals are back.
        trainer.transfer(llm, seed=None, packed=True, parts=2)
        assert_exact(generate(llm, prompts), prompts, reference(llama))
        trainer.transfer(llm, seed=None, how="itself")
        assert [o.outputs[0].token_ids for o in generate(llm, prompts)] == \
            [o.outputs[0].token_ids for o in first]
        # A label every later response carries must be text JSON can hold: refused before
        # anything is received (a reviewer's find: served, it made every response a 500), and
        # the round dropped as for any refused part.
        version = llm.get_weight_version()
        llm.start_weight_update()
        with pytest.raises(ValueError, match="update_info.weight_version 'v\\\\ud800' must be JSON text"):
            llm.update_weights({"update_info": {"names": [], "dtype_names": [], "shapes": [],
                                                "weight_version": "v\ud800"}})
        assert llm.get_weight_version() == version


# -- two pipeline stages: the bad transfers ---------------------------------------------------------
def test_two_stages_and_bad_transfers(llama, reference, prompts, original_weights, trainer_for):
    with LLM(llama, pipeline_parallel_size=2, weight_transfer_config=GLOO, **ENGINE_ARGS) as llm:
        trainer = trainer_for(llama, 2)
        trainer.group(llm.init_weight_transfer_engine)
        sent = perturbed(original_weights, seed=3)
        send_staging_only_what_each_rank_holds(llm, trainer, seed=3)
        llm.finish_weight_update(3)
        before = generate(llm, prompts)
        assert_exact(before, prompts, HFReference(llama, sent))
        identity = llm.engine.core.weights.identity

        def unchanged() -> None:
            assert llm.engine.core.weights.identity == identity and llm.get_weight_version() == 3
            assert llm.engine.core.executor.failure() is None
            outputs = generate(llm, prompts)
            assert [o.outputs[0].token_ids for o in outputs] == \
                [o.outputs[0].token_ids for o in before]

        # Refused before any rank joins the broadcast; a good part staged before goes too.
        layer1 = [n for n in trainer.names if n.startswith("model.layers.2.")]
        for field, index, value, message in [
                ("shapes", 0, [3, 5], r"has shape \(3, 5\)"),
                ("names", 1, "model.layers.2.mlp.bogus_proj.weight", "bogus_proj"),
                ("dtype_names", 2, "int32", r"dtype_names\[2\].*'int32'")]:
            llm.start_weight_update()
            good = trainer.call("send", 4, torch.float32, layer1[:2], False, "send")
            llm.update_weights({"update_info": good})
            assert trainer.call() == ("sent", 2)
            info = trainer.call("send", 4, torch.float32, layer1, False, "send")
            info[field][index] = value
            with pytest.raises(ValueError, match=message):
                llm.update_weights({"update_info": info})
            assert trainer.call()[0] in ("sent", "error")   # the closed group ends its send
            with pytest.raises(RuntimeError, match="call init_weight_transfer_engine first"):
                llm.finish_weight_update()
            unchanged()
            trainer.group(llm.init_weight_transfer_engine)

        # Fewer bytes than declared (float32 declared, bfloat16 sent): gloo takes a short
        # message into the larger buffer, and what it did not reach was once applied as weights.
        llm.start_weight_update()
        info = trainer.call("send", 4, torch.float32, layer1, False, "halves")
        with pytest.raises(WeightTransferError, match="fewer bytes than update_info declares"):
            llm.update_weights({"update_info": info})
        trainer.call()
        unchanged()
        trainer.group(llm.init_weight_transfer_engine)

        # The trainer stalls: the group's timeout ends the round.
        trainer.group(llm.init_weight_transfer_engine, timeout_s=2)
        llm.start_weight_update()
        info = trainer.call("send", 5, torch.float32, None, False, "stall")
        assert trainer.call() == ("stalled", 0)
        start = time.monotonic()
        with pytest.raises(WeightTransferError, match="keeps the weights it had"):
            llm.update_weights({"update_info": info})
        assert time.monotonic() - start < 30
        unchanged()

        # The trainer dies halfway through a round.
        trainer.group(llm.init_weight_transfer_engine)
        llm.start_weight_update()
        info = trainer.call("send", 5, torch.float32, None, False, "die")
        with pytest.raises(WeightTransferError, match="init_weight_transfer_engine again"):
            llm.update_weights({"update_info": info})
        trainer.proc.join(10)
        assert trainer.proc.exitcode == 3
        unchanged()

        # A new trainer, a new group: the originals come back exactly.
        trainer = trainer_for(llama, 2)
        trainer.group(llm.init_weight_transfer_engine)
        trainer.transfer(llm, seed=None)
        assert_exact(generate(llm, prompts), prompts, reference(llama))


def die_in_finish_on_rank_1(worker) -> None:
    """Given to collective_rpc: rank 1's process exits as it applies the round."""
    if worker.ctx.rank == 1:
        worker.finish_weight_update = lambda: os._exit(3)


def test_a_rank_that_dies_applying_a_round_is_replaced(llama, reference, prompts,
                                                       original_weights, trainer_for):
    """A rank dies in finish_weight_update's apply, after both checked the round: the group
    is replaced once, with the weights served before (the other rank may have applied the
    round), the call fails unapplied, and a new group's round then applies exactly."""
    with LLM(llama, tensor_parallel_size=2, max_worker_restarts=1, weight_transfer_config=GLOO,
             **ENGINE_ARGS) as llm:
        trainer = trainer_for(llama, 2)
        trainer.group(llm.init_weight_transfer_engine)
        llm.start_weight_update()
        info = trainer.call("send", 3, torch.float32, None, True, "send")
        llm.update_weights({"update_info": info})
        assert trainer.call()[0] == "sent"
        llm.collective_rpc(die_in_finish_on_rank_1)
        with pytest.raises(RuntimeError, match="worker rank 1 died.*not applied.*restarted"):
            llm.finish_weight_update(3)
        assert llm.engine.core.num_worker_restarts == 1 and llm.get_weight_version() == 0
        assert_exact(generate(llm, prompts), prompts, reference(llama))
        trainer = trainer_for(llama, 2)
        trainer.group(llm.init_weight_transfer_engine)
        trainer.transfer(llm, seed=5)
        assert_exact(generate(llm, prompts), prompts,
                     HFReference(llama, perturbed(original_weights, seed=5)))


def test_the_sender_sends_only_what_update_info_declared():
    """A worker receives what update_info declared: gloo aborts the worker's process on a
    longer message, and a shorter one loses the round (above). So WeightSender refuses first."""
    weights = [("a", torch.ones(4)), ("b", torch.ones(2, 3))]
    with WeightSender(world_size=2) as sender:   # never connected: a send would raise otherwise
        sender.update_info(weights, packed=True)
        with pytest.raises(ValueError, match=r"\(packed_buffer_size_bytes: 65536, declared "
                                             r"1073741824\); nothing was sent"):
            sender.send(weights, packed=True, packed_buffer_size_bytes=64 << 10)
        with pytest.raises(ValueError, match=r"\(dtype_names: item 1 is 'bfloat16', declared "
                                             r"'float32'\)"):
            sender.send([weights[0], ("b", weights[1][1].bfloat16())], packed=True)
        with pytest.raises(ValueError, match=r"\(packed: False, declared True\)"):
            sender.send(weights)


# -- three tensor shards ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_tp3(tmp_path_factory) -> str:
    """A tiny Llama with 6 heads, 3 KV heads, hidden 96 and an MLP of 192: it splits three
    ways (the shared tiny checkpoints have 4 heads)."""
    import transformers

    from tests.tiny_models import _sharpen, tiny_config

    tok = load_tokenizer(default_model_path())
    config = tiny_config("llama", tok, tie_word_embeddings=True)
    config.num_attention_heads, config.num_key_value_heads = 6, 3
    config.hidden_size, config.intermediate_size = 96, 192
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    _sharpen(model, 0.3, 0.5)
    path = tmp_path_factory.mktemp("tp3") / "llama"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_three_tensor_shards(llama_tp3, reference, trainer_for):
    path = llama_tp3
    weights = dict(iter_hf_weights(path))
    prompts = [load_tokenizer(path).encode(t) for t in TEXTS[:3]]
    with LLM(path, tensor_parallel_size=3, weight_transfer_config=GLOO, **ENGINE_ARGS) as llm:
        trainer = trainer_for(path, 3)
        trainer.group(llm.init_weight_transfer_engine)
        send_staging_only_what_each_rank_holds(llm, trainer, seed=6)
        llm.finish_weight_update()
        ref = HFReference(path, perturbed(weights, 6))
        assert_exact(generate(llm, prompts), prompts, ref)
        assert [ref.greedy(p, MAX_TOKENS) for p in prompts] != \
            [reference(path).greedy(p, MAX_TOKENS) for p in prompts]
        trainer.transfer(llm, seed=None)
        assert_exact(generate(llm, prompts), prompts, reference(path))


# -- over HTTP ---------------------------------------------------------------------------------------
def test_http_routes(llama, reference, prompts, original_weights, trainer_for, tmp_path):
    srv = Server(llama, tmp_path, "--weight-transfer-config", '{"backend": "gloo"}',
                 env={"TREADLE_API_KEY": "sesame"})
    key = {"Authorization": "Bearer sesame"}

    def post(path: str, body: Any = None, headers: dict | None = key) -> tuple[int, Any]:
        return srv.request("POST", path, {} if body is None else body, headers=headers)

    def completions(client) -> list[list[int]]:
        out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=MAX_TOKENS,
                                        temperature=0, extra_body={"ignore_eos": True,
                                                                   "return_token_ids": True})
        return [c.token_ids for c in sorted(out.choices, key=lambda c: c.index)]

    try:
        for path in ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                     "/finish_weight_update"):
            assert_error(*post(path, headers=None), 401)
        assert_error(*post("/start_weight_update"), 409)                  # no group yet
        status, body = post("/init_weight_transfer_engine", {})
        assert_error(status, body, 400)
        assert "init_info" in body["error"]["message"]
        status, body = post("/init_weight_transfer_engine", {"init_info": {
            "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0, "world_size": 2}})
        assert_error(status, body, 400)
        assert body["error"]["param"] == "init_info.rank_offset"
        # Past what torch.distributed takes (C ints; deadlines overflow past ~292 years; no
        # NUL in a host name): it failed there, a 502 naming no field.
        for change, field in (({"world_size": 2**31}, "world_size"),
                              ({"rank_offset": 2**31, "world_size": 2**31 + 1}, "rank_offset"),
                              ({"timeout": 1e10}, "timeout"),
                              ({"master_address": "127.0.0.1\x00"}, "master_address")):
            status, body = post("/init_weight_transfer_engine", {"init_info": {
                "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                "world_size": 2, **change}})
            assert_error(status, body, 400)
            assert body["error"]["param"] == f"init_info.{field}"

        trainer = trainer_for(llama, 1)

        def init(request: dict) -> None:
            assert post("/init_weight_transfer_engine", request) == \
                (200, {"message": "Weight transfer initialized"})

        trainer.group(init)
        assert_error(*post("/update_weights", {"update_info": {}}), 409)   # no round yet
        assert post("/start_weight_update", {"is_checkpoint_format": True})[0] == 200
        status, body = post("/update_weights", {"update_info": {"names": ["x"]}})
        assert_error(status, body, 400)
        assert body["error"]["param"] == "update_info.dtype_names"
        assert_error(*post("/update_weights", {"update_info": {}}), 409)   # the round went
        # A size past any tensor's bytes: torch failed on it in the workers (a 409, a C++ trace).
        for shape in ([2**40, 2**40], [2**63]):
            trainer.group(init)
            assert post("/start_weight_update")[0] == 200
            status, body = post("/update_weights", {"update_info": {
                "names": [trainer.names[0]], "dtype_names": ["float32"], "shapes": [shape]}})
            assert_error(status, body, 400)
            assert body["error"]["param"] == "update_info.shapes"
        trainer.group(init)
        assert post("/start_weight_update")[0] == 200
        # A name the model does not have: refused, and the group dropped (the trainer sent).
        info = trainer.call("send", 7, torch.float32, trainer.names[:1], False, "send")
        info["names"][0] = "model.layers.0.self_attn.bogus.weight"
        status, body = post("/update_weights", {"update_info": info})
        assert_error(status, body, 400)
        assert "bogus" in body["error"]["message"]
        trainer.call()
        trainer.group(init)

        # While a request runs unpaused the round is refused; paused (keep), it goes through.
        client = srv.client("sesame")
        reader = StreamReader(client, prompt="Once upon a time", max_tokens=200,
                              extra_body={"ignore_eos": True})
        reader.wait_for_chunks(2)
        status, body = post("/start_weight_update")
        assert_error(status, body, 409)
        assert "pause" in body["error"]["message"]
        assert srv.request("POST", "/pause?mode=keep", headers=key)[0] == 200
        assert post("/start_weight_update")[0] == 200
        info = trainer.call("send", 7, torch.float32, None, True, "send")
        assert post("/update_weights", {"update_info": info}) == \
            (200, {"message": "Weights updated", "num_tensors": len(original_weights)})
        assert trainer.call()[0] == "sent"
        assert post("/finish_weight_update", {"weight_version": "http-7"}) == \
            (200, {"message": "Weight update finished", "num_tensors": len(original_weights),
                   "weight_version": "http-7"})
        assert srv.request("POST", "/resume", headers=key)[0] == 200
        assert reader.result()[1] == "length"
        assert srv.request("GET", "/weight_version", headers=key) == \
            (200, {"weight_version": "http-7"})
        ref = HFReference(llama, perturbed(original_weights, 7))
        assert completions(client) == [ref.greedy(p, MAX_TOKENS) for p in prompts]

        # A trainer that dies mid-round: a 502, and the engine serves as before.
        assert post("/start_weight_update")[0] == 200
        info = trainer.call("send", 8, torch.float32, None, False, "die")
        status, body = post("/update_weights", {"update_info": info})
        assert_error(status, body, 502)
        assert "keeps the weights it had" in body["error"]["message"]
        assert srv.request("GET", "/health")[0] == 200
        assert completions(client) == [ref.greedy(p, MAX_TOKENS) for p in prompts]
    finally:
        assert srv.stop() == 0, srv.log()
