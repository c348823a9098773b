"""The `triton` attention backend (treadle/attention/triton_*.py), on the CPU through Triton's
interpreter: kernel by kernel against the torch backend, and the whole engine against
transformers; and through Triton's compiler to H100 code, which needs no GPU. The `gpu` tests
run the same comparisons compiled on a CUDA device.

Triton decides when a kernel is defined whether it is interpreted, so the interpreted cases
run in a fresh Python with TRITON_INTERPRET=1 (`_interpreted`), never in this process, where
the kernels may have been defined for a GPU.
"""

from __future__ import annotations

import os
from unittest import mock

import numpy as np
import pytest
import torch

from tests.fresh_python import in_fresh_python
from tests.gpu import shared_gpu
from treadle.attention.backend import BACKENDS, PagedAttention, check_attention_backend
from treadle.attention.torch_backend import TorchBackend
from treadle.attention.triton_backend import TritonBackend
from treadle.config import EngineArgs

CPU = torch.device("cpu")
BLOCK_SIZE = 16

# name -> one step: (query_lens, context_lens) per request, decodes first; query heads, KV
# heads, head dim; and split_min_tokens (None: no split, the unified kernel for the whole step).
CASES = {
    "decode_mha": ([1, 1, 1], [70, 33, 5], 4, 4, 64, None),
    "decode_gqa3": ([1, 1, 1], [70, 33, 5], 6, 2, 64, None),
    "chunked_prefill_mha": ([20, 9], [37, 16], 2, 2, 64, None),
    "chunked_prefill_gqa3": ([20, 9], [37, 16], 6, 2, 64, None),
    "first_chunks_gqa3": ([19, 3], [0, 0], 6, 2, 64, None),
    "draft_verify_gqa3_d48": ([1, 4, 6], [50, 40, 21], 6, 2, 48, None),
    "mixed_gqa3_d80": ([1, 1, 4, 20, 7], [90, 12, 30, 0, 18], 6, 2, 80, None),
    "split_decode_gqa3": ([1, 1, 1], [300, 150, 20], 6, 2, 64, 64),
    "split_decode_then_chunks_mha": ([1, 1, 9, 3], [200, 40, 30, 0], 4, 4, 64, 48),
}
BF16_CASES = ("mixed_gqa3_d80", "split_decode_gqa3")
FP32_TOL = 2e-5
BF16_TOL = 3e-2


def _step(case: str, dtype: torch.dtype, device: torch.device):
    """A step's inputs for `case`: its layout, a layer, a random cache and new q, k, v."""
    q_lens, ctx, hq, hkv, d, _ = CASES[case]
    q_lens, ctx = np.array(q_lens), np.array(ctx)
    gen = torch.Generator().manual_seed(sum(map(ord, case)))
    max_blocks = -(-int((q_lens + ctx).max()) // BLOCK_SIZE) + 1   # a padded table, as the runner's
    # Blocks scattered over the cache, none the null block 0.
    perm = torch.randperm(len(q_lens) * max_blocks, generator=gen).numpy() + 1
    table = perm.reshape(len(q_lens), max_blocks)
    positions = np.concatenate([np.arange(c, c + n) for c, n in zip(ctx, q_lens)])
    num_tokens = int(q_lens.sum())

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    cache = randn(2, table.size + 1, BLOCK_SIZE, hkv, d)
    layer = PagedAttention(hq, hkv, d, d ** -0.5)
    # q as a strided view, as the models' fused projection gives it
    q = randn(num_tokens, hq + 2, d)[:, :hq]
    k, v = randn(num_tokens, hkv, d), randn(num_tokens, hkv, d)
    return (q_lens, ctx, positions, table), layer, cache, (q, k, v)


def compare_case(case: str, dtype_name: str, device_name: str) -> dict[str, float | bool | int]:
    """The triton backend beside the torch backend on one step of `case`: the largest
    difference of their outputs, whether their caches match exactly after the K/V write, and
    the number of KV splits; for a split case, also the split path beside the unsplit one."""
    dtype, device = getattr(torch, dtype_name), torch.device(device_name)
    layout, layer, cache, (q, k, v) = _step(case, dtype, device)
    ref_cache = cache.clone()
    ref = TorchBackend(device, BLOCK_SIZE).build_metadata(*layout).attend(layer, q, k, v, ref_cache)
    backend = TritonBackend(device, BLOCK_SIZE)
    if (min_tokens := CASES[case][-1]) is not None:
        backend.split_min_tokens = min_tokens
    else:
        backend.split_max_decodes = 0
    meta = backend.build_metadata(*layout)
    got = meta.attend(layer, q, k, v, cache)
    result = {"max_diff": (got.float() - ref.float()).abs().max().item(),
              "cache_equal": torch.equal(cache, ref_cache), "num_kv_splits": meta.num_kv_splits}
    if meta.num_kv_splits > 1:
        backend.split_max_decodes = 0
        unsplit = backend.build_metadata(*layout)
        assert unsplit.num_kv_splits == 1
        result["split_vs_unsplit"] = (unsplit.attend(layer, q, k, v, cache).float()
                                      - got.float()).abs().max().item()
    return result


def write_kv_skips_padding(device_name: str) -> bool:
    """A negative slot (a padding token) writes nothing; the others land where index_copy_
    puts them."""
    from treadle.attention.triton_kv_write import write_kv

    device = torch.device(device_name)
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 5, BLOCK_SIZE, 3, 48, generator=gen).to(device)
    k, v = torch.randn(2, 4, 3, 48, generator=gen).to(device)
    slots = torch.tensor([17, -1, 40, 79], device=device)
    expected = cache.clone()
    for i, dst in enumerate(expected):
        dst.view(-1, 3, 48).index_copy_(0, slots[[0, 2, 3]], (k, v)[i][[0, 2, 3]])
    write_kv(k, v, cache[0], cache[1], slots)
    return torch.equal(cache, expected)


def rows_past_two_to_the_31(device_name: str) -> dict[str, bool]:
    """A step whose token rows lie 2**27 elements apart (q, out and k: strided views into
    buffers of about 8.6 GB of address space each, a few pages touched), so that the 17th row
    starts at element 2**31 of its view: each kernel must reach it with a 64-bit offset, not
    wrap 2**32 elements back (to zeros here). A helper's fuzz found
    both wrapping; an engine step reaches it in one prefill of some 466k tokens of a 7B model
    with 1M positions (its q a view of the fused qkv output)."""
    from treadle.attention.triton_kv_write import write_kv
    from treadle.attention.triton_unified import unified_attention

    device = torch.device(device_name)
    tokens, dim, row, base = 17, 16, 2 ** 27, 2 ** 32
    gen = torch.Generator().manual_seed(0)

    def tall(values: torch.Tensor) -> torch.Tensor:
        buf = torch.empty(base + (tokens - 1) * row + dim, dtype=torch.float16, device=device)
        buf[2 ** 31:2 ** 31 + dim] = 0   # where row 16 lands if its offset wraps
        view = buf.as_strided((tokens, 1, dim), (row, dim, 1), base)
        view.copy_(values)
        return view

    q = tall(torch.randn(tokens, 1, dim, generator=gen).half())
    out = tall(torch.zeros(tokens, 1, dim).half())
    k_cache, v_cache = torch.randn(2, 1, 32, 1, dim, generator=gen).half().to(device)
    unified_attention(out, q, k_cache, v_cache, torch.zeros(1, 1, dtype=torch.int32, device=device),
                      torch.tensor([tokens], dtype=torch.int32, device=device),
                      torch.tensor([0, tokens], dtype=torch.int32, device=device), dim ** -0.5)
    scores = (q[:, 0].float() @ k_cache[0, :tokens, 0].float().T) * dim ** -0.5
    scores = scores.masked_fill(torch.ones(tokens, tokens, dtype=torch.bool, device=device).triu(1),
                                float("-inf"))
    want = torch.softmax(scores, -1) @ v_cache[0, :tokens, 0].float()
    k = tall(torch.randn(tokens, 1, dim, generator=gen).half())
    caches = torch.zeros(2, 2, 16, 1, dim, dtype=torch.float16, device=device)
    write_kv(k, k, caches[0], caches[1], torch.arange(tokens, dtype=torch.int32, device=device))
    return {"unified_attention": bool(torch.allclose(out[:, 0].float(), want, atol=2e-3)),
            "write_kv": torch.equal(caches[0].view(-1, 1, dim)[:tokens], k)}


def unified_launch_shapes(device_name: str) -> dict[str, float]:
    """The unified kernel at other keys per tile, and with the loop that loads a tile's blocks
    in the tile itself (benchmarks/gpu/decode_attention.py times them on a GPU), against its
    default, on decodes and a chunk over partial tiles: the largest difference of each."""
    from treadle.attention.triton_unified import unified_attention

    device = torch.device(device_name)
    gen = torch.Generator().manual_seed(1)
    q_lens, contexts = [1, 1, 5], [70, 33, 21]
    table = torch.randperm(15, generator=gen)[:12].view(3, 4).to(torch.int32) + 1
    cache = torch.randn(2, 16, BLOCK_SIZE, 2, 64, generator=gen)
    q = torch.randn(sum(q_lens), 6, 64, generator=gen)
    seq_lens = torch.tensor([c + n for c, n in zip(contexts, q_lens)], dtype=torch.int32)
    starts = torch.tensor([0, 1, 2, 7], dtype=torch.int32)
    args = [t.to(device) for t in (q, cache[0], cache[1], table, seq_lens, starts)]

    def attend(**launch) -> torch.Tensor:
        out = torch.empty_like(args[0])
        unified_attention(out, *args, 0.125, **launch)
        return out

    want = attend()
    shapes = {f"tile{tile}": {"tile_n": tile, "num_warps": 8, "num_stages": 2} for tile in (16, 64)}
    shapes["same_tile_blocks"] = {"blocks_ahead": False}
    return {name: (attend(**launch) - want).abs().max().item() for name, launch in shapes.items()}


def run_engine(path: str, prompts: list[list[int]], follow_up: list[int], max_tokens: int,
               device_name: str, on_graph_buffers: bool = False, deferred: bool = False) -> dict:
    """Greedy output of the whole engine on the triton backend in fp32, with prefill chunks of
    16 tokens and n-gram drafts (matching a single token, so that the tiny models' outputs get
    some); `follow_up` runs after `prompts`, for a prefix hit. Counts the attention backend's
    own K/V writes, which the models' RoPE kernels spare where they write K/V themselves.
    On CUDA the engine captures decode and mixed-step graphs itself; on the CPU,
    `on_graph_buffers` runs every step on the graphs' buffers, eagerly, as the CUDA graphs
    would replay it (worker/cuda_graphs.py, mixed_graphs.py). `deferred`: async scheduling,
    steps deferred (on the CPU by leave: worker/deferred_step.py), and no drafts (a step that
    proposes drafts is never deferred)."""
    from tests.deferred import record_deferred
    from treadle import LLM, SamplingParams
    from treadle.attention import triton_kv_write

    # On the CPU's graph buffers, room for 8 requests (the runs have 3 at most) where the
    # default has 256: the unified kernel's grid spans them all (worker/mixed_graphs.py), and
    # the interpreter runs each empty request's program, as it runs the others.
    graph_seqs = {"max_num_seqs": 8} if on_graph_buffers and device_name == "cpu" else {}
    # Closed at the end: on a GPU the next engine in this process sizes its cache against what
    # this one leaves free.
    with mock.patch.object(triton_kv_write, "write_kv", wraps=triton_kv_write.write_kv) as backend_write, \
            LLM(path, device=device_name, attention_backend="triton", dtype="float32",
                block_size=BLOCK_SIZE, max_num_batched_tokens=16, async_scheduling=deferred,
                **graph_seqs, **shared_gpu(device_name),
                speculative_config=None if deferred else {
                    "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                    "prompt_lookup_max": 3}) as llm:
        runner = llm.engine.core.executor.worker.runner
        assert runner.attention.name == "triton"
        if on_graph_buffers and device_name == "cpu":
            runner.graphs = graph_buffers(runner, 16, mixed_tokens=16,
                                          max_reqs=runner.config.scheduler.max_num_seqs)
            if deferred:
                runner.allow_deferred_steps()
        deferred_of_step = record_deferred(runner)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        hit = llm.generate([{"prompt_token_ids": follow_up}], params, use_tqdm=False)[0]
        llm.engine.core.scheduler.kv_cache.assert_no_leaks()
        graphs = runner.graphs
        return {"tokens": [o.outputs[0].token_ids for o in outs] + [hit.outputs[0].token_ids],
                "cached": hit.num_cached_tokens,
                "drafts": llm.engine.core.scheduler.spec_stats.num_draft_tokens,
                "backend_kv_writes": backend_write.call_count,
                "steps": len(deferred_of_step), "deferred_steps": sum(deferred_of_step),
                "decode_graph_steps": graphs.num_steps if graphs is not None else 0,
                **{f"mixed_{name}": (getattr(graphs.mixed, f"num_{name}")
                                     if graphs is not None and graphs.mixed is not None else 0)
                   for name in ("steps", "replays", "patched")}}


def graph_buffers(runner, max_batch: int, **kwargs):
    """The CUDA graphs' persistent buffers for decodes of up to `max_batch` requests, run
    eagerly: the CPU's stand-in for graphs (worker/cuda_graphs.py); kwargs go to DecodeGraphs."""
    from treadle.worker.cuda_graphs import DecodeGraphs

    return DecodeGraphs(runner.model, runner.kv_caches, max_batch, runner.slots.block_table.shape[2],
                        runner.device, capture=False, backend=runner.attention, **kwargs)


def together_and_alone(llm, prompts: list[list[int]], max_tokens: int) -> dict[str, list[list[int]]]:
    """Greedy output of the prompts in one batch, then of each alone; no KV block left held."""
    from treadle import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    together = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    alone = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
    llm.engine.core.scheduler.kv_cache.assert_no_leaks()
    return {"together": [o.outputs[0].token_ids for o in together],
            "alone": [o.outputs[0].token_ids for o in alone]}


def run_engine_on_graph_buffers(path: str, prompts: list[list[int]], max_tokens: int,
                                device_name: str, deferred: bool = False,
                                split_min_tokens: int | None = None) -> dict:
    """Greedy output with every decode step on worker/cuda_graphs.py's persistent buffers, its
    batch padded to a captured size: replayed graphs on CUDA (captured by the engine itself),
    the same buffers run eagerly on the CPU (a test's stand-in: no graph exists there). All
    prompts at once (3 decodes padded to 4), then each alone (1). `deferred`: async scheduling,
    each step's input tokens taken on the device from the step before (worker/deferred_step.py;
    on CUDA the executor defers by itself). A budget of 128 tokens still prefills all prompts
    (at most 71 tokens here) in one step, as the default 2,048 did, and spares the CPU warming
    the untied head's GEMMs (49,152 rows) up to 2,048 rows at start-up. `split_min_tokens`:
    the backend's, so low that decodes take the split-KV path, in graphs of their own."""
    from tests.deferred import record_deferred
    from treadle import LLM

    with LLM(path, device=device_name, attention_backend="triton", dtype="float32",
             block_size=BLOCK_SIZE, max_num_seqs=8, max_num_batched_tokens=128,
             async_scheduling=deferred, **shared_gpu(device_name)) as llm:
        runner = llm.engine.core.executor.worker.runner
        if split_min_tokens is not None:
            runner.attention.split_min_tokens = split_min_tokens
            if device_name != "cpu":   # captured graphs hold the setting they were made with
                runner.capture_graphs()
        if device_name == "cpu":
            runner.graphs = graph_buffers(runner, 8)
            if deferred:
                runner.allow_deferred_steps()
        assert runner.defer_steps == deferred
        deferred_of_step = record_deferred(runner)
        graphs = runner.graphs
        return {**together_and_alone(llm, prompts, max_tokens),
                "graph_steps": graphs.num_steps, "captured": sorted(graphs.graphs),
                "split_steps": graphs.num_split_steps, "captured_split": sorted(graphs.split_graphs),
                "deferred_steps": sum(deferred_of_step)}


def run_connector_arrivals(path: str, store: str, stale: list[list[int]],
                           arrivals: list[list[int]], max_tokens: int, device_name: str) -> dict:
    """Invariant 3 on the triton backend: a consumer's slots first hold a finished batch (its
    last tokens and drafts), then requests whose KV the shared-storage connector delivers
    arrive with computed tokens and take those slots, n-gram drafts on."""
    from tests.kv_fixtures import connector_of, kv_config
    from treadle import LLM, SamplingParams

    common = dict(device=device_name, attention_backend="triton", dtype="float32",
                  block_size=BLOCK_SIZE, max_num_seqs=4, **shared_gpu(device_name))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(path, kv_transfer_config=kv_config(store, "kv_producer"), **common) as producer:
        producer.generate([{"prompt_token_ids": p} for p in arrivals],
                          SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
             "prompt_lookup_max": 3}
    with LLM(path, kv_transfer_config=kv_config(store, "kv_consumer"), speculative_config=ngram,
             **common) as consumer:
        consumer.generate([{"prompt_token_ids": p} for p in stale], params, use_tqdm=False)
        outs = consumer.generate([{"prompt_token_ids": p} for p in arrivals], params,
                                 use_tqdm=False)
        consumer.engine.core.scheduler.kv_cache.assert_no_leaks()
        return {"tokens": [o.outputs[0].token_ids for o in outs],
                "loaded_blocks": connector_of(consumer).num_loaded_blocks,
                "cached": [o.num_cached_tokens for o in outs],
                "drafts": consumer.engine.core.scheduler.spec_stats.num_draft_tokens}


def compile_for_sm90(dtype: str, group: int, head_dim: int, num_seqs: int,
                     tile_n: int | None = None, num_warps: int = 4, num_stages: int = 3) -> list[str]:
    """Compile every kernel for an H100/H200 (sm_90) without a GPU, as the launcher would for
    these shapes (it makes an integer argument equal to 1 a constant, and marks 16-byte aligned
    pointers and head strides so, which lets the pipeliner copy K and V asynchronously); the
    kernels' names. `tile_n`, `num_warps` and `num_stages`: the attention kernels' launch
    shape (decode_attention.py's variants), the default where None."""
    import triton
    from triton.backends.compiler import GPUTarget

    from treadle.attention import triton_decode, triton_kv_write, triton_unified

    block_m, block_q, head_dim_pad = triton_unified.tile_sizes(group, head_dim)
    shape = {"GROUP": group, "HEAD_DIM": head_dim, "HEAD_DIM_PAD": head_dim_pad,
             "BLOCK_SIZE": BLOCK_SIZE, "TILE_N": tile_n or triton_unified.TILE_N,
             "FP32_DOT": dtype == "fp32"}
    kernels = [
        (triton_unified._unified_attention_kernel,
         {**shape, "BLOCK_Q": block_q, "BLOCK_M": block_m, "num_seqs": num_seqs,
          "BLOCKS_AHEAD": True}),
        (triton_decode._split_decode_kernel, {**shape, "BLOCK_H": block_m}),
        (triton_decode._merge_splits_kernel,
         {"HEAD_DIM": head_dim, "HEAD_DIM_PAD": head_dim_pad, "SPLITS_PAD": 4}),
        (triton_kv_write._write_kv_kernel,
         {"NUM_KV_HEADS": 2, "HEADS_PAD": 2, "HEAD_DIM": head_dim,
          "HEAD_DIM_PAD": triton.next_power_of_2(head_dim), "BLOCK_SIZE": BLOCK_SIZE})]
    # Strides of whole heads, tokens and blocks: multiples of the head dim.
    head_strides = {"stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kb", "stride_kp",
                    "stride_kh", "stride_vb", "stride_vp", "stride_vh"}
    for kernel, constants in kernels:
        signature, aligned = {}, {}
        for i, name in enumerate(kernel.arg_names):
            if name in constants:
                signature[name] = "constexpr"
            elif name.startswith("part_"):
                signature[name] = "*fp32"
            elif name.endswith("_ptr"):
                signature[name] = "*i32" if name[:-4] in ("block_table", "seq_lens", "query_start",
                                                          "slot_mapping") else f"*{dtype}"
            else:
                signature[name] = "fp32" if name == "scale_log2" else "i32"
            if name.endswith("_ptr") or (name in head_strides and head_dim % 16 == 0):
                aligned[(i,)] = [["tt.divisibility", 16]]
        compiled = triton.compile(triton.compiler.ASTSource(kernel, signature, constants, aligned),
                                  target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": num_warps, "num_stages": num_stages})
        # What an H100's SM gives one block (227 KiB); past it the launch fails on the device.
        assert compiled.metadata.shared <= 227 * 1024, (kernel.__name__, compiled.metadata.shared)
    return [kernel.__name__ for kernel, _ in kernels]


def _in_fresh_python(calls: list[tuple[str, list]], interpret: bool) -> list:
    return in_fresh_python("tests.test_triton_attention", calls, interpret)


def _interpreted(calls: list[tuple[str, list]]) -> list:
    return _in_fresh_python(calls, interpret=True)


# -- the backend by name ---------------------------------------------------------------------
def test_triton_is_a_backend_refused_on_a_cpu_without_the_interpreter(monkeypatch):
    assert "triton" in BACKENDS
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"'triton' cannot run on cpu: .*set TRITON_INTERPRET=1 "
                                         r".*or use attention_backend 'cpu' or 'torch'"):
        check_attention_backend("triton", CPU)
    with pytest.raises(ValueError, match="set TRITON_INTERPRET=1"):
        EngineArgs(attention_backend="triton", device="cpu", model="/nonexistent").create_config()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert check_attention_backend("triton", CPU) is TritonBackend


def test_the_metadata_is_device_tensors_with_the_split_decided_on_the_host():
    """No kernel runs here: one int32 array holds the layout, slots included; few long decodes
    split their keys, and the requests after them get their own query starts."""
    q_lens, ctx = np.array([1, 1, 4, 20]), np.array([2000, 900, 30, 0])
    positions = np.concatenate([np.arange(c, c + n) for c, n in zip(ctx, q_lens)])
    table = np.arange(1, 4 * 130 + 1).reshape(4, 130)
    meta = TritonBackend(CPU, BLOCK_SIZE).build_metadata(q_lens, ctx, positions, table)
    # Two decodes take up to 64 // 2 ranges each (split_target_ranges), at most 16; 2001 keys
    # fill them.
    assert meta.num_decodes == 2 and meta.num_kv_splits == TritonBackend.max_kv_splits == 16
    assert meta.block_table.shape == (4, 126) and meta.block_table.dtype == torch.int32
    assert torch.equal(meta.block_table, torch.from_numpy(table[:, :126]).int())
    assert meta.seq_lens.tolist() == [2001, 901, 34, 20]
    assert meta.query_start.tolist() == [0, 1, 2, 6, 26]
    assert meta.rest_query_start.tolist() == [0, 4, 24]
    expected_slots = TorchBackend(CPU, BLOCK_SIZE).slot_mapping(q_lens, positions, table)
    assert meta.slot_mapping.dtype == torch.int32
    assert meta.slot_mapping.tolist() == expected_slots.tolist()
    many = TritonBackend(CPU, BLOCK_SIZE)
    many.split_max_decodes = 1
    assert many.build_metadata(q_lens, ctx, positions, table).num_kv_splits == 1


def test_the_split_count_follows_the_batch_as_measured():
    """As decode_attention.py found on an H200: 16 ranges a decode at 1-4 decodes, 4 at 16, 2 at
    32, none past 32; a step's longest sequence takes one range per 32 keys, at least one."""
    backend = TritonBackend(CPU, BLOCK_SIZE)
    assert [backend.batch_splits(n) for n in (0, 1, 4, 16, 24, 32, 33)] == [1, 16, 16, 4, 2, 2, 1]
    # Between them, the count of the next power of two: a CUDA graph's padded size's count.
    assert [backend.batch_splits(n) for n in (3, 5, 8, 9, 15, 17)] == [16, 8, 8, 4, 4, 2]
    assert backend.kv_splits(np.full(4, 4096)) == 16 and backend.kv_splits(np.full(16, 1000)) == 4
    assert backend.kv_splits(np.array([100, 5])) == 3 and backend.kv_splits(np.array([63])) == 1
    assert backend.kv_splits(np.full(33, 4096)) == 1 and backend.kv_splits(np.zeros(0)) == 1


@pytest.mark.parametrize("extra", [{"sliding_window": 8}, {"logit_softcap": 30.0}])
def test_a_layer_the_kernels_cannot_serve_is_refused_loudly(extra):
    q_lens, ctx = np.array([1]), np.array([5])
    meta = TritonBackend(CPU, BLOCK_SIZE).build_metadata(q_lens, ctx, np.array([5]),
                                                        np.array([[1]]))
    layer = PagedAttention(2, 2, 16, 0.25, **extra)
    q, kv = torch.zeros(1, 2, 16), torch.zeros(1, 2, 16)
    with pytest.raises(NotImplementedError, match="no sliding window or logit soft-cap yet"):
        meta.attend(layer, q, kv, kv, torch.zeros(2, 2, BLOCK_SIZE, 2, 16))


# -- under the interpreter -------------------------------------------------------------------
@pytest.fixture(scope="module")
def interpreted_kernels() -> dict:
    """Every case in fp32 and two in bf16, and the padding write: one interpreter process."""
    calls = [("compare_case", [case, "float32", "cpu"]) for case in CASES]
    calls += [("compare_case", [case, "bfloat16", "cpu"]) for case in BF16_CASES]
    calls.append(("write_kv_skips_padding", ["cpu"]))
    calls.append(("unified_launch_shapes", ["cpu"]))
    calls.append(("rows_past_two_to_the_31", ["cpu"]))
    results = _interpreted(calls)
    return {tuple(args[:2]) if name == "compare_case" else name: r
            for (name, args), r in zip(calls, results)}


@pytest.mark.parametrize("case", list(CASES))
def test_interpreted_kernels_match_the_torch_backend(interpreted_kernels, case):
    result = interpreted_kernels[(case, "float32")]
    assert result["cache_equal"]
    assert result["max_diff"] < FP32_TOL, result
    assert (result["num_kv_splits"] > 1) == (CASES[case][-1] is not None), result
    if "split_vs_unsplit" in result:
        assert result["split_vs_unsplit"] < FP32_TOL, result


@pytest.mark.parametrize("case", BF16_CASES)
def test_interpreted_kernels_in_bf16(interpreted_kernels, case):
    result = interpreted_kernels[(case, "bfloat16")]
    assert result["cache_equal"] and result["max_diff"] < BF16_TOL, result


def test_interpreted_kernels_reach_rows_past_two_to_the_31_elements(interpreted_kernels):
    assert interpreted_kernels["rows_past_two_to_the_31"] == {"unified_attention": True,
                                                             "write_kv": True}


def test_interpreted_kv_write_skips_padding_slots(interpreted_kernels):
    assert interpreted_kernels["write_kv_skips_padding"]


def test_interpreted_unified_kernel_in_other_launch_shapes(interpreted_kernels):
    diffs = interpreted_kernels["unified_launch_shapes"]
    assert set(diffs) == {"tile16", "tile64", "same_tile_blocks"}, diffs
    assert max(diffs.values()) < FP32_TOL, diffs


def _engine_prompts(path: str) -> tuple[list[list[int]], list[int]]:
    """Token ids, whatever the tokenizer (the GPU machines' tiny models have a word-level one)."""
    gen = torch.Generator().manual_seed(3)
    story = torch.randint(100, 30000, (2 * BLOCK_SIZE + 5,), generator=gen).tolist()
    prompts = [story, list(range(500, 509)), [11, 12, 13, 14, 15] * 5]
    # Goes on from the story, whose first two blocks are then cached: a prefix hit of 32 tokens.
    return prompts, story + [700, 701, 702, 703]


def _check_engine(result: dict, path: str, prompts, follow_up, max_tokens: int, reference) -> None:
    ref = reference(path)
    assert result["tokens"] == [ref.greedy(p, max_tokens) for p in prompts + [follow_up]]
    assert result["cached"] == 2 * BLOCK_SIZE
    assert result["drafts"] > 0 or result["deferred_steps"] > 0   # deferred steps draft none
    assert result["backend_kv_writes"] == 0   # RoPE's launch wrote every layer's K/V


def _arrival_prompts() -> tuple[list[list[int]], list[list[int]]]:
    gen = torch.Generator().manual_seed(9)
    stale = [[21, 22, 23, 24] * 6, torch.randint(100, 30000, (20,), generator=gen).tolist(),
             [31, 32, 33] * 7]
    arrivals = [torch.randint(100, 30000, (2 * BLOCK_SIZE + 3,), generator=gen).tolist(),
                [41, 42, 43, 44, 45] * 8, torch.randint(100, 30000, (BLOCK_SIZE + 1,), generator=gen).tolist()]
    return stale, arrivals


@pytest.fixture(scope="module")
def interpreted_engines(tiny_checkpoints, tmp_path_factory) -> dict:
    """Every whole-engine run under the interpreter, one engine after another (each closed
    before the next starts) in one interpreter process, as `interpreted_kernels`: a fresh
    Python costs its imports of torch, Triton and transformers each time."""
    calls = {arch: ("run_engine", [tiny_checkpoints[arch], *_engine_prompts(tiny_checkpoints[arch]),
                                   10, "cpu"])
             for arch in ("llama", "qwen3")}
    qwen3 = tiny_checkpoints["qwen3"]
    for arch, deferred in (("qwen3", False), ("llama", True)):
        path = tiny_checkpoints[arch]
        calls[f"mixed_{arch}"] = ("run_engine", [path, *_engine_prompts(path), 10, "cpu", True,
                                                 deferred])
    calls["graph_eager"] = ("run_engine_on_graph_buffers", [qwen3, _engine_prompts(qwen3)[0], 8, "cpu"])
    calls["graph_deferred"] = ("run_engine_on_graph_buffers",
                               [qwen3, _engine_prompts(qwen3)[0], 8, "cpu", True, 16])
    calls["arrivals"] = ("run_connector_arrivals",
                         [tiny_checkpoints["llama"], str(tmp_path_factory.mktemp("arrivals")),
                          *_arrival_prompts(), 10, "cpu"])
    return dict(zip(calls, _interpreted(list(calls.values()))))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_engine_on_the_interpreter_matches_transformers(tiny_checkpoints, reference,
                                                            interpreted_engines, arch):
    path = tiny_checkpoints[arch]
    prompts, follow_up = _engine_prompts(path)
    _check_engine(interpreted_engines[arch], path, prompts, follow_up, 10, reference)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_every_step_on_the_graph_buffers_matches_transformers(tiny_checkpoints, reference,
                                                              interpreted_engines, arch):
    """Prefill chunks, drafts, decodes and a prefix hit, every step on the CUDA graphs'
    buffers and padding (mixed steps padded to 16 tokens), run eagerly under the interpreter;
    the llama's steps deferred (async scheduling), their input tokens put into the buffers
    on the device."""
    path = tiny_checkpoints[arch]
    prompts, follow_up = _engine_prompts(path)
    result = interpreted_engines[f"mixed_{arch}"]
    _check_engine(result, path, prompts, follow_up, 10, reference)
    _check_graph_steps(result, deferred=arch == "llama", replayed=False)


def _check_graph_steps(result: dict, deferred: bool, replayed: bool) -> None:
    """Every step of a run_engine on graphs took one, mixed steps included; `replayed`: every
    mixed step replayed a captured graph (on CUDA); `deferred`: some mixed steps took input
    tokens from the step before on the device."""
    assert result["mixed_steps"] >= 3 and result["decode_graph_steps"] >= 1, result
    assert result["mixed_steps"] + result["decode_graph_steps"] == result["steps"], result
    assert result["mixed_replays"] == (result["mixed_steps"] if replayed else 0), result
    assert (result["deferred_steps"] > 0) == (result["mixed_patched"] > 0) == deferred, result


def test_decode_steps_on_the_graph_buffers_match_transformers(tiny_checkpoints, reference,
                                                              interpreted_engines):
    """The persistent buffers and padding of CUDA graphs, run eagerly under the interpreter;
    the deferred run's longer decodes take the split-KV path, as a split graph would."""
    path = tiny_checkpoints["qwen3"]
    prompts = _engine_prompts(path)[0]
    eager, deferred = interpreted_engines["graph_eager"], interpreted_engines["graph_deferred"]
    want = [reference(path).greedy(p, 8) for p in prompts]
    for result in (eager, deferred):
        assert result["together"] == want and result["alone"] == want
        assert result["graph_steps"] >= 3 * 7   # the decode steps of the runs alone, at least
    # Deferred: each decode's input token was put into the graph's buffer on the device.
    assert eager["deferred_steps"] == 0 and deferred["deferred_steps"] >= 3 * 7
    # The split path where a step's longest sequence reaches 2 x 16 keys; not before.
    assert eager["split_steps"] == 0 and 0 < deferred["split_steps"] < deferred["graph_steps"]


def test_connector_arrivals_in_reused_slots_match_transformers(tiny_checkpoints, reference,
                                                              interpreted_engines):
    path = tiny_checkpoints["llama"]
    arrivals = _arrival_prompts()[1]
    result = interpreted_engines["arrivals"]
    assert result["tokens"] == [reference(path).greedy(p, 10) for p in arrivals]
    assert result["loaded_blocks"] >= 4 and all(c > 0 for c in result["cached"])
    assert result["drafts"] > 0


# -- compiled for a GPU, without one ------------------------------------------------------
def test_the_kernels_compile_for_an_h100_without_a_gpu():
    """What the interpreter does not check: the kernels through Triton's compiler to sm_90
    code, in fp32 (ieee dots) and bf16, for one sequence and for several, and in the largest
    launch shapes decode_attention.py tries (64 keys a tile with 8 warps, or with 5 stages)."""
    calls = [("compile_for_sm90", ["fp32", 3, 80, 1]), ("compile_for_sm90", ["bf16", 8, 128, 5]),
             ("compile_for_sm90", ["bf16", 2, 128, 256, 64, 8]),   # decode_attention's largest
             ("compile_for_sm90", ["bf16", 2, 128, 256, 64, 4, 5])]
    for names in _in_fresh_python(calls, interpret=False):
        assert len(names) == 4


# -- on a GPU --------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_torch_on_cuda(case, dtype):
    assert os.environ.get("TRITON_INTERPRET") != "1", "the GPU tests compile the kernels"
    result = compare_case(case, dtype, "cuda")
    tol = FP32_TOL if dtype == "float32" else BF16_TOL
    assert result["cache_equal"] and result["max_diff"] < tol, result
    if "split_vs_unsplit" in result:
        assert result["split_vs_unsplit"] < tol, result


@pytest.mark.gpu
def test_kv_write_skips_padding_slots_on_cuda():
    assert write_kv_skips_padding("cuda")


@pytest.mark.gpu
def test_connector_arrivals_in_reused_slots_on_cuda(tiny_checkpoints, reference, tmp_path):
    path = tiny_checkpoints["llama"]
    stale, arrivals = _arrival_prompts()
    result = run_connector_arrivals(path, str(tmp_path), stale, arrivals, 24, "cuda")
    assert result["tokens"] == [reference(path).greedy(p, 24) for p in arrivals]
    assert result["loaded_blocks"] >= 4 and all(c > 0 for c in result["cached"])


@pytest.mark.gpu
def test_decode_cuda_graphs_match_transformers(tiny_checkpoints, reference):
    path = tiny_checkpoints["qwen3"]
    prompts = _engine_prompts(path)[0]
    want = [reference(path).greedy(p, 24) for p in prompts]
    for deferred in (False, True):   # deferred, in split-KV graphs (all sizes here are small)
        result = run_engine_on_graph_buffers(path, prompts, 24, "cuda", deferred,
                                             16 if deferred else None)
        assert result["together"] == want and result["alone"] == want
        assert result["captured"][:4] == [1, 2, 4, 8] and result["graph_steps"] >= 3 * 23
        assert result["captured_split"] == result["captured"]
        assert (result["deferred_steps"] >= 3 * 23) == deferred
        assert (0 < result["split_steps"] < result["graph_steps"]) == deferred


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_engine_on_cuda_matches_transformers(tiny_checkpoints, reference, arch):
    path = tiny_checkpoints[arch]
    prompts, follow_up = _engine_prompts(path)
    result = run_engine(path, prompts, follow_up, 24, "cuda", deferred=arch == "llama")
    _check_engine(result, path, prompts, follow_up, 24, reference)
    _check_graph_steps(result, deferred=arch == "llama", replayed=True)


@pytest.mark.gpu
def test_a_lone_worker_process_on_cuda_defers_by_itself_and_matches_transformers(
        tiny_checkpoints, reference):
    """The mp executor with one worker on CUDA and async scheduling defers its steps without
    being told (executor/mp.py), and stays token-identical to transformers."""
    from tests.deferred import defer_and_count, worker_num_deferred
    from treadle import LLM, SamplingParams

    path = tiny_checkpoints["qwen3"]
    prompts = _engine_prompts(path)[0]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with LLM(path, device="cuda", dtype="float32", attention_backend="triton", block_size=16,
             async_scheduling=True, distributed_executor_backend="mp", **shared_gpu("cuda")) as llm:
        assert llm.engine.core.executor.defers_steps
        assert llm.collective_rpc(defer_and_count) == [True]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        alone = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
        assert llm.collective_rpc(worker_num_deferred)[0] >= 2 * 23
    want = [reference(path).greedy(p, 24) for p in prompts]
    assert [list(o.outputs[0].token_ids) for o in outs + alone] == want + want[:1]


def test_the_decode_attention_benchmark_dry_runs_on_the_interpreter(tmp_path):
    """benchmarks/gpu/decode_attention.py as check.sh runs it, but interpreted on the CPU at
    tiny shapes: every split count, and past --max-split-batch every launch shape of the
    unified kernel, checked against the unified kernel's default, and timed."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "benchmarks/gpu/decode_attention.py", "--device", "cpu",
                           "--batches", "1,2", "--contexts", "40", "--splits", "3", "--reps", "1",
                           "--max-split-batch", "1", "--out", str(tmp_path)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    shapes = json.loads((tmp_path / "decode_attention.json").read_text())["shapes"]
    assert set(shapes) == {"1x40", "2x40"}
    from benchmarks.gpu.decode_attention import UNIFIED_VARIANTS

    assert set(shapes["1x40"]) == {"unified_us", "unified_gbs", "split3_us"}, shapes
    # Past --max-split-batch: no split, the unified kernel in each launch shape, checked first.
    assert set(shapes["2x40"]) == {f"{name}_{unit}" for name in ["unified", *UNIFIED_VARIANTS]
                                   for unit in ("us", "gbs")}, shapes
    *_, splits, reads = proc.stderr.strip().splitlines()
    assert splits.startswith("split-KV against unified"), proc.stderr
    assert reads.startswith("unified kernel's reads: batch 2: 40 keys"), proc.stderr
