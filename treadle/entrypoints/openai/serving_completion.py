"""POST /v1/completions.

`echo` with `logprobs` follows what lm-evaluation-harness's `local-completions` loglikelihood
path reads: the text starts with the prompt, and `tokens`, `token_logprobs`, `top_logprobs`
and `text_offset` cover the prompt tokens (the first has no logprob: null) and then the
generated ones. `echo` with `max_tokens: 0` returns the prompt alone, as vLLM does.
"""

from __future__ import annotations

import codecs
import time
import uuid
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from treadle.entrypoints.openai.errors import OpenAIError
from treadle.entrypoints.openai.protocol import (CompletionChoice, CompletionLogProbs,
                                                  CompletionRequest, CompletionResponse)
from treadle.entrypoints.openai.serving import (ChoiceProgress, OpenAIServing, TokenBytes,
                                                 clamp_logprob, prompt_logprobs, usage)
from treadle.entrypoints.openai.streams import PromptStreams
from treadle.outputs import RequestOutput
from treadle.sampling_params import RequestOutputKind


class CompletionServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        serving = self.serving
        serving.check_request(req, req.model)
        if req.suffix is not None:
            raise OpenAIError(400, "suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise OpenAIError(400, "best_of is not supported (it must equal n)", "best_of")
        prompts = await serving.off_loop(self._prompts, req)
        # Echo with max_tokens 0 scores the prompt only; the engine still makes one token.
        prompt_only = req.echo and req.max_tokens == 0
        overrides = {}
        if req.echo and req.logprobs is not None:   # the prompt's logprobs go in `logprobs`
            if req.prompt_logprobs is not None:
                raise OpenAIError(400, "prompt_logprobs with echo and logprobs would return the "
                                       "prompt's logprobs twice: send one of them",
                                  "prompt_logprobs")
            overrides["prompt_logprobs"] = req.logprobs
        max_tokens = req.max_tokens
        bound = serving.engine.config.model.generation.max_tokens
        if "max_tokens" not in req.model_fields_set and bound is not None:
            max_tokens = min(max_tokens, bound)   # OpenAI's 16, or the model's max_new_tokens if less
        params = serving.sampling_params(
            req, RequestOutputKind.CUMULATIVE if req.stream else RequestOutputKind.FINAL_ONLY,
            max_tokens=1 if prompt_only else max_tokens, logprobs=req.logprobs, **overrides)
        truncate = serving.engine.input_processor.truncate
        prompts = [dict(zip(("prompt", "prompt_token_ids"),
                            truncate(p["prompt"], p["prompt_token_ids"], params))) for p in prompts]
        await serving.validate(params, [p["prompt_token_ids"] for p in prompts], req)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        render = _Renderer(serving, req, request_id, prompts, prompt_only)
        return await serving.run(raw, request_id, prompts, params, req.priority, req.cache_salt,
                                 req.stream, render.response, render.chunks)

    def _prompts(self, req: CompletionRequest) -> list[dict[str, Any]]:
        """A str, a list of str, a list of token ids, or a list of lists: one dict per prompt."""
        prompt = req.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise OpenAIError(400, "prompt must not be empty", "prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                out.append({"prompt": p, "prompt_token_ids": self.serving.encode(
                    p, add_special_tokens=req.add_special_tokens)})
            else:
                out.append({"prompt": None, "prompt_token_ids": list(p)})
        return out


class _TextOffsets:
    """Where each token's text starts in a choice's text, token by token: a character split
    over several tokens counts once, at its first token (each part alone decodes to U+FFFD, one
    char apiece, and offsets counted from those drift); special tokens count only where the
    text holds them (the echoed prompt; the output unless skip_special_tokens)."""

    def __init__(self, token_bytes: TokenBytes, special_ids: set[int], skip_special: bool,
                 start: int) -> None:
        self.token_bytes = token_bytes
        self.special_ids = special_ids
        self.skip_special = skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = start

    def next(self, token_id: int, text: str, in_output: bool) -> int:
        at = self.chars
        if not (in_output and self.skip_special and token_id in self.special_ids):
            self.chars += len(self._decoder.decode(self.token_bytes(token_id, text)))
        return at


class _Renderer:
    """Turns engine outputs into one completion response or its stream of chunks.

    Choice i * n + k is sample k of prompt i, as in OpenAI's API.
    """

    def __init__(self, serving: OpenAIServing, req: CompletionRequest, request_id: str,
                 prompts: list[dict[str, Any]], prompt_only: bool) -> None:
        self.serving = serving
        self.req = req
        self.prompt_only = prompt_only
        decode = serving.tokenizer.decode
        self.prompt_texts = [decode(p["prompt_token_ids"]) if p["prompt"] is None else p["prompt"]
                             for p in prompts]
        self.id = request_id
        self.created = int(time.time())
        self.token_bytes = TokenBytes(serving.tokenizer)
        self.special_ids = set(serving.tokenizer.all_special_ids)

    def _offsets(self, start: int) -> _TextOffsets:
        return _TextOffsets(self.token_bytes, self.special_ids, self.req.skip_special_tokens, start)

    # -- whole response --------------------------------------------------------------------
    def response(self, finals: list[RequestOutput]) -> Response:
        choices = []
        for i, out in enumerate(finals):
            for c in out.outputs:
                text, ids, lps = c.text, c.token_ids, c.logprobs
                if self.prompt_only:
                    text, ids, lps = "", [], []
                choices.append(self._choice(i, out, c.index, text, ids, lps, echo=self.req.echo,
                                            offsets=self._offsets(0),
                                            finish_reason=c.finish_reason,
                                            stop_reason=c.stop_reason, first=True))
        body = CompletionResponse(id=self.id, created=self.created, model=self.serving.model_name,
                                  choices=choices,
                                  usage=usage(finals, count_completion=not self.prompt_only),
                                  kv_transfer_params=finals[0].kv_transfer_params,
                                  weight_version=finals[-1].weight_version)
        return Response(body.model_dump_json(), media_type="application/json")

    # -- streamed ----------------------------------------------------------------------------
    async def chunks(self, firsts: list[RequestOutput], streams: PromptStreams
                     ) -> AsyncIterator[CompletionResponse]:
        n = self.req.n
        progress = [ChoiceProgress() for _ in range(len(firsts) * n)]
        # text_offset of the next token, per choice: as vLLM's, the length of the text streamed
        # so far (a stop string's hold-back can keep it behind the tokens already sent); the
        # bytes of a character begun in an earlier chunk stay with the choice's offsets.
        offsets = [self._offsets(0) for _ in progress]
        streamed = [0] * len(progress)
        latest = list(firsts)
        every = self.req.stream_options is not None and self.req.stream_options.usage_in_every_chunk

        def chunks(i: int, out: RequestOutput) -> list[CompletionResponse]:
            """A chunk for each choice with something new, as vLLM and OpenAI stream n > 1: its
            continuous usage then counts that choice's tokens alone, as vLLM's does."""
            made = []
            for c in out.outputs:
                index = i * n + c.index
                first = progress[index].num_tokens == 0 and progress[index].text_len == 0
                delta = progress[index].take(c)
                if delta is None:
                    continue
                echo = self.req.echo and first
                text, ids, lps = delta.text, delta.token_ids, delta.logprobs
                if self.prompt_only:
                    text, ids, lps = "", [], []
                offsets[index].chars = streamed[index]
                choice = self._choice(i, out, c.index, text, ids, lps, echo, offsets[index],
                                      delta.finish_reason, delta.stop_reason, first)
                # The echoed prompt counts: its tokens' offsets came first (vLLM leaves it out).
                streamed[index] += len(choice.text)
                made.append(CompletionResponse(
                    id=self.id, created=self.created, model=self.serving.model_name,
                    choices=[choice], weight_version=out.weight_version,
                    usage=usage([out], not self.prompt_only, index=c.index) if every else None))
            return made

        for i, out in enumerate(firsts):
            for c in chunks(i, out):
                yield c
        async for i, out in streams:
            latest[i] = out
            for c in chunks(i, out):
                yield c
        if self.req.stream_options is not None and self.req.stream_options.usage_at_the_end:
            yield CompletionResponse(id=self.id, created=self.created,
                                     model=self.serving.model_name, choices=[],
                                     usage=usage(latest, count_completion=not self.prompt_only))

    # -- one choice ----------------------------------------------------------------------------
    def _choice(self, i: int, out: RequestOutput, k: int, text: str, ids: list[int],
                lps: list | None, echo: bool, offsets: _TextOffsets, finish_reason: str | None,
                stop_reason: int | str | None, first: bool) -> CompletionChoice:
        """`echo` puts the prompt (its text, tokens and logprobs) in front of this part; with
        return_token_ids, the `first` part of a choice carries the prompt's ids."""
        token_ids = prompt_token_ids = None
        if self.req.return_token_ids:
            token_ids = list(ids)
            prompt_token_ids = list(out.prompt_token_ids) if first else None
        logprobs = None
        if self.req.logprobs is not None:
            num_prompt = 0
            if echo:
                num_prompt = len(out.prompt_token_ids)
                ids = out.prompt_token_ids + ids
                lps = (out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + (lps or [])
            logprobs = self._logprobs(ids, lps or [], offsets, num_prompt)
        if echo:
            text = self.prompt_texts[i] + text
        prompt_lps = (prompt_logprobs(out, self.serving.tokenizer.decode)
                      if self.req.prompt_logprobs is not None else None)
        return CompletionChoice(index=i * self.req.n + k, text=text, logprobs=logprobs,
                                finish_reason=finish_reason, stop_reason=stop_reason,
                                prompt_token_ids=prompt_token_ids, token_ids=token_ids,
                                prompt_logprobs=prompt_lps)

    def _logprobs(self, ids: list[int], entries: list, offsets: _TextOffsets,
                  num_prompt: int) -> CompletionLogProbs:
        """OpenAI's legacy logprobs: a null entry (the first prompt token) has no logprob."""
        result = CompletionLogProbs()
        decode = self.serving.tokenizer.decode
        as_ids = self.req.return_tokens_as_token_ids

        def text_of(token_id: int, lp) -> str:
            return lp.decoded_token if lp is not None and lp.decoded_token is not None \
                else decode([token_id])

        def name(token_id: int, lp) -> str:
            # vLLM's "token_id:{id}" names a token that is not whole text (part of a character).
            return f"token_id:{token_id}" if as_ids else text_of(token_id, lp)

        for k, (token_id, entry) in enumerate(zip(ids, entries)):
            chosen = entry[token_id] if entry is not None else None
            if entry is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            else:
                result.token_logprobs.append(clamp_logprob(chosen.logprob))
                # The chosen token plus the top `logprobs`, keyed by text as OpenAI does.
                # Two tokens of one text (parts of characters, both U+FFFD) share a key: the
                # chosen token's value goes in last, so that top_logprobs[tokens[i]] is its own.
                result.top_logprobs.append({name(tid, lp): clamp_logprob(lp.logprob)
                                            for tid, lp in sorted(entry.items(),
                                                                  key=lambda kv: kv[0] == token_id)})
            result.tokens.append(name(token_id, chosen))
            result.text_offset.append(offsets.next(token_id, text_of(token_id, chosen),
                                                   in_output=k >= num_prompt))
        return result
