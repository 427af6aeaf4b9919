"""An embedding table that can be held in host memory while the rest of the model is on the device: a step's rows
are gathered on the host from its row ids and only they are copied to the device. For tables far larger than
the device (Qwen4-Exp's hashed n-gram tables: ~95 GiB on the Flash-Next shape) whose step reads a few rows.

The loader allocates the weight on the host when on_host is set (ladle.startup.ple_tables decides it, on meta);
on a CPU device host memory is the device's, and the gather is the same code. With from_files too (ple_table mmap)
nothing is allocated: the loader maps the table's rows from the checkpoint's safetensors files (one segment per
file tensor: HF may store a table as row chunks) and a step reads its rows from there, so the OS page cache, not the
process, holds what was read, and a table larger than RAM serves (llama.cpp's mmap, the expert tier's mmap)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class HostTable(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.on_host = False
        self.from_files = False
        self.segments: list[tuple[int, torch.Tensor]] = []  # (first row, rows mapped from a file)

    def map_files(self, segments: list[tuple[int, torch.Tensor]], dtype: torch.dtype) -> None:
        """Serve rows from these file-mapped segments, converted to dtype; the weight becomes an empty stand-in
        (before the loader materializes the model, so no table-sized storage is ever allocated)."""
        self.segments = segments
        self.weight = nn.Parameter(torch.empty(0, self.weight.shape[1], dtype=dtype, device=self.weight.device),
                                   requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Row ids (any shape, on the compute device) -> their rows [*ids.shape, dim] on that device."""
        if not self.on_host:
            return F.embedding(ids, self.weight)
        host_ids = ids.reshape(-1).to(self.weight.device)
        pinned = ids.device.type == "cuda"  # the copy to the device can then run beside the compute
        rows = torch.empty(host_ids.shape[0], self.weight.shape[1], dtype=self.weight.dtype, pin_memory=pinned)
        if self.segments:
            for start, part in self.segments:
                inside = (host_ids >= start) & (host_ids < start + part.shape[0])
                if bool(inside.any()):
                    rows[inside] = part.index_select(0, host_ids[inside] - start).to(rows.dtype)
        else:
            torch.index_select(self.weight, 0, host_ids, out=rows)
        return rows.to(ids.device, non_blocking=pinned).view(*ids.shape, -1)
