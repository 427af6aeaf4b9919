"""Qwen3.5 checkpoints with an MTP layer, for tests and benchmarks (HF neither saves nor runs one).

add_mtp_layer gives a checkpoint from ladle.demo.build_checkpoint a random `mtp.*` layer, its decoder layer as
HF saves a full-attention layer of that model. make_predictable then rebuilds the weights so that drafts are
worth verifying: the head maps token t's embedding to a fixed successor pi(t) (a random permutation), every
layer's output projections are scaled down to `noise`, and the MTP layer reads the token half of its input
almost alone. The target then mostly follows pi, departing from it where the context's small contribution
tips the argmax; the MTP layer proposes pi of the last token, so drafts are accepted as often as the target
follows pi and rejected where it departs.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# Projections whose output joins the residual stream: scaled by make_predictable's noise.
_OUTPUTS = ("o_proj.weight", "out_proj.weight", "down_proj.weight")


def add_mtp_layer(model_dir: str, seed: int = 0) -> str:
    """Add one random MTP layer to the single-file Qwen3.5 checkpoint in model_dir; returns model_dir."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(model_dir)
    config = AutoConfig.from_pretrained(path)
    one = AutoConfig.from_pretrained(path)
    one.num_hidden_layers, one.layer_types = 1, ["full_attention"]
    with torch.random.fork_rng(devices=[]), tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(one, dtype=torch.float32).save_pretrained(tmp, safe_serialization=True)
        layer = {"mtp.layers.0." + k[len("model.layers.0."):]: v
                 for k, v in load_file(f"{tmp}/model.safetensors").items() if k.startswith("model.layers.0.")}
        h = config.hidden_size
        layer["mtp.fc.weight"] = torch.randn(h, 2 * h) * config.initializer_range
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        layer[f"mtp.{name}.weight"] = torch.zeros(h)  # zero-centred norms: scale 1
    weights = load_file(path / "model.safetensors")
    save_file({**weights, **layer}, path / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((path / "config.json").read_text())
    raw["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    return model_dir


def make_predictable(model_dir: str, noise: float, seed: int = 0) -> str:
    """Rebuild an add_mtp_layer checkpoint (untied head) so its MTP drafts are often accepted; see above."""
    path = Path(model_dir)
    weights = load_file(path / "model.safetensors")
    if "lm_head.weight" not in weights:
        raise ValueError("make_predictable needs an untied head (build_checkpoint(tie_word_embeddings=False))")
    gen = torch.Generator().manual_seed(seed)
    embed = weights["model.embed_tokens.weight"]
    successor = torch.randperm(embed.shape[0], generator=gen)
    head = torch.empty_like(embed)
    head[successor] = embed  # head row pi(t) is t's embedding, so the logit of pi(t) leads after token t
    weights["lm_head.weight"] = head
    for name in list(weights):
        if name.endswith(_OUTPUTS):
            weights[name] = weights[name] * noise
    h = embed.shape[1]
    fc = torch.randn(h, 2 * h, generator=gen) * noise * 0.02
    fc[:, :h] += torch.eye(h)  # the token half passes through
    weights["mtp.fc.weight"] = fc
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return model_dir
