"""Build a model from a local HF checkpoint directory (config.json + safetensors) or a GGUF file."""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from ladle.distributed.parallel_state import SINGLE, TensorParallel
from ladle.experts.backing import FLOATS
from ladle.experts.tiering import ExpertInventory, ExpertTiering
from ladle.gguf.path import gguf_file_of
from ladle.kernels import cpu_kernels
from ladle.models.interface import CausalLM, ConfiguredModel, SupportsMtp
from ladle.models.layers.cpu_ops import CpuOps
from ladle.models.layers.decoder_layer import RotaryEmbedding
from ladle.models.layers.host_table import HostTable
from ladle.models.layers.ops import ModelOps, TorchOps, TritonOps, set_ops
from ladle.models.loading.expert_tiering import expert_inventory, fill_dummy_experts, tier_experts
from ladle.models.loading.huge_pages import move_weights_to_huge_pages
from ladle.models.loading.mapped_tables import map_tables
from ladle.models.registry import model_class_for, text_config_of
from ladle.quantization.apply import (
    checkpoint_dtypes,
    dequantize_layers,
    scale_names,
    use_fp8_linears,
    with_scale_slices,
)
from ladle.quantization.config import quant_config_of
from ladle.quantization.ggml_embedding import use_ggml_embedding
from ladle.quantization.ggml_linear import use_ggml_linears
from ladle.quantization.layer_interfaces import KeepsDtypes

_SINGLE_FILE = "model.safetensors"


class CheckpointError(RuntimeError):
    """The checkpoint's files exist but cannot be read."""

_INDEX_FILE = "model.safetensors.index.json"


def select_ops(device: torch.device) -> ModelOps:
    """Triton on CUDA; on CPU ladle's C kernels where they build (ladle.models.layers.cpu_ops), else torch."""
    if device.type == "cuda":
        return TritonOps()
    try:
        return CpuOps(cpu_kernels.load())
    except cpu_kernels.KernelUnavailable:
        return TorchOps()


def checkpoint_files(model_dir: str) -> list[str]:
    """The safetensors files of a checkpoint: the shards its index lists, or the single file."""
    index = os.path.join(model_dir, _INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, s) for s in shards]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"{_INDEX_FILE} lists shards that do not exist: {missing}")
        return files
    single = os.path.join(model_dir, _SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(f"no {_SINGLE_FILE} or {_INDEX_FILE} in {model_dir}")


def iter_weights(files: list[str], slices: dict | None = None,
                 skip: set[str] | frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time, so host memory holds one tensor beyond the model. slices: a
    tensor-parallel rank's part of each sharded tensor (ladle.models.loading.tensor_parallel.Slices), read alone from
    the file; a None slice skips the tensor, as does a name in skip (experts read from the files when needed)."""
    from safetensors import SafetensorError, safe_open

    slices = slices or {}
    for path in files:
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 -- safe_open has keys() but no iteration
                    if name in skip:
                        continue
                    if name not in slices:
                        yield name, f.get_tensor(name)
                    elif (part := slices[name]) is not None:
                        index = [slice(None)] * (part.dim + 1)
                        index[part.dim] = slice(part.start, part.start + part.size)
                        yield name, f.get_slice(name)[tuple(index)]
        except SafetensorError as e:
            raise CheckpointError(f"the weights file {path} is truncated or corrupt ({e}); copy or export the "
                                  "checkpoint again") from None


def load_config(model_dir: str) -> Any:
    """The checkpoint's HF config, checked to name an architecture ladle implements."""
    from transformers import AutoConfig

    gguf = gguf_file_of(model_dir)
    if gguf is not None:
        from ladle.gguf.config import hf_config_of
        from ladle.gguf.reader import read_gguf

        config = hf_config_of(read_gguf(gguf))
        model_class_for(config)
        return config
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model directory {model_dir!r} does not exist (only local checkpoints are loaded)")
    from huggingface_hub.errors import StrictDataclassError

    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, KeyError, StrictDataclassError) as e:  # the last: a config HF's own checks refuse
        raise ValueError(f"cannot read the config of {model_dir!r}: {str(e).splitlines()[0]}") from None
    model_class_for(config)
    return text_config_of(config)


def _enable_mtp(model: CausalLM, world_size: int) -> None:
    if not model.supports_mtp:
        raise ValueError(f"speculative_config method 'mtp' runs the MTP layer of Qwen3.5 and DeepSeek-V4; "
                         f"{type(model).__name__} has none ladle can run; use method 'ngram'")
    if world_size > 1:
        raise ValueError("speculative_config method 'mtp' cannot be used with tensor_parallel_size > 1 yet")
    cast(SupportsMtp, model).enable_mtp()


def load_model(
    model_dir: str, device: torch.device, dtype: torch.dtype, load_format: str = "auto", seed: int = 0,
    config: Any = None, tp: TensorParallel = SINGLE, dequantize: bool = False,
    tiering: Callable[[ExpertInventory | None], ExpertTiering | None] | None = None, mtp: bool = False,
    tables: Callable[[nn.Module], int] | None = None,
) -> tuple[ConfiguredModel, Any]:
    """Build the model for model_dir's config (read here unless given) on device in dtype and load its
    safetensors weights, or, with load_format="dummy", fill it with random weights (model_dir then needs only
    config.json). With tp of several ranks, only rank tp.rank's shard is built and read. dequantize: a
    quantized checkpoint's layers are widened to dtype once loaded. tiering: given the model's routed experts
    (ladle.experts.tiering), says whether and how they leave the device (the setting resolved by the caller).
    mtp: the checkpoint's multi-token-prediction layer is built and loaded too (speculative_config method mtp).
    tables: given the model on meta, places its host-holdable tables (ladle.startup.ple_tables) and returns the
    bytes it put in host memory, which the experts' tiering then does not count as the device's."""
    config = load_config(model_dir) if config is None else config
    model_cls = model_class_for(config)
    gguf = gguf_file_of(model_dir)
    if gguf is not None and (tp.world_size > 1 or mtp):
        what = "tensor_parallel_size > 1" if tp.world_size > 1 else "speculative_config method 'mtp'"
        raise ValueError(f"{gguf.name}: a GGUF checkpoint cannot be used with {what} yet")
    files = checkpoint_files(model_dir) if load_format != "dummy" and gguf is None else []
    device = torch.device(device)

    quant = quant_config_of(config)
    if quant is not None and load_format == "dummy":
        raise ValueError("load_format 'dummy' draws unquantized random weights; drop the checkpoint's "
                         "quantization_config or load its files")
    # Build on meta so no random init runs, then allocate uninitialised storage on the target device.
    slices, renames = None, {}
    with torch.device("meta"):
        model = model_cls(config)
        if mtp:
            _enable_mtp(model, tp.world_size)
        if tp.world_size > 1:
            if not model_cls.tensor_parallel:
                raise ValueError(f"{model_cls.__name__} has no tensor-parallel form yet; run it with "
                                 "tensor_parallel_size 1")
            slices = model.shard(tp)
        if quant is not None:
            raw = checkpoint_dtypes(files)
            renames = scale_names(raw)
            dtypes = {model.checkpoint_name(renames.get(k, k)): v for k, v in raw.items()}
            if use_fp8_linears(model, quant, dtypes) == 0:
                raise ValueError(f"{model_dir}: quantization_config says fp8, but no linear layer's weight in the "
                                 "checkpoint is FP8 e4m3")
            if slices is not None:
                slices = with_scale_slices(slices, quant.block, dtypes)
        gguf_blocks: set[str] = set()
        if gguf is not None and not dequantize and device.type == "cpu" and load_format != "dummy":
            # block-quantized linears and embedding stay blocks on CPU (C kernels); elsewhere, or asked to, all are
            # widened
            block_types = gguf_block_types(gguf, config)
            gguf_blocks = use_ggml_linears(model, block_types) | use_ggml_embedding(model, block_types, dtype)
    apart = tables(model) if tables is not None else 0
    inventory = expert_inventory(model, config, dtype) if tiering is not None else None
    if inventory is not None and apart:
        inventory = dataclasses.replace(inventory, resident_bytes=inventory.resident_bytes - apart)
    tiered = tiering(inventory) if tiering is not None else None
    skip: set[str] = set()
    if tiered is not None:
        if mtp:
            raise ValueError("tiered experts (moe_cache_size / moe_strategy) cannot be used with speculative_config "
                             "method 'mtp' yet")
        if tp.world_size > 1 or dequantize:
            raise ValueError("tiered experts (moe_cache_size / moe_strategy) cannot be used with "
                             f"{'tensor_parallel_size > 1' if tp.world_size > 1 else 'dequantize_weights'} yet")
        if gguf is not None:  # tiering reads experts from safetensors files when it needs them
            raise ValueError(f"{gguf.name}: tiered experts (moe_cache_size / moe_strategy) cannot be used with a "
                             "GGUF checkpoint yet; give a memory_budget that holds every expert")
        assert inventory is not None  # taken whenever tiering is given
        skip = tier_experts(model, tiered, dtype, device, files, renames, inventory.top_k)
    mapped = map_tables(model, files, renames, dtype)
    _materialize(model, device, dtype)
    set_ops(model, select_ops(device))
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.init_buffers()  # to_empty left it uninitialised, and it must stay fp32

    if load_format == "dummy":
        init_dummy_weights(model, seed)
        fill_dummy_experts(model, torch.Generator().manual_seed(seed + 1))
        model.init_dummy_buffers(torch.Generator(device=device).manual_seed(seed))
    else:
        named = (gguf_weights(gguf, config, gguf_blocks) if gguf is not None else
                 ((renames.get(name, name), tensor) for name, tensor in iter_weights(files, slices, skip | mapped)))
        loaded = model.load_weights((name, _cast(name, tensor, dtype)) for name, tensor in named)
        loaded |= {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, HostTable) and m.segments}
        missing = sorted(set(dict(model.named_parameters())) - loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
            raise ValueError(f"checkpoint {model_dir} has no weights for parameters: {shown}")
        if dequantize:
            dequantize_layers(model, dtype)

    if device.type == "cpu":
        model.lay_out_for_cpu()
        move_weights_to_huge_pages(model)
    model.requires_grad_(False).eval()
    return model, config


def gguf_block_types(path: str | Path, config: Any) -> dict[str, str]:
    """HF weight name -> the ggml type its GGUF tensor is stored in, for the decoder layers' linears, the
    embedding and an untied head (a tied head is the embedding's table: ladle.quantization.ggml_embedding)."""
    from ladle.gguf.config import architecture_of
    from ladle.gguf.reader import read_gguf
    from ladle.gguf.tensors import map_tensors

    gguf = read_gguf(path)
    return {t.hf_name: t.info.qtype.name for t in map_tensors(gguf, architecture_of(gguf), config)
            if t.hf_name.startswith(("model.layers.", "model.embed_tokens.", "lm_head."))}


def gguf_weights(path: str | Path, config: Any, keep: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """A GGUF file's tensors under HF names, each checked against config before any is read (a missing or
    misshapen one fails naming it): the names in keep as their block bytes (GgmlLinear), every other tensor
    widened to float32 one at a time (the loader casts it to the model dtype), a MoE layer's stacked experts
    one expert at a time under their per-expert names (always widened: ladle.gguf.tensors)."""
    from ladle.gguf.config import architecture_of
    from ladle.gguf.reader import read_gguf
    from ladle.gguf.tensors import iter_weights as iter_gguf
    from ladle.gguf.tensors import map_tensors

    gguf = read_gguf(path)
    return iter_gguf(gguf, map_tensors(gguf, architecture_of(gguf), config), keep)


def _cast(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Unquantized weights in the model dtype; quantized values and their scales as the file has them (the
    parameter they fill says what it takes)."""
    keep = tensor.dtype not in FLOATS or name.endswith("weight_scale_inv")
    return tensor if keep or not tensor.is_floating_point() else tensor.to(dtype)


def _materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give each meta parameter and buffer empty storage on device, floating ones in dtype (but those a module
    names in keep_dtypes: quantized weights and their scales). The same as model.to(dtype).to_empty(device),
    without the meta empty_like that imports sympy (1-2 s of a start)."""
    done: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor, keep: bool, where: torch.device = device) -> torch.Tensor:
        if id(t) not in done:
            floating = t.is_floating_point() and not keep
            done[id(t)] = torch.empty(t.shape, dtype=dtype if floating else t.dtype, device=where)
        return done[id(t)]

    host = torch.device("cpu")
    for module in model.modules():
        keep = module.keep_dtypes if isinstance(module, KeepsDtypes) else ()
        where = host if isinstance(module, HostTable) and module.on_host else device
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = nn.Parameter(empty(p, name in keep, where), requires_grad=p.requires_grad)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = empty(b, name in keep)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Weights N(0, 0.02) and norms 1, drawn on the model's device (an 8B model fills in well under a second
    on a GPU): throughput and memory do not depend on weight values, and no checkpoint needs to exist. A table
    held in host memory (HostTable) draws from a host generator of the same seed."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if param.device not in generators:
            generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        generator = generators[param.device]
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, 0.02, generator=generator)
