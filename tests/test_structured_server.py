"""Structured outputs through the server with the official openai client: response_format (json_schema and
json_object), vLLM's structured_outputs and its older guided_* fields, streamed and not, n > 1; every field
either enforced or answered with a 400 that names it, including a grammar the engine finds it cannot run."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from server_harness import ServerProcess, assert_error_envelope, openai_client, served_model
from structured_corpus import SCHEMAS

pytestmark = [pytest.mark.server, pytest.mark.slow]

MESSAGES = [{"role": "user", "content": "Give me the record as JSON."}]


@pytest.fixture(scope="module")
def server(tiny_qwen3_dir, tmp_path_factory):
    srv = ServerProcess(tiny_qwen3_dir, tmp_path_factory.mktemp("structured"), "--max-model-len", "2048",
                        "--max-num-batched-tokens", "64").start()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


model = served_model


@pytest.mark.parametrize("stream", [False, True])
def test_chat_response_format_json_schema_validates(client, stream):
    for schema in (SCHEMAS[0], SCHEMAS[5], SCHEMAS[19]):
        fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": schema, "strict": True}}
        kw = dict(model=model(client), messages=MESSAGES, max_tokens=400, response_format=fmt, n=2,
                  temperature=0.8, seed=5)
        if stream:
            texts, finish = ["", ""], [None, None]
            for chunk in client.chat.completions.create(stream=True, **kw):
                for ch in chunk.choices:
                    texts[ch.index] += ch.delta.content or ""
                    finish[ch.index] = ch.finish_reason or finish[ch.index]
        else:
            r = client.chat.completions.create(**kw)
            texts = [c.message.content for c in r.choices]
            finish = [c.finish_reason for c in r.choices]
        assert finish == ["stop", "stop"]
        for text in texts:
            jsonschema.validate(json.loads(text), schema)


def test_completions_take_structured_outputs_and_guided_fields(client):
    m = model(client)
    regex = r"[a-z]{2,4}-[0-9]{1,3}"
    r = client.completions.create(model=m, prompt="id:", max_tokens=20, temperature=0,
                                  extra_body={"structured_outputs": {"regex": regex}})
    assert re.fullmatch(regex, r.choices[0].text) and r.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in client.completions.create(
        model=m, prompt="pick:", max_tokens=20, stream=True, extra_body={"structured_outputs": {
            "choice": ["alpha", "beta gamma"]}}) if c.choices]
    assert "".join(pieces) in ("alpha", "beta gamma")
    r = client.completions.create(model=m, prompt="json:", max_tokens=300, temperature=0,
                                  extra_body={"guided_json": SCHEMAS[1]})
    assert json.loads(r.choices[0].text) in SCHEMAS[1]["enum"]
    r = client.chat.completions.create(model=m, messages=MESSAGES, max_tokens=40, temperature=0,
                                       response_format={"type": "json_object"},
                                       extra_body={"structured_outputs": None})
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


BAD = [
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "unclosed group"),
    ({"structured_outputs": {"json": "{bad"}}, "structured_outputs.json", "not valid JSON"),
    ({"structured_outputs": {"regex": "a", "choice": ["x"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regx": "a"}}, "structured_outputs", "structured_outputs.regx: this server does not serve"),
    ({"logit_bias": {"1": 2}}, "logit_bias", "does not serve"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "not supported"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema", "Invalid type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema", "needs"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format.json_schema.schema", "uniqueItems"),
    ({"response_format": {"type": "json_object"}, "guided_json": {}}, "guided_json", "set one"),
    ({"guided_decoding_backend": "xgrammar", "guided_regex": "a"}, "guided_decoding_backend", "llguidance"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "guided_json"),
    ({"guided_grammar": "start: nothing_here"}, "guided_grammar", "unknown name"),
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_unsupported_or_malformed_fields_are_400s_naming_them(server, path):
    base = {"messages": MESSAGES} if "chat" in path else {"prompt": "hi"}
    for extra, param, words in BAD:
        err = assert_error_envelope(server.post(path, {**base, "max_tokens": 4, **extra}), 400, param=param)
        assert words is None or words in err["message"], err
    assert server.health()[0] == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_the_engine_cannot_start_is_a_400_not_a_500(server, stream):
    """The regex parses but matches no text at all, which only a compile with the vocabulary finds out: the
    grammar sandbox does that compile before the request is queued, so a stream too is a 400 before its head."""
    body = {"prompt": "hi", "max_tokens": 4, "stream": stream,
            "structured_outputs": {"regex": "[^\\x00-\\x{10FFFF}]"}}
    r = server.post("/v1/completions", body)
    assert_error_envelope(r, 400, code="invalid_value")
    ok = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 4})
    assert ok.status_code == 200
