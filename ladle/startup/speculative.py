"""Speculative decoding at startup: what the config allows on this model and device, and what it costs."""
from __future__ import annotations

import torch

from ladle.config.engine_args import EngineArgs
from ladle.config.provenance import Provenance
from ladle.config.speculative import SpeculativeConfig
from ladle.kv_cache.specs import KVCacheLayout


def resolve_speculative(spec: SpeculativeConfig | None, prov: Provenance, layout: KVCacheLayout,
                        device: torch.device) -> SpeculativeConfig | None:
    """The speculative config, refused where verification could not be exact yet. Rejected drafts are undone by
    leaving their KV behind to be written over; a layer that folds each token into a per-request state (Gated
    DeltaNet, DeepSeek-V4's compressors) instead keeps its state after each draft in rows of its own, which the
    CUDA Gated DeltaNet kernel does not do yet."""
    if spec is None:
        prov.put("speculative_config", "off")
        return None
    deltanet = [g.spec.kind for g in layout.state_groups if "deltanet" in g.spec.kind]
    if deltanet and device.type != "cpu":
        raise ValueError(f"speculative_config cannot be used with this model on {device.type} yet: its "
                         f"{deltanet[0]} layers keep the state after each draft in the torch path only (the CUDA "
                         "kernel returns the last state alone); drop speculative_config")
    prov.put("speculative_config", spec.describe())
    return spec


def draft_rows_per_request(layout: KVCacheLayout, spec: SpeculativeConfig | None) -> int:
    """State rows a running request holds beyond its slot: one per draft position on a model with state layers
    (a rejected draft rolls the state back to the row after the last accepted one)."""
    return spec.num_speculative_tokens if spec is not None and layout.state_groups else 0


def mtp_drafts(spec: SpeculativeConfig | None) -> int:
    """The drafts the runner's MTP layer makes per sampled row (0: the method is not mtp)."""
    return spec.num_speculative_tokens if spec is not None and spec.method == "mtp" else 0


def mtp_limits(prov: Provenance, args: EngineArgs, graph_batch: int) -> tuple[int, bool]:
    """MTP drafts are made from a step's hidden states once its tokens are known: no step launched ahead, no
    graph (they return logits alone). Explicit requests are refused."""
    why = "mtp drafts read each step's hidden states once its tokens are sampled"
    for name, value in (("async_scheduling", args.async_scheduling), ("max_cudagraph_capture_size", graph_batch)):
        if value and name in prov.explicit:
            raise ValueError(f"{name} cannot be used with speculative_config method 'mtp' yet ({why}); drop it")
    if graph_batch:
        prov.put("max_cudagraph_capture_size", 0, why)
    if args.async_scheduling:
        prov.put("async_scheduling", False, why)
    return 0, False
