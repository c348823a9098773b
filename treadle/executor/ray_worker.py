"""A worker of the `ray` executor: one rank, its model shard and KV cache slice, in a Ray actor.

Calls run one at a time in the order the engine sent them (Ray keeps an actor's calls from one
caller in order). Each returns (ok, result), or (False, RemoteError): the engine decides what a
failure means, as with the `mp` executor. `watch` and `ping` run on a thread of their own, so
they answer while a step runs: `watch` returns only when the actor dies (with Ray's error), so
the engine sees a death without asking; `ping` tells a live actor from a gone one.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Any, Callable

import ray
import torch.distributed as dist

from treadle.config import TreadleConfig
from treadle.distributed.parallel_state import INIT_TIMEOUT
from treadle.executor.mp_worker import RemoteError, _remote_error

logger = logging.getLogger(__name__)

CONTROL_GROUP = "control"


class RayWorker:
    def __init__(self, rank: int, num_threads: int) -> None:
        logging.basicConfig(level=logging.INFO,
                            format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s")
        import torch

        torch.set_num_threads(num_threads)
        self.rank = rank
        self.worker = None
        self._store: dist.TCPStore | None = None
        self._never = threading.Event()

    def where(self) -> tuple[bool, tuple[str, str]]:
        """This actor's node: its IP address and Ray node id."""
        return True, (ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id())

    def host_store(self, port: int | None) -> tuple[bool, Any]:
        """Host torch.distributed's store on this node (rank 0's), on `port` or a free one;
        the port it listens on."""
        ip = ray.util.get_node_ip_address()
        try:   # the server listens on every interface; `ip` is where this rank reaches it
            self._store = dist.TCPStore(ip, port or 0, is_master=True,
                                        wait_for_workers=False, timeout=INIT_TIMEOUT)
        except (RuntimeError, OSError) as e:
            return False, RemoteError(self.rank, "RuntimeError",
                                      f"cannot host torch.distributed's store on {ip}:{port}: "
                                      f"{e} (is the port in use? pick another master_port)", "")
        return True, self._store.port

    def start(self, config: TreadleConfig, host: str, port: int) -> tuple[bool, Any]:
        """Join the process group at host:port and load this rank's shard; its KV block count."""
        from treadle.distributed.parallel_state import init_parallel
        from treadle.gc_freeze import freeze_startup_heap
        from treadle.worker.worker import Worker

        try:
            ctx = init_parallel(config.parallel, self.rank, host, port, config.device)
            self.worker = Worker(config, ctx)
            self.worker.load_model()
            num_blocks = self.worker.determine_num_blocks()
            freeze_startup_heap(f"Ray worker {self.rank}")
            return True, num_blocks
        except Exception as e:   # noqa: BLE001 - reported to the engine: a failed start is fatal
            logger.exception("start-up failed")
            return False, _remote_error(self.rank, e)

    def call(self, method: str | Callable, reply: bool, args: tuple,
             kwargs: dict[str, Any]) -> tuple[bool, Any]:
        """Run a Worker method (or a callable taking the worker); its result only if `reply`."""
        fn = (getattr(self.worker, method) if isinstance(method, str)
              else functools.partial(method, self.worker))
        try:
            result = fn(*args, **kwargs)
        except Exception as e:   # reported to the engine, which decides what it means
            logger.exception("call %s failed", getattr(method, "__name__", method))
            return False, _remote_error(self.rank, e)
        return True, result if reply else None

    @ray.method(concurrency_group=CONTROL_GROUP)
    def watch(self) -> None:
        """Never returns: its result is the actor's death."""
        self._never.wait()

    @ray.method(concurrency_group=CONTROL_GROUP)
    def ping(self) -> int:
        return os.getpid()
