"""AsyncLLM: the online engine API for asyncio (streaming generation and the RL controls).

The engine core is built and steps on its own thread (EngineCoreThread), or in a process of its
own (EngineCoreProcess, `engine_process=True`); this object lives on the caller's event loop.
Detokenizing and stop strings happen here, on the loop, and tokenizing a text prompt on a thread
of this object's; the core's thread (or the thread receiving from its process) hands each
step's outputs over with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, AsyncGenerator, Callable, Iterable

import torch

from treadle.config import EngineArgs
from treadle.core.scheduler_output import EngineCoreOutput
from treadle.core.stats import SchedulerStats
from treadle.engine.core import PAUSE_MODES, EngineCore, PauseMode
from treadle.engine import core_calls
from treadle.engine.core_thread import EngineCoreThread
from treadle.engine.errors import EngineBusyError, EngineDeadError
from treadle.engine.input_processor import InputProcessor, PromptType
from treadle.engine.output_processor import OutputProcessor
from treadle.engine.output_stream import OutputStream
from treadle.engine.status import engine_status
from treadle.engine.weight_transfer import update_info_of
from treadle.engine.weights import ServedWeights
from treadle.metrics import PrometheusMetrics
from treadle.models.loader import load_tokenizer
from treadle.outputs import RequestOutput
from treadle.request import RequestStatus
from treadle.sampling_params import SamplingParams
from treadle.worker.malloc import keep_freed_memory

if TYPE_CHECKING:
    from treadle.engine.core_client import EngineCoreProcess

logger = logging.getLogger(__name__)

JOIN_POLL_S = 0.02   # how often a weight-transfer join is asked how it stands


class AsyncLLM:
    """`AsyncLLM(model=None, engine_process=False, **engine_args)`; with no model, the embedded
    SmolLM2-135M-Instruct. `engine_process=True` runs the engine core in a process of its own
    (engine/core_proc.py), so that it shares no GIL with this one's event loop."""

    def __init__(self, model: str | None = None, engine_process: bool = False,
                 **engine_args: Any) -> None:
        unknown = set(engine_args) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"unknown engine arguments: {', '.join(sorted(unknown))}")
        self.config = EngineArgs(model=model, **engine_args).create_config()
        self.tokenizer = load_tokenizer(self.config.model.model)
        self.input_processor = InputProcessor(self.config, self.tokenizer)
        self.metrics = PrometheusMetrics()
        self.output_processor = OutputProcessor(self.tokenizer, self.metrics.requests)
        # Texts are tokenized off the event loop (a long one takes about a second per MB), on
        # one thread, so requests still reach the engine in the order they came.
        self._tokenize_thread = ThreadPoolExecutor(1, thread_name_prefix="treadle-tokenize")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, OutputStream] = {}
        self._pause_mode: PauseMode | None = None
        self._pause_lock: asyncio.Lock | None = None
        self._dead: BaseException | None = None
        self._last_weights: ServedWeights | None = None   # of the latest outputs delivered
        self._core: EngineCoreThread | EngineCoreProcess
        if engine_process:
            # Imported only here: pyzmq is not on every machine (a GPU machine may lack it).
            from treadle.engine.core_client import EngineCoreProcess
            self._core = EngineCoreProcess(self.config, self._outputs_from_thread,
                                           self._error_from_thread)
            self.core: EngineCore | None = None   # in the other process: reach it by _call
        else:
            if self.config.device.startswith("cpu"):
                keep_freed_memory()   # before the engine thread's first allocation picks its arena
            self._core = EngineCoreThread(lambda: EngineCore(self.config),
                                          self._outputs_from_thread, self._error_from_thread)
            self.core = self._core.core

    def get_tokenizer(self):
        return self.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.config.model.max_model_len

    # -- generation ----------------------------------------------------------------------
    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream `RequestOutput`s for one prompt (cumulative unless output_kind is delta).
        Outputs that arrive while the caller is busy come as one (engine/output_stream.py).

        Leaving the generator early (a cancelled task, a closed stream) aborts the request.
        """
        params = sampling_params or self.config.model.generation.sampling_params()
        request_id = request_id or uuid.uuid4().hex
        stream = await self._add_request(request_id, prompt, params, priority, cache_salt)
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._abort_now(request_id)

    async def _add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                           priority: int, cache_salt: str | None) -> OutputStream:
        self._bind_loop()
        self._check_new_request(request_id)
        if self.input_processor.needs_tokenizer(prompt):
            text, ids = await asyncio.get_running_loop().run_in_executor(
                self._tokenize_thread, self.input_processor.tokenize, prompt)
            self._check_new_request(request_id)   # a pause or the same id may have come meanwhile
        else:
            text, ids = self.input_processor.tokenize(prompt)
        text, ids = self.input_processor.truncate(text, ids, params)
        requests = self.input_processor.make_requests(request_id, ids, params, priority, cache_salt,
                                                      prompt_text=text)
        stream = OutputStream(params.output_kind)
        self._streams[request_id] = stream
        self.output_processor.add_request(request_id, text, ids, params,
                                          [r.request_id for r in requests])
        try:
            await asyncio.wrap_future(self._core.call(EngineCore.add_requests, requests))
        except BaseException:
            # Cancelled while the engine thread may already have added it: abort it there too.
            self._streams.pop(request_id, None)
            self._abort_now(request_id)
            raise
        return stream

    def _check_new_request(self, request_id: str) -> None:
        self._check_accepting()
        if request_id in self._streams or request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")

    def _check_accepting(self) -> None:
        # A worker group that died and will not be replaced too: refused now, not accepted
        # and ended with an error by the next step.
        self._check_alive()
        if self._pause_mode in ("abort", "wait"):
            raise EngineBusyError(f"generation is paused (mode {self._pause_mode!r}); "
                                  "retry after resume_generation()")

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """End requests now: each stream gets a final output with finish_reason "abort".
        Returns once the engine has freed their KV blocks."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        done = [self._abort_now(rid) for rid in ids]
        await asyncio.gather(*(asyncio.wrap_future(f) for f in done if f is not None))

    def _abort_now(self, request_id: str) -> Future | None:
        """Abort without waiting; the future completes when the engine has dropped the request."""
        final, engine_ids = self.output_processor.abort_request(request_id)
        stream = self._streams.get(request_id)
        if final is not None and stream is not None:
            stream.put(final, self._last_weights)   # made of what the last delivery made
        return self._core.call(EngineCore.abort_requests, engine_ids) if engine_ids else None

    # -- outputs from the engine thread --------------------------------------------------
    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("AsyncLLM is bound to another event loop")

    def _outputs_from_thread(self, outputs: list[EngineCoreOutput], weights: ServedWeights) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver, outputs, weights)

    def _deliver(self, outputs: list[EngineCoreOutput], weights: ServedWeights) -> None:
        ready, stopped = self.output_processor.process_outputs(outputs, weights.label)
        self._last_weights = weights
        if stopped:
            self._core.call(EngineCore.finish_requests, stopped, RequestStatus.FINISHED_STOPPED)
        for out in ready:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out, weights)

    def _error_from_thread(self, exc: BaseException) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fail_all, exc)
        else:
            self._dead = exc

    def _fail_all(self, exc: BaseException) -> None:
        self._dead = exc
        for stream in self._streams.values():
            stream.put(EngineDeadError(f"the engine core failed: {exc!r}"))

    async def _call(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """fn(core, *args, **kwargs) between the core's steps: an EngineCore method or a
        function of engine/core_calls.py."""
        return await asyncio.wrap_future(self._submit(fn, *args, **kwargs))

    def _submit(self, fn: Callable, *args: Any, **kwargs: Any) -> Future:
        if self._dead is not None:
            raise EngineDeadError(f"the engine core failed: {self._dead!r}")
        return self._core.call(fn, *args, **kwargs)

    # -- RL controls ---------------------------------------------------------------------
    def _lock(self) -> asyncio.Lock:
        if self._pause_lock is None:
            self._pause_lock = asyncio.Lock()
        return self._pause_lock

    async def pause_generation(self, *, mode: PauseMode = "abort", clear_cache: bool = True) -> None:
        """abort: end every request now (finish_reason "abort"); wait: let every request finish;
        keep: freeze requests, to continue on resume. New requests are refused (EngineBusyError)
        while paused in abort or wait mode, and queue in keep mode."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
        self._bind_loop()
        if mode == "abort" and self._lock().locked():
            # A pause("wait") holding the lock waits for these requests: end them now, so that
            # an abort can cut a drain short instead of queueing behind it.
            self._abort_every_request()
        async with self._lock():
            previous, self._pause_mode = self._pause_mode, mode
            pause_call: Future | None = None
            try:
                if mode == "abort":
                    self._abort_every_request()
                elif mode == "wait":
                    await self._call(EngineCore.prepare_to_finish_requests)
                    await asyncio.wrap_future(self._core.when_idle())
                pause_call = self._submit(EngineCore.pause, mode, clear_cache)
                await asyncio.wrap_future(pause_call)
            except BaseException:   # refused or cancelled: back to the state before this call
                self._pause_mode = previous
                if previous is not None:   # "wait" let kept requests run: freeze them again
                    self._core.call(EngineCore.pause, "keep", False)
                elif pause_call is not None and not pause_call.cancelled():
                    # Cancelled while the engine thread was already pausing: that pause still
                    # happens, so undo it after it, or the core stays paused unseen.
                    self._core.call(EngineCore.resume)
                raise

    def _abort_every_request(self) -> None:
        for rid in list(self.output_processor.requests):
            self._abort_now(rid)

    async def resume_generation(self) -> None:
        self._bind_loop()
        async with self._lock():
            await self._call(EngineCore.resume)
            self._pause_mode = None

    async def check_health(self) -> None:
        """Raises EngineDeadError once the engine core has failed, or a worker has died."""
        self._check_alive()

    def _check_alive(self) -> None:
        # The thread's record first: the loop may not have run _fail_all yet.
        dead = self._dead or self._core.failure()
        if dead is not None:
            raise EngineDeadError(f"the engine core failed: {dead!r}")
        # Asked here, not on the engine thread, which may be busy with a long step.
        reason = self._core.worker_failure()
        if reason is not None:
            raise EngineDeadError(reason)

    async def get_stats(self) -> SchedulerStats:
        """Running/waiting counts, KV usage, prefix-cache, preemption and spec-decode counters."""
        return await self._call(EngineCore.get_stats)

    async def render_metrics(self) -> bytes:
        """Every `treadle:*` metric in the Prometheus text format."""
        return self.metrics.render(await self.get_stats())

    async def is_paused(self) -> bool:
        return self._pause_mode is not None

    async def is_sleeping(self) -> bool:
        """As vLLM's: from sleep() until every part it put to sleep is woken."""
        return await self._call(core_calls.is_asleep)

    async def get_engine_status(self) -> dict[str, Any]:
        """Requests with their progress, the KV cache block by block, counters and the pause
        state, as of one moment between steps (engine/status.py)."""
        status = await self._call(engine_status)
        status["pause_mode"] = self._pause_mode
        return status

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return await self._call(EngineCore.reset_prefix_cache, reset_running_requests)

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                             weight_version: Any = None) -> int:
        """Copy (transformers parameter name, tensor) pairs into the model in place; a subset is
        fine. Refused while requests run unless paused. The prefix cache is dropped afterwards.
        Given a weight-transfer request ({"update_info": {...}}), receive that part of a round."""
        if update_info_of(named_tensors) is None:
            named_tensors = list(named_tensors)
        return await self._call(EngineCore.update_weights, named_tensors, weight_version)

    async def init_weight_transfer_engine(self, request: Any) -> None:
        """Join the trainer's group: {"init_info": {master_address, master_port, rank_offset,
        world_size}} (treadle/distributed/weight_transfer.py)."""
        await self._call(EngineCore.init_weight_transfer_engine, request)
        # The workers join on threads of their own: requests keep running meanwhile.
        while not await self._call(EngineCore.weight_transfer_joined):
            await asyncio.sleep(JOIN_POLL_S)

    async def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        await self._call(EngineCore.start_weight_update, is_checkpoint_format)

    async def finish_weight_update(self, weight_version: Any = None) -> int:
        """Apply the round received since start_weight_update; returns the weights set."""
        return await self._call(EngineCore.finish_weight_update, weight_version)

    async def load_weights(self, path: str, weight_version: Any = None) -> int:
        return await self._call(EngineCore.load_weights, path, weight_version)

    async def labelled(self, change: str, *args: Any) -> tuple[int, Any]:
        """A weight change (`change`: "load_weights" or "finish_weight_update", with its
        arguments) and the label it left, read in the same call on the engine thread: a change
        queued behind it cannot lend it its own label."""
        if change not in core_calls.WEIGHT_CHANGES:   # here too: nothing is sent for it
            raise ValueError(f"change must be load_weights or finish_weight_update, got {change!r}")
        return await self._call(core_calls.labelled, change, *args)

    async def get_weight_version(self) -> Any:
        return await self._call(core_calls.weight_version)

    async def sleep(self, level: int = 1) -> None:
        await self._call(EngineCore.sleep, level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._call(EngineCore.wake_up, tags)

    async def collective_rpc(self, method: str | Callable, args: tuple = (),
                             kwargs: dict[str, Any] | None = None) -> list[Any]:
        return await self._call(EngineCore.collective_rpc, method, args, kwargs)

    def shutdown(self) -> None:
        """Abort whatever is running and stop the engine thread."""
        for rid in list(self.output_processor.requests):
            self._abort_now(rid)
        self._tokenize_thread.shutdown(wait=False, cancel_futures=True)
        self._core.stop()
