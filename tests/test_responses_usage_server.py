"""Usage and reasoning through /v1/responses on a random-weight checkpoint in Qwen3.5's chat format, whose
template opens the thinking block: reasoning_tokens are the generated tokens of the thinking (all of them when
the budget ends inside it), reasoning.effort none closes the block (no thinking, none counted), a grade the
template has no control for is counted on /metrics (chat's reasoning_effort too), and a forced
call to a custom tool held to a Lark grammar is a 400 naming the tool in a format that writes its input as raw
text (qwen3_coder)."""
from __future__ import annotations

import pytest

from ladle.entrypoints.openai.field_policy import CHAT_EFFORT, RESPONSES_EFFORT
from ladle.testing.tool_checkpoints import build_tool_checkpoint
from server_harness import ServerProcess, assert_error_envelope, metric, openai_client, served_model

pytestmark = [pytest.mark.server, pytest.mark.slow]

LINES = {"type": "custom", "name": "edit", "format": {"type": "grammar", "syntax": "lark",
                                                      "definition": 'start: "+" /[a-z]{1,8}/ "\\n"'}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = build_tool_checkpoint(tmp_path_factory.mktemp("qwen3_5_usage"), "qwen3_5", seed=3)
    srv = ServerProcess(model, tmp_path_factory.mktemp("usage"), "--max-model-len", "2048", "--tool-call-parser",
                        "qwen3_coder", "--reasoning-parser", "qwen3").start()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_cut_off_by_the_budget_is_all_reasoning_tokens(client, stream):
    kw = dict(model=served_model(client), input="Think it through.", max_output_tokens=24, temperature=0)
    r = list(client.responses.create(stream=True, **kw))[-1].response if stream else client.responses.create(**kw)
    assert r.status == "incomplete" and [item.type for item in r.output] == ["reasoning"], r.output
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == 24


def test_effort_none_closes_the_thinking_block(client):
    r = client.responses.create(model=served_model(client), input="Answer at once.", max_output_tokens=24,
                                temperature=0, reasoning={"effort": "none"})
    assert "reasoning" not in [item.type for item in r.output], r.output
    assert r.usage.output_tokens_details.reasoning_tokens == 0 and r.usage.output_tokens > 0


def test_a_grade_the_template_has_no_control_for_is_counted(server, client):
    """Qwen3.5's template has a thinking switch only: none turns it off (honoured), high thinks at the one grade
    (counted as taken without effect), in both APIs."""
    m, before = served_model(client), server.metrics()
    for effort in ("none", "high"):
        client.responses.create(model=m, input="hi", max_output_tokens=2, reasoning={"effort": effort})
        client.chat.completions.create(model=m, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       reasoning_effort=effort)
    after = server.metrics()
    for api, field in (("responses", RESPONSES_EFFORT), ("chat_completions", CHAT_EFFORT)):
        assert metric(after, "ladle:no_op_fields_total", api=api, field=field) == metric(
            before, "ladle:no_op_fields_total", api=api, field=field) + 1, (api, field)


def test_a_lark_grammar_cannot_be_forced_in_a_raw_text_format(server, client):
    body = {"model": served_model(client), "input": "Edit.", "tools": [LINES],
            "tool_choice": {"type": "custom", "name": "edit"}}
    err = assert_error_envelope(server.post("/v1/responses", body), 400, param="tools")
    assert "tool 'edit': its input is held to a Lark grammar" in err["message"], err
    auto = server.post("/v1/responses", {**body, "tool_choice": "auto", "max_output_tokens": 4})
    assert auto.status_code == 200, auto.text  # offered, not forced: the model may call it as it writes
