"""EngineCore: the step loop joining the scheduler and the executor, and the RL controls.

The batch queue holds steps scheduled and not yet accounted for: one per pipeline stage, plus
one with async scheduling, so step N+1 is scheduled while step N runs (and with P stages, P
steps run at once, one in each). Steps are accounted for in the order they were scheduled; the
scheduler counts what is in flight in tokens per request.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from typing import Any, Callable, Iterable, Literal, NoReturn

import torch

from treadle.config import TreadleConfig, max_steps_in_flight, window_reach
from treadle.core.scheduler import Scheduler
from treadle.core.scheduler_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from treadle.core.stats import SchedulerStats
from treadle.engine.errors import EngineDeadError
from treadle.engine.weight_transfer import WeightTransfer, update_info_of
from treadle.engine.weights import ServedWeights, check_label, files_stamp
from treadle.engine.worker_restart import restart_refusal, restart_workers
from treadle.executor.base import WorkerFailedError
from treadle.executor.factory import create_executor
from treadle.kv_transfer import KVConnectorRole, create_connector
from treadle.models.loader import resolve_model
from treadle.models.rope import long_rope_after
from treadle.request import Request, RequestStatus
from treadle.structured_output.gate import GrammarGate
from treadle.structured_output.registry import get_backend

logger = logging.getLogger(__name__)

PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES = ("abort", "wait", "keep")
SLEEP_TAGS = ("weights", "kv_cache")
CONNECTOR_RETRY_S = 0.005   # between schedules while a connector answers "ask again later"


class EngineCore:
    def __init__(self, config: TreadleConfig) -> None:
        self.config = config
        self.executor = create_executor(config)
        num_blocks = self.executor.num_blocks
        cache, model = config.cache, config.model
        reach = window_reach(config)
        capacity = cache.capacity_tokens(num_blocks, reach)
        if capacity is not None and model.max_model_len > capacity:
            if model.max_model_len_is_explicit:   # as vLLM: the user's number is not lowered
                self.executor.shutdown()
                raise ValueError(
                    f"max_model_len ({model.max_model_len}) is more than the KV cache can hold "
                    f"({capacity} tokens: {num_blocks} blocks of {cache.block_size}, one kept "
                    f"empty); lower max_model_len to at most {capacity}, or raise num_kv_blocks "
                    "or kv_cache_memory_bytes")
            logger.warning("max_model_len %d exceeds the KV cache (%d tokens); capping it",
                           model.max_model_len, capacity)
            model.max_model_len = capacity
        self.connector = create_connector(config, KVConnectorRole.SCHEDULER)
        self.scheduler = Scheduler(
            config.scheduler, cache, num_blocks, model.max_model_len, seed=model.seed,
            connector=self.connector,
            kv_load_failure_policy=config.kv_transfer.kv_load_failure_policy
            if config.kv_transfer is not None else "recompute",
            long_rope_after=long_rope_after(model.hf_config, model.max_model_len),
            window_reach=reach)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB); max concurrency %.1fx at %d tokens",
                    num_blocks, cache.block_size,
                    num_blocks * cache.bytes_per_block(model) / 2**20,
                    (num_blocks - 1) / cache.kv_groups.peak_blocks(model.max_model_len,
                                                                   cache.block_size, reach),
                    model.max_model_len)
        # Requests whose grammar is compiling: in the engine, not yet in the scheduler.
        self.grammars = GrammarGate(lambda: get_backend(
            config.structured_outputs.backend, model.model, model.vocab_size),
            config.structured_outputs.compilation_timeout_s)
        self.async_scheduling = config.scheduler.async_scheduling
        self.max_steps_in_flight = max_steps_in_flight(config)
        # A step returns at once (sync, one stage) or later, through its .result().
        self.batch_queue: deque[tuple[Any, SchedulerOutput]] = deque()
        # Outputs of steps finished outside step() (drains, aborts), made by the weights served
        # now; step() hands them out first.
        self._pending: list[EngineCoreOutput] = []
        # Outputs held across a weight change, with the weights that made them, oldest first.
        self._held_before: list[tuple[ServedWeights, list[EngineCoreOutput]]] = []
        self.paused = False
        self.asleep: set[str] = set()     # parts put to sleep and not woken yet
        # Stamped where workers may be restarted: they reload these files, which must still
        # be the ones loaded at start-up.
        self.weights = (ServedWeights(checkpoint=model.model, source_stamp=files_stamp(model.model))
                        if config.parallel.max_worker_restarts else ServedWeights())
        self.weight_transfer = WeightTransfer(config.weight_transfer)
        self.num_worker_restarts = 0

    # -- requests ----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.grammars:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.sampling_params.structured_outputs is None:
            self.scheduler.add_request(request)
        else:
            self.scheduler.check_request(request)
            self.grammars.hold(request)
            self.executor.warm_grammar(request.sampling_params.structured_outputs)
        if self._pending or self._held_before:
            # Taken (the id was free): outputs held since a drain (a pause, a cache reset) under
            # this id are an ended request's, which its new tenant must not take, since outputs
            # go out by id alone (a helper's hunt). In place: pause("abort") may be extending
            # this very list.
            for held in [self._pending] + [outputs for _, outputs in self._held_before]:
                held[:] = [o for o in held if o.request_id != request.request_id]

    def add_requests(self, requests: list[Request]) -> None:
        """All of a user request's samples (n > 1), or none of them."""
        added = []
        try:
            for r in requests:
                self.add_request(r)
                added.append(r.request_id)
        except Exception:
            self.abort_requests(added)
            raise

    def abort_requests(self, request_ids: list[str]) -> None:
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        self.grammars.drop(request_ids)
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or len(self.grammars) > 0

    def is_idle(self) -> bool:
        return not self.has_unfinished_requests() and not self.batch_queue

    def has_work(self) -> bool:
        """Whether step() would do anything now (a compile still running is not work)."""
        return bool(self._pending or self._held_before or self.batch_queue
                    or self.grammars.has_compiled()
                    or (self._can_schedule() and self.scheduler.has_unfinished_requests()))

    # -- the step ------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Schedule a step if there is room in the batch queue, then account for the oldest one
        once the queue is full (or nothing more can be scheduled); returns what requests produced."""
        outputs = self.take_pending_outputs() + self._release_compiled()
        scheduled = False
        if (self._can_schedule() and len(self.batch_queue) < self.max_steps_in_flight
                and self.scheduler.has_unfinished_requests()):
            sched_out = self.scheduler.schedule()
            if not sched_out.is_empty:
                try:
                    result = self.executor.execute_model(
                        sched_out, non_block=self.max_steps_in_flight > 1)
                except WorkerFailedError as e:
                    self.batch_queue.append((None, sched_out))   # scheduled, and lost
                    self._lost_workers(e)
                    return outputs
                self.batch_queue.append((result, sched_out))
                scheduled = True
            elif not self.batch_queue:
                if sched_out.waiting_for_connector:
                    # The connector cannot tell yet what it can load for the next request.
                    time.sleep(CONNECTOR_RETRY_S)
                    return outputs
                # Every known request fits on its own, so an idle step with work waiting is a bug.
                raise RuntimeError("scheduler made no progress with requests waiting")
        if not self.batch_queue:
            if not outputs and len(self.grammars) and not self.scheduler.has_unfinished_requests():
                self.grammars.wait(timeout=0.1)   # nothing to run until a grammar compiles
            return outputs
        if scheduled and len(self.batch_queue) < self.max_steps_in_flight:
            return outputs  # room for one more step before waiting on the oldest
        return outputs + self._finish_oldest_step()

    def _release_compiled(self) -> list[EngineCoreOutput]:
        """Requests whose grammar compiled go to the scheduler; a failed compile ends its request."""
        ready, failed = self.grammars.take_compiled()
        for request in ready:
            self.scheduler.add_request(request)
        return [EngineCoreOutput(request_id=r.request_id, new_token_ids=[], finish_reason="error",
                                 stop_reason=message) for r, message in failed]

    def _can_schedule(self) -> bool:
        return not self.paused and not self.asleep

    def _finish_oldest_step(self) -> list[EngineCoreOutput]:
        result, sched_out = self.batch_queue.popleft()
        try:
            runner_out = result if isinstance(result, ModelRunnerOutput) else result.result()
        except WorkerFailedError as e:
            self.batch_queue.appendleft((None, sched_out))   # lost with the others in flight
            self._lost_workers(e)
            return []
        except Exception as e:   # the step is lost: no state can be trusted after it
            raise EngineDeadError(f"a model step failed: {e!r}") from e
        try:
            return self.scheduler.update_from_output(sched_out, runner_out)
        except Exception as e:   # the runner broke the scheduler's contract for this step
            raise EngineDeadError(f"a model step's output was invalid: {e}") from e

    def _lost_workers(self, error: WorkerFailedError) -> None:
        """Restart the worker group if allowed (`max_worker_restarts`), else the engine is dead."""
        refusal = restart_refusal(self)
        if refusal is not None:
            raise EngineDeadError(f"a model step failed: {error!r}{refusal}") from error
        try:
            restart_workers(self, str(error))
        except Exception as e:   # no workers now: nothing can run
            raise EngineDeadError(f"{error}; restarting the workers failed: {e!r}") from e

    def drain(self) -> None:
        """Wait for every step in flight and account for it; its outputs go out with the next step()."""
        while self.batch_queue:
            self._pending += self._finish_oldest_step()

    # -- pause / resume ------------------------------------------------------------------
    def pause(self, mode: PauseMode = "abort", clear_cache: bool = True) -> None:
        """Stop scheduling. abort: end every request now; wait: finish every request first;
        keep: freeze requests where they are. With clear_cache, the prefix cache is dropped
        once in-flight steps are done, and kept requests recompute on resume."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
        if mode == "abort":
            self._pending += self.abort_all()
        elif mode == "wait":
            self.prepare_to_finish_requests()
            while not self.is_idle():
                # step() hands out what was pending, so it is all held again. (`_pending +=
                # self.step()` would read the list before step() swaps it: every output twice.)
                outputs = self.step()
                self._pending.extend(outputs)
        self.paused = True
        self.drain()
        if clear_cache:
            cleared = self.reset_prefix_cache(reset_running_requests=True)
            assert cleared, "no block may be held once running requests are reset"

    def prepare_to_finish_requests(self) -> None:
        """Before waiting for every request to finish: requests kept by an earlier pause must run."""
        if self.asleep and self.has_unfinished_requests():
            raise RuntimeError("requests cannot finish while the engine sleeps: call wake_up() first")
        self.paused = False

    def resume(self) -> None:
        self.paused = False

    def take_held_outputs(self) -> list[tuple[ServedWeights, list[EngineCoreOutput]]]:
        """Every output held since a drain or abort, in groups by the weights that made
        them, oldest first: a weight change may have come between a drain and now."""
        groups = self._held_before + ([(self.weights, self._pending)] if self._pending else [])
        self._held_before, self._pending = [], []
        return groups

    def take_pending_outputs(self) -> list[EngineCoreOutput]:
        """Every output held, in one list (take_held_outputs says which weights made each)."""
        return [out for _, held in self.take_held_outputs() for out in held]

    def abort_all(self) -> list[EngineCoreOutput]:
        """Abort every request; returns a final output (finish_reason "abort") for each."""
        ids = self._request_ids()
        self.abort_requests(ids)
        return [EngineCoreOutput(request_id=rid, new_token_ids=[], finish_reason="abort") for rid in ids]

    # -- cache and weights -----------------------------------------------------------------
    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Drop cached prefixes after in-flight steps finish. With reset_running_requests, running
        requests are preempted first and resume by recompute; otherwise False while any is running."""
        self.drain()
        self._wait_for_kv_transfers()
        return self.scheduler.reset_prefix_cache(reset_running_requests)

    def _wait_for_kv_transfers(self) -> None:
        """Let a connector finish with the blocks it still writes (asynchronous loads) or reads
        (delayed frees): until then they stay held."""
        while self.scheduler.num_kv_transfers():
            sched_out = self.scheduler.poll_kv_loads()
            result = self.executor.execute_model(sched_out, non_block=self.max_steps_in_flight > 1)
            self.batch_queue.append((result, sched_out))
            self.drain()   # the one path that accounts for a step (and wraps its failures)

    def _check_quiet(self, what: str) -> None:
        # Waiting requests count too: a reset of the running ones, or pause("wait") after a
        # pause("keep"), leaves requests that have produced tokens waiting, none running,
        # unpaused; a change now would stall them unseen (sleep) or let them carry on under
        # other weights.
        if not self.paused and self.has_unfinished_requests():
            raise RuntimeError(f"{what} needs a paused or idle engine: "
                               "call pause_generation() first")

    @property
    def weight_version(self) -> Any:
        """The user's label for the weights served (counted up when an update gives none)."""
        return self.weights.label

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       weight_version: Any = None) -> int:
        """Copy (transformers name, tensor) pairs into the model in place; a subset is fine.
        Given a weight-transfer request instead ({"update_info": {...}} or an object with
        .update_info), receive that part of a round from the trainer; returns the count."""
        check_label(weight_version)
        update_info = update_info_of(named_tensors)
        if update_info is not None:
            self._check_transfer_quiet("update_weights")
            return self.weight_transfer.update(self.executor, update_info, weight_version)
        named_tensors = list(named_tensors)
        return self._change_weights("update_weights", named_tensors,
                                    lambda: self.weights.updated(named_tensors, weight_version))

    def load_weights(self, path: str, weight_version: Any = None) -> int:
        """Reload every weight from a folder, GGUF or Hub id of the same architecture.

        A Hub id is resolved here, once, to its snapshot folder: the folder is what a worker
        restart reloads and what the served weights' identity is stamped from.
        """
        check_label(weight_version)
        path = resolve_model(path, download_dir=self.config.model.download_dir)
        return self._change_weights("load_weights", path,
                                    lambda: self.weights.loaded(path, weight_version))

    def _change_weights(self, worker_method: str, source: Any,
                        served_after: Callable[[], ServedWeights]) -> int:
        self._check_quiet(worker_method)
        self.drain()
        self._wait_for_kv_transfers()   # no load may land KV of the old weights after it
        if self.config.parallel.world_size > 1:
            # Every rank checks its part before any rank changes a weight: a refused update
            # leaves the whole model as it was.
            self._rpc("check_weights", (
                source if isinstance(source, str) else [(n, tuple(t.shape)) for n, t in source],))
        try:
            count = self.executor.collective_rpc(worker_method, (source,))[0]
        except Exception as e:
            self._check_weights_whole(e)
            raise
        self._weights_changed(served_after())
        return count

    def _check_weights_whole(self, error: Exception) -> None:
        """After a weight change failed: where any rank may hold part of it (one began to
        copy it in, then failed re-packing or capturing graphs, as on a GPU out of memory; or,
        with several ranks, one failed after all had checked it and others applied it), the
        model is no one set of weights, under the old ones' identity and label. The workers
        are then replaced, reloading the weights served before, where a restart is allowed
        (a RuntimeError says so); else the engine is dead. So too where the group died in it.
        Otherwise nothing changed."""
        if isinstance(error, WorkerFailedError):   # the group died in it
            self._replace_lost_workers(error)
        if isinstance(error, EngineDeadError):
            return
        try:
            torn = (self.config.parallel.world_size > 1
                    or any(self.executor.collective_rpc("torn_weights")))
        except Exception:   # a worker that cannot answer may hold anything
            torn = True
        if not torn:
            return
        try:
            self.executor.fail(f"a weight change failed with the weights changed in part "
                               f"({error!r})")
        except WorkerFailedError as lost:
            self._replace_lost_workers(lost)

    def _rpc(self, method: str | Callable, args: tuple = (),
             kwargs: dict[str, Any] | None = None) -> list[Any]:
        """A control call to every worker; a group that dies in it is replaced (or the engine
        is dead), and the call fails unapplied (_replace_lost_workers)."""
        try:
            return self.executor.collective_rpc(method, args, kwargs)
        except WorkerFailedError as e:
            self._replace_lost_workers(e)

    def _replace_lost_workers(self, error: WorkerFailedError) -> NoReturn:
        """After a control call the group died in, or was given up in: it is replaced, as
        when a step finds it dead, with the weights served before the call, and the call fails
        with a RuntimeError (not applied, the engine serving on); where no restart is allowed,
        the engine is dead (EngineDeadError)."""
        self._lost_workers(error)
        raise RuntimeError(f"{error}: the call was not applied, and the workers were "
                           "restarted") from error

    def _weights_changed(self, served: ServedWeights) -> None:
        if self._pending:   # made by the weights served until now
            self._held_before.append((self.weights, self._pending))
            self._pending = []
        self.weights = served
        # No KV computed with the old weights may be read again, nor any computed on top of it
        # be stored under the new identity.
        self.scheduler.weights_changed(self.weights.identity)
        logger.info("weights updated; weight_version=%r (identity %s)", self.weights.label,
                    self.weights.identity[:12])

    # -- weights from a trainer process (engine/weight_transfer.py) -------------------------
    def init_weight_transfer_engine(self, request: Any) -> None:
        """Every worker starts joining the trainer's group ({"init_info": {...}} or init_info
        itself), on a thread of its own: steps go on. weight_transfer_joined() says when done."""
        self.weight_transfer.init(self.executor, request)

    def weight_transfer_joined(self) -> bool:
        """Whether every worker has joined; raises if one could not (the trainer never came)."""
        return self.weight_transfer.joined(self.executor)

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        self._check_transfer_quiet("start_weight_update")
        self.weight_transfer.start(self.executor, is_checkpoint_format)

    def finish_weight_update(self, weight_version: Any = None) -> int:
        """Apply everything received since start_weight_update, on every rank at once."""
        check_label(weight_version)
        self._check_transfer_quiet("finish_weight_update")
        self.drain()
        self._wait_for_kv_transfers()   # no load may land KV of the old weights after it
        count, digest, label = self.weight_transfer.finish(self.executor, weight_version,
                                                           self._check_weights_whole)
        self._weights_changed(self.weights.transferred(digest, label))
        return count

    def _check_transfer_quiet(self, what: str) -> None:
        self._check_quiet(what)
        if "weights" in self.asleep:
            raise RuntimeError(f"{what} needs the weights awake: call wake_up() first (after "
                               "sleep(level=2), reload them with load_weights)")

    def sleep(self, level: int = 1) -> None:
        """Level 1: drop the KV cache (and offload weights on GPU). Level 2: drop weights too."""
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        self._check_quiet("sleep")
        # Kept requests lose their KV: they recompute after wake_up.
        cleared = self.reset_prefix_cache(reset_running_requests=True)
        assert cleared, "no block may be held once running requests are reset"
        self._rpc("sleep", (level,))
        self.asleep = set(SLEEP_TAGS)

    def wake_up(self, tags: list[str] | None = None) -> None:
        tags = list(SLEEP_TAGS) if tags is None else list(tags)
        unknown = set(tags) - set(SLEEP_TAGS)
        if unknown:
            raise ValueError(f"tags must be among {', '.join(SLEEP_TAGS)}; got {sorted(unknown)}")
        self._rpc("wake_up", (tags,))
        self.asleep -= set(tags)

    def error_outputs(self, reason: str) -> list[EngineCoreOutput]:
        """Once the engine has failed: a final output (finish_reason "error", the reason as its
        stop_reason) for every request it had not finished."""
        return [EngineCoreOutput(request_id=rid, new_token_ids=[], finish_reason="error",
                                 stop_reason=reason) for rid in self._request_ids()]

    def _request_ids(self) -> list[str]:
        """Every request the engine holds: the scheduler's, and those whose grammar compiles."""
        return list(self.scheduler.requests) + self.grammars.request_ids()

    def failure(self) -> str | None:
        """Why the engine cannot serve, or None: a worker group that died and will not be
        replaced (`max_worker_restarts`). Changes nothing, so any thread may ask."""
        reason = self.executor.failure()
        if reason is None:
            return None
        refusal = restart_refusal(self)
        return reason + refusal if refusal is not None else None

    def get_stats(self) -> SchedulerStats:
        stats = self.scheduler.make_stats()
        # A request whose grammar compiles is waiting too, though not yet in the scheduler.
        return dataclasses.replace(stats, num_waiting_reqs=stats.num_waiting_reqs + len(self.grammars))

    def collective_rpc(self, method: str | Callable, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        return self._rpc(method, args, kwargs)

    def shutdown(self) -> None:
        self.grammars.shutdown()
        self.executor.shutdown()
