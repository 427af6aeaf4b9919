"""The engine's arguments as a user gives them (EngineArgs) and their checks: every one is validated before any
model or device is touched, and a wrong one fails naming itself."""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, fields
from typing import Any

from ladle.config.moe import validate_moe_args
from ladle.config.sizes import parse_bytes
from ladle.config.speculative import parse_speculative_config
from ladle.gguf.path import gguf_file_of

# vLLM spellings accepted as aliases of ladle's names.
ALIASES = {"num_gpu_blocks_override": "num_kv_blocks"}
SCHEDULING_POLICIES = ("fcfs", "priority")
# vLLM's names: FULL replays decode-only and mixed (prefill-carrying) steps from graphs, FULL_DECODE_ONLY only
# decode-only steps.
CUDAGRAPH_MODES = ("FULL", "FULL_DECODE_ONLY")
ATTENTION_BACKENDS = ("torch", "cpu", "triton")  # ladle.attention.registry.BACKENDS (tests/test_attention_registry.py)


@dataclass
class EngineArgs:
    model: str
    tokenizer: str | None = None
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (fp32 on CPU, bf16 on CUDA) | float32 | bfloat16 | float16
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_batched_tokens: int | None = None  # default: derived from measured memory (multiple of 64)
    max_prefill_length: int | None = None  # per-request chunk cap; default: max_num_batched_tokens
    # Sharing a step between prefills (ladle.startup.partial_prefill); defaults derived.
    max_num_partial_prefills: int | None = None
    max_long_partial_prefills: int | None = None
    long_prefill_token_threshold: int | None = None  # a prefill with more tokens left than this is long
    scheduling_policy: str = "fcfs"  # fcfs | priority (lower SamplingParams.priority first)
    max_num_seqs: int = 256
    block_size: int = 16
    num_kv_blocks: int | None = None  # default: what the memory plan leaves for KV
    kv_cache_memory_bytes: int | str | None = None  # alternative to num_kv_blocks, e.g. "2GiB"
    memory_budget: int | str | None = None  # cap on all ladle may use (weights, KV, activations), e.g. "8GiB"
    gpu_memory_utilization: float = 0.9  # CUDA: share of total device memory (vLLM semantics)
    enable_prefix_caching: bool = True
    # Models with per-request state: checkpoints prefix hits resume from (default derived from memory), and
    # tokens between them while a request prefills (default: the chunk cap, in whole blocks).
    num_state_checkpoints: int | None = None
    state_checkpoint_interval: int | None = None
    enforce_eager: bool = False  # CUDA: no CUDA graphs, every step eager (vLLM semantics)
    max_cudagraph_capture_size: int | None = None  # largest step (tokens) replayed from a graph; default 512
    cudagraph_mode: str | None = None  # FULL | FULL_DECODE_ONLY (CUDA); default FULL
    load_format: str = "auto"  # auto (safetensors) | dummy (random weights, for benchmarks: no checkpoint)
    quantization: str | None = None  # fp8; default: what the checkpoint's quantization_config says
    dequantize_weights: bool = False  # widen a quantized checkpoint's weights to the model dtype at load
    async_scheduling: bool = False  # launch a certain next decode step before reading this one's tokens
    profile_cache: bool = True  # reuse a stored activation profile of the same model, dtype, device and code
    num_threads: int | None = None  # CPU: torch threads; default: the usable CPUs less reserved_cpus
    attention_backend: str | None = None  # torch | cpu | triton; default: triton on CUDA, cpu where it builds
    reserved_cpus: int = 0  # CPUs left to ladle's other processes (`ladle serve` sets 1, for its API process)
    tensor_parallel_size: int = 1  # ranks the model is sharded over, one process each (ladle.distributed)
    # Drafts verified in each decode step (ladle.config.speculative: a dict, or its JSON as vLLM's CLI takes it).
    speculative_config: dict[str, Any] | str | None = None
    # MoE models: routed experts off the device (ladle.experts): slots cached on it, how misses run, where the
    # experts live. Default: every expert resident, or tiering derived when they do not fit the budget.
    moe_cache_size: int | None = None
    moe_cache_fraction: float | None = None
    moe_strategy: str | None = None  # offload | cpu | hybrid
    moe_backing: str | None = None  # host | mmap
    moe_prefetch: bool | None = None  # fetch experts ahead on a worker thread; default: on CUDA only (measured)
    seed: int = 0

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> tuple["EngineArgs", frozenset[str]]:
        """Build args from user kwargs; returns them with the set of names the user gave explicitly."""
        known = {f.name for f in fields(cls)}
        canon: dict[str, Any] = {}
        for name, value in kwargs.items():
            target = ALIASES.get(name, name)
            if target not in known:
                raise TypeError(f"unknown engine argument {name!r}; known: {sorted(known | set(ALIASES))}")
            if target in canon:
                raise TypeError(f"engine argument {target!r} given twice (once as {name!r})")
            canon[target] = value
        return cls(**canon), frozenset(canon)

    def validate(self) -> None:
        """Every check that needs no model and no device (ranges, choices, rules between settings, the model
        directory), so a typo costs the time of an import, not of loading and profiling."""
        for name in ("max_model_len", "max_num_batched_tokens", "max_prefill_length", "num_kv_blocks",
                     "max_cudagraph_capture_size", "max_num_partial_prefills", "max_long_partial_prefills",
                     "long_prefill_token_threshold", "num_threads", "tensor_parallel_size",
                     "num_state_checkpoints", "state_checkpoint_interval"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        positive_int("max_num_seqs", self.max_num_seqs)
        if isinstance(self.reserved_cpus, bool) or not isinstance(self.reserved_cpus, int) or self.reserved_cpus < 0:
            raise ValueError(f"reserved_cpus must be an integer >= 0, got {self.reserved_cpus!r}")
        positive_int("block_size", self.block_size)
        interval = self.state_checkpoint_interval
        if interval is not None and interval % self.block_size:
            raise ValueError(f"state_checkpoint_interval={interval} is not a multiple of block_size="
                             f"{self.block_size}: a prefix hit resumes only on a block boundary")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed={self.seed!r} is not an integer")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", str(self.device)):
            raise ValueError(f"device={self.device!r}: choose auto, cpu, cuda or cuda:N")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization={self.quantization!r}: ladle reads 'fp8' checkpoints (block-scaled "
                             "e4m3); online quantization of unquantized weights is not implemented")
        if not isinstance(self.dequantize_weights, bool):
            raise ValueError(f"dequantize_weights={self.dequantize_weights!r} is not a bool")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={self.load_format!r}: choose one of {', '.join(LOAD_FORMATS)}")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        for name in ("kv_cache_memory_bytes", "memory_budget"):
            if getattr(self, name) is not None:
                parse_bytes(getattr(self, name), name)
        if self.num_kv_blocks is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("num_kv_blocks and kv_cache_memory_bytes both size the KV pool; give one of them")
        chunk, budget = self.max_prefill_length, self.max_num_batched_tokens
        if chunk is not None and budget is not None and chunk > budget:
            raise ValueError(f"max_prefill_length={chunk} exceeds max_num_batched_tokens={budget}: a chunk can "
                             "never be larger than the step; lower max_prefill_length or raise the budget")
        num, long = self.max_num_partial_prefills, self.max_long_partial_prefills
        if num is not None and long is not None and long > num:
            raise ValueError(f"max_long_partial_prefills={long} exceeds max_num_partial_prefills={num}: long "
                             "prefills are some of the partial prefills; lower it or raise max_num_partial_prefills")
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r}: choose one of "
                             f"{', '.join(ATTENTION_BACKENDS)}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy={self.scheduling_policy!r}: choose one of "
                             f"{', '.join(SCHEDULING_POLICIES)}")
        for name in ("max_cudagraph_capture_size", "cudagraph_mode"):
            if getattr(self, name) is not None and self.enforce_eager:
                raise ValueError(f"{name} needs CUDA graphs, which enforce_eager disables; drop one of them")
        if self.cudagraph_mode is not None and self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph_mode={self.cudagraph_mode!r}: choose one of {', '.join(CUDAGRAPH_MODES)}")
        parse_speculative_config(self.speculative_config)
        validate_moe_args(self.moe_cache_size, self.moe_cache_fraction, self.moe_strategy, self.moe_backing,
                          self.moe_prefetch)
        check_model_dir(self.model, "model")
        if self.tokenizer is not None:
            check_model_dir(self.tokenizer, "tokenizer")
        if self.max_model_len is not None and gguf_file_of(self.model) is None:
            # A peek at config.json (a GGUF file's metadata is checked when setup reads it); setup checks again with the parsed config (nested text configs too).
            with open(os.path.join(self.model, "config.json")) as f:
                model_max = json.load(f).get("max_position_embeddings")
            if isinstance(model_max, int):
                check_max_model_len(self.max_model_len, model_max)


def check_max_model_len(max_model_len: int, model_max: int) -> None:
    if max_model_len > model_max:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                         f"{model_max}; set max_model_len <= {model_max}")


def check_model_dir(path: str, name: str = "model") -> None:
    """A local checkpoint directory with a config.json (tokenizers need only the directory), or a GGUF file (or
    a directory holding exactly one, and no config.json)."""
    if gguf_file_of(path) is not None:
        return
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{name} directory {path!r} does not exist; give a local HF checkpoint directory "
                                "or a .gguf file (no model hub is used)")
    if name == "model" and not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{name} directory {path!r} has no config.json; is it an HF checkpoint? "
                                "(a GGUF checkpoint is a .gguf file, or a directory holding one)")


DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "dummy")


def positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value
