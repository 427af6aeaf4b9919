"""Runs one scheduled step: builds the inputs, calls the model, samples. Nothing else calls the model."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ladle.attention.backends import AttentionBackend, select_backend
from ladle.engine.scheduler import SchedulerOutput
from ladle.kv_cache.specs import AttentionSpec, KVCacheLayout
from ladle.outputs import Logprob
from ladle.worker.block_table import BlockTableBuffer
from ladle.worker.cuda_graphs import DecodeGraphs
from ladle.worker.inputs import ScheduledChunk, build_step_inputs
from ladle.worker.sampler import Sampler, SamplerOutput, SamplingMetadata

GroupTables = tuple[dict[str, list[int]], ...]  # the KV manager's block tables, one dict per group


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: dict[int, Logprob] | None


def allocate_kv_caches(layout: KVCacheLayout, num_layers: int, num_blocks: int,
                       device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (K, V) pair per layer, [num_blocks, block_size, kv heads, head dim] each; the i-th layer of every
    group shares pair i (a block belongs to one group at a time; see ladle.kv_cache.specs)."""
    spec = layout.groups[0].spec
    shape = (num_blocks, layout.block_size, spec.num_kv_heads, spec.head_dim)
    pairs = [(torch.zeros(shape, dtype=spec.dtype, device=device), torch.zeros(shape, dtype=spec.dtype, device=device))
             for _ in range(layout.num_tensors)]
    return [pairs[i] for _, i in layout.layer_slots(num_layers)]


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
    ) -> None:
        self.model = model
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

    def capture_graphs(self, max_model_len: int, max_batch: int) -> int:
        """Capture decode graphs for batches up to max_batch; returns the device memory they hold."""
        graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size, max_model_len, max_batch, self.device,
                              self.backends[0])
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        graphs.capture()
        self.graphs = graphs
        return max(0, free_before - torch.cuda.mem_get_info(self.device)[0])

    def prepare(self, sched: SchedulerOutput, block_tables: GroupTables) -> list[ScheduledChunk]:
        return [
            ScheduledChunk(
                token_ids=s.request.all_token_ids[s.start_pos : s.start_pos + s.num_new_tokens],
                start_pos=s.start_pos,
                block_ids=tuple(t[s.request.request_id] for t in block_tables),
                sample=s.samples,
            )
            for s in sched.scheduled
        ]

    def execute(self, sched: SchedulerOutput, block_tables: GroupTables) -> dict[str, SampledToken]:
        chunks = self.prepare(sched, block_tables)
        requests = [s.request for s, c in zip(sched.scheduled, chunks) if c.sample]
        out = self.run(chunks, self._sampling_metadata(requests), self._table(sched, chunks))
        return {r.request_id: SampledToken(tok, lp) for r, tok, lp in zip(requests, out.token_ids, out.logprobs)}

    def launch(
        self, sched: SchedulerOutput, block_tables: GroupTables, input_ids: torch.Tensor | None = None,
    ) -> PendingStep | None:
        """Run a decode-only step whose sampling needs no host data, keeping its tokens on the device, so the
        engine can launch the next step before reading them (async scheduling). input_ids: the step's input
        tokens when they are still on the device (the previous pending step's output). None when the step
        does not qualify (a prefill chunk, logprobs, penalties, min_tokens): the caller runs execute()."""
        if not sched.scheduled or any(s.is_prefill or s.num_new_tokens != 1 for s in sched.scheduled):
            return None
        requests = [s.request for s in sched.scheduled]
        meta = self._sampling_metadata(requests)
        if not self.sampler.deferrable(meta):
            return None
        if input_ids is None:
            chunks = self.prepare(sched, block_tables)
            if not all(c.sample for c in chunks):
                return None
        else:  # the input token is the previous step's output: a placeholder here, the device copy below
            chunks = [ScheduledChunk([0], s.start_pos, tuple(t[s.request.request_id] for t in block_tables), True)
                      for s in sched.scheduled]
        with torch.inference_mode():
            logits = self._logits(chunks, self._table(sched, chunks), input_ids)
            assert logits is not None
            return PendingStep([r.request_id for r in requests], self.sampler.sample(logits, meta))

    def _sampling_metadata(self, requests: list) -> SamplingMetadata:
        return SamplingMetadata(
            params=[r.sampling_params for r in requests],
            generators=[r.generator for r in requests],
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            output_token_ids=[r.output_token_ids for r in requests],
            stop_token_ids=[r.stop_token_ids for r in requests],
        )

    def _table(self, sched: SchedulerOutput, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, ...] | None:
        if self.block_tables is None:
            return None
        rids = [s.request.request_id for s in sched.scheduled]
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
        inputs = build_step_inputs(chunks, self.block_size, self.device, block_tables, self.windows, self.backends)
        ids = inputs.input_ids if input_ids is None else input_ids
        hidden = self.model(ids, inputs.positions, self.kv_caches, inputs.attn_groups)
        if not inputs.sampled_rows:
            return None
        return self.model.compute_logits(hidden[inputs.logits_indices])
