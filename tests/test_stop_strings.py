"""Stop strings via the Aho-Corasick StopMatcher: the same results as the old per-string str.find scan
(kept here as the oracle), and work linear in the text whatever the number of stop strings."""
from __future__ import annotations

import random
from typing import Sequence

import pytest

from ladle.frontend.detokenizer import IncrementalDetokenizer
from ladle.frontend.output_processor import OutputProcessor
from ladle.frontend.stop_strings import StopMatcher
from ladle.sampling_params import SamplingParams

# Token id -> text: single chars, a few multi-char tokens, and an empty one (a token count that is not
# the char count matters for min_tokens).
VOCAB = ["a", "b", "c", "ab", "ba", "abc", "", "ca"]


class FakeTokenizer:
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(VOCAB[i] for i in ids)


class OldDetokenizer:
    """The oracle: IncrementalDetokenizer's stop-string logic before the automaton (one str.find per stop
    string per update), over FakeTokenizer, whose text never needs holding back."""

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool, min_tokens: int) -> None:
        self._stop = [s for s in stop if s]
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._stream_holdback = max((len(s) for s in self._stop), default=1) - 1
        self.output_text = ""
        self.num_output_tokens = 0
        self.stop_str: str | None = None
        self.finished = False
        self._sent = 0

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        if self.finished or not new_token_ids:
            return self.stop_str
        self.num_output_tokens += len(new_token_ids)
        ids = list(new_token_ids)
        if stop_terminated and not self._include_stop:
            ids = ids[:-1]
        if not ids:
            return None
        return self._append(FakeTokenizer().decode(ids))

    def finish(self) -> str | None:
        self.finished = True
        return self.stop_str

    def _append(self, delta: str) -> str | None:
        if not delta:
            return None
        old_len = len(self.output_text)
        self.output_text += delta
        if self._stop and self.num_output_tokens > self._min_tokens:
            return self._check_stop(old_len)
        return None

    def _check_stop(self, old_len: int) -> str | None:
        best: tuple[int, int, str] | None = None
        for s in self._stop:
            i = self.output_text.find(s, max(0, old_len - len(s) + 1))
            if i != -1 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        if best is None:
            return None
        _, i, s = best
        self.output_text = self.output_text[: i + len(s) if self._include_stop else i]
        self.stop_str = s
        self.finished = True
        return s

    def text_delta(self) -> str:
        end = len(self.output_text)
        if not self.finished:
            end = max(self._sent, end - self._stream_holdback)
        delta = self.output_text[self._sent : end]
        self._sent = end
        return delta


def random_stops(rng: random.Random, alphabet: str, text: str) -> list[str]:
    """Random stop strings, with nested, overlapping, duplicate and empty ones, and some from the text."""
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 10))]
    for _ in range(rng.randint(0, 4)):
        if text:
            i = rng.randrange(len(text))
            stops.append(text[i : i + rng.randint(1, 7)])
    for _ in range(rng.randint(0, 3)):
        s = rng.choice(stops)
        i = rng.randrange(len(s))
        stops.append(s[i : rng.randint(i + 1, len(s))])  # a substring: nested patterns
    if rng.random() < 0.2:
        stops.append("")
    if rng.random() < 0.3:
        stops.append(rng.choice(stops))
    rng.shuffle(stops)
    return stops


def pieces(rng: random.Random, ids: list[int]) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        k = rng.choice([1, 1, 1, 2, 3, 5, 50])
        out.append(ids[i : i + k])
        i += k
    return out


def assert_same(new: IncrementalDetokenizer, old: OldDetokenizer) -> None:
    assert (new.output_text, new.stop_str, new.finished) == (old.output_text, old.stop_str, old.finished)
    assert new.text_delta() == old.text_delta()


@pytest.mark.parametrize("seed", range(300))
def test_matches_the_old_find_scan(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = rng.choice(["ab", "abc"])
    vocab_ids = [i for i, t in enumerate(VOCAB) if set(t) <= set(alphabet)]
    ids = [rng.choice(vocab_ids) for _ in range(rng.randint(0, 60))]
    stops = random_stops(rng, alphabet, FakeTokenizer().decode(ids))
    include = rng.random() < 0.5
    min_tokens = rng.choice([0, 0, 1, 3, rng.randint(0, 40)])
    shared = StopMatcher(stops) if rng.random() < 0.5 else stops
    new = IncrementalDetokenizer(FakeTokenizer(), [], shared, include, True, min_tokens=min_tokens)
    old = OldDetokenizer(stops, include, min_tokens)
    chunks = pieces(rng, ids)
    for n, chunk in enumerate(chunks):
        terminated = n == len(chunks) - 1 and rng.random() < 0.3
        assert new.update(chunk, stop_terminated=terminated) == old.update(chunk, stop_terminated=terminated)
        assert_same(new, old)
    assert new.finish() == old.finish()
    assert_same(new, old)


def test_one_matcher_shared_by_many_choices() -> None:
    rng = random.Random(7)
    stops = ["abab", "bb", "aaa", "ba" * 4, "cab"]
    matcher = StopMatcher(stops)
    pairs = [(IncrementalDetokenizer(FakeTokenizer(), [], matcher, False, True, min_tokens=i % 3),
              OldDetokenizer(stops, False, i % 3)) for i in range(8)]
    for _ in range(40):  # interleave the choices' updates: their scan states must not mix
        new, old = rng.choice(pairs)
        chunk = [rng.randrange(len(VOCAB)) for _ in range(rng.randint(1, 3))]
        assert new.update(chunk) == old.update(chunk)
        assert_same(new, old)
    assert any(new.finished for new, _ in pairs)


def test_output_processor_builds_one_matcher_per_request() -> None:
    proc = OutputProcessor(FakeTokenizer())
    proc.add("r", None, [], SamplingParams(n=3, stop=["ab", "c"]), ["r-0", "r-1", "r-2"])
    matchers = {id(c.detok._stop_scanner.matcher) for c in proc.children.values()}
    assert len(matchers) == 1
    assert len({id(c.detok._stop_scanner) for c in proc.children.values()}) == 3


def test_matcher_longest_match_and_holdback() -> None:
    m = StopMatcher(["he", "she", "his", "hers", "", "he"])
    assert m.max_len == 4
    sc = m.scanner()
    assert sc.feed("us") is None
    assert sc.feed("hers") == (2, 3)  # "ushe": "she" and "he" end there; the longer one is reported
    d = IncrementalDetokenizer(FakeTokenizer(), [], m, False, True)
    d.update([0, 0, 0])  # "aaa"
    assert d.text_delta() == ""  # len("hers") - 1 chars held back
    assert IncrementalDetokenizer(FakeTokenizer(), [], ["", ""], False, True)._stop_scanner is None


def test_work_is_linear_in_the_text_not_in_the_stop_strings() -> None:
    rng = random.Random(0)
    # 100,000 stop strings: every binary string up to 12 chars is a trie prefix, so the scan stays deep
    # and keeps following fail links; none matches, since the text has no "c".
    many = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 12))) + "c" for _ in range(100_000)]
    matcher = StopMatcher(many)
    assert matcher.num_nodes <= sum(map(len, many)) + 1
    ids = [rng.randrange(2) for _ in range(5000)]  # "a"/"b" tokens
    steps = {}
    for name, stop in [("many", matcher), ("few", StopMatcher(["aab" + "c", "bc"]))]:
        d = IncrementalDetokenizer(FakeTokenizer(), [], stop, False, True)
        for chunk in pieces(rng, ids):
            assert d.update(chunk) is None
        assert d._stop_scanner is not None
        steps[name] = d._stop_scanner.steps
    # One transition per char plus the fail links followed, which never outnumber the chars.
    assert len(ids) <= steps["few"] <= 2 * len(ids)
    assert len(ids) <= steps["many"] <= 2 * len(ids)
    assert steps["many"] > 1.5 * len(ids)  # the fail links really are exercised
