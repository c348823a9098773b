"""KV loads through the real SharedStorageConnector, both sides, under the ledger test's driver.

The scheduler side is the real connector, as EngineCore builds it. The worker side is the real
connector too, over a tiny real KV cache: one layer, one head of size 1, int64, so each slot
holds the KV oracle's key for the token prefix ending there (see KVOracle in
tests/test_token_ledger.py; keys carry the weight generation). The worker side really writes
block files into a temporary folder and really reads them back into the cache; the oracle
checks every slot a step reads and every published block against what it must hold. So a
block saved under the wrong name (other weights, another request's tokens) or loaded into the
wrong request, or a tracking entry the connector loses, shows.

What is not real: the load thread (DeferredIO: an asynchronous load runs a given number of
returned steps after it starts, so a run is deterministic) and fault injection (the worker
side's injector draws from the test's seed). The worker side is called as ModelRunner does:
bind the metadata, get_finished, start_load_kv, the forward pass (the oracle's writes and
reads), wait_for_save, clear; the load errors are taken both before the forward pass (to know
which request reads a block that did not arrive) and after it, and reported together.
"""

from __future__ import annotations

import dataclasses
import random
import tempfile
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests.test_kv_load_recovery import add_stored, connected
from tests.test_scheduler import BS, make_request, make_scheduler
from tests.test_token_ledger import (POISON, AsyncRunner, RequestIds, prefix_keys,
                                     random_drafts, run_random_events)
from treadle.config import KVTransferConfig
from treadle.kv_transfer import KVConnectorOutput, KVConnectorRole
from treadle.kv_transfer.multi import MultiConnector, MultiConnectorMetadata
from treadle.kv_transfer.offloading import OffloadingConnector
from treadle.kv_transfer.registry import connector_class
from treadle.kv_transfer.shared_storage import (BlockTransfer, SharedStorageConnector,
                                                SharedStorageMetadata)
from treadle.request import Request, RequestStatus


BLOCK_BYTES = 2 * BS * 8   # a block of the oracle's cache: K and V, one int64 each per slot


@dataclasses.dataclass
class OracleConfig:
    """What the connectors read of a TreadleConfig (a dataclass: MultiConnector replaces its
    kv_transfer per connector)."""

    model: SimpleNamespace
    cache: SimpleNamespace
    parallel: SimpleNamespace
    kv_transfer: KVTransferConfig


def storage_config(root: str, load_async: bool, kind: str = "storage",
                   host_blocks: int = 8) -> OracleConfig:
    """Files in `root` ("storage"), a host tier of `host_blocks` blocks ("offloading"), or the
    host tier, then the files ("multi")."""
    files = {"kv_connector": "SharedStorageConnector",
             "kv_connector_extra_config": {"shared_storage_path": root, "load_async": load_async}}
    host = {"kv_connector": "OffloadingConnector",
            "kv_connector_extra_config": {"cpu_bytes_to_use": host_blocks * BLOCK_BYTES}}
    spec = {"storage": files, "offloading": host,
            "multi": {"kv_connector": "MultiConnector",
                      "kv_connector_extra_config": {"connectors": [host, files]}}}[kind]
    return OracleConfig(
        # A folder holding no weight files (the store's): blocks name the model by its files.
        model=SimpleNamespace(model=root, dtype=torch.int64, quantization=None,
                              num_layers=1, num_kv_heads=1, head_dim=1),
        cache=SimpleNamespace(block_size=BS),
        parallel=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1),
        kv_transfer=KVTransferConfig.from_dict({**spec, "kv_role": "kv_both"}))


def block_stores(connector) -> list:
    """The block stores behind a connector (a MultiConnector's, in order)."""
    return connector.connectors if isinstance(connector, MultiConnector) else [connector]


def without_poll_wait(meta):
    """The step's metadata, its stores told not to wait for loads (none finishes by waiting)."""
    if isinstance(meta, MultiConnectorMetadata):
        return MultiConnectorMetadata([without_poll_wait(m) for m in meta.metas])
    if isinstance(meta, SharedStorageMetadata):
        return dataclasses.replace(meta, poll_wait_s=0.0)
    return meta


class TensorSlots:
    """The oracle's slots in a real KV cache ([2, blocks, BS, 1, 1] int64; K and V both hold
    the key): 0 is a slot never written, -1 poison."""

    def __init__(self, cache: torch.Tensor) -> None:
        self.flat = cache.numpy().reshape(2, -1)   # a view: the connector's copies show here

    def get(self, slot: tuple[int, int], default=None):
        value = int(self.flat[0, slot[0] * BS + slot[1]])
        return default if value == 0 else POISON if value == -1 else value

    def __setitem__(self, slot: tuple[int, int], key) -> None:
        self.flat[:, slot[0] * BS + slot[1]] = -1 if key is POISON else key


class DeferredIO:
    """The worker side's load thread, made deterministic: a submitted load runs `load_steps`
    returned steps later."""

    def __init__(self, load_steps: int) -> None:
        self.load_steps = load_steps
        self.pending: list[list] = []   # [steps left, future, fn, args]

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self.pending.append([self.load_steps, future, fn, args])
        return future

    def tick(self) -> None:
        for entry in list(self.pending):
            entry[0] -= 1
            if entry[0] <= 0:
                self.pending.remove(entry)
                entry[1].set_result(entry[2](*entry[3]))

    def shutdown(self, wait: bool = True) -> None:
        pass


class Faults:
    """The worker side's fault injector, drawing from the test's choice."""

    def __init__(self, fails: Callable[[int], bool] | None) -> None:
        self.fails = fails
        self.num_injected = 0

    def should_fail(self, block_index: int) -> bool:
        fail = self.fails is not None and self.fails(block_index)
        self.num_injected += fail
        return fail


class StorageWorker:
    """Both sides of a connector (files in a folder, a host tier, or both: storage_config) and
    the worker side's KV cache."""

    def __init__(self, root: str, num_blocks: int, load_async: bool = False,
                 load_steps: int = 2, fails: Callable[[int], bool] | None = None,
                 kind: str = "storage", host_blocks: int = 8) -> None:
        config = storage_config(root, load_async, kind, host_blocks)
        self.root = Path(root)
        self.kind = kind
        cls = connector_class(config.kv_transfer.kv_connector)
        self.scheduler_side = cls(config, KVConnectorRole.SCHEDULER)
        self.connector = cls(config, KVConnectorRole.WORKER)
        self.cache = torch.zeros((2, num_blocks, BS, 1, 1), dtype=torch.int64)
        self.connector.register_kv_caches([self.cache])
        self.io = DeferredIO(load_steps)
        faults = Faults(fails)   # one draw per load, whichever store loads
        for store in block_stores(self.connector):
            store._io, store.injector = self.io, faults
        self.host_tier = next((s for s in block_stores(self.connector)
                               if isinstance(s, OffloadingConnector)), None)
        self.host = self.host_tier.store if self.host_tier is not None else None
        self.slots = TensorSlots(self.cache)
        # Another engine's worker side with the same weights: it fills the files (store()).
        config = storage_config(root, load_async)
        self._names = SharedStorageConnector(config, KVConnectorRole.SCHEDULER)
        self._producer = SharedStorageConnector(config, KVConnectorRole.WORKER)
        self._scratch = torch.zeros((2, 2, BS, 1, 1), dtype=torch.int64)
        self._producer.register_kv_caches([self._scratch])
        self._recving: set[str] = set()
        self._errors: set[int] = set()

    def before_forward(self, so) -> set[int]:
        """ModelRunner.execute_model up to the forward pass; returns the load errors so far."""
        c = self.connector
        c.bind_connector_metadata(without_poll_wait(so.kv_connector_metadata))
        _, self._recving = c.get_finished(so.finished_req_ids)
        c.start_load_kv()
        self._errors = c.get_block_ids_with_load_errors()
        return self._errors

    def after_forward(self) -> KVConnectorOutput:
        """The rest of ModelRunner.execute_model: saves, and what the step reports."""
        c = self.connector
        c.wait_for_save()
        c.clear_connector_metadata()
        return KVConnectorOutput(set(), self._recving,
                                 self._errors | c.get_block_ids_with_load_errors())

    def tick(self) -> None:
        self.io.tick()

    def store(self, request: Request, gen: int, num_blocks: int | None = None) -> None:
        """Another engine with the same weights (generation `gen`) stores the KV of the
        request's prompt blocks, under the names this engine's connector gives them now; a
        host tier alone is no one else's to fill."""
        if self.kind == "offloading":
            return
        self._names.weights_identity = block_stores(self.scheduler_side)[-1].weights_identity
        keys = prefix_keys(request.prompt_token_ids, gen)
        n = request.num_prompt_tokens // BS if num_blocks is None else num_blocks
        for i in range(n):
            self._scratch[:, 1, :, 0, 0] = torch.tensor(keys[i * BS:(i + 1) * BS])
            key = self._names.block_key(request.block_hashes[i])
            self._producer.bind_connector_metadata(SharedStorageMetadata(
                saves=[BlockTransfer(request.request_id, 1, key, i)]))
            self._producer.wait_for_save()
        self._producer.clear_connector_metadata()

    def damage(self, rng: random.Random) -> None:
        """A stored block is damaged, in host memory or as a file: its load must fail
        (checksum or format)."""
        if self.host is not None and (self.kind == "offloading" or rng.random() < 0.5):
            # Only a sealed block: one the saver still checksums would be sealed as damaged.
            self.host_tier._wait_for_saves(sealed=True)
            slots = sorted(self.host._slot[key] for key in self.host._crc)
            if slots:
                self.host.buffer[rng.choice(slots)].view(-1)[rng.randrange(2 * BS)] ^= 0x5A
            return
        files = sorted(self.root.glob("*.kv"))
        if files:
            path = rng.choice(files)
            data = path.read_bytes()
            path.write_bytes(data[:len(data) // 2] if rng.random() < 0.5 else bytes(len(data)))


def storage_runner(root: str, policy: str = "recompute", load_async: bool = False,
                   load_steps: int = 2, fails: Callable[[int], bool] | None = None,
                   num_blocks: int = 40, scheduling: str = "fcfs", kind: str = "storage",
                   host_blocks: int = 8, **kw) -> tuple[AsyncRunner, StorageWorker]:
    worker = StorageWorker(root, num_blocks, load_async, load_steps, fails, kind, host_blocks)
    sched = make_scheduler(num_blocks=num_blocks, policy=scheduling, **kw)
    sched.connector, sched.kv_load_failure_policy = worker.scheduler_side, policy
    return AsyncRunner(sched, worker=worker), worker


# -- random interleavings ------------------------------------------------------------------------
# The tiered connectors' examples, beside the ci profile's 500 of shared storage: within ~30 s.
TIERED_EXAMPLES = 400


@settings(deadline=None)
@given(num_blocks=st.integers(10, 24), depth=st.sampled_from([1, 2, 3]),
       budget=st.sampled_from([8, 16, 64]), policy=st.sampled_from(["recompute", "fail"]),
       sched_policy=st.sampled_from(["fcfs", "priority"]), load_async=st.booleans(),
       drafts=st.booleans(), seed=st.integers(0, 2**32 - 1), num_events=st.integers(10, 100))
def test_shared_storage_under_random_interleavings(num_blocks: int, depth: int, budget: int,
                                                   policy: str, sched_policy: str,
                                                   load_async: bool, drafts: bool, seed: int,
                                                   num_events: int):
    """Loads (sync and async, failed by injection or by a damaged file), saves of everything
    computed, reused ids, resets, pauses and weight updates, drafts, sync and async scheduling."""
    random_interleavings("storage", 8, num_blocks, depth, budget, policy, sched_policy,
                         load_async, drafts, seed, num_events)


@settings(deadline=None, max_examples=TIERED_EXAMPLES)
@given(kind=st.sampled_from(["offloading", "multi"]), host_blocks=st.integers(1, 12),
       num_blocks=st.integers(10, 24), depth=st.sampled_from([1, 2, 3]),
       budget=st.sampled_from([8, 16, 64]), policy=st.sampled_from(["recompute", "fail"]),
       sched_policy=st.sampled_from(["fcfs", "priority"]), load_async=st.booleans(),
       drafts=st.booleans(), seed=st.integers(0, 2**32 - 1), num_events=st.integers(10, 100))
def test_tiered_connectors_under_random_interleavings(kind: str, host_blocks: int,
                                                      num_blocks: int, depth: int, budget: int,
                                                      policy: str, sched_policy: str,
                                                      load_async: bool, drafts: bool, seed: int,
                                                      num_events: int):
    """The same with a host tier (OffloadingConnector) of a few blocks, evicting as it goes, alone
    or before the files (MultiConnector): blocks damaged in host memory too."""
    random_interleavings(kind, host_blocks, num_blocks, depth, budget, policy, sched_policy,
                         load_async, drafts, seed, num_events)


def random_interleavings(kind: str, host_blocks: int, num_blocks: int, depth: int, budget: int,
                         policy: str, sched_policy: str, load_async: bool, drafts: bool,
                         seed: int, num_events: int) -> None:
    rng = random.Random(seed)
    fail_rate = rng.choice([0.0, 0.0, 0.2, 0.5])
    with tempfile.TemporaryDirectory() as root:
        runner, worker = storage_runner(root, policy, load_async, rng.randint(1, 4),
                                        lambda i: rng.random() < fail_rate,
                                        num_blocks=num_blocks, budget=budget,
                                        scheduling=sched_policy, kind=kind,
                                        host_blocks=host_blocks)
        if drafts:
            runner.propose = random_drafts(random.Random(seed + 1))
        ids = RequestIds(runner, rng)

        def add() -> None:
            max_tokens = rng.randint(1, 8)
            prompt_len = min(rng.randint(1, 30), (num_blocks - 1) * BS - max_tokens)
            request = make_request(ids.next(), prompt_len,
                                   first_token=rng.choice((100, 300, 500)), max_tokens=max_tokens,
                                   priority=rng.randint(0, 5), arrival=float(len(runner.requests)))
            if rng.random() < 0.3:
                worker.store(request, runner.kv.gen)
            ids.add(request)

        for _ in range(rng.randint(1, 6)):
            add()
        run_random_events(runner, rng, num_events, depth, add, add_weight=20,
                          extra=lambda: worker.damage(rng))


# -- issue 42, one test each ---------------------------------------------------------------------
@pytest.mark.parametrize("how", ["reset", "pause"])
@pytest.mark.parametrize("depth", [1, 2])
def test_a_request_reset_and_readmitted_with_an_async_load_starts(tmp_path, depth, how):
    """Defect 1: a reset request is in the scheduler's finished ids; re-admitted with an
    asynchronous load (its KV is in the store, the prefix cache is gone), it is not among the
    step's new requests, and the connector must not drop what admission just tracked."""
    runner, _ = storage_runner(str(tmp_path), load_async=True)
    a = make_request("a", 13, max_tokens=4)
    runner.add(a)
    runner.step(depth)
    runner.finish_in_flight()            # a's three prompt blocks are computed and saved
    if how == "reset":
        assert runner.engine_reset()
    else:
        runner.pause()                   # mode "keep", clear_cache=True by default
        runner.resume()
    runner.drain(depth)
    assert a.num_preemptions == 1 and a.num_cached_tokens == 0
    runner.check_ledger()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_reused_id_does_not_take_the_old_requests_load_result(policy):
    """Defect 2: "R" is aborted while a step carrying its KV load is in flight and a new "R"
    arrives at once; settling the old step must not publish the new R's blocks before its own
    load is checked."""
    sched, store = connected(policy, num_blocks=40)
    failing: set[tuple[str, int]] = set()
    runner = AsyncRunner(sched, load_fails=lambda rid, i: (rid, i) in failing)
    add_stored(runner, store, "R", 13, first_token=100)
    runner.schedule()                    # old R loads blocks 0-2
    runner.abort("R")
    add_stored(runner, store, "R", 17, first_token=300)
    failing.add(("R", 1))                # the new R's block 1 will not arrive
    runner.schedule()                    # new R loads blocks 0-3, block 1 fails
    runner.complete()                    # the old R's step
    runner.complete()                    # the new R's: its failure is settled
    runner.drain(2)
    runner.check_ledger()


def test_a_loaded_request_starts_when_the_only_running_one_preempts_itself():
    """Defect 3: sync scheduling, a full cache. B's asynchronous load is done and B holds the
    blocks of its prompt; A, the only running request, needs one more block and preempts
    itself. B must start (nothing else can), or the engine sees no progress."""
    sched, store = connected(load_async=True, num_blocks=7)   # 6 usable blocks of 4
    runner = AsyncRunner(sched, load_steps=1)
    a = make_request("A", 8, first_token=100, max_tokens=8)
    runner.add(a)                                            # 2 blocks, a third to decode
    add_stored(runner, store, "B", 13, first_token=500)      # loads into 4 blocks
    runner.step(1)
    assert a.status == RequestStatus.RUNNING and sched.loaded
    runner.drain(1)
    runner.check_ledger()


def test_a_connector_that_cannot_tell_yet_does_not_stall_the_engine():
    """Defect 3's other path: nothing runs and the connector answers "ask again later" (None)
    for the next waiting request; the engine must ask again, not stop."""
    answers = iter([True, True, False])
    sched, store = connected(undecided=lambda: next(answers, False), num_blocks=40)
    runner = AsyncRunner(sched)
    add_stored(runner, store, "a", 13, first_token=100)
    runner.drain(1)
    runner.check_ledger()


@pytest.mark.parametrize("load_async", [False, True])
def test_kv_computed_on_old_weights_is_never_saved_under_the_new_ones(tmp_path, load_async):
    """Defect 4: A is kept across a weight update (pause keep, clear_cache=False), so the
    blocks it computes afterwards sit on KV of the old weights; none may reach the store under
    the new weights' names, where C (new weights, same prompt) would load them."""
    runner, _ = storage_runner(str(tmp_path), load_async=load_async, budget=8)
    a = make_request("A", 21, first_token=100, max_tokens=2)
    runner.add(a)
    runner.step(1)                       # A: tokens 0-7 (blocks 0-1), old weights
    runner.pause(clear_cache=False)
    runner.update_weights()
    runner.resume()
    runner.drain(1)                      # A finishes its prompt (blocks 2-4) on its old KV
    d = make_request("D", 9, first_token=100, max_tokens=1)
    runner.add(d)                        # new weights: blocks 0-1, published
    runner.drain(1)
    runner.add(make_request("C", 21, first_token=100, max_tokens=2))
    runner.drain(1)                      # C: hits 0-1, then asks the store for 2-4
    runner.check_ledger()
