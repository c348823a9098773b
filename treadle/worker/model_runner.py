"""Runs one scheduled step: updates the slots, flattens the batch, runs the model, samples."""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from treadle.attention.backend import AttentionMetadata, assign_kv_groups, create_attention_backend
from treadle.config import TreadleConfig, max_steps_in_flight
from treadle.core.scheduler_output import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from treadle.device_copy import to_device, to_host
from treadle.distributed.parallel_state import ParallelContext
from treadle.distributed.pipeline import StageLink
from treadle.kv_transfer import KVConnectorOutput, KVConnectorRole, create_connector
from treadle.models import linear
from treadle.models.loader import iter_hf_weights
from treadle.models.registry import get_model_class
from treadle.worker.cuda_graphs import DecodeGraphs
from treadle.worker.deferred_step import DeferredStep
from treadle.worker.grammar import GrammarMatchers
from treadle.worker.device import worker_device
from treadle.worker.request_state import PLACEHOLDER, RequestSlots
from treadle.worker.sampled_inbox import SampledInbox
from treadle.worker.prompt_logprobs import queue_prompt_logprobs
from treadle.worker.sampler import Sampler, SamplerOutput, ruled_out_error
from treadle.worker.spec_decode.ngram import NgramProposer
from treadle.worker.weight_controls import WeightControls

logger = logging.getLogger(__name__)

# The largest decode batch with a CUDA graph of its own (vLLM's default too); larger ones run eagerly.
MAX_GRAPH_BATCH = 256


class ModelRunner(WeightControls):
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
        # (worker/deferred_step.py): an executor with one worker on a GPU, with async
        # scheduling, turns this on (`allow_deferred_steps`; executor/uniproc.py, and mp.py's
        # lone worker); `_pending` is the last such step, unfinished.
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
        if (reason := self.attention.refuses(self.model)) is not None:
            if self.config.attention_backend is not None:
                raise ValueError(f"attention_backend {self.attention.name!r} cannot serve "
                                 f"{cfg.model}: {reason}; use attention_backend 'torch'")
            # The device's best backend cannot: the one that serves every model.
            logger.info("attention backend %s cannot serve this model (%s): torch instead",
                        self.attention.name, reason)
            self.attention = create_attention_backend("torch", self.device, self.block_size)
        if self.native_kernels:
            self.model.use_cpu_kernels()
        if self.attention.name == "triton":   # its ops take over the norms, RoPE, activation
            from treadle.models import triton_gemv
            self.model.use_triton_ops(few_row_linears=triton_gemv.enabled(self.device))
        self.model.pack_weights()
        if self.model.is_packed:
            warm = time.perf_counter()
            sched, spec = self.config.scheduler, self.config.speculative
            sampled_rows = sched.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0))
            ran = linear.warm_up_gemms(self.model, sched.max_num_batched_tokens,
                                       min(sampled_rows, sched.max_num_batched_tokens))
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

    @property
    def serves_graphs(self) -> bool:
        """Whether steps replay CUDA graphs (worker/cuda_graphs.py: decodes; mixed_graphs.py:
        steps with prefill chunks or drafts): on a GPU, on the triton backend, with one
        worker, for a model that reads nothing back in its forward (not MoE), with one KV
        cache group, unless enforce_eager."""
        return (self.on_device.captures_graphs and not self.config.enforce_eager
                and self.attention.name == "triton" and self.model.capturable
                and self.ctx.tp_size * self.ctx.pp_size == 1 and not self.kv_groups.is_hybrid)

    def capture_graphs(self) -> None:
        """Capture the decode and mixed-step graphs, where they serve (serves_graphs)."""
        self.graphs = None
        if not self.serves_graphs:
            return
        sched = self.config.scheduler
        max_batch = min(sched.max_num_seqs, sched.max_num_batched_tokens, MAX_GRAPH_BATCH)
        self.graphs = DecodeGraphs(self.model, self.kv_caches, max_batch,
                                   self.slots.block_table.shape[2], self.device,
                                   backend=self.attention,
                                   mixed_tokens=sched.max_num_batched_tokens,
                                   max_reqs=sched.max_num_seqs)

    def _keep_graphs_valid(self) -> None:
        """Capture again where the graphs' tensors moved (weights or cache given new memory)."""
        if self.graphs is not None and not self.graphs.valid_for(self.model, self.kv_caches):
            self.capture_graphs()

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
        """Defer steps' tokens (worker/deferred_step.py) where the runner alone makes the step's
        output: one rank, no drafts to propose, no KV connector. Returns whether it does."""
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
        if not cached.req_ids:
            return
        idx = np.array([slots.slot_of[rid] for rid in cached.req_ids], dtype=np.int64)
        wrong = np.flatnonzero(slots.num_computed_tokens[idx] != np.asarray(cached.num_computed_tokens))
        assert not len(wrong), "".join(
            f"{cached.req_ids[i]}: runner has {slots.num_computed_tokens[idx[i]]} computed, "
            f"scheduler {cached.num_computed_tokens[i]}; " for i in wrong)
        # Most steps give a decoding request no block and take none back: nothing to write.
        for slot, blocks, num_null in zip(idx.tolist(), cached.new_block_ids,
                                          cached.num_null_blocks, strict=True):
            if blocks[0]:
                slots.append_blocks(slot, blocks)
            if any(num_null):
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
        previous, self._pending = self._pending, None   # set only where steps defer
        self._update_slots(so, previous)
        if self.connector is None:
            if not so.total_num_scheduled_tokens:
                return ModelRunnerOutput.empty()
            out = self._execute(so, previous, self.defer_steps)
            if previous is not None:   # queued behind this step: now wait for its tokens
                previous.finish(self.slots, self.grammars)
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
            connector.get_dropped_saves(), connector.get_transferred())
        return out

    def finish_deferred(self, step: DeferredStep) -> ModelRunnerOutput:
        """A deferred step's output, waiting for its tokens if no later step has yet."""
        if self._pending is step:
            self._pending = None
        return step.finish(self.slots, self.grammars)

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
        patch = previous.device_tokens_for(token_slot, positions) if previous is not None else None
        assert np.array_equal(np.flatnonzero(input_ids == PLACEHOLDER),
                              patch[0] if patch is not None else []), (
            "the rows reading a deferred token are not the ones its step provides")
        rope_positions = positions
        if self.long_rope_offset:
            rope_positions = positions + self.long_rope_offset * slots.long_rope[token_slot]
        graphs = self.graphs
        # Graphs serve models with one KV cache group; their block tables go up only as far as
        # the step's longest sequence reaches (the graphs' buffers are as wide as max_model_len).
        block_table = (slots.block_table[0, idx, :-(-int(ends.max(initial=1)) // self.block_size)]
                       if graphs is not None else None)
        if (graphs is not None and len(decodes) == len(idx)
                and graphs.padded_size(len(idx)) is not None):
            # Every request decodes one token: a CUDA graph's step (worker/cuda_graphs.py).
            hidden = graphs.run(input_ids, rope_positions,
                                self.attention.slots(q_lens, positions, block_table), ends,
                                block_table, patch)
        elif (graphs is not None and graphs.mixed is not None
              and graphs.mixed.padded_size(total, len(idx)) is not None):
            # Prefill chunks or drafts, or more decodes than the decode graphs take: a mixed
            # step's graph (worker/mixed_graphs.py).
            hidden = graphs.mixed.run(input_ids, rope_positions,
                                      self.attention.slots(q_lens, positions, block_table),
                                      q_lens, ends, block_table, patch)
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
        rows = np.flatnonzero(samples)
        prompt = queue_prompt_logprobs(self.model, slots, hidden, req_ids, idx, starts, q_lens, ctx)
        if len(rows) and defer:
            assert not so.scheduled_spec_decode_tokens, "steps verifying drafts are never deferred"
            if previous is not None and self.grammars.waits_for_tokens(np.intersect1d(idx[rows], previous.slots)):
                # Their masks follow the previous step's tokens: wait for them now, with this
                # step's forward pass queued behind it.
                previous.finish(slots, self.grammars)
            logits = self.model.compute_logits(
                hidden[to_device(starts[rows] + q_lens[rows] - 1, self.device, torch.int64)])
            self._pending = DeferredStep.queue(self.sampler, slots, self.grammars, logits, req_ids,
                                               idx, rows, ends, prompt, previous)
            return self._pending
        row_drafts = [drafts[r] for r in rows]
        queued = (self._queue_samples(hidden, idx[rows], starts[rows] + q_lens[rows] - 1 - num_drafts[rows],
                                      row_drafts) if len(rows) else None)
        # The step's one wait: its samples and prompt logprobs come down together.
        sample_tensors = queued.tensors() if queued is not None else []
        host = to_host(*sample_tensors, *prompt.tensors())
        if queued is not None:
            sampled_rows, logprobs_rows, slot_errors = self._verify(
                queued.to_lists(host[:len(sample_tensors)]), idx[rows], row_drafts,
                queued.rows_ruled_out(host[:len(sample_tensors)]))
            request_errors = {req_ids[r]: slot_errors[int(idx[r])] for r in rows
                              if int(idx[r]) in slot_errors}
            counts = np.array([len(tokens) for tokens in sampled_rows], dtype=np.int64)
            slots.append_tokens(idx[rows], counts, [t for tokens in sampled_rows for t in tokens])
            # Rejected drafts were computed but are not part of the sequence.
            ends[rows] -= num_drafts[rows] - (counts - 1)
            for r, tokens, lps in zip(rows.tolist(), sampled_rows, logprobs_rows):
                sampled[r] = tokens
                if lps is not None:
                    logprobs[req_ids[r]] = lps
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

        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, logprobs=logprobs,
                                 prompt_logprobs=prompt.to_dict(host[len(sample_tensors):]),
                                 draft_token_ids=draft_token_ids,
                                 request_errors=request_errors)

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

    def _queue_samples(self, hidden: torch.Tensor, slot_ids: np.ndarray, first_rows: np.ndarray,
                       drafts: list[list[int]]) -> SamplerOutput:
        """Queue the sampling of each request's next token; with k drafts, of all 1 + k positions
        (rows from `first_rows`), each as decoding one token at a time would sample it."""
        counts = np.array([len(d) + 1 for d in drafts], dtype=np.int64)
        row_index = np.repeat(first_rows - (np.cumsum(counts) - counts), counts) + np.arange(counts.sum())
        logits = self.model.compute_logits(hidden[to_device(row_index, self.device, torch.int64)])
        return self.sampler.sample_slots(logits, self.slots, slot_ids, drafts,
                                         self.grammars.bitmask(slot_ids, drafts))

    def _verify(self, samples: tuple[list[int], list[TokenLogprobs | None]], slot_ids: np.ndarray,
                drafts: list[list[int]], ruled_out: set[int]) -> tuple[
                    list[list[int]], list[list[TokenLogprobs] | None], dict[int, str]]:
        """Each request's tokens from its samples (`_queue_samples`'s, on the host): with k
        drafts, the drafts up to the first one the sample disagrees with, plus that sample. Also
        returns, per slot whose grammar refused its tokens or which had a row with no token left
        (`ruled_out`, rows of the samples), why its request ends.

        Output is identical with and without drafts: greedy keeps the longest matching prefix
        plus the bonus token, and a sampled draft d survives with probability p(d), else the
        sample comes from p without d — the same law as rejection sampling against one-hot
        n-gram drafts.
        """
        tokens, token_lps = samples
        if not ruled_out and not self.grammars.any_constrained(slot_ids) and not any(drafts):
            # Most steps: a token each, with nothing to check it against.
            return [[t] for t in tokens], [None if lp is None else [lp] for lp in token_lps], {}
        out_tokens, out_lps, errors = [], [], {}
        pos = 0
        for slot, d in zip(slot_ids, drafts):
            accepted = 0
            while accepted < len(d) and tokens[pos + accepted] == d[accepted]:
                accepted += 1
            keep = accepted + 1
            # A row with no token left past the first: the accepted drafts before it stand, and
            # the next step's first row, the same row, ends the request.
            dead = next((j for j in range(keep) if pos + j in ruled_out), None)
            keep = keep if dead is None else max(dead, 1)
            out_tokens.append(tokens[pos:pos + keep])
            position = int(self.slots.num_tokens[slot])
            if dead == 0:
                errors[int(slot)] = ruled_out_error(position - int(self.slots.num_prompt_tokens[slot]))
                self.slots.grammar[slot] = None   # as after a refusal: its tokens are dropped
            elif (error := self.grammars.accept(int(slot), out_tokens[-1], position)) is not None:
                errors[int(slot)] = error
            lps = token_lps[pos:pos + keep]
            out_lps.append(None if lps[0] is None else lps)
            pos += len(d) + 1
        return out_tokens, out_lps, errors
