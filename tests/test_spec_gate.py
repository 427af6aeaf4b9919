"""The speculation gate: drafts only while their measured acceptance pays for the tokens they add."""
from __future__ import annotations

import pytest

from ladle.engine.speculation.gate import PROBE_EVERY, SpecGate, expected_accepted


def _fitted(ms_per_token: float, base_ms: float = 20.0) -> SpecGate:
    gate = SpecGate()
    for i in range(40):  # decode-only steps of 1 and 6 tokens
        tokens = 1 if i % 2 else 6
        gate.record_step(tokens, base_ms + ms_per_token * tokens)
    return gate


def test_the_cost_fit_needs_two_step_sizes_and_recovers_a_line():
    gate = SpecGate()
    for _ in range(20):
        gate.record_step(4, 30.0)
    assert gate.cost() is None
    a, b = _fitted(2.0).cost()
    assert abs(a - 20.0) < 1e-6 and abs(b - 2.0) < 1e-6


def test_drafts_that_are_never_accepted_stop_being_drafted_but_are_probed_ever_more_rarely():
    gate = _fitted(4.0)
    for _ in range(30):
        gate.record("r", 5, 0)
    allowed = [gate.allows("r", 5, rows=1) for _ in range(7 * PROBE_EVERY)]
    probes = [i for i, n in enumerate(allowed) if n]
    assert probes == [PROBE_EVERY - 1, 3 * PROBE_EVERY - 1, 7 * PROBE_EVERY - 1]  # backing off: 16, 32, 64
    assert {allowed[i] for i in probes} == {1}  # one draft: the cheapest test of acceptance
    for _ in range(30):
        gate.record("r", 1, 1)  # the probes start to be accepted: drafts come back, the backoff resets
    assert gate.allows("r", 5, rows=1) == 5 and gate._rates["r"].backoff == PROBE_EVERY


def test_accepted_drafts_are_drafted_and_a_new_request_starts_from_the_engine_wide_rate():
    gate = _fitted(4.0)
    for _ in range(30):
        gate.record("good", 5, 5)
    assert gate.allows("good", 5, rows=1) == 5
    assert gate.rate("new") > 0.8  # the engine has seen drafts accepted
    # Where a token costs as much as a plain step's share, only near-certain drafts pay.
    costly = _fitted(50.0, base_ms=0.0)
    for _ in range(30):
        costly.record("half", 4, 1)
    assert costly.allows("half", 4, rows=1) == 0


def test_expected_accepted_is_the_geometric_sum():
    assert expected_accepted(0.5, 3) == 0.5 + 0.25 + 0.125
    assert expected_accepted(1.0, 4) == 4


def test_a_step_drafts_while_drafting_is_the_faster_arm_and_explores_the_other():
    from ladle.engine.speculation.arms import EXPLORE_EVERY, StepArms

    arms = StepArms()
    assert arms.drafts_now(16)  # drafts first
    for _ in range(4):
        arms.record(16, True, 96, 240.0)  # every draft accepted, but 6x the tokens cost 6x the time and more
    assert not arms.drafts_now(16)  # the plain arm must be seen before any comparison
    for _ in range(4):
        arms.record(16, False, 16, 38.0)
    choices = [arms.drafts_now(16) for _ in range(2 * EXPLORE_EVERY)]
    assert choices.index(True) == EXPLORE_EVERY - 1 and choices.count(True) == 1  # plain is faster: explore
    assert not arms.settled_plain(16)
    # Each exploration the drafts lose doubles the interval to the next: 64, 128, 256, then 512 at most.
    choices += [arms.drafts_now(16) for _ in range(4000)]
    explored = [i for i, c in enumerate(choices) if c]
    assert [b - a for a, b in zip(explored, explored[1:])][:5] == [64, 128, 256, 512, 512]
    assert arms.settled_plain(16) and not arms.settled_plain(1)
    assert arms.rates(16) == pytest.approx((16 / 38.0, 96 / 240.0)) and arms.rates(1) is None
    for _ in range(4):
        arms.record(1, True, 6, 25.0)
        arms.record(1, False, 1, 20.0)
    assert sum(arms.drafts_now(1) for _ in range(EXPLORE_EVERY)) == EXPLORE_EVERY - 1  # batch 1: drafts pay
