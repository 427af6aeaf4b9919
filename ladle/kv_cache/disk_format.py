"""The prefix cache's disk tier, one file per cached block or state checkpoint: what a file holds, how it is named,
and the checks a read makes before its bytes may serve a hit.

Names. A block's file is named by a SHA-256 chain over token ids: digest(k) = SHA-256(digest(k - 1) || the k-th
block's token ids as little-endian int32), from a root bound to the model's identity, then the KV cache group
(`<digest>.<group>.kv`). A group whose block spans several token blocks (a compressed group) names it by the digest
of its last token block, as the prefix tree registers it under that block's node. A state checkpoint at a block
boundary is named by the digest of the prefix it ends (`<digest>.state.kv`): it is exact for that prefix whichever
request wrote it, as in the host tier. The in-memory prefix tree compares token ids on every hit because Python's
hash collides; on disk, where keys must outlive the process, the key is this chain (as vLLM's
prefix_caching_hash_algo=sha256 and LMCache's keys), and the file still carries its block's own token ids and its
parent's digest, compared on every read.

Contents. Magic, a JSON header (the model identity, kind, group, digest, parent digest, the block's token ids,
each tensor's dtype and shape, the payload's SHA-256) and the payload, raw bytes: for a block, its page of every
tensor of the paged pool (ladle.runner.host_kv_cache), in pool order; for a checkpoint, its row of every state
tensor and its tail page of every compressed layer, in the host checkpoint tier's order. A file is written whole
under a temporary name and renamed into place (atomic on POSIX), so a process killed mid-write leaves a temporary
file, never a torn entry; a file torn anyway (a power cut, a full disk, a stray write) fails its checksum and is a
miss.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch

from ladle.kv_cache.host_tier import CHECKPOINT

MAGIC = b"LADLEKV1"
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
STATE = "state"  # a checkpoint's file name in place of a group
_LEN = struct.Struct("<I")
# KV pages' dtypes, and state tensors' (Qwen4-Exp keeps its n-gram token ids, int64, in its state)
_DTYPES = MappingProxyType({str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                                                 torch.float8_e5m2, torch.uint8, torch.int8, torch.int32,
                                                 torch.int64, torch.float64, torch.bool)})

TensorSpec = tuple[str, tuple[int, ...]]  # (dtype name, shape of one block's page)


def storable(dtype_name: str) -> bool:
    """An entry may hold tensors of this dtype (a reader could not type any other)."""
    return dtype_name in _DTYPES


def root_digest(identity: str) -> bytes:
    return hashlib.sha256(b"ladle-kv-root\0" + identity.encode()).digest()


def chain_digest(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.sha256(parent + array("i", tokens).tobytes()).digest()


def entry_name(digest: bytes, group: int) -> str:
    """group: a KV cache group, or CHECKPOINT for the state checkpoint at the digest's prefix."""
    return f"{digest.hex()}.{STATE if group == CHECKPOINT else group}{SUFFIX}"


def parse_name(name: str) -> tuple[bytes, int] | None:
    """(digest, group or CHECKPOINT) of an entry's file name; None for anything else in the directory."""
    if not name.endswith(SUFFIX):
        return None
    stem, _, group = name[: -len(SUFFIX)].partition(".")
    try:
        digest = bytes.fromhex(stem)
    except ValueError:
        return None
    if len(digest) != 32 or not (group.isdigit() or group == STATE):
        return None
    return digest, CHECKPOINT if group == STATE else int(group)


def entry_kind(group: int) -> str:
    return "checkpoint" if group == CHECKPOINT else "block"


@dataclass(frozen=True)
class EntryMeta:
    """What names an entry and what its reader compares."""

    identity: str
    group: int  # a KV cache group, or CHECKPOINT
    digest: bytes
    parent: bytes
    tokens: tuple[int, ...]


class EntryMismatch(Exception):
    """A file that must not serve the hit it was read for: the reason, for the miss counters and the log."""


def tensor_spec(t: torch.Tensor) -> TensorSpec:
    return str(t.dtype), tuple(t.shape)


def write_entry(path: str, meta: EntryMeta, pages: Sequence[torch.Tensor]) -> int:
    """Write the entry atomically; returns the file's bytes. pages: CPU tensors, one block of each pool tensor (or
    a checkpoint's row of each state and tail tensor)."""
    payload = b"".join(p.contiguous().view(torch.uint8).numpy().tobytes() for p in pages)
    header = json.dumps({
        "identity": meta.identity, "kind": entry_kind(meta.group), "group": meta.group, "digest": meta.digest.hex(),
        "parent": meta.parent.hex(),
        "tokens": list(meta.tokens), "tensors": [[d, list(s)] for d, s in map(tensor_spec, pages)],
        "payload_sha256": hashlib.sha256(payload).hexdigest(),
    }).encode()
    tmp = f"{path}.{os.getpid()}{TMP_SUFFIX}"
    with open(tmp, "wb") as f:
        f.write(MAGIC + _LEN.pack(len(header)) + header + payload)
    os.replace(tmp, path)
    return len(MAGIC) + _LEN.size + len(header) + len(payload)


def read_entry(path: str, expect: EntryMeta, specs: Sequence[TensorSpec]) -> list[torch.Tensor]:
    """The entry's pages, after every check: magic, header, identity, kind, group, digest, parent digest, the
    block's token ids, the tensors' dtypes and shapes (the pool's or the checkpoint's, `specs`), and the payload's
    checksum. Raises EntryMismatch (or OSError for a file that is gone) otherwise."""
    with open(path, "rb") as f:
        data = f.read()
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _LEN.size:
        raise EntryMismatch("not a ladle KV entry (bad magic)")
    (n,) = _LEN.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    try:
        header = json.loads(data[start : start + n])
        # (entries written before checkpoints had a kind were all blocks)
        got = (header["identity"], header.get("kind", "block"), header["group"], header["digest"],
               header["parent"], tuple(header["tokens"]))
        tensors = [(str(d), tuple(s)) for d, s in header["tensors"]]
        checksum = header["payload_sha256"]
    except (ValueError, KeyError, TypeError) as e:
        raise EntryMismatch(f"unreadable header ({type(e).__name__})") from None
    want = (expect.identity, entry_kind(expect.group), expect.group, expect.digest.hex(), expect.parent.hex(),
            tuple(expect.tokens))
    for what, a, b in zip(("model identity", "kind", "group", "digest", "parent digest", "token ids"), got, want):
        if a != b:
            raise EntryMismatch(f"{what} differs (stale or foreign entry)")
    if tensors != [(d, tuple(s)) for d, s in specs]:
        raise EntryMismatch("tensor dtypes or shapes differ from the pool's (or the checkpoints')")
    payload = data[start + n :]
    if hashlib.sha256(payload).hexdigest() != checksum:
        raise EntryMismatch("payload checksum differs (torn or truncated entry)")
    pages, offset = [], 0
    buffer = bytearray(payload)
    for dtype_name, shape in tensors:
        dtype = _DTYPES.get(dtype_name)
        if dtype is None:
            raise EntryMismatch(f"unknown dtype {dtype_name}")
        size = dtype.itemsize * int(torch.Size(shape).numel())
        pages.append(torch.frombuffer(buffer, dtype=torch.uint8, count=size, offset=offset)
                     .view(dtype).reshape(shape))
        offset += size
    if offset != len(payload):
        raise EntryMismatch("payload length differs from its tensors'")
    return pages
