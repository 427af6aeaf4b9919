"""Runs one scheduled step: builds the inputs, calls the model, samples. Nothing else calls the model.

The runner keeps its own copy of every request it runs (tokens, sampling state, block tables), updated by
the plain StateUpdate the engine sends each step (ladle.worker.payload); it never reads the engine's objects.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ladle.attention.backends import AttentionBackend, select_backend
from ladle.kv_cache.specs import AttentionSpec, KVCacheLayout
from ladle.outputs import Logprob
from ladle.sampling_params import SamplingParams
from ladle.worker.block_table import BlockTableBuffer
from ladle.worker.cuda_graphs import DecodeGraphs
from ladle.worker.inputs import ScheduledChunk, build_step_inputs
from ladle.worker.payload import ChunkSpec, StateUpdate
from ladle.worker.sampler import Sampler, SamplerOutput, SamplingMetadata


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: dict[int, Logprob] | None


@dataclass
class RunnerRequest:
    """The runner's copy of a request: its tokens, sampling state and block tables."""

    prompt: list[int]
    output: list[int]  # generated tokens (kept apart, so penalties read them without a copy each step)
    params: SamplingParams
    stop_token_ids: frozenset[int]
    generator: torch.Generator | None  # seeded requests draw from their own, on the runner's device
    tables: tuple[list[int], ...]  # per KV cache group; entries a window gave back may be stale (never read)
    state_slot: int = -1  # its slot in the state layers (models with StateSpec layers)

    def tokens(self, start: int, n: int) -> list[int]:
        """Tokens [start, start + n) of prompt + output."""
        p = len(self.prompt)
        if start >= p:
            return self.output[start - p : start - p + n]
        if start + n <= p:
            return self.prompt[start : start + n]
        return self.prompt[start:] + self.output[: start + n - p]


def allocate_kv_caches(layout: KVCacheLayout, num_layers: int, num_blocks: int, device: torch.device,
                       num_state_slots: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """One (K, V) pair per paged layer, [num_blocks, block_size, kv heads, head dim] each; the i-th layer of
    every paged group shares pair i (a block belongs to one group at a time; see ladle.kv_cache.specs). A
    state layer gets its own tensors, [num_state_slots, *shape] for each of its spec's shapes."""
    spec = layout.groups[0].spec
    shape = (num_blocks, layout.block_size, spec.num_kv_heads, spec.head_dim)
    pairs = []
    for _ in range(layout.num_tensors):
        k = torch.zeros(shape, dtype=spec.dtype, device=device)
        pairs.append((k, k) if spec.kv_shared else (k, torch.zeros(shape, dtype=spec.dtype, device=device)))
    caches: list[tuple[torch.Tensor, ...]] = [pairs[i] if i >= 0 else () for _, i in layout.layer_slots(num_layers)]
    for group in layout.state_groups:
        for layer in group.layers:
            caches[layer] = tuple(torch.zeros((num_state_slots, *s), dtype=d, device=device)
                                  for s, d in zip(group.spec.shapes, group.spec.dtypes))
    return caches


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
        windows: tuple[int | None, ...] = (None,), backends: tuple[AttentionBackend, ...] | None = None,
        state_groups: tuple[tuple[int, ...], ...] = (), compressions: tuple[tuple[int, int], ...] | None = None,
    ) -> None:
        """state_groups: the layers of each state group (models with StateSpec layers); compressions: each
        paged group's (tokens per entry, block scale), KVCacheLayout.compressions."""
        self.compressions = compressions
        self.model = model
        self.num_state_groups = len(state_groups)
        self.state_layers = tuple(layer for group in state_groups for layer in group)
        # Set once a forward has begun: from then on its state layers may have advanced their requests' state.
        self.state_touched = False
        self.kv_caches = kv_caches  # one (K, V) pair per layer
        self.block_size = block_size
        self.device = device
        # The engine's persistent host tables, one per KV cache group; None: built from each step.
        self.block_tables = block_tables
        self.windows = windows  # each KV cache group's sliding window (None: full attention)
        # Each group's attention backend, chosen once at startup (ladle.attention.backends.select_backend).
        self.backends = backends or tuple(select_backend(device, AttentionSpec(1, 1, torch.float32, w))
                                          for w in windows)
        self.sampler = Sampler()
        self.graphs: DecodeGraphs | None = None
        self.requests: dict[str, RunnerRequest] = {}

    def capture_graphs(self, max_model_len: int, max_batch: int) -> int:
        """Capture decode graphs for batches up to max_batch; returns the device memory they hold."""
        graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size, max_model_len, max_batch, self.device,
                              self.backends[0])
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        graphs.capture()
        self.graphs = graphs
        return max(0, free_before - torch.cuda.mem_get_info(self.device)[0])

    # ---- the runner's own copy of the requests, kept up to date by the engine's StateUpdate ----

    def apply(self, update: StateUpdate) -> None:
        """Forget finished requests, take new (or resumed) ones, extend the others."""
        for rid in update.finished:
            self.requests.pop(rid, None)
        for new in update.new_requests:
            old = self.requests.get(new.request_id)
            seed = new.sampling_params.seed
            # A request back from preemption keeps its generator, so its draws go on where they stopped.
            generator = old.generator if old is not None else (
                None if seed is None else torch.Generator(device=self.device).manual_seed(seed))
            n = new.num_prompt_tokens
            self.requests[new.request_id] = RunnerRequest(
                list(new.token_ids[:n]), list(new.token_ids[n:]), new.sampling_params, new.stop_token_ids,
                generator, tuple(list(t) for t in new.block_ids), new.state_slot)
        for diff in update.diffs:
            req = self.requests[diff.request_id]
            req.output.extend(diff.new_token_ids)
            for table, added in zip(req.tables, diff.new_block_ids):  # () when no group grew
                table.extend(added)

    def snapshot_states(self, request_ids: list[str]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Copies of these requests' state slots in every state tensor: (tensor, slots, saved rows)."""
        slots = torch.tensor([self.requests[r].state_slot for r in request_ids], device=self.device)
        return [(t, slots, t[slots].clone()) for layer in self.state_layers for t in self.kv_caches[layer]]

    @staticmethod
    def restore_states(snapshot: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """Undo whatever a failed step did to the snapshotted slots."""
        for tensor, slots, saved in snapshot:
            tensor[slots] = saved

    def generators(self, request_ids: list[str]) -> list[torch.Generator]:
        """The seeded requests' generators among these (the engine rewinds them before retrying a step)."""
        return [g for g in (self.requests[r].generator for r in request_ids) if g is not None]

    def prepare(self, specs: list[ChunkSpec]) -> list[ScheduledChunk]:
        chunks = []
        for s in specs:
            req = self.requests[s.request_id]
            chunks.append(ScheduledChunk(req.tokens(s.start_pos, s.num_tokens), s.start_pos, req.tables, s.sample,
                                         req.state_slot))
        return chunks

    def execute(self, specs: list[ChunkSpec]) -> dict[str, SampledToken]:
        chunks = self.prepare(specs)
        rids = [s.request_id for s in specs if s.sample]
        out = self.run(chunks, self._sampling_metadata(rids), self._table(specs, chunks))
        return {rid: SampledToken(tok, lp) for rid, tok, lp in zip(rids, out.token_ids, out.logprobs)}

    @torch.inference_mode()
    def forward_shard(self, specs: list[ChunkSpec]) -> None:
        """A tensor-parallel rank other than 0: its part of the step's forward; rank 0 gets the logits."""
        chunks = self.prepare(specs)
        self._logits(chunks, self._table(specs, chunks))

    def launch(self, specs: list[ChunkSpec], input_ids: torch.Tensor | None = None) -> PendingStep | None:
        """Run a decode-only step whose sampling needs no host data, keeping its tokens on the device, so the
        engine can launch the next step before reading them (async scheduling). input_ids: the step's input
        tokens when they are still on the device (the previous pending step's output). None when the step
        does not qualify (a prefill chunk, logprobs, penalties, min_tokens): the caller runs execute()."""
        # A step launched ahead samples every row; its specs cannot say so, as its input tokens are not known.
        if not specs or any(s.num_tokens != 1 or not (s.sample or input_ids is not None) for s in specs):
            return None
        rids = [s.request_id for s in specs]
        meta = self._sampling_metadata(rids)
        if not self.sampler.deferrable(meta):
            return None
        if input_ids is None:
            chunks = self.prepare(specs)
        else:  # the input token is the previous step's output: a placeholder here, the device copy below
            chunks = [ScheduledChunk([0], s.start_pos, self.requests[s.request_id].tables, True,
                                     self.requests[s.request_id].state_slot) for s in specs]
        with torch.inference_mode():
            logits = self._logits(chunks, self._table(specs, chunks), input_ids)
            assert logits is not None
            return PendingStep(rids, self.sampler.sample(logits, meta))

    def _sampling_metadata(self, request_ids: list[str]) -> SamplingMetadata:
        reqs = [self.requests[r] for r in request_ids]
        return SamplingMetadata(
            params=[r.params for r in reqs],
            generators=[r.generator for r in reqs],
            prompt_token_ids=[r.prompt for r in reqs],
            output_token_ids=[r.output for r in reqs],
            stop_token_ids=[r.stop_token_ids for r in reqs],
        )

    def _table(self, specs: list[ChunkSpec], chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, ...] | None:
        if self.block_tables is None:
            return None
        rids = [s.request_id for s in specs]
        widths = [-(-(c.start_pos + len(c.token_ids)) // self.block_size) for c in chunks]
        return tuple(buffer.gather(rids, [c.block_ids[g] for c in chunks], widths)
                     for g, buffer in enumerate(self.block_tables))

    @torch.inference_mode()
    def run(
        self, chunks: list[ScheduledChunk], meta: SamplingMetadata,
        block_tables: tuple[torch.Tensor, ...] | None = None,
    ) -> SamplerOutput:
        """The forward pass, logits and sampling of one step; meta holds one entry per sampling chunk.
        block_tables: the step's [chunks, blocks] host table per group when the caller keeps them."""
        logits = self._logits(chunks, block_tables)
        return SamplerOutput([], []) if logits is None else self.sampler(logits, meta)

    def _logits(
        self, chunks: list[ScheduledChunk], block_tables: tuple[torch.Tensor, ...] | None,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Logits of the sampled rows (None if no row samples); input_ids overrides the chunks' tokens."""
        if self.graphs is not None and self.graphs.can_run(chunks):
            return self.graphs.run(chunks, None if block_tables is None else block_tables[0], input_ids)
        inputs = build_step_inputs(chunks, self.block_size, self.device, block_tables, self.windows, self.backends,
                                   self.num_state_groups, self.compressions)
        ids = inputs.input_ids if input_ids is None else input_ids
        self.state_touched = self.num_state_groups > 0
        hidden = self.model(ids, inputs.positions, self.kv_caches, inputs.attn_groups)
        if not inputs.sampled_rows:
            return None
        return self.model.compute_logits(hidden[inputs.logits_indices])
