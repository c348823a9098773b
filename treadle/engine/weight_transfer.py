"""The engine's side of a weight transfer from a trainer process: vLLM's four calls
(`init_weight_transfer_engine`, `start_weight_update`, `update_weights`, `finish_weight_update`)
driven across every rank. The protocol: treadle/distributed/weight_transfer.py; a worker's part:
treadle/worker/weight_transfer.py.

The rules:
  - Over gloo each worker joins the trainer's group on a thread of its own, so that steps go
    on while the trainer comes (or never does, until the timeout); the engine's `init` starts
    the joins and `joined` polls them, and a round needs every rank joined. (NCCL's join holds
    the worker: worker/weight_transfer.py says why.)
  - An update_info is checked by every rank against its part of the model before any rank
    joins the broadcast. A refused one changes nothing, but the trainer may already be sending
    into the group, so the round and the group are dropped: the trainer's broadcast then fails
    at once instead of waiting for its timeout, and a new init sets up a fresh group.
  - Nothing is applied until finish: a transfer that fails halfway (the trainer died, a
    timeout) leaves the old weights on every rank, drops what was staged and the group.
  - finish is a weight change like update_weights (EngineCore.finish_weight_update): refused
    while requests run unpaused, every rank checks before any applies, the prefix cache goes.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, NoReturn

from treadle.config import WeightTransferConfig
from treadle.distributed.weight_transfer import InitInfo, UpdateInfo
from treadle.engine.errors import EngineDeadError
from treadle.engine.weights import check_label
from treadle.executor.base import Executor

logger = logging.getLogger(__name__)

NOT_ENABLED = ("weight transfer is not enabled: start the engine with "
               "weight_transfer_config={'backend': 'gloo'} (CPU) or {'backend': 'nccl'} (CUDA); "
               "on the command line, --weight-transfer-config '{\"backend\": \"gloo\"}'")
INIT_AGAIN = "call init_weight_transfer_engine again to set up a new group"


class WeightTransferError(RuntimeError):
    """A transfer failed on the wire (the trainer died, a timeout): the engine keeps the weights
    it had and stays healthy; the group is gone."""


def init_info_of(request: Any) -> dict[str, Any]:
    """vLLM's forms: {"init_info": {...}} or an object with .init_info; or init_info itself."""
    if isinstance(request, dict):
        return request["init_info"] if "init_info" in request else request
    if hasattr(request, "init_info"):
        return request.init_info
    raise ValueError(f"init_weight_transfer_engine takes {{'init_info': {{...}}}} or init_info, "
                     f"got {type(request).__name__}")


def update_info_of(request: Any) -> dict[str, Any] | None:
    """The update_info of a weight-transfer request ({"update_info": {...}}, or an object with
    .update_info, as vLLM accepts), or None for update_weights' (name, tensor) pairs."""
    if isinstance(request, dict):
        if "update_info" not in request:
            raise ValueError("update_weights takes (name, tensor) pairs or a weight-transfer "
                             "request {'update_info': {...}}; this dict has no 'update_info'")
        return request["update_info"]
    if hasattr(request, "update_info"):
        return request.update_info
    return None


class WeightTransfer:
    """Where the group and the round stand, the same on every rank. The executor is passed to
    each call: a worker restart replaces it, and its workers know no group."""

    def __init__(self, config: WeightTransferConfig | None) -> None:
        self.config = config
        self._executor: Executor | None = None   # whose workers joined the group
        # Whose workers are joining it, and where: the join runs on a thread of each worker's
        # so that steps go on meanwhile; `joined` asks how it stands.
        self._joining: tuple[Executor, InitInfo] | None = None
        self._round_open = False
        self._round_version: Any = None   # a weight_version given during the round

    def init(self, executor: Executor, request: Any) -> None:
        self._check_enabled()
        info = InitInfo.parse(init_info_of(request))
        if info.rank_offset + executor.world_size > info.world_size:
            raise ValueError(f"init_info.world_size {info.world_size} is too small for rank_offset "
                             f"{info.rank_offset} and this engine's {executor.world_size} workers")
        if self._joining is not None and not self._earlier_join_ended(executor):
            # Its caller still waits on it: a retry must not give it up (a 409, not a 502).
            raise RuntimeError("a join of the trainer's group is under way: wait for the "
                               "init_weight_transfer_engine call before to return, or its "
                               "timeout")
        # Each worker leaves an earlier group (or its remains) before it joins the new one.
        self._executor, self._round_open, self._joining = None, False, None
        try:
            executor.collective_rpc("init_weight_transfer_engine", (init_info_of(request),))
        except EngineDeadError:
            raise
        except Exception as e:
            self._failed_join(executor, info, e)
        self._joining = executor, info

    def joined(self, executor: Executor) -> bool:
        """After init: False while a worker is still joining the trainer's group, True once
        every one has; raises WeightTransferError (ValueError for a refused init_info) if any
        could not, after every rank has left the group."""
        if self._joining is None:
            self._check_group(executor)
            return True
        joining, info = self._joining
        if joining is not executor:
            self._joining = None
            raise WeightTransferError(f"the workers were restarted while they joined the "
                                      f"trainer's group: {INIT_AGAIN}")
        try:
            states = executor.collective_rpc("weight_transfer_joined")
        except EngineDeadError:
            raise
        except Exception as e:
            self._joining = None
            self._failed_join(executor, info, e)
        if not all(states):
            return False
        self._executor, self._joining = executor, None
        return True

    def _earlier_join_ended(self, executor: Executor) -> bool:
        """Whether the join an earlier init started is over (its caller may have stopped
        asking: a client gone); a failure of it is its caller's to hear, if it still asks."""
        try:
            return self.joined(executor)
        except EngineDeadError:
            raise
        except Exception as e:
            logger.info("init_weight_transfer_engine: the join before it had failed: %s", e)
            return True

    def _failed_join(self, executor: Executor, info: InitInfo, error: Exception) -> NoReturn:
        self._drop(executor, close_group=True)
        if isinstance(error, ValueError):
            raise error
        raise WeightTransferError(f"could not join the trainer's group at "
                                  f"{info.master_address}:{info.master_port}: {error}") from error

    def start(self, executor: Executor, is_checkpoint_format: bool = True) -> None:
        self._check_group(executor)
        if is_checkpoint_format is not True:
            raise ValueError("is_checkpoint_format must be true: treadle takes weights by their "
                             "transformers names, as in the checkpoint")
        if self._round_open:
            logger.warning("start_weight_update: dropping the unfinished round before it")
        executor.collective_rpc("start_weight_update")
        self._round_open, self._round_version = True, None

    def update(self, executor: Executor, update_info: Any, weight_version: Any = None) -> int:
        """Receive one part of the round; returns the number of tensors received."""
        self._check_round(executor, "update_weights")
        try:
            info = UpdateInfo.parse(update_info)
            check_label(info.weight_version, "update_info.weight_version")
            executor.collective_rpc("check_weight_update", (update_info,))
        except EngineDeadError:
            raise
        except Exception as e:
            self._drop(executor, close_group=True)
            kind = ValueError if isinstance(e, ValueError) else RuntimeError
            raise kind(f"{e}. Nothing was changed; the round and the group were dropped (the "
                       f"trainer may have started sending): {INIT_AGAIN}") from e
        try:
            count = executor.collective_rpc("receive_weights", (update_info,))[0]
        except EngineDeadError:
            raise
        except Exception as e:
            self._drop(executor, close_group=True)
            raise WeightTransferError(
                f"the weight transfer failed: {e}. The engine keeps the weights it had (nothing "
                f"of the round was applied) and the group is closed: {INIT_AGAIN}") from e
        version = weight_version if weight_version is not None else info.weight_version
        if version is not None:
            self._round_version = version
        return count

    def finish(self, executor: Executor, weight_version: Any = None,
               on_apply_error: Callable[[Exception], None] | None = None) -> tuple[int, str, Any]:
        """Apply the round on every rank: (weights set, the round's digest, its label). The
        caller has drained the engine; it records the change. `on_apply_error` hears of a
        failure once the ranks have begun to apply it (before, nothing changed)."""
        self._check_round(executor, "finish_weight_update")
        try:
            executor.collective_rpc("check_staged_weights")   # every rank, before any applies
        except EngineDeadError:
            raise
        except Exception:
            self._drop(executor, close_group=False)
            raise
        self._round_open = False   # the workers hand their staged tensors over, come what may
        try:
            count, digest = executor.collective_rpc("finish_weight_update")[0]
        except Exception as e:
            if on_apply_error is not None:
                on_apply_error(e)
            raise
        return count, digest, weight_version if weight_version is not None else self._round_version

    def _drop(self, executor: Executor, close_group: bool) -> None:
        """Every rank forgets the round (and the group); never raises but for a dead engine."""
        self._round_open = False
        if close_group:
            self._executor = self._joining = None
        try:
            executor.collective_rpc("abort_weight_update", (close_group,))
        except EngineDeadError:
            raise
        except Exception as e:
            logger.warning("dropping the weight transfer round: %s", e)

    def _check_enabled(self) -> None:
        if self.config is None:
            raise RuntimeError(NOT_ENABLED)

    def _check_group(self, executor: Executor) -> None:
        self._check_enabled()
        if self._joining is not None:
            raise RuntimeError("the workers are still joining the trainer's group: wait for "
                               "init_weight_transfer_engine to return")
        if self._executor is None:
            raise RuntimeError("no weight transfer group: call init_weight_transfer_engine first")
        if self._executor is not executor:
            raise RuntimeError(f"the workers were restarted since init_weight_transfer_engine: "
                               f"{INIT_AGAIN}")

    def _check_round(self, executor: Executor, what: str) -> None:
        self._check_group(executor)
        if not self._round_open:
            raise RuntimeError(f"{what} needs a round: call start_weight_update first")
