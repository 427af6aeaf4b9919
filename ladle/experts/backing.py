"""Where a tiered layer's experts live: host memory (HostBacking) or the checkpoint's safetensors files, read
when an expert is needed (FileBacking), so a model whose experts exceed RAM runs on CPU as llama.cpp's mmap
does, with the process holding only the resident weights and the cache's slots."""
from __future__ import annotations

import ctypes
import json
import struct
from dataclasses import dataclass

import torch

from ladle.experts.expert_files import ExpertFiles

# safetensors dtype names -> torch
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                      "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8,
                      "U8": torch.uint8}
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class TensorLocation:
    path: str
    offset: int  # from the start of the file
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def tensor_locations(files: list[str]) -> dict[str, TensorLocation]:
    """Every tensor of the safetensors files by name, from their headers alone (no tensor is read)."""
    found: dict[str, TensorLocation] = {}
    for path in files:
        with open(path, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(size))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            dtype = SAFETENSORS_DTYPES.get(meta["dtype"])
            if dtype is None:
                continue  # no expert is stored so; the loader reports such a tensor if the model needs it
            start, end = meta["data_offsets"]
            found[name] = TensorLocation(path, 8 + size + start, end - start, dtype, tuple(meta["shape"]))
    return found


def compatible(file: torch.dtype, held: torch.dtype) -> bool:
    """Whether checkpoint values of dtype `file` fill a tensor of dtype `held` as the loader would fill it: floats
    converted, quantized bytes kept as they are (so of the same width)."""
    return (file in FLOATS) == (held in FLOATS) and (held in FLOATS or file.itemsize == held.itemsize)


def copy_values(dest: torch.Tensor, src: torch.Tensor) -> None:
    """src into dest as the loader would (`compatible` was checked when the files were read)."""
    dest.copy_(src.to(dest.dtype) if dest.dtype in FLOATS else src.view(dest.dtype))


class HostBacking:
    """A layer's stacked experts, name -> [E, ...], in host memory (pinned when the device is CUDA, so a fetch
    is one DMA); the loader fills them as it fills parameters."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors.values())

    def expert(self, expert: int) -> dict[str, torch.Tensor]:
        return {name: t[expert] for name, t in self.tensors.items()}

    def read_into(self, expert: int, dest: dict[str, torch.Tensor]) -> int:
        for name, t in self.tensors.items():
            src, out = t[expert], dest[name]
            if out.device.type == "cpu" and out.is_contiguous() and out.dtype == src.dtype:
                # One plain copy: torch's copy_ would start its own OpenMP team on the fetch thread, beside the
                # compute's (2 teams on the same cores ran a prefill 1.7x slower).
                ctypes.memmove(out.data_ptr(), src.data_ptr(), src.nbytes)
            else:
                out.copy_(src, non_blocking=True)
        return self.nbytes // len(next(iter(self.tensors.values())))


@dataclass(frozen=True)
class FilePart:
    """One checkpoint tensor of an expert: which tensor of the slot it fills, from which row."""
    name: str
    row: int
    location: TensorLocation


class FileBacking:
    """A layer's experts read from the checkpoint files when needed: each expert's parts, in file order, each
    checked against what load found (ladle.experts.expert_files). Reads go straight into the destination where its
    dtype is the file's and it is host memory (os.preadv: no mapping is left behind, so the file's pages count
    toward the page cache, not this process)."""

    def __init__(self, parts: list[list[FilePart]], shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 files: ExpertFiles, layer: str) -> None:
        self.parts, self.shapes, self.files, self.layer = parts, shapes, files, layer
        self.nbytes = sum(p.location.nbytes for expert in parts for p in expert)

    def expert(self, expert: int) -> dict[str, torch.Tensor]:
        """The expert read into fresh host tensors (its bytes are not kept)."""
        out = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in self.shapes.items()}
        self.read_into(expert, out)
        return out

    def read_into(self, expert: int, dest: dict[str, torch.Tensor]) -> int:
        total = 0
        for part in self.parts[expert]:
            loc = part.location
            rows = loc.shape[0] if loc.shape else 1
            target = dest[part.name][part.row: part.row + rows]
            direct = target.device.type == "cpu" and target.dtype == loc.dtype and target.is_contiguous()
            buf = target if direct else torch.empty(loc.shape, dtype=loc.dtype)
            self.files.read(loc, buf.view(torch.uint8).numpy().data.cast("B"), self.layer, expert)
            if not direct:
                copy_values(target, buf.reshape(target.shape))
            total += loc.nbytes
        return total
