"""Request and response bodies of the OpenAI-compatible API, with OpenAI's and vLLM's names.

Ranges are checked by `SamplingParams` (its ValueError names the field and becomes a 400);
the models here only fix types, plus bounds that keep absurd integers away from the engine.

Every field a request may send is declared here, or listed in its model's `unsupported`: a
field OpenAI or vLLM defines that treadle does not implement, refused (400) unless it holds a
value that changes nothing. Anything else is an unknown field, also refused
(`OpenAIServing.check_request`).
"""

from __future__ import annotations

import json
import re
import time
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from treadle.validate import MAX_NESTING, too_deep

# Integers go into int64 tensors in the engine; a larger one must be a 400, not a dead engine.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
# n > 1 makes n engine requests at once; bound it so one request cannot flood the scheduler.
MAX_N = 128


class OpenAIModel(BaseModel):
    # Extras are kept so that `check_request` can name each one in its 400 (vLLM only
    # logs them); pydantic's own "extra inputs are not permitted" would not say which it knows.
    model_config = ConfigDict(extra="allow")
    # Fields OpenAI or vLLM defines here that treadle refuses, each with the values that leave
    # it without effect (null always does).
    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """OpenAI's API takes null as "not set" ("n": null, "stream": null); where a field
        cannot hold None, that means its default."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if v is not None or k not in fields or type(None) in get_args(fields[k].annotation)}


_SURROGATE = re.compile("[\ud800-\udfff]")
_TEXT_OR_CONTAINER = (str, dict, list)


class RequestBody(OpenAIModel):
    """A request's root model. Its whole decoded JSON is checked once, for nesting and for
    valid Unicode: JSON lets a string hold half a surrogate pair ("\\ud800"), which no
    tokenizer takes and no response can carry back (a field echoed in every response would
    fail all of them). The models inside are validated from the same, already checked, data."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        # First, so that the walks after it (the one below, pydantic's, a chat template's)
        # recurse within bounds, and every response that echoes a field can be serialized.
        if (top := too_deep(data)) is not None:
            raise ValueError(f"`{top}` nests objects and lists more than {MAX_NESTING} deep")
        if (where := lone_surrogate_at(data)) is not None:
            # The path may hold the surrogate (a key): escaped, or the message cannot be sent.
            where = where.encode("utf-8", "backslashreplace").decode()
            raise ValueError(f"`{where}` is not valid Unicode text: it holds half of a UTF-16 "
                             "surrogate pair")
        return data


def _surrogate_path(value: Any) -> list | None:
    """The keys to the first lone surrogate in `value` (innermost first), or None. No string
    is built per element, and a list of numbers (token ids) is passed over in one C call."""
    if isinstance(value, str):
        return [] if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        items = value.items()
    else:
        if not any(issubclass(t, _TEXT_OR_CONTAINER) for t in set(map(type, value))):
            return None
        items = enumerate(value)
    for key, item in items:
        if isinstance(key, str) and _SURROGATE.search(key):
            return [key]
        if isinstance(item, _TEXT_OR_CONTAINER) and (found := _surrogate_path(item)) is not None:
            found.append(key)
            return found
    return None


def lone_surrogate_at(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string (a key or a value) in decoded JSON that holds a lone
    surrogate, or None. (A pair in JSON decodes to one character above U+FFFF.)"""
    if not isinstance(value, _TEXT_OR_CONTAINER) or (found := _surrogate_path(value)) is None:
        return None
    return ".".join(([path] if path else []) + [str(k) for k in reversed(found)]) or "value"


def unexpected_field(model: BaseModel, path: str = "") -> tuple[str, str] | None:
    """(the field's dotted path, why it is refused) for the first field of `model` or of a
    model inside it that treadle would otherwise ignore; None when there is none."""
    unsupported = model.unsupported if isinstance(model, OpenAIModel) else {}
    for name, value in (model.model_extra or {}).items():
        where = path + name
        if name not in unsupported:
            return where, (f"unknown field `{where}`: neither OpenAI's nor vLLM's API has it "
                           f"here (treadle refuses what it would ignore; per-request extras go "
                           f"in `vllm_xargs`)")
        inert = unsupported[name]
        if value is not None and value not in inert:
            allowed = f" (only null or {', '.join(map(json.dumps, inert))})" if inert else ""
            return where, f"`{where}` is not supported by treadle{allowed}"
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            if isinstance(item, BaseModel):
                inner = f"{path}{name}." if i is None else f"{path}{name}.{i}."
                if (found := unexpected_field(item, inner)) is not None:
                    return found
    return None


class StreamOptions(OpenAIModel):
    # As vLLM's: unset means true (stream_options given at all asks for the usage chunk), an
    # explicit null means false.
    include_usage: bool | None = True
    include_obfuscation: bool | None = None   # OpenAI's; there is nothing to obfuscate locally
    # vLLM's: every chunk carries the usage so far too.
    continuous_usage_stats: bool | None = None

    @property
    def usage_at_the_end(self) -> bool:
        return bool(self.include_usage)

    @property
    def usage_in_every_chunk(self) -> bool:
        return bool(self.continuous_usage_stats) and self.usage_at_the_end


class JsonSchemaFormat(OpenAIModel):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(RequestBody):
    """The sampling fields completions and chat share (vLLM's extras included)."""

    model: str | None = None
    n: Annotated[int, Field(le=MAX_N)] = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: Int64 = 0
    # vLLM's: only requests with the same salt share prefix-cache blocks (one per tenant).
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[Int64] | None = None   # vLLM's: only these may be sampled
    truncate_prompt_tokens: Int64 | None = None    # vLLM's: the prompt's last k tokens only
    bad_words: list[str] | None = None             # vLLM's: words never to write
    # For the KV connector (vLLM's field): what a P/D prefill answer handed back.
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's per-request extras, to SamplingParams.extra_args; treadle reads
    # "speculative_decoding": false (no drafts for this request), and "reasoning": true|false
    # (whether the reply starts inside the reasoning, its grammar binding after it).
    vllm_xargs: dict[str, str | int | float | bool] | None = None
    # Constrained output: OpenAI's response_format, or vLLM's structured_outputs (json, regex,
    # choice, grammar); not both.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's older names for structured_outputs (deprecated, mapped onto it).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None   # must name the server's backend
    spaces_between_special_tokens: bool = True
    # vLLM's: the response carries prompt_token_ids and each choice's token_ids.
    return_token_ids: bool = False
    # vLLM's: logprobs name their tokens "token_id:{id}" (for tokens that are not whole text).
    return_tokens_as_token_ids: bool = False
    # vLLM's: the logprob of every prompt token after the first, with the top N (not streamed).
    prompt_logprobs: Int64 | None = None

    @model_validator(mode="after")
    def _stream_options_only_when_streamed(self) -> SamplingFields:
        # Refused as vLLM does: a client asking for usage in chunks would get none.
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when `stream` is true")
        return self

    unsupported = {"use_beam_search": (False,), "length_penalty": (1, 1.0),
                   "logits_processors": ([],),
                   "request_id": (),
                   "guided_whitespace_pattern": (), "structural_tag": (),
                   "mm_processor_kwargs": ({},)}


class CompletionRequest(SamplingFields):
    prompt: list[int] | list[list[int]] | str | list[str]
    max_tokens: Int64 | None = 16
    echo: bool = False
    logprobs: Int64 | None = None
    best_of: Int64 | None = None
    suffix: str | None = None
    add_special_tokens: bool = True   # vLLM's: BOS etc. added to a text prompt

    unsupported = {**SamplingFields.unsupported, "prompt_embeds": ()}


class FunctionCall(OpenAIModel):
    name: str
    arguments: str   # JSON text, as OpenAI sends it


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    role: str
    # A string, or OpenAI content parts; only {"type": "text"} parts are supported.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None   # an assistant turn that called tools
    tool_call_id: str | None = None            # a tool's answer to that call
    refusal: str | None = None                 # OpenAI's, on a replayed assistant turn; unused
    # A replayed assistant turn's chain of thought (either name), for templates that show it
    # again (interleaved thinking), as `reasoning_content`, the name templates read.
    reasoning: str | None = None
    reasoning_content: str | None = None

    unsupported = {"audio": (), "function_call": (), "annotations": ([],)}


class FunctionDefinition(OpenAIModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Int64 | None = None              # deprecated by OpenAI; max_completion_tokens wins
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    tools: list[ChatTool] | None = None
    # None: "auto" with tools, "none" without, as OpenAI does.
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # The chat template's options, passed to it as vLLM passes them.
    add_generation_prompt: bool = True
    continue_final_message: bool = False   # the last message is left open, to be continued
    chat_template_kwargs: dict[str, Any] | None = None   # e.g. {"enable_thinking": false}
    documents: list[dict[str, str]] | None = None        # for retrieval templates
    add_special_tokens: bool = False   # BOS etc. on top of what the template writes
    echo: bool = False   # the reply starts with the last message's content (vLLM's)
    # OpenAI's fields that change nothing on a local engine: accepted, unused.
    parallel_tool_calls: bool = True   # the tool parser returns every call it finds
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None   # prefix caching is automatic
    safety_identifier: str | None = None
    # vLLM's: false leaves the chain of thought out (needs --reasoning-parser to find it).
    include_reasoning: bool = True

    unsupported = {**SamplingFields.unsupported, "best_of": (1,), "chat_template": (),
                   "functions": (), "function_call": (), "audio": (), "modalities": (["text"],),
                   "prediction": (), "web_search_options": (), "reasoning_effort": (),
                   "verbosity": (), "media_io_kwargs": ()}


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    # With messages, the chat template's options, as /v1/chat/completions takes them.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    tools: list[ChatTool] | None = None

    unsupported = {"chat_template": (), "return_token_strs": (False,), "mm_processor_kwargs": ({},)}


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[Int64]


class UpdateWeightsRequest(RequestBody):
    path: str
    weight_version: Any = None


# -- responses -------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's entry for one token at one prompt position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # With return_token_ids (vLLM's): the prompt's ids (a stream's first chunk), the output's.
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None   # with prompt_logprobs


class CompletionResponse(BaseModel):
    """A whole completion, or one streamed chunk of it (then `usage` is only on the last)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None   # the KV connector's, for P/D
    # The engine's weights when these tokens were made (an RL loop tells rollouts apart by it).
    weight_version: Any = None


class ChatLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    content: list[ChatLogProbsContent] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    # With --reasoning-parser: the chain of thought (vLLM's `reasoning`; `reasoning_content`,
    # its older name, carries the same text for the clients that read that one).
    reasoning: str | None = None
    reasoning_content: str | None = None


class Delta(BaseModel):
    """A streamed piece carries only what changed: {"content": "..."}, not {"role": null, ...}."""

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(Delta):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(Delta):
    """One piece of a streamed tool call; the SDK joins the pieces that share an index."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None   # with return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None   # the KV connector's, for P/D
    weight_version: Any = None   # the engine's weights when the last token was made
    prompt_token_ids: list[int] | None = None   # with return_token_ids
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None   # with prompt_logprobs


class DeltaMessage(Delta):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning: str | None = None            # as ChatResponseMessage's
    reasoning_content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None   # with return_token_ids: this chunk's


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None   # with return_token_ids: in the first chunk
    # The engine's weights when this chunk's last token was made (tokens held back from
    # earlier chunks, a tool call's or a tag's beginning, may be older).
    weight_version: Any = None
