"""The shared-storage KV connector's set-up, shared by test_kv_transfer.py and
test_kv_engine_controls.py: its configuration, the prompts, and a store a producer filled.

The fixtures are module-scoped, as they were in test_kv_transfer.py: a module that uses them
imports them (`from tests.kv_fixtures import prompts, store`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_correctness import TEXTS
from treadle import LLM, SamplingParams
from treadle.models.loader import load_tokenizer

MAX_TOKENS = 12
BLOCK = 16   # the prompts are a few blocks long (a CPU engine defaults to 128)


def kv_config(path: Path, role: str, policy: str = "recompute", **extra) -> dict:
    """A SharedStorageConnector's kv_transfer_config on the folder `path`."""
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"shared_storage_path": str(path), **extra}}


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def core_request(engine, request_id: str):
    """The engine-core Request behind a client's request (its first sample): the core's ids
    are the engine's own (invariant 6), not the client's."""
    sample = engine.output_processor.requests[request_id].samples[0]
    return engine.core.scheduler.requests[sample.engine_id]


def connector_of(llm: LLM):
    """The worker side of the engine's connector (its counters tell what moved)."""
    return llm.engine.core.executor.worker.runner.connector


def copy_store(store: Path, tmp_path: Path) -> Path:
    """A copy of the store's files, for a test that writes to or damages its store."""
    target = tmp_path / "kv"
    target.mkdir()
    for f in store.iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    return target


@pytest.fixture(scope="module")
def prompts(llama) -> list[list[int]]:
    tok = load_tokenizer(llama)
    long = tok.encode(" ".join(TEXTS))          # ~90 tokens: five blocks of 16
    return [long, long[:40], tok.encode(TEXTS[2]), tok.encode(TEXTS[0])[:9]]


@pytest.fixture(scope="module")
def store(tmp_path_factory, llama, prompts) -> Path:
    """A folder a producer filled with the prompts' KV (it ran each prompt for one token)."""
    path = tmp_path_factory.mktemp("kv-store")
    producer = LLM(llama, block_size=BLOCK, kv_transfer_config=kv_config(path, "kv_producer"))
    outs = producer.generate([{"prompt_token_ids": p} for p in prompts], greedy(1), use_tqdm=False)
    assert connector_of(producer).num_saved_blocks > 0
    # What a P/D proxy hands to the decode side: where the KV went, and how much of it.
    assert [o.kv_transfer_params for o in outs] == [
        {"shared_storage_path": str(path), "num_stored_blocks": len(p) // BLOCK} for p in prompts]
    producer.engine.core.scheduler.kv_cache.assert_no_leaks()
    return path
