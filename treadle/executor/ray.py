"""Executor over Ray actors, one per rank, across hosts (`distributed_executor_backend="ray"`).

The same semantics as the `mp` executor (executor/mp.py): every call goes to every rank, in the
order sent; a step's result comes from the last stage's first shard, and the other ranks' replies
are read only for failures; an error in a control call is the caller's. A rank that dies, fails
a step or cannot start ends the executor with an error naming the rank and its node.

Placement: a placement group with one bundle per rank (`TREADLE_RAY_PLACEMENT_STRATEGY`, PACK by
default; `TREADLE_RAY_BUNDLE_RESOURCES`, a JSON list of one dict per rank, adds resources to each
rank's bundle, e.g. to pin a stage to a node). Rank 0 hosts torch.distributed's store on its node,
at the address Ray reports for it. docs/distributed.md says how to run it across machines.

Deaths show without a call: each actor runs `watch`, which returns only when the actor dies.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Callable

from treadle.config import TreadleConfig
from treadle.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from treadle.distributed.parallel_state import output_rank
from treadle.executor.base import Executor
from treadle.executor.mp_worker import RemoteError
from treadle.structured_output.params import StructuredOutputsParams

try:
    import ray
    from ray.exceptions import RayError, RayTaskError
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError:
    raise ImportError("distributed_executor_backend 'ray' needs Ray, which is not installed: "
                      "pip install 'treadle[ray]'") from None

from treadle.executor.ray_worker import CONTROL_GROUP, RayWorker  # noqa: E402 - needs ray

logger = logging.getLogger(__name__)

STRATEGY_ENV = "TREADLE_RAY_PLACEMENT_STRATEGY"
BUNDLES_ENV = "TREADLE_RAY_BUNDLE_RESOURCES"
# Passed on to every worker, wherever it runs: the network interfaces of gloo and NCCL.
FORWARDED_ENV = ("GLOO_", "NCCL_")
# How long to wait for the cluster to have room for every bundle, and for the actors to come up
# (a new worker process, and its runtime environment, on a busy node).
PLACEMENT_TIMEOUT_S = 120.0
ACTOR_START_TIMEOUT_S = 300.0
# How long a failed step waits for another rank to show that it died (or to answer a ping),
# before the step itself is blamed: a rank whose peer was killed fails on the broken connection.
DEATH_GRACE_S = 3.0
POLL_S = 1.0   # a wait wakes this often, to see a shutdown from another thread


class PendingStep:
    """A step sent to the workers; result() waits for it."""

    def __init__(self, executor: "RayExecutor", refs: list["ray.ObjectRef"],
                 scheduler_output: SchedulerOutput) -> None:
        self._executor, self._refs, self._so = executor, refs, scheduler_output

    def result(self) -> ModelRunnerOutput:
        ex = self._executor
        if ex.kv_outputs is None:
            return ex._wait([(ex.output_rank, self._refs[0])])[0]
        return ex.kv_outputs.aggregate(self._so, ex._wait(list(enumerate(self._refs))),
                                       ex.output_rank)


class RayExecutor(Executor):
    def __init__(self, config: TreadleConfig) -> None:
        self.output_rank = output_rank(config.parallel)
        self.actors: list[Any] = []
        self.nodes: list[tuple[str, str]] = []   # each rank's node: (IP address, Ray node id)
        self._watches: dict[ray.ObjectRef, int] = {}
        # Steps of the ranks whose output is not read, checked only for failures.
        self._unchecked: dict[ray.ObjectRef, int] = {}
        self._placement = None
        self._own_cluster = False
        super().__init__(config)

    def _start_workers(self, config: TreadleConfig) -> list[int]:
        """Place an actor per rank; rank 0 hosts the store; each joins the group and loads."""
        parallel = config.parallel
        # One thread per worker unless OMP_NUM_THREADS says: torch's OpenMP threads spin-wait,
        # and a bundle reserves as many CPUs as its worker runs threads.
        threads = int(os.environ.get("OMP_NUM_THREADS") or 0) or 1
        self._own_cluster = _join_cluster(self.world_size * threads)
        bundles = _bundles(config, threads)
        strategy = os.environ.get(STRATEGY_ENV, "PACK")
        self._placement = _place(bundles, strategy)
        env = {"OMP_NUM_THREADS": str(threads),
               **{k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV)}}
        actor_class = ray.remote(concurrency_groups={CONTROL_GROUP: 2})(RayWorker)
        for rank, bundle in enumerate(bundles):
            self.actors.append(actor_class.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._placement, placement_group_bundle_index=rank),
                runtime_env={"env_vars": env}).remote(rank, threads))
        self._watches = {actor.watch.remote(): rank for rank, actor in enumerate(self.actors)}
        self.nodes = self._wait([(rank, actor.where.remote())
                                 for rank, actor in enumerate(self.actors)],
                                starting=True, timeout=ACTOR_START_TIMEOUT_S)
        port = self._wait([(0, self.actors[0].host_store.remote(parallel.master_port))],
                          starting=True)[0]
        host = self.nodes[0][0]
        config_ref = ray.put(config)
        num_blocks = self._wait([(rank, actor.start.remote(config_ref, host, port))
                                 for rank, actor in enumerate(self.actors)], starting=True)
        logger.info("ray executor: %d workers (pp=%d, tp=%d, %s), %d threads each, store at "
                    "%s:%d; nodes by rank: %s", self.world_size, parallel.pipeline_parallel_size,
                    parallel.tensor_parallel_size, strategy, threads, host, port,
                    ", ".join(ip for ip, _ in self.nodes))
        return num_blocks

    # -- calls -------------------------------------------------------------------------
    def _execute_model(self, scheduler_output: SchedulerOutput,
                       non_block: bool) -> ModelRunnerOutput | PendingStep:
        args = ray.put((scheduler_output,))   # serialized once for every rank
        read = [] if self.kv_outputs is None else list(range(self.world_size))
        refs = []
        for rank, actor in enumerate(self.actors):
            wanted = rank == self.output_rank or rank in read
            ref = actor.call.remote("execute_model", wanted, args, {})
            if wanted:
                refs.append(ref)
            else:
                self._unchecked[ref] = rank
        pending = PendingStep(self, refs, scheduler_output)
        return pending if non_block else pending.result()

    def _warm_grammar(self, params: StructuredOutputsParams) -> None:
        """Tell every worker a request's grammar as it arrives; nothing waits for it."""
        try:
            args = ray.put((params,))
            for actor in self.actors:
                actor.call.remote("warm_grammar", False, args, {})
        except RayError:   # a hint: the group's failure shows on the next real call
            logger.debug("warm_grammar not sent", exc_info=True)

    def _collective_rpc(self, method: str | Callable, args: tuple,
                        kwargs: dict[str, Any]) -> list[Any]:
        args_ref, kwargs_ref = ray.put(args), ray.put(kwargs)   # big tensors go once
        return self._wait([(rank, actor.call.remote(method, True, args_ref, kwargs_ref))
                           for rank, actor in enumerate(self.actors)], control=True)

    def _wait(self, calls: list[tuple[int, "ray.ObjectRef"]], control: bool = False,
              starting: bool = False, timeout: float | None = None) -> list[Any]:
        """The replies to `calls` ((rank, ref) pairs), in order. A death, a failed step and a
        failed start end the executor; an error in a control call is raised as the caller's
        once every rank has answered."""
        deadline = None if timeout is None else time.monotonic() + timeout
        waiting = {ref: rank for rank, ref in calls}
        replies: dict[ray.ObjectRef, tuple[bool, Any]] = {}
        while waiting:
            self._check_alive()
            if deadline is not None and time.monotonic() > deadline:
                self._fail(f"worker ranks {sorted(waiting.values())} did not start within "
                           f"{timeout:.0f} s")
            ready, _ = ray.wait([*waiting, *self._unchecked, *self._watches], num_returns=1,
                                timeout=POLL_S)
            for ref in ready:
                if ref in self._watches:
                    self._fail(self._death(self._watches[ref], ref))
                mine = ref in waiting
                rank = waiting.pop(ref) if mine else self._unchecked.pop(ref)
                ok, value = self._get(rank, ref)
                # An error is the caller's only among the control call's own replies: a
                # step's (an unchecked rank's, found while a control call waits) ends the group.
                if not ok and not (control and mine):
                    self._blame(rank, value, "failed to start" if starting else "failed a step")
                if mine:
                    replies[ref] = (ok, value)
        results = [replies[ref] for _, ref in calls]
        for ok, value in results:
            if not ok:   # a caller's error in a control call: the workers are fine
                raise value.to_exception()
        return [value for _, value in results]

    def _get(self, rank: int, ref: "ray.ObjectRef") -> tuple[bool, Any]:
        try:
            return ray.get(ref)
        except RayTaskError as e:   # the call could not run there (an argument it cannot unpickle)
            cause = e.cause if isinstance(e.cause, BaseException) else e
            return False, RemoteError(rank, type(cause).__name__, str(cause), str(e))
        except RayError as e:   # the actor, its node, or the object holding the result is gone
            self._fail(self._death_reason(rank, e))

    def _blame(self, rank: int, error: RemoteError, what: str) -> None:
        """A rank failed: if a peer died (its death breaks the others' connections), the death
        is the cause; else the rank's own failure."""
        self._fail(self._peer_death(rank)
                   or f"{self._who(rank)} {what}: {error.kind}: {error.message}",
                   error.traceback)

    def _peer_death(self, rank: int) -> str | None:
        """Why another rank is gone, waiting up to DEATH_GRACE_S for Ray to say so or for every
        peer to answer a ping; None when all answer."""
        pings = {actor.ping.remote(): r for r, actor in enumerate(self.actors) if r != rank}
        watches = {ref: r for ref, r in self._watches.items() if r != rank}
        deadline = time.monotonic() + DEATH_GRACE_S
        while pings:
            ready, _ = ray.wait([*pings, *watches], num_returns=1,
                                timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                return (f"{self._who(next(iter(pings.values())))} stopped answering: its "
                        "process or its node is gone")
            if ready[0] in watches:
                return self._death(watches[ready[0]], ready[0])
            peer = pings.pop(ready[0])
            try:
                ray.get(ready[0])
            except RayError as e:
                return self._death_reason(peer, e)
        return None

    def _find_failure(self) -> str | None:
        """A rank that died, as Ray has told its `watch` call; asks nothing of the workers."""
        if not self._watches:
            return None
        ready, _ = ray.wait(list(self._watches), num_returns=1, timeout=0)
        return self._death(self._watches[ready[0]], ready[0]) if ready else None

    def _death(self, rank: int, watch: "ray.ObjectRef") -> str:
        """The reason in a finished `watch` call (which ends only with its actor's death)."""
        try:
            ray.get(watch, timeout=0)
        except RayError as e:
            return self._death_reason(rank, e)
        return f"{self._who(rank)} stopped"

    def _death_reason(self, rank: int, error: RayError) -> str:
        return f"{self._who(rank)} died: {_ray_cause(error)}"

    def _who(self, rank: int) -> str:
        if rank < len(self.nodes):
            ip, node_id = self.nodes[rank]
            return f"worker rank {rank} on node {ip} (node id {node_id})"
        return f"worker rank {rank}"

    # -- shutdown ----------------------------------------------------------------------
    def _close(self, graceful: bool) -> None:
        """Kill the actors either way (they hold nothing to save), free their placement, and
        stop the Ray instance this executor started, if it did."""
        self._watches, self._unchecked = {}, {}
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except RayError:   # its node is gone, and it with it
                pass
        if self._placement is not None:
            remove_placement_group(self._placement)
        if self._own_cluster:
            ray.shutdown()


def _join_cluster(num_cpus: int) -> bool:
    """Join the Ray cluster that ray.init was given, RAY_ADDRESS names, or `ray start` began on
    this host; else start one here, with a CPU for each worker thread. Whether one was started."""
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init()
        return False
    try:
        ray.init(address="auto")
        return False
    except ConnectionError:
        logger.info("no Ray cluster to join: starting one on this host")
        ray.init(num_cpus=max(os.cpu_count() or 1, num_cpus), include_dashboard=False)
        return True


def _bundles(config: TreadleConfig, threads: int) -> list[dict[str, float]]:
    """Each rank's bundle: its CPUs (a GPU on CUDA), and what TREADLE_RAY_BUNDLE_RESOURCES adds."""
    world_size = config.parallel.world_size
    base = {"CPU": float(threads), **({"GPU": 1.0} if config.device.startswith("cuda") else {})}
    extra: list[dict[str, float]] = [{}] * world_size
    if os.environ.get(BUNDLES_ENV):
        extra = json.loads(os.environ[BUNDLES_ENV])
        if (not isinstance(extra, list) or len(extra) != world_size
                or not all(isinstance(e, dict) for e in extra)):
            raise ValueError(f"{BUNDLES_ENV} must be a JSON list of {world_size} objects (one per "
                             f"rank), got {os.environ[BUNDLES_ENV]!r}")
    return [{**base, **more} for more in extra]


def _place(bundles: list[dict[str, float]], strategy: str):
    """A placement group holding every bundle, once the cluster has room for it."""
    group = placement_group(bundles, strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(f"Ray could not place {len(bundles)} workers ({strategy}, bundles "
                           f"{bundles}) within {PLACEMENT_TIMEOUT_S:.0f} s; the cluster has "
                           f"{ray.available_resources()} free")
    return group


def _ray_cause(error: RayError) -> str:
    """The sentence of Ray's error that says why (its messages run to many lines)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    because = next((line for line in lines if "because" in line), lines[0] if lines else "")
    return because.split(". ")[0].rstrip(".") or type(error).__name__
