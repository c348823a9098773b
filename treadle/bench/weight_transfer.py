"""One full weight transfer from a trainer process over gloo, against an in-process
update_weights of the same tensors, in the same run.

A trainer process (treadle.rl.WeightSender) holds the model's weights and broadcasts all of them
each round: start_weight_update, update_weights (the trainer sending meanwhile), then
finish_weight_update, which applies them. Rounds alternate between unpacked (one broadcast per
tensor, as a trainer calling torch.distributed itself) and packed (tensors in buffers of
--packed-buffer-mib). The in-process side copies the same tensors with LLM.update_weights. The
weights sent are the model's own, so the output never changes; the report gives the median of
each, and the bytes per second of the transfer.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import statistics
import sys
import time
from typing import Any

from treadle.bench.throughput import check_at_least, machine

logger = logging.getLogger(__name__)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--num-rounds", type=int, default=3, help="timed rounds of each kind [default: 3]")
    g.add_argument("--packed-buffer-mib", type=int, default=64,
                   help="packed rounds' buffer size [default: 64]")
    g.add_argument("--output-json", default=None, metavar="PATH", help="also save the figures here")


def _sender_main(conn, model_path: str, world_size: int) -> None:
    from treadle.models.loader import iter_hf_weights
    from treadle.rl import WeightSender

    pairs = list(iter_hf_weights(model_path))
    with WeightSender(world_size) as sender:
        conn.send(sender.init_info)
        sender.connect()
        while True:
            command, *args = conn.recv()
            if command == "exit":
                return
            packed, buffer_bytes = args
            conn.send(sender.update_info(pairs, packed=packed, packed_buffer_size_bytes=buffer_bytes))
            sender.send(pairs, packed=packed, packed_buffer_size_bytes=buffer_bytes)
            conn.send("sent")


def main(ns: argparse.Namespace) -> int:
    import torch

    from treadle import LLM
    from treadle.entrypoints.engine_cli_args import engine_args_from
    from treadle.models.loader import iter_hf_weights, prepare_model

    check_at_least(ns, num_rounds=1, packed_buffer_mib=1)
    engine_args = engine_args_from(ns)
    engine_args["weight_transfer_config"] = {"backend": "gloo"}
    llm = LLM(**engine_args)
    path = prepare_model(llm.engine.config.model.model)
    pairs = list(iter_hf_weights(path))
    total_bytes = sum(t.numel() * t.element_size() for _, t in pairs)
    world = llm.engine.config.parallel.world_size

    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_sender_main, args=(child, path, 1 + world), daemon=True)
    proc.start()
    times: dict[str, list[float]] = {"gloo, unpacked": [], "gloo, packed": [], "in-process": []}
    try:
        # Returns once the trainer, in its own process, has seen every worker join.
        llm.init_weight_transfer_engine({"init_info": conn.recv()})
        for _ in range(ns.num_rounds):
            for name, packed in (("gloo, unpacked", False), ("gloo, packed", True)):
                start = time.perf_counter()
                llm.start_weight_update()
                conn.send(("send", packed, ns.packed_buffer_mib << 20))
                llm.update_weights({"update_info": conn.recv()})
                llm.finish_weight_update()
                times[name].append(time.perf_counter() - start)
                assert conn.recv() == "sent"
            start = time.perf_counter()
            llm.update_weights(pairs)
            times["in-process"].append(time.perf_counter() - start)
    finally:
        if proc.is_alive():
            conn.send(("exit",))
        proc.join(30)
        llm.shutdown()

    medians = {name: statistics.median(v) for name, v in times.items()}
    host = machine()
    report: dict[str, Any] = {
        "command": " ".join(["treadle", *sys.argv[1:]]), "machine": host,
        "engine_args": engine_args, "weights": len(pairs), "bytes": total_bytes,
        "dtype": str(pairs[0][1].dtype).removeprefix("torch."), "world_size": world,
        "times_s": times, "median_s": medians, "torch": torch.__version__,
    }
    out = sys.stdout
    out.write(f"{len(pairs)} tensors, {total_bytes / 1e6:.1f} MB, to {world} worker(s); "
              f"{host['cpu']}, {host['cores']} cores\n\n"
              "| transfer | median s | min s | max s | GB/s |\n|---|---|---|---|---|\n")
    for name, values in times.items():
        out.write(f"| {name} | {medians[name]:.3f} | {min(values):.3f} | {max(values):.3f} | "
                  f"{total_bytes / medians[name] / 1e9:.2f} |\n")
    out.write(f"\ngloo packed / in-process: {medians['gloo, packed'] / medians['in-process']:.2f}x\n")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return 0
