"""Executor over worker processes on this host, one per rank (`distributed_executor_backend="mp"`).

Every call goes to every worker, which run them in the order sent (executor/mp_worker.py has the
wire). A step's result comes back from one rank, the last stage's first shard; the other ranks
report only failures, so no rank waits on the engine and the stages stay busy. A worker that
dies or fails ends the executor: the error names the rank, and every later call fails at once.

The ranks meet through torch.distributed's store, hosted here, so a port already in use is an
error in this process before anything is spawned.

With one worker on a GPU and async scheduling, the worker defers steps (worker/deferred_step.py)
as the in-process executor's thread does, and more: the engine's scheduling and output
processing run in this process, beside the worker's input preparation and sampling, with no
GIL between them. A deferred step's reply comes when the next step is queued behind it; the
engine, waiting for a step with none sent after it, sends FINISH_STEP instead.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import time
import weakref
from typing import Any, Callable

import torch.distributed as dist
import zmq

from treadle.config import TreadleConfig
from treadle.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from treadle.distributed.parallel_state import INIT_TIMEOUT, output_rank
from treadle.executor.base import Executor
from treadle.executor.ipc import socket_folder
from treadle.executor.mp_worker import FINISH_STEP, SHUTDOWN, allow_deferred_steps, dumps, worker_main
from treadle.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0
# How long a failed step waits for another rank's death to show, before blaming the step.
DEATH_GRACE_S = 1.0


class PendingStep:
    """A step sent to the workers; result() waits for it."""

    def __init__(self, executor: "MultiprocExecutor", call_id: int,
                 scheduler_output: SchedulerOutput) -> None:
        self._executor, self._call_id, self._so = executor, call_id, scheduler_output

    def result(self) -> ModelRunnerOutput:
        ex = self._executor
        if ex.defers_steps and ex._last_step == self._call_id:
            ex._finish_last_step()
        if ex.kv_outputs is None:
            return ex._wait(self._call_id, [ex.output_rank])[0]
        return ex.kv_outputs.aggregate(self._so, ex._wait(self._call_id, range(ex.world_size)),
                                       ex.output_rank)


class MultiprocExecutor(Executor):
    def __init__(self, config: TreadleConfig) -> None:
        self.output_rank = output_rank(config.parallel)
        self._next_call = 1
        self._replies: dict[tuple[int, int], tuple[bool, Any]] = {}
        # Control calls waiting for replies: an error in one is the caller's (bad weights), while
        # an error in a step, or in start-up, ends the executor.
        self._control_calls: set[int] = set()
        self._zmq = zmq.Context()
        self._sock = self._zmq.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._ipc_dir = socket_folder("treadle-rpc-")
        self._sock.bind(f"ipc://{self._ipc_dir}/engine")
        self.procs: list[multiprocessing.Process] = []
        # An executor never shut down (its engine dropped, or the interpreter exiting) still
        # kills its workers and removes its socket's folder.
        self._finalizer = weakref.finalize(self, _clean_up, self.procs, self._ipc_dir)
        self._store: dist.TCPStore | None = None
        self.defers_steps = False   # the lone worker's runner defers steps (module docstring)
        self._last_step = 0         # the call id of the last step sent
        self._finish_sent = 0       # ... and of the last one FINISH_STEP was sent for
        super().__init__(config)

    def _start_workers(self, config: TreadleConfig) -> list[int]:
        """Spawn a process per rank; each reports its block count (call 0) once it has loaded."""
        parallel = config.parallel
        self._store = _host_store(parallel.master_port, self.world_size)
        # Each worker gets an equal share of the cores, unless OMP_NUM_THREADS says.
        threads = int(os.environ.get("OMP_NUM_THREADS") or 0) or max(
            1, (os.cpu_count() or 1) // self.world_size)
        spawn = multiprocessing.get_context("spawn")
        for rank in range(self.world_size):
            proc = spawn.Process(
                target=worker_main, name=f"treadle-worker-{rank}", daemon=True,
                args=(rank, config, f"ipc://{self._ipc_dir}/engine", self._store.port,
                      os.getpid(), threads))
            proc.start()
            self.procs.append(proc)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        for proc in self.procs:   # a process's sentinel becomes readable when it ends
            self._poller.register(proc.sentinel, zmq.POLLIN)
        num_blocks = self._wait(0, range(self.world_size), starting=True)
        logger.info("mp executor: %d workers (pp=%d, tp=%d), %d threads each", self.world_size,
                    parallel.pipeline_parallel_size, parallel.tensor_parallel_size, threads)
        if self.world_size == 1 and config.scheduler.async_scheduling and config.device.startswith("cuda"):
            self.defers_steps = self._collective_rpc(allow_deferred_steps, (), {})[0]
        return num_blocks

    # -- calls -------------------------------------------------------------------------
    def _execute_model(self, scheduler_output: SchedulerOutput,
                       non_block: bool) -> ModelRunnerOutput | PendingStep:
        reply_from = set(range(self.world_size)) if self.kv_outputs else {self.output_rank}
        call_id = self._last_step = self._send("execute_model", (scheduler_output,), {},
                                               reply_from=reply_from)
        pending = PendingStep(self, call_id, scheduler_output)
        return pending if non_block else pending.result()

    def _finish_last_step(self) -> None:
        """Have the worker send the last step sent, if it holds it deferred: no later step will
        finish it."""
        self._check_alive()   # a group that failed meanwhile has no socket to send on
        if self._finish_sent != self._last_step:
            self._finish_sent = self._last_step
            self._send(FINISH_STEP, (), {}, reply_from=set())

    def _warm_grammar(self, params: StructuredOutputsParams) -> None:
        """Tell every worker a request's grammar as the request arrives, so that the ranks that
        sample compile it before its first step. No reply is awaited."""
        self._send("warm_grammar", (params,), {}, reply_from=set())

    def _collective_rpc(self, method: str | Callable, args: tuple,
                        kwargs: dict[str, Any]) -> list[Any]:
        call_id = self._send(method, args, kwargs, reply_from=set(range(self.world_size)))
        self._control_calls.add(call_id)
        try:
            return self._wait(call_id, range(self.world_size))
        finally:
            self._control_calls.discard(call_id)

    def _send(self, method: str | Callable, args: tuple, kwargs: dict,
              reply_from: set[int]) -> int:
        call_id, self._next_call = self._next_call, self._next_call + 1
        message = dumps((call_id, dumps((method, args, kwargs))))
        for rank in range(self.world_size):
            flag = b"1" if rank in reply_from else b"0"
            self._sock.send_multipart([str(rank).encode(), flag, message], copy=False)
        return call_id

    def _wait(self, call_id: int, ranks, starting: bool = False) -> list[Any]:
        """The replies of `ranks` to a call. Any failure, from any rank, ends the executor."""
        ranks = list(ranks)
        while True:
            self._check_alive()
            if all((call_id, r) in self._replies for r in ranks):
                break
            self._poller.poll()
            while self._sock.poll(0):   # replies first: a worker reports why before it exits
                self._take_reply(starting)
            self._check_processes()
        replies = [self._replies.pop((call_id, rank)) for rank in ranks]
        for ok, value in replies:
            if not ok:   # a caller's error in a control call: the workers are fine
                raise value.to_exception()
        return [value for _, value in replies]

    def _take_reply(self, starting: bool) -> None:
        _, message = self._sock.recv_multipart()
        call_id, rank, ok, value = pickle.loads(message)
        if not ok and call_id not in self._control_calls:
            # A rank whose peer was killed fails on the broken connection: report the death,
            # the cause. (A peer that exits with a code of its own has reported why first.)
            for peer, proc in self._reap_peers_of(rank):
                if proc.exitcode is not None and proc.exitcode < 0:
                    self._fail(f"worker rank {peer} died (exit code {proc.exitcode})")
            what = "failed to start" if starting else "failed a step"
            self._fail(f"worker rank {rank} {what}: {value.kind}: {value.message}",
                       value.traceback)
        self._replies[(call_id, rank)] = (ok, value)

    def _reap_peers_of(self, rank: int) -> list[tuple[int, multiprocessing.Process]]:
        """The other ranks' processes, after waiting up to DEATH_GRACE_S for one of them to
        die and reaping the dead: a killed process's sentinel shows a moment before its exit
        code can be read."""
        peers = [(r, proc) for r, proc in enumerate(self.procs) if r != rank]
        if peers:
            dead = multiprocessing.connection.wait([proc.sentinel for _, proc in peers], DEATH_GRACE_S)
            for _, proc in peers:
                if proc.sentinel in dead:
                    proc.join(DEATH_GRACE_S)
        return peers

    def _check_processes(self) -> None:
        reason = self._find_failure()
        if reason is not None:
            self._fail(reason)

    def _find_failure(self) -> str | None:
        for rank, proc in enumerate(self.procs):
            if proc.exitcode is not None:
                return f"worker rank {rank} died (exit code {proc.exitcode})"
        return None

    # -- shutdown ----------------------------------------------------------------------
    def _close(self, graceful: bool) -> None:
        """Ask the workers to exit (while all are healthy), kill any that do not, and free the
        sockets."""
        if graceful and self.procs:
            try:
                for rank in range(self.world_size):
                    self._sock.send_multipart(
                        [str(rank).encode(), b"1", dumps((-1, dumps((SHUTDOWN, (), {}))))], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            deadline = time.monotonic() + SHUTDOWN_GRACE_S   # one grace period for them all
            for proc in self.procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        self._finalizer()   # kills any worker left, and removes the socket's folder
        self._store = None   # frees its port, for a worker group that replaces this one
        self._sock.close(0)
        self._zmq.term()


def _clean_up(procs: list[multiprocessing.Process], ipc_dir: str) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    deadline = time.monotonic() + SHUTDOWN_GRACE_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    shutil.rmtree(ipc_dir, ignore_errors=True)


def _host_store(port: int | None, world_size: int) -> dist.TCPStore:
    try:
        return dist.TCPStore("127.0.0.1", port or 0, world_size, is_master=True,
                             wait_for_workers=False, timeout=INIT_TIMEOUT)
    except (RuntimeError, OSError) as e:
        raise RuntimeError(f"cannot host torch.distributed's store on 127.0.0.1:{port}: {e}"
                           " (is the port in use? pick another master_port)") from None
