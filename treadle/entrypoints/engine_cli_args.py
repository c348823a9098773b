"""The engine's flags, and the EngineArgs they make: shared by the CLI's commands and the
benchmarks, which import this and not each other."""

from __future__ import annotations

import argparse
from typing import Any

from treadle.config import EngineArgs

_ENGINE_HELP = {
    "revision": "a Hub model's branch, tag or commit (default: main)",
    "download_dir": "the Hugging Face cache to download Hub models into and find them in "
                    "(default: HF_HUB_CACHE)",
    "dtype": "float32 | bfloat16 | float16 | auto (fp32 on CPU, bf16 on GPU)",
    "quantization": "int8: weight-only int8; gguf: a .gguf model's own Q4_0/Q4_1/Q8_0 blocks "
                    "(both for batch-1 latency; CPU, float32; opt-in)",
    "max_model_len": "longest prompt + output, in tokens (default: the model's own limit, lowered "
                     "to what the KV cache holds; past the model's limit only with "
                     "TREADLE_ALLOW_LONG_MAX_MODEL_LEN=1)",
    "block_size": "tokens per KV-cache block (default: 128 on CPU, as vLLM-CPU; 16 on GPU)",
    "num_kv_blocks": "number of KV-cache blocks (overrides --kv-cache-memory-bytes)",
    "kv_cache_memory_bytes": "KV-cache budget in bytes (default on CPU: what max_num_seqs "
                             "sequences of max_model_len tokens use, at most 1 GiB and a quarter "
                             "of the available memory)",
    "gpu_memory_utilization": "share of the GPU's memory the engine may use, the KV cache taking "
                              "what the weights and a profile step leave (CUDA)",
    "max_num_seqs": "most requests in one step",
    "max_num_batched_tokens": "most tokens in one step (prefill chunks + decodes)",
    "scheduling_policy": "fcfs | priority",
    "seed": "engine seed for requests that bring none",
    "device": "cpu | cuda (default: cuda when available)",
    "attention_backend": "cpu (the C++ kernels) | torch | triton (CUDA, or TRITON_INTERPRET=1) "
                         "(default: the fastest for the device)",
    "pipeline_parallel_size": "pipeline stages (worker processes split the layers)",
    "tensor_parallel_size": "tensor-parallel ranks per stage (they split the heads)",
    "distributed_executor_backend": "uni | mp | ray (default: uni with one worker, else mp)",
    "master_port": "torch.distributed rendezvous port for mp and ray workers (default: a free one)",
    "max_worker_restarts": "times a failed worker group is replaced, its requests resumed",
}


def add_engine_args(parser: argparse.ArgumentParser, with_model: bool = True) -> None:
    group = parser.add_argument_group("engine")
    if with_model:
        group.add_argument("--model", default=None,
                           help="HF folder, .gguf file or Hugging Face Hub id, e.g. "
                                "Qwen/Qwen3-0.6B (default: embedded SmolLM2-135M-Instruct)")
    defaults = EngineArgs()
    for name, text in _ENGINE_HELP.items():
        default = getattr(defaults, name)
        kind = (str if name in ("revision", "download_dir", "dtype", "quantization",
                                "scheduling_policy", "device",
                                "attention_backend", "distributed_executor_backend")
                else float if name == "gpu_memory_utilization" else int)
        group.add_argument("--" + name.replace("_", "-"), type=kind, default=default,
                           help=f"{text} [default: {default}]")
    # Both spellings, as vLLM's flags: --enable-prefix-caching and --no-enable-prefix-caching.
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=True, help="prefix caching [default: on]")
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                       default=True, help="chunked prefill [default: on]")
    group.add_argument("--enforce-eager", action="store_true",
                       help="no CUDA graphs: every decode step launches its kernels from Python")
    group.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="schedule the next step while the current one runs [default: on "
                            "for one GPU with no drafts and no KV connector, else off]")
    group.add_argument("--speculative-config", default=None, metavar="JSON",
                       help='speculative decoding, e.g. \'{"method": "ngram", '
                            '"num_speculative_tokens": 3}\'')
    group.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                       help='a KV connector, e.g. \'{"kv_connector": "SharedStorageConnector", '
                            '"kv_role": "kv_both", "kv_connector_extra_config": '
                            '{"shared_storage_path": "/tmp/kv"}}\'')
    group.add_argument("--kv-offloading-size", type=float, default=None, metavar="GiB",
                       help="a tier of KV blocks in host memory of this size (an "
                            "OffloadingConnector; not with --kv-transfer-config)")
    group.add_argument("--weight-transfer-config", default=None, metavar="JSON",
                       help='weights streamed from a trainer process: \'{"backend": "gloo"}\' '
                            '(CPU) or "nccl" (CUDA), and optionally "timeout_s"')
    group.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                       help="request defaults (temperature, top_p, top_k, min_p, "
                            "repetition_penalty, max_new_tokens) from the model's "
                            "generation_config.json (auto), none (vllm: the engine's own), or a "
                            "folder's [default: auto]")
    group.add_argument("--override-generation-config", default=None, metavar="JSON",
                       help='generation-config keys on top of it, e.g. \'{"temperature": 0.5}\'')
    group.add_argument("--structured-outputs-config", default=None, metavar="JSON",
                       help='structured outputs: \'{"backend": "xgrammar"}\' (default) or '
                            '"guidance", "compilation_timeout_s", "reasoning_parser", '
                            '"enable_in_reasoning"')


def engine_args_from(ns: argparse.Namespace) -> dict[str, Any]:
    names = EngineArgs.field_names()
    return {k: v for k, v in vars(ns).items() if k in names}
