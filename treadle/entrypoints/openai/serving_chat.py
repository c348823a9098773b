"""POST /v1/chat/completions: messages through the model's chat template."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import Response

from treadle.engine.input_processor import MAX_LOGPROBS
from treadle.engine.llm import CHAT_RENDER_ARGUMENTS
from treadle.entrypoints.openai.errors import OpenAIError
from treadle.entrypoints.openai.reasoning import ReasoningParser, ReasoningStream
from treadle.entrypoints.openai.protocol import (ChatChoice, ChatCompletionChunk,
                                                  ChatCompletionRequest, ChatCompletionResponse,
                                                  ChatLogProb, ChatLogProbs, ChatLogProbsContent,
                                                  ChatResponseMessage, ChatStreamChoice,
                                                  DeltaMessage, TokenizeRequest)
from treadle.entrypoints.openai.serving import (ChoiceProgress, OpenAIServing, TokenBytes,
                                                 clamp_logprob, message_text, prompt_logprobs,
                                                 structured_outputs, usage)
from treadle.entrypoints.openai.streams import PromptStreams
from treadle.entrypoints.openai.tool_parsers.base import ToolParser
from treadle.entrypoints.openai.tools import ToolCalls, tool_choice_of, tool_constraint
from treadle.outputs import Logprob, RequestOutput
from treadle.sampling_params import RequestOutputKind, SamplingParams
from treadle.structured_output.reasoning import prompt_opens_reasoning

logger = logging.getLogger(__name__)


class ChatServing:
    def __init__(self, serving: OpenAIServing, tool_parser: ToolParser | None = None,
                 reasoning_parser: ReasoningParser | None = None) -> None:
        self.serving = serving
        self.tool_parser = tool_parser   # for tool_choice "auto"; None: "auto" is refused
        self.reasoning_parser = reasoning_parser   # None: the whole output is content

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        serving = self.serving
        serving.check_request(req, req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise OpenAIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got "
                                   f"{req.top_logprobs}", "top_logprobs")
        if not req.include_reasoning and self.reasoning_parser is None:
            raise OpenAIError(400, "include_reasoning: false needs the server started with "
                                   "--reasoning-parser, to find the reasoning", "include_reasoning")
        tool_choice = tool_choice_of(req, self.tool_parser)
        overrides = {}
        if (constraint := tool_constraint(req, tool_choice)) is not None:
            if structured_outputs(req, serving.grammar_backend) is not None:
                raise OpenAIError(400, "tool_choice \"required\" or a named function cannot be "
                                       "combined with response_format or structured_outputs",
                                  "tool_choice")
            overrides["structured_outputs"] = constraint
        text, ids, add_generation_prompt = await encode_messages(serving, req,
                                                                 req.add_special_tokens)
        # None: to the end of the context, or the model's max_new_tokens if less (make_requests).
        max_tokens = (req.max_completion_tokens if req.max_completion_tokens is not None
                      else req.max_tokens)
        if req.max_completion_tokens is not None and req.max_completion_tokens < 1:
            raise OpenAIError(400, f"max_completion_tokens must be an integer >= 1 or null, got "
                                   f"{req.max_completion_tokens}", "max_completion_tokens")
        params = serving.sampling_params(
            req, RequestOutputKind.CUMULATIVE if req.stream else RequestOutputKind.FINAL_ONLY,
            max_tokens=max_tokens, logprobs=(req.top_logprobs or 0) if req.logprobs else None,
            **overrides)
        prompt, ids = serving.engine.input_processor.truncate(text, ids, params)
        await serving.validate(params, [ids], req, "structured_outputs" in overrides)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        reasoning = None
        if self.reasoning_parser is not None:
            variables = {**serving.default_template_kwargs, **(req.chat_template_kwargs or {})}
            thinking = variables.get("enable_thinking", True) is not False
            reasoning = self.reasoning_parser.for_request(thinking, constrained=False)
            if params.structured_outputs is not None:
                reasoning = await self._where_the_grammar_binds(req, params, text, thinking,
                                                                reasoning, add_generation_prompt)
        render = _Renderer(serving, req, request_id, add_generation_prompt,
                           lambda: ToolCalls(tool_choice, self.tool_parser), reasoning)
        return await serving.run(raw, request_id, [{"prompt": prompt, "prompt_token_ids": ids}],
                                 params, req.priority, req.cache_salt, req.stream, render.response,
                                 render.chunks)

    async def _where_the_grammar_binds(self, req: ChatCompletionRequest, params: SamplingParams,
                                       text: str, thinking: bool, free: ReasoningParser,
                                       add_generation_prompt: bool) -> ReasoningParser:
        """Tell the engine whether this constrained reply starts inside the reasoning (its
        grammar then waits for </think>), and return the parser that splits the text where the
        grammar binds. It starts inside as the generation prompt's last tag says (DeepSeek-R1
        opens <think> there, Qwen3 with thinking off closes an empty one), or with no tag there
        as the template's thinking switch says; the conversation before it (earlier turns'
        thoughts) does not count. vllm_xargs {"reasoning": ...} overrides. `free`: the parser
        for this request without a grammar."""
        parser = self.reasoning_parser
        extra = params.extra_args = dict(params.extra_args or {})
        if "reasoning" not in extra:
            opens = prompt_opens_reasoning(
                await self._generation_prompt(req, text) if add_generation_prompt else text,
                parser.name)
            extra["reasoning"] = free.opens_inside if opens is None else opens
        if self.serving.engine.input_processor.grammar_waits(text, extra["reasoning"]):
            # Reasoning from the first token to </think> alone, where the grammar wakes: a
            # <tool_call> before it is still the unconstrained thought.
            return dataclasses.replace(parser, opens_inside=True, tool_call_ends=False)
        return parser.for_request(thinking, constrained=True)

    async def _generation_prompt(self, req: ChatCompletionRequest, text: str) -> str:
        """What the generation prompt adds to the conversation: the start of the reply."""
        without, _, _ = await encode_messages(self.serving, req.model_copy(
            update={"add_generation_prompt": False}))
        return text[len(without):] if text.startswith(without) else text


async def encode_messages(serving: OpenAIServing, req: ChatCompletionRequest | TokenizeRequest,
                          add_special_tokens: bool = False) -> tuple[str, list[int], bool]:
    """The request's messages and tools through the chat template with its options (as
    /v1/chat/completions and /tokenize both take them): (text, token ids, whether a
    generation prompt was added)."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    template_kwargs = _template_kwargs(req, serving.template_variables,
                                       serving.default_template_kwargs)
    add_generation_prompt = template_kwargs.pop("add_generation_prompt")
    text, ids = await serving.off_loop(serving.encode_chat, req.messages, add_generation_prompt,
                                       tools, template_kwargs, add_special_tokens)
    return text, ids, add_generation_prompt


def check_default_template_kwargs(defaults: dict[str, Any], variables: frozenset[str] | None
                                  ) -> dict[str, Any]:
    """--default-chat-template-kwargs, checked at start-up: a name that is how the template is
    rendered, not a variable of it, is a ValueError; one the template never reads is dropped
    with a warning (vLLM drops it silently: `{"enable_thinking": false}` is set on servers of
    models that do not think). Returns what is kept."""
    kept = {}
    for key, value in defaults.items():
        if key in CHAT_RENDER_ARGUMENTS or key in ("messages", "add_generation_prompt",
                                               "continue_final_message"):
            raise ValueError(f"--default-chat-template-kwargs may not set `{key}`: it is not a "
                             "template variable")
        if variables is not None and key not in variables:
            logger.warning("--default-chat-template-kwargs: the chat template does not read "
                           "`%s`; it is left out", key)
            continue
        kept[key] = value
    return kept


def _template_kwargs(req: ChatCompletionRequest | TokenizeRequest, variables: frozenset[str] | None,
                     defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the chat template gets besides the messages and tools, as vLLM builds it: the
    request's options, then the server's default variables (`defaults`), then the request's
    chat_template_kwargs over them. A variable the template never reads (`variables`) would
    change nothing, so it is refused rather than ignored."""
    kwargs: dict[str, Any] = {"add_generation_prompt": req.add_generation_prompt,
                              "continue_final_message": req.continue_final_message, **(defaults or {})}
    given = dict(req.chat_template_kwargs or {})
    if req.documents is not None:
        given = {"documents": req.documents, **given}
    for key, value in given.items():
        from_request = key == "documents" and req.documents is not None
        param = "documents" if from_request else "chat_template_kwargs"
        if key in CHAT_RENDER_ARGUMENTS or key == "messages":
            raise OpenAIError(400, f"chat_template_kwargs may not set `{key}`: it is how the "
                                   f"server renders the template (the request's messages, "
                                   f"its options), not a template variable", param)
        if key not in kwargs and variables is not None and key not in variables:
            raise OpenAIError(400, f"{param}: this model's chat template does not read "
                                   f"`{key}`", param)
        kwargs[key] = value
    if kwargs["continue_final_message"] and kwargs["add_generation_prompt"]:
        raise OpenAIError(400, "Cannot set both `continue_final_message` and "
                               "`add_generation_prompt` to true (add_generation_prompt defaults "
                               "to true: send false with continue_final_message)",
                          "continue_final_message")
    return kwargs


class _Renderer:
    def __init__(self, serving: OpenAIServing, req: ChatCompletionRequest, request_id: str,
                 add_generation_prompt: bool, tool_calls: Callable[[], ToolCalls],
                 reasoning: ReasoningParser | None) -> None:
        self.serving = serving
        self.req = req
        self.id = request_id
        self.created = int(time.time())
        self.tool_calls = tool_calls   # a fresh one per choice
        self.reasoning = reasoning     # tool calls are looked for past the reasoning only
        # As vLLM: without a generation prompt the reply goes on in the last message's role,
        # and `echo` puts that message's content in front of the reply when roles match.
        last = req.messages[-1]
        self.role = "assistant" if add_generation_prompt else last.role
        self.echo = message_text(last) if req.echo and last.role == self.role else ""
        self.token_bytes = TokenBytes(serving.tokenizer)

    def response(self, finals: list[RequestOutput]) -> Response:
        out = finals[0]
        choices = []
        for c in out.outputs:
            reasoning, text = self.reasoning.split(c.text) if self.reasoning else (None, c.text)
            content, calls = self.tool_calls().extract(text) if text is not None else (None, [])
            if self.req.echo:
                content = self.echo + (content or "")
            if not self.req.include_reasoning:
                reasoning = None
            choices.append(ChatChoice(
                index=c.index,
                message=ChatResponseMessage(role=self.role, content=content, tool_calls=calls,
                                            reasoning=reasoning, reasoning_content=reasoning),
                logprobs=self._logprobs(c.token_ids, c.logprobs),
                finish_reason=_finish_reason(c.finish_reason, bool(calls)),
                stop_reason=c.stop_reason, token_ids=self._token_ids(c.token_ids)))
        body = ChatCompletionResponse(id=self.id, created=self.created,
                                      model=self.serving.model_name, choices=choices,
                                      usage=usage(finals),
                                      kv_transfer_params=out.kv_transfer_params,
                                      weight_version=out.weight_version,
                                      prompt_token_ids=self._token_ids(out.prompt_token_ids),
                                      prompt_logprobs=prompt_logprobs(
                                          out, self.serving.tokenizer.decode))
        return Response(body.model_dump_json(), media_type="application/json")

    async def chunks(self, firsts: list[RequestOutput], streams: PromptStreams
                     ) -> AsyncIterator[ChatCompletionChunk]:
        progress = [ChoiceProgress() for _ in range(self.req.n)]
        tool_calls = [self.tool_calls() for _ in range(self.req.n)]
        reasoning = [self.reasoning.stream() if self.reasoning else None for _ in range(self.req.n)]
        # As OpenAI does: each choice opens with the role and empty content (the echo, if any).
        first = self._chunk([ChatStreamChoice(index=k, delta=DeltaMessage(role=self.role,
                                                                          content=self.echo))
                             for k in range(self.req.n)])
        first.prompt_token_ids = self._token_ids(firsts[0].prompt_token_ids)
        if self.req.stream_options is not None and self.req.stream_options.usage_in_every_chunk:
            first.usage = usage(firsts[:1], count_completion=False)   # no token yet
        yield first
        latest = firsts[0]
        for chunk in self._delta_chunks(progress, tool_calls, reasoning, latest):
            yield chunk
        async for _, out in streams:
            latest = out
            for chunk in self._delta_chunks(progress, tool_calls, reasoning, out):
                yield chunk
        if self.req.stream_options is not None and self.req.stream_options.usage_at_the_end:
            yield ChatCompletionChunk(id=self.id, created=self.created,
                                      model=self.serving.model_name, choices=[],
                                      usage=usage([latest]))

    def _delta_chunks(self, progress: list[ChoiceProgress], tool_calls: list[ToolCalls],
                      reasoning_streams: list[ReasoningStream | None],
                      out: RequestOutput) -> list[ChatCompletionChunk]:
        """A chunk for each choice with something new, as vLLM and OpenAI stream n > 1: its
        continuous usage then counts that choice's tokens alone, as vLLM's does."""
        chunks = []
        every = self.req.stream_options is not None and self.req.stream_options.usage_in_every_chunk
        for c in out.outputs:
            delta = progress[c.index].take(c)
            if delta is None:
                continue
            calls, finished = tool_calls[c.index], delta.finish_reason is not None
            text, reasoning = delta.text, ""
            if (stream := reasoning_streams[c.index]) is not None:
                reasoning, text = stream.feed(text, finished)
                if not self.req.include_reasoning:
                    reasoning = ""
            content, call_deltas = calls.feed(text, finished)
            held = progress[c.index]
            token_ids = held.held_ids + delta.token_ids
            logprobs = held.held_logprobs + delta.logprobs if delta.logprobs is not None else None
            if not content and not call_deltas and not reasoning and not finished:
                held.held_ids, held.held_logprobs = token_ids, logprobs or []
                continue   # held back: a tool call or a tag has begun and is not complete
            held.held_ids, held.held_logprobs = [], []
            chunk = self._chunk([ChatStreamChoice(
                index=c.index, delta=DeltaMessage(
                    content=content if content or not (call_deltas or reasoning) else None,
                    tool_calls=call_deltas or None, reasoning=reasoning or None,
                    reasoning_content=reasoning or None),
                logprobs=self._logprobs(token_ids, logprobs),
                finish_reason=_finish_reason(delta.finish_reason, calls.num_streamed > 0),
                stop_reason=delta.stop_reason, token_ids=self._token_ids(token_ids))])
            chunk.weight_version = out.weight_version
            if every:   # held-back tokens count too: they were generated (vLLM counts them)
                chunk.usage = usage([out], index=c.index)
            chunks.append(chunk)
        return chunks

    def _token_ids(self, ids: list[int]) -> list[int] | None:
        return list(ids) if self.req.return_token_ids else None

    def _chunk(self, choices: list[ChatStreamChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.serving.model_name,
                                   choices=choices)

    def _logprobs(self, token_ids: list[int], entries: list | None) -> ChatLogProbs | None:
        if not self.req.logprobs or entries is None:
            return None
        num_top = self.req.top_logprobs or 0
        content = []
        as_ids = self.req.return_tokens_as_token_ids
        for token_id, entry in zip(token_ids, entries):
            tops = sorted((item for item in entry.items()
                           if item[1].rank is not None and item[1].rank <= num_top),
                          key=lambda item: item[1].rank)[:num_top]
            content.append(ChatLogProbsContent(
                **_logprob(token_id, entry[token_id], as_ids, token_bytes=self.token_bytes),
                top_logprobs=[ChatLogProb(**_logprob(t, lp, as_ids, name_bytes=True,
                                                     token_bytes=self.token_bytes))
                              for t, lp in tops]))
        return ChatLogProbs(content=content)


def _finish_reason(reason: str | None, called_tools: bool) -> str | None:
    return "tool_calls" if reason == "stop" and called_tools else reason


def _logprob(token_id: int, lp: Logprob, as_id: bool = False, name_bytes: bool = False,
             token_bytes: TokenBytes | None = None) -> dict:
    """One token's entry; `as_id`: named "token_id:{id}" (return_tokens_as_token_ids). As in
    vLLM, its bytes are its token's even so, but a top_logprobs entry's are its name's
    (`name_bytes`). A token's bytes are its own, also where it holds part of a character and
    its text is U+FFFD (`token_bytes`)."""
    text = lp.decoded_token or ""
    token = f"token_id:{token_id}" if as_id else text
    if name_bytes and as_id:
        raw = token.encode("utf-8")
    else:
        raw = token_bytes(token_id, text) if token_bytes is not None else text.encode("utf-8")
    return {"token": token, "logprob": clamp_logprob(lp.logprob), "bytes": list(raw)}
