"""Turns logits into tokens: allowed_token_ids, bad_words, logit_bias, min_tokens, penalties,
grammar masks, temperature, top-k/top-p/min-p, logprobs (of the raw logits, before any of these,
as vLLM's default).

Every step that touches the [rows, vocab] logits is one batched tensor operation over the rows
that need it; Python walks the rows only to build small index and parameter tensors from their
metadata, which go up from pinned memory (treadle/device_copy.py: no row is picked with a Python
list, which would be a copy that waits for the GPU). So the same code runs on a GPU without a
per-row launch or a host sync: `Sampler.sample` returns its results as device tensors
(`SamplerOutput`), and `SamplerOutput.to_lists` is the one place they come down, in one wait.

Randomness is positional and counter-based (`sampling_random.py`): the noise for a request's
k-th output token is a hash of (request seed, k, token index). A seeded request therefore samples
the same tokens whatever else is in the batch, in whichever row, whether or not it was preempted
and recomputed on the way, and the uniforms behind them are the same bits on CPU and CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import numpy as np
import torch

from treadle.core.scheduler_output import TokenLogprobs
from treadle.device_copy import to_device, to_host
from treadle.kernels.cpu import cpu_kernels_available
from treadle.sampling_params import SamplingParams
from treadle.worker.grammar import GrammarMask, apply_token_bitmask
from treadle.worker.request_state import PLACEHOLDER, argmax_from, has_penalties
from treadle.worker.sampling_random import exponential_noise, row_key

if TYPE_CHECKING:
    from treadle.worker.request_state import RequestSlots


@dataclass
class SamplingRow:
    params: SamplingParams
    seed: int
    prompt_ids: np.ndarray
    output_ids: np.ndarray   # a PLACEHOLDER where a deferred step's token is still on the device
    eos_token_id: int | None
    slot: int = 0            # the request's slot (finds its deferred token)


class DeviceTokens(Protocol):
    """Tokens still on the device (worker/deferred_step.py's DeferredStep)."""

    def device_tokens_for(self, token_slot: np.ndarray, positions: np.ndarray
                          ) -> tuple[np.ndarray, torch.Tensor] | None:
        """The entries (slot, position) that are its tokens, and those tokens on the device."""


def sampling_rows(slots: RequestSlots, slot_ids: Sequence[int],
                  drafts: Sequence[Sequence[int]] | None = None) -> list[SamplingRow]:
    """The rows to sample for these slots' requests: one each, or 1 + k for a request verifying
    k drafts. Row j of a request sees as its output history the outputs so far plus its first j
    drafts, so each position samples as decoding one token at a time would (same penalties
    history, same positional seed)."""
    rows: list[SamplingRow] = []
    for i, slot in enumerate(slot_ids):
        slot = int(slot)
        outputs, prompt = slots.output_ids(slot), slots.prompt_ids(slot)
        d = drafts[i] if drafts is not None else ()
        for j in range(len(d) + 1):
            history = outputs if j == 0 else np.concatenate([outputs, np.asarray(d[:j], dtype=outputs.dtype)])
            rows.append(SamplingRow(slots.params[slot], slots.seeds[slot], prompt, history,
                                    slots.eos_token_ids[slot], slot))
    return rows


@dataclass
class BatchedLogprobs:
    """Logprobs for some rows, as device tensors: each row's chosen token, its logprob and rank,
    and the top max(num_top) tokens (a row keeps its first num_top of them)."""

    num_top: list[int]
    token_ids: torch.Tensor    # [n] int64
    chosen: torch.Tensor       # [n] fp32
    ranks: torch.Tensor        # [n] int32, 1 for the most likely token
    top_ids: torch.Tensor      # [n, max num_top] int64
    top_values: torch.Tensor   # [n, max num_top] fp32

    def tensors(self) -> list[torch.Tensor]:
        return [self.token_ids, self.chosen, self.ranks, self.top_ids, self.top_values]

    def to_lists(self, host: list[torch.Tensor] | None = None) -> list[TokenLogprobs]:
        """As Python lists; `host`: `tensors()` already brought to the host."""
        ids, chosen, ranks, top_ids, top_values = (t.tolist() for t in host or to_host(*self.tensors()))
        return [TokenLogprobs(token_ids=[t] + ti[:n], logprobs=[c] + tv[:n], rank=r)
                for t, c, r, ti, tv, n
                in zip(ids, chosen, ranks, top_ids, top_values, self.num_top)]


@dataclass(slots=True)
class SamplerOutput:
    """A step's samples, still on the device."""

    token_ids: torch.Tensor              # [rows] int64
    logprobs: BatchedLogprobs | None     # for the rows in `logprob_rows`
    logprob_rows: list[int]
    # [rows] bool: the request's own constraints ruled out every token (its token is a
    # placeholder, 0, and the runner ends the request); None where no row could be.
    ruled_out: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        return ([self.token_ids] + (self.logprobs.tensors() if self.logprobs is not None else [])
                + ([self.ruled_out] if self.ruled_out is not None else []))

    def rows_ruled_out(self, host: list[torch.Tensor]) -> set[int]:
        """The rows with no token left to sample (`host`: `tensors()` on the host)."""
        return set() if self.ruled_out is None else set(host[-1].nonzero().flatten().tolist())

    def to_lists(self, host: list[torch.Tensor] | None = None
                 ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """The tokens and per-row logprobs (None where a row asked for none) as Python values:
        where the step's results leave the device, in one wait (`host`: `tensors()` brought to
        the host already, in the step's one wait)."""
        host = host or to_host(*self.tensors())
        tokens = host[0].tolist()
        if self.logprobs is None:
            return tokens, [None] * len(tokens)
        out: list[TokenLogprobs | None] = [None] * len(tokens)
        lp_host = host[1:1 + len(self.logprobs.tensors())]
        for i, lp in zip(self.logprob_rows, self.logprobs.to_lists(lp_host)):
            out[i] = lp
        return tokens, out


def ruled_out_error(num_output: int) -> str:
    """Why a request whose row had no token left ends (SamplerOutput.ruled_out)."""
    return (f"no token can be sampled after {num_output} output token(s): the request's "
            f"allowed_token_ids, bad_words, min_tokens and structured outputs rule out every token")


def _may_rule_out_all(row: SamplingRow) -> bool:
    p = row.params
    return (p.allowed_token_ids is not None or bool(p.bad_words_token_ids)
            or len(row.output_ids) < p.min_tokens)


def _argmax_only(row: SamplingRow) -> bool:
    """Greedy, with nothing that edits the row's logits (a bias, min_tokens still to reach, a
    penalty) or reads its log-probabilities."""
    return len(row.output_ids) >= argmax_from(row.params)


def _put(logits: torch.Tensor, row_ids: list[int], token_ids: list[int],
         values: list[float] | float, accumulate: bool) -> None:
    """logits[row_ids[i], token_ids[i]] = (or +=) values[i], all in one index_put_."""
    if not row_ids:
        return
    device = logits.device
    if isinstance(values, float):
        values = [values] * len(row_ids)
    index = (to_device(row_ids, device), to_device(token_ids, device, torch.int64))
    logits.index_put_(index, to_device(values, device, logits.dtype), accumulate=accumulate)


def pending_tokens(deferred: DeviceTokens | None, slot_ids: np.ndarray,
                   positions: np.ndarray) -> torch.Tensor:
    """The tokens at these (slot, position) entries, every one a PLACEHOLDER whose token is
    still on the device (`deferred`'s), in the entries' order."""
    found = deferred.device_tokens_for(slot_ids, positions) if deferred is not None else None
    assert found is not None and len(found[0]) == len(slot_ids), "a deferred token went missing"
    return found[1]


def apply_allowed_token_ids(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Sets every token outside a row's allowed_token_ids to -inf, in place, for the rows that
    name them, together: each gets a row of -inf with 0 at its allowed tokens added."""
    picked = [i for i, r in enumerate(rows) if r.params.allowed_token_ids is not None]
    if not picked:
        return
    device = logits.device
    row_ids: list[int] = []
    token_ids: list[int] = []
    for k, i in enumerate(picked):
        allowed = rows[i].params.allowed_token_ids
        row_ids += [k] * len(allowed)
        token_ids += allowed
    outside = torch.full((len(picked), logits.shape[-1]), float("-inf"), device=device)
    _put(outside, row_ids, token_ids, 0.0, accumulate=False)
    index = to_device(picked, device)
    logits[index] = logits[index] + outside


def apply_bad_words(logits: torch.Tensor, rows: list[SamplingRow],
                    deferred: DeviceTokens | None = None) -> None:
    """Bans each bad word's last token, in place, in the rows whose output ends with the rest
    of the word (a one-token word in every row that has it), all in one masked write. Where the
    output's last token is still on the device (`deferred`'s), its part of the check is made
    there, with no wait for it."""
    row_ids: list[int] = []
    token_ids: list[int] = []
    # (pair index, slot, position, the token the word needs there) for checks on the device
    on_device: list[tuple[int, int, int, int]] = []
    for i, row in enumerate(rows):
        out = row.output_ids
        for word in row.params.bad_words_token_ids or ():
            rest = word[:-1]
            if len(rest) > len(out):
                continue
            tail = out[len(out) - len(rest):]
            if any(t != PLACEHOLDER and t != w for t, w in zip(tail, rest)):
                continue
            if rest and tail[-1] == PLACEHOLDER:
                on_device.append((len(row_ids), row.slot, len(row.prompt_ids) + len(out) - 1,
                                  rest[-1]))
            row_ids.append(i)
            token_ids.append(word[-1])
    if not row_ids:
        return
    device = logits.device
    index = (to_device(row_ids, device), to_device(token_ids, device, torch.int64))
    ban = torch.ones(len(row_ids), dtype=torch.bool, device=device)
    if on_device:
        pairs, slot_ids, positions, needed = (np.array(c, dtype=np.int64) for c in zip(*on_device))
        ban[to_device(pairs, device)] = (pending_tokens(deferred, slot_ids, positions)
                                         == to_device(needed, device))
    # A token two words end with is in `index` twice, perhaps banned by one check and not the
    # other: added, -inf wins whichever is written first.
    logits.index_put_(index, torch.where(ban, float("-inf"), 0.0), accumulate=True)


def apply_grammar_mask(logits: torch.Tensor, mask: GrammarMask,
                       deferred: DeviceTokens | None = None) -> None:
    """The grammar's masks, in place; a mask waiting on the reasoning's end token, where that
    token is still on the device (`deferred`'s), holds where the token is it."""
    ended = None
    if mask.if_token_ends:
        _, slot_ids, positions, tokens = (np.array(c, dtype=np.int64) for c in zip(*mask.if_token_ends))
        ended = pending_tokens(deferred, slot_ids, positions) == to_device(tokens, logits.device)
    apply_token_bitmask(logits, mask, ended)


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
    _put(logits, row_ids, token_ids, biases, accumulate=True)


def apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Bans EOS (unless ignore_eos) and the stop tokens of rows short of min_tokens, in place."""
    row_ids: list[int] = []
    token_ids: list[int] = []
    for i, row in enumerate(rows):
        p = row.params
        if len(row.output_ids) >= p.min_tokens:
            continue
        banned = list(p.stop_token_ids)
        if row.eos_token_id is not None and not p.ignore_eos:
            banned.append(row.eos_token_id)
        row_ids += [i] * len(banned)
        token_ids += banned
    _put(logits, row_ids, token_ids, float("-inf"), accumulate=False)


def token_counts(id_arrays: list[np.ndarray], vocab: int, device: torch.device,
                 deferred: Callable[[np.ndarray, np.ndarray], torch.Tensor] | None = None
                 ) -> torch.Tensor:
    """How often each token occurs in each array, [len(id_arrays), vocab] fp32: one scatter_add_
    over the arrays padded to one length with a spare column `vocab`, dropped at the end.
    `deferred(rows, columns)`: the device tokens behind the PLACEHOLDER entries there."""
    width = max(1, max(len(a) for a in id_arrays))
    padded = np.full((len(id_arrays), width), vocab, dtype=np.int64)
    for r, a in enumerate(id_arrays):
        padded[r, :len(a)] = a
    ids = to_device(padded, device)
    rows, columns = np.nonzero(padded == PLACEHOLDER)
    if len(rows):
        assert deferred is not None, "a token still on the device, and no step to read it from"
        ids[to_device(rows, device), to_device(columns, device)] = deferred(rows, columns)
    counts = torch.zeros(len(id_arrays), vocab + 1, device=device)
    counts.scatter_add_(1, ids, torch.ones(ids.shape, device=device))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow],
                    deferred: DeviceTokens | None = None) -> None:
    """Repetition (CTRL: seen in prompt or output), frequency and presence (OpenAI: output
    counts) penalties, in place, for the rows that have any, together. A row whose penalty is
    neutral (1.0, or 0.0) comes out bit-identical: x / 1, x * 1 and x - 0 are exact. An output
    token still on the device (`deferred`'s) is counted there, so this needs no wait for it."""
    picked = [i for i, r in enumerate(rows) if has_penalties(r.params)]
    if not picked:
        return
    device, vocab = logits.device, logits.shape[-1]
    params = [rows[i].params for i in picked]
    index = to_device(picked, device)
    sub = logits[index]

    def deferred_tokens(entry_rows: np.ndarray, columns: np.ndarray) -> torch.Tensor:
        picked_rows = [rows[picked[i]] for i in entry_rows.tolist()]
        slot_ids = np.array([r.slot for r in picked_rows], dtype=np.int64)
        positions = np.array([len(r.prompt_ids) for r in picked_rows], dtype=np.int64) + columns
        return pending_tokens(deferred, slot_ids, positions)

    counts = token_counts([rows[i].output_ids for i in picked], vocab, device, deferred_tokens)

    def column(values: list[float]) -> torch.Tensor:
        return to_device(values, device, sub.dtype)[:, None]

    if any(p.repetition_penalty != 1.0 for p in params):
        # Only rows with a repetition penalty need their prompt; the rest count an empty one.
        empty = np.empty(0, dtype=np.int64)
        prompts = [rows[i].prompt_ids if rows[i].params.repetition_penalty != 1.0 else empty
                   for i in picked]
        seen = (counts > 0) | (token_counts(prompts, vocab, device) > 0)
        rep = column([p.repetition_penalty for p in params])
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    if any(p.frequency_penalty != 0.0 for p in params):
        sub -= column([p.frequency_penalty for p in params]) * counts
    if any(p.presence_penalty != 0.0 for p in params):
        sub -= column([p.presence_penalty for p in params]) * (counts > 0).to(sub.dtype)
    logits[index] = sub


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._native_argmax = cpu_kernels_available(device)

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """torch.argmax(dim=-1), from the C++ kernel on CPU (torch's compares one value at a time),
        over fp32, bf16 or fp16 rows."""
        if self._native_argmax and logits.stride(-1) == 1:
            return torch.ops.treadle.argmax_rows(logits)
        return logits.argmax(dim=-1)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 grammar_mask: GrammarMask | None = None
                 ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """`sample`, converted to Python lists."""
        return self.sample(logits, rows, grammar_mask).to_lists()

    def sample_slots(self, logits: torch.Tensor, slots: RequestSlots, slot_ids: np.ndarray,
                     drafts: Sequence[Sequence[int]] | None = None,
                     grammar_mask: GrammarMask | None = None,
                     deferred: DeviceTokens | None = None) -> SamplerOutput:
        """`sample` for these slots' rows (`sampling_rows`). A step whose rows are all a plain
        argmax, as the slots' `argmax_from` tells at once, takes it without building them:
        most greedy steps, where a row each costs more host time than the argmax itself."""
        outputs = slots.num_tokens[slot_ids] - slots.num_prompt_tokens[slot_ids]
        if grammar_mask is None and (outputs >= slots.argmax_from[slot_ids]).all():
            return SamplerOutput(self._argmax(logits), None, [])
        return self.sample(logits, sampling_rows(slots, slot_ids, drafts), grammar_mask, deferred)

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow],
               grammar_mask: GrammarMask | None = None,
               deferred: DeviceTokens | None = None) -> SamplerOutput:
        """`grammar_mask`: the masks of rows under structured outputs.
        `logits` in the model's dtype: rows that only take the argmax read them as they are (a
        bf16 or fp16 value widens to fp32 exactly, so the answer is the same); the rest work in
        fp32. `logits` is this step's own tensor, so it may be edited in place. `deferred`: the
        step whose tokens are the PLACEHOLDERs in the rows' output (penalties count them, and
        bad words and the reasoning's end are checked against them)."""
        if grammar_mask is None and all(_argmax_only(r) for r in rows):
            # An argmax records no autograd history: the common greedy step skips entering
            # inference mode, which costs as much as the rest of this path.
            return SamplerOutput(self._argmax(logits), None, [])
        with torch.inference_mode():
            return self._edit_and_sample(logits, rows, grammar_mask, deferred)

    def _edit_and_sample(self, logits: torch.Tensor, rows: list[SamplingRow],
                         grammar_mask: GrammarMask | None,
                         deferred: DeviceTokens | None) -> SamplerOutput:
        logits = logits.float()
        device = logits.device
        logprob_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        raw_logprobs = None
        if logprob_rows:
            raw = logits if len(logprob_rows) == len(rows) else logits[to_device(logprob_rows, device)]
            raw_logprobs = torch.log_softmax(raw, dim=-1)

        # vLLM's order: allowed_token_ids, bad_words, logit_bias and min_tokens, then
        # penalties, then the grammar, before temperature and top-k/top-p.
        apply_allowed_token_ids(logits, rows)
        apply_bad_words(logits, rows, deferred)
        apply_logit_bias(logits, rows)
        apply_min_tokens(logits, rows)
        apply_penalties(logits, rows, deferred)
        if grammar_mask is not None:
            apply_grammar_mask(logits, grammar_mask, deferred)
        ruled_out = None
        if grammar_mask is not None or any(_may_rule_out_all(r) for r in rows):
            # A row whose constraints leave no token (allowed_token_ids outside the grammar, or
            # only stop tokens before min_tokens) samples a placeholder from a flat row instead
            # of NaN probabilities; the runner ends its request with the reason.
            ruled_out = torch.isneginf(logits).all(dim=-1)
            logits.masked_fill_(ruled_out[:, None], 0.0)

        greedy = [i for i, r in enumerate(rows) if r.params.temperature < 1e-5]
        random = [i for i, r in enumerate(rows) if r.params.temperature >= 1e-5]
        if not random:   # all greedy: no row copy of the [rows, vocab] logits
            tokens = self._argmax(logits)
        elif not greedy:
            tokens = self._sample(logits, rows)
        else:
            tokens = torch.empty(len(rows), dtype=torch.long, device=device)
            greedy_index, random_index = to_device(greedy, device), to_device(random, device)
            tokens[greedy_index] = self._argmax(logits[greedy_index])
            tokens[random_index] = self._sample(logits[random_index], [rows[i] for i in random])

        logprobs = None
        if raw_logprobs is not None:
            chosen = tokens if len(logprob_rows) == len(rows) else tokens[to_device(logprob_rows, device)]
            logprobs = batched_logprobs(raw_logprobs, chosen,
                                        [rows[i].params.logprobs for i in logprob_rows])
        return SamplerOutput(tokens, logprobs, logprob_rows, ruled_out)

    @staticmethod
    def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        device = logits.device
        temps = to_device([r.params.temperature for r in rows], device)
        logits = logits / temps[:, None]
        # The sort behind top-k/top-p is most of a step's sampling time: only rows that ask pay it.
        cut = [i for i, r in enumerate(rows) if r.params.top_k > 0 or r.params.top_p < 1.0]
        if cut:
            top_k = [rows[i].params.top_k for i in cut]
            top_p = [rows[i].params.top_p for i in cut]
            if len(cut) == len(rows):
                logits = _top_k_top_p(logits, top_k, top_p)
            else:
                index = to_device(cut, device)
                logits[index] = _top_k_top_p(logits[index], top_k, top_p)
        probs = torch.softmax(logits, dim=-1)
        if any(r.params.min_p > 0 for r in rows):
            min_p = to_device([r.params.min_p for r in rows], device)
            threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs.masked_fill_(probs < threshold, 0.0)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p; E from the row's key.
        keys = to_device([row_key(r.seed, len(r.output_ids)) for r in rows], device, torch.int64)
        return probs.div_(exponential_noise(keys, probs.shape[-1])).argmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ks = to_device([min(k, vocab) if k > 0 else vocab for k in top_k], logits.device)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= ks[:, None], float("-inf"))
    ps = to_device(top_p, logits.device, logits.dtype)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token once the mass strictly before it already reaches top_p; the first always
    # stays, even where a top_p below float32's smallest rounds to 0.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_logits = sorted_logits.masked_fill((mass_before >= ps[:, None]) & (ranks > 0),
                                              float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def batched_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]
                     ) -> BatchedLogprobs:
    """For each row of `logprobs` ([n, vocab]): the logprob and rank of `token_ids` ([n]) and
    the top num_top tokens, from one gather, one comparison and one topk of the largest
    num_top, without leaving the device."""
    chosen = logprobs.gather(1, token_ids[:, None])
    # An int32 count: torch's int64 sum of a bool [n, vocab] along rows runs at a third the speed.
    ranks = (logprobs > chosen).sum(dim=1, dtype=torch.int32) + 1
    top_values, top_ids = logprobs.topk(min(max(num_top, default=0), logprobs.shape[-1]), dim=-1)
    return BatchedLogprobs(num_top, token_ids, chosen[:, 0], ranks, top_ids, top_values)
