"""What the model-family tests share (test_moe, test_model_families, test_sliding_window,
test_gemma): transformers' own model loaded from the same folder as the reference, seeded
random prompts, greedy runs, and the engine settings that force chunks and preemption."""

from __future__ import annotations

import torch
import transformers

from treadle import LLM, SamplingParams
from treadle.config import layer_windows
from treadle.core.kv_cache_groups import kv_cache_groups

MAX_TOKENS = 24
# Chunks of 16 tokens, 16-token blocks, and a cache too small for every prompt at once.
TIGHT = {"max_num_batched_tokens": 16, "block_size": 16, "num_kv_blocks": 14, "max_num_seqs": 4}


def tight_for(hf_dir: str) -> dict:
    """TIGHT's cache in bytes for the model in `hf_dir`: a model mixing local and global layers
    has a block per group of layers (core/kv_cache_groups.py), a block per layer of each group,
    so as many more blocks as it has groups."""
    groups = kv_cache_groups(layer_windows(transformers.AutoConfig.from_pretrained(hf_dir)))
    return dict(TIGHT, num_kv_blocks=groups.num_groups * (TIGHT["num_kv_blocks"] - 1) + 1)


class PretrainedReference:
    """transformers' model from the folder through `from_pretrained`, so its own loader reads
    the checkpoint (per-expert or fused names); greedy through `generate`."""

    def __init__(self, path: str, overrides: dict[str, torch.Tensor] | None = None) -> None:
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        # No end of sequence: greedy runs its n tokens as treadle's ignore_eos does, with EOS a
        # token like any other (min_new_tokens would forbid it instead, changing the argmax).
        self.model.generation_config.eos_token_id = None
        if overrides:
            with torch.no_grad():
                params = dict(self.model.named_parameters())
                for name, tensor in overrides.items():
                    params[name].copy_(tensor)

    @torch.inference_mode()
    def greedy(self, ids: list[int], n: int = MAX_TOKENS, **generate_kwargs) -> list[int]:
        """`generate_kwargs`: more of generate's, e.g. repetition_penalty (CTRL's, as treadle's)."""
        out = self.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                  pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  **generate_kwargs)
        return out[0, len(ids):].tolist()

    @torch.inference_mode()
    def prompt_logprobs(self, ids: list[int]) -> torch.Tensor:
        """log p(token i | tokens before it), for i >= 1."""
        lps = torch.log_softmax(self.model(torch.tensor([ids])).logits[0].float(), dim=-1)
        return lps[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def random_prompts(n: int, shortest: int, seed: int) -> list[list[int]]:
    """n prompts of ordinary token ids, `shortest` tokens long and 17 more each."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40000, (shortest + 17 * i,), generator=gen).tolist() for i in range(n)]


def greedy_ids(llm: LLM, batch: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]
