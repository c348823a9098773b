"""What completions and chat share: validation, tokenizing, sampling params, running a request
on the engine (streamed or not), usage, and request logging."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, TypeVar

import jinja2
import jinja2.meta
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response
from transformers.convert_slow_tokenizer import bytes_to_unicode

from treadle.engine.async_llm import AsyncLLM
from treadle.engine.errors import EngineDeadError
from treadle.engine.llm import content_text
from treadle.entrypoints.openai.errors import OpenAIError, sse_error
from treadle.entrypoints.openai.protocol import (ChatMessage, PromptLogprob, PromptTokensDetails,
                                                  SamplingFields, UsageInfo, unexpected_field)
from treadle.entrypoints.openai.streams import (ClientDisconnected, PromptStreams, SSEResponse,
                                                until_disconnected)
from treadle.outputs import CompletionOutput, RequestOutput
from treadle.sampling_params import RequestOutputKind, SamplingParams
from treadle.validate import MAX_NESTING, too_deep

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Request fields that map one to one onto SamplingParams when the client sets them.
_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids",
                    "ignore_eos", "min_tokens", "include_stop_str_in_output", "skip_special_tokens",
                    "spaces_between_special_tokens", "logit_bias", "allowed_token_ids",
                    "truncate_prompt_tokens", "bad_words", "prompt_logprobs")
# vLLM's older names for structured_outputs, and the kind each one sets.
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}
_warned_deprecated: set[str] = set()   # each deprecated field is reported once per process
# OpenAI's default, where the model's generation config names none.
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
        # Token ids, and their logprobs, of text a stream holds back (a tool call, a tag).
        self.held_ids: list[int] = []
        self.held_logprobs: list = []

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
        # --default-chat-template-kwargs: variables every chat request's template gets unless
        # the request sets them (build_app sets them, checked against the template).
        self.default_template_kwargs: dict[str, Any] = {}
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

    @property
    def grammar_backend(self) -> str:
        """The structured outputs backend, one per server ("xgrammar" or "guidance")."""
        return self.engine.input_processor.config.structured_outputs.backend

    # -- checks ------------------------------------------------------------------------------
    def check_request(self, req: BaseModel, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise OpenAIError(404, f"The model `{model}` does not exist.", "model")
        if self.shutting_down:
            raise OpenAIError(503, "the server is shutting down")
        # Stricter than vLLM, which logs such fields and goes on: a misspelt or unimplemented
        # option, silently ignored, gives a client wrong results it cannot see.
        if (found := unexpected_field(req)) is not None:
            param, message = found
            raise OpenAIError(400, message, param)

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
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> str:
        """The conversation through the chat template; `template_kwargs` (continue_final_message,
        documents, the client's chat_template_kwargs) go to it as vLLM passes them."""
        kwargs = {"add_generation_prompt": add_generation_prompt, **(template_kwargs or {})}
        try:
            conversation = [_message_dict(m) for m in messages]
            return self.tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False,
                                                      **kwargs)
        except (jinja2.TemplateError, ValueError, TypeError) as e:
            raise OpenAIError(400, f"the chat template failed on these messages: {e}",
                              "messages") from None
        except RecursionError:   # a tool call's arguments, as JSON text, nested past its walk
            raise OpenAIError(400, "the chat template failed on these messages: a tool call's "
                                   "arguments or the tools nest too deep", "messages") from None

    def encode_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None,
                    add_special_tokens: bool = False) -> tuple[str, list[int]]:
        text = self.render_chat(messages, add_generation_prompt, tools, template_kwargs)
        # The template already holds the special tokens; encoding adds more only when asked.
        return text, self.encode(text, add_special_tokens=add_special_tokens)

    @functools.cached_property
    def template_variables(self) -> frozenset[str] | None:
        """The names the chat template reads (None: no template, or one jinja2 cannot parse
        on its own, when nothing can be said)."""
        template = self.tokenizer.chat_template
        if not isinstance(template, str):
            return None
        try:
            ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
        except jinja2.TemplateSyntaxError:
            return None
        return frozenset(jinja2.meta.find_undeclared_variables(ast))

    # -- sampling ----------------------------------------------------------------------------
    def sampling_params(self, req: SamplingFields, output_kind: RequestOutputKind,
                        **overrides: Any) -> SamplingParams:
        if req.prompt_logprobs is not None and req.stream:
            raise OpenAIError(400, "prompt_logprobs are not available when stream is true",
                              "prompt_logprobs")
        kwargs = {name: getattr(req, name) for name in _SAMPLING_FIELDS
                  if getattr(req, name) is not None}
        # What the client leaves unset, the model's generation config sets.
        for name, value in self.engine.config.model.generation.sampling.items():
            kwargs.setdefault(name, value)
        kwargs.setdefault("temperature", _DEFAULT_TEMPERATURE)
        extra_args = dict(req.vllm_xargs or {})
        if req.kv_transfer_params is not None:
            extra_args["kv_transfer_params"] = req.kv_transfer_params
        if extra_args:
            kwargs["extra_args"] = extra_args
        structured = structured_outputs(req, self.grammar_backend)
        if structured is not None:
            kwargs["structured_outputs"] = structured
        kwargs.update(overrides)
        try:
            return SamplingParams(output_kind=output_kind, **kwargs)
        except ValueError as e:
            message, param = _constraint_named(str(e), req, "structured_outputs" in overrides)
            raise OpenAIError(400, message, param or _field_named(message, req)) from None

    async def validate(self, params: SamplingParams, prompts: list[list[int]],
                       req: SamplingFields, tools_constrain: bool = False) -> None:
        """Each prompt and max_tokens within max_model_len, logprobs in range, a grammar the
        backend takes, token ids in the vocabulary (checked last: a prompt far too long is
        refused without a pass over it). On a tokenizer thread: a deep JSON schema takes
        seconds to parse. An error names the fields `req` sent (`tools_constrain`: the
        grammar is a forced tool call's)."""
        await self.off_loop(self._validate, params, prompts, req, tools_constrain)

    def _validate(self, params: SamplingParams, prompts: list[list[int]], req: SamplingFields,
                  tools_constrain: bool) -> None:
        try:
            processor = self.engine.input_processor
            processor.validate_sampling(params)
            for prompt_ids in prompts:
                processor.validate_length(params, len(prompt_ids))
                processor.tokenize(prompt_ids)
        except ValueError as e:
            message, param = _constraint_named(str(e), req, tools_constrain)
            if "max_tokens must be in" in message:   # past the context (vLLM's wording first)
                field = ("max_completion_tokens" if getattr(req, "max_completion_tokens", None)
                         is not None else "max_tokens")
                message, param = message.replace("max_tokens must", f"{field} must"), field
            raise OpenAIError(400, message, param or _field_named(message, req)
                              or _field_named(message, params)) from None

    # -- running -------------------------------------------------------------------------------
    async def run(self, raw: Request, request_id: str, prompts: list[dict[str, Any]],
                  params: SamplingParams, priority: int, cache_salt: str | None, stream: bool,
                  respond: Callable[[list[RequestOutput]], Response],
                  events: Callable[[list[RequestOutput], PromptStreams], AsyncIterator[BaseModel]],
                  ) -> Response:
        """Run the prompts; `respond(final outputs)` builds a whole response, `events(first
        outputs, streams)` the chunks of a streamed one."""
        self.log_request(request_id, prompts, params)
        streams = PromptStreams(self.engine, prompts, params, request_id, priority, cache_salt,
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


def _field_named(message: str, fields: Any) -> str | None:
    """The field a ValueError's message starts with ("logit_bias['5'] must be ..."), when
    `fields` (a request or SamplingParams) has one by that name: the error's `param`."""
    name = re.match(r"\w+", message)
    return name.group() if name is not None and hasattr(fields, name.group()) else None


def _constraint_named(message: str, req: SamplingFields, tools_constrain: bool
                      ) -> tuple[str, str | None]:
    """A constraint's error (it names structured_outputs.<kind>) with the field the client
    sent in its place, and that field as the `param`; other errors unchanged, no param."""
    if not message.startswith(("invalid structured_outputs", "structured_outputs")):
        return message, None
    field = ("tools" if tools_constrain
             else next((n for n in _GUIDED_FIELDS if getattr(req, n, None) is not None), None)
             or ("structured_outputs" if req.structured_outputs is not None else "response_format"))
    if field != "structured_outputs":
        message = re.sub(r"structured_outputs(\.\w+)?", field, message, count=1)
    return message, field


def _guided(req: SamplingFields, backend: str) -> dict[str, Any] | None:
    """vLLM's deprecated guided_* fields as a structured_outputs dict (None: none set)."""
    for name in (*_GUIDED_FIELDS, "guided_decoding_backend"):
        if getattr(req, name) is not None and name not in _warned_deprecated:
            _warned_deprecated.add(name)
            logger.warning("`%s` is deprecated (as in vLLM); use `structured_outputs`", name)
    if req.guided_decoding_backend not in (None, "auto", backend):
        raise OpenAIError(400, f"guided_decoding_backend must be null, \"auto\" or this "
                               f"server's backend \"{backend}\" (set per server with "
                               f"structured_outputs_config), got {req.guided_decoding_backend!r}",
                          "guided_decoding_backend")
    given = [name for name in _GUIDED_FIELDS if getattr(req, name) is not None]
    if not given:
        return None
    if req.structured_outputs is not None:
        raise OpenAIError(400, f"set structured_outputs or the deprecated {given[0]}, not both",
                          given[0])
    if len(given) > 1:
        raise OpenAIError(400, f"set one of {', '.join(_GUIDED_FIELDS)}; got "
                               f"{', '.join(given)}", given[1])
    return {_GUIDED_FIELDS[given[0]]: getattr(req, given[0])}


def structured_outputs(req: SamplingFields, backend: str) -> dict[str, Any] | None:
    """The request's constraint, from vLLM's structured_outputs (or its older guided_* names)
    or OpenAI's response_format."""
    constraint = _guided(req, backend) or req.structured_outputs
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return constraint
    if constraint is not None:
        field = next((n for n in _GUIDED_FIELDS if getattr(req, n) is not None),
                     "structured_outputs")
        raise OpenAIError(400, f"set response_format or {field}, not both", field)
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise OpenAIError(400, "response_format of type json_schema needs json_schema.schema",
                          "response_format")
    return {"json": fmt.json_schema.json_schema}


def usage(outputs: list[RequestOutput], count_completion: bool = True,
          index: int | None = None) -> UsageInfo:
    """`index`: count only that choice's completion tokens, as vLLM's continuous_usage_stats
    does in a streamed chunk (which carries that one choice)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs
                     if index is None or c.index == index)
    completion = completion if count_completion else 0
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(
                         cached_tokens=sum(o.num_cached_tokens for o in outputs)))


def prompt_logprobs(out: RequestOutput, decode: Callable[[list[int]], str]
                    ) -> list[dict[int, PromptLogprob] | None] | None:
    """vLLM's `prompt_logprobs` of one prompt: per position, the prompt's token and the top N,
    each with its logprob, rank and text; None for the first position, which has none."""
    if out.prompt_logprobs is None:
        return None
    return [None if entry is None else {
        token: PromptLogprob(logprob=clamp_logprob(lp.logprob), rank=lp.rank,
                             decoded_token=(lp.decoded_token if lp.decoded_token is not None
                                            else decode([token])))
        for token, lp in entry.items()} for entry in out.prompt_logprobs]


@functools.lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, char -> byte."""
    return {char: byte for byte, char in bytes_to_unicode().items()}


class TokenBytes:
    """A token's own UTF-8 bytes, for OpenAI's `bytes` field: for a token that holds part of a
    character (byte-level BPE splits most CJK characters and emoji over two or three tokens;
    a SentencePiece byte-fallback token is one byte) its text is U+FFFD, whose bytes are not
    the token's. Memoised per token."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._memo: dict[int, bytes] = {}

    def __call__(self, token_id: int, text: str) -> bytes:
        if "\ufffd" not in text:
            return text.encode("utf-8")
        got = self._memo.get(token_id)
        if got is None:
            got = self._memo[token_id] = self._raw(token_id, text)
        return got

    def _raw(self, token_id: int, text: str) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return text.encode("utf-8")
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)    # SentencePiece byte fallback
        if m is not None:
            return bytes([int(m.group(1), 16)])
        alphabet = _byte_level_alphabet()
        if all(c in alphabet for c in piece):               # byte-level BPE
            return bytes(alphabet[c] for c in piece)
        return text.encode("utf-8")


def clamp_logprob(value: float) -> float:
    # JSON has no -inf; OpenAI (and vLLM) send -9999.0 for "impossible".
    return max(value, -9999.0)


def message_text(m: ChatMessage) -> str:
    """A message's content as text: OpenAI's text parts joined by newlines, as vLLM does."""
    try:
        return content_text(m.content)
    except ValueError as e:
        raise OpenAIError(400, str(e).partition(", got")[0], "messages") from None


def _message_dict(m: ChatMessage) -> dict[str, Any]:
    message: dict[str, Any] = {"role": m.role, "content": message_text(m)}
    if m.name is not None:
        message["name"] = m.name
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if m.tool_calls:
        # Templates read the arguments as a mapping, as transformers documents them.
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": _arguments(c.function.arguments)}}
            for c in m.tool_calls]
    return message


def _arguments(text: str) -> Any:
    try:
        arguments = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return text
    if too_deep([arguments]) is not None:
        raise OpenAIError(400, f"a tool call's arguments nest objects and lists more than "
                               f"{MAX_NESTING} deep", "messages")
    return arguments


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
