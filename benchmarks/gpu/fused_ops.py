"""Issue 45's choice for the decoder's elementwise ops on a GPU: the model's eager torch path,
the same functions through torch.compile, and the Triton kernels (treadle/models/triton_ops.py),
timed at Qwen3-0.6B's shapes (hidden 1024, intermediate 3072, 16 q heads and 8 KV heads of 128)
for 1, 64 and 512 tokens in bf16. Each Triton result is checked against eager first.

    python benchmarks/gpu/fused_ops.py --out DIR            # on the GPU (check.sh runs it)
    python benchmarks/gpu/fused_ops.py --device cpu --impls eager,triton --tokens 1,8 --out /tmp/f
                                                           # a dry run here, interpreted

Each is timed per call launched from Python (what an eager step pays, launch costs included)
and, on a GPU, replayed in a CUDA graph (what a decode step's graph pays: the kernels alone).
Writes DIR/fused_ops.json after every op (a run cut short keeps what it timed) and logs one
line last: per op, the fastest implementation summed over the token counts, by each timing,
and its speed-up over eager. No torch.compile starts once --budget-s is spent, so the script ends inside
check.sh's limit; an entry skipped so says so, and the last line names what was left out.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

logger = logging.getLogger("fused_ops")

HIDDEN, INTERMEDIATE, Q_HEADS, KV_HEADS, HEAD_DIM, EPS = 1024, 3072, 16, 8, 128, 1e-6
VOCAB = 151936
IMPLS = ("eager", "compile", "triton")
# A Triton output further than this from eager's (|diff| / (|eager| + 1)) is wrong, not
# rounded otherwise: a bf16 ulp is 2**-7 of the value at most.
MAX_ERR = 2e-2


def make_ops(device: torch.device, dtype: torch.dtype) -> dict[str, tuple]:
    """name -> (inputs(tokens), eager, triton[, options]): eager is the model's own torch path
    (for the few-row linears, the triton backend's path today), triton the op meant to replace
    it; both take inputs(tokens)'s tuple. options: "max_tokens" (the op is timed up to it) and
    "compile" (False: no torch.compile entry)."""
    from treadle.attention.backend import KVTarget
    from treadle.attention.triton_kv_write import write_kv
    from treadle.models import triton_gemv, triton_ops
    from treadle.models.llama import RMSNorm
    from treadle.models.rope import RotaryEmbedding, apply_rope

    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    norm = RMSNorm(HIDDEN, EPS).to(device=device, dtype=dtype)
    head_norm = RMSNorm(HEAD_DIM, EPS).to(device=device, dtype=dtype)
    rotary = RotaryEmbedding(SimpleNamespace(rope_theta=1e6), HEAD_DIM, 4096).to(device)
    qkv_width = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM

    def qkv_views(tokens: int) -> tuple[torch.Tensor, ...]:
        qkv = randn(tokens, qkv_width)
        q = qkv[:, :Q_HEADS * HEAD_DIM].view(tokens, Q_HEADS, HEAD_DIM)
        k = qkv[:, Q_HEADS * HEAD_DIM:(Q_HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
        cos, sin = rotary(torch.randint(0, 4096, (tokens,), generator=gen).to(device), dtype)
        return q, k, cos, sin

    def eager_silu(gate_up: torch.Tensor) -> torch.Tensor:   # MLP.forward's
        gate, up = gate_up.split(INTERMEDIATE, dim=-1)
        return nn.functional.silu(gate) * up

    def eager_rope(q, k, cos, sin):   # Attention.forward's, with q/k norms (Qwen3)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def triton_rope(q, k, cos, sin):
        triton_ops.rope_(q, k, cos, sin)
        return q, k

    def kv_inputs(tokens: int) -> tuple[torch.Tensor, ...]:
        """qkv_views's, with v, a layer's paged cache (blocks of 16) and a slot per token."""
        q, k, cos, sin = qkv_views(tokens)
        v = randn(tokens, KV_HEADS, HEAD_DIM)
        cache = torch.zeros(2, -(-tokens // 16) + 1, 16, KV_HEADS, HEAD_DIM, dtype=dtype,
                            device=device)
        slots = torch.randperm(cache.shape[1] * 16, generator=gen)[:tokens].to(device, torch.int32)
        return q, k, cos, sin, v, cache, slots

    def eager_write_kv(k, v, cache, slots):   # as the torch backend writes them
        cache[0].view(-1, KV_HEADS, HEAD_DIM)[slots] = k
        cache[1].view(-1, KV_HEADS, HEAD_DIM)[slots] = v
        return cache

    def eager_qk_norm_rope_kv(q, k, cos, sin, v, cache, slots):
        q, k = eager_rope(head_norm(q), head_norm(k), cos, sin)
        return q, k, eager_write_kv(k, v, cache, slots)

    def triton_qk_norm_rope_kv(q, k, cos, sin, v, cache, slots):
        q, k = triton_ops.qk_norm_rope(q, k, head_norm.weight, head_norm.weight, EPS, cos, sin,
                                       (v, KVTarget(cache[0], cache[1], slots)))
        return q, k, cache

    # Few-row linears with the op before them in one launch (models/triton_gemv.py), against
    # what the triton backend's path runs today: the Triton norm or activation, then torch's
    # linear (cuBLAS). Only at a few rows (GEMV_TOKENS).
    def weight(n: int, k: int) -> torch.Tensor:
        if device.type != "cuda":   # interpreted, a dry run: a slice of the outputs
            n = min(n, 32)
        return (torch.randn(n, k, generator=gen) * k ** -0.5).to(device=device, dtype=dtype)

    w_qkv, w_gate_up = weight(qkv_width, HIDDEN), weight(2 * INTERMEDIATE, HIDDEN)
    w_o, w_down = weight(HIDDEN, Q_HEADS * HEAD_DIM), weight(HIDDEN, INTERMEDIATE)
    w_head = weight(VOCAB, HIDDEN)

    def add_norm_linear(w: torch.Tensor) -> tuple[Callable, Callable, Callable]:
        def today(x, r):
            x, r = triton_ops.fused_add_rms_norm(x, r, norm.weight, EPS)
            return nn.functional.linear(x, w), r

        return ((lambda t: (randn(t, HIDDEN), randn(t, HIDDEN))), today,
                lambda x, r: triton_gemv.add_norm_gemv(x, r, norm.weight, EPS, w))

    def linear(w: torch.Tensor) -> tuple[Callable, Callable, Callable]:
        return ((lambda t: (randn(t, w.shape[1]),)), lambda x: nn.functional.linear(x, w),
                lambda x: triton_gemv.gemv(x, w))

    gemv_ops = {
        "add_norm_qkv": add_norm_linear(w_qkv),
        "add_norm_gate_up": add_norm_linear(w_gate_up),
        "silu_mul_down": ((lambda t: (randn(t, 2 * INTERMEDIATE),)),
                          lambda gu: nn.functional.linear(triton_ops.silu_and_mul(gu), w_down),
                          lambda gu: triton_gemv.silu_mul_gemv(gu, w_down)),
        "linear_o": linear(w_o),
        "linear_head": linear(w_head),
    }
    return {
        "rms_norm": (lambda t: (randn(t, HIDDEN),), norm,
                     lambda x: triton_ops.rms_norm(x, norm.weight, EPS)),
        "add_rms_norm": (lambda t: (randn(t, HIDDEN), randn(t, HIDDEN)), norm.add_and_norm,
                         lambda x, r: triton_ops.fused_add_rms_norm(x, r, norm.weight, EPS)[::-1]),
        "qk_head_norm": (lambda t: qkv_views(t)[:1], head_norm,
                         lambda q: triton_ops.rms_norm(q, head_norm.weight, EPS)),
        "silu_and_mul": (lambda t: (randn(t, 2 * INTERMEDIATE),), eager_silu,
                         triton_ops.silu_and_mul),
        "rope": (qkv_views, eager_rope, triton_rope),
        # Qwen3's q/k head norms then RoPE; Triton's in one launch where the above take three
        "qk_norm_rope": (qkv_views,
                         lambda q, k, cos, sin: eager_rope(head_norm(q), head_norm(k), cos, sin),
                         lambda q, k, cos, sin: triton_ops.qk_norm_rope(
                             q, k, head_norm.weight, head_norm.weight, EPS, cos, sin)),
        # The attention backend's K/V write (attention/triton_kv_write.py), and the same
        # written by qk_norm_rope's launch: what the fused write saves is this op's time
        # and qk_norm_rope's, less qk_norm_rope_kv's.
        "write_kv": (lambda t: kv_inputs(t)[4:] + (randn(t, KV_HEADS, HEAD_DIM),),
                     lambda v, cache, slots, k: eager_write_kv(k, v, cache, slots),
                     lambda v, cache, slots, k: (write_kv(k, v, cache[0], cache[1], slots), cache)[1]),
        "qk_norm_rope_kv": (kv_inputs, eager_qk_norm_rope_kv, triton_qk_norm_rope_kv),
        # last: torch.compile's budget is spent on the ops above first
        **{name: op + ({"max_tokens": triton_gemv.MAX_ROWS, "compile": False},)
           for name, op in gemv_ops.items()},
    }


def time_us(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median microseconds per call over five rounds of back-to-back calls: what a step pays
    without CUDA graphs, launch costs included."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    rounds = []
    for _ in range(5):
        sync()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        rounds.append((time.perf_counter() - start) / reps * 1e6)
    return statistics.median(rounds)


def graphed_us(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median microseconds per call replaying `reps` calls captured in one CUDA graph: the
    kernels' own time, as a decode step's graph runs them (worker/cuda_graphs.py)."""
    side = torch.cuda.Stream(device)   # warm-up off the capture stream, as torch asks
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return time_us(graph.replay, device, 10) / reps


def max_error(got, want) -> float:
    """Largest |got - want| / (|want| + 1) over the outputs."""
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    return max(((g.float() - w.float()).abs() / (w.float().abs() + 1)).max().item()
               for g, w in zip(got, want))


def run_op(name: str, op: tuple, ns: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """One op at every token count: the Triton output against eager's, then each
    implementation's time per call launched from Python and, on a GPU, replayed in a CUDA
    graph (a failed capture is written, not raised); torch.compile is skipped past `deadline`."""
    inputs, eager, triton_fn = op[:3]
    options = op[3] if len(op) > 3 else {}
    fns = {"eager": eager, "triton": triton_fn}
    impls = [i for i in IMPLS if i in ns.impls and (i != "compile" or options.get("compile", True))]
    if "compile" in impls:
        # Shapes as the model's: static for one token, then one dynamic graph for the rest.
        fns["compile"] = torch.compile(eager)
    result: dict[str, Any] = {}
    for tokens in ns.tokens:
        if tokens > options.get("max_tokens", tokens):
            continue
        args = inputs(tokens)
        # In-place ops get fresh copies for the check, and the same buffers while timed.
        fresh = lambda: tuple(a.clone() for a in args)  # noqa: E731
        row: dict[str, Any] = {"max_err_triton": max_error(triton_fn(*fresh()), eager(*fresh()))}
        if row["max_err_triton"] > MAX_ERR:
            raise ValueError(f"{name} at {tokens} tokens: Triton is {row['max_err_triton']:.3g} "
                             "from eager")
        for impl in impls:
            if impl == "compile" and time.perf_counter() > deadline:
                row["compile_us"] = "skipped: out of time"
                continue
            call = functools.partial(fns[impl], *args)
            row[f"{impl}_us"] = time_us(call, ns.device, ns.reps)
            if ns.device.type == "cuda":
                try:
                    row[f"{impl}_graph_us"] = graphed_us(call, ns.device, ns.reps)
                except Exception as exc:   # the launched time stands; say why this one is missing
                    row[f"{impl}_graph_us"] = f"failed: {exc!r}"[:300]
        result[str(tokens)] = row
        logger.info("%s at %d tokens: %s", name, tokens, row)
    return result


def choice(result: dict[str, Any], impls: list[str], suffix: str) -> str:
    """The implementation fastest over all token counts by the times `{impl}{suffix}`, its
    speed-up over eager, and those left out of the race (a compile skipped at some size)."""
    if not result:
        return "not timed at these token counts"
    totals = {}
    for impl in impls:
        times = [row.get(f"{impl}{suffix}") for row in result.values()]
        if all(isinstance(t, float) for t in times):
            totals[impl] = sum(times)
    if "eager" not in totals:
        return "no eager time"
    best = min(totals, key=totals.get)
    missing = [impl for impl in impls if impl not in totals]
    return (f"{best} {totals['eager'] / totals[best]:.2f}x"
            + (f" ({', '.join(missing)} skipped)" if missing else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "./gpu-results"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", default="1,64,512", type=lambda s: [int(t) for t in s.split(",")])
    parser.add_argument("--impls", default=",".join(IMPLS), type=lambda s: s.split(","))
    parser.add_argument("--reps", type=int, default=100, help="calls per timed round")
    parser.add_argument("--budget-s", type=float, default=25.0,
                        help="no torch.compile starts past this many seconds from the start")
    ns = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ns.device = torch.device(ns.device)
    if ns.device.type == "cpu":   # before triton_ops is imported: its kernels are defined then
        os.environ["TRITON_INTERPRET"] = "1"
    deadline = time.perf_counter() + ns.budget_s
    os.makedirs(ns.out, exist_ok=True)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(ns.device) if ns.device.type == "cuda" else "cpu",
        "torch": torch.__version__, "dtype": ns.dtype, "tokens": ns.tokens,
        "shape": {"hidden": HIDDEN, "intermediate": INTERMEDIATE, "q_heads": Q_HEADS,
                  "kv_heads": KV_HEADS, "head_dim": HEAD_DIM},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "ops": {}}
    failed = False
    with torch.inference_mode():
        for name, op in make_ops(ns.device, getattr(torch, ns.dtype)).items():
            try:
                report["ops"][name] = run_op(name, op, ns, deadline)
            except Exception as exc:   # one op's failure must not hide the others' times
                logger.exception("%s failed", name)
                report["ops"][name] = {"error": repr(exc)}
                failed = True
            with open(os.path.join(ns.out, "fused_ops.json"), "w") as f:
                json.dump(report, f, indent=2)
    suffixes = ("_us", "_graph_us") if ns.device.type == "cuda" else ("_us",)
    summary = [f"{name}: FAILED" if "error" in result else
               f"{name}: " + " | ".join(choice(result, ns.impls, s) for s in suffixes)
               for name, result in report["ops"].items()]
    logger.info("fastest over %s tokens, vs eager (launched%s), %s: %s", ns.tokens,
                " | in a CUDA graph" if len(suffixes) == 2 else "", ns.dtype, "; ".join(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
