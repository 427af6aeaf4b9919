"""A GGUF file's metadata and tensor table, read in one pass over its header; tensor data memory-mapped.

gguf's own GGUFReader builds a numpy view per array element: SmolLM2's 49,152 tokens and 48,900 merges take it
5-10 s on a 2-core EPYC, paid by every start and every tokenizer load. This reads the same header with struct
from one buffer (tens of milliseconds) and keeps gguf's constants (value types, block sizes), so the layout
rules are llama.cpp's own. tests/test_gguf.py holds it equal to GGUFReader on every test file.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

_SCALARS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_NUMPY: dict[GGUFValueType, str] = {t: f[1:].replace("?", "b1") for t, f in _SCALARS.items()}
_VERSIONS = (2, 3)  # version 1 used 32-bit counts and lengths; llama.cpp dropped it in 2023


class GGUFFormatError(ValueError):
    """The file is not a GGUF file ladle can read (bad magic, version, truncated header or data)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml order: dims[0] is the contiguous (input) dimension
    qtype: GGMLQuantizationType
    offset: int  # from the start of the file

    @property
    def shape(self) -> tuple[int, ...]:
        """torch/numpy order: rows first (an HF linear weight's [out, in])."""
        return tuple(reversed(self.dims))

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.dims[1:], dtype=np.int64)) * (self.dims[0] // block) * size


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]  # key -> str, int, float, bool, or a list (numeric arrays as numpy arrays)
    tensors: dict[str, TensorInfo]

    def raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes as the file holds them, memory-mapped: numpy shape [rows..., row bytes] uint8 for
        block types, the element dtype and shape otherwise (what gguf.quants.dequantize takes)."""
        block, size = GGML_QUANT_SIZES[info.qtype]
        flat = np.memmap(self.path, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.nbytes,))
        if block == 1:
            dtype = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                     GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                     GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                     GGMLQuantizationType.I64: np.int64}.get(info.qtype)
            if dtype is not None:
                return flat.view(dtype).reshape(info.shape)
        return flat.reshape(*info.shape[:-1], info.dims[0] // block * size)


class _Cursor:
    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise GGUFFormatError(f"{self.path}: the header ends early (truncated file?)") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise GGUFFormatError(f"{self.path}: the header ends early (truncated file?)")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        # llama.cpp writes UTF-8; some vocabularies hold lone bytes that are not, kept as the replacement char
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            item, count = GGUFValueType(self.take("<I")), self.take("<Q")
            if item in _NUMPY:  # numeric arrays (token types, scores) in one read
                dtype = np.dtype(_NUMPY[item])
                end = self.pos + count * dtype.itemsize
                if end > len(self.buf):
                    raise GGUFFormatError(f"{self.path}: the header ends early (truncated file?)")
                out = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
                self.pos = end
                return out
            return [self.value(item) for _ in range(count)]
        if vtype not in _SCALARS:
            raise GGUFFormatError(f"{self.path}: unknown metadata value type {int(vtype)}")
        return self.take(_SCALARS[vtype])


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse the header (metadata and tensor table); tensor data stays on disk until raw() maps it."""
    path = Path(path)
    with open(path, "rb") as f:
        mapped = np.memmap(f, dtype=np.uint8, mode="r")
    cur = _Cursor(mapped.data, path)  # the mapping's buffer, as memoryview(mapped)
    if cur.take("<I") != GGUF_MAGIC:
        raise GGUFFormatError(f"{path} is not a GGUF file (no GGUF magic at its start)")
    version = cur.take("<I")
    if version not in _VERSIONS:
        hint = " (a big-endian file?)" if struct.unpack(">I", struct.pack("<I", version))[0] in _VERSIONS else ""
        raise GGUFFormatError(f"{path}: GGUF version {version}{hint}; ladle reads versions {_VERSIONS}")
    n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        try:
            vtype = GGUFValueType(cur.take("<I"))
        except ValueError:
            raise GGUFFormatError(f"{path}: metadata key {key!r} has an unknown value type") from None
        metadata[key] = cur.value(vtype)
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.take("<Q") for _ in range(cur.take("<I")))
        raw_type = cur.take("<I")
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFFormatError(f"{path}: tensor {name!r} has ggml type {raw_type}, unknown to gguf "
                                  f"{_gguf_version()}") from None
        infos.append((name, dims, qtype, cur.take("<Q")))
    alignment = int(metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
    start = -(-cur.pos // alignment) * alignment
    tensors = {name: TensorInfo(name, dims, qtype, start + offset) for name, dims, qtype, offset in infos}
    for t in tensors.values():
        block = GGML_QUANT_SIZES[t.qtype][0]
        if t.dims[0] % block:
            raise GGUFFormatError(f"{path}: tensor {t.name!r} rows of {t.dims[0]} are not whole {t.qtype.name} "
                                  f"blocks of {block}")
        if t.offset + t.nbytes > len(mapped):
            raise GGUFFormatError(f"{path}: tensor {t.name!r} runs past the end of the file (truncated file?)")
    return GGUFFile(path, version, metadata, tensors)


def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")
