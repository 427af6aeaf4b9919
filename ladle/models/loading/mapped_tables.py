"""Tables left in the checkpoint's files (HostTable.from_files: Qwen4-Exp's n-gram tables under ple_table mmap):
each is mapped from the safetensors files, read-only in effect (copy-on-write, never written), before the model is
materialized, so no table-sized storage is allocated, and the loader does not read them."""
from __future__ import annotations

from typing import Protocol, cast

import numpy as np
import torch
from torch import nn

from ladle.experts.backing import FLOATS, TensorLocation, tensor_locations
from ladle.models.layers.host_table import HostTable

Segment = tuple[int, str, TensorLocation]  # (first row, checkpoint tensor name, where it lies)


class MapsTables(Protocol):
    def table_sources(self, locations: dict[str, TensorLocation],
                      renames: dict[str, str]) -> dict[str, list[Segment]]:
        """Per table parameter: the checkpoint tensors holding its rows, by the model's own naming rules."""


def map_tables(model: nn.Module, files: list[str], renames: dict[str, str], dtype: torch.dtype) -> set[str]:
    """Map every from_files table's rows (the model on meta); returns the checkpoint tensor names the loader must
    not read. A table whose rows the files do not cover exactly, in a float type, is refused naming it."""
    tables = {name: m for name, m in model.named_modules() if isinstance(m, HostTable) and m.from_files}
    if not tables:
        return set()
    if not files or not hasattr(model, "table_sources"):
        raise ValueError("ple_table=mmap reads the n-gram tables from a safetensors checkpoint's files, which this "
                         "model has none of; use ple_table host or device")
    sources = cast(MapsTables, model).table_sources(tensor_locations(files), renames)
    skip: set[str] = set()
    for name, table in tables.items():
        rows, width = table.weight.shape
        found = sorted(sources.get(f"{name}.weight", []), key=lambda s: s[0])
        covered = 0
        for start, raw, loc in found:
            if start != covered or len(loc.shape) != 2 or loc.shape[1] != width or loc.dtype not in FLOATS:
                raise ValueError(f"{raw}: {loc.dtype} {loc.shape} at row {start} does not continue {name}.weight "
                                 f"({rows} x {width} floats) from row {covered}")
            covered += loc.shape[0]
        if covered != rows:
            raise ValueError(f"the checkpoint's files hold {covered} of the {rows} rows of {name}.weight")
        table.map_files([(start, _mapped(loc)) for start, _, loc in found], dtype)
        skip.update(raw for _, raw, _ in found)
    return skip


def _mapped(loc: TensorLocation) -> torch.Tensor:
    """The tensor's bytes mapped from its file (copy-on-write: nothing here writes them, and the mapping lives as
    long as the tensor)."""
    raw = np.memmap(loc.path, dtype=np.uint8, mode="c", offset=loc.offset, shape=(loc.nbytes,))
    return torch.from_numpy(raw).view(loc.dtype).view(loc.shape)
