"""Engine configuration: one dataclass per concern, built from flat `EngineArgs`."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch

from treadle.validate import check_seconds, json_dict
from treadle.core.kv_cache_groups import KVCacheGroups, kv_cache_groups, one_group, step_reach
from treadle.attention.backend import check_attention_backend
from treadle.executor.registry import EXECUTORS
from treadle.models.generation_config import GenerationDefaults, load_generation_defaults
from treadle.structured_output.reasoning import check_reasoning_parser

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


@dataclass
class ModelConfig:
    model: str                 # a local HF folder (a GGUF is converted into one, once)
    hf_config: Any             # transformers.PretrainedConfig
    dtype: torch.dtype
    max_model_len: int
    seed: int = 0
    # Set by the user: refused, not lowered, when the KV cache cannot hold it (EngineCore).
    max_model_len_is_explicit: bool = False
    # "int8" (models/linear.py) or "gguf" (models/gguf_weights.py): weight-only, CPU, float32
    quantization: str | None = None
    gguf_file: str | None = None   # the GGUF file `model` was converted from, if any
    download_dir: str | None = None   # the Hub cache a model given by id is found in
    # Request defaults and EOS tokens from the model's generation_config.json
    # (models/generation_config.py).
    generation: GenerationDefaults = dataclasses.field(default_factory=GenerationDefaults)

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        c = self.hf_config
        return getattr(c, "num_key_value_heads", None) or c.num_attention_heads

    @property
    def head_dim(self) -> int:
        c = self.hf_config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size


@dataclass
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None          # explicit block count wins
    kv_cache_memory_bytes: int | None = None  # else a byte budget; else sized to the machine
    # On a GPU, with neither of those: the share of the device's memory this engine may use,
    # the KV cache being what a profile step leaves of it (worker/memory_profile.py).
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # Which layers share a block table, and each group's sliding window: a request's blocks
    # behind a group's window are freed while it runs (core/kv_cache_groups.py, core/kv_cache_manager.py).
    kv_groups: KVCacheGroups = dataclasses.field(default_factory=lambda: one_group([None]))

    def bytes_per_block(self, model: ModelConfig) -> int:
        """Bytes of one block: it serves `group_size` layers (every layer, with one group)."""
        elem = torch.tensor([], dtype=model.dtype).element_size()
        return (2 * self.kv_groups.group_size * self.block_size * model.num_kv_heads
                * model.head_dim * elem)

    def capacity_tokens(self, num_blocks: int, reach: int | None = None) -> int | None:
        """The longest sequence the cache could ever hold (the null block aside); None: any.
        `reach` (`window_reach`) bounds what a windowed group holds; without it every group
        keeps all of a sequence."""
        return self.kv_groups.capacity_tokens(num_blocks - 1, self.block_size, reach)


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    enable_chunked_prefill: bool = True
    # Schedule step N+1 while step N runs (output in flight is counted in tokens per request).
    async_scheduling: bool = False


@dataclass
class SpeculativeConfig:
    """`speculative_config={"method": "ngram", "num_speculative_tokens": k, ...}`, as in vLLM."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4

    @classmethod
    def from_dict(cls, spec: dict[str, Any] | str) -> "SpeculativeConfig":
        spec = dict(_json_fields("speculative_config", spec, cls))
        # As vLLM: one n-gram bound given sets the other (both left out: treadle's 2 and 4).
        if "prompt_lookup_min" in spec and "prompt_lookup_max" not in spec:
            spec["prompt_lookup_max"] = spec["prompt_lookup_min"]
        elif "prompt_lookup_max" in spec and "prompt_lookup_min" not in spec:
            spec["prompt_lookup_min"] = spec["prompt_lookup_max"]
        config = cls(**spec)
        if config.method != "ngram":
            raise ValueError(f"speculative_config method must be 'ngram', got {config.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            _check_positive(name, getattr(config, name))
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({config.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({config.prompt_lookup_max})")
        return config


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


@dataclass
class KVTransferConfig:
    """`kv_transfer_config={"kv_connector": NAME, "kv_role": ..., "kv_load_failure_policy": ...,
    "kv_connector_extra_config": {...}}`, as in vLLM (see treadle/kv_transfer/)."""

    kv_connector: str
    kv_role: str = "kv_both"
    kv_load_failure_policy: str = "recompute"
    kv_connector_extra_config: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_dict(cls, spec: dict[str, Any] | str) -> "KVTransferConfig":
        from treadle.kv_transfer.registry import connector_class

        spec = _json_fields("kv_transfer_config", spec, cls)
        if "kv_connector" not in spec:
            raise ValueError("kv_transfer_config.kv_connector is required")
        config = cls(**spec)
        connector = connector_class(config.kv_connector)   # an unknown name: ValueError
        if config.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {', '.join(KV_ROLES)}; "
                             f"got {config.kv_role!r}")
        if config.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_transfer_config.kv_load_failure_policy must be one of "
                             f"{', '.join(KV_LOAD_FAILURE_POLICIES)}; got "
                             f"{config.kv_load_failure_policy!r}")
        extra = config.kv_connector_extra_config
        if not isinstance(extra, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config must be a dict")
        missing = [k for k in connector.required_extra_keys if k not in extra]
        if missing:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config needs "
                             f"{', '.join(missing)} for {config.kv_connector}")
        connector.check_config(config)
        return config

    @classmethod
    def from_engine_args(cls, spec: dict[str, Any] | str | None, kv_offloading_size: float | None
                         ) -> "KVTransferConfig | None":
        """`kv_transfer_config`, or the one `kv_offloading_size` (GiB, vLLM's shorthand) stands
        for: a host-memory OffloadingConnector of that size."""
        if kv_offloading_size is None:
            return cls.from_dict(spec) if spec is not None else None
        if spec is not None:
            raise ValueError("give kv_offloading_size or kv_transfer_config, not both: "
                             "kv_offloading_size stands for an OffloadingConnector's "
                             "kv_transfer_config")
        size = kv_offloading_size
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not 0 < size <= 2**30:
            raise ValueError(f"kv_offloading_size must be a size in GiB > 0 (at most 2**30), "
                             f"got {size!r}")
        return cls.from_dict({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                              "kv_connector_extra_config": {"cpu_bytes_to_use": int(size * 2**30)}})


@dataclass
class StructuredOutputsConfig:
    """`structured_outputs_config={"backend": "xgrammar" | "guidance"}`, as in vLLM."""

    backend: str = "xgrammar"
    # With a reasoning parser, a grammar binds once the output's reasoning has ended
    # (structured_output/reasoning.py); with enable_in_reasoning, from the first token.
    reasoning_parser: str | None = None
    enable_in_reasoning: bool = False
    # A grammar not compiled within this many seconds ends its request (0: no limit). vLLM has
    # VLLM_REGEX_COMPILATION_TIMEOUT_S (5 s, regexes only); here every kind, with room for a
    # slow CPU: a 2000-property JSON schema takes 5.5 s on a shared Xeon core.
    compilation_timeout_s: float = 10.0

    @classmethod
    def from_dict(cls, spec: dict[str, Any] | str) -> "StructuredOutputsConfig":
        from treadle.structured_output.registry import check_backend

        config = cls(**_json_fields("structured_outputs_config", spec, cls))
        check_backend(config.backend)   # an unknown name: ValueError
        if config.reasoning_parser is not None:
            check_reasoning_parser(config.reasoning_parser,
                                   "structured_outputs_config.reasoning_parser")
        if not isinstance(config.enable_in_reasoning, bool):
            raise ValueError(f"structured_outputs_config.enable_in_reasoning must be true or "
                             f"false, got {config.enable_in_reasoning!r}")
        check_seconds("structured_outputs_config.compilation_timeout_s",
                         config.compilation_timeout_s, zero_ok=True, zero_means="0: no limit")
        return config


WEIGHT_TRANSFER_BACKENDS = ("gloo", "nccl")


@dataclass
class WeightTransferConfig:
    """`weight_transfer_config={"backend": "gloo" | "nccl"}`, as in vLLM: a trainer process
    broadcasts new weights to every worker (treadle/distributed/weight_transfer.py). gloo is the
    CPU transport, NCCL the GPU one. `timeout_s` bounds each step of a transfer (setting up the
    group, one broadcast); an init_info's "timeout" overrides it for that group."""

    backend: str = "gloo"
    timeout_s: float = 300.0

    @classmethod
    def from_dict(cls, spec: dict[str, Any] | str) -> "WeightTransferConfig":
        config = cls(**_json_fields("weight_transfer_config", spec, cls))
        if config.backend not in WEIGHT_TRANSFER_BACKENDS:
            raise ValueError(f"weight_transfer_config.backend must be one of "
                             f"{', '.join(WEIGHT_TRANSFER_BACKENDS)}; got {config.backend!r}")
        check_seconds("weight_transfer_config.timeout_s", config.timeout_s)
        return config

    def check_device(self, device: str) -> None:
        if self.backend == "nccl" and not device.startswith("cuda"):
            raise ValueError(f"weight_transfer_config.backend 'nccl' needs a CUDA device, the "
                             f"engine runs on {device!r}: use 'gloo'")


@dataclass
class ParallelConfig:
    """How the model is split over worker processes: `pipeline_parallel_size` stages of layers,
    each split `tensor_parallel_size` ways. Rank = pp_rank * tensor_parallel_size + tp_rank."""

    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "uni"
    master_port: int | None = None   # torch.distributed's rendezvous; None: a free port
    # Times a failed worker group is replaced, its requests resumed by recompute (mp only);
    # 0: a failure ends the engine.
    max_worker_restarts: int = 0

    @property
    def world_size(self) -> int:
        return self.pipeline_parallel_size * self.tensor_parallel_size

    def check_model(self, model: "ModelConfig") -> None:
        """Refuse a split the model cannot take, naming the numbers that do not divide."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        heads, kv_heads = model.hf_config.num_attention_heads, model.num_kv_heads
        if heads % tp:
            raise ValueError(f"tensor_parallel_size {tp} must divide the model's "
                             f"{heads} attention heads")
        if (kv_heads % tp) if kv_heads >= tp else (tp % kv_heads):
            raise ValueError(f"tensor_parallel_size {tp} and the model's {kv_heads} KV heads "
                             "must divide one another (KV heads are replicated when fewer)")
        if model.hf_config.intermediate_size % tp:
            raise ValueError(f"tensor_parallel_size {tp} must divide the model's MLP size "
                             f"{model.hf_config.intermediate_size}")
        if model.vocab_size % tp:
            raise ValueError(f"tensor_parallel_size {tp} must divide the model's vocabulary "
                             f"of {model.vocab_size}")
        if pp > model.num_layers:
            raise ValueError(f"pipeline_parallel_size {pp} exceeds the model's "
                             f"{model.num_layers} layers")


@dataclass
class TreadleConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: str = "cpu"
    attention_backend: str | None = None   # None: the best for the device (attention/backend.py)
    # No CUDA graphs: every decode step launches its kernels from Python (worker/cuda_graphs.py).
    enforce_eager: bool = False
    speculative: SpeculativeConfig | None = None
    kv_transfer: KVTransferConfig | None = None
    weight_transfer: WeightTransferConfig | None = None
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    structured_outputs: StructuredOutputsConfig = dataclasses.field(
        default_factory=StructuredOutputsConfig)


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_host_tiers(transfer: KVTransferConfig | None) -> None:
    """At start-up, before anything is allocated: the host memory the connectors allocate whole
    (a host KV tier: pinned on a GPU, where too much fails obscurely; on a CPU its pages come
    as blocks are written, and too much ends in the OOM killer) fits in what is available."""
    if transfer is None:
        return
    from treadle.kv_transfer.registry import connector_class

    size = connector_class(transfer.kv_connector).host_bytes(transfer)
    available = available_memory_bytes()
    if size > available:
        raise ValueError(
            f"the host KV tier's size (kv_offloading_size, or cpu_bytes_to_use in "
            f"kv_connector_extra_config) is {size / 2**30:.2f} GiB, more than the "
            f"{available / 2**30:.2f} GiB of host memory available now: lower it, leaving "
            f"room for the model")


def _async_scheduling(setting: bool | None, device: str, measured: bool = True) -> bool:
    """The engine's async_scheduling: as set, or (None) on CUDA where it was `measured`
    faster (docs/performance.md, "On a GPU")."""
    if setting is None:
        return device.startswith("cuda") and measured
    if not isinstance(setting, bool):
        raise ValueError(f"async_scheduling must be true, false or None (on for CUDA, off "
                         f"elsewhere), got {setting!r}")
    return setting


@dataclass
class EngineArgs:
    """Flat engine arguments, named as in vLLM; `create_config` validates and groups them."""

    model: str | None = None
    # A Hub id's branch, tag or commit (None: main), and the Hub cache to use (None: HF_HUB_CACHE).
    revision: str | None = None
    download_dir: str | None = None
    dtype: str = "auto"
    quantization: str | None = None
    max_model_len: int | None = None
    block_size: int | None = None   # None: 128 on CPU, 16 on GPU, as vLLM
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    # None: on for one CUDA device with no drafts and no KV connector, where the host's next
    # step overlaps the device's (1.4x the output tokens of 256 requests on an H200,
    # docs/performance.md; vLLM turns it on by default too), off elsewhere: on CPUs the host
    # and the "device" share the cores (docs/performance-log.md), and the rest is unmeasured.
    async_scheduling: bool | None = None
    speculative_config: dict[str, Any] | str | None = None
    kv_transfer_config: dict[str, Any] | str | None = None
    kv_offloading_size: float | None = None   # GiB of host memory for KV (OffloadingConnector)
    weight_transfer_config: dict[str, Any] | str | None = None
    structured_outputs_config: dict[str, Any] | str | None = None
    # "deepseek_r1" | "qwen3": grammars bind after the reasoning (structured_outputs_config's).
    reasoning_parser: str | None = None
    seed: int = 0
    device: str | None = None
    attention_backend: str | None = None   # "cpu" | "torch" | "triton"; None: best for the device
    enforce_eager: bool = False   # no CUDA graphs of decode steps
    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    # "uni" (in this process), "mp" (worker processes) or "ray"; None: uni at world size 1, else mp.
    distributed_executor_backend: str | None = None
    master_port: int | None = None
    max_worker_restarts: int = 0
    # "auto": the model's generation_config.json sets the defaults of requests that leave
    # temperature, top_p, top_k, min_p, repetition_penalty or max_tokens unset; "vllm": the
    # engine's own defaults; or a folder with a generation_config.json. Overrides: its keys.
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | str | None = None

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def create_config(self) -> TreadleConfig:
        from treadle.models.loader import is_gguf, load_hf_config, prepare_model, resolve_model

        start = time.perf_counter()
        # Checked before the model is touched: a typo must not cost a model load.
        kv_transfer = KVTransferConfig.from_engine_args(self.kv_transfer_config,
                                                        self.kv_offloading_size)
        _check_host_tiers(kv_transfer)
        weight_transfer = (WeightTransferConfig.from_dict(self.weight_transfer_config)
                           if self.weight_transfer_config is not None else None)
        parallel = self._parallel_config()
        structured = self._structured_outputs_config()
        device = self.device or _default_device()
        _check_device(device)
        if weight_transfer is not None:
            weight_transfer.check_device(device)
        if self.attention_backend is not None:
            check_attention_backend(self.attention_backend, torch.device(device))
        for name in ("revision", "download_dir"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string or None, got {value!r}")
        # Before the model is touched, as a model on the Hub may have to be downloaded.
        dtype = _resolve_dtype(self.dtype, device)
        source = resolve_model(self.model, self.revision, self.download_dir)
        gguf_file = source if is_gguf(source) else None
        _check_quantization(self.quantization, dtype, device, gguf_file, parallel.tensor_parallel_size)
        path = prepare_model(source)
        hf_config = load_hf_config(path)
        check_model_fields(hf_config)
        generation = load_generation_defaults(path, self.generation_config,
                                              self.override_generation_config,
                                              getattr(hf_config, "eos_token_id", None))
        if generation.sampling or generation.max_tokens is not None:
            shown = {**generation.sampling, "max_new_tokens": generation.max_tokens}
            logger.info("request defaults from the model's generation config: %s (a request's "
                        "own values win; --generation-config vllm ignores them)",
                        ", ".join(f"{k}={v}" for k, v in sorted(shown.items()) if v is not None))

        max_model_len = _max_model_len(self.max_model_len, hf_config)
        block_size = self.block_size if self.block_size is not None else default_block_size(device)
        _check_positive("block_size", block_size)
        _check_positive("max_num_seqs", self.max_num_seqs)
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 (one is the null block), got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes is not None:
            _check_positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if (self.num_kv_blocks is not None and self.max_model_len is not None
                and None in layer_windows(hf_config)):
            # Known before the weights load, so refused before: the engine checks it again
            # for a cache sized from a budget. (With every layer windowed, a request holds
            # only its window's blocks: any length fits.)
            capacity = (self.num_kv_blocks - 1) * block_size   # (a hybrid model's is less)
            if max_model_len > capacity:
                raise ValueError(
                    f"max_model_len ({max_model_len}) is more than the KV cache can hold "
                    f"({capacity} tokens: {self.num_kv_blocks} blocks of {block_size}, one kept "
                    f"empty); lower max_model_len to at most {capacity}, or raise num_kv_blocks")

        max_batched = self.max_num_batched_tokens
        if max_batched is None:
            max_batched = 2048 if self.enable_chunked_prefill else max_model_len
        _check_positive("max_num_batched_tokens", max_batched)
        if not self.enable_chunked_prefill and max_batched < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({max_batched}) must be >= max_model_len ({max_model_len}) "
                "when chunked prefill is disabled")

        model_cfg = ModelConfig(model=path, hf_config=hf_config, dtype=dtype,
                                download_dir=self.download_dir,
                                max_model_len=max_model_len, seed=self.seed,
                                quantization=self.quantization, gguf_file=gguf_file,
                                max_model_len_is_explicit=self.max_model_len is not None,
                                generation=generation)
        cache_cfg = CacheConfig(block_size=block_size, num_kv_blocks=self.num_kv_blocks,
                                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                                gpu_memory_utilization=self.gpu_memory_utilization,
                                enable_prefix_caching=self.enable_prefix_caching,
                                kv_groups=kv_cache_groups(layer_windows(hf_config),
                                                          hybrid=kv_transfer is None))
        spec_cfg = (SpeculativeConfig.from_dict(self.speculative_config)
                    if self.speculative_config is not None else None)
        # Where async scheduling measured faster: one GPU whose runner defers its steps (none
        # with drafts or a KV connector, whose steps would wait on a worker thread instead).
        measured = spec_cfg is None and kv_transfer is None and parallel.world_size == 1
        sched_cfg = SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                    max_num_batched_tokens=max_batched,
                                    scheduling_policy=self.scheduling_policy,  # type: ignore[arg-type]
                                    enable_chunked_prefill=self.enable_chunked_prefill,
                                    async_scheduling=_async_scheduling(self.async_scheduling,
                                                                       device, measured))
        parallel.check_model(model_cfg)
        _check_devices_per_rank(device, parallel)
        if spec_cfg is not None and parallel.pipeline_parallel_size > 1:
            raise ValueError("speculative decoding with pipeline_parallel_size > 1 is not "
                             "supported: drop speculative_config or use one stage")
        # A start-up stage of its own: the grammar engine's and transformers' imports take seconds.
        logger.info("engine config in %.1f s: %s, %s, max_model_len %d, %s", time.perf_counter()
                    - start, path, str(dtype).removeprefix("torch."), max_model_len, device)
        return TreadleConfig(model=model_cfg, cache=cache_cfg, scheduler=sched_cfg, device=device,
                             attention_backend=self.attention_backend,
                             enforce_eager=self.enforce_eager,
                             speculative=spec_cfg, kv_transfer=kv_transfer, parallel=parallel,
                             structured_outputs=structured, weight_transfer=weight_transfer)

    def _structured_outputs_config(self) -> StructuredOutputsConfig:
        spec = self.structured_outputs_config or {}
        if self.reasoning_parser is not None:   # vLLM's flag, the config's key
            check_reasoning_parser(self.reasoning_parser, "reasoning_parser")
            spec = json_dict("structured_outputs_config", spec)
            if spec.get("reasoning_parser", self.reasoning_parser) != self.reasoning_parser:
                raise ValueError(f"reasoning_parser is {self.reasoning_parser!r} but "
                                 f"structured_outputs_config.reasoning_parser is "
                                 f"{spec['reasoning_parser']!r}: give one")
            spec = {**spec, "reasoning_parser": self.reasoning_parser}
        return StructuredOutputsConfig.from_dict(spec)

    def _parallel_config(self) -> ParallelConfig:
        _check_positive("pipeline_parallel_size", self.pipeline_parallel_size)
        _check_positive("tensor_parallel_size", self.tensor_parallel_size)
        world_size = self.pipeline_parallel_size * self.tensor_parallel_size
        backend = self.distributed_executor_backend or ("uni" if world_size == 1 else "mp")
        if backend not in EXECUTORS:
            raise ValueError(f"distributed_executor_backend must be one of "
                             f"{', '.join(sorted(EXECUTORS))}; got {backend!r}")
        if backend == "uni" and world_size > 1:
            raise ValueError(f"distributed_executor_backend 'uni' runs one worker; world size "
                             f"{world_size} needs 'mp'")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535, got {self.master_port}")
        if not isinstance(self.max_worker_restarts, int) or self.max_worker_restarts < 0:
            raise ValueError(f"max_worker_restarts must be an integer >= 0, "
                             f"got {self.max_worker_restarts!r}")
        if self.max_worker_restarts and backend != "mp":
            # uni: the worker shares this process, so a failure there ends the engine. ray:
            # Ray's own actor restarts are the tool there, and ours is untested with it.
            raise ValueError("max_worker_restarts replaces worker processes: it needs "
                             f"distributed_executor_backend 'mp', got {backend!r}")
        return ParallelConfig(self.pipeline_parallel_size, self.tensor_parallel_size,
                              backend, self.master_port, self.max_worker_restarts)


def _json_fields(name: str, spec: dict[str, Any] | str, cls: type) -> dict[str, Any]:
    """A dict argument for dataclass `cls`, or its JSON (from the command line), with no key
    the dataclass does not have."""
    return json_dict(name, spec, {f.name for f in dataclasses.fields(cls)})


ALLOW_LONG_MAX_MODEL_LEN = "TREADLE_ALLOW_LONG_MAX_MODEL_LEN"


def _max_model_len(requested: int | None, hf_config: Any) -> int:
    """The user's max_model_len, or the model's own limit; past that limit only with
    TREADLE_ALLOW_LONG_MAX_MODEL_LEN=1 (vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN)."""
    model_max = getattr(hf_config, "max_position_embeddings", None)
    if requested is None:
        return model_max or 2048
    _check_positive("max_model_len", requested)
    if model_max is not None and requested > model_max:
        if os.environ.get(ALLOW_LONG_MAX_MODEL_LEN) != "1":
            raise ValueError(
                f"max_model_len ({requested}) is longer than the model's max_position_embeddings "
                f"({model_max}); lower it, or set {ALLOW_LONG_MAX_MODEL_LEN}=1 to allow it "
                "(positions past the model's are ones it was never trained on)")
        logger.warning("max_model_len %d is past the model's max_position_embeddings %d "
                       "(%s=1); output past position %d may be garbage", requested, model_max,
                       ALLOW_LONG_MAX_MODEL_LEN, model_max)
    return requested


def check_model_fields(hf_config: Any) -> None:
    """Refuse, naming the field, what the model classes would otherwise run silently wrong or
    crash on deep inside (a kernel, or the first step), before any worker starts."""
    from treadle.models.rope import rope_inv_freq

    # Every MLP here but Gemma's is SiLU-and-mul, whatever the config says; Gemma's configs
    # name theirs `hidden_activation`, which its model checks.
    activation = getattr(hf_config, "hidden_act", None) or "silu"
    if not hasattr(hf_config, "hidden_activation") and activation not in ("silu", "swish"):
        raise ValueError(f"config hidden_act {activation!r} is not supported (only silu)")
    window = getattr(hf_config, "sliding_window", None)
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 0):
        raise ValueError(f"config sliding_window must be a positive integer or null, got {window!r}")
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    top_k = getattr(hf_config, "num_experts_per_tok", None)
    if experts and top_k is not None and not 1 <= top_k <= experts:
        raise ValueError(f"config num_experts_per_tok ({top_k}) must be in 1..{experts}, the "
                         "number of experts")
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        raise ValueError(f"config num_attention_heads ({heads}) must be a multiple of "
                         f"num_key_value_heads ({kv_heads})")
    rope_inv_freq(hf_config, 2)   # an unsupported rope_type, named, before the workers start


def sliding_window(hf_config: Any) -> int | None:
    """The window of the model's sliding-window layers, or None where every layer attends to
    every earlier token (Qwen2 and Qwen3 configs carry a window they do not use). Which layers
    have it: models/llama.py's `layer_window`."""
    window = getattr(hf_config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    return window if getattr(hf_config, "use_sliding_window", True) else None


def layer_window(hf_config: Any, index: int) -> int | None:
    """Layer `index`'s sliding window, or None where it attends to every earlier token."""
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None and layer_types[index] != "sliding_attention":
        return None
    return sliding_window(hf_config)


def layer_windows(hf_config: Any) -> list[int | None]:
    """Every layer's sliding window (None: full attention)."""
    return [layer_window(hf_config, i) for i in range(hf_config.num_hidden_layers)]


def _check_devices_per_rank(device: str, parallel: ParallelConfig) -> None:
    """On CUDA each worker has a GPU of its own: `mp` gives rank r this machine's GPU r (Ray
    gives each actor one), so `mp` needs as many GPUs as ranks, and a fixed device index
    cannot serve several."""
    world = parallel.world_size
    if not device.startswith("cuda") or world == 1:
        return
    if ":" in device:
        raise ValueError(f"device {device!r} names one GPU, but {world} workers each need their "
                         "own: use device='cuda'")
    if parallel.distributed_executor_backend == "mp" and torch.cuda.device_count() < world:
        raise ValueError(f"{world} workers (pipeline_parallel_size x tensor_parallel_size) need "
                         f"{world} GPUs, one each; this machine has {torch.cuda.device_count()}")


def _check_device(device: str) -> None:
    """Checked before the model is loaded, so a machine without CUDA says so in one line."""
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} was asked for, but CUDA is not available here "
                             f"(torch {torch.__version__}, {torch.cuda.device_count()} GPUs "
                             "visible); use device 'cpu' (--device cpu)")
        if index and int(index) >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} was asked for, but only "
                             f"{torch.cuda.device_count()} CUDA devices are visible")


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _check_quantization(quantization: str | None, dtype: torch.dtype, device: str, gguf_file: str | None,
                        tensor_parallel_size: int) -> None:
    if quantization is None:
        return
    if quantization not in ("int8", "gguf"):
        raise ValueError(f"quantization must be None, 'int8' or 'gguf' (weight-only), got {quantization!r}")
    if not device.startswith("cpu") or dtype != torch.float32:
        raise ValueError(f"quantization={quantization!r} runs on CPU in float32 (the activations and the "
                         f"rest of the model); got device={device!r}, dtype={str(dtype).split('.')[-1]}")
    if quantization == "gguf" and gguf_file is None:
        raise ValueError("quantization='gguf' runs a GGUF file's own blocks: model must be a .gguf file")
    if quantization == "gguf" and tensor_parallel_size > 1:
        raise ValueError(f"quantization='gguf' needs tensor_parallel_size=1, got {tensor_parallel_size}")


def default_block_size(device: str) -> int:
    """Tokens per KV block when none is given: 128 on CPU, as vLLM-CPU, since decode attention
    reads each block of a sequence as one run and longer runs keep more of the memory's
    bandwidth (docs/performance-log.md); 16 on GPU."""
    return 128 if device.startswith("cpu") else 16


def _resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        # fp32 on CPU keeps greedy output identical to the transformers reference.
        return torch.float32 if device == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(sorted(_DTYPES))}; got {dtype!r}")
    return _DTYPES[dtype]


def available_memory_bytes() -> int:
    """Memory this process could still use on the host."""
    try:
        import psutil
        return int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover - psutil ships with our deps
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def max_steps_in_flight(config: TreadleConfig) -> int:
    """The batch queue's depth: a step per pipeline stage, and one more with async scheduling
    (scheduled while the others run)."""
    return config.parallel.pipeline_parallel_size + int(config.scheduler.async_scheduling)


def window_reach(config: TreadleConfig) -> int | None:
    """How far past a request's confirmed count one step can reach (core/kv_cache_groups.py
    step_reach), for this engine's budget, batch queue and drafts. None with a KV connector:
    then no block leaves behind a window (the scheduler's manager keeps whole sequences, since
    a connector saves and sends them), so every group counts as holding all of a request."""
    if config.kv_transfer is not None:
        return None
    spec = config.speculative
    return step_reach(config.scheduler.max_num_batched_tokens, max_steps_in_flight(config),
                      spec.num_speculative_tokens if spec is not None else 0)


# The most the default KV cache takes on CPU, and the share of the memory still available it
# may take: the machine's other work (and the model's activations) need the rest.
CPU_KV_CACHE_MAX_BYTES = 1 << 30
CPU_KV_CACHE_MEMORY_FRACTION = 0.25


def kv_cache_sized_by_profile(config: TreadleConfig) -> bool:
    """Whether the KV cache is what a profile step leaves of gpu_memory_utilization (on a
    GPU, with neither num_kv_blocks nor kv_cache_memory_bytes given)."""
    cache = config.cache
    return (config.device.startswith("cuda") and cache.num_kv_blocks is None
            and cache.kv_cache_memory_bytes is None)


def num_blocks_from_budget(config: TreadleConfig, per_block: int | None = None,
                           profiled_kv_bytes: int | None = None) -> int:
    """How many KV blocks to allocate: explicit count, byte budget, or sized to the machine.
    `per_block`: bytes of one block on this worker (its layers and KV heads); else the model's.
    `profiled_kv_bytes`: on a GPU, what the worker's profile left for the KV cache
    (`kv_cache_sized_by_profile`).

    On CPU the default is what `max_num_seqs` requests of `max_model_len` tokens can use, and no
    more, bounded by a quarter of the available memory and by 1 GiB (shared by the workers).
    """
    cache, model = config.cache, config.model
    per_block = per_block or cache.bytes_per_block(model)
    if cache.num_kv_blocks is not None:
        num_blocks, reason = cache.num_kv_blocks, "num_kv_blocks"
    elif cache.kv_cache_memory_bytes is not None:
        num_blocks = cache.kv_cache_memory_bytes // per_block
        reason = f"kv_cache_memory_bytes={cache.kv_cache_memory_bytes}"
    elif config.device.startswith("cuda"):
        assert profiled_kv_bytes is not None, "a GPU's KV cache is sized by a profile step"
        num_blocks = profiled_kv_bytes // per_block
        reason = f"gpu_memory_utilization {cache.gpu_memory_utilization}, after a profile step"
    else:
        num_blocks, reason = _default_cpu_blocks(config, per_block)
    if num_blocks < 2:
        raise ValueError(
            f"the KV cache ({reason}) holds {num_blocks} blocks of {per_block} bytes, fewer "
            "than 2; raise kv_cache_memory_bytes or num_kv_blocks")
    logger.info("KV cache: %d blocks of %d tokens, %.1f MiB (%s)", num_blocks, cache.block_size,
                num_blocks * per_block / 2**20, reason)
    return num_blocks


def _default_cpu_blocks(config: TreadleConfig, per_block: int) -> tuple[int, str]:
    """(blocks, why) for a CPU cache sized by default: every sequence at its longest (in every
    KV cache group, a windowed one holding its window's share), plus the null block, unless
    memory bounds it first."""
    max_seqs, max_len = config.scheduler.max_num_seqs, config.model.max_model_len
    cache = config.cache
    needed = max_seqs * cache.kv_groups.peak_blocks(max_len, cache.block_size, window_reach(config)) + 1
    world = config.parallel.world_size
    available = available_memory_bytes()
    bounds = [(needed, f"max_num_seqs {max_seqs} x max_model_len {max_len}"),
              (int(available * CPU_KV_CACHE_MEMORY_FRACTION) // world // per_block,
               f"{CPU_KV_CACHE_MEMORY_FRACTION:.0%} of {available / 2**30:.1f} GiB available"),
              (CPU_KV_CACHE_MAX_BYTES // world // per_block,
               f"the {CPU_KV_CACHE_MAX_BYTES / 2**20:.0f} MiB default cap")]
    if world > 1:
        bounds[1:] = [(n, f"{why}, over {world} workers") for n, why in bounds[1:]]
    return min(bounds, key=lambda bound: bound[0])


__all__ = ["EngineArgs", "TreadleConfig", "ModelConfig", "CacheConfig", "SchedulerConfig",
           "SpeculativeConfig", "KVTransferConfig", "ParallelConfig", "StructuredOutputsConfig",
           "num_blocks_from_budget", "max_steps_in_flight", "window_reach"]
