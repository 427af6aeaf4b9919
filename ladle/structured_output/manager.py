"""The engine core's grammar matchers: one per constrained request, compiled off the step loop, asked for a
bitmask row only when its request samples, and advanced only by tokens the core commits.

Compiling runs on one worker thread (llguidance drops the GIL while it builds a matcher), keyed by the grammar's
text in an LRU of pristine matchers: a request takes a deep copy, so n samples of one request, or the same
schema sent again, compile once. A request waits in the queue (the scheduler passes over it) until its copy is
ready; one whose grammar fails to compile, or whose compile runs longer than compile_timeout_s, ends with an
error (time queued behind other compiles, or behind the tokenizer's one-time build, does not count).
"""
from __future__ import annotations

import concurrent.futures as cf
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ladle.sampling_params import StructuredOutputsParams
from ladle.structured_output.grammar import InvalidStructuredOutput, grammar_of
from ladle.structured_output.matcher import GrammarError, compile_matcher, error_line, lltokenizer, tokenizer_spec
from ladle.structured_output.think_gate import Gate, ThinkGate
from ladle.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

DEFAULT_CACHE_SIZE = 64  # pristine matchers kept (each holds its lexer: kilobytes to megabytes)
DEFAULT_COMPILE_TIMEOUT_S = 30.0


def _set_bit(row: np.ndarray, token_id: int, value: bool) -> None:
    word, bit = divmod(token_id, 32)
    if word < row.shape[0]:
        u = row.view(np.uint32)
        u[word] = u[word] | np.uint32(1 << bit) if value else u[word] & np.uint32(~(1 << bit) & 0xFFFFFFFF)


class StructuredOutputManager:
    def __init__(self, tokenizer: str, vocab_size: int, eos_token_ids: frozenset[int], *,
                 cache_size: int = DEFAULT_CACHE_SIZE, compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """tokenizer: the checkpoint's tokenizer folder (loaded on the first constrained request);
        vocab_size: the logits' width, which every bitmask row covers (tokens past the tokenizer's never
        allowed); eos_token_ids: the tokens a matcher allows where its grammar is complete."""
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self._tokenizer_path = tokenizer
        self._eos = sorted(eos_token_ids)
        self._clock = clock
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ladle-grammar")
        self._lltokenizer: LLTokenizer | None = None
        self._cache: OrderedDict[str, LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        # Each pending request's compile, and when that compile began (empty while it waits for the worker).
        self._pending: dict[str, tuple[cf.Future, list[float]]] = {}
        self._matchers: dict[str, LLMatcher] = {}
        self._gates: dict[str, ThinkGate] = {}  # requests whose constraint waits for a thinking block's end
        self.num_compiled = 0  # grammars compiled (cache misses), for tests and stats

    @property
    def width(self) -> int:
        """Int32 words per bitmask row."""
        return (self.vocab_size + 31) // 32

    def add(self, request_id: str, spec: StructuredOutputsParams, prompt: list[int] | None = None) -> None:
        """Start compiling request_id's grammar (a cached one is ready at the next poll); prompt: its token ids,
        which say whether it starts inside a thinking block (with spec.think_tags)."""
        if spec.think_tags is not None:
            self._gates[request_id] = ThinkGate.at_prompt(spec.think_tags, prompt or [])
        started: list[float] = []
        try:
            grammar = grammar_of(spec)
        except InvalidStructuredOutput as e:
            future: cf.Future = cf.Future()
            future.set_exception(GrammarError(str(e)))
        else:
            future = self._pool.submit(self._compile, grammar, started)
        self._pending[request_id] = (future, started)

    def poll(self) -> list[tuple[str, str]]:
        """Take the matchers compiled since the last poll; returns the requests that cannot run, with why."""
        failed = []
        now = self._clock()
        for rid, (future, started) in list(self._pending.items()):
            if future.done():
                del self._pending[rid]
                try:
                    self._matchers[rid] = future.result().deep_copy()
                except Exception as e:  # noqa: BLE001 -- any failure ends this request only
                    failed.append((rid, f"its structured-output grammar could not be compiled: {e}"))
            elif started and now - started[0] > self.compile_timeout_s:
                del self._pending[rid]
                future.cancel()
                failed.append((rid, f"its structured-output grammar did not compile within "
                                    f"{self.compile_timeout_s:g} s"))
        return failed

    def wait(self, timeout: float) -> None:
        """Block until some pending grammar is compiled, or timeout seconds pass (an engine with nothing else
        to run waits here instead of spinning)."""
        futures = [f for f, _ in self._pending.values()]
        if futures:
            cf.wait(futures, timeout=timeout, return_when=cf.FIRST_COMPLETED)

    def is_ready(self, request_id: str) -> bool:
        return request_id in self._matchers

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def error(self, request_id: str) -> str | None:
        """Why request_id's matcher broke (a token it could not take, a parser limit), in one line, or None.
        llguidance's report also dumps its state and the whole grammar: only its error line is kept."""
        m = self._matchers[request_id]
        return error_line(m.get_error()) if m.is_error() else None

    def fill_bitmasks(self, request_ids: list[str]) -> np.ndarray:
        """[len(request_ids), width] int32: bit t of row i (word t // 32, bit t % 32) is set when token t may
        come next for request i. Rows are filled in parallel by llguidance's threads."""
        mask = np.zeros((len(request_ids), self.width), dtype=np.int32)
        row_bytes = mask.shape[1] * 4
        for i, rid in enumerate(request_ids):
            gate = self._gates.get(rid)
            if gate is not None and gate.state is Gate.THINKING:
                mask[i] = -1  # thinking: anything but EOS
                for t in self._eos:
                    _set_bit(mask[i], t, False)
                continue
            self._matchers[rid].unsafe_compute_mask_ptr(mask.ctypes.data + i * row_bytes, row_bytes)
            if gate is not None and gate.state is Gate.MAY_OPEN:
                _set_bit(mask[i], gate.tags.start[0], True)
        return mask

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance request_id by a committed token (its matcher, unless a thinking block holds it); False when
        the grammar does not allow the token."""
        gate = self._gates.get(request_id)
        if gate is not None and not gate.take(token_id):
            return True
        return bool(self._matchers[request_id].consume_token(token_id))

    def is_terminated(self, request_id: str) -> bool:
        """The grammar is complete and allows nothing more: the request is done."""
        gate = self._gates.get(request_id)
        return (gate is None or gate.state is Gate.ENFORCED) and bool(self._matchers[request_id].is_stopped())

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (speculative tokens that were not verified), all of them
        the grammar's (not across a thinking block's end)."""
        gate = self._gates.get(request_id)
        if gate is not None and (gate.state is not Gate.ENFORCED or num_tokens > gate.fed):
            raise GrammarError(f"request {request_id}: cannot roll back {num_tokens} tokens across its thinking block")
        if not self._matchers[request_id].rollback(num_tokens):
            raise GrammarError(f"request {request_id}: cannot roll back {num_tokens} tokens")
        if gate is not None:
            gate.fed -= num_tokens

    def can_draft(self, request_id: str) -> bool:
        """Whether drafts can be checked against the grammar and taken back: its matcher is ready and holds (no
        thinking block may still come, across whose end no rollback goes)."""
        gate = self._gates.get(request_id)
        m = self._matchers.get(request_id)
        return m is not None and not m.is_error() and (gate is None or gate.state is Gate.ENFORCED)

    def forced_tokens(self, request_id: str) -> list[int]:
        """The tokens the grammar forces next (its only legal continuation), for a drafter to propose; none
        while a thinking block may still come."""
        gate = self._gates.get(request_id)
        if gate is not None and gate.state is not Gate.ENFORCED:
            return []
        return list(self._matchers[request_id].compute_ff_tokens())

    def remove(self, request_id: str) -> None:
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            pending[0].cancel()
        self._matchers.pop(request_id, None)
        self._gates.pop(request_id, None)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, grammar: str, started: list[float]) -> LLMatcher:
        """On the worker thread: the pristine matcher of grammar, from the cache or compiled now (noting in
        `started` when the compile itself began)."""
        hit = self._cache.get(grammar)  # the cache and the tokenizer are the worker's alone
        if hit is not None:
            self._cache.move_to_end(grammar)
            return hit
        tokenizer = self._tokenizer()
        started.append(self._clock())
        matcher = self._matcher(tokenizer, grammar)
        self.num_compiled += 1
        self._cache[grammar] = matcher
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return matcher

    @staticmethod
    def _matcher(tokenizer: LLTokenizer, grammar: str) -> LLMatcher:
        return compile_matcher(tokenizer, grammar)

    def _tokenizer(self) -> LLTokenizer:
        """llguidance's view of the checkpoint's tokenizer, built once (about 2 s at a 150K vocabulary)."""
        if self._lltokenizer is None:
            hf = load_tokenizer(self._tokenizer_path)
            self._lltokenizer = lltokenizer(tokenizer_spec(hf, self.vocab_size, self._eos))
        return self._lltokenizer
