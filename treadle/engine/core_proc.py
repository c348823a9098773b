"""The engine core in a process of its own: `AsyncLLM(engine_process=True)`, `treadle serve
--engine-process` (the frontend's end is engine/core_client.py).

Why: with the core on a thread of the server's process, the event loop (HTTP, detokenizing, the
SSE chunks) and the step loop share one GIL, and on a GPU, where a step is short, that bounds
what a server streams (docs/performance.md, "On a GPU"). vLLM runs its EngineCoreProc so.

Here the core steps on an EngineCoreThread, exactly as in the frontend's process, and this
process's main thread only passes calls to it and their results back.

The wire, over ZeroMQ (ipc sockets in a folder of the frontend's), each message pickled:
  frontend -> core (PUSH -> PULL), two frames: the call id (decimal text), then
      (fn, args, kwargs): run fn(core, *args, **kwargs) between two steps; fn is an
                          EngineCore method or a function of engine/core_calls.py
      (WHEN_IDLE, (), {}): reply once the core has no request and no step in flight
  or one frame, STOP. A call that will not unpickle here (a class only the frontend's
  __main__ has) is answered with the error; the id comes apart from it for that.
  core -> frontend (PUSH -> PULL), in the order things happened here:
      ("outputs", outputs, weights)      a step's outputs and the weights that made them
      ("result", call_id, ok, value)     a call's result, or the exception it raised
      ("failure", reason)                EngineCore.failure() changed (a worker group died)
      ("dead", exc)                      the core failed; every later call fails
  Start-up ends with ("ready", None), or with ("result", 0, False, exc) when it failed.
Outputs a call produced go out before its result, as on the thread.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import signal
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import zmq

from treadle.config import TreadleConfig

logger = logging.getLogger(__name__)

WHEN_IDLE = "when_idle"
STOP = b"stop"
FAILURE_POLL_S = 0.2   # how often EngineCore.failure() is read for the frontend's health checks


def dumps(message: tuple) -> bytes:
    """A message, pickled. A result or an exception that cannot cross (a lambda, an exception
    whose class will not unpickle) goes as a RuntimeError that says what it was."""
    try:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if message[0] == "dead" or (message[0] == "result" and not message[2]):
            pickle.loads(data)   # errors are rare: check that the frontend can read this one
        return data
    except Exception as e:
        if message[0] == "result":
            what = (f"{type(message[3]).__name__}: {message[3]}" if not message[2]
                    else f"the result of the call could not be sent back ({e})")
            return dumps(("result", message[1], False, RuntimeError(what)))
        if message[0] == "dead":
            return dumps(("dead", RuntimeError(f"{type(message[1]).__name__}: {message[1]}")))
        raise


def engine_core_main(config: TreadleConfig, in_address: str, out_address: str,
                     parent_pid: int) -> None:
    """Entry point of the spawned engine core process."""
    # Ctrl-C, and a SIGTERM sent to the whole process group (timeout, systemd), reach this
    # process too: the frontend stops it, after letting open requests finish as the server's
    # --shutdown-timeout says. It exits on its own if the frontend is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from treadle.executor.mp_worker import exit_with_parent
    exit_with_parent(parent_pid, os.path.dirname(in_address.removeprefix("ipc://")))
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s engine core %(name)s: %(message)s")
    context = zmq.Context()
    calls = context.socket(zmq.PULL)
    calls.connect(in_address)
    replies = context.socket(zmq.PUSH)
    replies.setsockopt(zmq.LINGER, 5000)   # the last replies (a start-up error) still go out
    replies.connect(out_address)
    send_lock = threading.Lock()   # the core thread and this one both send

    def send(message: tuple) -> None:
        data = dumps(message)
        with send_lock:
            replies.send(data)

    try:
        core = _start(config, send)
    except BaseException as exc:
        logger.exception("the engine core could not start")
        send(("result", 0, False, exc))
        replies.close()
        context.term()
        return
    send(("ready", None))
    try:
        _serve(core, calls, send)
    finally:
        core.stop()
        replies.close()
        calls.close(linger=0)
        context.term()


def _start(config: TreadleConfig, send: Callable[[tuple], None]):
    from treadle.engine.core import EngineCore
    from treadle.engine.core_thread import EngineCoreThread
    from treadle.gc_freeze import freeze_startup_heap
    from treadle.worker.malloc import keep_freed_memory

    if config.device.startswith("cpu"):
        keep_freed_memory()   # before the core thread's first allocation picks its arena
    core = EngineCoreThread(lambda: EngineCore(config),
                            lambda outputs, weights: send(("outputs", outputs, weights)),
                            lambda exc: send(("dead", exc)))
    freeze_startup_heap("the engine core process")
    return core


def _serve(core: Any, calls: zmq.Socket, send: Callable[[tuple], None]) -> None:
    """Pass calls to the core thread until told to stop, and report worker failures."""
    reported: str | None = None
    next_check = 0.0
    while True:
        if calls.poll(int(FAILURE_POLL_S * 1000)):
            frames = calls.recv_multipart()
            if frames == [STOP]:
                return
            call_id = int(frames[0])
            try:
                fn, args, kwargs = pickle.loads(frames[1])
            except Exception as e:
                send(("result", call_id, False,
                      TypeError(f"the engine core process cannot read this call: {e}")))
                continue
            if fn == WHEN_IDLE:   # no outputs can follow: the order of its reply is free
                core.when_idle().add_done_callback(functools.partial(_reply, send, call_id))
            else:
                future: Future = Future()
                future.add_done_callback(functools.partial(_reply, send, call_id))
                core.call_into(future, fn, args, kwargs)
        now = time.monotonic()
        if now >= next_check and core.failure() is None:
            next_check = now + FAILURE_POLL_S
            reason = core.worker_failure()
            if reason != reported:
                reported = reason
                send(("failure", reason))


def _reply(send: Callable[[tuple], None], call_id: int, future: Future) -> None:
    exc = future.exception()
    send(("result", call_id, exc is None, future.result() if exc is None else exc))
