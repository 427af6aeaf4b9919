"""Runs one scheduled step: builds the inputs, calls the model, samples. Nothing else calls the model."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ladle.engine.scheduler import SchedulerOutput
from ladle.outputs import Logprob
from ladle.worker.block_table import BlockTableBuffer
from ladle.worker.cuda_graphs import DecodeGraphs
from ladle.worker.inputs import ScheduledChunk, build_step_inputs
from ladle.worker.sampler import Sampler, SamplerOutput, SamplingMetadata


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: dict[int, Logprob] | None


def allocate_kv_caches(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]


class ModelRunner:
    def __init__(
        self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int, device: torch.device, block_table: BlockTableBuffer | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.block_table = block_table  # the engine's persistent host tables; None: built from each step
        self.sampler = Sampler()
        self.graphs: DecodeGraphs | None = None

    def capture_graphs(self, max_model_len: int, max_batch: int) -> int:
        """Capture decode graphs for batches up to max_batch; returns the device memory they hold."""
        graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size, max_model_len, max_batch, self.device)
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        graphs.capture()
        self.graphs = graphs
        return max(0, free_before - torch.cuda.mem_get_info(self.device)[0])

    def prepare(self, sched: SchedulerOutput, block_tables: dict[str, list[int]]) -> list[ScheduledChunk]:
        return [
            ScheduledChunk(
                token_ids=s.request.all_token_ids[s.start_pos : s.start_pos + s.num_new_tokens],
                start_pos=s.start_pos,
                block_ids=block_tables[s.request.request_id],
                sample=s.samples,
            )
            for s in sched.scheduled
        ]

    def execute(self, sched: SchedulerOutput, block_tables: dict[str, list[int]]) -> dict[str, SampledToken]:
        chunks = self.prepare(sched, block_tables)
        requests = [s.request for s, c in zip(sched.scheduled, chunks) if c.sample]
        meta = SamplingMetadata(
            params=[r.sampling_params for r in requests],
            generators=[r.generator for r in requests],
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            output_token_ids=[r.output_token_ids for r in requests],
            stop_token_ids=[r.stop_token_ids for r in requests],
        )
        table = None
        if self.block_table is not None:
            table = self.block_table.gather(
                [s.request.request_id for s in sched.scheduled], [c.block_ids for c in chunks],
                [-(-(c.start_pos + len(c.token_ids)) // self.block_size) for c in chunks])
        out = self.run(chunks, meta, table)
        return {r.request_id: SampledToken(tok, lp) for r, tok, lp in zip(requests, out.token_ids, out.logprobs)}

    @torch.inference_mode()
    def run(
        self, chunks: list[ScheduledChunk], meta: SamplingMetadata, block_table: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """The forward pass, logits and sampling of one step; meta holds one entry per sampling chunk.
        block_table: the step's [chunks, blocks] host table when the caller keeps one (else built here)."""
        if self.graphs is not None and self.graphs.can_run(chunks):
            return self.sampler(self.graphs.run(chunks, block_table), meta)
        inputs = build_step_inputs(chunks, self.block_size, self.device, block_table)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn)
        if not inputs.sampled_rows:
            return SamplerOutput([], [])
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        return self.sampler(logits, meta)
