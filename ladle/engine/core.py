"""EngineCore: add_request / abort / step. The one loop that the offline LLM and the server both drive."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig

from ladle.config import EngineArgs, EngineConfig, resolve_config, resolve_device, resolve_dtype
from ladle.engine.kv_cache import KVCacheManager
from ladle.engine.memory import free_memory_bytes
from ladle.engine.scheduler import Scheduler, SchedulerOutput
from ladle.engine.stats import EngineStats, StepRecord
from ladle.models.loader import kv_cache_shape_params, load_model
from ladle.outputs import Logprob
from ladle.request import Request, RequestStatus
from ladle.sampling_params import SamplingParams
from ladle.worker.model_runner import ModelRunner, SampledToken, allocate_kv_caches

logger = logging.getLogger("ladle")


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None
    error: str | None = None


def eos_token_ids(model_dir: str, hf_config) -> frozenset[int]:
    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


class EngineCore:
    def __init__(self, args: EngineArgs, explicit: frozenset[str]) -> None:
        device = resolve_device(args.device)
        model, hf_config = load_model(args.model, device, resolve_dtype(args.dtype, device))
        num_layers, num_kv_heads, head_dim = kv_cache_shape_params(hf_config)
        dtype = next(model.parameters()).dtype
        kv_bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize
        self.config: EngineConfig = resolve_config(
            args, explicit, hf_config.max_position_embeddings, kv_bytes_per_token, free_memory_bytes(device)
        )
        logger.info("resolved engine settings:\n%s", self.config.table())
        cfg = self.config
        self.hf_config = hf_config
        self.eos_token_ids = eos_token_ids(args.model, hf_config)
        self.kv = KVCacheManager(cfg.num_kv_blocks, cfg.block_size)
        self.scheduler = Scheduler(cfg, self.kv)
        caches = allocate_kv_caches(num_layers, cfg.num_kv_blocks, cfg.block_size, num_kv_heads, head_dim,
                                    dtype, device)
        self.runner = ModelRunner(model, caches, cfg.block_size, device)
        self.stats = EngineStats()

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
        req = Request(request_id, list(prompt_token_ids), params, max_tokens, stop_ids)
        if params.seed is not None:
            req.generator = torch.Generator(device=self.config.device).manual_seed(params.seed)
        return req

    def check_request(self, request: Request) -> None:
        self.scheduler.check(request)

    def add_request(self, request: Request) -> None:
        if self.scheduler.find(request.request_id) is not None:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        self.scheduler.add(request)

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        outs = []
        for rid in request_ids:
            req = self.scheduler.find(rid)
            if req is not None:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
                outs.append(EngineCoreOutput(rid, finish_reason="abort"))
        return outs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[EngineCoreOutput]:
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            if self.scheduler.has_unfinished():
                # Admission checks guarantee a lone request fits, so an idle step with work left is a bug:
                # fail loudly rather than spin forever.
                raise RuntimeError(f"scheduler made no progress with {len(self.scheduler.waiting)} waiting, "
                                   f"{len(self.scheduler.running)} running, {self.kv.num_free_blocks} free blocks")
            return []
        start = time.perf_counter()
        sampled = self.runner.execute(sched, self.kv.block_tables)
        ms = (time.perf_counter() - start) * 1000
        self._record(sched, ms)
        return self._update(sched, sampled)

    def _record(self, sched: SchedulerOutput, ms: float) -> None:
        self.stats.steps.append(StepRecord(
            step=len(self.stats.steps), num_tokens=sched.num_tokens, num_prefill_chunks=sched.num_prefill_chunks,
            num_decodes=sched.num_decodes, num_preempted=len(sched.preempted_ids), ms=ms,
        ))
        self.stats.num_preemptions += len(sched.preempted_ids)

    def _update(self, sched: SchedulerOutput, sampled: dict[str, SampledToken]) -> list[EngineCoreOutput]:
        outs = []
        for s in sched.scheduled:
            req = s.request
            if s.is_prefill:
                self.stats.prefill_chunks.setdefault(req.request_id, []).append(s.num_new_tokens)
                self.stats.prompt_tokens += s.num_new_tokens
            req.num_computed_tokens += s.num_new_tokens
            tok = sampled.get(req.request_id)
            if tok is None:
                continue
            self.stats.generation_tokens += 1
            req.append_output(tok.token_id, tok.logprobs)
            out = EngineCoreOutput(req.request_id, [tok.token_id], [tok.logprobs])
            status = self._stop_status(req)
            if status is not None:
                self.scheduler.finish(req, status)
                out.finish_reason = status.value
                out.stop_reason = req.stop_reason
            outs.append(out)
        return outs

    def _stop_status(self, req: Request) -> RequestStatus | None:
        last = req.output_token_ids[-1]
        if req.num_output_tokens >= req.sampling_params.min_tokens and last in req.stop_token_ids:
            if last in req.sampling_params.stop_token_ids:
                req.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
