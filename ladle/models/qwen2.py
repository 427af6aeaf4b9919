"""Qwen2 (and Qwen2.5) dense models: the shared decoder with biases on q, k and v (none on o_proj) and no q/k
norm, as HF's Qwen2Attention has them."""
from __future__ import annotations

from ladle.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    qk_norm = False
    qkv_bias = True
