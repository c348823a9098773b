"""Would a decode step gain from running attention on one core while the other runs linears?

A decode step of B sequences is the attention (bound by K/V reads) and then the linears (bound
by multiply-adds), each on both cores. Split into two halves of B/2 whose layers take turns,
each core could run one half's attention beside the other half's linears ("two-batch
overlap"). This measures the parts that decide it, each in a process of its own pinned to a
core, with one thread:

  - attention and linears over B rows on two threads, one after the other (the step today);
  - attention and linears over B/2 rows on one thread, alone, then side by side on the two
    cores (the overlapped step: each core's attention plus its linears);
  - two attentions over B/2 side by side (the kernel's rate without its shared work queue).

    .venv/bin/python benchmarks/core_overlap.py [--batch 64] [--context 640] [--seconds 8]

SmolLM2-135M's shape in fp32: 30 layers; attention as decode_attention.py sets it up (9
query heads on 3 KV heads of 64, 128-token blocks in a random order); the four linears on
AVX-512 panels, as linears.py, without the LM head. Time nothing else while it runs: the machine has two cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from decode_attention import attention_pass, kv_bytes   # beside this file

LAYERS = 30
LINEARS = ((960, 576), (576, 576), (3072, 576), (576, 1536))   # qkv, o, gate_up, down


def one_part(part: str, rows: int, context: int, seconds: float) -> float:
    """Median ms of one pass of `part` over the layers, on this process's threads."""
    from treadle.kernels.cpu import cpu_kernels_available
    from treadle.models import linear
    from treadle.worker.malloc import keep_freed_memory

    if not cpu_kernels_available(torch.device("cpu")):
        raise SystemExit("the CPU kernels are not built here (python -m treadle.kernels)")
    keep_freed_memory()
    torch.manual_seed(0)
    if part == "attention":
        one_pass, _ = attention_pass(rows, context, torch.float32, LAYERS)
    else:
        weights = [[linear.pack_tiles(torch.randn(o, i) / i ** 0.5) for o, i in LINEARS] for _ in range(LAYERS)]
        if weights[0][0] is None:
            raise SystemExit("this CPU has no fp32 panels (AVX-512)")
        inputs = [torch.randn(rows, i) for _, i in LINEARS]

        def one_pass() -> None:
            for layer in weights:
                for x, w in zip(inputs, layer):
                    torch.ops.treadle.tiles_linear(x, w, None)

    with torch.inference_mode():
        for _ in range(2):
            one_pass()
        times, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            start = time.perf_counter()
            one_pass()
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def run(jobs: list[tuple[str, int, int, int | None]], context: int, seconds: float) -> list[float]:
    """Runs (part, rows, threads, cpu or None) jobs side by side, each in its own process."""
    procs = []
    for part, rows, threads, cpu in jobs:
        cmd = [sys.executable, __file__, "--part", part, "--batch", str(rows), "--context", str(context),
               "--seconds", str(seconds)]
        if cpu is not None:
            cmd = ["taskset", "-c", str(cpu)] + cmd
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        stdout, _ = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"a part failed (exit {proc.returncode})")
        results.append(float(stdout.split()[-1]))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="sequences decoding (even)")
    parser.add_argument("--context", type=int, default=640)
    parser.add_argument("--seconds", type=float, default=8.0, help="per measurement")
    parser.add_argument("--part", choices=("attention", "linears"), help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.part:   # one measurement, in a process of its own
        print(f"{one_part(ns.part, ns.batch, ns.context, ns.seconds):.2f}")
        return
    if ns.batch < 2 or ns.batch % 2:
        parser.error(f"--batch must be even and at least 2, got {ns.batch}")
    b, half, ctx, s = ns.batch, ns.batch // 2, ns.context, ns.seconds
    (attn,) = run([("attention", b, 2, None)], ctx, s)
    (lin,) = run([("linears", b, 2, None)], ctx, s)
    (attn_1,) = run([("attention", half, 1, 0)], ctx, s)
    (lin_1,) = run([("linears", half, 1, 1)], ctx, s)
    attn_beside, lin_beside = run([("attention", half, 1, 0), ("linears", half, 1, 1)], ctx, s)
    attn_pair = max(run([("attention", half, 1, 0), ("attention", half, 1, 1)], ctx, s))
    kv = kv_bytes(b, ctx, LAYERS, 4)   # fp32
    print(f"fp32, {b} sequences at {ctx} tokens, {LAYERS} layers, ms per pass (K/V GB/s)\n")
    print("| part | ms |\n|---|---|")
    print(f"| attention, {b} rows, 2 threads | {attn:.1f} ({kv / attn / 1e6:.1f}) |")
    print(f"| linears, {b} rows, 2 threads | {lin:.1f} |")
    print(f"| attention, {half} rows, 1 thread, alone | {attn_1:.1f} ({kv / 2 / attn_1 / 1e6:.1f}) |")
    print(f"| linears, {half} rows, 1 thread, alone | {lin_1:.1f} |")
    print(f"| attention, {half} rows, 1 thread, beside the linears | {attn_beside:.1f} |")
    print(f"| linears, {half} rows, 1 thread, beside the attention | {lin_beside:.1f} |")
    print(f"| two attentions of {half} rows side by side (the slower) | {attn_pair:.1f} "
          f"({kv / attn_pair / 1e6:.1f}) |")
    serial, overlapped = attn + lin, attn_beside + lin_beside
    print(f"\nstep today (attention then linears, 2 threads): {serial:.1f} ms; overlapped, each core "
          f"one half's attention and linears: {overlapped:.1f} ms ({serial / overlapped:.2f}x), before "
          "the hand-offs between the halves")


if __name__ == "__main__":
    main()
