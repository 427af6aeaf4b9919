"""A stream silent for longer than the keepalive interval carries SSE comment lines, which every SSE parser skips,
and nothing else changes: the events in order, and closing the stream early runs its generator's cleanup (the
request is freed) even while an event is awaited."""
from __future__ import annotations

import asyncio

from ladle.entrypoints.openai.sse_keepalive import KEEPALIVE, with_keepalive


def test_silences_get_comment_lines_and_events_pass_in_order():
    async def events():
        yield "data: 1\n\n"
        await asyncio.sleep(0.35)  # a long prefill
        yield "data: 2\n\n"
        yield "data: 3\n\n"

    async def collect() -> list[str]:
        return [e async for e in with_keepalive(events(), interval=0.1)]

    out = asyncio.run(collect())
    assert [e for e in out if e != KEEPALIVE] == ["data: 1\n\n", "data: 2\n\n", "data: 3\n\n"]
    assert out[0] == "data: 1\n\n" and out[1] == KEEPALIVE  # the silence's timer is due before the event's
    assert KEEPALIVE.startswith(":") and KEEPALIVE.endswith("\n\n")  # an SSE comment, a whole block


def test_closing_while_an_event_is_awaited_runs_the_cleanup():
    cleaned = asyncio.Event()

    async def events():
        try:
            yield "data: 1\n\n"
            await asyncio.sleep(3600)  # never comes: the client hangs up first
            yield "data: 2\n\n"
        finally:
            cleaned.set()

    async def consume() -> list[str]:
        stream = with_keepalive(events(), interval=0.05)
        got = [await stream.__anext__(), await stream.__anext__()]  # the event, then a keepalive
        await stream.aclose()
        return got

    assert asyncio.run(consume()) == ["data: 1\n\n", KEEPALIVE]
    assert cleaned.is_set()


def test_an_error_in_the_events_reaches_the_caller():
    async def events():
        yield "data: 1\n\n"
        raise KeyError("boom")

    async def collect() -> list[str]:
        out = []
        try:
            async for e in with_keepalive(events(), interval=10):
                out.append(e)
        except KeyError:
            out.append("raised")
        return out

    assert asyncio.run(collect()) == ["data: 1\n\n", "raised"]
