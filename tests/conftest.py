"""Shared fixtures: the embedded model, tiny checkpoints, and the transformers reference."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.reference import HFReference
from tests.tiny_models import make_tiny_checkpoint
from treadle.models.loader import default_model_path


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_checkpoint(arch, root / arch) for arch in ("llama", "qwen2", "qwen3")}


@functools.lru_cache(maxsize=None)
def _reference(path: str) -> HFReference:
    return HFReference(path)


@pytest.fixture(scope="session")
def reference():
    """reference(path) -> HFReference for that model, built once per session."""
    return _reference
