"""Where PLE's hashed n-gram tables live (Qwen4-Exp's per-layer embeddings, the largest tensors of the model):
on the device, in host memory with each step's rows gathered from its token ids, or left in the checkpoint's files
with each step's rows read from there (mmap). Resolved while the model is
on meta, before any storage exists, and shown as a line of the plan."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ladle.config.engine_args import EngineArgs
from ladle.config.sizes import format_bytes
from ladle.experts.tiering import ROOM_SHARE
from ladle.models.qwen4_exp.ple import NGramEmbedding

_WIDENED = (torch.float32, torch.bfloat16, torch.float16)  # built in one of these, held in the model dtype


@dataclass(frozen=True)
class TablePlacement:
    where: str  # device | host | mmap
    nbytes: int  # the tables' bytes
    line: str  # the plan's line on them

    def apart(self, on_cpu: bool) -> int:
        """Bytes the tables take out of the device's weights: in host memory, unless that is the device; in the
        files, on any device."""
        return self.nbytes if self.where == "mmap" or (self.where == "host" and not on_cpu) else 0


def ple_tables(model: nn.Module) -> list[NGramEmbedding]:
    return [m for m in model.modules() if isinstance(m, NGramEmbedding)]


def table_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """The tables' bytes as held in dtype (on meta, before they are)."""
    return sum(t.ngram_embedding.weight.numel() * dtype.itemsize for t in ple_tables(model))


def meta_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """Every parameter's and buffer's bytes as they will be held, the model on meta."""
    return sum(t.numel() * (dtype.itemsize if t.dtype in _WIDENED else t.element_size())
               for t in (*model.parameters(), *model.buffers()))


def place_tables(model: nn.Module, args: EngineArgs, budget: int, on_cpu: bool, dtype: torch.dtype,
                 put: Callable[..., Any], everything: int | None = None) -> TablePlacement | None:
    """Resolve ple_table for the model on meta (everything: all its weights' bytes, if known better than
    meta_bytes) and mark its tables for the loader; None: it has no PLE table."""
    tables = table_bytes(model, dtype)
    total = meta_bytes(model, dtype) if everything is None else everything
    where = resolve_ple_table(args, tables, total, budget, on_cpu, put)
    if where is None:
        return None
    for table in ple_tables(model):
        table.ngram_embedding.on_host = where in ("host", "mmap")
        table.ngram_embedding.from_files = where == "mmap"
    return TablePlacement(where, tables, table_line(tables, where, len(ple_tables(model)), on_cpu))


def resolve_ple_table(args: EngineArgs, tables: int, all_weights: int, budget: int, on_cpu: bool,
                      put: Callable[..., Any]) -> str | None:
    """'device' or 'host' for a model with PLE tables of `tables` bytes (None: it has none). Derived: host
    memory on CUDA unless every weight (all_weights, the tables and every expert included) fits beside room for
    the KV pool and activations: a step reads a few rows of each table, far fewer bytes than the experts it routes
    to, so the table leaves the device before any expert does."""
    if not tables:
        if args.ple_table is not None:
            raise ValueError("ple_table is set, but this model has no PLE n-gram table; drop it")
        return None
    if args.ple_table == "mmap" and args.load_format == "dummy":
        raise ValueError("ple_table=mmap reads the n-gram tables from the checkpoint's files, and load_format dummy "
                         "reads none; use ple_table host or device")
    if args.ple_table is not None:
        return put("ple_table", args.ple_table)
    if on_cpu:
        return put("ple_table", "device", "on CPU host memory is the device's")
    if all_weights <= budget * (1 - ROOM_SHARE):
        return put("ple_table", "device", f"every weight ({format_bytes(all_weights)}) fits the device beside "
                                          "room for the KV pool and activations")
    return put("ple_table", "host", f"the weights ({format_bytes(all_weights)}) do not all fit the device: the "
               f"tables ({format_bytes(tables)}) go first, a step reading only its tokens' rows of them")


def table_line(tables: int, where: str, layers: int, on_cpu: bool) -> str:
    """The plan's line on the tables: where, and their bytes."""
    if where == "mmap":
        place = ("in the checkpoint's files, mapped, not in the weights; each step's rows read from them when needed "
                 "(the OS page cache keeps what was read)")
    elif where == "host":
        place = "in host memory" + (" (counted in the weights: on CPU it is the device's)" if on_cpu else
                                    ", not in the weights") + "; each step's rows gathered from its token ids"
    else:
        place = "on the device (in the weights)"
    return f"PLE n-gram tables: {format_bytes(tables)} in {layers} layers, {place}"
