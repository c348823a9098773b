"""The frontend's handle on an engine core in a process of its own (engine/core_proc.py has
that process and the wire), with EngineCoreThread's interface: AsyncLLM uses either.

A receiving thread here hands each step's outputs to the callback and completes each call's
future, in the order the process sent them. If the process dies (killed, out of memory), the
receiving thread sees its sentinel: the error callback runs, and every call waiting and every
later call fails with EngineDeadError.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import pickle
import shutil
import threading
import weakref
from concurrent.futures import Future
from typing import Any, Callable

import zmq

from treadle.config import TreadleConfig
from treadle.engine.core_proc import STOP, WHEN_IDLE, engine_core_main
from treadle.engine.core_thread import ErrorCallback, OutputCallback
from treadle.engine.errors import EngineDeadError
from treadle.executor.ipc import socket_folder

logger = logging.getLogger(__name__)

STOP_GRACE_S = 30.0   # for the core to shut its workers down before it is killed


class EngineCoreProcess:
    def __init__(self, config: TreadleConfig, on_outputs: OutputCallback,
                 on_error: ErrorCallback) -> None:
        """Spawns the process and waits until its core is built; raises what building it raised."""
        self._on_outputs, self._on_error = on_outputs, on_error
        self._lock = threading.Lock()   # the waiting calls and the state below
        self._send_lock = threading.Lock()   # the call socket
        self._waiting: dict[int, Future] = {}
        self._call_ids = itertools.count(1)
        self._failure: BaseException | None = None   # what killed the core, if anything did
        self._worker_failure: str | None = None
        self._stopping = False
        self._ipc_dir = socket_folder("treadle-core-")
        self._zmq = zmq.Context()
        self._calls = self._zmq.socket(zmq.PUSH)
        self._calls.setsockopt(zmq.LINGER, 0)
        self._calls.bind(f"ipc://{self._ipc_dir}/calls")
        self._replies = self._zmq.socket(zmq.PULL)
        self._replies.setsockopt(zmq.LINGER, 0)
        self._replies.bind(f"ipc://{self._ipc_dir}/replies")
        # Not a daemon: a daemonic process may not start the mp executor's worker processes.
        # It exits by itself once this process is gone (core_proc.py), and is killed here when
        # this object is dropped unstopped.
        self._proc = multiprocessing.get_context("spawn").Process(
            target=engine_core_main, name="treadle-engine-core",
            args=(config, f"ipc://{self._ipc_dir}/calls", f"ipc://{self._ipc_dir}/replies",
                  os.getpid()))
        self._proc.start()
        self._finalizer = weakref.finalize(self, _clean_up, self._proc, self._ipc_dir)
        self._poller = zmq.Poller()
        self._poller.register(self._replies, zmq.POLLIN)
        self._poller.register(self._proc.sentinel, zmq.POLLIN)
        try:
            self._wait_until_built()
        except BaseException:
            self._finalizer()
            self._zmq.destroy(linger=0)
            raise
        self._receiver = threading.Thread(target=self._receive, name="treadle-core-replies",
                                          daemon=True)
        self._receiver.start()

    def _wait_until_built(self) -> None:
        while True:
            ready = dict(self._poller.poll())
            if self._replies in ready:
                message = pickle.loads(self._replies.recv())
                if message[0] == "ready":
                    return
                raise message[3]   # ("result", 0, False, the start-up error)
            if self._proc.sentinel in ready:
                self._proc.join()
                raise RuntimeError("the engine core process exited while starting, with code "
                                   f"{self._proc.exitcode}: its log above says why")

    # -- EngineCoreThread's interface ------------------------------------------------------
    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """fn(core, *args, **kwargs) in the core process, between two steps. fn must pickle by
        name: an EngineCore method or a module-level function."""
        return self._send(fn, args, kwargs)

    def when_idle(self) -> Future:
        """A future that completes once the core has no request and no step in flight."""
        return self._send(WHEN_IDLE, (), {})

    def failure(self) -> BaseException | None:
        """What killed the core or its process, or None."""
        with self._lock:
            return self._failure

    def worker_failure(self) -> str | None:
        """EngineCore.failure(), as the core process last reported it (every 0.2 s)."""
        return self._worker_failure

    def stop(self) -> None:
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self._push([STOP])   # a failed core's process, too, waits to be told
        self._proc.join(STOP_GRACE_S)
        self._receiver.join(STOP_GRACE_S)
        self._finalizer()   # kills it if it is still there, and removes the sockets' folder
        self._fail_waiting(RuntimeError("the engine core has stopped"))
        self._zmq.destroy(linger=0)

    # -- internals -------------------------------------------------------------------------
    def _send(self, fn: Any, args: tuple, kwargs: dict) -> Future:
        future: Future = Future()
        with self._lock:
            if self._failure is not None:
                future.set_exception(EngineDeadError(f"the engine core failed: {self._failure}"))
                return future
            if self._stopping:
                future.set_exception(RuntimeError("the engine core has stopped"))
                return future
            call_id = next(self._call_ids)
            try:
                data = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:   # a lambda, or an argument that cannot cross processes
                future.set_exception(TypeError(
                    f"{getattr(fn, '__qualname__', fn)} cannot be sent to the engine core "
                    f"process: {e}"))
                return future
            self._waiting[call_id] = future
        self._push([str(call_id).encode(), data])
        return future

    def _push(self, frames: list[bytes]) -> None:
        """Send, unless the process is gone: a PUSH with no peer would wait for good, and the
        receiving thread then fails the call with every other one waiting."""
        with self._send_lock:
            while True:
                try:
                    self._calls.send_multipart(frames, flags=zmq.NOBLOCK)
                    return
                except zmq.Again:
                    if not self._proc.is_alive():
                        return
                    self._calls.poll(100, zmq.POLLOUT)

    def _receive(self) -> None:
        try:
            while True:
                ready = dict(self._poller.poll())
                if self._replies in ready:
                    # Everything it sent is read before its exit counts.
                    while self._replies.poll(0):
                        self._handle(pickle.loads(self._replies.recv()))
                    continue
                if self._proc.sentinel in ready:
                    break
        except Exception as exc:   # a message that will not unpickle: nothing can be trusted
            logger.exception("the engine core process's replies")
            self._die(exc)
        self._proc.join()
        with self._lock:
            stopping = self._stopping
        if not stopping and self._failure is None:
            self._die(RuntimeError(f"the engine core process exited with code {self._proc.exitcode}"))

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "outputs":
            self._on_outputs(message[1], message[2])
        elif kind == "result":
            with self._lock:
                future = self._waiting.pop(message[1], None)
            if future is not None and future.set_running_or_notify_cancel():
                if message[2]:
                    future.set_result(message[3])
                else:
                    future.set_exception(message[3])
        elif kind == "failure":
            self._worker_failure = message[1]
        elif kind == "dead":
            self._die(message[1])
        else:
            raise ValueError(f"unknown message from the engine core process: {kind!r}")

    def _die(self, exc: BaseException) -> None:
        with self._lock:
            if self._failure is not None:
                return
            self._failure = exc
        self._on_error(exc)
        self._fail_waiting(EngineDeadError(f"the engine core failed: {exc}"))

    def _fail_waiting(self, error: Exception) -> None:
        with self._lock:
            waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(error)


def _clean_up(proc: multiprocessing.Process, ipc_dir: str) -> None:
    if proc.is_alive():
        proc.kill()
        proc.join(5.0)
    shutil.rmtree(ipc_dir, ignore_errors=True)
