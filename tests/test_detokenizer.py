"""IncrementalDetokenizer: incremental text equals a full decode; stop strings cut it, even across tokens."""
from __future__ import annotations

import random
from typing import Any

import pytest

from ladle.frontend.detokenizer import IncrementalDetokenizer

MULTIBYTE = [
    "Hello, world! 你好，世界！",
    "Emoji 😀🚀 and a family 👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵.",
    "日本語のテキストです。한국어 문장입니다. Привет, мир! Café naïve Straße",
    "🤖" * 7 + "中文" * 5,
]


def detok(tok: Any, prompt: list[int] | None = None, stop: list[str] | None = None, include: bool = False,
          skip: bool = True, **kw: Any) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tok, prompt or [], stop or [], include, skip, **kw)


def feed(d: IncrementalDetokenizer, ids: list[int], step: int = 1) -> tuple[str | None, str]:
    """Feed ids `step` at a time, then finish; return (stop string, concatenated text_delta())."""
    stop, streamed = None, ""
    for i in range(0, len(ids), step):
        stop = d.update(ids[i : i + step])
        streamed += d.text_delta()
        if stop is not None:
            break
    if stop is None:
        stop = d.finish()
    return stop, streamed + d.text_delta()


@pytest.mark.parametrize("text", MULTIBYTE)
@pytest.mark.parametrize("step", [1, 2, 3])
def test_multibyte_text_one_token_at_a_time(tokenizer: Any, text: str, step: int) -> None:
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)  # characters really are split across tokens
    prompt = tokenizer.encode("User: say something.\nAssistant:")
    d = detok(tokenizer, prompt)
    stop, streamed = feed(d, ids, step)
    assert stop is None
    assert d.output_text == text == tokenizer.decode(ids) == streamed


def test_output_text_never_holds_a_partial_character(tokenizer: Any) -> None:
    text = MULTIBYTE[1]
    ids = tokenizer.encode(text)
    d = detok(tokenizer)
    for i, t in enumerate(ids):
        d.update([t])
        assert "\ufffd" not in d.output_text
        assert text.startswith(d.output_text)
        # Everything decodable is out: only an incomplete trailing character is held back.
        assert d.output_text == tokenizer.decode(ids[: i + 1]).rstrip("\ufffd")


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("skip", [True, False])
def test_random_tokens_equal_full_decode(tokenizer: Any, seed: int, skip: bool) -> None:
    rng = random.Random(seed)
    vocab = len(tokenizer)
    ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 200))]
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
    d = detok(tokenizer, prompt, skip=skip)
    stop, streamed = feed(d, ids, step=rng.choice([1, 1, 2, 5]))
    assert stop is None
    assert d.output_text == tokenizer.decode(ids, skip_special_tokens=skip) == streamed


def test_prompt_ending_mid_character_does_not_leak_into_output(tokenizer: Any) -> None:
    ids = tokenizer.encode("前后😀")
    for cut in range(1, len(ids)):
        d = detok(tokenizer, ids[:cut])
        feed(d, ids[cut:])
        assert d.output_text == tokenizer.decode(ids[cut:])


def test_special_tokens_skipped_or_kept(tokenizer: Any) -> None:
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("hi") + [im_end] + tokenizer.encode(" there")
    for skip, expected in [(True, "hi there"), (False, "hi<|im_end|> there")]:
        d = detok(tokenizer, skip=skip)
        feed(d, ids)
        assert d.output_text == expected


def test_eos_text_left_out_when_stop_terminated(tokenizer: Any) -> None:
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for include, expected in [(False, "ok"), (True, "ok<|im_end|>")]:
        d = detok(tokenizer, skip=False, include=include)
        d.update(tokenizer.encode("ok"))
        d.update([eos], stop_terminated=True)
        d.finish()
        assert d.output_text == expected
        assert d.num_output_tokens == len(tokenizer.encode("ok")) + 1


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tokenizer: Any, include: bool) -> None:
    text = "The answer is 42. END of story, and more text after END."
    ids = tokenizer.encode(text)
    stop_str = "D of st"
    # The stop string is not a single token: it spans a token boundary.
    assert not any(stop_str in tokenizer.decode([t]) for t in ids)
    d = detok(tokenizer, stop=["never", stop_str], include=include)
    stop, streamed = feed(d, ids)
    assert stop == stop_str
    expected = text[: text.index(stop_str) + (len(stop_str) if include else 0)]
    assert d.output_text == expected == streamed
    assert d.finished
    assert d.update(tokenizer.encode(" ignored")) == stop_str and d.output_text == expected


def test_earliest_stop_string_wins_and_multibyte_stop(tokenizer: Any) -> None:
    text = "abc 世界 xyz 😀 tail"
    ids = tokenizer.encode(text)
    d = detok(tokenizer, stop=["😀", "世界"])
    stop, streamed = feed(d, ids)
    assert stop == "世界" and d.output_text == "abc " == streamed


def test_stop_string_within_one_update_of_many_tokens(tokenizer: Any) -> None:
    text = "first line\nsecond line\nthird"
    d = detok(tokenizer, stop=["\n"])
    assert d.update(tokenizer.encode(text)) == "\n"
    assert d.output_text == "first line"


def test_min_tokens_ignores_early_stop_strings(tokenizer: Any) -> None:
    ids = tokenizer.encode("a.b.c.d")
    assert len(ids) == 7  # one token per character, so token counts are char counts
    d = detok(tokenizer, stop=["."], min_tokens=3)
    stop, _ = feed(d, ids)
    # vLLM semantics: stop strings count only once more than min_tokens tokens exist; the "." at token 2
    # is ignored, the one at token 4 stops.
    assert stop == "." and d.output_text == "a.b"


def test_text_delta_holds_back_a_possible_stop_prefix(tokenizer: Any) -> None:
    d = detok(tokenizer, stop=["STOP"])
    d.update(tokenizer.encode("go ST"))
    assert d.output_text == "go ST"
    assert d.text_delta() == "go"  # "go ST"[:-3]: " ST" could still become "STOP"
    d.update(tokenizer.encode("ILL"))
    assert d.text_delta() == " ST"  # "go STILL"[:-3]
    d.finish()
    assert d.text_delta() == "ILL"  # final: nothing held back


def test_long_output_keeps_the_window_short(tokenizer: Any) -> None:
    calls: list[int] = []

    class Counting:
        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            calls.append(len(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    text = "The quick brown fox jumps over the lazy dog. 你好😀 " * 40
    ids = tokenizer.encode(text)
    d = detok(Counting())
    feed(d, ids)
    assert d.output_text == text
    assert max(calls) <= 12  # never a full re-decode


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("include", [False, True])
def test_random_stop_strings_cut_at_the_first_match(tokenizer: Any, seed: int, include: bool) -> None:
    rng = random.Random(seed)
    step = rng.choice([1, 3, 1000])
    ids = tokenizer.encode(" ".join(rng.choice(MULTIBYTE) for _ in range(4)))
    full = tokenizer.decode(ids)
    stops = []
    for _ in range(2):
        start = rng.randrange(len(full) - 4)
        stops.append(full[start : start + rng.randrange(1, 5)])
    d = detok(tokenizer, tokenizer.encode("prompt"), stop=stops, include=include)
    stop, streamed = feed(d, ids, step=step)
    assert stop in stops
    cut = full.index(stop)
    # Streaming semantics: the stop string that is complete first wins; none ends earlier in the text.
    assert all(full.index(s) + len(s) >= cut + len(stop) for s in stops)
    end = cut + (len(stop) if include else 0)
    assert d.output_text == full[:end] == streamed
