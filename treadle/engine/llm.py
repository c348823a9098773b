"""LLM: the offline, batch API."""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Callable, Iterable, Sequence

import torch
from tqdm.auto import tqdm

from treadle.config import EngineArgs
from treadle.core.stats import SchedulerStats
from treadle.engine.input_processor import PromptType
from treadle.engine.llm_engine import LLMEngine
from treadle.gc_freeze import frozen_while_running
from treadle.outputs import RequestOutput
from treadle.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

ChatMessages = list[dict[str, Any]]


# apply_chat_template's own arguments that decide what comes back; chat_template_kwargs set the
# template's variables, not these.
CHAT_RENDER_ARGUMENTS = frozenset({
    "conversation", "tools", "chat_template", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class LLM:
    """Generate text for batches of prompts: `LLM(model=None, **engine_args)`.

    `model`: a local HF folder or .gguf file, or a Hugging Face Hub id (`revision=` picks a
    branch, tag or commit); with none, the embedded SmolLM2-135M-Instruct is used.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        unknown = set(engine_args) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"unknown engine arguments: {', '.join(sorted(unknown))}")
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_args))
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the workers (worker processes with the `mp` executor). Idempotent."""
        self.engine.core.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` sample with when given no SamplingParams: the defaults,
        with the model's generation config on top (`generation_config`, as vLLM); where it
        names max_new_tokens, max_tokens is None: that many, within the context."""
        return self.engine.config.model.generation.sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in input order.

        A prompt dict may carry a "cache_salt": only prompts with the same salt share cached
        prefixes. `priority` (lower runs first) matters with scheduling_policy="priority".
        """
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            params_list = [self.get_default_sampling_params()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priorities)} priorities")
        return self._run(prompts, params_list, priorities, use_tqdm)

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate.
        `chat_template_kwargs`: more variables for the template (e.g. enable_thinking)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        clash = sorted(set(chat_template_kwargs or ()) & (
            CHAT_RENDER_ARGUMENTS | {"messages", "add_generation_prompt", "continue_final_message"}))
        if clash:
            raise ValueError(f"chat_template_kwargs must not set {clash}: they are chat()'s own "
                             f"arguments")
        prompts = []
        for conv in conversations:
            # OpenAI content parts ({"type": "text", ...}) as text, as the server (and vLLM) do.
            conv = [{**m, "content": content_text(m["content"])}
                    if isinstance(m.get("content"), list) else m for m in conv]
            text = tokenizer.apply_chat_template(conv, tokenize=False, chat_template=chat_template,
                                                 add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message,
                                                 tools=tools, **(chat_template_kwargs or {}))
            # The template already holds the special tokens; encoding must not add more.
            prompts.append({"prompt": text,
                            "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    # -- RL controls -------------------------------------------------------------------
    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Drop cached prefixes; False while a request holds blocks, unless running requests
        are reset too (they recompute)."""
        return self.engine.reset_prefix_cache(reset_running_requests)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       weight_version: Any = None) -> int:
        """Copy (transformers parameter name, tensor) pairs into the model in place; or, given a
        weight-transfer request ({"update_info": {...}}), receive that part of a round."""
        return self.engine.core.update_weights(named_tensors, weight_version)

    def init_weight_transfer_engine(self, request: Any) -> None:
        """Join the trainer's group: {"init_info": {master_address, master_port, rank_offset,
        world_size}} (treadle/distributed/weight_transfer.py)."""
        self.engine.core.init_weight_transfer_engine(request)
        while not self.engine.core.weight_transfer_joined():
            time.sleep(0.02)

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        self.engine.core.start_weight_update(is_checkpoint_format)

    def finish_weight_update(self, weight_version: Any = None) -> int:
        """Apply the round received since start_weight_update; returns the weights set."""
        return self.engine.core.finish_weight_update(weight_version)

    def load_weights(self, path: str, weight_version: Any = None) -> int:
        """Reload every weight from an HF folder, GGUF or Hub id of the same architecture."""
        return self.engine.core.load_weights(path, weight_version)

    def get_weight_version(self) -> Any:
        return self.engine.core.weight_version

    def sleep(self, level: int = 1) -> None:
        self.engine.core.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.engine.core.wake_up(tags)

    def get_stats(self) -> SchedulerStats:
        """Running/waiting counts, KV usage, prefix-cache, preemption and spec-decode counters."""
        return self.engine.core.get_stats()

    def collective_rpc(self, method: str | Callable, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run a Worker method (by name, or a callable taking the worker) on every worker."""
        return self.engine.core.collective_rpc(method, args, kwargs)

    def _run(self, prompts: list[PromptType], params_list: list[SamplingParams],
             priorities: list[int], use_tqdm: bool) -> list[RequestOutput]:
        with frozen_while_running():   # no walk of the whole heap mid-run (gc_freeze.py)
            return self._run_frozen(prompts, params_list, priorities, use_tqdm)

    def _run_frozen(self, prompts: list[PromptType], params_list: list[SamplingParams],
                    priorities: list[int], use_tqdm: bool) -> list[RequestOutput]:
        if self.engine.core.asleep:
            raise RuntimeError("the engine is asleep: call wake_up() before generate()")
        # Tokenize and validate everything first, so one bad prompt adds none of the others.
        processor = self.engine.input_processor
        tokenized = []
        for params in {id(p): p for p in params_list}.values():   # often one for every prompt
            processor.validate_sampling(params)
        for prompt, params in zip(prompts, params_list):
            text, ids = processor.truncate(*processor.tokenize(prompt), params)
            processor.validate_length(params, len(ids))
            salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
            if salt is not None and not isinstance(salt, str):
                raise ValueError(f"cache_salt must be a string, got {type(salt).__name__}")
            tokenized.append(({"prompt": text, "prompt_token_ids": ids}, salt))
        request_ids = []
        try:
            for (prompt, salt), params, prio in zip(tokenized, params_list, priorities):
                final_only = params.clone()
                final_only.output_kind = RequestOutputKind.FINAL_ONLY
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, final_only, priority=prio, cache_salt=salt)
                request_ids.append(rid)
            results = self._drain(len(request_ids), use_tqdm)
        except BaseException:
            self.engine.abort_request(request_ids)
            raise
        return [results[rid] for rid in request_ids]

    def _drain(self, total: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=total, desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        start = time.perf_counter()
        in_tokens = out_tokens = 0
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if not out.finished:
                    continue
                results[out.request_id] = out
                in_tokens += len(out.prompt_token_ids)
                out_tokens += sum(len(c.token_ids) for c in out.outputs)
                elapsed = max(time.perf_counter() - start, 1e-9)
                bar.set_postfix_str(f"input: {in_tokens / elapsed:.1f} tok/s, "
                                    f"output: {out_tokens / elapsed:.1f} tok/s", refresh=False)
                bar.update(1)
        bar.close()
        return results


def content_text(content: str | list[Any] | None) -> str:
    """A chat message's content as text: OpenAI's text parts joined by newlines, as vLLM does."""
    if not isinstance(content, list):
        return content or ""
    texts = []
    for part in content:
        if not (isinstance(part, dict) and part.get("type") == "text"):
            raise ValueError(f"only text content parts are supported, got {part!r}")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"a text content part needs its text as a string, got {part!r}")
        texts.append(part["text"])
    return "\n".join(texts)
