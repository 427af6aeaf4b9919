"""Runs one scheduled step: builds the inputs, calls the model, samples. Nothing else calls the model.

The runner keeps its own copy of every request it runs (tokens, sampling state, block tables), updated by
the plain StateUpdate the engine sends each step (ladle.runner.payload); it never reads the engine's objects.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from ladle.attention.backends import AttentionGroup, reference_group, select_backend
from ladle.kernels.cpu_kernels import CpuKernels, KernelUnavailable
from ladle.kernels.cpu_kernels import load as load_cpu_kernels
from ladle.kv_cache.specs import StateGroup, paged_group
from ladle.outputs import Logprob
from ladle.runner.block_table import BlockTableBuffer
from ladle.runner.checkpoint_copier import CheckpointCopier
from ladle.runner.cuda_graphs import DecodeGraphs
from ladle.runner.inputs import StepInputs, build_step_inputs
from ladle.runner.mtp_drafter import MtpDrafter
from ladle.runner.step_batch import ScheduledChunk, StepBatch
from ladle.runner.mixed_graphs import MixedGraphs
from ladle.runner.payload import ChunkSpec, StateUpdate
from ladle.runner.prompt_logprobs import PromptChunk, compute_prompt_logprobs, prompt_chunks
from ladle.runner.runner_requests import RunnerRequests
from ladle.runner.sampler import FAILED, Sampler, SamplerOutput
from ladle.runner.penalty_counts import PenaltyCounts
from ladle.runner.sampling_batch import SamplingBatch, SamplingMetadata
from ladle.runner.spec_verify import accept, count_drafts, roll_back_states, row_owners, sampled_positions
from ladle.runner.step_buffers import StepBuffers


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: dict[int, Logprob] | None
    # Speculative decoding: the row's accepted drafts, with their logprobs, which come before token_id.
    accepted: tuple[tuple[int, dict[int, Logprob] | None], ...] = ()
    drafts: tuple[int, ...] = ()  # the model's own (MTP) drafts of the tokens after token_id
    # SamplingParams.prompt_logprobs: (the first prompt position covered, an entry per position) from this
    # step's chunk. A chunk that samples nothing carries them with token_id PROMPT_ONLY.
    prompt_logprobs: tuple[int, list[dict[int, Logprob]]] | None = None


PROMPT_ONLY = -2  # the token id of a result that only carries a mid-prompt chunk's prompt logprobs


def _cpu_kernels() -> CpuKernels | None:
    """ladle's C kernels, or None where they cannot be built (the torch paths run instead)."""
    try:
        return load_cpu_kernels()
    except KernelUnavailable:
        return None


class PendingStep:
    """A launched step whose sampled tokens are still on the device.

    Their copy to the host is queued at once, before anything launched later, and result() waits on an event
    recorded right after it: a plain .tolist() would queue the copy behind the step launched ahead and wait
    for that step too, which is exactly the overlap async scheduling is for."""

    def __init__(self, request_ids: list[str], token_ids: torch.Tensor) -> None:
        self.request_ids = request_ids
        # [len(request_ids)] on the device, in request order: the next step's input. A FAILED row's request
        # ends when this step is read, so its token in the step ahead is void; 0 keeps the embedding in range.
        self.token_ids = token_ids.clamp_min(0)
        self._event: torch.cuda.Event | None = None
        self._host = token_ids
        if token_ids.is_cuda:
            self._host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            self._host.copy_(token_ids, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> dict[str, SampledToken]:
        """Wait for this step's tokens (not for steps launched after it) and read them."""
        if self._event is not None:
            self._event.synchronize()
        return {rid: SampledToken(t, None) for rid, t in zip(self.request_ids, self._host.tolist())}


class ModelRunner:
    def __init__(
        self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int, device: torch.device, block_tables: list[BlockTableBuffer] | None = None,
        groups: tuple[AttentionGroup, ...] | None = None, state_groups: tuple[StateGroup, ...] = (),
        max_num_seqs: int = 256, seed: int = 0, checkpoint_tails: dict[int, torch.Tensor] | None = None,
        first_checkpoint: int = 0, draft_rows: tuple[int, int] = (0, 0), mtp_drafts: int = 0,
    ) -> None:
        """block_tables: the persistent host tables, one per KV cache group (None: built from each step);
        groups: the paged KV cache groups with the backends chosen at startup (attention_groups; one
        full-attention group if None); state_groups: the layout's state groups (models with StateSpec layers);
        max_num_seqs: requests sampled at once at most (rows of the penalty counts); seed: the engine's seed,
        which the draws of rows without a seed of their own come from (a host generator of the runner's, not
        torch's global). checkpoint_tails: allocate_checkpoint_tails'; first_checkpoint: the state tensors' row of
        checkpoint 0. draft_rows: (the state tensors' first draft row, draft rows per slot): speculative decoding
        on a model with state layers keeps slot s's state after its j-th new token in row first + s * k + j.
        mtp_drafts: the model's MTP layer drafts this many tokens after each sampled one (0: it does not run)."""
        self.model = model
        self.max_num_seqs = max_num_seqs  # also the rows of a prompt-logprobs slice (ladle.runner.prompt_logprobs)
        self.checkpoints = CheckpointCopier(kv_caches, state_groups, groups or (), checkpoint_tails or {},
                                            first_checkpoint)
        self.num_state_groups = len(state_groups)
        self.state_layers = tuple(layer for group in state_groups for layer in group.layers)
        # Set once a forward has begun: from then on its state layers may have advanced their requests' state.
        self.state_touched = False
        self.draft_rows = draft_rows
        self.kv_caches = kv_caches  # one (K, V) pair per layer
        self.block_size = block_size
        self.device = device
        self.groups = groups or (reference_group(backend=select_backend(device, paged_group().spec)),)
        self.sampler = Sampler(_cpu_kernels() if device.type == "cpu" else None)
        self.generator = torch.Generator().manual_seed(seed)
        self.graphs: DecodeGraphs | None = None  # decode-only steps
        self.mixed_graphs: MixedGraphs | None = None  # steps with a prefill chunk
        self.buffers = StepBuffers(device)
        self.requests = RunnerRequests(block_tables, PenaltyCounts(max_num_seqs, model.config.vocab_size, device))
        # The sampling side of the last batch, reused while the same requests sample in the same order.
        self._sampling: tuple[tuple[int, tuple[str, ...]], SamplingBatch] | None = None
        self.drafter = MtpDrafter(model, mtp_drafts, block_size, device, self.groups, self.requests) \
            if mtp_drafts else None

    @property
    def penalties(self) -> PenaltyCounts:
        return self.requests.penalties

    def capture_graphs(self, max_model_len: int, max_batch: int, mixed_tokens: int = 0,
                       max_num_seqs: int = 256) -> int:
        """Capture decode graphs for batches up to max_batch and, with mixed_tokens, graphs for steps with a
        prefill chunk of up to that many tokens, all in one memory pool; returns the device memory they hold."""
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = None
        if mixed_tokens:  # the larger steps first: the decode graphs then reuse their pool's blocks
            mixed = MixedGraphs(self.model, self.kv_caches, self.block_size, max_model_len, mixed_tokens,
                                max_num_seqs, self.device, self.groups, self.buffers)
            pool = mixed.capture()
            self.mixed_graphs = mixed
        graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size, max_model_len, max_batch, self.device,
                              self.groups, self.buffers)
        graphs.capture(pool)
        self.graphs = graphs
        return max(0, free_before - torch.cuda.mem_get_info(self.device)[0])

    def apply(self, update: StateUpdate) -> None:
        """Take the engine's news of its requests (ladle.runner.runner_requests); a request resuming from a
        state checkpoint gets its state back before any step runs it."""
        self.requests.apply(update)
        for new in update.new_requests:
            if new.restore is not None:
                self.checkpoints.restore(new.restore)

    def snapshot_states(self, request_ids: list[str]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Copies of these requests' state slots in every state tensor: (tensor, slots, saved rows)."""
        slots = torch.tensor([self.requests[r].state_slot for r in request_ids], device=self.device)
        return [(t, slots, t[slots].clone()) for layer in self.state_layers for t in self.kv_caches[layer]]

    @staticmethod
    def restore_states(snapshot: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """Undo whatever a failed step did to the snapshotted slots."""
        for tensor, slots, saved in snapshot:
            tensor[slots] = saved

    def execute(self, specs: list[ChunkSpec]) -> dict[str, SampledToken]:
        sampled = [s for s in specs if s.sample]
        batch, tables = self._step_batch(specs), self.requests.tables(specs, self.block_size)
        prompt = prompt_chunks(self.requests, specs, self.penalties.vocab)
        prompt_lps = {}
        if self.drafter is None and not prompt:
            out = self.run(batch, self._sampling_metadata(sampled), tables)
        else:
            with torch.inference_mode():
                logits, prompt_lps, hidden, inputs = self._forward_all(batch, tables, prompt)
                out = SamplerOutput([], []) if logits is None else \
                    self.sampler(logits, self._sampling_metadata(sampled))
        self.checkpoints.save_after(specs)
        if any(s.draft_token_ids for s in sampled):
            verified = accept(sampled, out.token_ids, out.logprobs)
            if self.num_state_groups:
                states = [t for layer in self.state_layers for t in self.kv_caches[layer]]
                roll_back_states(states, sampled, verified, [self.requests[s.request_id].state_slot for s in sampled],
                                 self.draft_rows)
            result = {s.request_id: SampledToken(*v) for s, v in zip(sampled, verified)}
        else:
            result = {s.request_id: SampledToken(tok, lp) for s, tok, lp in zip(sampled, out.token_ids, out.logprobs)}
        if self.drafter is not None:
            kept = {rid: (len(t.accepted), t.token_id) for rid, t in result.items() if t.token_id != FAILED}
            for rid, d in self.drafter.propose(self.kv_caches, specs, batch, inputs, hidden, kept).items():
                result[rid] = replace(result[rid], drafts=d)
        for rid, lps in prompt_lps.items():
            result[rid] = replace(result.get(rid, SampledToken(PROMPT_ONLY, None)), prompt_logprobs=lps)
        return result

    def _forward_all(self, batch: StepBatch, tables: tuple[torch.Tensor, ...] | None, prompt: list[PromptChunk]
                     ) -> tuple[torch.Tensor | None, dict[str, tuple[int, list[dict[int, Logprob]]]], torch.Tensor,
                                StepInputs]:
        """The sampled rows' logits, the prompt logprobs of the chunks in prompt, and the hidden states and inputs
        they came from. Every tensor-parallel rank runs the prompt slices, then the sampled rows' head, in this
        order, so their collectives pair up; sampling, which has none, comes after."""
        hidden, inputs = self._hidden(batch, tables)
        lps = compute_prompt_logprobs(self.model, hidden, prompt, self.max_num_seqs) if prompt else {}
        return self._head(hidden, inputs), lps, hidden, inputs

    @torch.inference_mode()
    def forward_shard(self, specs: list[ChunkSpec]) -> None:
        """A tensor-parallel rank other than 0: its part of the step's forward; rank 0 gets the logits (and
        the prompt logprobs, whose head slices this rank's collectives join in the same order)."""
        batch, tables = self._step_batch(specs), self.requests.tables(specs, self.block_size)
        prompt = prompt_chunks(self.requests, specs, self.penalties.vocab)
        if not prompt:
            self._logits(batch, tables)
        else:
            self._forward_all(batch, tables, prompt)
        self.checkpoints.save_after(specs)

    def _step_batch(self, specs: list[ChunkSpec]) -> StepBatch:
        """The step's columns; with drafts on a model with state layers, the rows each row's states go to."""
        batch = self.requests.step_batch(specs)
        if self.num_state_groups and batch.num_drafts is not None:
            first, k = self.draft_rows
            batch.draft_rows = [tuple(first + slot * k + j for j in range(d))
                                for slot, d in zip(batch.state_slots, batch.num_drafts)]
        return batch


    def launch(self, specs: list[ChunkSpec], input_ids: torch.Tensor | None = None) -> PendingStep | None:
        """Run a decode-only step whose sampling needs no host data, keeping its tokens on the device, so the
        engine can launch the next step before reading them (async scheduling). input_ids: the step's input
        tokens when they are still on the device (the previous pending step's output). None when the step
        does not qualify (a prefill chunk, logprobs, penalties): the caller runs execute()."""
        # A step launched ahead samples every row; its specs cannot say so, as its input tokens are not known.
        if not specs or any(s.num_tokens != 1 or not (s.sample or input_ids is not None) or s.bitmask is not None
                            for s in specs):
            return None
        meta = self._sampling_metadata(specs)
        if not self.sampler.deferrable(meta):
            return None
        batch = self.requests.step_batch(specs, placeholder_inputs=input_ids is not None)
        with torch.inference_mode():
            logits = self._logits(batch, self.requests.tables(specs, self.block_size), input_ids)
            assert logits is not None
            return PendingStep([s.request_id for s in specs], self.sampler.sample(logits, meta))

    def _sampling_metadata(self, specs: list[ChunkSpec]) -> SamplingMetadata:
        """The sampling metadata of these sampled chunks: the batch's tensors (rebuilt only when its requests
        change) and this step's draws, each at the position of the token it samples, and grammar bitmasks."""
        drafts = any(s.draft_token_ids for s in specs)
        # With drafts a row samples each of its positions: one sampling row per position, the request's own.
        ids = tuple(specs[i].request_id for i in row_owners(specs)) if drafts else tuple(s.request_id for s in specs)
        key = (self.requests.version, ids)
        if self._sampling is None or self._sampling[0] != key:
            reqs = [self.requests[r] for r in key[1]]
            batch = SamplingBatch([r.params for r in reqs], [len(r.prompt) for r in reqs],
                                  [r.stop_token_ids for r in reqs], self.penalties.vocab, self.device,
                                  self.requests.penalty_rows(reqs), self.generator)
            self._sampling = (key, batch)
        batch = self._sampling[1]
        positions = None
        if drafts:
            positions = sampled_positions(specs)
        elif batch.needs_positions:
            positions = np.fromiter((s.start_pos + s.num_tokens for s in specs), dtype=np.int64, count=len(specs))
        masks = [(i, s.bitmask) for i, s in enumerate(specs) if s.bitmask is not None]
        if drafts and masks:  # a constrained row with drafts has a mask per position ([1 + drafts, words])
            first = np.cumsum([0] + [len(s.draft_token_ids) + 1 for s in specs])  # each spec's first row
            masks = [(int(first[i]) + j, row) for i, m in masks for j, row in enumerate(m.reshape(-1, m.shape[-1]))]
        meta = batch.step(positions, self.penalties, masks)
        if drafts and meta.output_counts is not None:
            count_drafts(meta.output_counts, batch.penalized_host, specs)
        return meta

    @torch.inference_mode()
    def run(
        self, step: StepBatch | list[ScheduledChunk], meta: SamplingMetadata,
        block_tables: tuple[torch.Tensor, ...] | None = None,
    ) -> SamplerOutput:
        """The forward pass, logits and sampling of one step; meta holds one entry per sampling chunk.
        block_tables: the step's [chunks, blocks] host table per group when the caller keeps them."""
        logits = self._logits(step if isinstance(step, StepBatch) else StepBatch.of(step), block_tables)
        return SamplerOutput([], []) if logits is None else self.sampler(logits, meta)

    def _logits(
        self, step: StepBatch, block_tables: tuple[torch.Tensor, ...] | None, input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Logits of the sampled rows (None if no row samples); input_ids overrides the step's tokens."""
        if self.graphs is not None and self.graphs.can_run(step):
            return self.graphs.run(step, block_tables, input_ids)
        return self._head(*self._hidden(step, block_tables, input_ids))

    def _head(self, hidden: torch.Tensor, inputs: StepInputs) -> torch.Tensor | None:
        """The logits of the step's sampled rows (None if no row samples)."""
        return self.model.compute_logits(hidden[inputs.logits_indices]) if inputs.sampled_rows else None

    def _hidden(self, step: StepBatch, block_tables: tuple[torch.Tensor, ...] | None,
                input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, StepInputs]:
        """The final-normed hidden states of the step's tokens, and the inputs they came from."""
        if self.mixed_graphs is not None and self.mixed_graphs.can_run(step):
            return self.mixed_graphs.run(step, block_tables)
        inputs = build_step_inputs(step, self.block_size, self.device, block_tables, self.groups,
                                   self.num_state_groups, self.buffers)
        ids = inputs.input_ids if input_ids is None else input_ids
        self.state_touched = self.num_state_groups > 0
        return self.model(ids, inputs.positions, self.kv_caches, inputs.attn_groups), inputs
