"""Llama 2/3 (and Llama-shaped checkpoints): the shared decoder without q/k norm.

attention_bias and mlp_bias are read from the config by the shared layers; Llama 3 rope scaling
("llama3") is handled by RotaryEmbedding.
"""
from __future__ import annotations

from ladle.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    qk_norm = False
