"""The prefix cache's disk tier, below the host tier (ladle.kv_cache.host_tier): every block and every state
checkpoint the prefix cache registers is also written to a local directory (write-through, by the runner's writer
thread: the engine loop never waits on a disk write), so a session's prefix outlives the device pool, the host
tier, kill -9 and a restart. A request whose prefix continues on disk past what the device and host hold is passed
over, keeping its place, while what its deepest hit needs is read (ladle.kv_cache.disk_hits; on a reader thread:
the engine loop never waits on a disk read while it has other work) and checked (ladle.kv_cache.disk_format);
each verified block then fills a host slot, and a checkpoint a slot of the host tier's checkpoints, from which
admission promotes them like any host hit. A file that fails a check is a counted miss, and what it held is
computed.

A model with per-request state (Gated DeltaNet, DeepSeek-V4's compressors and compressed groups) can resume only
where a state checkpoint is, so its checkpoints go to disk too: without them its blocks on disk could serve no hit.

Only ids and bookkeeping live here; the pages a read returns travel to the runner with the step's StateUpdate
(fills: host slot <- pages, for blocks and for checkpoints), and the writes and deletions travel there too
(stores: device block or checkpoint row -> file; unlinks), applied in order on the runner's writer thread. The
index (which entries exist, of either kind, least recently used first) is built at startup from the directory, so a
restarted engine hits on what the last one wrote; it counts bytes against kv_disk_cache_size and deletes the least
recently used entries past it.
"""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ladle.kv_cache.disk_format import (
    TMP_SUFFIX,
    EntryMeta,
    EntryMismatch,
    TensorSpec,
    chain_digest,
    entry_name,
    parse_name,
    read_entry,
    root_digest,
)
from ladle.kv_cache.host_tier import CHECKPOINT

if TYPE_CHECKING:
    from ladle.request import Request

logger = logging.getLogger("ladle.kv_cache")
EntryKey = tuple[bytes, int]  # (chain digest, KV cache group or CHECKPOINT)
Fill = tuple[int, list[torch.Tensor]]  # (host slot, pages read)


@dataclass(frozen=True)
class DiskStore:
    """A registered device block or state checkpoint to write to disk (the runner copies it before the step's
    forward, before anything may overwrite it)."""

    block: int  # a device block, or a checkpoint's row in the state tensors (meta.group CHECKPOINT)
    name: str
    meta: EntryMeta


@dataclass(frozen=True)
class DiskRead:
    """A finished read of one entry for a request: its pages, or None with the reason it cannot serve."""

    request: Request
    index: int  # the index of the token block whose prefix node the entry is registered under
    group: int  # a KV cache group, or CHECKPOINT
    pages: list[torch.Tensor] | None
    reason: str = ""


class DiskTier:
    def __init__(self, directory: str, identity: str, capacity_bytes: int, specs: Sequence[TensorSpec],
                 entry_bytes: int, block_size: int, checkpoint_specs: Sequence[TensorSpec] = (),
                 checkpoint_bytes: int = 0) -> None:
        """directory: this model's entries (one directory per model identity). specs: one block's page of each
        pool tensor, which every block entry must hold; checkpoint_specs: a checkpoint's row of each state and tail
        tensor, which every checkpoint entry must hold. entry_bytes, checkpoint_bytes: a file's size before its
        header."""
        self.directory = directory
        self.identity = identity
        self.capacity_bytes = capacity_bytes
        self.specs = tuple(specs)
        self.checkpoint_specs = tuple(checkpoint_specs)
        self.entry_bytes = entry_bytes
        self.checkpoint_bytes = checkpoint_bytes
        self.block_size = block_size
        self.root = root_digest(identity)
        self.index: OrderedDict[EntryKey, int] = OrderedDict()  # entry -> file bytes, least recently used first
        self.num_bytes = 0
        self.stores: list[DiskStore] = []
        self.unlinks: list[str] = []
        self.fills: list[Fill] = []  # blocks, for the runner
        self.checkpoint_fills: list[Fill] = []  # state checkpoints (slots of the host tier's checkpoints)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="ladle-kv-disk-read")
        self._reads: dict[str, list[Future[DiskRead]]] = {}  # per request: its reads in flight
        self._done = threading.Event()  # set by a finished read, so an idle engine wakes for it
        self.fetched: set[str] = set()  # requests that read from disk once (never twice in a life)
        # entries of either kind; num_loaded_checkpoints: of num_loaded, the state checkpoints
        self.num_stored = self.num_loaded = self.num_misses = self.num_evicted = self.num_loaded_checkpoints = 0
        os.makedirs(directory, exist_ok=True)
        self._scan()

    def _scan(self) -> None:
        """Index what an earlier engine left, oldest first; leftovers of a write that was killed go."""
        found = []
        with os.scandir(self.directory) as it:
            for e in it:
                if e.name.endswith(TMP_SUFFIX) and not _writer_alive(e.name):
                    os.unlink(e.path)
                    continue
                key = parse_name(e.name)
                if key is not None and e.is_file():
                    st = e.stat()
                    found.append((st.st_mtime_ns, key, st.st_size))
        for _, key, size in sorted(found):
            self.index[key] = size
            self.num_bytes += size
        self._evict_over_capacity()
        if found:
            logger.info("KV disk tier %s: %d entries (%.1f MiB) from earlier runs", self.directory, len(self.index),
                        self.num_bytes / 2**20)

    def digests(self, request: Request, num_blocks: int) -> list[bytes]:
        """The chain digests of the request's first num_blocks full blocks (made once per block)."""
        made, size, ids = request.block_digests, self.block_size, request.all_token_ids
        parent = made[-1] if made else self.root
        for i in range(len(made), num_blocks):
            parent = chain_digest(parent, ids[i * size : (i + 1) * size])
            made.append(parent)
        return made

    def _meta(self, request: Request, index: int, group: int) -> EntryMeta:
        digests = request.block_digests
        return EntryMeta(self.identity, group, digests[index], digests[index - 1] if index else self.root,
                         request.block_tokens[index].token_ids)

    def store(self, request: Request, index: int, group: int, block: int) -> None:
        """The prefix cache registered, under the node of the request's index-th token block, a block of `group`
        in device block `block` (or, group CHECKPOINT, a state checkpoint in row `block`): write it unless an
        entry has it already (then it is just the most recently used)."""
        key = (request.block_digests[index], group)
        if key in self.index:
            self.index.move_to_end(key)
            return
        meta = self._meta(request, index, group)
        payload = self.checkpoint_bytes if group == CHECKPOINT else self.entry_bytes
        size = payload + len(meta.tokens) * 8  # about what its header adds
        self.index[key] = size
        self.num_bytes += size
        self.stores.append(DiskStore(block, entry_name(*key), meta))
        self.num_stored += 1
        self._evict_over_capacity()

    def _evict_over_capacity(self) -> None:
        while self.num_bytes > self.capacity_bytes and self.index:
            key, size = self.index.popitem(last=False)
            self.num_bytes -= size
            self.unlinks.append(entry_name(*key))
            self.num_evicted += 1

    def has(self, request: Request, index: int, group: int) -> bool:
        """An entry of `group` (or CHECKPOINT) under the node of the request's index-th token block is on disk
        (digests() made its digest)."""
        return (request.block_digests[index], group) in self.index

    def read(self, request: Request, entries: Sequence[tuple[int, int]]) -> None:
        """Start reading these entries of the request: (token block index, group or CHECKPOINT) each."""
        self.fetched.add(request.request_id)
        futures = []
        for index, group in entries:
            self.index.move_to_end((request.block_digests[index], group))
            futures.append(self._reader.submit(self._read_one, request, index, group))
        self._reads[request.request_id] = futures

    def _read_one(self, request: Request, index: int, group: int) -> DiskRead:
        meta = self._meta(request, index, group)
        path = os.path.join(self.directory, entry_name(meta.digest, group))
        specs = self.checkpoint_specs if group == CHECKPOINT else self.specs
        try:
            return DiskRead(request, index, group, read_entry(path, meta, specs))
        except (OSError, EntryMismatch) as e:
            return DiskRead(request, index, group, None, str(e) or type(e).__name__)
        finally:
            self._done.set()

    def reading(self, request_id: str) -> bool:
        return request_id in self._reads

    @property
    def num_reading(self) -> int:
        return len(self._reads)

    def finished(self) -> list[DiskRead]:
        """The reads of every request whose reads have all finished (their requests stop waiting)."""
        self._done.clear()
        out = []
        for rid in [r for r, fs in self._reads.items() if all(f.done() for f in fs)]:
            for f in self._reads.pop(rid):
                read = f.result()
                if read.pages is None:
                    self.num_misses += 1
                    key = (read.request.block_digests[read.index], read.group)
                    logger.warning("KV disk tier: %s is a miss: %s", entry_name(*key), read.reason)
                    size = self.index.pop(key, None)
                    if size is not None:
                        self.num_bytes -= size
                out.append(read)
        return out

    def wait(self, timeout: float) -> None:
        """Wait (at most timeout seconds) for a read to finish: the engine has nothing else to do."""
        self._done.wait(timeout)

    def clear(self) -> None:
        """Delete every entry (reset_prefix_cache): the next prompts compute everything."""
        self.unlinks += [entry_name(*key) for key in self.index]
        self.num_evicted += len(self.index)
        self.index.clear()
        self.num_bytes = 0

    def forget(self, request_id: str) -> None:
        self.fetched.discard(request_id)

    def take(self) -> tuple[list[Fill], list[Fill], list[DiskStore], list[str]]:
        """What the runner owes the tier since the last call: (fills, checkpoint fills, stores, unlinks)."""
        out = (self.fills, self.checkpoint_fills, self.stores, self.unlinks)
        self.fills, self.checkpoint_fills, self.stores, self.unlinks = [], [], [], []
        return out

    def shutdown(self) -> None:
        self._reader.shutdown(wait=True, cancel_futures=True)


def _writer_alive(name: str) -> bool:
    """A temporary file's writer (its pid is in the name) is still running: its file may yet be renamed."""
    pid = name[: -len(TMP_SUFFIX)].rpartition(".")[2]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
