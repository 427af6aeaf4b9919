"""Unexpected errors in the server: a 500 (or an error event mid-stream) that names no exception text, only an
id to find it in the log. In-process, no engine: the routes below are added for the test."""
from __future__ import annotations

import asyncio
import json
import logging

from fastapi.testclient import TestClient

from ladle.entrypoints.openai.app import ServerState, build_app
from ladle.entrypoints.openai.serving_engine import SSE_DONE, ServingContext, _guarded
from ladle.entrypoints.openai.tokenizer_pool import TokenizerPool

SECRET = "/home/alice/secret-path: token 0xdeadbeef"


def test_a_500_hides_the_exception_and_logs_it_under_an_id(caplog):
    ctx = ServingContext(client=None, tokenizer=None, pool=TokenizerPool(None), metrics=None, model_name="m")
    app = build_app(ServerState(ctx))

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError(SECRET)

    with caplog.at_level(logging.ERROR, logger="ladle.server"):
        r = TestClient(app, raise_server_exceptions=False).get("/boom")
    assert r.status_code == 500
    err = r.json()["error"]
    assert SECRET not in r.text and err["code"] == "internal_error" and err["type"] == "server_error"
    error_id = err["message"].split("under id ")[1]
    assert any(error_id in rec.getMessage() and SECRET in str(rec.exc_info[1]) for rec in caplog.records)


class _Stream:
    request_id = "cmpl-test"
    aborted = False

    def abort(self, reason: str = "abort") -> None:
        self.aborted = True


def test_an_error_mid_stream_becomes_an_error_event_then_done():
    async def events():
        yield "data: {}\n\n"
        raise KeyError(SECRET)

    async def collect() -> list[str]:
        return [e async for e in _guarded(stream, events())]

    stream = _Stream()
    out = asyncio.run(collect())
    assert out[0] == "data: {}\n\n" and out[-1] == SSE_DONE and stream.aborted
    err = json.loads(out[1].removeprefix("data: "))["error"]
    assert err["code"] == "internal_error" and SECRET not in out[1]
