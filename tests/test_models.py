"""Model details: RoPE configuration forms, Llama 3 scaling, untied heads, half precision."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.reference import HFReference
from treadle import LLM, SamplingParams
from treadle.models.rope import rope_inv_freq, rope_parameters
from treadle.models.loader import default_model_path, load_tokenizer


def test_rope_theta_read_from_either_config_form():
    old = transformers.PretrainedConfig()
    old.rope_theta = 12345.0
    new = transformers.PretrainedConfig()
    new.rope_parameters = {"rope_type": "default", "rope_theta": 54321.0}
    assert rope_parameters(old)["rope_theta"] == 12345.0
    assert rope_parameters(new)["rope_theta"] == 54321.0
    assert rope_parameters(transformers.PretrainedConfig())["rope_type"] == "default"


def test_unknown_rope_type_is_a_clear_error():
    cfg = transformers.PretrainedConfig()
    cfg.rope_parameters = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    with pytest.raises(ValueError, match="rope_type"):
        rope_inv_freq(cfg, 64)


@pytest.fixture(scope="module")
def llama3_checkpoint(tmp_path_factory) -> str:
    """An untied Llama with Llama 3.1 RoPE scaling, long enough prompts to feel it."""
    tokenizer = load_tokenizer(default_model_path())
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
        initializer_range=0.15, tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        rope_theta=500000.0)
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("llama3")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_llama3_rope_scaling_and_untied_head_match_transformers(llama3_checkpoint):
    llm = LLM(llama3_checkpoint, max_num_batched_tokens=64)
    assert llm.engine.core.executor.worker.runner.model.lm_head is not None
    ref = HFReference(llama3_checkpoint)
    tok = llm.get_tokenizer()
    prompts = [tok.encode("The history of weaving " * 20), tok.encode("Looms and shuttles")]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == ref.greedy(p, 20)


@pytest.mark.parametrize("dtype, torch_dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_half_precision_runs(tiny_checkpoints, dtype, torch_dtype):
    llm = LLM(tiny_checkpoints["llama"], dtype=dtype)
    runner = llm.engine.core.executor.worker.runner
    assert runner.kv_caches[0].dtype == torch_dtype
    assert next(runner.model.parameters()).dtype == torch_dtype
    out = llm.generate("Hello, my name is", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8
    llm.engine.core.scheduler.kv_cache.assert_no_leaks()


def test_bad_dtype_is_rejected(tiny_checkpoints):
    with pytest.raises(ValueError, match="dtype"):
        LLM(tiny_checkpoints["llama"], dtype="float8")
