"""The seam between the engine loop and the model: an Executor loads and plans the model, owns the runner(s)
it is loaded into, and runs each step there. This one runs in the engine's own process; the tensor-parallel
group (ladle.executor.tensor_parallel) runs rank 0 here and ships each step to the other ranks. The engine
talks to the executor only, never to a runner: steps, and the state snapshots a retried step needs."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from ladle.config.engine_args import EngineArgs
from ladle.experts.cache import ExpertCacheStats
from ladle.runner.model_runner import ModelRunner, StateSnapshot
from ladle.runner.payload import ChunkSpec, PendingStep, SampledToken, StateUpdate
from ladle.startup.engine_config import EngineConfig
from ladle.startup.expert_tiers import expert_cache_of
from ladle.startup.setup import Loaded, build_runner, load_and_plan

logger = logging.getLogger("ladle")


class FatalStepError(RuntimeError):
    """A failure after which no retry is sound (a tensor-parallel rank broke off mid-step, leaving the group's
    collectives out of step): the engine ends, and a server's supervisor starts a new one."""


class Executor:
    def __init__(self, args: EngineArgs, explicit: frozenset[str]) -> None:
        loaded = load_and_plan(args, explicit)
        self._adopt(loaded, build_runner(loaded.model, loaded.config))

    def _adopt(self, loaded: Loaded, runner: ModelRunner) -> None:
        self.config: EngineConfig = loaded.config
        self.hf_config = loaded.hf_config
        self.runner = runner  # rank 0's: the one that samples (tests and benchmarks read its model and caches)
        self.graph_memory_bytes = 0  # device memory the CUDA graphs hold, measured at capture

    def capture_graphs(self) -> None:
        """Capture the CUDA graphs the plan sized (a no-op where it derived none)."""
        cfg = self.config
        if not cfg.max_cudagraph_capture_size:
            return
        assert cfg.plan is not None  # startup's plan sized the graphs
        start = time.perf_counter()
        mixed = min(cfg.max_cudagraph_capture_size, cfg.max_num_batched_tokens)
        mixed = mixed if cfg.cudagraph_mode == "FULL" and mixed > 1 else 0  # a step of 1 token is a decode
        self.graph_memory_bytes = self.runner.capture_graphs(
            cfg.max_model_len, min(cfg.max_cudagraph_capture_size, cfg.max_num_seqs), mixed, cfg.max_num_seqs)
        logger.info("captured CUDA graphs for decode batches up to %d and steps with a prefill chunk up to %d "
                    "tokens in %.1f s: %.1f MiB (plan reserved %.1f MiB)", cfg.max_cudagraph_capture_size,
                    mixed, time.perf_counter() - start, self.graph_memory_bytes / 2**20,
                    cfg.plan.inputs.graph_bytes / 2**20)

    def expert_cache_stats(self) -> ExpertCacheStats | None:
        """Tiered experts: the cache's counters, from zero now (startup's profiling not counted)."""
        cache = expert_cache_of(self.runner.model)
        if cache is None:
            return None
        cache.stats = ExpertCacheStats()
        return cache.stats

    def apply(self, update: StateUpdate) -> None:
        """The engine's news of its requests since the last step."""
        self.runner.apply(update)

    def execute(self, specs: list[ChunkSpec]) -> dict[str, SampledToken]:
        return self.runner.execute(specs)

    def launch(self, specs: list[ChunkSpec], input_ids: torch.Tensor | None = None) -> PendingStep | None:
        """A decode step whose tokens stay on the device (ModelRunner.launch); None when it does not qualify."""
        return self.runner.launch(specs, input_ids)

    def snapshot_states(self, request_ids: list[str]) -> StateSnapshot | None:
        """Copies of these requests' rows in the state layers, to put back after a failed step; None for a model
        without state layers, which has nothing a failed step could leave changed."""
        return self.runner.snapshot_states(request_ids) if self.runner.num_state_groups else None

    def restore_states(self, snapshot: StateSnapshot) -> None:
        """Undo whatever a failed step did to the snapshotted rows."""
        self.runner.restore_states(snapshot)

    @property
    def state_touched(self) -> bool:
        """Whether a forward began since this was last set False: its state layers may have advanced their
        requests' states (never, for a model without state layers)."""
        return self.runner.state_touched

    @state_touched.setter
    def state_touched(self, touched: bool) -> None:
        self.runner.state_touched = touched

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call back with the reason when part of the executor dies between steps (never, in one process)."""

    def shutdown(self) -> None:
        """Release what the executor started (in one process: the runner's disk-tier writer, which finishes
        its writes first)."""
        self.runner.shutdown()
