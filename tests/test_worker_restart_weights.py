"""A restarted worker group serves the weights the engine was serving, or is not started.

The files of the checkpoint or of the last load_weights can be read again; weights updated in
place cannot, whatever their label (0 used to read as "never updated", and the new workers
silently served the checkpoint)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.reference import HFReference
from tests.test_parallel import assert_exact, greedy, token_ids
from treadle import EngineArgs, EngineDeadError
from treadle.engine.llm_engine import LLMEngine

WEIGHT = "model.layers.0.input_layernorm.weight"


def perturbed(path: str, target: Path) -> tuple[str, list]:
    """A copy of the checkpoint with one weight scaled; returns it and the weight."""
    shutil.copytree(path, target)
    tensors = load_file(target / "model.safetensors")
    tensors[WEIGHT] = tensors[WEIGHT] * 1.5
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return str(target), [(WEIGHT, tensors[WEIGHT])]


def the_weight(worker):
    """Given to collective_rpc: WEIGHT, from the rank that holds it."""
    param = dict(worker.runner.model.named_parameters()).get(WEIGHT)
    return None if param is None else param.detach().clone()


def engine_with_one_restart(path: str) -> LLMEngine:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return LLMEngine.from_engine_args(EngineArgs(
        path, pipeline_parallel_size=2, async_scheduling=True, max_worker_restarts=1,
        max_num_batched_tokens=16, kv_cache_memory_bytes=4 << 20, master_port=port))


def run_with_a_worker_killed(engine: LLMEngine, prompts: list[list[int]]) -> dict:
    finals = {}
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids}, greedy())
    for _ in range(8):
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    os.kill(engine.core.executor.procs[1].pid, signal.SIGKILL)
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    return finals


def test_a_restart_after_load_weights_serves_the_loaded_weights(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints["qwen3"]
    other, overrides = perturbed(path, tmp_path / "other")
    prompts = token_ids(path)
    engine = engine_with_one_restart(path)
    try:
        engine.core.load_weights(other, weight_version="other")
        finals = run_with_a_worker_killed(engine, prompts)
        assert engine.core.num_worker_restarts == 1
        assert_exact([finals[str(i)] for i in range(len(prompts))], prompts,
                     HFReference(path, overrides=overrides))
    finally:
        engine.core.shutdown()


@pytest.mark.parametrize("label", [0, None])
def test_no_restart_after_an_update_in_place(tiny_checkpoints, label):
    path = tiny_checkpoints["qwen3"]
    engine = engine_with_one_restart(path)
    try:
        weight = next(w for w in engine.core.collective_rpc(the_weight) if w is not None)
        engine.core.update_weights([(WEIGHT, weight * 1.5)], weight_version=label)
        with pytest.raises(EngineDeadError, match="the workers were not restarted: the weights "
                                                  "were updated in place"):
            run_with_a_worker_killed(engine, token_ids(path))
        assert engine.core.num_worker_restarts == 0
    finally:
        engine.core.shutdown()
