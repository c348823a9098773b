"""Attention backends by name and device (treadle/attention/backend.py): which one runs, the
errors for one that cannot, and the `torch` backend beside the C++ kernels matching
transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from treadle import LLM, SamplingParams
from treadle.attention.backend import BACKENDS, auto_backend_name, create_attention_backend
from treadle.attention.cpu_backend import CpuKernelBackend, CpuKernelMetadata
from treadle.attention.torch_backend import TorchBackend, TorchMetadata
from treadle.config import EngineArgs
from treadle.entrypoints.cli import build_parser
from treadle.entrypoints.engine_cli_args import engine_args_from
from treadle.models import layer_stack

from tests.kernel_support import CPU, needs_kernels
from tests.test_correctness import assert_matches_reference, prompt_ids


@needs_kernels
def test_the_kernels_serve_the_cpu_unless_torch_is_named():
    assert isinstance(create_attention_backend(None, CPU, 16), CpuKernelBackend)
    assert isinstance(create_attention_backend("torch", CPU, 16), TorchBackend)


def test_the_best_backend_on_a_gpu_is_triton_where_it_runs(monkeypatch):
    """Triton with its decode CUDA graphs is the GPU engine (on an H200: docs/performance.md,
    "On a GPU"); plain torch where Triton cannot run. The interpreter, which runs Triton on a
    CPU, never takes a CPU's default."""
    from treadle.attention.triton_backend import TritonBackend

    monkeypatch.setattr(TritonBackend, "unavailable", classmethod(lambda cls, device: None))
    assert auto_backend_name(torch.device("cuda")) == "triton"
    assert auto_backend_name(CPU) in ("cpu", "torch")
    monkeypatch.setattr(TritonBackend, "unavailable", classmethod(lambda cls, device: "none"))
    assert auto_backend_name(torch.device("cuda")) == "torch"


def test_the_default_backend_gives_way_to_torch_for_what_triton_cannot_serve(tmp_path, monkeypatch):
    """Triton has no sliding window or soft-cap yet: where it is the device's default (CUDA;
    here the interpreter stands in), such a model gets the torch backend; asked for by name, it
    is refused at load with the reason, not in the first step."""
    from tests.tiny_models import make_tiny_checkpoint
    from treadle.attention import backend

    path = str(tmp_path / "mistral")
    make_tiny_checkpoint("mistral", path)   # a 512-token window
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(backend, "auto_backend_name", lambda device: "triton")
    with LLM(path, num_kv_blocks=16, block_size=16) as llm:
        assert llm.engine.core.executor.worker.runner.attention.name == "torch"
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match=r"attention_backend 'triton' cannot serve .*: it has no "
                                         r"sliding window or logit soft-cap yet; use attention_backend 'torch'"):
        LLM(path, attention_backend="triton", num_kv_blocks=16, block_size=16)


def test_a_backend_that_cannot_run_is_refused_by_name():
    with pytest.raises(ValueError, match=r"attention_backend must be one of cpu, torch, triton; got 'flash'"):
        create_attention_backend("flash", CPU, 16)
    with pytest.raises(ValueError, match=r"'cpu' cannot run on cuda: its kernels are for CPUs"):
        create_attention_backend("cpu", torch.device("cuda"), 16)
    assert set(BACKENDS) == {"cpu", "torch", "triton"}   # triton: tests/test_triton_attention.py


def test_engine_args_check_the_backend_before_the_model_loads(monkeypatch):
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineArgs(attention_backend="sdpa", model="/nonexistent").create_config()
    monkeypatch.setenv("TREADLE_CPU_KERNELS", "0")
    with pytest.raises(ValueError, match="'cpu' cannot run on cpu: the C\\+\\+ kernels are not built"):
        EngineArgs(attention_backend="cpu", model="/nonexistent").create_config()


def test_the_flag_reaches_engine_args():
    ns = build_parser().parse_args(["serve", "--attention-backend", "torch"])
    assert engine_args_from(ns)["attention_backend"] == "torch"


@needs_kernels
def test_both_backends_lay_out_one_step_alike():
    """Decodes first in both, and only the kernels' metadata lets the layer stack run."""
    q_lens, ctx = np.array([1, 1, 7]), np.array([40, 3, 0])
    positions = np.concatenate([np.arange(c, c + n) for c, n in zip(ctx, q_lens)])
    table = np.arange(1, 10).reshape(3, 3)
    kernels = CpuKernelBackend(CPU, 16).build_metadata(q_lens, ctx, positions, table)
    plain = TorchBackend(CPU, 16).build_metadata(q_lens, ctx, positions, table)
    assert isinstance(kernels, CpuKernelMetadata) and isinstance(plain, TorchMetadata)
    assert kernels.num_decodes == plain.num_decodes == 2
    assert torch.equal(kernels.slot_mapping, plain.slot_mapping)
    assert layer_stack.serves(kernels) and not layer_stack.serves(plain)


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_torch_attention_beside_the_kernels_matches_transformers(tiny_checkpoints, reference, arch):
    """The C++ GEMMs and norms with the torch attention: a mix no other setting makes."""
    path = tiny_checkpoints[arch]
    # The prompts (99 tokens) fit one step of 128 as they did the default 2,048; an untied
    # head's GEMM (49,152 rows) is warmed only up to the budget at start-up.
    llm = LLM(path, block_size=16, attention_backend="torch", max_num_batched_tokens=128)
    runner = llm.engine.core.executor.worker.runner
    assert runner.native_kernels and runner.attention.name == "torch"
    assert_matches_reference(llm, reference(path), prompt_ids(llm), max_tokens=24)
