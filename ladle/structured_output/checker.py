"""Checks a request's constraint before the request is queued: its size against GrammarLimits at once, then its
compile in the sandbox, remembering the last constraints that passed (a batch of prompts with one schema, or
an agent's tools sent every turn, is compiled once)."""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import threading
from collections import OrderedDict

from ladle.sampling_params import StructuredOutputsParams
from ladle.structured_output.limits import GrammarLimits, check_spec
from ladle.structured_output.matcher import TokenizerSpec
from ladle.structured_output.sandbox import DEFAULT_TIMEOUT_S, DEFAULT_WORKERS, GrammarSandbox


class GrammarChecker:
    def __init__(self, limits: GrammarLimits = GrammarLimits(), workers: int = DEFAULT_WORKERS,
                 timeout_s: float = DEFAULT_TIMEOUT_S, cache_size: int = 256) -> None:
        self.limits = limits
        self.sandbox = GrammarSandbox(workers, timeout_s)
        self._valid: OrderedDict[str, str] = OrderedDict()  # the spec's key -> its grammar
        self._size = cache_size
        self._lock = threading.Lock()  # futures complete on the sandbox's threads

    def set_tokenizer(self, spec: TokenizerSpec) -> None:
        """Compile matchers for this tokenizer too, as the engine will (until then: the grammar alone)."""
        if not self.sandbox.has_tokenizer:
            self.sandbox.set_tokenizer(spec)

    def submit(self, spec: StructuredOutputsParams, client: str = "") -> cf.Future:
        """A future of spec's grammar text (raising InvalidStructuredOutput where it cannot be served). A
        constraint past a bound raises ConstraintTooLarge here, at once; a full queue, SandboxBusy."""
        check_spec(spec, self.limits)
        key = _key(spec, self.sandbox.has_tokenizer)
        with self._lock:
            grammar = self._valid.get(key)
            if grammar is not None:
                self._valid.move_to_end(key)
                done: cf.Future = cf.Future()
                done.set_result(grammar)
                return done
        future = self.sandbox.submit(spec, client)
        future.add_done_callback(lambda f: self._remember(key, f))
        return future

    def check(self, spec: StructuredOutputsParams) -> str:
        """submit(spec)'s grammar, waited for."""
        return self.submit(spec).result()

    def shutdown(self) -> None:
        self.sandbox.shutdown()

    def _remember(self, key: str, future: cf.Future) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        with self._lock:
            self._valid[key] = future.result()
            while len(self._valid) > self._size:
                self._valid.popitem(last=False)


def _key(spec: StructuredOutputsParams, with_tokenizer: bool) -> str:
    """spec as text: equal constraints have equal keys (a schema as a dict or as its JSON text may differ)."""
    return json.dumps([with_tokenizer, dataclasses.asdict(spec)], sort_keys=True, default=repr)
