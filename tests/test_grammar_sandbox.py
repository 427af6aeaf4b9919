"""Client constraints are bounded before any native code sees them, and compiled in worker processes where a
crash or a runaway compile costs one request (issue: one schema segfaulted the API process for good)."""
from __future__ import annotations

import signal
import time

import pytest

from ladle.sampling_params import StructuredOutputsParams as SO
from ladle.structured_output.checker import GrammarChecker
from ladle.structured_output.grammar import InvalidStructuredOutput
from ladle.structured_output.limits import ConstraintTooLarge, GrammarLimits
from ladle.structured_output.sandbox import GrammarSandbox

# Past every bound, so the workers meet what the bounds normally refuse.
UNBOUNDED = GrammarLimits(max_depth=10**6, max_items=10**7, max_keys=10**7, max_nodes=10**8, max_choices=10**7,
                          max_chars=10**9)


def required(n: int) -> SO:
    """The hostile corpus's schema: `required` lists n names and no properties. llguidance 1.9 compiles 10,000
    in about a second, 25,000 in several, and overflows its stack at 30,000 (SIGSEGV)."""
    return SO(json={"type": "object", "required": [f"r{i:06d}" for i in range(n)]})


def nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("spec, bound", [
    (required(30_000), "1024 in one array"),
    (required(100_000), "1024 in one array"),
    (SO(json=nested(10_000)), "deeper than 64 levels"),
    (SO(json={"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(500)}}),
     "256 in one object"),
    (SO(json={"anyOf": [{"properties": {f"p{i}": {"type": "integer"} for i in range(100)}}] * 1000}),
     "more than 100000 values"),
    (SO(choice=[f"c{i}" for i in range(2_100)]), "at most 1024"),
    (SO(regex="a" * (2 << 20)), "at most 1048576"),
])
def test_a_constraint_past_a_bound_is_refused_at_once_naming_it(spec, bound):
    """At once: submit raises itself, before the sandbox (and so any worker, any native code) sees the spec."""
    checker = GrammarChecker()
    reached: list[object] = []
    checker.sandbox.submit = lambda *args, **kwargs: reached.append(args)  # type: ignore[method-assign]
    with pytest.raises(ConstraintTooLarge) as e:
        checker.submit(spec)
    assert bound in str(e.value) and not reached
    assert e.value.field == f"structured_outputs.{spec.kind}"
    checker.shutdown()


def test_a_schema_that_crashes_the_compiler_fails_its_request_and_the_next_one_compiles():
    checker = GrammarChecker(UNBOUNDED, workers=1)
    with pytest.raises(InvalidStructuredOutput, match=r"crashed on this constraint \(killed by SIG"):
        checker.check(required(30_000))
    assert checker.sandbox.num_crashes == 1
    assert '"type":"integer"' in checker.check(SO(json={"type": "integer"})).replace(" ", "")
    checker.shutdown()


def test_a_compile_past_its_timeout_is_killed_and_its_request_refused():
    checker = GrammarChecker(UNBOUNDED, workers=1, timeout_s=0.5)
    with pytest.raises(InvalidStructuredOutput, match="did not compile within 0.5 s"):
        checker.submit(required(25_000)).result(timeout=120)  # a generous bound: it must never hang
    killed = list(checker.sandbox._workers)  # the worker that ran the compile, killed at its timeout
    assert checker.sandbox.num_timeouts == 1
    assert [w.proc.returncode for w in killed] == [-signal.SIGKILL]
    # A new worker compiles the next constraint. Its 0.5 s would also time its start-up (imports, seconds on a
    # busy machine): what is checked here is that one is there, not how fast it starts.
    checker.sandbox.timeout_s = 60.0
    assert checker.submit(SO(regex="a+")).result(timeout=120)
    assert [w.proc.pid for w in checker.sandbox._workers] != [w.proc.pid for w in killed]
    checker.shutdown()


def test_the_compilers_own_errors_still_name_the_field():
    checker = GrammarChecker()
    with pytest.raises(InvalidStructuredOutput) as e:
        checker.check(SO(regex="("))
    assert e.value.field == "structured_outputs.regex" and "unclosed group" in e.value.message
    assert checker.sandbox.num_crashes == 0
    checker.shutdown()


def test_compile_slots_take_the_clients_in_turn():
    """One slot; a client queues three compiles that each run to the timeout, another one quick compile: the
    quick one runs second, not fourth."""
    sandbox = GrammarSandbox(workers=1, timeout_s=1.0)
    finished: list[str] = []
    slow = [sandbox.submit(required(25_000), client="greedy") for _ in range(3)]
    quick = sandbox.submit(SO(regex="b+"), client="other")
    for name, f in [("slow0", slow[0]), ("slow1", slow[1]), ("slow2", slow[2]), ("quick", quick)]:
        f.add_done_callback(lambda _, name=name: finished.append(name))
    assert quick.result(timeout=30)
    for f in slow:
        with pytest.raises(InvalidStructuredOutput):
            f.result(timeout=30)
    assert finished.index("quick") == 1, finished
    sandbox.shutdown()


def test_a_full_queue_is_refused_at_once():
    from ladle.structured_output.sandbox import SandboxBusy

    sandbox = GrammarSandbox(workers=1, timeout_s=1.0, max_queued=2)
    futures = [sandbox.submit(required(25_000), client="a") for _ in range(3)]  # one running, two queued
    time.sleep(0.2)
    with pytest.raises(SandboxBusy):
        for _ in range(3):
            futures.append(sandbox.submit(SO(regex="a"), client="b"))
    sandbox.shutdown()


def test_passing_constraints_are_remembered():
    checker = GrammarChecker()
    spec = SO(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    first = checker.check(spec)
    again = SO(json='{"type": "object", "properties": {"a": {"type": "integer"}}}')
    assert checker.submit(spec).done() and checker.check(spec) == first
    assert checker.check(again)  # the same schema as text: compiled (its key differs), and as valid
    checker.shutdown()
