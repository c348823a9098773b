"""The correctness reference: Hugging Face transformers on the same weights, fp32, greedy; and
for the linear kernels alone, the same product in float64, and what they must do on a CPU
without their instructions."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import AutoModelForCausalLM

from treadle.models.loader import iter_hf_weights, load_hf_config, prepare_model


class HFReference:
    """Greedy decoding with transformers' own forward pass and KV cache, one prompt at a time.

    The weights come through treadle's loader (test_loader proves they equal transformers' own
    GGUF load), from the converted folder, which skips parsing the GGUF in every test session.
    """

    def __init__(self, path: str, overrides: list[tuple[str, torch.Tensor]] = ()) -> None:
        """`overrides`: (transformers name, tensor) pairs replacing weights of the checkpoint,
        as treadle's update_weights takes them."""
        path = prepare_model(path)
        config = load_hf_config(path)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        state = dict(iter_hf_weights(path))
        assert all(name in state for name, _ in overrides), "override of an unknown weight"
        state.update(overrides)
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected, unexpected
        assert all("lm_head" in m for m in missing), missing
        model.tie_weights()
        self.model = model.eval()
        self._memo: dict[tuple, list[int]] = {}

    @torch.inference_mode()
    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """Argmax decoding with no EOS handling (what treadle does with ignore_eos=True)."""
        key = (tuple(prompt_ids), max_new_tokens)
        if key in self._memo:
            return self._memo[key]
        ids = torch.tensor([prompt_ids])
        # transformers 5.24 renamed the cache `cache` (both in and out) and deprecates the old
        # name, which 5.40 drops; the GPU machine's 5.17 knows only the old one.
        kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        out, tokens = self.model(input_ids=ids, use_cache=True), []
        for _ in range(max_new_tokens):
            nxt = int(out.logits[0, -1].argmax())
            tokens.append(nxt)
            out = self.model(input_ids=torch.tensor([[nxt]]), use_cache=True, **{kw: out[kw]})
        self._memo[key] = tokens
        return tokens

    @torch.inference_mode()
    def prompt_logprobs(self, prompt_ids: list[int]) -> torch.Tensor:
        """log p(token i | tokens < i) for i >= 1."""
        logits = self.model(input_ids=torch.tensor([prompt_ids])).logits[0].float()
        lps = torch.log_softmax(logits, dim=-1)
        return lps[:-1].gather(1, torch.tensor(prompt_ids[1:])[:, None])[:, 0]


def linear_float64(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T + b in float64, the reference the linear kernels are held to."""
    return x.double() @ w.double().T + (b.double() if b is not None else 0)


def refused_without(has_flags: bool, kernel: str, w: torch.Tensor, match: str) -> bool:
    """On a CPU without the instructions a linear kernel needs (`has_flags` false): holds its
    ops (`linear_{kernel}_ready`, `pack_linear_{kernel}`, `{kernel}_linear`) to refusing `w`
    with an error matching `match`, and says so. Where the CPU has them: False."""
    if has_flags:
        return False
    ops = torch.ops.treadle
    assert not getattr(ops, f"linear_{kernel}_ready")(w)
    with pytest.raises(RuntimeError, match=match):
        getattr(ops, f"{kernel}_linear")(torch.zeros(2, w.shape[1], dtype=w.dtype),
                                         getattr(ops, f"pack_linear_{kernel}")(w), None)
    return True
