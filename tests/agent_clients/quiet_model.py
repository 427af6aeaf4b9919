"""A random-weight checkpoint that ends its replies by itself after a few tokens, as a trained model does. The agent
CLIs take a reply cut off at max_tokens as a failed turn (Claude Code: "exceeded the 32000 output token maximum";
Codex: "Incomplete response returned"), and a random model left alone writes until the limit.

How: residual dimension 0 is held at a value far above the others (every token embeds it there, and no attention or
MLP output writes it), so the final norm leaves about sqrt(hidden size) in it at every position whatever the context;
the output head reads that dimension for the end-of-turn token only. Every other token's logit is near zero, so the
end token takes a fixed share of each step (about a third: replies of a few tokens, 30 or more about once in 10^5),
and any other token is about equally likely, inside a forced call's grammar too. The same dimension keeps the model
from ever opening a thinking block: a random model closes one only by chance (1 token in ~500, the reply's end being
barred inside), so a forced call that began with one wrote some 500 tokens first, and a few thousand now and then."""
from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

_LEVEL = 100.0  # the held dimension's value; the others are random at about 0.2 (ladle.demo's initializer range)
_END_WEIGHT = 0.8  # the end token's head weight on it: a logit of about 0.8 * 8 = 6.4 against ~518 near-zero ones
_NEVER_WEIGHT = -8.0  # a logit of about -64: never sampled


def make_quiet(model_dir: str | Path, end: str = "<|im_end|>", never: str = "<think>") -> None:
    """Rewrites model_dir's weights in place, so its replies end soon with `end` and never hold `never`; the
    checkpoint's output head must be its own matrix (untied)."""
    if json.loads((Path(model_dir) / "config.json").read_text()).get("tie_word_embeddings"):
        raise ValueError("make_quiet needs an untied output head (build with tie_word_embeddings=False)")
    path = Path(model_dir) / "model.safetensors"
    weights = load_file(path)
    weights["model.embed_tokens.weight"][:, 0] = _LEVEL
    for name, w in weights.items():
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            w[0, :] = 0
    weights["lm_head.weight"][:, 0] = 0
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    weights["lm_head.weight"][tokenizer.convert_tokens_to_ids(end), 0] = _END_WEIGHT
    weights["lm_head.weight"][tokenizer.convert_tokens_to_ids(never), 0] = _NEVER_WEIGHT
    save_file(weights, path, metadata={"format": "pt"})
