"""Turns logits into tokens: logit_bias, min_tokens, penalties, grammar masks, temperature,
top-k/top-p/min-p, logprobs (of the raw logits, before any of these, as vLLM's default).

Randomness is positional: the noise for a request's k-th output token comes from a generator
seeded with (request seed, k). A seeded request therefore samples the same tokens whatever else
is in the batch, and whether or not it was preempted and recomputed on the way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from treadle.core.scheduler_output import TokenLogprobs
from treadle.kernels.cpu import cpu_kernels_available
from treadle.sampling_params import SamplingParams
from treadle.worker.grammar import apply_token_bitmask

_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, position) pairs apart
_MASK63 = (1 << 63) - 1


@dataclass
class SamplingRow:
    params: SamplingParams
    seed: int
    prompt_ids: np.ndarray
    output_ids: np.ndarray
    eos_token_id: int | None


def _row_generator(gen: torch.Generator, seed: int, position: int) -> torch.Generator:
    gen.manual_seed((seed * _MIX + position + 1) & _MASK63)
    return gen


def _has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _argmax_only(row: SamplingRow) -> bool:
    """Greedy, with nothing that edits the row's logits (a bias, min_tokens still to reach, a
    penalty) or reads its log-probabilities."""
    p = row.params
    return (p.temperature < 1e-5 and p.logprobs is None and len(row.output_ids) >= p.min_tokens
            and not _has_penalties(p) and not p.logit_bias)


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Adds each row's logit_bias to its logits in place, all rows in one index_put_."""
    row_ids: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for i, row in enumerate(rows):
        bias = row.params.logit_bias
        if bias:
            row_ids += [i] * len(bias)
            token_ids += bias.keys()
            biases += bias.values()
    if not row_ids:
        return
    device = logits.device
    index = (torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device))
    logits.index_put_(index, torch.tensor(biases, dtype=logits.dtype, device=device),
                      accumulate=True)


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._gen = torch.Generator(device=device)
        self._native_argmax = cpu_kernels_available(device)

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """torch.argmax(dim=-1), from the C++ kernel on CPU (torch's compares one value at a time),
        over fp32, bf16 or fp16 rows."""
        if self._native_argmax and logits.stride(-1) == 1:
            return torch.ops.treadle.argmax_rows(logits)
        return logits.argmax(dim=-1)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 grammar_mask: tuple[torch.Tensor, list[int]] | None = None
                 ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """`grammar_mask`: (bitmask, the rows it covers) for rows under structured outputs.
        `logits` in the model's dtype: rows that only take the argmax read them as they are (a
        bf16 or fp16 value widens to fp32 exactly, so the answer is the same); the rest work in
        fp32."""
        if grammar_mask is None and all(_argmax_only(r) for r in rows):
            return self._argmax(logits).tolist(), [None] * len(rows)
        logits = logits.float()
        num_logprobs = [r.params.logprobs for r in rows]
        raw_logprobs = (torch.log_softmax(logits, dim=-1)
                        if any(n is not None for n in num_logprobs) else None)

        # `logits` is this step's own tensor, so it may be edited in place. The order is vLLM's:
        # logit_bias and min_tokens, then penalties.
        apply_logit_bias(logits, rows)
        for i, row in enumerate(rows):
            self._apply_min_tokens(logits[i], row)
            self._apply_penalties(logits[i], row)
        if grammar_mask is not None:   # after penalties, before temperature and top-k/top-p
            apply_token_bitmask(logits, *grammar_mask)

        greedy = [i for i, r in enumerate(rows) if r.params.temperature < 1e-5]
        random = [i for i, r in enumerate(rows) if r.params.temperature >= 1e-5]
        if not random:   # all greedy: no row copy of the [rows, vocab] logits
            tokens = self._argmax(logits)
        else:
            tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
            if greedy:
                tokens[greedy] = self._argmax(logits[greedy])
            tokens[random] = self._sample(logits[random], [rows[i] for i in random])
        token_list = tokens.tolist()

        out_logprobs: list[TokenLogprobs | None] = []
        for i, n in enumerate(num_logprobs):
            out_logprobs.append(None if n is None else token_logprobs(raw_logprobs[i], token_list[i], n))
        return token_list, out_logprobs

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        temps = torch.tensor([r.params.temperature for r in rows], device=logits.device)
        logits = logits / temps[:, None]
        top_k = [r.params.top_k for r in rows]
        top_p = [r.params.top_p for r in rows]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            logits = _top_k_top_p(logits, top_k, top_p)
        probs = torch.softmax(logits, dim=-1)
        min_p = torch.tensor([r.params.min_p for r in rows], device=logits.device)
        if bool((min_p > 0).any()):
            threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, one noise vector per row.
        noise = torch.empty_like(probs)
        for i, row in enumerate(rows):
            noise[i].exponential_(generator=_row_generator(self._gen, row.seed, len(row.output_ids)))
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _apply_min_tokens(logits: torch.Tensor, row: SamplingRow) -> None:
        if len(row.output_ids) >= row.params.min_tokens:
            return
        banned = list(row.params.stop_token_ids)
        if row.eos_token_id is not None and not row.params.ignore_eos:
            banned.append(row.eos_token_id)
        if banned:
            logits[banned] = float("-inf")

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, row: SamplingRow) -> None:
        p = row.params
        if not _has_penalties(p):
            return
        vocab = logits.shape[0]
        out_ids = torch.from_numpy(row.output_ids.astype(np.int64)).to(logits.device)
        counts = torch.bincount(out_ids, minlength=vocab)[:vocab].to(logits.dtype)
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            seen[torch.from_numpy(row.prompt_ids.astype(np.int64)).to(logits.device)] = True
            penalised = torch.where(logits > 0, logits / p.repetition_penalty,
                                    logits * p.repetition_penalty)
            logits.copy_(torch.where(seen, penalised, logits))
        if p.frequency_penalty != 0.0:
            logits -= p.frequency_penalty * counts
        if p.presence_penalty != 0.0:
            logits -= p.presence_penalty * (counts > 0).to(logits.dtype)


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ks = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= ks[:, None], float("-inf"))
    ps = torch.tensor(top_p, device=logits.device, dtype=logits.dtype)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token once the mass strictly before it already reaches top_p; the first always stays.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= ps[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def token_logprobs(logprobs: torch.Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    """The chosen token's logprob and rank, then the top `num_top` (rank 1 first)."""
    chosen = logprobs[token_id]
    rank = int((logprobs > chosen).sum().item()) + 1
    ids, values = [token_id], [float(chosen)]
    if num_top > 0:
        top_vals, top_ids = logprobs.topk(num_top)
        ids += top_ids.tolist()
        values += top_vals.tolist()
    return TokenLogprobs(token_ids=ids, logprobs=values, rank=rank)
