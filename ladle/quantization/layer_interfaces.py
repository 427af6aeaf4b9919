"""What a layer declares to the loader and the quantizer, so that neither probes it for attributes.

A layer's class says, by the bases it takes from here, which tensors the loader's cast to the model dtype leaves
alone, how several checkpoint tensors fill one of its parameters, that it stacks checkpoint projections, or that
it holds experts which can take the checkpoint's quantized values in place. They live on this floor because the
quantized layers here are among those that declare them; the stacked linears and experts above build on them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

# A checkpoint tensor's place in a parameter: the view of the parameter that tensor fills.
View = Callable[[torch.Tensor], torch.Tensor]


def narrow_rows(start: int, size: int) -> View:
    """The view of rows start:start+size of a tensor (a shard's rows of a stacked parameter)."""
    return lambda p: p.narrow(0, start, size)


class KeepsDtypes:
    """A layer whose tensors named in keep_dtypes are allocated in their own dtype, never cast to the model's:
    quantized values and their scales, a cache's slots."""

    keep_dtypes: tuple[str, ...] = ()


class StacksCheckpointTensors(ABC):
    """A layer that fills some parameter from several checkpoint tensors."""

    @abstractmethod
    def checkpoint_views(self, prefix: str) -> dict[str, tuple[str, View]]:
        """Checkpoint name -> (the parameter's name, the view of it that tensor fills), for the layer at prefix."""


class StackedProjections(StacksCheckpointTensors):
    """A linear computing several checkpoint projections of one input in one matmul (vLLM's
    QKVParallelLinear): shards maps each checkpoint module name to its (first row, rows), in output order. A
    quantized replacement keeps the stack."""

    shards: dict[str, tuple[int, int]]


class QuantizableExperts(StacksCheckpointTensors, KeepsDtypes):
    """A layer's experts, stacked, which can hold the checkpoint's quantized values in place of dense weights."""

    weight_format: str | None  # None: dense in the model dtype; "fp8" (block-scaled e4m3) or "mxfp4"

    @abstractmethod
    def fp8_checkpoint_parts(self, prefix: str) -> list[str]:
        """The checkpoint modules whose weights, quantized or not, decide this layer's format."""

    @abstractmethod
    def use_fp8(self, block: tuple[int, int], scale_dtype: torch.dtype = torch.float32) -> None:
        """Hold the experts as the checkpoint's e4m3 values with block scales (still on meta)."""

    @abstractmethod
    def use_mxfp4(self) -> None:
        """Hold the experts as packed MXFP4 values with E8M0 scales (still on meta)."""

    @abstractmethod
    def dequantize(self, dtype: torch.dtype) -> None:
        """Replace the quantized stacks by dense ones in dtype (--dequantize-weights)."""

    @property
    @abstractmethod
    def is_tiered(self) -> bool:
        """Whether the experts live off the device (their bytes are the expert plan's, not the weights')."""


class ExpertStack(ABC):
    """Stacked experts' quantized weights indexed like the dense stack [E, R, C]: stack[e] is expert e's weight
    widened when asked, and linear() multiplies by it, by the quantized bytes directly where it can."""

    @abstractmethod
    def __getitem__(self, expert: int) -> torch.Tensor:
        """Expert's weight [R, C], widened."""

    @abstractmethod
    def linear(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """x [T, C] @ expert's weight^T -> [T, R]."""
