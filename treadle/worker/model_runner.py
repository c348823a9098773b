"""Runs one scheduled step: updates the slots, flattens the batch, runs the model, samples."""

from __future__ import annotations

import logging
import time
from typing import Iterable

import numpy as np
import torch

from treadle.attention.backend import AttentionMetadata, assign_kv_groups, create_attention_backend
from treadle.config import TreadleConfig, max_steps_in_flight
from treadle.core.scheduler_output import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from treadle.device_copy import to_device
from treadle.distributed.parallel_state import ParallelContext
from treadle.distributed.pipeline import StageLink
from treadle.kv_transfer import KVConnectorOutput, KVConnectorRole, create_connector
from treadle.models import linear
from treadle.models.loader import iter_hf_weights, prepare_model
from treadle.models.registry import get_model_class
from treadle.worker.cuda_graphs import DecodeGraphs
from treadle.worker.deferred_step import PLACEHOLDER, DeferredStep, plain
from treadle.worker.grammar import GrammarMatchers
from treadle.worker.device import worker_device
from treadle.worker.request_state import RequestSlots
from treadle.worker.sampled_inbox import SampledInbox
from treadle.worker.sampler import Sampler, SamplingRow, logprobs_lists
from treadle.worker.spec_decode.ngram import NgramProposer

logger = logging.getLogger(__name__)

# The largest decode batch with a CUDA graph of its own (vLLM's default too); larger ones run eagerly.
MAX_GRAPH_BATCH = 256


class ModelRunner:
    def __init__(self, config: TreadleConfig, ctx: ParallelContext | None = None) -> None:
        self.config = config
        self.ctx = ctx = ctx or ParallelContext()
        self.layers = ctx.layer_range(config.model.num_layers)
        self.num_kv_heads = max(1, config.model.num_kv_heads // ctx.tp_size)
        # With pipeline stages: the traffic between them, and (before the last stage) the
        # tokens the last stage sampled, which come back later.
        self.link: StageLink | None = None
        self.inbox: SampledInbox | None = None
        self.step = 0   # steps run so far; the same count on every rank
        self.num_blocks = 0
        self._weights_discarded = False   # by sleep(level=2), until a full load
        self.device = torch.device(config.device)
        self.on_device = worker_device(self.device)
        self.native_kernels = self.on_device.native_kernels
        self.dtype = config.model.dtype
        self.block_size = config.cache.block_size
        self.kv_groups = config.cache.kv_groups   # which layers share a block table
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.attention = create_attention_backend(config.attention_backend, self.device, self.block_size)
        self.slots: RequestSlots | None = None
        self.graphs: DecodeGraphs | None = None   # decode steps' CUDA graphs, where they serve
        self.grammars: GrammarMatchers | None = None   # where this rank samples
        self.sampler = Sampler(self.device)
        spec = config.speculative
        self.proposer = (NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max,
                                       spec.num_speculative_tokens) if spec is not None else None)
        self.connector = create_connector(config, KVConnectorRole.WORKER)
        if self.connector is not None:   # it moves this rank's layers and KV heads
            self.connector.bind_rank(ctx.rank, ctx.pp_rank, ctx.tp_rank)
        # Steps whose sampled tokens stay on the device until the next step is queued
        # (worker/deferred_step.py): only the in-process executor, with async scheduling, turns
        # this on (`allow_deferred_steps`); `_pending` is the last such step, unfinished.
        self.defer_steps = False
        self._pending: DeferredStep | None = None

    # -- set-up ------------------------------------------------------------------
    def load_model(self) -> None:
        cfg = self.config.model
        start = time.perf_counter()
        model_cls = get_model_class(cfg.hf_config)
        # Built without initial values: the strict load below sets every parameter, so a
        # random init would be wasted (about a second of start-up for SmolLM2).
        # The parameters get their dtype while still on meta, then their memory (the device's:
        # in huge pages on CPU), and the load converts each tensor as it copies it in: one copy in all.
        with torch.device("meta"):
            model = model_cls(cfg.hf_config, max_positions=cfg.max_model_len, ctx=self.ctx)
        self.model = model.to(dtype=self.dtype).eval()
        assign_kv_groups(self.model, self.kv_groups)
        self._param_shapes = {n: tuple(p.shape) for n, p in self.model.named_parameters()}
        model.to_empty(device=self.device)   # the buffers; the parameters get theirs next
        self._materialize_weights()
        model.load_weights(iter_hf_weights(cfg.model))
        logger.info("read the weights in %.1fs; packing and warming the kernels",
                    time.perf_counter() - start)
        # RoPE tables are computed, not loaded, and stay fp32, as in transformers.
        self.model.model.rotary.compute_tables()
        # LongRoPE past the original context: a long request's tokens read the long factors'
        # tables, this many rows on (models/rope.py).
        self.long_rope_offset = self.model.model.rotary.long_rope_offset
        self.model.quantization = cfg.quantization
        self.model.gguf_file = cfg.gguf_file
        if self.native_kernels:
            self.model.use_cpu_kernels()
        if self.attention.name == "triton":   # its ops take over the norms, RoPE, activation
            self.model.use_triton_ops()
        self.model.pack_weights()
        if self.model.is_packed:
            warm = time.perf_counter()
            ran = linear.warm_up_gemms(self.model, self.config.scheduler.max_num_batched_tokens)
            logger.debug("warmed up %d GEMMs in %.2fs", ran, time.perf_counter() - warm)
        if self.ctx.pp_size > 1:
            self.link = StageLink(self.ctx, cfg.hf_config.hidden_size, self.dtype, self.device)
            if not self.ctx.is_last_stage:
                self.inbox = SampledInbox(self.link, max_steps_in_flight(self.config))
        logger.info("loaded %s (%s) in %.1fs", cfg.model, model_cls.__name__,
                    time.perf_counter() - start)

    def init_kv_cache(self, num_blocks: int) -> None:
        cfg = self.config.model
        self.num_blocks = num_blocks
        start = time.perf_counter()
        self._allocate_kv_cache()
        logger.info("allocated %d KV blocks in %.1fs", num_blocks, time.perf_counter() - start)
        self.on_device.release_cached_memory()   # what loading and packing freed
        max_blocks_per_req = -(-cfg.max_model_len // self.block_size)
        self.slots = RequestSlots(self.config.scheduler.max_num_seqs, cfg.max_model_len,
                                  max_blocks_per_req, self.kv_groups.num_groups)
        if self.ctx.is_last_stage:
            self.grammars = GrammarMatchers(self.config, self.slots)

    def capture_decode_graphs(self) -> None:
        """CUDA graphs of decode steps (worker/cuda_graphs.py), where they can serve: on a GPU,
        on the triton backend, with one worker, for a model that reads nothing back in its
        forward (not MoE), with one KV cache group, unless enforce_eager."""
        self.graphs = None
        if (not self.on_device.captures_graphs or self.config.enforce_eager
                or self.attention.name != "triton" or not self.model.capturable
                or self.ctx.tp_size * self.ctx.pp_size > 1 or self.kv_groups.is_hybrid):
            return
        sched = self.config.scheduler
        max_batch = min(sched.max_num_seqs, sched.max_num_batched_tokens, MAX_GRAPH_BATCH)
        self.graphs = DecodeGraphs(self.model, self.kv_caches, max_batch,
                                   self.slots.block_table.shape[2], self.device)

    def _keep_graphs_valid(self) -> None:
        """Capture again where the graphs' tensors moved (weights or cache given new memory)."""
        if self.graphs is not None and not self.graphs.valid_for(self.model, self.kv_caches):
            self.capture_decode_graphs()

    def free_kv_cache(self) -> None:
        """Let go of the KV cache (sleep, or after the profile step), connector's hold included."""
        self.graphs = None   # they read the cache
        self.kv_caches = []
        if self.connector is not None:   # its hold on the cache would keep the memory
            self.connector.register_kv_caches([])
        self.attention.release()

    def kv_block_bytes(self) -> int:
        """Bytes of one KV block here: this stage's cache tensors (a tensor per layer, or
        per layer of a group: core/kv_cache_groups.py), this rank's KV heads."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return (2 * len(self.kv_groups.tensors_of(self.layers)) * self.block_size
                * self.num_kv_heads * self.config.model.head_dim * elem)

    def _allocate_kv_cache(self) -> None:
        """A cache tensor per layer; with several KV cache groups, layer j of every group
        shares tensor j (each group writes only the blocks it holds)."""
        cfg = self.config.model
        shape = (2, self.num_blocks, self.block_size, self.num_kv_heads, cfg.head_dim)
        used = self.kv_groups.tensors_of(self.layers)
        tensors = dict(zip(used, self.on_device.zeros([(shape, self.dtype)] * len(used))))
        self.kv_caches = [tensors[self.kv_groups.layer_tensor[i]] for i in self.layers]
        if self.connector is not None:
            self.connector.register_kv_caches(self.kv_caches)

    def allow_deferred_steps(self) -> bool:
        """Defer plain steps' tokens (worker/deferred_step.py) where the runner alone makes the
        step's output: one rank, no drafts to propose, no KV connector. Returns whether it does."""
        self.defer_steps = (self.proposer is None and self.connector is None
                            and self.ctx.tp_size * self.ctx.pp_size == 1)
        return self.defer_steps

    # -- the step ------------------------------------------------------------------
    def _update_slots(self, so: SchedulerOutput, previous: DeferredStep | None = None) -> None:
        slots = self.slots
        for rid in so.finished_req_ids:
            if previous is not None and rid in slots.slot_of:
                previous.drop(slots.slot_of[rid])   # its deferred token must not reach the slot
            slots.remove(rid)
        for new in so.scheduled_new_reqs:
            slot = slots.add(new, self.step)
            if self.grammars is not None:
                self.grammars.attach(slot, new)
        cached = so.scheduled_cached_reqs
        for rid, blocks, num_computed, num_null in zip(
                cached.req_ids, cached.new_block_ids, cached.num_computed_tokens,
                cached.num_null_blocks, strict=True):
            slot = slots.slot_of[rid]
            assert slots.num_computed_tokens[slot] == num_computed, (
                f"{rid}: runner has {slots.num_computed_tokens[slot]} computed, scheduler {num_computed}")
            slots.append_blocks(slot, blocks)
            slots.null_leading_blocks(slot, num_null)   # given back behind the sliding window

    @torch.inference_mode()
    def execute_profile_step(self, so: SchedulerOutput) -> None:
        """A step that no KV connector sees: worker/memory_profile.py's, on a throwaway cache."""
        self._update_slots(so)
        self._execute(so)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | DeferredStep:
        """The step's output; a DeferredStep where its tokens are still on the device, which
        `finish_deferred` (or the next step) turns into the output."""
        self.step += 1
        previous, self._pending = self._pending, None
        defer = self.defer_steps and self._plain(so)
        if previous is not None and not defer:
            previous.finish(self.slots)   # this step reads its tokens on the host
            previous = None
        self._update_slots(so, previous)
        if self.connector is None:
            if not so.total_num_scheduled_tokens:
                return ModelRunnerOutput.empty()
            out = self._execute(so, previous, defer)
            if previous is not None:   # queued behind this step: now wait for its tokens
                previous.finish(self.slots)
            return out
        # Loads land before the forward pass reads them (asynchronous ones in blocks nothing
        # reads until they are done); saves follow it. A step may only poll for loads.
        connector = self.connector
        connector.bind_connector_metadata(so.kv_connector_metadata)
        finished_sending, finished_recving = connector.get_finished(so.finished_req_ids)
        connector.start_load_kv()
        out = self._execute(so) if so.total_num_scheduled_tokens else ModelRunnerOutput.empty()
        connector.wait_for_save()
        connector.clear_connector_metadata()
        out.kv_connector_output = KVConnectorOutput(
            finished_sending, finished_recving, connector.get_block_ids_with_load_errors(),
            connector.get_dropped_saves())
        return out

    def finish_deferred(self, step: DeferredStep) -> ModelRunnerOutput:
        """A deferred step's output, waiting for its tokens if no later step has yet."""
        if self._pending is step:
            self._pending = None
        return step.finish(self.slots)

    def _plain(self, so: SchedulerOutput) -> bool:
        """Whether every request of the step is plain (worker/deferred_step.py) and none
        verifies drafts."""
        if so.scheduled_spec_decode_tokens:
            return False
        params = [new.sampling_params for new in so.scheduled_new_reqs]
        params += [self.slots.params[self.slots.slot_of[rid]]
                   for rid in so.scheduled_cached_reqs.req_ids]
        return all(plain(p) for p in params)

    def _execute(self, so: SchedulerOutput, previous: DeferredStep | None = None,
                 defer: bool = False) -> ModelRunnerOutput | DeferredStep:
        """The step; with `previous`, the rows at its deferred tokens' positions read them from
        the device; with `defer`, this step's own tokens stay there (a DeferredStep)."""
        slots = self.slots

        req_ids = list(so.num_scheduled_tokens)
        idx = np.array([slots.slot_of[r] for r in req_ids], dtype=np.int64)
        q_lens = np.array([so.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
        ctx = slots.num_computed_tokens[idx]
        # Decodes first: the attention backend batches them. A step verifying drafts is a
        # short chunk of 1 + k tokens to the backend.
        is_decode = (q_lens == 1) & (ctx > 0)
        decodes = np.flatnonzero(is_decode)
        # Longest first, as the backend expects: it cuts decodes into contiguous runs of
        # similar length.
        decodes = decodes[np.argsort(-ctx[decodes], kind="stable")]
        order = np.concatenate([decodes, np.flatnonzero(~is_decode)])
        req_ids = [req_ids[i] for i in order]
        idx, q_lens, ctx = idx[order], q_lens[order], ctx[order]
        drafts = [so.scheduled_spec_decode_tokens.get(rid, []) for rid in req_ids]
        for slot, d in zip(idx, drafts):
            if d:   # scratch space past the known tokens; verified tokens overwrite it
                n = int(slots.num_tokens[slot])
                slots.token_ids[slot, n:n + len(d)] = d

        num_drafts = np.array([len(d) for d in drafts], dtype=np.int64)
        ends = ctx + q_lens
        if self.inbox is not None:   # tokens this step reads may still be on their way back
            self.inbox.receive_for(self.step, slots, idx, ends - num_drafts)
        total = int(q_lens.sum())
        starts = np.cumsum(q_lens) - q_lens
        positions = np.arange(total) - np.repeat(starts, q_lens) + np.repeat(ctx, q_lens)
        token_slot = np.repeat(idx, q_lens)
        input_ids = slots.token_ids[token_slot, positions]
        patch = (previous.device_tokens_for(token_slot, positions, slots.max_num_reqs)
                 if previous is not None else None)
        assert np.array_equal(np.flatnonzero(input_ids == PLACEHOLDER),
                              patch[0] if patch is not None else []), (
            "the rows reading a deferred token are not the ones its step provides")
        rope_positions = positions
        if self.long_rope_offset:
            rope_positions = positions + self.long_rope_offset * slots.long_rope[token_slot]
        if (self.graphs is not None and len(decodes) == len(idx)
                and self.graphs.padded_size(len(idx)) is not None):
            # Every request decodes one token: a CUDA graph's step (worker/cuda_graphs.py).
            block_table = slots.block_table[0, idx]   # graphs serve models with one group
            hidden = self.graphs.run(input_ids, rope_positions,
                                     self.attention.slots(q_lens, positions, block_table), ends,
                                     block_table, patch)
        else:
            meta = self.attention.build_group_metadata(q_lens, ctx, positions,
                                                       slots.block_table[:, idx])
            hidden = self._forward(input_ids, rope_positions, meta, patch)

        # Who samples is the scheduler's decision; the runner obeys it. A request samples
        # (1 + k tokens with k drafts) when its chunk reaches its last known token.
        samples = np.array([rid in so.num_in_flight_tokens for rid in req_ids], dtype=bool)
        reaches_end = ends - num_drafts == slots.num_tokens[idx]
        assert (ends - num_drafts <= slots.num_tokens[idx]).all() and (samples == reaches_end).all(), (
            f"the scheduler's sampling requests {sorted(so.num_in_flight_tokens)} disagree with "
            f"the runner's token counts for {[r for r, m in zip(req_ids, samples != reaches_end) if m]}")
        sampled: list[list[int]] = [[] for _ in req_ids]
        if not self.ctx.is_last_stage:
            # The same bookkeeping as the last stage, which samples and sends the tokens back.
            slots.num_computed_tokens[idx] = ends
            self.inbox.expect(self.step, [req_ids[r] for r in np.flatnonzero(samples)])
            return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)
        logprobs: dict[str, list[TokenLogprobs]] = {}
        request_errors: dict[str, str] = {}
        if samples.any() and defer:
            return self._defer(hidden, req_ids, idx, np.flatnonzero(samples),
                               starts + q_lens - 1, ends)
        if samples.any():
            rows = np.flatnonzero(samples)
            sampled_rows, logprobs_rows, slot_errors = self._sample_and_verify(
                hidden, idx[rows], starts[rows] + q_lens[rows] - 1 - num_drafts[rows],
                [drafts[r] for r in rows])
            request_errors = {req_ids[r]: slot_errors[int(idx[r])] for r in rows
                              if int(idx[r]) in slot_errors}
            for r, tokens, lps in zip(rows, sampled_rows, logprobs_rows):
                slot = int(idx[r])
                for tok in tokens:
                    slots.append_token(slot, tok)
                sampled[r] = tokens
                if lps is not None:
                    logprobs[req_ids[r]] = lps
                # Rejected drafts were computed but are not part of the sequence.
                ends[r] -= num_drafts[r] - (len(tokens) - 1)
            if self.link is not None:
                self.link.send_sampled([t for r in rows for t in sampled[r]])
        slots.num_computed_tokens[idx] = ends

        draft_token_ids: dict[str, list[int]] = {}
        if self.proposer is not None:
            for r in np.flatnonzero(samples):
                slot = int(idx[r])
                if (slots.params[slot].extra_args or {}).get("speculative_decoding") is False:
                    continue
                draft_token_ids[req_ids[r]] = self.grammars.valid_drafts(slot, self.proposer.propose(
                    slots.token_ids[slot, :slots.num_tokens[slot]]))

        prompt_logprobs = self._prompt_logprobs(req_ids, idx, starts, q_lens, ctx, hidden)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, logprobs=logprobs,
                                 prompt_logprobs=prompt_logprobs, draft_token_ids=draft_token_ids,
                                 request_errors=request_errors)

    def _defer(self, hidden: torch.Tensor, req_ids: list[str], idx: np.ndarray, rows: np.ndarray,
               last_rows: np.ndarray, ends: np.ndarray) -> DeferredStep:
        """Queue the sampling of `rows` (requests; `last_rows`: each request's last input row)
        and leave their tokens on the device: the slots advance over a PLACEHOLDER each."""
        slots = self.slots
        slot_ids = idx[rows]
        sampling_rows = [SamplingRow(slots.params[s], slots.seeds[s], slots.prompt_ids(s),
                                     slots.output_ids(s), slots.eos_token_ids[s]) for s in slot_ids]
        logits = self.model.compute_logits(hidden[to_device(last_rows[rows], self.device, torch.int64)])
        samples = self.sampler.sample(logits, sampling_rows)
        positions = slots.num_tokens[slot_ids].copy()
        for slot in slot_ids:
            slots.append_token(slot, PLACEHOLDER)
        slots.num_computed_tokens[idx] = ends
        self._pending = DeferredStep(req_ids, rows, slot_ids, positions, samples)
        return self._pending

    def _forward(self, input_ids: np.ndarray, positions: np.ndarray, meta: AttentionMetadata,
                 patch: tuple[np.ndarray, torch.Tensor] | None = None) -> torch.Tensor:
        """This stage's part of the model; hidden states come from the stage before and go to
        the stage after. `positions` index the RoPE tables (a LongRoPE request's past the
        short ones); `patch`: input rows and the device tokens they take (a deferred step's)."""
        hidden_in = None
        if self.link is not None and not self.ctx.is_first_stage:
            hidden_in = self.link.recv_hidden(len(positions))
        ids = to_device(input_ids, self.device) if self.ctx.is_first_stage else None
        if patch is not None:
            ids[to_device(patch[0], self.device)] = patch[1]
        hidden = self.model(ids, to_device(positions, self.device), self.kv_caches, meta, hidden_in)
        if self.link is not None and not self.ctx.is_last_stage:
            self.link.send_hidden(hidden)
        return hidden

    def _sample_and_verify(self, hidden: torch.Tensor, slot_ids: np.ndarray, first_rows: np.ndarray,
                           drafts: list[list[int]]) -> tuple[
                               list[list[int]], list[list[TokenLogprobs] | None], dict[int, str]]:
        """Sample each request's next token; with k drafts, sample all 1 + k positions and keep
        the drafts up to the first one the sample disagrees with, plus that sample. Also returns,
        per slot whose grammar refused its tokens, why its request ends.

        Each position samples exactly as decoding one token at a time would (same penalties
        history, same positional seed), so output is identical with and without drafts: greedy
        keeps the longest matching prefix plus the bonus token, and a sampled draft d survives
        with probability p(d), else the sample comes from p without d — the same law as
        rejection sampling against one-hot n-gram drafts.
        """
        slots = self.slots
        row_index: list[int] = []
        sampling_rows: list[SamplingRow] = []
        for slot, first, d in zip(slot_ids, first_rows, drafts):
            outputs = slots.output_ids(slot)
            for j in range(len(d) + 1):
                row_index.append(int(first) + j)
                history = outputs if j == 0 else np.concatenate([outputs, np.asarray(d[:j], dtype=outputs.dtype)])
                sampling_rows.append(SamplingRow(slots.params[slot], slots.seeds[slot],
                                                 slots.prompt_ids(slot), history, slots.eos_token_ids[slot]))
        logits = self.model.compute_logits(hidden[to_device(row_index, self.device, torch.int64)])
        tokens, token_lps = self.sampler(logits, sampling_rows,
                                         self.grammars.bitmask(slot_ids, drafts))
        out_tokens, out_lps, errors = [], [], {}
        pos = 0
        for slot, d in zip(slot_ids, drafts):
            accepted = 0
            while accepted < len(d) and tokens[pos + accepted] == d[accepted]:
                accepted += 1
            out_tokens.append(tokens[pos:pos + accepted + 1])
            if (error := self.grammars.accept(int(slot), out_tokens[-1])) is not None:
                errors[int(slot)] = error
            lps = token_lps[pos:pos + accepted + 1]
            out_lps.append(None if lps[0] is None else lps)
            pos += len(d) + 1
        return out_tokens, out_lps, errors

    def _prompt_logprobs(self, req_ids, idx, starts, q_lens, ctx, hidden
                         ) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        """Logprobs of the prompt tokens this chunk predicts: position p scores token p + 1."""
        out = {}
        for i, rid in enumerate(req_ids):
            slot = int(idx[i])
            num_top = self.slots.params[slot].prompt_logprobs
            if num_top is None:
                continue
            n_prompt = int(self.slots.num_prompt_tokens[slot])
            first, stop = int(ctx[i]), min(int(ctx[i] + q_lens[i]), n_prompt - 1)
            if stop <= first:
                out[rid] = (first + 1, [])
                continue
            rows = torch.arange(int(starts[i]), int(starts[i]) + stop - first, device=self.device)
            lps = torch.log_softmax(self.model.compute_logits(hidden[rows]).float(), dim=-1)
            targets = self.slots.token_ids[slot, first + 1:stop + 1]
            out[rid] = (first + 1, logprobs_lists(lps, targets, num_top))
        return out

    # -- RL controls: weights and sleep ------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy transformers-named tensors into the model in place; returns how many were set.

        A subset is fine, except after sleep(level=2), when every weight must come back.
        """
        return self._copy_weights(named_tensors, strict=self._weights_discarded)

    def load_weights(self, path: str) -> int:
        """Reload every weight from a folder or GGUF of the same architecture."""
        return self._copy_weights(iter_hf_weights(prepare_model(path)), strict=True)

    def check_weights(self, source: list[tuple[str, tuple[int, ...]]] | str) -> None:
        """Raise as update_weights (given (name, shape) pairs) or load_weights (given a path)
        would, changing nothing."""
        if isinstance(source, str):
            named_shapes = ((n, tuple(t.shape)) for n, t in iter_hf_weights(prepare_model(source)))
            strict = True
        else:
            named_shapes, strict = source, self._weights_discarded
        if self._weights_discarded:   # the weights a full load will fill anyway
            self._materialize_weights()
        self.model.check_weights(named_shapes, strict)

    def _copy_weights(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool) -> int:
        if self._weights_discarded:
            self._materialize_weights()
        loaded = self.model.load_weights(weights, strict=strict)   # re-packs a packed model
        self._weights_discarded = False
        if not self.model.is_packed:   # weights restored after sleep(level=2)
            self.model.pack_weights()
        self._keep_graphs_valid()
        return len(loaded)

    def sleep(self, level: int) -> None:
        """Level 1 frees the KV cache and moves weights to host memory (a no-op on CPU);
        level 2 discards the weights as well."""
        self.free_kv_cache()
        if level >= 2:
            self.model.unpack_weights()
            for param in self.model.parameters():
                param.data = torch.empty(0, dtype=param.dtype, device=self.device)
            self._weights_discarded = True
        else:
            self.on_device.offload(self.model)
        self.on_device.release_cached_memory()

    def wake_up(self, tags: list[str]) -> None:
        if "weights" in tags:
            if self._weights_discarded:
                raise RuntimeError("sleep(level=2) discarded the weights: call load_weights or "
                                   "update_weights with every weight before wake_up")
            self.on_device.reload(self.model)
        if "kv_cache" in tags and not self.kv_caches:
            self._allocate_kv_cache()
        if self.kv_caches and not self._weights_discarded:
            if self.graphs is None:
                self.capture_decode_graphs()
            else:
                self._keep_graphs_valid()

    def _materialize_weights(self) -> None:
        """Uninitialised memory for every parameter, for a load to fill."""
        named = list(self.model.named_parameters())
        memory = self.on_device.empty([(self._param_shapes[name], param.dtype) for name, param in named])
        for (_, param), data in zip(named, memory):
            param.data = data
