"""A random-weight checkpoint that ends its replies by itself after a few tokens, as a trained model does. The agent
CLIs take a reply cut off at max_tokens as a failed turn (Claude Code: "exceeded the 32000 output token maximum";
Codex: "Incomplete response returned"), and a random model left alone writes until the limit.

How: residual dimension 0 is held at a value far above the others (every token embeds it there, and no attention or
MLP output writes it), so the final norm leaves about sqrt(hidden size) in it at every position whatever the context;
the output head reads that dimension for the end-of-turn token only. Every other token's logit is near zero, so the
end token takes a fixed share of each step (a third: replies of a few tokens, 30 or more about once in 10^5), and
any other token is about equally likely, inside a forced call's grammar too. The same dimension keeps the model
from ever opening a thinking block: a random model closes one only by chance (1 token in the vocabulary's size, the
reply's end being barred inside), so a forced call that began with one wrote some 500 tokens first, and a few
thousand now and then. Tokens given the end's logit too (`likely`) come as often: a thinking block's close, where the
template opens the block itself (Qwen3.5's), so it ends after a token or two (a reply may then hold the close as
text); a double quote, so a forced call's strings end after a few tokens when its arguments are not narrowed."""
from __future__ import annotations

import json
import math
from pathlib import Path

from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

# The held dimension's value. The others start at about 0.2 (ladle.demo's initializer range), and every layer adds
# its attention and MLP outputs to them: at hidden size 256 they reach tens each, and a held value of 100 no longer
# dominates the final norm (a forced call's strings then ran for thousands of tokens); 10^4 does at every size here.
_LEVEL = 1e4
_NEVER_LOGIT = -64.0  # never sampled
# Every layer's writes into the residual stream: attention (full or Gated DeltaNet) and MLP outputs.
_WRITERS = ("self_attn.o_proj.weight", "linear_attn.out_proj.weight", "mlp.down_proj.weight")


def make_quiet(model_dir: str | Path, end: str = "<|im_end|>", never: str = "<think>",
               likely: tuple[str, ...] = ()) -> None:
    """Rewrites model_dir's weights in place, so its replies end soon with `end`, never hold `never`, and hold each
    of `likely` as often as the end; the checkpoint's output head must be its own matrix (untied), its final norm's
    gain 1 in the held dimension (a fresh checkpoint's)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    if config.get("tie_word_embeddings"):
        raise ValueError("make_quiet needs an untied output head (build with tie_word_embeddings=False)")
    path = Path(model_dir) / "model.safetensors"
    weights = load_file(path)
    weights["model.embed_tokens.weight"][:, 0] = _LEVEL
    for name, w in weights.items():
        if name.endswith(_WRITERS):
            w[0, :] = 0
    head = weights["lm_head.weight"]
    head[:, 0] = 0
    # After the final norm the held dimension is about sqrt(hidden size); the end's logit ln((V - 1) / 2) against
    # V - 1 near-zero ones gives it a third of each step (less by the likely tokens' share).
    held = math.sqrt(config["hidden_size"])
    end_logit = math.log((head.shape[0] - 1) / 2)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for token, logit in ((end, end_logit), *((t, end_logit) for t in likely), (never, _NEVER_LOGIT)):
        head[tokenizer.convert_tokens_to_ids(token), 0] = logit / held
    save_file(weights, path, metadata={"format": "pt"})
