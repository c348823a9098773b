"""What completions and chat share: validation, tokenizing, sampling params, running a request
on the engine (streamed or not), usage, and request logging."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, TypeVar

import jinja2
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from treadle.engine.async_llm import AsyncLLM
from treadle.engine.errors import EngineDeadError
from treadle.entrypoints.openai.errors import OpenAIError, sse_error
from treadle.entrypoints.openai.protocol import (ChatMessage, PromptTokensDetails, SamplingFields,
                                                  UsageInfo)
from treadle.entrypoints.openai.streams import (ClientDisconnected, PromptStreams, SSEResponse,
                                                until_disconnected)
from treadle.outputs import CompletionOutput, RequestOutput
from treadle.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Request fields that map one to one onto SamplingParams when the client sets them.
_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids",
                    "ignore_eos", "min_tokens", "include_stop_str_in_output", "skip_special_tokens")
# OpenAI's default; vLLM would take the model's generation config instead.
_DEFAULT_TEMPERATURE = 1.0
# Tokenizer threads: the tokenizer lets go of the GIL while it encodes, so a few long prompts
# tokenize side by side, and short ones are not queued behind a long one.
_TOKENIZER_THREADS = 4


@dataclass
class Delta:
    """What a streamed choice has not sent yet, from the engine's cumulative output."""

    text: str
    token_ids: list[int]
    logprobs: list | None
    finish_reason: str | None
    stop_reason: int | str | None


class ChoiceProgress:
    """Tracks how much of one choice was streamed. The engine's outputs are cumulative (an
    aborted stream's last output is always cumulative), so deltas are taken here."""

    def __init__(self) -> None:
        self.text_len = 0
        self.num_tokens = 0
        self.done = False

    def take(self, c: CompletionOutput) -> Delta | None:
        """The new part of `c`; None when there is nothing new or the choice already ended."""
        if self.done:
            return None
        text, ids = c.text[self.text_len:], c.token_ids[self.num_tokens:]
        if not text and not ids and c.finish_reason is None:
            return None
        logprobs = c.logprobs[self.num_tokens:] if c.logprobs is not None else None
        self.text_len, self.num_tokens = len(c.text), len(c.token_ids)
        self.done = c.finish_reason is not None
        return Delta(text, ids, logprobs, c.finish_reason, c.stop_reason)


class OpenAIServing:
    """The server's state (engine, model names, shutting down) and the helpers every
    endpoint uses; completions and chat build on one shared instance."""

    def __init__(self, engine: AsyncLLM, model_names: list[str], max_log_len: int | None,
                 log_requests: bool = False) -> None:
        self.engine = engine
        self.tokenizer = engine.get_tokenizer()
        self.model_names = model_names
        self.max_log_len = max_log_len
        # Per-request lines (the request, a disconnect, an abort) flood an eval run's log, so
        # they show at INFO only with --enable-log-requests.
        self.request_log_level = logging.INFO if log_requests else logging.DEBUG
        self.shutting_down = False
        self._tokenizer_pool = ThreadPoolExecutor(_TOKENIZER_THREADS,
                                                  thread_name_prefix="treadle-tokenizer")

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    # -- checks ------------------------------------------------------------------------------
    def check_request(self, req: BaseModel, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise OpenAIError(404, f"The model `{model}` does not exist.", "model")
        if self.shutting_down:
            raise OpenAIError(503, "the server is shutting down")
        if req.model_extra:
            logger.warning("ignoring unsupported request fields: %s",
                           ", ".join(sorted(req.model_extra)))

    @staticmethod
    def check_unsupported(req: SamplingFields) -> None:
        if req.logit_bias:
            raise OpenAIError(400, "logit_bias is not supported", "logit_bias")

    # -- tokenizing --------------------------------------------------------------------------
    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on a tokenizer thread. Rendering and tokenizing a prompt take about a
        second per MB of text; on the event loop that would stall /health and every stream."""
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenizer_pool, functools.partial(fn, *args))

    def close(self) -> None:
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not text:
            raise OpenAIError(400, "prompt must not be empty", "prompt")
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except TypeError:  # what the tokenizer raises for text that is not valid Unicode
            raise OpenAIError(400, "prompt is not valid Unicode text", "prompt") from None

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None = None) -> str:
        conversation = [_message_dict(m) for m in messages]
        try:
            return self.tokenizer.apply_chat_template(
                conversation, tools=tools, tokenize=False,
                add_generation_prompt=add_generation_prompt)
        except (jinja2.TemplateError, ValueError, TypeError) as e:
            raise OpenAIError(400, f"the chat template failed on these messages: {e}",
                              "messages") from None

    def encode_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
        text = self.render_chat(messages, add_generation_prompt, tools)
        # The template already holds the special tokens; encoding must not add more.
        return text, self.encode(text, add_special_tokens=False)

    # -- sampling ----------------------------------------------------------------------------
    def sampling_params(self, req: SamplingFields, output_kind: RequestOutputKind,
                        **overrides: Any) -> SamplingParams:
        kwargs = {name: getattr(req, name) for name in _SAMPLING_FIELDS
                  if getattr(req, name) is not None}
        kwargs.setdefault("temperature", _DEFAULT_TEMPERATURE)
        extra_args = dict(req.vllm_xargs or {})
        if req.kv_transfer_params is not None:
            extra_args["kv_transfer_params"] = req.kv_transfer_params
        if extra_args:
            kwargs["extra_args"] = extra_args
        structured = _structured_outputs(req)
        if structured is not None:
            kwargs["structured_outputs"] = structured
        kwargs.update(overrides)
        try:
            return SamplingParams(output_kind=output_kind, **kwargs)
        except ValueError as e:
            raise OpenAIError(400, str(e)) from None

    def validate(self, params: SamplingParams, prompt_ids: list[int]) -> None:
        """The prompt and max_tokens within max_model_len, logprobs in range, token ids in the
        vocabulary (checked last: a prompt far too long is refused without a pass over it)."""
        try:
            self.engine.input_processor.validate_params(params, len(prompt_ids))
            self.engine.input_processor.tokenize(prompt_ids)
        except ValueError as e:
            raise OpenAIError(400, str(e)) from None

    # -- running -------------------------------------------------------------------------------
    async def run(self, raw: Request, request_id: str, prompts: list[dict[str, Any]],
                  params: SamplingParams, priority: int, stream: bool,
                  respond: Callable[[list[RequestOutput]], Response],
                  events: Callable[[list[RequestOutput], PromptStreams], AsyncIterator[BaseModel]],
                  ) -> Response:
        """Run the prompts; `respond(final outputs)` builds a whole response, `events(first
        outputs, streams)` the chunks of a streamed one."""
        self.log_request(request_id, prompts, params)
        streams = PromptStreams(self.engine, prompts, params, request_id, priority,
                                log_level=self.request_log_level)
        try:
            firsts = await until_disconnected(raw, streams.start())
        except ClientDisconnected:
            await streams.aclose()
            logger.log(self.request_log_level, "request %s: client disconnected", request_id)
            return Response(status_code=499)   # nobody reads it; nginx's "client closed request"
        except ValueError as e:
            await streams.aclose()
            raise OpenAIError(400, str(e)) from None
        except BaseException:
            await streams.aclose()
            raise
        if not stream:
            await streams.aclose()
            return respond(firsts)   # output_kind FINAL_ONLY: the first output is the last
        return SSEResponse(_sse(request_id, events(firsts, streams)), on_close=streams.aclose)

    def log_request(self, request_id: str, prompts: list[dict[str, Any]], params: SamplingParams
                    ) -> None:
        if not logger.isEnabledFor(self.request_log_level):
            return
        n = self.max_log_len
        shown = [p.get("prompt") if p.get("prompt") is not None else p["prompt_token_ids"]
                 for p in prompts]
        shown = [s[:n] if n is not None else s for s in shown]
        logger.log(self.request_log_level, "request %s: prompts=%r, params=%s", request_id, shown,
                   params)


def _structured_outputs(req: SamplingFields) -> dict[str, Any] | None:
    """The request's constraint, from vLLM's structured_outputs or OpenAI's response_format."""
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return req.structured_outputs
    if req.structured_outputs is not None:
        raise OpenAIError(400, "set response_format or structured_outputs, not both",
                          "structured_outputs")
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise OpenAIError(400, "response_format of type json_schema needs json_schema.schema",
                          "response_format")
    return {"json": fmt.json_schema.json_schema}


def usage(outputs: list[RequestOutput], count_completion: bool = True) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    completion = completion if count_completion else 0
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(
                         cached_tokens=sum(o.num_cached_tokens for o in outputs)))


def clamp_logprob(value: float) -> float:
    # JSON has no -inf; OpenAI (and vLLM) send -9999.0 for "impossible".
    return max(value, -9999.0)


def _message_dict(m: ChatMessage) -> dict[str, Any]:
    content = m.content
    if isinstance(content, list):
        parts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise OpenAIError(400, "only text content parts are supported", "messages")
            parts.append(part["text"])
        content = "\n".join(parts)
    message: dict[str, Any] = {"role": m.role, "content": content or ""}
    if m.name is not None:
        message["name"] = m.name
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        # Templates read the arguments as a mapping, as transformers documents them.
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": _arguments(c.function.arguments)}}
            for c in m.tool_calls]
    return message


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


async def _sse(request_id: str, chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """`data: {json}` per chunk, then `data: [DONE]`; an error mid-stream becomes an event."""
    try:
        async for chunk in chunks:
            yield f"data: {chunk.model_dump_json()}\n\n"
    except EngineDeadError:
        logger.exception("request %s: the engine failed mid-stream", request_id)
        yield sse_error(500, "the engine failed; see the server log")
    except Exception:
        logger.exception("request %s: unexpected error mid-stream", request_id)
        yield sse_error(500, "internal server error; see the server log")
    yield "data: [DONE]\n\n"
