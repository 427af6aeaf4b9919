"""The disk tier's writes (ladle.kv_cache.disk_tier), done off the step loop: each step's StateUpdate names the
registered device blocks and state checkpoint rows to store and the files to delete; the runner copies their
pages out before the forward (after which a block may belong to another request, and a checkpoint's row to
another checkpoint) and a writer thread writes and deletes, in the order asked, so a deletion never races the
write it follows.

A disk slower than the engine must not grow host memory without bound: past max_backlog_bytes of copied pages,
a store is skipped (its index entry then fails its read: a counted miss, never a wrong token)."""
from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable

import torch

from ladle.kv_cache.disk_format import write_entry
from ladle.kv_cache.disk_tier import DiskStore
from ladle.kv_cache.host_tier import CHECKPOINT

logger = logging.getLogger("ladle.kv_cache")


class DiskKVWriter:
    def __init__(self, pool_tensors: list[torch.Tensor], directory: str, max_backlog_bytes: int,
                 checkpoint_rows: Callable[[int], list[torch.Tensor]] | None = None) -> None:
        """pool_tensors: the paged pool's distinct tensors, [num_blocks, ...] each (ladle.runner.host_kv_cache).
        checkpoint_rows: a state checkpoint's row of every state and tail tensor (HostCheckpointCache.rows; None:
        the model has no checkpoints)."""
        self.pool = pool_tensors
        self.checkpoint_rows = checkpoint_rows
        self.directory = directory
        self.max_backlog_bytes = max_backlog_bytes
        self._queue: queue.Queue[tuple[str, DiskStore | None, list[torch.Tensor]] | None] = queue.Queue()
        self._backlog = 0
        self._lock = threading.Lock()
        self.num_skipped = 0
        self._thread = threading.Thread(target=self._run, name="ladle-kv-disk-write", daemon=True)
        self._thread.start()

    def _views(self, store: DiskStore) -> list[torch.Tensor]:
        if store.meta.group == CHECKPOINT:
            assert self.checkpoint_rows is not None  # checkpoints are stored only where the runner keeps them
            return self.checkpoint_rows(store.block)
        return [t[store.block] for t in self.pool]

    @torch.no_grad()
    def store(self, stores: list[DiskStore]) -> None:
        for s in stores:
            views = self._views(s)
            size = sum(v.numel() * v.element_size() for v in views)
            with self._lock:
                if self._backlog + size > self.max_backlog_bytes:
                    self.num_skipped += 1
                    if self.num_skipped == 1:  # said once; each skipped entry is a counted miss if ever read
                        logger.warning("KV disk tier: the disk is slower than the engine; entries past a backlog "
                                       "of %d MiB are not written", self.max_backlog_bytes // 2**20)
                    continue
                self._backlog += size
            pages = [v.to("cpu", copy=True) for v in views]
            self._queue.put((os.path.join(self.directory, s.name), s, pages))

    def unlink(self, names: list[str]) -> None:
        for name in names:
            self._queue.put((os.path.join(self.directory, name), None, []))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            path, store, pages = item
            try:
                if store is None:
                    os.unlink(path)
                else:
                    write_entry(path, store.meta, pages)
            except FileNotFoundError:
                pass  # deleted already (by reset, or an entry never written)
            except OSError as e:  # a full or read-only disk: the entry is a miss later, never a crash now
                logger.warning("KV disk tier: could not write %s: %s", path, e)
            finally:
                if store is not None:
                    with self._lock:
                        self._backlog -= sum(p.numel() * p.element_size() for p in pages)
                self._queue.task_done()
        self._queue.task_done()

    def flush(self) -> None:
        """Wait until every write and deletion asked for so far is done (the thread keeps running)."""
        self._queue.join()

    def close(self) -> None:
        """Finish the writes asked for, then stop the thread."""
        self._queue.put(None)
        self._thread.join()
