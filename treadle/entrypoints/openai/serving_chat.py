"""POST /v1/chat/completions: messages through the model's chat template."""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from treadle.entrypoints.openai.errors import OpenAIError
from treadle.entrypoints.openai.protocol import (ChatChoice, ChatCompletionChunk,
                                                  ChatCompletionRequest, ChatCompletionResponse,
                                                  ChatLogProb, ChatLogProbs, ChatLogProbsContent,
                                                  ChatResponseMessage, ChatStreamChoice,
                                                  DeltaMessage)
from treadle.entrypoints.openai.serving import ChoiceProgress, OpenAIServing, clamp_logprob, usage
from treadle.entrypoints.openai.streams import PromptStreams
from treadle.outputs import RequestOutput
from treadle.sampling_params import RequestOutputKind


class ChatServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        serving = self.serving
        serving.check_request(req, req.model)
        serving.check_unsupported(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        text, ids = serving.encode_chat(req.messages, req.add_generation_prompt)
        max_tokens = (req.max_completion_tokens if req.max_completion_tokens is not None
                      else req.max_tokens)
        params = serving.sampling_params(
            req, RequestOutputKind.CUMULATIVE if req.stream else RequestOutputKind.FINAL_ONLY,
            max_tokens=max_tokens, logprobs=(req.top_logprobs or 0) if req.logprobs else None)
        serving.validate(params, ids)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        render = _Renderer(serving, req, request_id)
        return await serving.run(raw, request_id, [{"prompt": text, "prompt_token_ids": ids}],
                                 params, req.priority, req.stream, render.response, render.chunks)


class _Renderer:
    def __init__(self, serving: OpenAIServing, req: ChatCompletionRequest, request_id: str) -> None:
        self.serving = serving
        self.req = req
        self.id = request_id
        self.created = int(time.time())

    def response(self, finals: list[RequestOutput]) -> Response:
        out = finals[0]
        choices = [ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                              logprobs=self._logprobs(c.token_ids, c.logprobs),
                              finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                   for c in out.outputs]
        body = ChatCompletionResponse(id=self.id, created=self.created,
                                      model=self.serving.model_name, choices=choices,
                                      usage=usage(finals), kv_transfer_params=out.kv_transfer_params)
        return Response(body.model_dump_json(), media_type="application/json")

    async def chunks(self, firsts: list[RequestOutput], streams: PromptStreams
                     ) -> AsyncIterator[ChatCompletionChunk]:
        progress = [ChoiceProgress() for _ in range(self.req.n)]
        # As OpenAI does: each choice opens with the role and empty content.
        yield self._chunk([ChatStreamChoice(index=k, delta=DeltaMessage(role="assistant",
                                                                        content=""))
                           for k in range(self.req.n)])
        latest = firsts[0]
        if (chunk := self._delta_chunk(progress, latest)) is not None:
            yield chunk
        async for _, out in streams:
            latest = out
            if (chunk := self._delta_chunk(progress, out)) is not None:
                yield chunk
        if self.req.stream_options is not None and self.req.stream_options.include_usage:
            yield ChatCompletionChunk(id=self.id, created=self.created,
                                      model=self.serving.model_name, choices=[],
                                      usage=usage([latest]))

    def _delta_chunk(self, progress: list[ChoiceProgress], out: RequestOutput
                     ) -> ChatCompletionChunk | None:
        choices = []
        for c in out.outputs:
            delta = progress[c.index].take(c)
            if delta is not None:
                choices.append(ChatStreamChoice(
                    index=c.index, delta=DeltaMessage(content=delta.text),
                    logprobs=self._logprobs(delta.token_ids, delta.logprobs),
                    finish_reason=delta.finish_reason, stop_reason=delta.stop_reason))
        return self._chunk(choices) if choices else None

    def _chunk(self, choices: list[ChatStreamChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.serving.model_name,
                                   choices=choices)

    def _logprobs(self, token_ids: list[int], entries: list | None) -> ChatLogProbs | None:
        if not self.req.logprobs or entries is None:
            return None
        num_top = self.req.top_logprobs or 0
        content = []
        for token_id, entry in zip(token_ids, entries):
            chosen = entry[token_id]
            tops = sorted((lp for lp in entry.values()
                           if lp.rank is not None and lp.rank <= num_top),
                          key=lambda lp: lp.rank)[:num_top]
            content.append(ChatLogProbsContent(
                **_logprob(chosen), top_logprobs=[ChatLogProb(**_logprob(lp)) for lp in tops]))
        return ChatLogProbs(content=content)


def _logprob(lp) -> dict:
    token = lp.decoded_token or ""
    return {"token": token, "logprob": clamp_logprob(lp.logprob),
            "bytes": list(token.encode("utf-8"))}
