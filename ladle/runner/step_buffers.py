"""Where a step's input arrays go on their way to the device.

On CUDA each named input has a persistent device buffer and two sets of pinned host staging buffers used in
turn: a step writes its arrays into one set and queues one non-blocking copy per input, so the host never
waits for a transfer, and the set is reused only two steps later, after an event says its copies ran (with
async scheduling the copies of the step launched last may still be queued behind the step before it). The
buffers grow to the largest step seen. On CPU there is nothing to copy: the arrays themselves are the inputs.
"""
from __future__ import annotations

import numpy as np
import torch


class StepBuffers:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._device: dict[str, torch.Tensor] = {}
        self._staging: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] = ({}, {})
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._set = 0

    def begin(self) -> None:
        """Start a step: take the staging set whose last copies are done."""
        if not self.cuda:
            return
        self._set ^= 1
        event = self._events[self._set]
        if event is not None:
            event.synchronize()

    def end(self) -> None:
        """All of this step's inputs are queued: mark when their copies will have run."""
        if self.cuda:
            event = self._events[self._set] = torch.cuda.Event()
            event.record()

    def put(self, name: str, values: np.ndarray | list[int], dtype: torch.dtype) -> torch.Tensor:
        """values as `dtype` on the device, in a view of the persistent buffer `name` (on CPU: the array itself
        where it has that dtype)."""
        host = (torch.tensor(values, dtype=dtype) if isinstance(values, list)
                else torch.from_numpy(values).to(dtype))
        if not self.cuda:
            return host
        n = host.numel()
        staging = self._staging[self._set]
        if name not in staging or staging[name].numel() < n or staging[name].dtype != host.dtype:
            size = max(n, 2 * staging[name].numel() if name in staging else 64)
            staging[name] = torch.empty(size, dtype=host.dtype, pin_memory=True)
        dev = self._device.get(name)
        if dev is None or dev.numel() < n or dev.dtype != host.dtype:
            dev = self._device[name] = torch.empty(staging[name].numel(), dtype=host.dtype, device=self.device)
        stage = staging[name][:n]
        stage.copy_(host.reshape(-1))  # reshape copies a strided array, so the staging buffer is dense
        out = dev[:n]
        out.copy_(stage, non_blocking=True)
        return out.view(host.shape)
