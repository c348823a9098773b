"""A worker process of the `mp` executor: one rank, its model shard and KV cache slice.

The wire, over ZeroMQ (a DEALER here, the engine's ROUTER there):
  engine -> worker: two frames, b"1" or b"0" (whether to reply), then the pickled (call_id,
                    method, args, kwargs): run a Worker method (or a callable taking the
                    worker). Ranks whose step output the engine does not read get b"0" and
                    report only failures. The call is pickled once for all ranks.
  worker -> engine: the pickled (call_id, rank, ok, result): the result, or a RemoteError.
Call 0 is start-up: every rank reports its KV block count, or why it could not start.
A lone worker with deferred steps (executor/mp.py) replies to a step once the next step is
queued behind it, or when told FINISH_STEP: replies still come in the order of the calls.

A worker exits when told to (at once, with code 0), and on its own when its parent is gone (a parent killed with
SIGKILL runs no clean-up), so no worker outlives the engine.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import shutil
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import zmq

from treadle.config import TreadleConfig
from treadle.gc_freeze import freeze_startup_heap

logger = logging.getLogger(__name__)

SHUTDOWN = "shutdown"
# Send the deferred step the worker holds, if any (no reply of its own).
FINISH_STEP = "finish_step"
PARENT_POLL_S = 0.5


@dataclass
class RemoteError:
    """An exception raised in a worker, as the engine re-raises it."""

    rank: int
    kind: str        # the exception's class name
    message: str
    traceback: str

    def to_exception(self) -> Exception:
        # Caller errors (bad weights, bad arguments, a path that is not there) keep a type the
        # server turns into a 400, as they would with the worker in the engine's process.
        cls = {"ValueError": ValueError, "TypeError": TypeError, "KeyError": ValueError,
               "FileNotFoundError": FileNotFoundError, "PermissionError": PermissionError,
               "IsADirectoryError": OSError, "NotADirectoryError": OSError,
               "OSError": OSError, "AttributeError": AttributeError}.get(self.kind, RuntimeError)
        return cls(f"worker rank {self.rank}: {self.kind}: {self.message}")


def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def worker_main(rank: int, config: TreadleConfig, address: str, store_port: int,
                parent_pid: int, num_threads: int) -> None:
    """Entry point of a spawned worker process."""
    # Ctrl-C reaches the whole process group: the engine shuts the workers down itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent(parent_pid, os.path.dirname(address.removeprefix("ipc://")))
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s")
    import torch

    torch.set_num_threads(num_threads)
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, str(rank).encode())
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(address)
    try:
        worker = _start(rank, config, store_port)
        sock.send(dumps((0, rank, True, worker.determine_num_blocks())))
    except BaseException as e:   # noqa: BLE001 - any failure to start is reported, then fatal
        sock.send(dumps((0, rank, False, _remote_error(rank, e))))
        sock.close()
        context.term()
        os._exit(1)
    freeze_startup_heap(f"worker process {rank}")
    _serve(rank, worker, sock)
    sock.close()
    context.term()
    # Skip the interpreter's teardown: collecting every object of torch, the model and the
    # tokenizer takes seconds, past the engine's SHUTDOWN_GRACE_S, and then the worker is killed.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _start(rank: int, config: TreadleConfig, store_port: int):
    import torch

    from treadle.distributed.parallel_state import init_parallel
    from treadle.worker.worker import Worker

    if config.device.startswith("cuda"):
        # A GPU per rank: "cuda" is then this one (config.py checked there are enough).
        torch.cuda.set_device(rank)
    ctx = init_parallel(config.parallel, rank, "127.0.0.1", store_port, config.device)
    worker = Worker(config, ctx)
    worker.load_model()
    return worker


def _serve(rank: int, worker, sock: zmq.Socket) -> None:
    from treadle.worker.deferred_step import DeferredStep

    # A deferred step (worker/deferred_step.py) whose reply waits: its tokens are still on the
    # device. The next step finishes it once queued behind it, and it is sent then; so is it
    # on FINISH_STEP, and before any call other than a step or a grammar's warm-up.
    held: tuple[int, DeferredStep] | None = None

    def send(call_id: int, ok: bool, result: Any) -> None:
        try:
            sock.send(dumps((call_id, rank, ok, result)))
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            sock.send(dumps((call_id, rank, False, _remote_error(rank, e))))

    def send_held() -> None:
        nonlocal held
        (call_id, step), held = held, None
        try:
            send(call_id, True, worker.runner.finish_deferred(step))
        except Exception as e:   # as a failed step: the engine ends the executor
            logger.exception("finishing step %d failed", call_id)
            send(call_id, False, _remote_error(rank, e))

    while True:
        flag, message = sock.recv_multipart()
        call_id, payload = pickle.loads(message)   # the id first: a reply can name its call
        reply = flag == b"1"
        try:
            method, args, kwargs = pickle.loads(payload)
        except Exception as e:   # a callable or argument this process cannot unpickle
            logger.exception("call %d could not be unpickled", call_id)
            if held is not None:
                send_held()
            send(call_id, False, _remote_error(rank, e))
            continue
        if held is not None and method not in ("execute_model", "warm_grammar"):
            send_held()
        if method == FINISH_STEP:
            continue
        if method == SHUTDOWN:
            sock.send(dumps((call_id, rank, True, None)))
            return
        try:
            fn = (getattr(worker, method) if isinstance(method, str)
                  else functools.partial(method, worker))
            result, ok = fn(*args, **kwargs), True
        except Exception as e:   # reported to the engine, which decides what it means
            logger.exception("call %s failed", getattr(method, "__name__", method))
            result, ok, reply = _remote_error(rank, e), False, True
        if held is not None and method == "execute_model":
            send_held()   # this step, queued behind it, finished it (or it finishes now)
        if ok and isinstance(result, DeferredStep):
            assert reply, "only a rank that replies defers its steps"
            held = (call_id, result)
        elif reply:
            send(call_id, ok, result)


def allow_deferred_steps(worker) -> bool:
    """Turn on the runner's deferred steps where it can (a collective_rpc callable)."""
    return worker.runner.allow_deferred_steps()


def _remote_error(rank: int, e: BaseException) -> RemoteError:
    return RemoteError(rank, type(e).__name__, str(e), traceback.format_exc())


def exit_with_parent(parent_pid: int, ipc_dir: str) -> None:
    """Exit as soon as the parent is gone (this process is then re-parented), removing the
    folder of its socket, which the parent had no chance to."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        shutil.rmtree(ipc_dir, ignore_errors=True)
        os._exit(1)

    threading.Thread(target=watch, name="treadle-parent-watch", daemon=True).start()
