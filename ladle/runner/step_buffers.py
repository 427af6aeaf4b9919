"""Where a step's input arrays go on their way to the device.

On CUDA each named input has a persistent device buffer and two sets of pinned host staging buffers used in
turn: a step writes its arrays into one set and queues one non-blocking copy per input, so the host never
waits for a transfer, and the set is reused only two steps later, after an event says its copies ran (with
async scheduling the copies of the step launched last may still be queued behind the step before it). The
buffers grow to the largest step seen, except the static ones a CUDA graph reads (reserve): those are made
once at their largest and written in place, their leading rows (and columns) only. On CPU there is nothing to
copy: the arrays themselves are the inputs.
"""
from __future__ import annotations

import numpy as np
import torch


class StepBuffers:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._device: dict[str, torch.Tensor] = {}
        self._static: set[str] = set()
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

    def reserve(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Make `name` a static buffer of this shape (zeros): put() writes into it and never moves it."""
        if self.cuda:
            self._device[name] = torch.zeros(shape, dtype=dtype, device=self.device)
            self._static.add(name)

    def put(self, name: str, values: np.ndarray | list[int], dtype: torch.dtype) -> torch.Tensor:
        """values as `dtype` on the device, in a view of the persistent buffer `name` (on CPU: the array itself
        where it has that dtype). A static buffer's view is its leading rows at their full width."""
        host = (torch.tensor(values, dtype=dtype) if isinstance(values, list)
                else torch.from_numpy(values).to(dtype))
        if not self.cuda:
            return host
        n = host.numel()
        staging = self._staging[self._set]
        if name not in staging or staging[name].numel() < n or staging[name].dtype != host.dtype:
            size = max(n, 2 * staging[name].numel() if name in staging else 64)
            staging[name] = torch.empty(size, dtype=host.dtype, pin_memory=True)
        if name in self._static:
            return self._put_static(name, staging[name][:n], host)
        dev = self._device.get(name)
        if dev is None or dev.numel() < n or dev.dtype != host.dtype:
            dev = self._device[name] = torch.empty(staging[name].numel(), dtype=host.dtype, device=self.device)
        stage = staging[name][:n]
        stage.copy_(host.reshape(-1))  # reshape copies a strided array, so the staging buffer is dense
        out = dev[:n]
        out.copy_(stage, non_blocking=True)
        return out.view(host.shape)

    def _put_static(self, name: str, stage: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
        dev = self._device[name]
        if host.dim() != dev.dim() or any(h > d for h, d in zip(host.shape, dev.shape)):
            raise ValueError(f"{name}: {tuple(host.shape)} does not fit its static buffer {tuple(dev.shape)}")
        stage.copy_(host.reshape(-1))
        rows = host.shape[0]
        view = dev[:rows] if host.dim() == 1 else dev[:rows, : host.shape[1]]
        view.copy_(stage.view(host.shape), non_blocking=True)
        return dev[:rows]
