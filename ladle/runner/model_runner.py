"""Runs one scheduled step: builds the inputs, calls the model, samples. Nothing else calls the model.

The runner keeps its own copy of every request it runs (tokens, sampling state, block tables), updated by
the plain StateUpdate the engine sends each step (ladle.runner.payload); it never reads the engine's objects.
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple, cast

import numpy as np
import torch

from ladle.attention.groups import AttentionGroup, reference_group
from ladle.attention.selector import select_backend
from ladle.kernels.cpu_kernels import CpuKernels, KernelUnavailable
from ladle.kernels.cpu_kernels import load as load_cpu_kernels
from ladle.kv_cache.specs import StateGroup, paged_group
from ladle.models.interface import CausalLM, SupportsMtp
from ladle.outputs import Logprob
from ladle.runner.block_table import BlockTableBuffer
from ladle.runner.checkpoint_copier import CheckpointCopier
from ladle.runner.cuda_graphs import DecodeGraphs
from ladle.runner.disk_kv_writer import DiskKVWriter
from ladle.runner.host_kv_cache import HostCheckpointCache, HostKVCache
from ladle.runner.inputs import StepInputs, build_step_inputs
from ladle.runner.mixed_graphs import MixedGraphs
from ladle.runner.mtp_drafter import MtpDrafter
from ladle.runner.payload import (
    FAILED,
    PROMPT_ONLY,
    ChunkSpec,
    NewTokens,
    PendingStep,
    SampledToken,
    StateUpdate,
    new_tokens,
)
from ladle.runner.penalty_counts import PenaltyCounts
from ladle.runner.prompt_logprobs import PromptChunk, compute_prompt_logprobs, prompt_chunks
from ladle.runner.runner_requests import RunnerRequests
from ladle.runner.sampler import Sampler, SamplerOutput
from ladle.runner.sampling_batch import SamplingBatch, SamplingMetadata
from ladle.runner.spec_verify import accept, count_drafts, roll_back_states, row_owners, sampled_positions
from ladle.runner.step_batch import StepBatch
from ladle.runner.step_buffers import StepBuffers


class StepForward(NamedTuple):
    """What a step's forward leaves for its sampling."""

    batch: StepBatch
    logits: torch.Tensor | None  # the sampled rows' (None: no row samples)
    prompt_logprobs: dict[str, tuple[int, list[dict[int, Logprob]]]]
    # The hidden states and the inputs they came from: the drafter's (None unless the step ran _forward_all).
    hidden: torch.Tensor | None = None
    inputs: StepInputs | None = None


# Saved rows of the state tensors: (tensor, the slots, their rows as they were).
StateSnapshot = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _cpu_kernels() -> CpuKernels | None:
    """ladle's C kernels, or None where they cannot be built (the torch paths run instead)."""
    try:
        return load_cpu_kernels()
    except KernelUnavailable:
        return None


class ModelRunner:
    def __init__(
        self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, ...]],
        block_size: int, device: torch.device, block_tables: list[BlockTableBuffer] | None = None,
        groups: tuple[AttentionGroup, ...] | None = None, state_groups: tuple[StateGroup, ...] = (),
        max_num_seqs: int = 256, seed: int = 0, checkpoint_tails: dict[int, torch.Tensor] | None = None,
        first_checkpoint: int = 0, draft_rows: tuple[int, int] = (0, 0), mtp_drafts: int = 0,
        host_kv: HostKVCache | None = None, disk_writer: DiskKVWriter | None = None,
        host_checkpoints: HostCheckpointCache | None = None,
    ) -> None:
        """block_tables: the persistent host tables, one per KV cache group (None: built from each step);
        groups: the paged KV cache groups with the backends chosen at startup (attention_groups; one
        full-attention group if None); state_groups: the layout's state groups (models with StateSpec layers);
        max_num_seqs: requests sampled at once at most (rows of the penalty counts); seed: the engine's seed,
        which the draws of rows without a seed of their own come from (a host generator of the runner's, not
        torch's global). checkpoint_tails: allocate_checkpoint_tails'; first_checkpoint: the state tensors' row of
        checkpoint 0. draft_rows: (the state tensors' first draft row, draft rows per slot): speculative decoding
        on a model with state layers keeps slot s's state after its j-th new token in row first + s * k + j.
        mtp_drafts: the model's MTP layer drafts this many tokens after each sampled one (0: it does not run).
        host_kv: the prefix cache's host tier's tensors (None: no host tier); disk_writer: the disk tier's writes
        below it (None: no disk tier); host_checkpoints: the host tier's state checkpoints (None: none)."""
        self.model = model
        self.host_kv = host_kv
        self.disk_writer = disk_writer
        self.host_checkpoints = host_checkpoints
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
        self.requests = RunnerRequests(block_tables, PenaltyCounts(max_num_seqs, model.vocab_size, device))
        # The sampling side of the last batch, reused while the same requests sample in the same order.
        self._sampling: tuple[tuple[int, tuple[str, ...]], SamplingBatch] | None = None
        # mtp_drafts only where the loader enabled the MTP layer, which it does on a class saying supports_mtp
        self.drafter = MtpDrafter(cast(SupportsMtp, model), mtp_drafts, block_size, device, self.groups,
                                  self.requests) if mtp_drafts else None

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
        state checkpoint gets its state back before any step runs it; the host tier's copies run first, blocks
        saved out before loaded in (a block can be both, for an entry evicted and another promoted into it). The
        disk tier's come before them: the blocks and checkpoint rows it stores are copied out before any is
        overwritten, and the pages it read fill their host slots before a load reads them."""
        if update.kv_stores or update.kv_unlinks:
            assert self.disk_writer is not None  # the engine has a disk tier only where the runner was given one
            self.disk_writer.store(update.kv_stores)
            self.disk_writer.unlink(update.kv_unlinks)
        if update.kv_saves or update.kv_loads or update.kv_fills:
            assert self.host_kv is not None  # the engine has a host tier only where the runner was given one
            if update.kv_fills:
                self.host_kv.fill(update.kv_fills)
            if update.kv_saves:
                self.host_kv.save(update.kv_saves)
            if update.kv_loads:
                self.host_kv.load(update.kv_loads)
        if update.checkpoint_saves or update.checkpoint_loads or update.checkpoint_fills:
            assert self.host_checkpoints is not None  # given where the engine has a host checkpoint tier
            self.host_checkpoints.fill(update.checkpoint_fills)
            self.host_checkpoints.save(update.checkpoint_saves)
            self.host_checkpoints.load(update.checkpoint_loads)
        self.requests.apply(update)
        for new in update.new_requests:
            if new.restore is not None:
                self.checkpoints.restore(new.restore)

    def shutdown(self) -> None:
        """Finish the disk tier's writes (a no-op without one)."""
        if self.disk_writer is not None:
            self.disk_writer.close()
            self.disk_writer = None

    def snapshot_states(self, request_ids: list[str]) -> StateSnapshot:
        """Copies of these requests' state slots in every state tensor: (tensor, slots, saved rows)."""
        slots = torch.tensor([self.requests[r].state_slot for r in request_ids], device=self.device)
        return [(t, slots, t[slots].clone()) for layer in self.state_layers for t in self.kv_caches[layer]]

    @staticmethod
    def restore_states(snapshot: StateSnapshot) -> None:
        """Undo whatever a failed step did to the snapshotted slots."""
        for tensor, slots, saved in snapshot:
            tensor[slots] = saved

    @torch.inference_mode()
    def execute(self, specs: list[ChunkSpec]) -> dict[str, SampledToken]:
        """Run the step: its forward, then its sampling, in one inference-mode context (each costs the host a few
        microseconds a step); its tokens join the requests."""
        sampled = self._sample(specs, self._forward(specs))
        self.append(new_tokens(specs, sampled))
        return sampled

    def append(self, new: dict[str, NewTokens]) -> None:
        """A step's sampled tokens join their requests (RunnerRequests.append). Only once the step has fully
        succeeded: a step that raises is run again, and nothing of it may have stuck."""
        self.requests.append(new)

    @torch.inference_mode()
    def forward(self, specs: list[ChunkSpec]) -> StepForward:
        """The step's forward: every collective of the step is here, run in the same order on every
        tensor-parallel rank (a rank other than 0 runs only this; rank 0 gets the gathered logits). The states
        the step's chunks checkpoint are saved after it."""
        return self._forward(specs)

    @torch.inference_mode()
    def sample(self, specs: list[ChunkSpec], step: StepForward) -> dict[str, SampledToken]:
        """The step's tokens from its forward: sampled, drafts verified (the states of rejected ones rolled
        back), the drafter's next drafts made, prompt logprobs attached. No collectives: rank 0 alone."""
        return self._sample(specs, step)

    def _forward(self, specs: list[ChunkSpec]) -> StepForward:
        batch, tables = self._step_batch(specs), self.requests.tables(specs, self.block_size)
        prompt = prompt_chunks(self.requests, specs, self.penalties.vocab)
        if self.drafter is None and not prompt:
            step = StepForward(batch, self._logits(batch, tables), {})
        else:
            step = StepForward(batch, *self._forward_all(batch, tables, prompt))
        self.checkpoints.save_after(specs)
        return step

    def _sample(self, specs: list[ChunkSpec], step: StepForward) -> dict[str, SampledToken]:
        sampled = [s for s in specs if s.sample]
        out = SamplerOutput([], [])
        if step.logits is not None:
            out = self.sampler(step.logits, self._sampling_metadata(sampled))
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
            assert step.hidden is not None and step.inputs is not None  # a drafter's step runs _forward_all
            kept = {rid: (len(t.accepted), t.token_id) for rid, t in result.items() if t.token_id != FAILED}
            for rid, d in self.drafter.propose(self.kv_caches, specs, step.batch, step.inputs, step.hidden,
                                               kept).items():
                result[rid] = replace(result[rid], drafts=d)
        for rid, lps in step.prompt_logprobs.items():
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
            return PendingStep([s.request_id for s in specs], [s.start_pos + 1 for s in specs],
                               self.sampler.sample(logits, meta), self.requests.append)

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
    def run(self, step: StepBatch, meta: SamplingMetadata) -> SamplerOutput:
        """The forward pass, logits and sampling of a step of no requests the runner holds (profiling's, whose
        tables are in the batch); meta holds one entry per sampling row."""
        logits = self._logits(step, None)
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
