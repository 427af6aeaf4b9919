"""The engine's arguments as a user gives them (EngineArgs) and their checks: every one is validated before any
model or device is touched, and a wrong one fails naming itself."""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

from ladle.config.moe import MOE_BACKINGS, MOE_STRATEGIES, validate_moe_args
from ladle.config.sizes import parse_bytes
from ladle.config.speculative import parse_speculative_config
from ladle.gguf.path import gguf_file_of

# vLLM spellings accepted as aliases of ladle's names (on the command line too).
ALIASES = {"num_gpu_blocks_override": "num_kv_blocks"}
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
QUANTIZATIONS = ("fp8",)
PLE_TABLES = ("device", "host", "mmap")  # where Qwen4-Exp's hashed n-gram tables live (ladle.startup.ple_tables)
SCHEDULING_POLICIES = ("fcfs", "priority")
# vLLM's names: FULL replays decode-only and mixed (prefill-carrying) steps from graphs, FULL_DECODE_ONLY only
# decode-only steps.
CUDAGRAPH_MODES = ("FULL", "FULL_DECODE_ONLY")
ATTENTION_BACKENDS = ("torch", "cpu", "triton")  # ladle.attention.registry.BACKENDS (tests/test_attention_registry.py)


def flag(default: Any, text: str | None = None, *, choices: tuple[str, ...] | None = None,
         short: str | None = None) -> Any:
    """A field with its command-line flag beside it, as vLLM's EngineArgs keeps them: the help, the choices and a
    short spelling (ladle.entrypoints.cli_args builds the flag; its type comes from the field's)."""
    metadata: dict[str, Any] = {"help": text}
    if choices is not None:
        metadata["choices"] = choices
    if short is not None:
        metadata["short"] = short
    return field(default=default, metadata=metadata)


@dataclass
class EngineArgs:
    model: str
    tokenizer: str | None = None
    device: str = flag("auto", "auto | cpu | cuda[:N] (default auto)")
    dtype: str = flag("auto", "auto | float32 | bfloat16 | float16 (auto: fp32 on CPU, bf16 on CUDA)")
    max_model_len: int | None = flag(None, "default: the model's max_position_embeddings")
    max_num_batched_tokens: int | None = flag(
        None, "tokens per forward call (default: the largest multiple of 64 that fits memory, <= 8192)")
    max_prefill_length: int | None = flag(None, "prompt tokens of one request per step (default: the step budget)")
    # Sharing a step between prefills (ladle.startup.partial_prefill); defaults derived.
    max_num_partial_prefills: int | None = flag(
        None, "requests prefilling in one step, sharing what decodes leave (default min(4, max_num_seqs))")
    max_long_partial_prefills: int | None = flag(
        None, "of those, how many may be long (default 1): short prompts start beside a long one")
    long_prefill_token_threshold: int | None = flag(
        None, "a prefill with more tokens left than this is long (default: the step budget)")
    scheduling_policy: str = flag(
        "fcfs", "fcfs (default) or priority: lower request priority first, and preempted last",
        choices=SCHEDULING_POLICIES)
    max_num_seqs: int = flag(256, "requests running at once (default 256)")
    block_size: int = flag(16, "tokens per KV block (default 16)")
    num_kv_blocks: int | None = flag(None, "KV pool size in blocks (default: what the memory plan leaves)")
    kv_cache_memory_bytes: int | str | None = flag(None, "KV pool size as bytes or e.g. 2GiB")
    kv_offloading_size: int | str | None = flag(
        None, "host memory for the prefix cache's host tier, as bytes or e.g. 8GiB (vLLM's name): cached blocks "
        "the device pool evicts move there, and a hit on one is copied back; 0 turns it off (default: on CUDA twice "
        "the device pool within a quarter of free host memory, on CPU none)")
    kv_disk_cache_dir: str | None = flag(
        None, "directory for the prefix cache's disk tier, below the host tier (needs kv_offloading_size): every "
        "cached block and state checkpoint is also written there, so sessions outlive the host tier and restarts "
        "(default: no disk tier)")
    kv_disk_cache_size: int | str | None = flag(
        None, "bytes the disk tier may use, e.g. 50GiB (default: a tenth of the free space in kv_disk_cache_dir)")
    memory_budget: int | str | None = flag(None, "cap on all ladle may use, e.g. 8GiB (default: measured)")
    gpu_memory_utilization: float = flag(0.9, "CUDA: share of device memory (0.9)")  # vLLM semantics
    enable_prefix_caching: bool = flag(True, "reuse KV of shared prompt prefixes (default on)")
    num_state_checkpoints: int | None = flag(
        None, "models with per-request state (Gated DeltaNet, DeepSeek-V4): state checkpoints kept for prefix hits "
              "(default: derived from memory)")
    state_checkpoint_interval: int | None = flag(
        None, "tokens between state checkpoints while a request prefills, a multiple of the block size (default: "
              "the chunk cap in whole blocks)")
    enforce_eager: bool = flag(False, "CUDA: no CUDA graphs")  # every step eager (vLLM semantics)
    max_cudagraph_capture_size: int | None = flag(
        None, "CUDA: largest step, in tokens, replayed from a graph (default min(512, max_num_seqs))")
    cudagraph_mode: str | None = flag(
        None, "CUDA: FULL replays decode-only steps and steps with a prefill chunk from graphs, FULL_DECODE_ONLY "
              "only decode-only steps (default FULL)", choices=CUDAGRAPH_MODES)
    async_scheduling: bool = flag(
        False, "launch a decode step whose successor is certain before reading its tokens")
    load_format: str = flag("auto", "dummy: random weights from config.json alone, for benchmarks",
                            choices=LOAD_FORMATS)
    quantization: str | None = flag(
        None, "the checkpoint's weight format (default: what its quantization_config says; a value that "
              "contradicts the checkpoint is refused)", choices=QUANTIZATIONS, short="-q")
    dequantize_weights: bool = flag(
        False, "widen a quantized checkpoint's FP8/MXFP4 weights to --dtype at load (for comparison, or where a "
               "quantized kernel is missing: FP8 experts on CUDA); refused for an unquantized one")
    profile_cache: bool = flag(
        True, "reuse the activation profile stored by an earlier start of the same model, dtype, device and "
              "ladle code (default on; --no-profile-cache measures again and refreshes it)")
    num_threads: int | None = flag(
        None, "CPU: torch threads (default: the CPUs this process may use; serve leaves one for its API process "
              "and pins the engine to the rest)")
    attention_backend: str | None = flag(
        None, "default: triton on CUDA; on CPU, ladle's C decode kernel (built with the system C compiler on first "
              "use), or torch where it cannot be built", choices=ATTENTION_BACKENDS)
    reserved_cpus: int = 0  # CPUs left to ladle's other processes (`ladle serve` sets 1, for its API process)
    tensor_parallel_size: int = flag(
        1, "shard the model over this many ranks, one process each (gloo on CPU, NCCL on CUDA; default 1)",
        short="-tp")  # ladle.distributed
    # Drafts verified in each decode step (ladle.config.speculative: a dict, or its JSON as vLLM's CLI takes it).
    speculative_config: dict[str, Any] | str | None = flag(  # noqa: RUF009 -- flag() returns a field()
        None, 'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 3, '
              '"prompt_lookup_max": 4} (drafts verified in each decode step; the output is unchanged)')
    # MoE models: routed experts off the device (ladle.experts): slots cached on it, how misses run, where the
    # experts live. Default: every expert resident, or tiering derived when they do not fit the budget.
    moe_cache_size: int | None = flag(
        None, "MoE: routed-expert slots on the device, shared by all MoE layers; the rest live in --moe-backing "
              "(default: every expert resident, or derived when they do not fit)")
    moe_cache_fraction: float | None = flag(
        None, "MoE: the expert cache as a share of all routed experts (instead of --moe-cache-size)")
    moe_strategy: str | None = flag(
        None, "tiered experts: offload (a miss is fetched into a slot), cpu (computed where it lives, nothing "
              "cached) or hybrid (per miss, from the costs measured at startup)", choices=MOE_STRATEGIES)
    moe_backing: str | None = flag(
        None, "where tiered experts live: host memory (default on CUDA, pinned) or mmap: read from the "
              "checkpoint's files when needed (default on CPU; a model larger than RAM runs)", choices=MOE_BACKINGS)
    moe_prefetch: bool | None = flag(
        None, "tiered experts: fetch a layer's misses, and in a prefill the next layer's experts, ahead on a "
              "worker thread (default: on CUDA, where copies use the DMA engines; off on CPU, where they compete "
              "with the compute for the same cores)")
    ple_table: str | None = flag(
        None, "Qwen4-Exp's PLE n-gram tables: device, host (held in host memory; each step's rows gathered "
              "from its token ids) or mmap (left in the checkpoint's files, each step's rows read when needed: "
              "tables larger than RAM) (default: device when every weight fits the device, else host)",
        choices=PLE_TABLES)
    seed: int = flag(0)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> tuple[EngineArgs, frozenset[str]]:
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
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantization={self.quantization!r}: ladle reads 'fp8' checkpoints (block-scaled "
                             "e4m3); online quantization of unquantized weights is not implemented")
        if not isinstance(self.dequantize_weights, bool):
            raise ValueError(f"dequantize_weights={self.dequantize_weights!r} is not a bool")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={self.load_format!r}: choose one of {', '.join(LOAD_FORMATS)}")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        for name in ("kv_cache_memory_bytes", "memory_budget", "kv_offloading_size", "kv_disk_cache_size"):
            if getattr(self, name) is not None:
                parse_bytes(getattr(self, name), name, allow_zero=name == "kv_offloading_size")
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
        if self.ple_table is not None and self.ple_table not in PLE_TABLES:
            raise ValueError(f"ple_table={self.ple_table!r}: choose one of {', '.join(PLE_TABLES)}")
        validate_moe_args(self.moe_cache_size, self.moe_cache_fraction, self.moe_strategy, self.moe_backing,
                          self.moe_prefetch)
        check_model_dir(self.model, "model")
        if self.tokenizer is not None:
            check_model_dir(self.tokenizer, "tokenizer")
        if self.max_model_len is not None and gguf_file_of(self.model) is None:
            # A peek at config.json (a GGUF file's metadata is checked when setup reads it); setup checks again
            # with the parsed config (nested text configs too).
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



def positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value
