"""One request's outputs on their way from the engine to the code awaiting them.

The engine delivers an output per step. Outputs that arrive while the consumer is busy (a
server writing one event per output to many sockets) merge as they arrive, as vLLM's
RequestOutputCollector does, so that it does less work per token exactly when it is short of
time, and a consumer that stops reading holds one output, not one per step:
  - cumulative outputs: the latest holds all the others;
  - delta outputs: their new text, token ids and logprobs joined, sample by sample, in time
    linear in what they hold.
Outputs made by different weights never merge (a trainer reads which weights made which
tokens): each comes with the engine's served weights, whose object changes with every update,
whatever label the user gave it. An error comes after the outputs queued before it.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from typing import Any

from treadle.outputs import CompletionOutput, RequestOutput
from treadle.sampling_params import RequestOutputKind


class _Merged:
    """Outputs of one request and one set of weights, merged into one as they arrive."""

    def __init__(self, out: RequestOutput, weights: Any, delta: bool) -> None:
        self.weights = weights
        self.delta = delta
        self.out = out
        # Delta: per sample index, its text pieces (joined once, when taken) and its output,
        # whose fresh token id and logprob lists grow in place.
        self.texts: dict[int, list[str]] = {c.index: [c.text] for c in out.outputs} if delta else {}
        self.samples: dict[int, CompletionOutput] = {c.index: c for c in out.outputs} if delta else {}

    def add(self, out: RequestOutput) -> None:
        if not self.delta:
            self.out = out
            return
        for c in out.outputs:
            mine = self.samples.get(c.index)
            if mine is None:
                self.samples[c.index], self.texts[c.index] = c, [c.text]
                continue
            self.texts[c.index].append(c.text)
            mine.token_ids.extend(c.token_ids)
            if c.logprobs is not None:
                if mine.logprobs is None:
                    mine.logprobs = []
                mine.logprobs.extend(c.logprobs)
            mine.finish_reason, mine.stop_reason = c.finish_reason, c.stop_reason
        self.out = dataclasses.replace(
            out, prompt_logprobs=out.prompt_logprobs if out.prompt_logprobs is not None
            else self.out.prompt_logprobs,
            kv_transfer_params=out.kv_transfer_params if out.kv_transfer_params is not None
            else self.out.kv_transfer_params)

    def take(self) -> RequestOutput:
        if not self.delta:
            return self.out
        for index, sample in self.samples.items():
            if len(self.texts[index]) > 1:
                sample.text = "".join(self.texts[index])
        return dataclasses.replace(
            self.out, outputs=sorted(self.samples.values(), key=lambda c: c.index))


class OutputStream:
    def __init__(self, kind: RequestOutputKind) -> None:
        self.delta = kind == RequestOutputKind.DELTA
        self._items: collections.deque[_Merged | BaseException] = collections.deque()
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException, weights: Any = None) -> None:
        """Queue an output made by `weights` (compared by identity), or an error."""
        tail = self._items[-1] if self._items else None
        if isinstance(item, BaseException):
            self._items.append(item)
        elif isinstance(tail, _Merged) and tail.weights is weights:
            tail.add(item)
        else:
            self._items.append(_Merged(item, weights, self.delta))
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        """What arrived since the last get, merged; waits when nothing has."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        return item.take() if isinstance(item, _Merged) else item
