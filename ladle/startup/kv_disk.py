"""The prefix cache's disk tier at startup (ladle.kv_cache.disk_tier): where its entries go, how many bytes they may
use, and the model identity every entry is keyed by, so that no entry written for other weights, another dtype,
quantization, block size or cache layout is ever read as this model's.

The identity hashes the weights' files by samples (each file's name and size, and 64 KiB from its start, middle and
end: two fine-tunes of one shape differ there, and hashing a whole checkpoint at every start would cost minutes),
the model's config, and everything that shapes a block's bytes (and a state checkpoint's, where the model has
them). Entries live in a directory named by it.

A model whose prefix hits need state checkpoints (state layers, compressed groups) is served too: its checkpoints
go to disk with its blocks, and are read back into the host tier's checkpoints, so it needs room for at least one
there. Tensor parallelism is refused: each rank would need its own shard of every entry."""
from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass

import torch

from ladle.config.engine_args import EngineArgs
from ladle.config.provenance import Provenance
from ladle.config.sizes import format_bytes, parse_bytes
from ladle.kv_cache.disk_format import TensorSpec, storable
from ladle.kv_cache.specs import KVCacheLayout

SAMPLE_BYTES = 64 * 1024
DEFAULT_SHARE_OF_FREE_DISK = 0.1
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".json")


@dataclass(frozen=True)
class KVDiskConfig:
    directory: str  # this model's entries: <kv_disk_cache_dir>/<identity[:32]>
    identity: str
    capacity_bytes: int
    specs: tuple[TensorSpec, ...]  # one block's page of each pool tensor
    checkpoint_specs: tuple[TensorSpec, ...] = ()  # a state checkpoint's row of each state and tail tensor

    @property
    def entry_bytes(self) -> int:
        return _bytes(self.specs)

    @property
    def checkpoint_entry_bytes(self) -> int:
        return _bytes(self.checkpoint_specs)


def _bytes(specs: tuple[TensorSpec, ...]) -> int:
    return sum(torch.Size(shape).numel() * getattr(torch, dtype.removeprefix("torch.")).itemsize
               for dtype, shape in specs)


def page_specs(layout: KVCacheLayout) -> tuple[TensorSpec, ...]:
    """One block's page of each distinct pool tensor, in the order the host tier keeps them
    (ladle.runner.kv_allocation: K then V of each tensor pair, one tensor where K and V are shared)."""
    spec = layout.groups[0].spec
    page = (str(spec.dtype), (layout.block_size, spec.num_kv_heads, spec.head_dim))
    return (page,) * (layout.num_tensors * (1 if spec.kv_shared else 2))


def checkpoint_specs(layout: KVCacheLayout) -> tuple[TensorSpec, ...]:
    """A state checkpoint's row of each state tensor, then its tail pages of each compressed layer (a K and a V page
    unless key = value), in the order the host tier keeps them (ladle.runner.host_kv_cache.HostCheckpointCache;
    ladle.runner.kv_allocation.allocate_checkpoint_tails)."""
    state = [(str(d), tuple(s)) for g in layout.state_groups for _ in g.layers for s, d in zip(g.spec.shapes,
                                                                                                 g.spec.dtypes)]
    spec = layout.groups[0].spec
    pages = (str(spec.dtype), (1 if spec.kv_shared else 2, layout.block_size, spec.num_kv_heads, spec.head_dim))
    return (*state, *(pages for g in layout.tail_groups for _ in layout.groups[g].layers))


def _file_fingerprint(h: hashlib._Hash, path: str) -> None:
    size = os.path.getsize(path)
    h.update(f"{os.path.basename(path)}\0{size}\0".encode())
    with open(path, "rb") as f:
        for at in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}):
            f.seek(at)
            h.update(f.read(SAMPLE_BYTES))


def model_identity(model: str, dtype: torch.dtype, quantization: str | None, layout: KVCacheLayout,
                   tp_rank: int = 0, tp_size: int = 1) -> str:
    h = hashlib.sha256(b"ladle-kv-disk-identity-v1\0")
    files = ([model] if os.path.isfile(model) else
             sorted(os.path.join(model, n) for n in os.listdir(model) if n.endswith(_WEIGHT_SUFFIXES)))
    for path in files:
        _file_fingerprint(h, path)
    shaped = (str(dtype), quantization, layout.block_size, layout.lines(), page_specs(layout), tp_rank, tp_size)
    checkpoints = checkpoint_specs(layout)
    # (a model without checkpoints keeps the identity it had before checkpoints went to disk, and its entries)
    h.update(repr((*shaped, checkpoints) if checkpoints else shaped).encode())
    return h.hexdigest()


def resolve_kv_disk(args: EngineArgs, prov: Provenance, layout: KVCacheLayout, dtype: torch.dtype,
                    quantization: str | None, host_blocks: int, host_checkpoints: int, checkpointing: bool,
                    tp_size: int) -> KVDiskConfig | None:
    """The disk tier's settings, or None without kv_disk_cache_dir; what it cannot serve is refused by name.
    host_checkpoints: the host tier's state checkpoint slots (checkpointing: prefix hits need checkpoints)."""
    if args.kv_disk_cache_dir is None:
        if args.kv_disk_cache_size is not None:
            raise ValueError("kv_disk_cache_size sizes the disk tier, but kv_disk_cache_dir is not given; give "
                             "both or neither")
        prov.put("kv_disk_cache_dir", "off")
        return None
    if not host_blocks:
        why = prov.settings["kv_offloading_size"].reason
        raise ValueError("kv_disk_cache_dir: the disk tier reads entries back through the host tier, which is off "
                         f"here{f' ({why})' if why else ''}; give kv_offloading_size too (e.g. 1GiB)")
    if checkpointing and not host_checkpoints:
        raise ValueError("kv_disk_cache_dir: this model's prefix hits need state checkpoints, which the disk tier "
                         "reads back through the host tier's, and kv_offloading_size leaves room for none here; "
                         "give more kv_offloading_size")
    if tp_size > 1:
        raise ValueError("kv_disk_cache_dir cannot be used with tensor_parallel_size > 1 yet; drop it")
    root = os.path.abspath(os.path.expanduser(args.kv_disk_cache_dir))
    os.makedirs(root, exist_ok=True)
    if not os.access(root, os.W_OK):
        raise ValueError(f"kv_disk_cache_dir={args.kv_disk_cache_dir!r} is not writable; give a directory ladle "
                         "may write")
    identity = model_identity(args.model, dtype, quantization, layout)
    if args.kv_disk_cache_size is not None:
        capacity = parse_bytes(args.kv_disk_cache_size, "kv_disk_cache_size")
        prov.put("kv_disk_cache_size", format_bytes(capacity))
    else:
        free = shutil.disk_usage(root).free
        capacity = int(free * DEFAULT_SHARE_OF_FREE_DISK)
        prov.put("kv_disk_cache_size", format_bytes(capacity),
                 f"a tenth of the {format_bytes(free)} free in {root}")
    specs = page_specs(layout)
    config = KVDiskConfig(os.path.join(root, identity[:32]), identity, capacity, specs,
                          checkpoint_specs(layout) if checkpointing else ())
    unknown = sorted({d for d, _ in (*config.specs, *config.checkpoint_specs) if not storable(d)})
    if unknown:  # every entry would be a miss
        raise ValueError(f"kv_disk_cache_dir: the disk tier cannot keep this model's {', '.join(unknown)} tensors yet; "
                         "drop kv_disk_cache_dir")
    if capacity < max(config.entry_bytes, config.checkpoint_entry_bytes):
        raise ValueError(f"kv_disk_cache_size={format_bytes(capacity)} holds no block of this model "
                         f"({format_bytes(config.entry_bytes)} each"
                         + (f", {format_bytes(config.checkpoint_entry_bytes)} a state checkpoint"
                            if config.checkpoint_specs else "") + "); give more")
    prov.put("kv_disk_cache_dir", config.directory)
    return config
