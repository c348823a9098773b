"""Phi-3 and Phi-4 (`Phi3ForCausalLM`): Llama layers whose checkpoints hold q/k/v in one
`qkv_proj` and gate/up in one `gate_up_proj`, with LongRoPE scaling (models/rope.py) and, in
Phi-4-mini, RoPE over part of each head.

The fused checkpoint weights are split into their parts on the way in, so a tensor-parallel rank
takes its slice of each part as for Llama, and the parts are fused again into this model's own
`qkv_proj` and `gate_up_proj`.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from treadle.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def biases(config) -> tuple[bool, bool]:
        return False, False

    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]
                           ) -> Iterator[tuple[str, torch.Tensor]]:
        config = self.config
        head_dim = self.model.rotary.head_dim
        q_rows = config.num_attention_heads * head_dim
        kv_rows = (config.num_key_value_heads or config.num_attention_heads) * head_dim
        for name, tensor in weights:
            if name.endswith(".self_attn.qkv_proj.weight"):
                prefix = name.removesuffix("qkv_proj.weight")
                if tensor.shape[0] != q_rows + 2 * kv_rows:
                    raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected "
                                     f"{q_rows + 2 * kv_rows} rows")
                q, k, v = tensor.split([q_rows, kv_rows, kv_rows])
                yield from ((prefix + "q_proj.weight", q), (prefix + "k_proj.weight", k),
                            (prefix + "v_proj.weight", v))
            elif name.endswith(".mlp.gate_up_proj.weight"):
                prefix = name.removesuffix("gate_up_proj.weight")
                gate, up = tensor.chunk(2, dim=0)
                yield from ((prefix + "gate_proj.weight", gate), (prefix + "up_proj.weight", up))
            else:
                yield name, tensor
