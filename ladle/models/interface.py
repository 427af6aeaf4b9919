"""What the loader, the planner and the runner call on a model: the CausalLM protocol every registered class
meets (tests/test_model_interface.py checks each one), and the base class of the layers that route tokens to
experts. Optional behaviour is a member with a no-op default, or a declared flag (supports_mtp) naming the
protocol (SupportsMtp) the class also meets; never an attribute probed with hasattr or getattr."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from torch import nn

from ladle.experts.cache import ExpertCache

if TYPE_CHECKING:
    import torch

    from ladle.attention.backend import BackendMetadata
    from ladle.distributed.parallel_state import TensorParallel
    from ladle.kv_cache.specs import CacheSpec


class CausalLM(Protocol):
    # Whether shard() covers every layer the model has; False: it runs with tensor_parallel_size 1 only.
    tensor_parallel: ClassVar[bool]
    # (value, reason) for the settings table: which kernels lay_out_for_cpu gave it; None: no row.
    cpu_kernels: tuple[str, str] | None
    # Whether the class meets SupportsMtp (its checkpoints' multi-token-prediction layer can draft for
    # speculative decoding's `mtp` method); False: the loader refuses that method.
    supports_mtp: ClassVar[bool]

    @property
    def expert_cache(self) -> ExpertCache | None:
        """The device slots the tiered routed experts share (ladle.models.loading.expert_tiering registers it
        as the submodule `expert_cache` at load, so its buffers count as weights); None: nothing is tiered."""

    @property
    def vocab_size(self) -> int:
        """The rows of the logits compute_logits gives (the config's vocab_size, whole on every rank)."""

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """A checkpoint tensor's name as this model's parameters have it (the model's own renames on load)."""

    def __init__(self, config: Any) -> None:
        """Built from the HF config (on the meta device, by the loader)."""

    def cache_specs(self, dtype: torch.dtype, max_model_len: int | None = None) -> list[CacheSpec]:
        """What each cache layer keeps per request (ladle.kv_cache.specs)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[tuple[torch.Tensor, ...]],
                meta: Any) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden]; meta: one entry per KV group."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, hidden] -> fp32 logits [N, vocab] (None on a tensor-parallel rank other than the driver)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors in; returns the parameter names loaded."""

    def shard(self, tp: TensorParallel) -> dict:
        """Shard the model (still on meta) for rank tp.rank; returns the checkpoint slices it loads."""

    def init_dummy_buffers(self, generator: torch.Generator) -> None:
        """With dummy weights: fill the buffers that must hold valid values (a hash-routing table)."""

    def lay_out_for_cpu(self) -> None:
        """After loading, on CPU: put the weights in the layouts the CPU kernels read."""

    # The nn.Module surface the engine uses.
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[tuple[torch.Tensor, ...]],
                 meta: Any) -> torch.Tensor: ...
    def parameters(self) -> Iterator[nn.Parameter]: ...
    def buffers(self) -> Iterator[torch.Tensor]: ...
    def modules(self) -> Iterator[nn.Module]: ...


class SupportsMtp(CausalLM, Protocol):
    """A model whose class says supports_mtp: its multi-token-prediction layer drafts for speculative decoding's
    `mtp` method (ladle.runner.mtp_drafter)."""

    def enable_mtp(self) -> None:
        """Build the MTP layer (on meta, before loading): its weights then load with the model's."""

    def mtp_forward(self, next_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                    kv_cache: tuple[torch.Tensor, ...], attn: BackendMetadata,
                    write_only: bool = False) -> torch.Tensor | None:
        """The MTP layer at these positions (next_ids: the token after each; hidden: the state there) -> its
        output; write_only: only its cache written, for later positions to read (None)."""

    def mtp_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The MTP layer's output -> logits, through the model's head."""


_EXPERT_SLOTS = "tiered_expert_slots"  # the submodule attach_expert_cache registers


class ConfiguredModel(nn.Module, CausalLM):
    """The base of every model class: an nn.Module that says it is a CausalLM, so the type checker holds each
    class to the protocol, and what the loader builds and hands on. It computes the members every class computes
    alike from its HF config and its registered modules."""

    config: Any  # the HF config the class was built from

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def expert_cache(self) -> ExpertCache | None:
        cache = self._modules.get(_EXPERT_SLOTS)
        return cache if isinstance(cache, ExpertCache) else None

    def attach_expert_cache(self, cache: ExpertCache) -> None:
        """Tiered experts (ladle.models.loading.expert_tiering): the device slots they share join the model as a
        submodule, so their buffers count as its weights and are allocated with them."""
        self.add_module(_EXPERT_SLOTS, cache)


class RoutedExperts(nn.Module):
    """A layer that routes each token to experts. Profiling sets force_worst_routing: every token of the step
    to experts 0..k-1, the routing that puts the most tokens through one expert, so the memory plan holds
    whatever the dummy tokens' own routing would be."""

    def __init__(self) -> None:
        super().__init__()
        self.force_worst_routing = False


def causal_lm_members() -> list[str]:
    """The protocol's own members, for the test that every registered model class has each one."""
    return sorted({*CausalLM.__annotations__, *(n for n in vars(CausalLM) if not n.startswith("_"))})
