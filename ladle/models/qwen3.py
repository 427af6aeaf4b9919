"""Qwen3 dense models: the shared decoder with per-head RMSNorm on q and k before rope."""
from __future__ import annotations

from ladle.models.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    qk_norm = True
