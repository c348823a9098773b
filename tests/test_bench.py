"""The benchmarks run end to end on a tiny model and write the figures they promise."""

from __future__ import annotations

import json

import gguf
import pytest
import transformers

from treadle.entrypoints.cli import main

from tests.kernel_support import needs_kernels


def test_bench_latency_compares_sync_and_async(tiny_checkpoints, tmp_path, capsys):
    out = tmp_path / "lat.json"
    assert main(["bench", "latency", "--model", tiny_checkpoints["llama"], "--compare-async",
                 "--batch-size", "2", "--input-len", "8", "--output-len", "4", "--num-iters", "2",
                 "--num-iters-warmup", "0", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"sync", "async"}
    assert report["results"]["async"]["iters"] == 2
    assert "async speed-up over sync" in capsys.readouterr().out


def test_bench_throughput_compare_async(tiny_checkpoints, tmp_path):
    out = tmp_path / "tp.json"
    # A step budget of 128 holds the three prompts (at most 120 tokens) in one step, as the
    # default 2,048 does; each engine warms the untied head's GEMM (49,152 rows) up to it.
    assert main(["bench", "throughput", "--model", tiny_checkpoints["qwen3"], "--compare-async",
                 "--num-prompts", "3", "--input-len-range", "8,40", "--output-len-range", "4,12",
                 "--max-num-batched-tokens", "128", "--no-tqdm", "--output-json", str(out)]) == 0
    names = [r["name"] for r in json.loads(out.read_text())["results"]]
    assert names == ["treadle", "treadle (async)"]   # it raises if their outputs differ


def test_bench_spec_reports_every_workload(tiny_checkpoints, tmp_path):
    out = tmp_path / "spec.json"
    assert main(["bench", "spec", "--model", tiny_checkpoints["llama"], "--num-prompts", "1",
                 "--output-len", "12", "--output-json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"rewrite", "chat", "chat-sampled", "random"}
    for r in results.values():
        assert r["plain_tok_s"] > 0 and r["spec_tok_s"] > 0
        assert 0 <= r["acceptance_rate"] <= 1


def test_bench_kv_loads_the_prefix_and_agrees(tiny_checkpoints, tmp_path, capsys):
    out = tmp_path / "kv.json"
    assert main(["bench", "kv", "--model", tiny_checkpoints["llama"], "--prefix-len", "144",
                 "--suffix-len", "4", "--num-requests", "2", "--store", str(tmp_path / "store"),
                 "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["first_tokens_agree"] == "2/2"
    assert set(report["median_ttft_s"]) == {"from the store", "recomputed"}
    assert "TTFT speed-up from the store" in capsys.readouterr().out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])   # a tied head, and an untied one
def test_bench_floor_counts_the_weights_a_step_reads(tiny_checkpoints, tmp_path, arch):
    out = tmp_path / "floor.json"
    path = tiny_checkpoints[arch]
    # Enough decode steps that a tiny model's TPOT stands above the machine's noise. A step
    # budget of 64 (the prompt is 4 tokens): an untied head's GEMM (49,152 rows) is warmed
    # only up to it at start-up.
    assert main(["bench", "floor", "--model", path, "--input-len", "4", "--output-len", "96",
                 "--num-iters", "3", "--copy-mib", "64", "--max-num-batched-tokens", "64",
                 "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype="float32")
    expected = sum(p.numel() * 4 for p in hf.parameters())   # a tied head is counted once
    if not hf.config.tie_word_embeddings:
        expected -= hf.get_input_embeddings().weight.numel() * 4   # a lookup reads one row
    assert report["weight_bytes_per_step"] == expected
    assert report["copy_bandwidth_gb_s"] > 0 and report["tpot_ms_median"] > 0
    assert len(report["copy_bandwidth_gb_s_all"]) == 3   # one beside each timed iteration
    assert report["tpot_over_floor"] == pytest.approx(report["tpot_ms_median"] / report["floor_ms"])
    with pytest.raises(SystemExit):   # --output-len below 2 has no decode step to time
        main(["bench", "floor", "--model", path, "--output-len", "1"])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bench_floor_counts_int8_weights_as_their_int8_copies(tiny_checkpoints, tmp_path, arch):
    out = tmp_path / "floor.json"
    path = tiny_checkpoints[arch]
    assert main(["bench", "floor", "--model", path, "--quantization", "int8", "--input-len", "4",
                 "--output-len", "8", "--copy-mib", "64", "--max-num-batched-tokens", "64",
                 "--output-json", str(out)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype="float32")
    expected = 0
    for name, p in hf.named_parameters():
        if "embed_tokens" in name and not hf.config.tie_word_embeddings:
            continue   # a lookup reads one row
        # A matrix is read as int8 plus one fp32 scale per 32 inputs; vectors stay fp32.
        expected += p.numel() + p.numel() // 32 * 4 if p.dim() == 2 else p.numel() * 4
    assert json.loads(out.read_text())["weight_bytes_per_step"] == expected


@needs_kernels
def test_bench_floor_counts_gguf_weights_as_the_files_blocks(smollm2_path, tmp_path):
    out = tmp_path / "floor.json"
    assert main(["bench", "floor", "--model", smollm2_path, "--quantization", "gguf", "--input-len", "4",
                 "--output-len", "4", "--num-iters", "1", "--copy-mib", "64", "--output-json", str(out)]) == 0
    # The file's bytes, as it stores them: the Q4_1 layers and the Q8_0 embedding (the tied
    # head), and the fp32 norms.
    expected = sum(int(t.n_bytes) for t in gguf.GGUFReader(smollm2_path).tensors)
    assert json.loads(out.read_text())["weight_bytes_per_step"] == expected


def test_bench_structured_times_both_runs_and_the_compile(tiny_checkpoints, tmp_path, capsys):
    out = tmp_path / "structured.json"
    assert main(["bench", "structured", "--model", tiny_checkpoints["llama"], "--batch-sizes",
                 "1,3", "--input-len", "6", "--output-len", "5", "--num-iters", "1",
                 "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["steps"]) == {"1", "3"}
    for r in report["steps"].values():
        assert r["free"] > 0 and r["json_schema"] > 0
        assert r["ratio"] == pytest.approx(r["json_schema"] / r["free"])
    assert 0 < report["compile"]["compile_cached_s"] <= report["compile"]["compile_cold_s"]
    assert "compile cold" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "structured", "--model", tiny_checkpoints["llama"], "--batch-sizes", "0"])


def test_bench_kv_tiers_runs_every_tier_and_agrees(tiny_checkpoints, tmp_path, capsys):
    out, png = tmp_path / "tiers.json", tmp_path / "tiers.png"
    assert main(["bench", "kv-tiers", "--model", tiny_checkpoints["llama"], "--block-size", "16",
                 "--num-conversations", "2", "--num-turns", "2", "--turn-len", "20", "40",
                 "--output-len", "4", "--max-concurrency", "1", "--output-json", str(out),
                 "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    results = report["results"]
    assert list(results) == ["none", "host", "redis", "host+redis"]
    assert report["engine_args"]["num_kv_blocks"] < report["workload"]["working_set_blocks"]
    for tier, r in results.items():
        assert len(r["ttft_s"]) == 4 and r["ttft_p99_s"] >= r["ttft_p50_s"] > 0
        assert r["output_tok_s"] > 0 and r["output_tokens"] == 16
        assert tier == "none" or (r["agree"] == 4 and sum(r["tier_hits"].values()) > 0)
    assert png.stat().st_size > 0
    assert "| host+redis |" in capsys.readouterr().out
