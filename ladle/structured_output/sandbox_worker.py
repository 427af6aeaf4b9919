"""A grammar sandbox's worker process: `python -m ladle.structured_output.sandbox_worker`.

It reads length-prefixed pickled messages on stdin and answers each on stdout:
    ("tokenizer", TokenizerSpec)            -> ("ok", None)
    ("compile", StructuredOutputsParams)    -> ("ok", grammar) or ("invalid", field, message)
A compile does all the native work the engine would do for the constraint: the grammar from the schema, the
compiler's validation, and, once a tokenizer was sent, the matcher and its first mask. Whatever crashes in
there ends this process only; the sandbox answers that request and starts another worker.
"""
from __future__ import annotations

import pickle
import struct
import sys
from typing import IO, Any

_HEADER = struct.Struct("<I")


def read_message(stream: IO[bytes]) -> Any:
    """The next message, or None at the end of the stream."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    body = stream.read(size)
    if len(body) < size:
        return None
    return pickle.loads(body)


def write_message(stream: IO[bytes], message: Any) -> None:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(body)) + body)
    stream.flush()


def answer(message: Any, tokenizer: list[Any]) -> Any:
    import llguidance

    from ladle.structured_output.grammar import InvalidStructuredOutput, grammar_of
    from ladle.structured_output.matcher import GrammarError, compile_matcher, lltokenizer

    if message[0] == "tokenizer":
        tokenizer[:] = [lltokenizer(message[1])]
        return ("ok", None)
    spec = message[1]
    field = f"structured_outputs.{spec.kind}"
    try:
        grammar = grammar_of(spec)
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error:
            return ("invalid", field, error.strip())
        if tokenizer:
            compile_matcher(tokenizer[0], grammar)
    except InvalidStructuredOutput as e:
        return ("invalid", e.field, e.message)
    except (GrammarError, ValueError, RuntimeError) as e:
        return ("invalid", field, str(e).strip())
    return ("ok", grammar)


def main() -> int:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    tokenizer: list[Any] = []  # the llguidance tokenizer, once sent
    while (message := read_message(stdin)) is not None:
        write_message(stdout, answer(message, tokenizer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
