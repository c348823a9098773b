"""The model runner's RL controls over its weights and memory: in-place weight updates and
full reloads (both re-pack packed weights and keep CUDA graphs valid), the dry-run check
behind them, and sleep / wake_up.

A mixin of ModelRunner (worker/model_runner.py), as vLLM's runner takes its connector and LoRA
parts: it uses the runner's `model`, `device`, `on_device`, `kv_caches`, `graphs` and
`_param_shapes`, and its cache and graph methods.
"""

from __future__ import annotations

from typing import Iterable

import torch

from treadle.gc_freeze import collect_frozen_garbage
from treadle.models.loader import iter_hf_weights, prepare_model


class WeightControls:
    _weights_discarded = False   # by sleep(level=2), until a full load
    _weights_offloaded = False   # moved to host memory by sleep(level=1), until wake_up
    # A weight change failed after its first copy: the model holds part of it (and packed
    # copies or graphs perhaps of neither), so the engine serves nothing more (engine/core.py).
    torn_weights = False

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       local: bool = False) -> int:
        """Copy transformers-named tensors into the model in place; returns how many were set.

        A subset is fine, except after sleep(level=2), when every weight must come back.
        With local=True they are the model's local_weights: this rank's parts, already cut.
        """
        return self._copy_weights(named_tensors, strict=self._weights_discarded, local=local)

    def load_weights(self, path: str) -> int:
        """Reload every weight from a folder or GGUF of the same architecture."""
        return self._copy_weights(iter_hf_weights(prepare_model(path)), strict=True)

    def check_weights(self, source: list[tuple[str, tuple[int, ...]]] | str) -> None:
        """Raise as update_weights (given (name, shape) pairs) or load_weights (given a path)
        would, changing nothing."""
        if isinstance(source, str):
            named_shapes = ((n, tuple(t.shape)) for n, t in iter_hf_weights(prepare_model(source)))
            strict = True
        else:
            named_shapes, strict = source, self._weights_discarded
        self._check_awake()
        if self._weights_discarded:   # the weights a full load will fill anyway
            self._materialize_weights()
        self.model.check_weights(named_shapes, strict)

    def _copy_weights(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool,
                      local: bool = False) -> int:
        self._check_awake()
        if self._weights_discarded:
            self._materialize_weights()

        def tearing() -> None:
            self.torn_weights = True

        # Re-packs a packed model.
        loaded = self.model.load_weights(weights, strict=strict, before_copy=tearing, local=local)
        self._weights_discarded = False
        if not self.model.is_packed:   # weights restored after sleep(level=2)
            self.model.pack_weights()
        self._keep_graphs_valid()
        self.torn_weights = False
        return len(loaded)

    def _check_awake(self) -> None:
        # Weights changed in host memory would come back without the packed copies and
        # graphs made from them on the device.
        if self._weights_offloaded:
            raise RuntimeError("sleep(level=1) moved the weights to host memory: call "
                               "wake_up(tags=['weights']) before changing them")

    def sleep(self, level: int) -> None:
        """Level 1 frees the KV cache and moves weights to host memory (a no-op on CPU);
        level 2 discards the weights as well."""
        self.free_kv_cache()
        if level >= 2:
            self.model.unpack_weights()
            for param in self.model.parameters():
                param.data = torch.empty(0, dtype=param.dtype, device=self.device)
            self._weights_discarded = True
            self._weights_offloaded = False   # gone: a full load brings them back
        else:
            self.on_device.offload(self.model)
            self._weights_offloaded = self.on_device.offloads_weights
        collect_frozen_garbage()   # in a process that froze its start-up objects (gc_freeze.py)
        self.on_device.release_cached_memory()

    def wake_up(self, tags: list[str]) -> None:
        if "weights" in tags:
            if self._weights_discarded:
                raise RuntimeError("sleep(level=2) discarded the weights: call load_weights or "
                                   "update_weights with every weight before wake_up")
            self.on_device.reload(self.model)
            self._weights_offloaded = False
        if "kv_cache" in tags and not self.kv_caches:
            self._allocate_kv_cache()
        if self.kv_caches and not self._weights_discarded:
            if self.graphs is None:
                self.capture_graphs()
            else:
                self._keep_graphs_valid()

    def _materialize_weights(self) -> None:
        """Uninitialised memory for every parameter, for a load to fill."""
        named = list(self.model.named_parameters())
        memory = self.on_device.empty([(self._param_shapes[name], param.dtype) for name, param in named])
        for (_, param), data in zip(named, memory):
            param.data = data
