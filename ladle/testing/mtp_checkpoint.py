"""Qwen3.5 and DeepSeek-V4 checkpoints with an MTP layer, for tests and benchmarks (HF neither saves nor runs
one).

add_mtp_layer gives a checkpoint from ladle.demo.build_checkpoint a random `mtp.*` layer, its decoder layer as HF
saves a full-attention layer of that model (DeepSeek-V4: `mtp.0.*`, a sliding-window, score-routed block).
make_predictable then rebuilds the weights so that drafts are worth verifying: the head maps token t's embedding to
a fixed successor pi(t) (a random permutation), every layer's output projections are scaled down to `noise`, and the
MTP layer reads the token half of its input almost alone. The target then mostly follows pi, departing from it where
the context's small contribution tips the argmax; the MTP layer proposes pi of the last token, so drafts are
accepted as often as the target follows pi and rejected where it departs.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# Projections whose output joins the residual stream (Qwen3.5's, DeepSeek-V4's): scaled by make_predictable's noise.
_OUTPUTS = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "wo_b.weight", "w2.weight")


def add_mtp_layer(model_dir: str, seed: int = 0) -> str:
    """Add one random MTP layer to the single-file checkpoint in model_dir; returns model_dir."""
    from transformers import AutoConfig

    path = Path(model_dir)
    config = AutoConfig.from_pretrained(path)
    dsv4 = config.model_type == "deepseek_v4"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        block = _one_layer(path, {"layer_types": ["sliding_attention"], "mlp_layer_types": ["moe"]} if dsv4
                           else {"layer_types": ["full_attention"]})
        h, std = config.hidden_size, config.initializer_range
        if dsv4:
            n = config.hc_mult
            layer = {"mtp.0." + k: v for k, v in block.items()}
            layer.update({"mtp.0.e_proj.weight": torch.randn(h, h) * std,
                          "mtp.0.h_proj.weight": torch.randn(h, h) * std,
                          "mtp.0.hc_head_fn": torch.randn(n, n * h) * std, "mtp.0.hc_head_base": torch.zeros(n),
                          "mtp.0.hc_head_scale": torch.ones(1)})
            layer.update({f"mtp.0.{name}.weight": torch.ones(h) for name in ("enorm", "hnorm", "norm")})
        else:
            layer = {"mtp.layers.0." + k: v for k, v in block.items()}
            layer["mtp.fc.weight"] = torch.randn(h, 2 * h) * std
            for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
                layer[f"mtp.{name}.weight"] = torch.zeros(h)  # zero-centred norms: scale 1
    weights = load_file(path / "model.safetensors")
    save_file({**weights, **layer}, path / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((path / "config.json").read_text())
    raw["num_nextn_predict_layers" if dsv4 else "mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    return model_dir


def _one_layer(path: Path, types: dict) -> dict[str, torch.Tensor]:
    """A random decoder layer of the checkpoint's model with these layer types, as HF saves it (its tensors by
    their names under the layer)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    one = AutoConfig.from_pretrained(path)
    one.num_hidden_layers = 1
    for key, value in types.items():
        setattr(one, key, value)
    with tempfile.TemporaryDirectory() as tmp:
        AutoModelForCausalLM.from_config(one, dtype=torch.float32).save_pretrained(tmp, safe_serialization=True)
        return {k[len("model.layers.0."):]: v for k, v in load_file(f"{tmp}/model.safetensors").items()
                if k.startswith("model.layers.0.")}


def make_predictable(model_dir: str, noise: float, seed: int = 0) -> str:
    """Rebuild an add_mtp_layer checkpoint (untied head) so its MTP drafts are often accepted; see above."""
    path = Path(model_dir)
    weights = load_file(path / "model.safetensors")
    head_name = next((n for n in ("lm_head.weight", "head.weight") if n in weights), None)  # HF's, DeepSeek's
    if head_name is None:
        raise ValueError("make_predictable needs an untied head (build_checkpoint(tie_word_embeddings=False))")
    gen = torch.Generator().manual_seed(seed)
    embed = weights["model.embed_tokens.weight"]
    successor = torch.randperm(embed.shape[0], generator=gen)
    head = torch.empty_like(embed)
    head[successor] = embed  # head row pi(t) is t's embedding, so the logit of pi(t) leads after token t
    weights[head_name] = head
    for name in list(weights):
        if name.endswith(_OUTPUTS):
            weights[name] = weights[name] * noise
    h = embed.shape[1]
    if "mtp.0.e_proj.weight" in weights:  # DeepSeek-V4: the token's projection passes it through
        weights["mtp.0.e_proj.weight"] = torch.eye(h)
        weights["mtp.0.h_proj.weight"] = torch.randn(h, h, generator=gen) * noise * 0.02
    else:
        fc = torch.randn(h, 2 * h, generator=gen) * noise * 0.02
        fc[:, :h] += torch.eye(h)  # the token half passes through
        weights["mtp.fc.weight"] = fc
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return model_dir
