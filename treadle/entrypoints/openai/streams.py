"""Running one HTTP request's prompts on the engine, and ending them when the client leaves.

Every exit path closes the engine generators, and closing one aborts its request (AsyncLLM
frees its KV blocks), so a client that disconnects never leaves work running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from treadle.engine.async_llm import AsyncLLM
from treadle.outputs import RequestOutput
from treadle.sampling_params import SamplingParams

T = TypeVar("T")

logger = logging.getLogger(__name__)


class ClientDisconnected(Exception):
    pass


class PromptStreams:
    """The engine streams of one HTTP request (one per prompt), started together and merged.

    `start()` waits for every prompt's first output, so a request the engine refuses (paused,
    failed) fails before any response header is sent and gets its own status code.
    """

    def __init__(self, engine: AsyncLLM, prompts: list[dict[str, Any]], params: SamplingParams,
                 request_id: str, priority: int = 0, cache_salt: str | None = None,
                 log_level: int = logging.DEBUG) -> None:
        self.request_id = request_id
        self._log_level = log_level   # of the per-request abort line
        self._gens: list[AsyncGenerator[RequestOutput, None]] = [
            engine.generate(p, params, f"{request_id}-{i}", priority=priority, cache_salt=cache_salt)
            for i, p in enumerate(prompts)]
        self._pending: dict[asyncio.Future, int] = {}
        self._open_alone = False   # a lone prompt's generator has more to give

    async def start(self) -> list[RequestOutput]:
        """The first output of every prompt, in prompt order; later ones come from iterating."""
        self._pending = {asyncio.ensure_future(anext(g)): i for i, g in enumerate(self._gens)}
        await asyncio.wait(self._pending)
        started, self._pending = self._pending, {}
        errors = [e for e in (task.exception() for task in started) if e is not None]
        if errors:
            raise errors[0]   # aclose() then aborts the prompts that did start
        firsts: list[RequestOutput] = [None] * len(self._gens)  # type: ignore[list-item]
        for task, i in started.items():
            firsts[i] = task.result()
            self._schedule_next(i, firsts[i])
        return firsts

    def _schedule_next(self, i: int, out: RequestOutput) -> None:
        # After its final output a generator is left at its last yield; aclose() ends it.
        if not out.finished:
            if len(self._gens) == 1:
                self._open_alone = True   # iterated directly, with no task per output
            else:
                self._pending[asyncio.ensure_future(anext(self._gens[i]))] = i

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as outputs arrive, after those `start()` returned."""
        while self._open_alone:
            # Cancelled here (a disconnect), the generator sees it and aborts its request.
            try:
                out = await anext(self._gens[0])
            except asyncio.CancelledError:
                raise
            except BaseException:
                self._open_alone = False   # it ended with this error: nothing left to abort
                raise
            self._open_alone = not out.finished
            yield 0, out
        while self._pending:
            done, _ = await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=self._pending.__getitem__):
                i = self._pending.pop(task)
                out = task.result()
                self._schedule_next(i, out)
                yield i, out

    async def aclose(self) -> None:
        """Abort whatever has not finished. Safe to call more than once."""
        tasks = list(self._pending)
        self._pending.clear()
        if tasks or self._open_alone:
            logger.log(self._log_level, "request %s: aborting %d unfinished prompt(s)",
                       self.request_id, len(tasks) or 1)
        self._open_alone = False
        for task in tasks:
            task.cancel()   # the generator sees the cancellation and aborts its request
        await asyncio.gather(*tasks, return_exceptions=True)
        for gen in self._gens:
            await gen.aclose()


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first (ClientDisconnected)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read already, so the next message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


class SSEResponse(StreamingResponse):
    """Server-sent events that always close their engine streams, however the response ends.

    Starlette cancels the body on a disconnect from inside an anyio cancel scope, where any
    await in the body's own cleanup would be cancelled again; `on_close` runs outside it.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str],
                 on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()
