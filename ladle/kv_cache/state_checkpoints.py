"""State checkpoints: copies of a request's per-request state (Gated DeltaNet's conv and recurrent state,
DeepSeek-V4's compressor pending projections and the entries of its compressed groups' last, partly filled
block) at a token position, so a prefix hit can resume there exactly.

A checkpoint is a slot of its own in the state tensors (past the running requests' slots), decoupled from the
KV block size. A request that will end a chunk at a checkpoint position takes a slot (pending), the runner
copies the request's state into it right after the forward that reached the position, and only then, as the
step's output is read, is it registered under the prefix node of that position; a step that failed or fell
short leaves it unregistered and the slot goes back. Registered checkpoints are evicted least recently used
first when a pending one needs a slot (a live session's kept checkpoint only when no other is left:
ladle.kv_cache.session_retention; into the host tier's checkpoints, where there is one: ladle.kv_cache.host_tier),
and with a window block their hit reads when the pool drops it (ladle.kv_cache.checkpoint_windows); a checkpoint
may go while its KV blocks stay.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointCopy:
    """One copy between a request's state slot and a checkpoint slot, for the runner: before a step (restore,
    checkpoint -> request) or after it (save, request -> checkpoint). tail_blocks: per paged group, the block
    whose page the checkpoint's tail holds (-1 for a group without a tail: uncompressed, or nothing partial)."""

    checkpoint: int  # its row in the state tensors (and index + first_slot in the tail tensors)
    state_slot: int
    position: int  # the token position the state is at
    tail_blocks: tuple[int, ...] = ()


class StateCheckpoints:
    def __init__(self, num_checkpoints: int, first_slot: int, bytes_each: int,
                 on_evict: Callable[[int, int, bool], None], kept: Callable[[int], bool] | None = None) -> None:
        """first_slot: the state tensors' row of checkpoint 0 (after the running requests' slots);
        on_evict(node, row, still_valid): a registered checkpoint left its row (the node loses the reference,
        unless a host tier keeps a still valid one: one evicted for room, not for a lost window); kept(node): a
        session keeps the node's checkpoint, so it is evicted for room after every other."""
        self.num_checkpoints = num_checkpoints
        self.first_slot = first_slot
        self.bytes_each = bytes_each
        self._free = [first_slot + i for i in range(num_checkpoints - 1, -1, -1)]
        self._by_node: OrderedDict[int, int] = OrderedDict()  # registered, least recently used first
        self._on_evict = on_evict
        self._kept = kept
        self.num_stored = 0
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._by_node)

    @property
    def bytes_held(self) -> int:
        return len(self._by_node) * self.bytes_each

    def get(self, node: int) -> int | None:
        slot = self._by_node.get(node)
        if slot is not None:
            self._by_node.move_to_end(node)
        return slot

    def has(self, node: int) -> bool:
        return node in self._by_node

    def take(self) -> int | None:
        """A slot for a pending (or promoted) checkpoint, evicting the least recently used registered one if
        none is free; None when every slot is pending."""
        if not self._free and self._by_node:
            kept = self._kept
            node = next((n for n in self._by_node if kept is None or not kept(n)), next(iter(self._by_node)))
            slot = self._by_node.pop(node)
            self.num_evicted += 1
            self._on_evict(node, slot, True)
            self._free.append(slot)
        return self._free.pop() if self._free else None

    def evict(self, node: int) -> None:
        """Evict the checkpoint of node now (a block its hit reads went)."""
        slot = self._by_node.pop(node)
        self._free.append(slot)
        self.num_evicted += 1
        self._on_evict(node, slot, False)

    def register(self, node: int, slot: int) -> bool:
        """Make a written pending slot the checkpoint of node; False (and the slot is freed) if node has one."""
        if node in self._by_node:
            self._free.append(slot)
            return False
        self._by_node[node] = slot
        self.num_stored += 1
        return True

    def release(self, slot: int) -> None:
        """A pending slot that was never registered."""
        self._free.append(slot)

    def clear(self) -> None:
        while self._by_node:
            node, slot = self._by_node.popitem(last=False)
            self._on_evict(node, slot, False)
            self._free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self._free)
