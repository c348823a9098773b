"""A worker's end of a weight transfer from a trainer (treadle/distributed/weight_transfer.py).

Every worker receives every tensor and stages those its pipeline stage holds (of the others,
only the shape is kept); nothing touches the model until `finish`, which applies the round
through the runner's update path, so each rank keeps only its own shard and a round that fails
halfway leaves the old weights in place. Rank 0 hashes what it receives into the digest the
engine chains into the weights' identity (engine/weights.py).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from treadle.config import WeightTransferConfig
from treadle.distributed.parallel_state import ParallelContext
from treadle.distributed.weight_transfer import InitInfo, TransferGroup, UpdateInfo, unpack
from treadle.engine.weights import add_to_digest, update_digest
from treadle.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class WeightReceiver:
    def __init__(self, config: WeightTransferConfig | None, runner: ModelRunner,
                 ctx: ParallelContext) -> None:
        self.config = config
        self.runner = runner
        self.ctx = ctx
        self.group: TransferGroup | None = None
        # The round so far: this rank's parts of it (the model's local_weights: None for
        # another stage's), and every tensor's name and whole shape, for the checks.
        self.staged: list[tuple[str, torch.Tensor | None]] = []
        self.received: list[tuple[str, tuple[int, ...]]] = []
        self.digest: Any = None   # of the round's tensors so far, on rank 0
        # A gloo join runs on a thread of its own, so that steps go on while the trainer comes
        # (or never does, until the timeout): `joined()` says how it went. (NCCL's: `init`.)
        self._lock = threading.Lock()
        self._joining: threading.Thread | None = None
        self._join_error: BaseException | None = None
        self._join_id = 0   # the current join's; a join whose id has moved on was given up

    def init(self, init_info: dict[str, Any]) -> None:
        """Start joining the trainer's group as rank rank_offset + this worker's rank (a new
        group replaces any earlier one); `joined()` reports when it is done."""
        if self.config is None:
            raise RuntimeError("weight transfer is not enabled: start the engine with "
                               "weight_transfer_config={'backend': 'gloo'}")
        info = InitInfo.parse(init_info)
        rank = info.rank_offset + self.ctx.rank
        if rank >= info.world_size:
            raise ValueError(f"init_info.world_size {info.world_size} has no rank {rank} for "
                             f"worker {self.ctx.rank} (rank_offset {info.rank_offset})")
        with self._lock:
            if self._joining is not None and self._joining.is_alive():
                raise RuntimeError("a join of the trainer's group is under way: wait for "
                                   "init_weight_transfer_engine to return, or its timeout")
        self.abort(close_group=True)
        # gloo stages on the host whatever the device; NCCL receives on the worker's GPU.
        device = self.runner.device if self.config.backend == "nccl" else torch.device("cpu")
        with self._lock:
            self._join_id += 1
            self._join_error = None
            args = (self._join_id, info, rank, info.timeout or self.config.timeout_s, device)
            if self.config.backend != "nccl":
                self._joining = threading.Thread(target=self._join, args=args, daemon=True,
                                                 name="treadle-weight-transfer-join")
                self._joining.start()
                return
        # NCCL's set-up waits on CUDA streams, which would break a CUDA graph that wake_up
        # captured on this worker meanwhile: it joins here, holding the worker, as before.
        self._join(*args)
        with self._lock:
            error, self._join_error = self._join_error, None
        if error is not None:
            raise error

    def _join(self, join_id: int, info: InitInfo, rank: int, timeout_s: float,
              device: torch.device) -> None:
        group: TransferGroup | None = None
        try:
            group = TransferGroup(self.config.backend, info.master_address, info.master_port,
                                  rank, info.world_size, timeout_s, device)
            group.connect()
        except BaseException as e:
            if group is not None:
                group.close()
            with self._lock:
                if join_id == self._join_id:
                    self._join_error = e
            return
        with self._lock:
            given_up = join_id != self._join_id   # by abort(close_group) while it ran
            if not given_up:
                self.group = group
        if given_up:
            group.close()
            return
        logger.info("weight transfer: joined %s:%d as rank %d of %d (%s)", info.master_address,
                    info.master_port, rank, info.world_size, self.config.backend)

    def joined(self) -> bool:
        """False while the join started by `init` runs; True once it has joined; raises what
        made it fail, once."""
        with self._lock:
            if self._joining is None:
                if self.group is None:
                    raise RuntimeError("no weight transfer group: call "
                                       "init_weight_transfer_engine first")
                return True
            if self._joining.is_alive():
                return False
            self._joining, error, self._join_error = None, self._join_error, None
        if error is not None:
            raise error
        return self.group is not None

    def start(self) -> None:
        self.staged, self.received = [], []
        self.digest = update_digest() if self.ctx.rank == 0 else None

    def check(self, update_info: dict[str, Any]) -> None:
        """Raise ValueError if any name, shape or dtype does not fit this rank's model, before
        anything is received."""
        info = UpdateInfo.parse(update_info)
        self.runner.check_weights([(name, shape) for name, _, shape in info.tensors()])

    def receive(self, update_info: dict[str, Any]) -> int:
        """Receive the tensors update_info lists into staging; returns how many. A failure
        drops the round's staged tensors and the group, which is then broken for every rank."""
        if self.group is None:
            raise RuntimeError("no weight transfer group: call init_weight_transfer_engine")
        info = UpdateInfo.parse(update_info)
        layout = info.tensors()
        received = 0
        try:
            for chunk in info.chunks():
                part = [layout[i] for i in chunk]
                for name, tensor in self._receive_chunk(part, info.packed):
                    if self.digest is not None:
                        add_to_digest(self.digest, name, tensor)
                    self.received.append((name, tuple(tensor.shape)))
                    # Only this rank's part is kept (of another stage's tensor, nothing), so
                    # no rank stages the whole model until the round ends.
                    self.staged += [(local_name, None if piece is None else _own(piece))
                                    for local_name, piece
                                    in self.runner.model.local_weights([(name, tensor)])]
                    received += 1
        except Exception as e:
            self.abort(close_group=True)
            raise RuntimeError(f"receiving from the trainer failed after {received} of "
                               f"{len(layout)} tensors: {e}") from e
        return received

    def _receive_chunk(self, part: list[tuple[str, torch.dtype, tuple[int, ...]]], packed: bool
                       ) -> list[tuple[str, torch.Tensor]]:
        assert self.group is not None
        device = self.group.device
        if not packed:
            (name, dtype, shape), = part
            tensor = torch.empty(shape, dtype=dtype, device=device)
            self._broadcast_whole(tensor, part)
            return [(name, tensor)]
        size = sum(torch.Size(shape).numel() * dtype.itemsize for _, dtype, shape in part)
        buffer = torch.empty(size, dtype=torch.uint8, device=device)
        self._broadcast_whole(buffer, part)
        return list(unpack(buffer, part))

    def _broadcast_whole(self, tensor: torch.Tensor,
                         part: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        """Receive into `tensor`, refusing a message shorter than it. gloo takes a shorter
        message into a larger buffer and leaves the rest as it was: a trainer that declared
        float32 and sent bfloat16, or packed with another buffer size, would have had memory
        applied as weights. So the buffer's last bytes are set first, to random bytes ending in
        0xFF (a float weight, little-endian, whose last byte is 0xFF is negative and past 1e38,
        infinite or NaN), and a message that leaves them all as they were did not reach them.
        (A longer message than declared is gloo's own error; it aborts the process.)"""
        assert self.group is not None
        tail = tensor.view(-1).view(torch.uint8)[-8:]
        if not tail.numel():
            self.group.broadcast(tensor)
            return
        mark = torch.randint(0, 256, (tail.numel(),), dtype=torch.uint8)
        mark[-1] = 0xFF
        tail.copy_(mark)
        self.group.broadcast(tensor)
        if torch.equal(tail.cpu(), mark):
            names = [name for name, _, _ in part]
            raise ValueError(
                f"the trainer sent fewer bytes than update_info declares for "
                f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''}: its dtype_names, "
                f"shapes or packed_buffer_size_bytes differ from what it sent")

    def check_staged(self) -> None:
        """Raise as applying the round would (after sleep(level=2), a round must hold every
        weight), changing nothing."""
        self.runner.check_weights(self.received)

    def finish(self) -> tuple[int, str | None]:
        """Apply the round; (distinct weights set, rank 0's digest of the round)."""
        staged, self.staged, self.received = self.staged, [], []
        digest, self.digest = self.digest, None
        count = self.runner.update_weights(staged, local=True)
        return count, digest.hexdigest() if digest is not None else None

    def abort(self, close_group: bool) -> None:
        """Drop the staged tensors, and with close_group the group too (one still being joined
        is closed as its join ends)."""
        self.staged, self.received, self.digest = [], [], None
        if not close_group:
            return
        with self._lock:
            group, self.group = self.group, None
            if self._joining is not None:
                self._join_id += 1   # its outcome is nobody's now: it closes what it joins
                self._joining = None
        if group is not None:
            group.close()


def _own(piece: torch.Tensor) -> torch.Tensor:
    """`piece`, or a copy of it where it is a view into more (a shard of a received tensor,
    a tensor in a packed buffer), which it would keep alive whole."""
    if piece.untyped_storage().nbytes() > piece.numel() * piece.element_size():
        return piece.clone()
    return piece
