"""One request's outputs on their way from the engine to the code awaiting them.

The engine delivers an output per step. A consumer that falls behind (a server writing one
event per output to many sockets) takes everything that arrived meanwhile as one output, as
vLLM's RequestOutputCollector does, so that it does less work per token exactly when it is
short of time:
  - cumulative outputs: the latest holds all the others;
  - delta outputs: their new text, token ids and logprobs joined, sample by sample.
Outputs of different weight versions never merge (a trainer reads which weights made which
tokens), and an error is raised only after the outputs queued before it.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses

from treadle.outputs import CompletionOutput, RequestOutput
from treadle.sampling_params import RequestOutputKind


class OutputStream:
    def __init__(self, kind: RequestOutputKind) -> None:
        self.kind = kind
        self._items: collections.deque[RequestOutput | BaseException] = collections.deque()
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        self._items.append(item)
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        """What arrived since the last get, merged where it can be; waits when nothing has."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        out = self._items.popleft()
        while (self._items and isinstance(out, RequestOutput)
               and isinstance(nxt := self._items[0], RequestOutput)
               and nxt.weight_version == out.weight_version):
            self._items.popleft()
            out = merge_delta(out, nxt) if self.kind == RequestOutputKind.DELTA else nxt
        return out


def merge_delta(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two delta outputs of one request as one: each sample's new parts, in order; the
    request-level fields (finished, cached tokens, transfer params) as of the later."""
    samples = {c.index: c for c in first.outputs}
    for c in then.outputs:
        before = samples.get(c.index)
        if before is None:
            samples[c.index] = c
            continue
        logprobs = (None if before.logprobs is None and c.logprobs is None
                    else (before.logprobs or []) + (c.logprobs or []))
        samples[c.index] = CompletionOutput(
            index=c.index, text=before.text + c.text, token_ids=before.token_ids + c.token_ids,
            logprobs=logprobs, finish_reason=c.finish_reason, stop_reason=c.stop_reason)
    return dataclasses.replace(
        then, outputs=sorted(samples.values(), key=lambda c: c.index),
        prompt_logprobs=then.prompt_logprobs if then.prompt_logprobs is not None
        else first.prompt_logprobs,
        kv_transfer_params=then.kv_transfer_params if then.kv_transfer_params is not None
        else first.kv_transfer_params)
