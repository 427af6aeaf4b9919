"""EngineCore: add_request / abort / step. The one loop that the offline LLM and the server both drive."""
from __future__ import annotations

import atexit
import gc
import logging
import time
from collections.abc import Callable

import torch
from transformers import GenerationConfig

from ladle.config.engine_args import EngineArgs
from ladle.engine.core_output import EngineCoreOutput, EngineSnapshot
from ladle.engine.runner_sync import RunnerSync
from ladle.engine.scheduler import Scheduler
from ladle.engine.scheduler_output import SchedulerOutput
from ladle.engine.stats import EngineStats, StepRecord
from ladle.engine.step_executor import RequestFailure, StepExecutor, chunk_specs
from ladle.engine.structured_step import with_bitmasks
from ladle.executor.executor import Executor
from ladle.executor.factory import create_executor
from ladle.experts.expert_files import ExpertFileError
from ladle.gguf.path import gguf_file_of
from ladle.kv_cache.disk_tier import DiskTier
from ladle.kv_cache.manager import KVCacheManager
from ladle.request import Request, RequestStatus, child_request_ids
from ladle.runner.payload import PendingStep, SampledToken
from ladle.sampling_params import SamplingParams
from ladle.startup.cpu_lending import CpuLender
from ladle.startup.engine_config import EngineConfig
from ladle.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("ladle")

# Steps in a row that fail for every request they hold before the engine gives up (and its process exits,
# for the server's supervisor to restart): then the device or the model is broken, not a request.
MAX_FAILED_STEPS_IN_A_ROW = 2
# With nothing to run but requests whose grammars compile (or whose prefixes are read from the KV disk tier), a
# step waits this long for one of them.
GRAMMAR_WAIT_S = 0.05


class EngineStepError(RuntimeError):
    """Steps keep failing for every request in them: the engine cannot serve."""


def eos_token_ids(model_dir: str, hf_config) -> frozenset[int]:
    """generation_config.json's eos ids, else the config's (a GGUF file has only the config, whose eos holds
    every end-of-generation id the file names)."""
    try:
        eos = None if gguf_file_of(model_dir) is not None else GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def disk_tier(cfg: EngineConfig) -> DiskTier | None:
    """The prefix cache's disk tier the startup configured (None: none)."""
    disk = cfg.kv_disk
    if disk is None:
        return None
    return DiskTier(disk.directory, disk.identity, disk.capacity_bytes, disk.specs, disk.entry_bytes, cfg.block_size,
                    disk.checkpoint_specs, disk.checkpoint_entry_bytes)


class EngineCore:
    def __init__(self, args: EngineArgs, explicit: frozenset[str]) -> None:
        self.model_executor: Executor = create_executor(args, explicit)
        self.config: EngineConfig = self.model_executor.config
        logger.info("resolved engine settings:\n%s", self.config.report())
        cfg = self.config
        self.hf_config = self.model_executor.hf_config
        self.eos_token_ids = eos_token_ids(args.model, self.hf_config)
        layout = cfg.kv_layout
        assert layout is not None  # startup plans the layout before the engine is built
        slots = cfg.max_num_seqs if layout.state_groups else 0
        self.kv = KVCacheManager(cfg.num_kv_blocks, cfg.block_size, enable_caching=cfg.enable_prefix_caching,
                                 groups=layout.groups, num_state_slots=slots,
                                 num_checkpoints=cfg.num_state_checkpoints,
                                 checkpoint_bytes=layout.checkpoint_bytes(cfg.block_size),
                                 host_slots=cfg.num_host_kv_blocks, disk=disk_tier(cfg),
                                 host_checkpoints=cfg.num_host_checkpoints)
        self.stats = EngineStats(experts=self.model_executor.expert_cache_stats())
        self.grammars = StructuredOutputManager(cfg.tokenizer, self.hf_config.vocab_size, self.eos_token_ids)
        self.scheduler = Scheduler(cfg, self.kv, self.stats, self.grammars)
        self.model_executor.capture_graphs()
        self.lender = (None if cfg.cpu_lending is None else
                       CpuLender(cfg.cpu_lending, torch.set_num_threads))  # reserved CPUs, borrowed while idle
        self.step_executor = StepExecutor(self.model_executor, cfg.block_size, cfg.device, self.stats)
        self.sync = RunnerSync()  # what the runner has been told of each request
        # Everything alive now (torch, transformers, the model) lives as long as the engine: keep the
        # collector from walking it again and again (a full pass cost 6 of 14 ms per step at 256 decodes).
        gc.collect()
        gc.freeze()
        # At exit, hand it back, so the interpreter's last collection frees it (native extensions such as
        # Triton's report what was never freed).
        atexit.register(gc.unfreeze)
        self._failed_steps_in_a_row = 0
        self._ahead: tuple[SchedulerOutput, PendingStep] | None = None  # a step launched before its inputs were read

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks and leave the process group (a no-op on one device); the disk
        tier's reads stop and its writes finish."""
        self.grammars.shutdown()
        if self.kv.disk is not None:
            self.kv.disk.shutdown()
        self.model_executor.shutdown()

    @property
    def before_execute(self) -> Callable[[SchedulerOutput], None] | None:
        """A test hook run before each forward call (e.g. to inject an out-of-memory error)."""
        return self.step_executor.before_execute

    @before_execute.setter
    def before_execute(self, hook: Callable[[SchedulerOutput], None] | None) -> None:
        self.step_executor.before_execute = hook

    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty; give at least one token")
        vocab = self.hf_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = max(1, self.config.max_model_len - len(prompt_token_ids))
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        return Request(request_id, list(prompt_token_ids), params, max_tokens, stop_ids)

    def make_requests(self, parent_id: str, prompts: list[list[int]], params: SamplingParams,
                      checkpoint_marks: tuple[int, ...] = (), session_id: str | None = None) -> list[Request]:
        """The one request factory: a user request's children (n per prompt, ids by child_request_ids), each
        checked so it can run. checkpoint_marks: where a one-prompt request's messages end (state models
        checkpoint there). session_id: the client's session, whose next turn the prefix cache keeps the
        request's prefix for. Raises ValueError (RequestRejected) naming what to change."""
        n = params.n
        ids = child_request_ids(parent_id, len(prompts) * n)
        reqs = [self.make_request(ids[p * n + i], prompt, params.for_child(i))
                for p, prompt in enumerate(prompts) for i in range(n)]
        for req in reqs:
            req.session_id = session_id
            if len(prompts) == 1:
                req.checkpoint_marks = tuple(checkpoint_marks)
        for req in reqs[::n]:  # siblings share what the check reads: prompt, max_tokens, priority
            self.check_request(req)
        return reqs

    def check_request(self, request: Request) -> None:
        self.scheduler.check(request)

    def add_request(self, request: Request) -> None:
        if self.scheduler.find(request.request_id) is not None:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        self.scheduler.add(request)
        if request.sampling_params.structured_outputs is not None:
            self.grammars.add(request.request_id, request.sampling_params.structured_outputs,
                              request.prompt_token_ids)

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        outs = []
        for rid in request_ids:
            req = self.scheduler.find(rid)
            if req is not None:
                self._finish(req, RequestStatus.FINISHED_ABORTED)
                outs.append(EngineCoreOutput(rid, finish_reason="abort", prefill_chunks=req.prefill_chunks))
        return outs

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache, so the next prompts compute everything; False while requests run."""
        if self.has_unfinished_requests() or not self.kv.reset_prefix_cache():
            return False
        self.model_executor.apply(self.sync.flush(self.kv))  # the disk tier's deletions
        return True

    def snapshot(self) -> EngineSnapshot:
        """The gauges and counters a server reports, as of now."""
        stats, kv = self.stats, self.kv
        host = {}
        if kv.host is not None:
            layout = self.config.kv_layout
            assert layout is not None  # planned before the engine was built
            host = dict(kv_offload_demoted_blocks=kv.host.num_demoted, kv_offload_promoted_blocks=kv.host.num_promoted,
                        kv_offload_promoted_bytes=kv.host.num_promoted * layout.block_bytes,
                        kv_offload_dropped_blocks=kv.host.num_dropped)
        if kv.disk is not None:
            host |= dict(kv_disk_stored_blocks=kv.disk.num_stored, kv_disk_loaded_blocks=kv.disk.num_loaded,
                         kv_disk_misses=kv.disk.num_misses, kv_disk_evicted_blocks=kv.disk.num_evicted)
        return EngineSnapshot(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_in_use=kv.num_blocks - kv.num_free_blocks, num_kv_blocks=kv.num_blocks, **stats.counters(),
            prefix_cache_sessions=len(kv.sessions), prefix_cache_kept_nodes=kv.sessions.num_kept_nodes, **host)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._ahead is not None

    def step(self) -> list[EngineCoreOutput]:
        """Run one step and return its outputs. With async scheduling a decode step whose successor is
        certain launches that successor before reading its own tokens, so the device computes the next step
        while the host does this one's bookkeeping; the next call then starts from the launched step."""
        start = time.perf_counter()
        refused: list[EngineCoreOutput] = []  # requests whose grammar cannot compile
        if self._ahead is not None:
            sched, pending = self._ahead
            self._ahead = None
        else:
            refused = self._poll_grammars()
            sched = self.scheduler.schedule()
            if not sched.scheduled:
                if refused or self.grammars.num_pending:
                    if not refused:
                        self.grammars.wait(GRAMMAR_WAIT_S)
                    return refused
                if self.kv.disk is not None and self.kv.disk.num_reading:
                    self.kv.disk.wait(GRAMMAR_WAIT_S)  # its waiting requests' prefixes are being read from disk
                    return refused
                if self.scheduler.has_unfinished():
                    # Admission checks guarantee a lone request fits, so an idle step with work left is a bug:
                    # fail loudly rather than spin forever.
                    raise RuntimeError(f"scheduler made no progress with {len(self.scheduler.waiting)} waiting, "
                                       f"{len(self.scheduler.running)} running, {self.kv.num_free_blocks} free blocks")
                return []
            sched = with_bitmasks(sched, self.grammars)
            if self.lender is not None:
                self.stats.steps_with_lent_cpus += self.lender.before_step() > self.lender.lending.base_threads
            self.model_executor.apply(self.sync.update(sched, self.kv))
            launched = self._launch(sched) if self._can_defer() else None
            if launched is None:
                result = self.step_executor.run(sched)
                self._record(result.sched, (time.perf_counter() - start) * 1000)
                restarted = [r for r in map(self.scheduler.find, result.restarted) if r is not None]
                self.scheduler.restart(restarted)
                for r in restarted:
                    self.sync.forget(r.request_id)
                failed = [self._end_with_error(f) for f in result.failures]
                return refused + self._end_step(sched, failed + self._update(result.sched, result.sampled))
            pending = launched
        nxt = self.scheduler.schedule_ahead(sched) if self._can_defer() else None
        if nxt is not None:
            self.model_executor.apply(self.sync.update(nxt, self.kv))
            ahead = self._launch(nxt, pending.token_ids)
            self._ahead = None if ahead is None else (nxt, ahead)
            self.stats.steps_ahead += ahead is not None
        sampled = pending.result()
        self._record(sched, (time.perf_counter() - start) * 1000)
        return refused + self._end_step(sched, self._update(sched, sampled))

    def _can_defer(self) -> bool:
        # The OOM test hook wraps the synchronous path only.
        return self.config.async_scheduling and self.before_execute is None

    def _launch(self, sched: SchedulerOutput, input_ids: torch.Tensor | None = None) -> PendingStep | None:
        """runner.launch, or None when it runs out of memory: the synchronous path, with its retries, then
        runs the step (a step launched ahead is simply scheduled again; its KV slots get the same values)."""
        try:
            return self.model_executor.launch(chunk_specs(sched), input_ids)
        except (torch.OutOfMemoryError, MemoryError) as e:
            logger.warning("out of memory launching a step (%s); it runs synchronously", type(e).__name__)
            if self.config.device.type == "cuda":
                torch.cuda.empty_cache()
            return None
        except ExpertFileError:
            # The synchronous path's retries end only the requests routed to the expert (a model with state layers,
            # which a launch cannot take back, refuses async_scheduling with a file tier).
            logger.warning("a tiered expert could not be read launching a step; it runs synchronously")
            return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        self.scheduler.finish(req, status)
        self._forget(req.request_id)

    def _forget(self, request_id: str) -> None:
        """A request ended: what was kept beside the scheduler about it goes too."""
        self.sync.forget(request_id)
        self.step_executor.forget(request_id)
        self.grammars.remove(request_id)
        if self.scheduler.speculator is not None:
            self.scheduler.speculator.forget(request_id)

    def _poll_grammars(self) -> list[EngineCoreOutput]:
        """Take the grammars compiled since the last step; end the requests whose grammar cannot be."""
        outs = []
        for rid, message in self.grammars.poll():
            req = self.scheduler.find(rid)
            if req is not None:
                outs.append(self.scheduler.fail(req, f"request {rid}: {message}", "invalid_grammar"))
                self._forget(rid)
        return outs

    def _end_with_error(self, failure: RequestFailure) -> EngineCoreOutput:
        req = self.scheduler.find(failure.request_id)
        assert req is not None, f"a step failed for {failure.request_id}, which the scheduler does not hold"
        self._forget(req.request_id)
        return self.scheduler.fail(req, failure.message, failure.code)

    def _end_step(self, sched: SchedulerOutput, outs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """The tail of every step: count steps that failed for every request in them (raising when that
        happens too often in a row), and when the engine goes idle let the runner forget who finished."""
        if not self.has_unfinished_requests():
            self.model_executor.apply(self.sync.flush(self.kv))
        # A failure with a known cause (a client's grammar, a tiered expert's changed file) says nothing of whether
        # the device or the model works: only failures of the engine count.
        failed = sum(o.finish_reason == "error" and o.error_code is None for o in outs)
        if sched.scheduled and failed == len(sched.scheduled):
            self._failed_steps_in_a_row += 1
            if self._failed_steps_in_a_row >= MAX_FAILED_STEPS_IN_A_ROW:
                raise EngineStepError(f"{self._failed_steps_in_a_row} steps in a row failed for every request "
                                      f"in them; the last: {outs[-1].error}")
        elif sched.scheduled:
            self._failed_steps_in_a_row = 0
        return outs

    def _record(self, sched: SchedulerOutput, ms: float) -> None:
        self.stats.record(StepRecord(
            step=self.stats.num_steps, num_tokens=sched.num_tokens, num_prefill_chunks=sched.num_prefill_chunks,
            num_decodes=sched.num_decodes, num_preempted=len(sched.preempted_ids), ms=ms,
        ))
        self.stats.num_preemptions += len(sched.preempted_ids)

    def _update(self, sched: SchedulerOutput, sampled: dict[str, SampledToken]) -> list[EngineCoreOutput]:
        outs = self.scheduler.update_from_output(sched, sampled)
        spec = self.scheduler.speculator
        if spec is not None and sched.scheduled and not sched.num_prefill_chunks:
            spec.record_step(len(sched.scheduled), sched.num_tokens, sched.num_draft_tokens,
                             sum(len(o.new_token_ids) for o in outs), self.stats.steps[-1].ms)
        for out in outs:
            if out.finish_reason is not None:
                self._forget(out.request_id)
        return outs
