"""treadle against vLLM's CPU build and llama.cpp, on identical token-id workloads, one engine
after another in one invocation (`make bench-peers`; the peers come from setup.sh).

Offline, per workload and dtype: output tokens/s, wall time, and how many greedy outputs agree
with treadle's fp32 ones token for token; over --offline-rounds rounds, the medians.
  - treadle and vLLM run their offline APIs, each in a process of its own (engines/);
  - llama.cpp runs `llama-server` with one slot per request, all requests sent at once to its
    native /completion endpoint (it has no offline batch API).
Serving: each server in turn, driven by `treadle bench serve` at each concurrency (TTFT, TPOT
and ITL, p50 and p99).

The same weights everywhere: treadle's HF folder of the embedded model (the GGUF dequantized)
for treadle and vLLM; GGUF files in F32 and BF16 (and the packaged Q4_1) for llama.cpp, made
from the packaged file with `llama-quantize --allow-requantize`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from treadle.bench.throughput import machine, make_workload
from treadle.models.loader import default_model_path, load_tokenizer, prepare_model

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PEERS = Path(os.environ.get("TREADLE_PEERS_DIR", Path.home() / ".cache/treadle/peers"))
# name -> (requests, prompt lengths, output lengths)
WORKLOADS = {"mixed": (64, (32, 512), (32, 256)),        # as `treadle bench throughput`
             "nano": (64, (100, 1024), (100, 512))}      # nano-vllm's shape, scaled to 2 cores
DTYPES = {"fp32": ("float32", "F32"), "bf16": ("bfloat16", "BF16")}
SERVING = {"requests_per_level": 4, "input_len": (64, 512), "output_len": (32, 128)}
SERVING_LEVELS = (1, 8, 32)   # requests in flight
LLAMA_CTX = 1600   # a slot's context: the longest prompt and output of any workload, and some


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_env() -> dict[str, str]:
    """The environment vLLM's CPU docs recommend: KV space, thread binding, tcmalloc + iomp."""
    tcmalloc = subprocess.run("ldconfig -p | grep -o '/.*libtcmalloc_minimal.so.4' | head -1",
                              shell=True, capture_output=True, text=True).stdout.strip()
    iomp = PEERS / "vllm/lib/libiomp5.so"
    preload = ":".join(p for p in (tcmalloc, str(iomp) if iomp.exists() else "") if p)
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
            "LD_PRELOAD": preload}


def llama_env() -> dict[str, str]:
    libs = [str(PEERS / "llamacpp/sonames"), os.environ.get("LD_LIBRARY_PATH", "")]
    return {**os.environ, "LD_LIBRARY_PATH": ":".join(p for p in libs if p)}


def llama_bin(name: str) -> str:
    found = sorted(PEERS.glob(f"llamacpp/**/bin/{name}")) + sorted(PEERS.glob(f"llamacpp/**/{name}"))
    executables = [p for p in found if p.is_file() and os.access(p, os.X_OK)]
    if not executables:
        raise FileNotFoundError(f"{name} not found under {PEERS}/llamacpp: run setup.sh")
    return str(executables[0])


def gguf_weights() -> dict[str, str]:
    """The embedded model as GGUF in each dtype llama.cpp runs here."""
    packaged = default_model_path()
    out = {"q4_1": packaged}
    for dtype, (_, kind) in DTYPES.items():
        path = PEERS / f"weights/smollm2-{dtype}.gguf"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run([llama_bin("llama-quantize"), "--allow-requantize", packaged,
                            str(path), kind], check=True, env=llama_env(), capture_output=True)
        out[dtype] = str(path)
    return out


# -- offline -------------------------------------------------------------------------------------
def offline_api(engine: str, hf_dir: str, dtype: str, work: Any, out_dir: Path,
                treadle_args: dict[str, Any]) -> dict[str, Any]:
    """treadle's or vLLM's offline API in a child process; returns its result JSON."""
    spec = {"model": hf_dir, "dtype": DTYPES[dtype][0], "prompts": work.prompts,
            "output_lens": work.output_lens, "treadle_args": treadle_args,
            "max_model_len": max(map(len, work.prompts)) + max(work.output_lens) + 8}
    spec_path, result_path = out_dir / "spec.json", out_dir / f"{engine}-{dtype}-result.json"
    spec_path.write_text(json.dumps(spec))
    if engine == "treadle":
        cmd, env = [sys.executable, str(HERE / "engines/treadle_offline.py")], dict(os.environ)
    else:
        cmd, env = [str(PEERS / "vllm/bin/python"), str(HERE / "engines/vllm_offline.py")], vllm_env()
    subprocess.run([*cmd, str(spec_path), str(result_path)], check=True, env=env,
                   stdout=subprocess.DEVNULL, stderr=open(out_dir / f"{engine}-{dtype}.log", "w"))
    return json.loads(result_path.read_text())


def start_llama_server(gguf: str, slots: int, port: int, log: Path) -> subprocess.Popen:
    cmd = [llama_bin("llama-server"), "-m", gguf, "--port", str(port), "-np", str(slots),
           "-c", str(slots * LLAMA_CTX), "-t", "2", "-tb", "2", "--cache-ram", "0"]
    return subprocess.Popen(cmd, env=llama_env(), stdout=open(log, "w"), stderr=subprocess.STDOUT)


def offline_llama(gguf: str, work: Any, out_dir: Path, tag: str) -> dict[str, Any]:
    import aiohttp

    port = free_port()
    server = start_llama_server(gguf, len(work.prompts), port, out_dir / f"llama-{tag}.log")
    try:
        wait_healthy(f"http://127.0.0.1:{port}", server)

        async def one(session, prompt, n):
            body = {"prompt": prompt, "n_predict": n, "ignore_eos": True, "cache_prompt": False,
                    "temperature": 0.0, "return_tokens": True}
            async with session.post(f"http://127.0.0.1:{port}/completion", json=body) as resp:
                resp.raise_for_status()
                return (await resp.json())["tokens"]

        async def run_all(prompts, lens):
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=6 * 3600)) as s:
                return await asyncio.gather(*(one(s, p, n) for p, n in zip(prompts, lens)))

        asyncio.run(run_all([work.prompts[0][:16]], [4]))   # warm-up
        start = time.perf_counter()
        token_ids = asyncio.run(run_all(work.prompts, work.output_lens))
        elapsed = time.perf_counter() - start
    finally:
        stop(server)
    return {"elapsed_s": elapsed, "output_tokens": sum(map(len, token_ids)), "token_ids": token_ids}


# -- serving -------------------------------------------------------------------------------------
def wait_healthy(base_url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{base_url} not healthy after {timeout} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_server(engine: str, dtype: str, hf_dir: str, ggufs: dict[str, str], port: int, slots: int,
                 log: Path, treadle_args: list[str]) -> subprocess.Popen:
    max_len = str(SERVING["input_len"][1] + SERVING["output_len"][1] + 8)
    if engine == "treadle":
        cmd = [str(ROOT / ".venv/bin/treadle"), "serve", hf_dir, "--port", str(port),
               "--dtype", DTYPES[dtype][0], "--max-model-len", max_len, "--no-enable-prefix-caching",
               *treadle_args]
        return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    if engine == "vllm":
        cmd = [str(PEERS / "vllm/bin/python"), "-m", "vllm.entrypoints.openai.api_server",
               "--model", hf_dir, "--port", str(port), "--dtype", DTYPES[dtype][0],
               "--max-model-len", max_len, "--no-enable-prefix-caching"]
        return subprocess.Popen(cmd, env=vllm_env(), stdout=open(log, "w"), stderr=subprocess.STDOUT)
    return start_llama_server(ggufs[dtype], slots, port, log)


def serving(engine: str, dtype: str, hf_dir: str, ggufs: dict[str, str], tokenizer_dir: str,
            out_dir: Path, treadle_args: list[str], requests_per_level: int,
            levels: tuple[int, ...] = SERVING_LEVELS, tag: str = "") -> dict[int, dict[str, Any]]:
    """One server's sweep over `levels`; its log and results are named after the engine, the
    dtype and `tag` (the round, when there are several)."""
    port = free_port()
    server = start_server(engine, dtype, hf_dir, ggufs, port, max(levels),
                          out_dir / f"serve-{engine}{tag}-{dtype}.log", treadle_args)
    results = {}
    try:
        wait_healthy(f"http://127.0.0.1:{port}", server)
        for level in levels:
            path = out_dir / f"serve-{engine}{tag}-{dtype}-c{level}.json"
            n = max(8, requests_per_level * level)
            lo, hi = SERVING["input_len"]
            olo, ohi = SERVING["output_len"]
            # A level with failed requests is still reported: its summary counts the errors.
            subprocess.run(
                [str(ROOT / ".venv/bin/treadle"), "bench", "serve",
                 "--base-url", f"http://127.0.0.1:{port}", "--tokenizer", tokenizer_dir,
                 "--num-prompts", str(n), "--max-concurrency", str(level),
                 "--input-len", f"{lo},{hi}", "--output-len", f"{olo},{ohi}",
                 "--save-result", str(path), "--no-tqdm"],
                check=False, stdout=subprocess.DEVNULL)
            results[level] = json.loads(path.read_text())
    finally:
        stop(server)
    return results


# -- the run -------------------------------------------------------------------------------------
def offline_row(results: list[dict[str, Any]], treadle: list[dict[str, Any]] | None,
                reference: list[list[int]] | None) -> dict[str, Any]:
    """One engine's offline row over its rounds: the median tok/s and wall time, each round's
    tok/s, the median of the rounds' ratios to treadle's tok/s in the same round, and the first
    round's agreement with treadle's fp32 outputs (greedy outputs repeat from round to round)."""
    tok_s = [r["output_tokens"] / r["elapsed_s"] for r in results]
    row: dict[str, Any] = {"output_tok_s": float(np.median(tok_s)),
                           "elapsed_s": float(np.median([r["elapsed_s"] for r in results])),
                           "output_tokens": results[0]["output_tokens"], "rounds_tok_s": tok_s,
                           "agree_with_treadle_fp32": agree(results[0]["token_ids"], reference)
                           if reference is not None else None}
    if treadle:
        base = [t["output_tokens"] / t["elapsed_s"] for t in treadle]
        row["vs_treadle"] = float(np.median([a / b for a, b in zip(tok_s, base)]))
    return row


def agree(token_ids: list[list[int]], reference: list[list[int]]) -> str:
    return f"{sum(a == b for a, b in zip(token_ids, reference))}/{len(reference)}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="peer-results", help="folder for logs and figures")
    parser.add_argument("--engines", default="treadle,vllm,llamacpp")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--no-serving", action="store_true", help="offline workloads only")
    parser.add_argument("--no-offline", action="store_true", help="the serving sweep only")
    parser.add_argument("--serving-dtypes", default="fp32",
                        help="dtypes of the serving sweep [default: fp32]")
    parser.add_argument("--serving-levels", default=",".join(map(str, SERVING_LEVELS)),
                        help="requests in flight at each level of the serving sweep "
                             f"[default: {','.join(map(str, SERVING_LEVELS))}]")
    parser.add_argument("--requests-per-level", type=int, default=SERVING["requests_per_level"],
                        help="requests per unit of concurrency at each level (at least 8) "
                             f"[default: {SERVING['requests_per_level']}]")
    parser.add_argument("--serving-rounds", type=int, default=1,
                        help="run the serving sweep this many times per dtype, each round "
                             "starting with the next engine, so that no engine always runs "
                             "first; rows are named 'engine #round' [default: 1]")
    parser.add_argument("--offline-rounds", type=int, default=1,
                        help="run each offline workload this many times per dtype, each round "
                             "starting with the next engine; rows give the median tok/s and the "
                             "median of the rounds' ratios to treadle, which a drift of the "
                             "machine between engines moves less than one round's [default: 1]")
    parser.add_argument("--treadle-serve-args", default="", metavar="ARGS",
                        help="more flags for `treadle serve`; write it with '=', e.g. "
                             "--treadle-serve-args=--async-scheduling")
    parser.add_argument("--treadle-offline-args", default="{}", metavar="JSON",
                        help='more engine arguments for treadle\'s offline LLM, e.g. '
                             '\'{"async_scheduling": true}\'')
    parser.add_argument("--offline-from", default=None, metavar="PEERS_JSON",
                        help="take the offline results of an earlier run (with --no-offline)")
    ns = parser.parse_args()
    for flag in ("serving_rounds", "offline_rounds"):
        if getattr(ns, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(ns, flag)}")
    engines, dtypes = ns.engines.split(","), ns.dtypes.split(",")
    treadle_offline_args = json.loads(ns.treadle_offline_args)   # a typo fails before any run
    levels = tuple(int(level) for level in ns.serving_levels.split(","))
    out_dir = Path(ns.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_dir = prepare_model(None)
    ggufs = gguf_weights() if "llamacpp" in engines else {}
    tokenizer = load_tokenizer(hf_dir)
    report: dict[str, Any] = {"machine": machine(), "command": " ".join(sys.argv),
                              "offline": {}, "serving": {}}
    if ns.offline_from:
        earlier = json.loads(Path(ns.offline_from).read_text())
        report["offline"], report["offline_machine"] = earlier["offline"], earlier["machine"]

    if not ns.no_offline:
        for wname in ns.workloads.split(","):
            num, in_range, out_range = WORKLOADS[wname]
            work = make_workload(tokenizer, num, in_range, out_range, seed=0)
            reference = None
            for dtype in ["fp32"] + [d for d in dtypes if d != "fp32"]:
                runs: dict[str, list[dict[str, Any]]] = {engine: [] for engine in engines}
                for round_no in range(ns.offline_rounds):
                    first = round_no % len(engines)
                    for engine in engines[first:] + engines[:first]:
                        if engine == "llamacpp":
                            res = offline_llama(ggufs[dtype], work, out_dir, f"{wname}-{dtype}")
                        else:
                            res = offline_api(engine, hf_dir, dtype, work, out_dir, treadle_offline_args)
                        runs[engine].append(res)
                        print(f"{wname} {dtype} {engine} round {round_no + 1}: "
                              f"{res['output_tokens'] / res['elapsed_s']:.1f} tok/s", flush=True)
                if "treadle" in runs and dtype == "fp32":
                    reference = runs["treadle"][0]["token_ids"]
                for engine, results in runs.items():
                    row = offline_row(results, runs.get("treadle"), reference)
                    report["offline"].setdefault(wname, {}).setdefault(dtype, {})[engine] = row
                    print(f"{wname} {dtype} {engine}: {row}", flush=True)
                save(report, out_dir)

    if not ns.no_serving:
        for dtype in ns.serving_dtypes.split(","):
            for round_no in range(1, ns.serving_rounds + 1):
                first = (round_no - 1) % len(engines)
                for engine in engines[first:] + engines[:first]:
                    name = engine if ns.serving_rounds == 1 else f"{engine} #{round_no}"
                    tag = "" if ns.serving_rounds == 1 else f"-r{round_no}"
                    report["serving"].setdefault(dtype, {})[name] = serving(
                        engine, dtype, hf_dir, ggufs, hf_dir, out_dir,
                        shlex.split(ns.treadle_serve_args), ns.requests_per_level, levels, tag)
                    print(f"serving {dtype} {name} done", flush=True)
                    save(report, out_dir)

    save(report, out_dir)
    plot(report, out_dir / "peers.png")
    print(markdown(report))
    return 0


def save(report: dict[str, Any], out_dir: Path) -> None:
    """Written after every result, so that a failure late in a long run keeps the rest."""
    (out_dir / "peers.json").write_text(json.dumps(report, indent=2, default=str))
    (out_dir / "peers.md").write_text(markdown(report))


def markdown(report: dict[str, Any]) -> str:
    host = report["machine"]
    lines = [f"{host['cpu']}, {host['cores']} cores, {host['date']}", ""]
    if report["offline"]:
        lines += ["| workload | dtype | engine | output tok/s | s | vs treadle | agree with treadle fp32 "
                  "| tok/s by round |", "|---|---|---|---|---|---|---|---|"]
        for wname, by_dtype in report["offline"].items():
            for dtype, by_engine in by_dtype.items():
                base = by_engine.get("treadle", {}).get("output_tok_s")
                for engine, r in by_engine.items():
                    # rows of runs before --offline-rounds have no vs_treadle
                    vs = r.get("vs_treadle", r["output_tok_s"] / base if base else None)
                    ratio = f"{vs:.2f}x" if vs is not None else ""
                    rounds = ", ".join(f"{v:.1f}" for v in r.get("rounds_tok_s", [r["output_tok_s"]]))
                    lines.append(f"| {wname} | {dtype} | {engine} | {r['output_tok_s']:.1f} | "
                                 f"{r['elapsed_s']:.1f} | {ratio} | {r['agree_with_treadle_fp32']} | {rounds} |")
        lines.append("")
    if report["serving"]:
        lines += ["| dtype | engine | concurrency | output tok/s | TTFT p50 / p99 ms | "
                  "TPOT p50 / p99 ms | ITL p50 / p99 ms | errors |", "|---|---|---|---|---|---|---|---|"]
        for dtype, by_engine in report["serving"].items():
            for engine, levels in by_engine.items():
                for level, s in levels.items():
                    summary = s.get("summary", s)
                    cell = lambda k: f"{summary[k]['median_ms']:.0f} / {summary[k]['p99_ms']:.0f}"  # noqa: E731
                    lines.append(f"| {dtype} | {engine} | {level} | "
                                 f"{summary['output_throughput']:.1f} | {cell('ttft')} | "
                                 f"{cell('tpot')} | {cell('itl')} | {summary['errors']} |")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("offline", None)] if report["offline"] else []
    panels += [("serving", d) for d in report["serving"]]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (kind, dtype) in zip(axes[0], panels):
        if kind == "offline":
            labels, series = [], {}
            for wname, by_dtype in report["offline"].items():
                for d, by_engine in by_dtype.items():
                    labels.append(f"{wname}\n{d}")
                    for engine, r in by_engine.items():
                        series.setdefault(engine, []).append(r["output_tok_s"])
            x = np.arange(len(labels))
            width = 0.8 / max(len(series), 1)
            for i, (engine, values) in enumerate(series.items()):
                ax.bar(x + i * width, values, width, label=engine)
            ax.set_xticks(x + width * (len(series) - 1) / 2, labels)
            ax.set_ylabel("output tokens/s")
            ax.set_title("offline")
        else:
            for engine, levels in report["serving"][dtype].items():
                xs = [int(k) for k in levels]
                ys = [levels[k].get("summary", levels[k])["tpot"]["median_ms"] for k in levels]
                ax.plot(xs, ys, marker="o", label=engine)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.set_ylabel("TPOT p50, ms")
            ax.set_title(f"serving, {dtype}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
