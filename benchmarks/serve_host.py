"""The server's own time per streamed token: `treadle serve` on a model too small to cost
anything (Qwen3's architecture at hidden size 64, on the CPU), driven by `treadle bench serve`,
and the CPU time of the server's main thread (its event loop: HTTP, output processing, the SSE
chunks) over the run, from /proc. On a GPU, where a step is short, this is what bounds a
server's tokens per second at high concurrency (docs/performance.md, "On a GPU").

    python benchmarks/serve_host.py [--concurrency 64] [--output-len 256] [--rounds 1] [--no-engine-process]

Linux only (/proc/PID/task). Prints, per round, output tokens/s, TPOT p50/p99 and ITL p50/p99/max (ITL
is between events, and a server that lags sends several tokens in one) and the main thread's
and the whole server's CPU microseconds per output token.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile

import psutil
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.gpu.workloads import TINY, build_model, cpu_seconds  # noqa: E402
from benchmarks.peers.run import free_port, stop, wait_healthy  # noqa: E402
from treadle.bench.serve import run as drive  # noqa: E402
from treadle.bench.serve import summarize  # noqa: E402
from treadle.bench.throughput import make_workload  # noqa: E402
from treadle.models.loader import load_tokenizer  # noqa: E402


def one_round(path: str, ns: argparse.Namespace) -> dict[str, float]:
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "treadle.entrypoints.cli", "serve", path, "--host", "127.0.0.1",
             "--port", str(port), "--device", "cpu", "--dtype", "float32", "--max-num-seqs", "256",
             "--max-model-len", str(128 + ns.output_len + 16),
             "--engine-process" if ns.engine_process else "--no-engine-process"],
            stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_healthy(base, server, timeout=150)
            main_stat, whole_stat = f"/proc/{server.pid}/task/{server.pid}/stat", f"/proc/{server.pid}/stat"
            work = make_workload(load_tokenizer(path), 2 * ns.concurrency, (128, 128),
                                 (ns.output_len, ns.output_len), seed=0)
            # The engine core's process counts as the server's too.
            stats = [whole_stat] + [f"/proc/{c.pid}/stat" for c in psutil.Process(server.pid).children()]
            main0, whole0 = cpu_seconds(main_stat), sum(map(cpu_seconds, stats))
            done, seconds, _ = asyncio.run(drive(base, None, None, work.prompts, work.output_lens,
                                                 float("inf"), ns.concurrency, 0, False))
            main1, whole1 = cpu_seconds(main_stat), sum(map(cpu_seconds, stats))
        finally:
            stop(server)
    summary = summarize(done, seconds)
    tokens = summary["output_tokens"]
    assert summary["errors"] == 0, summary
    return {"output_tok_s": summary["output_throughput"], "tpot_p50_ms": summary["tpot"]["median_ms"],
            "tpot_p99_ms": summary["tpot"]["p99_ms"], "itl_p50_ms": summary["itl"]["median_ms"],
            "itl_max_ms": summary["itl"]["max_ms"],
            "itl_p99_ms": summary["itl"]["p99_ms"], "main_us_per_token": (main1 - main0) / tokens * 1e6,
            "server_us_per_token": (whole1 - whole0) / tokens * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                        help="the engine core in a process of its own, as `treadle serve` runs "
                             "it by default; --no-engine-process: on a thread of the server's")
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = build_model("Qwen3", dict(TINY, vocab_size=2048), folder, torch.float32)
        for i in range(ns.rounds):
            r = one_round(path, ns)
            print(f"round {i + 1}: {r['output_tok_s']:.0f} output tok/s, TPOT p50/p99 "
                  f"{r['tpot_p50_ms']:.1f}/{r['tpot_p99_ms']:.1f} ms, ITL p50/p99/max "
                  f"{r['itl_p50_ms']:.1f}/{r['itl_p99_ms']:.1f}/{r['itl_max_ms']:.0f} ms; CPU per output token: main "
                  f"thread {r['main_us_per_token']:.1f} us, whole server {r['server_us_per_token']:.1f} us",
                  flush=True)


if __name__ == "__main__":
    main()
