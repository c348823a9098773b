"""TTFT and throughput of multi-turn chats whose history outgrows the device's KV cache, with
no KV tier, the host-memory tier, Redis, and both chained (host memory, then Redis).

--num-conversations conversations of --num-turns turns each: a turn adds --turn-len MIN MAX
random ordinary tokens (seeded) to the conversation's history, and the prompt is the whole
history (earlier turns and their answers) plus them; the answer, --output-len greedy tokens,
joins the history. The conversations run at once through AsyncLLM, each turn waiting for its
conversation's previous one, at most --max-concurrency turns in the engine at a time, so they
interleave as users do. Unless --num-kv-blocks is given, the device cache is sized to hold
--max-concurrency of the longest conversations and no more: below the working set (every
conversation's final history), which is printed with it, so a returning conversation finds
its prefix evicted unless a tier kept it. The host tier is sized to the working set unless
--host-tier-gib is given. Without --redis-url a redis-server is started on a free port for the
run, and stopped. Each engine answers one warm-up request before it is timed; the answers are
compared with the run without a tier.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from treadle.bench.throughput import check_at_least, machine, make_workload

logger = logging.getLogger(__name__)

TIERS = ("none", "host", "redis", "host+redis")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--num-conversations", type=int, default=16, help="[default: 16]")
    g.add_argument("--num-turns", type=int, default=6, help="turns per conversation [default: 6]")
    g.add_argument("--turn-len", type=int, nargs=2, default=[100, 300], metavar=("MIN", "MAX"),
                   help="tokens a turn adds to the history [default: 100 300]")
    g.add_argument("--output-len", type=int, default=16, help="answer tokens per turn [default: 16]")
    g.add_argument("--max-concurrency", type=int, default=4,
                   help="turns in the engine at a time [default: 4]")
    g.add_argument("--tiers", nargs="+", choices=TIERS, default=list(TIERS),
                   help="the configurations to run, in this order [default: all]")
    g.add_argument("--host-tier-gib", type=float, default=None,
                   help="the host tier's size [default: the working set]")
    g.add_argument("--redis-url", default=None,
                   help="a Redis to use [default: start a redis-server for the run]")
    g.add_argument("--output-json", default=None, metavar="PATH", help="also save the figures here")
    g.add_argument("--plot", default=None, metavar="PATH.png",
                   help="TTFT CDFs of the configurations (matplotlib)")


@dataclass
class TierResult:
    tier: str
    elapsed_s: float
    ttft_s: list[float]              # per turn, in (conversation, turn) order
    prompt_tokens: int
    cached_tokens: int               # of the prompts, served from the device cache or a tier
    output_tokens: int
    tier_hits: dict[str, int]        # blocks loaded, per connector
    tier_dropped: dict[str, int]     # block saves dropped (store down or busy), per connector
    agree: int | None = None         # turns whose answer equals the no-tier run's

    def summary(self) -> dict[str, float]:
        return {"ttft_p50_s": float(np.percentile(self.ttft_s, 50)),
                "ttft_p99_s": float(np.percentile(self.ttft_s, 99)),
                "output_tok_s": self.output_tokens / self.elapsed_s,
                "prompt_tok_s": self.prompt_tokens / self.elapsed_s,
                "cached_fraction": self.cached_tokens / self.prompt_tokens}


class RedisProcess:
    """A redis-server of the bench's own: 127.0.0.1, a free port, a temporary folder, no
    persistence."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise ValueError("redis-server not found: install it (`make redis`) or give --redis-url")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.folder = tempfile.mkdtemp(prefix="treadle-bench-redis-")
        self.proc = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", self.folder,
             "--save", "", "--appendonly", "no", "--logfile", f"{self.folder}/redis.log"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _wait_ready(self, timeout_s: float = 10.0) -> None:
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start (log in {self.folder})") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        shutil.rmtree(self.folder, ignore_errors=True)


def tier_config(tier: str, host_bytes: int, redis_url: str | None) -> dict[str, Any] | None:
    """The kv_transfer_config of a configuration; each Redis run has keys of its own, so it
    starts cold."""
    host = {"kv_connector": "OffloadingConnector",
            "kv_connector_extra_config": {"cpu_bytes_to_use": host_bytes}}
    remote = {"kv_connector": "RedisConnector", "kv_connector_extra_config": {
        "url": redis_url, "key_prefix": f"treadle:bench:{time.time_ns()}:", "ttl_s": 3600}}
    connectors = {"none": [], "host": [host], "redis": [remote], "host+redis": [host, remote]}[tier]
    if not connectors:
        return None
    if len(connectors) == 1:
        return {**connectors[0], "kv_role": "kv_both"}
    return {"kv_connector": "MultiConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": connectors}}


async def run_tier(tier: str, engine_args: dict[str, Any], kv_transfer_config: dict | None,
                   turns: list[list[list[int]]], warmup: list[int], output_len: int,
                   max_concurrency: int) -> tuple[TierResult, list[list[list[int]]]]:
    from treadle import AsyncLLM, SamplingParams

    llm = AsyncLLM(**engine_args, kv_transfer_config=kv_transfer_config)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    try:
        async for _ in llm.generate({"prompt_token_ids": warmup}, params, "warmup"):
            pass
        slots = asyncio.Semaphore(max_concurrency)
        ttft = [[0.0] * len(t) for t in turns]
        answers = [[[] for _ in t] for t in turns]
        counts = {"prompt": 0, "cached": 0, "output": 0}

        async def conversation(c: int) -> None:
            history: list[int] = []
            for t, added in enumerate(turns[c]):
                prompt = history + added
                async with slots:
                    start = time.perf_counter()
                    out = None
                    async for out in llm.generate({"prompt_token_ids": prompt}, params, f"c{c}t{t}"):
                        if not ttft[c][t]:
                            ttft[c][t] = time.perf_counter() - start
                assert out is not None
                answers[c][t] = list(out.outputs[0].token_ids)
                counts["prompt"] += len(prompt)
                counts["cached"] += out.num_cached_tokens
                counts["output"] += len(answers[c][t])
                history = prompt + answers[c][t]

        start = time.perf_counter()
        await asyncio.gather(*(conversation(c) for c in range(len(turns))))
        elapsed = time.perf_counter() - start
        stats = await llm.get_stats()
    finally:
        llm.shutdown()
    hits = {s.connector: s.hits - s.failed_loads for s in stats.kv_tiers}
    dropped = {s.connector: s.dropped_saves for s in stats.kv_tiers}
    return TierResult(tier, elapsed, [x for conv in ttft for x in conv], counts["prompt"],
                      counts["cached"], counts["output"], hits, dropped), answers


def plot(results: list[TierResult], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        xs = np.sort(np.asarray(r.ttft_s) * 1000)
        ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=r.tier)
    ax.set(xscale="log", xlabel="TTFT ms", ylabel="fraction of turns", title="TTFT by KV tier")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(ns: argparse.Namespace) -> int:
    from treadle.config import EngineArgs
    from treadle.entrypoints.engine_cli_args import engine_args_from
    from treadle.models.loader import load_tokenizer

    check_at_least(ns, num_conversations=1, num_turns=1, output_len=1, max_concurrency=1)
    low, high = ns.turn_len
    if not 1 <= low <= high:
        raise ValueError(f"--turn-len must be 1 <= MIN <= MAX, got {low} {high}")
    engine_args = engine_args_from(ns)
    if engine_args.pop("kv_transfer_config", None) or engine_args.pop("kv_offloading_size", None):
        raise ValueError("this bench sets the KV tiers itself: no --kv-transfer-config or "
                         "--kv-offloading-size")
    seed = engine_args.get("seed") or 0
    config = EngineArgs(**engine_args).create_config()
    block_size = config.cache.block_size
    tokenizer = load_tokenizer(config.model.model)
    work = make_workload(tokenizer, ns.num_conversations * ns.num_turns + 1, (low, high), (1, 1), seed)
    turns = [work.prompts[c * ns.num_turns:(c + 1) * ns.num_turns]
             for c in range(ns.num_conversations)]
    final_lens = [sum(len(t) for t in conv) + ns.num_turns * ns.output_len for conv in turns]
    working_blocks = sum(math.ceil(n / block_size) for n in final_lens)
    if engine_args.get("num_kv_blocks") is None:
        # The turns in flight at their longest, a block to spare each (and the one kept back).
        engine_args["num_kv_blocks"] = ns.max_concurrency * (
            math.ceil(max(final_lens) / block_size) + 1) + 1
    if engine_args.get("max_model_len") is None:
        engine_args["max_model_len"] = max(final_lens)
    block_bytes = config.cache.bytes_per_block(config.model)
    host_bytes = (int(ns.host_tier_gib * 2**30) if ns.host_tier_gib is not None
                  else working_blocks * block_bytes)

    redis_server = None
    if ns.redis_url is None and any("redis" in t for t in ns.tiers):
        redis_server = RedisProcess()
    redis_url = ns.redis_url or (redis_server.url if redis_server else None)
    results: list[TierResult] = []
    baseline: list[list[list[int]]] | None = None
    try:
        for tier in ns.tiers:
            logger.info("running the %s configuration", tier)
            result, answers = asyncio.run(run_tier(
                tier, engine_args, tier_config(tier, host_bytes, redis_url), turns,
                work.prompts[-1], ns.output_len, ns.max_concurrency))
            if tier == "none":
                baseline = answers
            if baseline is not None:
                result.agree = sum(a == b for conv, base in zip(answers, baseline)
                                   for a, b in zip(conv, base))
            results.append(result)
    finally:
        if redis_server is not None:
            redis_server.stop()

    host = machine()
    report: dict[str, Any] = {
        "command": " ".join(["treadle", *sys.argv[1:]]), "machine": host,
        "workload": {"num_conversations": ns.num_conversations, "num_turns": ns.num_turns,
                     "turn_len": [low, high], "output_len": ns.output_len,
                     "max_concurrency": ns.max_concurrency, "seed": seed,
                     "working_set_tokens": sum(final_lens), "working_set_blocks": working_blocks},
        "engine_args": engine_args, "block_size": block_size, "host_tier_bytes": host_bytes,
        "redis_url": ns.redis_url or "started for the run",
        "results": {r.tier: {**r.summary(), **asdict(r)} for r in results},
    }
    num_turns = ns.num_conversations * ns.num_turns
    out = sys.stdout
    out.write(f"{ns.num_conversations} conversations x {ns.num_turns} turns of {low}-{high} tokens "
              f"+ {ns.output_len} answer tokens, {ns.max_concurrency} turns at a time; working set "
              f"{sum(final_lens)} tokens ({working_blocks} blocks of {block_size}), device cache "
              f"{engine_args['num_kv_blocks']} blocks, host tier {host_bytes / 2**20:.0f} MiB; "
              f"{host['cpu']}, {host['cores']} cores, {host['torch_threads']} torch threads\n\n"
              "| KV tier | TTFT p50 s | TTFT p99 s | output tok/s | prompt tok/s | wall s "
              "| prompt tokens cached | blocks loaded from tiers | answers as without a tier |\n"
              "|---|---|---|---|---|---|---|---|---|\n")
    for r in results:
        s = r.summary()
        hits = ", ".join(f"{k.removesuffix('Connector')} {v}" for k, v in r.tier_hits.items()) or "-"
        agree = "-" if r.agree is None or r.tier == "none" else f"{r.agree}/{num_turns}"
        out.write(f"| {r.tier} | {s['ttft_p50_s']:.3f} | {s['ttft_p99_s']:.3f} "
                  f"| {s['output_tok_s']:.1f} | {s['prompt_tok_s']:.0f} | {r.elapsed_s:.1f} "
                  f"| {s['cached_fraction']:.0%} | {hits} | {agree} |\n")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    if ns.plot:
        plot(results, ns.plot)
    return 0
