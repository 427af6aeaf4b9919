"""Mistral: the Llama-shaped decoder, every layer attending over a sliding window (config.json's
`sliding_window`; none means full attention, as in Mistral v0.2 and later)."""
from __future__ import annotations

from ladle.models.decoder import DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    qk_norm = False
