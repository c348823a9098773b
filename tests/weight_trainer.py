"""A trainer process for the weight-transfer tests: it holds a model's weights and is rank 0 of
the transfer group (treadle.rl.WeightSender). Kept apart from the test module so that the
spawned process imports torch and treadle.rl only."""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

import torch

SMALL_BUFFER = 64 << 10   # packs the tiny models into many buffers, some of several tensors


def perturbed(weights: dict[str, torch.Tensor], seed: int, dtype: torch.dtype = torch.float32
              ) -> list[tuple[str, torch.Tensor]]:
    """Every weight moved a little, travelling as `dtype` (the trainer and the test agree)."""
    gen = torch.Generator().manual_seed(seed)
    return [(name, (w + 0.02 * torch.randn(w.shape, generator=gen)).to(dtype))
            for name, w in weights.items()]


def _trainer_main(conn, weights: dict[str, torch.Tensor], world_size: int) -> None:
    import torch.distributed as dist

    from treadle.rl import WeightSender

    sender = None
    while True:
        cmd, *args = conn.recv()
        if cmd == "exit":
            return
        try:
            if cmd == "group":   # a new group: its init_info first, then wait for the workers
                if sender is not None:
                    sender.close()
                sender = WeightSender(world_size, timeout_s=args[0])
                conn.send(sender.init_info)
                sender.connect()
                conn.send("connected")
            elif cmd == "send":
                seed, dtype, names, packed, how = args
                source = perturbed(weights, seed, dtype) if seed is not None else weights.items()
                pairs = [(n, t) for n, t in source if names is None or n in names]
                conn.send(sender.update_info(pairs, packed=packed,
                                             packed_buffer_size_bytes=SMALL_BUFFER))
                if how == "itself":   # as a trainer calling torch.distributed by itself
                    for _, tensor in pairs:
                        dist.broadcast(tensor, group=sender.group, group_src=0)
                elif how == "die":
                    for _, tensor in pairs[:len(pairs) // 2]:
                        sender.broadcast(tensor)
                    os._exit(3)
                elif how == "halves":   # declared as they are, sent in bfloat16: half the bytes
                    for _, tensor in pairs:
                        sender.broadcast(tensor.to(torch.bfloat16))
                elif how == "stall":   # joined, but sends nothing
                    conn.send(("stalled", 0))
                    continue
                else:
                    sender.send(pairs, packed=packed, packed_buffer_size_bytes=SMALL_BUFFER)
                conn.send(("sent", len(pairs)))
        except Exception as e:   # reported to the test, which decides
            conn.send(("error", repr(e)))


class Trainer:
    """A trainer process holding `weights`: rank 0 of the transfer group."""

    def __init__(self, weights: dict[str, torch.Tensor], world_size: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.names = list(weights)
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_trainer_main, args=(child, weights, world_size), daemon=True)
        self.proc.start()

    def call(self, *cmd: Any, timeout: float = 60) -> Any:
        """Send a command (if any) and wait for the trainer's next reply."""
        if cmd:
            self.conn.send(cmd)
        assert self.conn.poll(timeout), f"the trainer did not answer {cmd}"
        return self.conn.recv()

    def group(self, init, timeout_s: float = 60) -> None:
        """A new group: `init(request)` is the engine's init_weight_transfer_engine."""
        init_info = self.call("group", timeout_s)
        init({"init_info": init_info})
        assert self.call() == "connected"

    def transfer(self, llm, seed: int | None, *, dtype: torch.dtype = torch.float32,
                 packed: bool = False, parts: int = 1, how: str = "send",
                 weight_version: Any = None) -> int:
        """One round on an LLM: start, `parts` update_weights (the trainer sending each), finish.
        seed None: the weights as held; else perturbed(weights, seed, dtype)."""
        llm.start_weight_update()
        for i in range(parts):
            part = self.names[i::parts]
            info = self.call("send", seed, dtype, part, packed, how)
            assert llm.update_weights({"update_info": info}) == len(part)
            assert self.call() == ("sent", len(part))
        return llm.finish_weight_update(weight_version)

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("exit",))
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
