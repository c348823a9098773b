"""Holds requests until their grammar is compiled, so no step ever waits for a compile.

A held request is in the engine (abort, pause and failure reach it) but not in the scheduler:
it takes no batch slot and no KV block. Compiles run on a thread of their own; once one is
done, the request goes to the scheduler, or ends with finish_reason "error" and the message.
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import Callable

from treadle.request import Request
from treadle.structured_output.backend import GrammarBackend

logger = logging.getLogger(__name__)


class GrammarGate:
    def __init__(self, get_backend: Callable[[], GrammarBackend]) -> None:
        self._get_backend = get_backend
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="treadle-grammar")
        self._held: dict[str, tuple[Request, concurrent.futures.Future]] = {}
        # Called from the compile thread when a compile ends: the engine thread may be asleep.
        self.on_compiled: Callable[[], None] | None = None

    def hold(self, request: Request) -> None:
        params = request.sampling_params.structured_outputs
        future = self._pool.submit(lambda: self._get_backend().compile(params))
        self._held[request.request_id] = (request, future)
        future.add_done_callback(self._notify)

    def _notify(self, _: concurrent.futures.Future) -> None:
        if self.on_compiled is not None:
            self.on_compiled()

    def take_compiled(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Requests whose compile ended, in arrival order: (ready, [(failed, message)])."""
        ready, failed = [], []
        for rid, (request, future) in list(self._held.items()):
            if not future.done():
                continue
            del self._held[rid]
            error = future.exception()
            if error is None:
                ready.append(request)
            else:
                logger.info("request %s: its grammar did not compile: %s", rid, error)
                failed.append((request, str(error)))
        return ready, failed

    def has_compiled(self) -> bool:
        return any(future.done() for _, future in self._held.values())

    def wait(self, timeout: float) -> None:
        """Wait until some held request's compile ends (or `timeout` seconds pass)."""
        concurrent.futures.wait([f for _, f in self._held.values()], timeout,
                                return_when=concurrent.futures.FIRST_COMPLETED)

    def drop(self, request_ids: list[str]) -> list[str]:
        """Forget held requests (aborted or ended from outside); returns the ids it held."""
        return [rid for rid in request_ids if self._held.pop(rid, None) is not None]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def request_ids(self) -> list[str]:
        return list(self._held)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
