"""A transformers fast tokenizer built from a GGUF file's tokenizer.* keys: byte-level BPE (llama.cpp's "gpt2"
model), its pre-tokenizer split by tokenizer.ggml.pre, control tokens special, the file's chat template.

transformers builds one too (AutoTokenizer.from_pretrained(dir, gguf_file=...)), but reads the header with a
reader that takes 8-10 s for SmolLM2's vocabulary on a busy 2-core EPYC, and splits a pre type it does not
know ("smollm") with GPT-2's regex where llama.cpp first splits every digit. This one builds in well under a
second from ladle.gguf.reader and splits as llama.cpp does for the pre types it names; any other pre type or
tokenizer model is refused by name (a different split is a different tokenization).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ladle.gguf.reader import GGUFFile

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# llama.cpp token types (llama_token_type): 3 CONTROL (special: never split, skipped when decoding with
# skip_special_tokens), 4 USER_DEFINED (matched whole, decoded as text).
_CONTROL, _USER_DEFINED = 3, 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the regexes llama.cpp splits with, in order (llama-vocab.cpp, llm_tokenizer_bpe).
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2_SPLIT,),
    "gpt-2": (_GPT2_SPLIT,),
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
}


class GGUFTokenizerError(ValueError):
    """The file's tokenizer is one ladle cannot build exactly."""


def build_tokenizer(gguf: GGUFFile) -> PreTrainedTokenizerFast:
    """The file's tokenizer as a PreTrainedTokenizerFast (what ladle's engine and server take)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    md = gguf.metadata
    kind = md.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFTokenizerError(f"{gguf.path}: tokenizer.ggml.model {kind!r} is not implemented; ladle builds "
                                 "byte-level BPE ('gpt2') tokenizers from GGUF files")
    pre = md.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise GGUFTokenizerError(f"{gguf.path}: tokenizer.ggml.pre {pre!r} is not implemented; known: "
                                 f"{', '.join(PRE_TOKENIZER_SPLITS)}")
    if md.get("tokenizer.ggml.add_space_prefix"):
        raise GGUFTokenizerError(f"{gguf.path}: tokenizer.ggml.add_space_prefix true is not implemented for "
                                 "byte-level BPE")
    tokens: list[str] = md["tokenizer.ggml.tokens"]
    types = list(md.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFTokenizerError(f"{gguf.path}: tokenizer.ggml.tokens spells {len(tokens) - len(vocab)} tokens twice")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZER_SPLITS[pre]]
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                   use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind_ in zip(tokens, types) if kind_ == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind_ in zip(tokens, types) if kind_ == _USER_DEFINED])
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise GGUFTokenizerError(f"{gguf.path}: the tokenizer built has {tok.get_vocab_size()} tokens, the file "
                                 f"lists {len(tokens)}")

    def special(key: str) -> str | None:
        index = md.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
    if add_bos or add_eos:  # llama.cpp adds them around every prompt; so must the tokenizer's post-processor
        from tokenizers import processors

        bos = special("bos") if add_bos else ""
        eos = special("eos") if add_eos else ""
        if bos is None or eos is None:
            raise GGUFTokenizerError(f"{gguf.path}: add_bos_token / add_eos_token is set but the token id is absent")
        before = [bos] if add_bos else []
        after = [eos] if add_eos else []
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join([*before, "$A", *after]),
            pair=" ".join([*before, "$A", *after, *before, "$B:1", *after]),
            special_tokens=[(t, vocab[t]) for t in dict.fromkeys(before + after)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=special("bos"), eos_token=special("eos"), unk_token=special("unknown"),
        pad_token=special("padding"), chat_template=md.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False, model_max_length=1 << 30,
    )
