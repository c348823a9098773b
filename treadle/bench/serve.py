"""Drive a running OpenAI-compatible server over HTTP with streaming completions and measure
it, with the definitions the common serving benchmarks use:
  - TTFT: request sent -> first chunk with non-empty `choices`;
  - ITL: gaps between later chunks that carry tokens;
  - TPOT: (latency - TTFT) / (output tokens - 1), per request;
  - E2E latency, request throughput, output and total token throughput, errors.
Prompts are random ordinary token ids sent as token-id prompts (exact lengths), each asking for
exactly its output length (ignore_eos, greedy). Arrivals are Poisson at --request-rate
(inf: all at once), optionally capped at --max-concurrency requests in flight."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from treadle.bench.throughput import _range, machine, make_workload

logger = logging.getLogger(__name__)


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int = 0
    sent: float = 0.0                 # seconds since the benchmark started
    ttft: float | None = None
    latency: float | None = None
    token_times: list[float] = field(default_factory=list)   # arrival of each token-carrying chunk
    error: str | None = None

    @property
    def itls(self) -> list[float]:
        return list(np.diff(self.token_times)) if len(self.token_times) > 1 else []

    @property
    def tpot(self) -> float | None:
        if self.latency is None or self.ttft is None or self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("target")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root [default: %(default)s]")
    g.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    g.add_argument("--api-key", default=None, help="sent as a bearer token")
    g.add_argument("--tokenizer", default=None,
                   help="folder or GGUF whose tokenizer picks prompt tokens (default: the embedded model)")
    g = parser.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=100, help="[default: 100]")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals; inf sends all at once [default: inf]")
    g.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    g.add_argument("--input-len", type=_range, default=(128, 128), metavar="N or MIN,MAX",
                   help="prompt tokens [default: 128]")
    g.add_argument("--output-len", type=_range, default=(64, 64), metavar="N or MIN,MAX",
                   help="output tokens [default: 64]")
    g.add_argument("--seed", type=int, default=0)
    g = parser.add_argument_group("output")
    g.add_argument("--save-result", default=None, metavar="PATH", help="save figures as JSON")
    g.add_argument("--plot", default=None, metavar="PATH.png",
                   help="TTFT/TPOT CDFs and output throughput over time (matplotlib)")
    g.add_argument("--no-tqdm", action="store_true", help="no progress bar")


async def _one_request(session: Any, url: str, model: str, prompt: list[int], output_len: int,
                       headers: dict[str, str], start: float) -> RequestResult:
    import aiohttp

    result = RequestResult(prompt_len=len(prompt))
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    result.sent = sent - start
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if chunk.get("choices"):
                    if result.ttft is None:
                        result.ttft = now - sent
                    result.token_times.append(now - start)
                if chunk.get("usage"):
                    result.output_len = chunk["usage"]["completion_tokens"]
            result.latency = time.perf_counter() - sent
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    if result.error is None and result.output_len != output_len:
        result.error = f"asked for {output_len} tokens, got {result.output_len}"
    return result


async def run(base_url: str, model: str | None, api_key: str | None, prompts: list[list[int]],
              output_lens: list[int], request_rate: float, max_concurrency: int | None,
              seed: int, use_tqdm: bool) -> tuple[list[RequestResult], float, str]:
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    # A connection per request: a server closing a kept-alive connection just as the next
    # request reuses it fails that request (llama-server, 9 of 64 at concurrency 32; still 1
    # with idle connections dropped after 1 s). A local connect costs well under a millisecond.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        if model is None:
            async with session.get(f"{base_url}/v1/models", headers=headers) as resp:
                resp.raise_for_status()
                model = (await resp.json())["data"][0]["id"]
        url = f"{base_url}/v1/completions"
        limit = asyncio.Semaphore(max_concurrency or len(prompts))
        rng = np.random.default_rng(seed)
        bar = tqdm(total=len(prompts), desc="requests", disable=not use_tqdm, dynamic_ncols=True)
        start = time.perf_counter()

        async def limited(prompt: list[int], n: int) -> RequestResult:
            async with limit:
                out = await _one_request(session, url, model, prompt, n, headers, start)
            bar.update(1)
            return out

        tasks = []
        for prompt, n in zip(prompts, output_lens):
            tasks.append(asyncio.create_task(limited(prompt, n)))
            if math.isfinite(request_rate):
                await asyncio.sleep(rng.exponential(1.0 / request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return list(results), duration, model


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean_ms": float("nan"), "median_ms": float("nan"), "p99_ms": float("nan"),
                "max_ms": float("nan")}
    a = np.asarray(values) * 1000
    return {"mean_ms": float(a.mean()), "median_ms": float(np.median(a)),
            "p99_ms": float(np.percentile(a, 99)), "max_ms": float(a.max())}


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    return {
        "completed": len(ok), "errors": len(results) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "input_tokens": in_tokens, "output_tokens": out_tokens,
        "ttft": _stats([r.ttft for r in ok if r.ttft is not None]),
        "tpot": _stats([r.tpot for r in ok if r.tpot is not None]),
        "itl": _stats([x for r in ok for x in r.itls]),
        "e2e_latency": _stats([r.latency for r in ok if r.latency is not None]),
        "error_samples": sorted({r.error for r in results if r.error})[:5],
    }


def plot(results: list[RequestResult], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.error is None]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, values in (("TTFT", [r.ttft for r in ok if r.ttft is not None]),
                         ("TPOT", [r.tpot for r in ok if r.tpot is not None])):
        if values:
            xs = np.sort(np.asarray(values) * 1000)
            ax1.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=name)
    ax1.set(xlabel="ms", ylabel="fraction of requests", title="latency CDF")
    ax1.legend()
    times = np.asarray([t for r in ok for t in r.token_times])
    if len(times):
        bins = np.arange(0, math.ceil(times.max()) + 1)
        counts, edges = np.histogram(times, bins=bins)
        ax2.plot(edges[:-1], counts)
    ax2.set(xlabel="seconds since start", ylabel="token chunks per second", title="output throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(ns: argparse.Namespace) -> int:
    from treadle.models.loader import load_tokenizer, prepare_model

    if ns.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {ns.num_prompts}")
    if not ns.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {ns.request_rate}")
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {ns.max_concurrency}")
    tokenizer = load_tokenizer(prepare_model(ns.tokenizer))
    work = make_workload(tokenizer, ns.num_prompts, ns.input_len, ns.output_len, ns.seed)
    host = machine()
    results, duration, model = asyncio.run(run(
        ns.base_url.rstrip("/"), ns.model, ns.api_key, work.prompts, work.output_lens,
        ns.request_rate, ns.max_concurrency, ns.seed, not ns.no_tqdm))
    summary = summarize(results, duration)
    out = sys.stdout
    out.write(f"model {model} at {ns.base_url}: {ns.num_prompts} requests, input {list(ns.input_len)}, "
              f"output {list(ns.output_len)}, rate {ns.request_rate}, max concurrency "
              f"{ns.max_concurrency}\n")
    out.write(f"completed {summary['completed']}, errors {summary['errors']}, "
              f"duration {duration:.2f} s\n")
    out.write(f"request throughput {summary['request_throughput']:.3f} req/s, output "
              f"{summary['output_throughput']:.1f} tok/s, total {summary['total_token_throughput']:.1f} tok/s\n")
    out.write("| metric | mean ms | median ms | p99 ms | max ms |\n|---|---|---|---|---|\n")
    for name in ("ttft", "tpot", "itl", "e2e_latency"):
        s = summary[name]
        out.write(f"| {name} | {s['mean_ms']:.1f} | {s['median_ms']:.1f} | {s['p99_ms']:.1f} | {s['max_ms']:.1f} |\n")
    for err in summary["error_samples"]:
        out.write(f"error: {err}\n")
    if ns.save_result:
        with open(ns.save_result, "w") as f:
            json.dump({"command": " ".join(["treadle", *sys.argv[1:]]), "machine": host,
                       "base_url": ns.base_url, "model": model,
                       "workload": {"num_prompts": ns.num_prompts, "input_len": list(ns.input_len),
                                    "output_len": list(ns.output_len), "request_rate": ns.request_rate,
                                    "max_concurrency": ns.max_concurrency, "seed": ns.seed},
                       "summary": summary, "requests": [asdict(r) for r in results]}, f, indent=1)
    if ns.plot:
        plot(results, ns.plot)
    return 0 if summary["errors"] == 0 else 1
