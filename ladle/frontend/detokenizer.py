"""Incremental detokenization and stop strings, one instance per request.

Decoding the whole output after every token costs O(n^2) over a long generation. Like vLLM, we decode only
a short window: a few already-emitted tokens (context, so tokenizers that treat a leading space specially
decode the new tokens as they would in place) plus the tokens not yet emitted, and emit what the window's
text gained. A window always starts at a character boundary, so the result equals a full decode.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ladle.frontend.stop_strings import StopMatcher
from ladle.outputs import Logprob

REPLACEMENT_CHAR = "\ufffd"
# vLLM primes the window with the prompt's last tokens: at least this many, ...
_PROMPT_CONTEXT_MIN = 5
# ... and gives up looking for a clean (U+FFFD-free) prompt suffix beyond this many.
_PROMPT_CONTEXT_MAX = 24


class IncrementalDetokenizer:
    """Turns a request's output token ids into text as they arrive, and finds its stop strings.

    Invariant: `output_text` (before a stop cut) equals the full decode of the output tokens, except that a
    trailing run of U+FFFD is held back while later tokens may still complete it into a real character.
    `finish()` releases it, so the final text equals `tokenizer.decode(output_ids)` exactly.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] | StopMatcher,
        include_stop_str_in_output: bool,
        skip_special_tokens: bool,
        *,
        min_tokens: int = 0,
    ) -> None:
        """stop: the stop strings, or a StopMatcher built from them, which the n choices of one request
        share (it is immutable); an empty stop string would match at once, so it means nothing."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        matcher = stop if isinstance(stop, StopMatcher) else StopMatcher(stop)
        self._stop_scanner = matcher.scanner() if matcher.max_len else None
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        # Streaming holds back as many chars as could still grow into a stop string.
        self._stream_holdback = max(matcher.max_len, 1) - 1

        self.output_text = ""
        self.num_output_tokens = 0
        self.stop_str: str | None = None  # the stop string that ended the text, if any
        self.finished = False  # a stop string matched or finish() was called: output_text is final
        self._sent = 0  # chars of output_text already returned by text_delta()

        # Window: token ids starting at a character boundary; the first `_context_len` of them were
        # emitted before (decode context); `_emitted` chars of the window's text are in output_text.
        self._window: list[int] = []
        self._context_len = 0
        self._emitted = 0
        self._prime(list(prompt_token_ids))

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _prime(self, prompt: list[int]) -> None:
        # Context must end at a character boundary, or the first output bytes would be decoded as the tail
        # of a prompt character; a suffix free of U+FFFD starts and ends on boundaries.
        if not prompt:
            return
        for k in range(min(_PROMPT_CONTEXT_MIN, len(prompt)), min(len(prompt), _PROMPT_CONTEXT_MAX) + 1):
            text = self._decode(prompt[-k:])
            if REPLACEMENT_CHAR not in text:
                self._window = prompt[-k:]
                self._context_len = k
                self._emitted = len(text)
                return

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Append tokens; extend output_text; return the matched stop string (text then cut) or None.

        stop_terminated: the last token ended the request (EOS or a stop token id); like vLLM its text is
        left out unless include_stop_str_in_output.
        """
        if self.finished or not new_token_ids:
            return self.stop_str
        self.num_output_tokens += len(new_token_ids)
        ids = list(new_token_ids)
        if stop_terminated and not self._include_stop:
            ids = ids[:-1]
        if not ids:
            return None
        self._window.extend(ids)
        text = self._decode(self._window)
        # A trailing U+FFFD may be the first bytes of a character the next tokens complete; the text
        # before it can no longer change, because UTF-8 decoding resynchronises after a complete char.
        safe = len(text.rstrip(REPLACEMENT_CHAR))
        delta = text[self._emitted : safe] if safe > self._emitted else ""
        self._emitted = max(self._emitted, safe)
        if safe == len(text):
            # The window ends on a boundary: restart it from the tokens emitted since the last boundary,
            # which keeps it a few tokens long however long the output grows.
            self._window = self._window[self._context_len :]
            self._context_len = len(self._window)
            self._emitted = len(self._decode(self._window))
        return self._append(delta)

    def finish(self) -> str | None:
        """The request ended: release held-back text (an incomplete trailing character stays U+FFFD, as in
        a full decode) and make output_text final. Returns the matched stop string or None."""
        if not self.finished:
            text = self._decode(self._window)
            delta = text[self._emitted :]
            self._emitted = len(text)
            self._append(delta)
            self.finished = True
        return self.stop_str

    def _append(self, delta: str) -> str | None:
        if not delta:
            return None
        old_len = len(self.output_text)
        self.output_text += delta
        if self._stop_scanner is None:
            return None
        # Only a match that ends inside the new text is new; it may start in older text (spanning tokens).
        # The match that is complete first wins (then the longer one), so the result does not depend on
        # how many tokens each update brought. vLLM semantics: stop strings are ignored until more than
        # min_tokens tokens were generated; the ignored text is still scanned, as a match may start in it.
        hit = self._stop_scanner.feed(delta, report=self.num_output_tokens > self._min_tokens)
        if hit is None:
            return None
        end = old_len + hit[0]
        i = end - hit[1]
        s = self.output_text[i:end]
        self.output_text = self.output_text[: end if self._include_stop else i]
        self.stop_str = s
        self.finished = True
        return s

    def text_delta(self) -> str:
        """Text added since the last call, for streaming. Until the text is final, the last
        len(longest stop) - 1 chars are held back: they might still turn out to begin a stop string."""
        end = len(self.output_text)
        if not self.finished:
            end = max(self._sent, end - self._stream_holdback)
        delta = self.output_text[self._sent : end]
        self._sent = end
        return delta


def decode_logprobs(tokenizer: Any, logprobs: dict[int, Logprob] | None) -> dict[int, Logprob]:
    """Fill in each candidate token's text, as vLLM reports it (each token decoded alone)."""
    if logprobs is None:
        return {}
    for tid, lp in logprobs.items():
        if lp.decoded_token is None:
            lp.decoded_token = tokenizer.decode([tid])
    return logprobs
