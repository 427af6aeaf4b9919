"""The released agent CLIs against `ladle serve`, as shipped (Claude Code, Codex and OpenCode at the versions
tests/agent_clients/install.py pins, installed from the npm registry): their recorded first requests replayed
verbatim (a 200 and the start of the stream), and each client run for real, in a loopback-only network namespace
with the server, for a plain turn and for a turn whose tool call the client runs and answers. The server is a tiny
random-weight Qwen3 in Qwen3's chat format whose replies end after a few tokens (tests/agent_clients/quiet_model.py);
a proxy between client and server forces the tool call (tests/agent_clients/forcing_proxy.py)."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from agent_clients import clients
from agent_clients.cache_reads import cached_and_computed, is_conversation, system_and_tools_tokens
from agent_clients.forcing_proxy import Force, ForcingProxy
from agent_clients.install import PINS, install
from agent_clients.netns import loopback_only, only_loopback_reachable
from agent_clients.quiet_model import make_quiet
from agent_clients.recorded import recorded_requests
from ladle.testing.tool_checkpoints import build_tool_checkpoint
from server_harness import ServerProcess

pytestmark = [pytest.mark.server, pytest.mark.slow]

# Claude Code's first request is ~47K tokens of the test tokenizer (a 518-token byte-level BPE: ~1.6 characters a
# token), with max_tokens 32000 as recorded; later turns add the tool result and the replies.
MAX_MODEL_LEN = 131072
RUN_TIMEOUT = 240  # seconds for one client turn, all its requests included
NOTE = "ladle agent client note: 7f3a"  # what a forced read or cat returns to the client, and it sends back

RUNNERS: dict[str, Callable[..., clients.Run]] = {"claude": clients.claude, "codex": clients.codex,
                                                   "opencode": clients.opencode}


def forced_tool(client: str, workdir: Path) -> Force:
    """A call each client runs in non-interactive mode without asking: a file read (Claude Code's Read and
    OpenCode's read are allowed by default), a command that only reads (Codex's exec_command, in exec's
    read-only sandbox)."""
    note = str(workdir / "note.txt")
    return {"claude": Force("Read", {"file_path": note}), "codex": Force("exec_command", {"cmd": "cat note.txt"}),
            "opencode": Force("read", {"filePath": note})}[client]


@pytest.fixture(scope="module")
def executables() -> dict[str, Path]:
    return install()  # before the namespace: it reaches the npm registry


@pytest.fixture(scope="module")
def loopback(executables: dict[str, Path]) -> Iterator[None]:
    """This module's server, proxies and clients in a loopback-only network namespace (installing first)."""
    with loopback_only():
        assert only_loopback_reachable()
        yield


@pytest.fixture(scope="module")
def server(loopback: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = build_tool_checkpoint(tmp_path_factory.mktemp("agent_qwen3"), "qwen3", seed=2,
                                  max_position_embeddings=MAX_MODEL_LEN, tie_word_embeddings=False)
    make_quiet(model)
    srv = ServerProcess(model, tmp_path_factory.mktemp("agent_logs"), "--max-model-len", str(MAX_MODEL_LEN),
                        "--served-model-name", clients.MODEL).start(timeout=180)
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture
def proxied(server: ServerProcess) -> Iterator[Callable[[Force | None], tuple[ForcingProxy, str]]]:
    started: list[ForcingProxy] = []

    def start(force: Force | None) -> tuple[ForcingProxy, str]:
        proxy = ForcingProxy(server.base_url, (force,) if force is not None else ())
        started.append(proxy)
        return proxy, proxy.start()

    yield start
    for proxy in started:
        proxy.stop()


# Replays ------------------------------------------------------------------------------------------------------

FIRST_EVENT = {"/v1/messages": "message_start", "/v1/responses": "response.created",
               "/v1/chat/completions": "chat.completion.chunk"}
_NOT_FORWARDED = {"host", "content-length", "connection", "accept-encoding"}


@pytest.mark.parametrize("recorded", sorted(recorded_requests()))
def test_a_recorded_first_request_is_served(recorded: str, server: ServerProcess) -> None:
    """The body and headers as the client sent them (its beta flags, its metadata): a 200 and a stream that
    starts as the API's does. The stream is closed after its first event; the server aborts the rest."""
    req = recorded_requests()[recorded]
    headers = {k: v for k, v in req["headers"].items() if k.lower() not in _NOT_FORWARDED}
    path = req["path"].split("?")[0]
    with httpx.stream(req["method"], server.base_url + req["path"], content=json.dumps(req["body"]),
                      headers=headers, timeout=300) as r:
        assert r.status_code == 200, r.read().decode()[:2000]
        first = next(json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:"))
    assert (first.get("type") or first.get("object")) == FIRST_EVENT[path], first


# Live clients -------------------------------------------------------------------------------------------------


def check_served(proxy: ForcingProxy, run: clients.Run) -> None:
    assert proxy.seen, f"the client sent nothing\n{run.stdout}\n{run.stderr}"
    bad = [(s.path, s.status) for s in proxy.seen if s.status != 200]
    assert not bad, f"{bad}\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"


def client_reported_no_error(client: str, run: clients.Run) -> None:
    """Each client's own account of the turn: Claude Code's JSON result, Codex's and OpenCode's JSON events."""
    if client == "claude":
        result = json.loads(run.stdout)
        assert result["is_error"] is False and result["subtype"] == "success", result
        return
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert events, run.stdout
    errors = [e for e in events if "error" in str(e.get("type", "")) or e.get("type") == "turn.failed"]
    assert not errors, errors
    if client == "codex":
        assert any(e.get("type") == "turn.completed" for e in events), events


def tool_results(body: dict[str, Any]) -> list[str]:
    """The text of every tool result a request carries, whatever its API."""
    out = []
    for m in body.get("messages") or []:  # Anthropic's tool_result blocks; Chat Completions' tool messages
        if m.get("role") == "tool":
            out.append(json.dumps(m.get("content")))
        for block in m.get("content") if isinstance(m.get("content"), list) else []:
            if isinstance(block, dict) and block.get("type") == "tool_result":
                out.append(json.dumps(block.get("content")))
    for item in body.get("input") if isinstance(body.get("input"), list) else []:
        if item.get("type") == "function_call_output":
            out.append(json.dumps(item.get("output")))
    return out


@pytest.mark.clients
@pytest.mark.parametrize("client", sorted(PINS))
def test_a_plain_turn_completes(client: str, executables: dict[str, Path], proxied, tmp_path: Path) -> None:
    proxy, url = proxied(None)
    (tmp_path / "work").mkdir()
    run = RUNNERS[client](executables[client], tmp_path / "home", tmp_path / "work", url, "say hi", RUN_TIMEOUT)
    check_served(proxy, run)
    client_reported_no_error(client, run)


@pytest.mark.clients
@pytest.mark.parametrize("client", sorted(PINS))
def test_a_tool_call_is_run_and_its_result_sent_back(client: str, executables: dict[str, Path], proxied,
                                                     tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "note.txt").write_text(NOTE + "\n")
    proxy, url = proxied(forced_tool(client, work))
    run = RUNNERS[client](executables[client], tmp_path / "home", work, url, "read note.txt", RUN_TIMEOUT)
    check_served(proxy, run)
    forced = proxy.forced()
    assert forced is not None, [s.path for s in proxy.seen]
    later = [r for s in proxy.seen[forced + 1:] for r in tool_results(s.body)]
    assert any(NOTE in r for r in later), (later, run.stdout[-4000:])
    client_reported_no_error(client, run)


@pytest.mark.clients
def test_claude_codes_next_session_reads_its_system_prompt_and_tools_from_the_cache(
        executables: dict[str, Path], proxied, server: ServerProcess, tmp_path: Path) -> None:
    """A new session resends the same ~20K-token system prompt and tools (the billing line that changes between
    sessions is kept out of the prompt): the prefix cache serves at least 90% of it, as Claude Code's own JSON
    usage reports."""
    (tmp_path / "work").mkdir()
    runs = []
    for _ in range(2):
        proxy, url = proxied(None)
        run = clients.claude(executables["claude"], tmp_path / "home", tmp_path / "work", url, "say hi", RUN_TIMEOUT)
        check_served(proxy, run)
        runs.append((proxy, run))
    proxy, run = runs[1]
    first = next(s for s in proxy.seen if is_conversation(s))
    shared = system_and_tools_tokens(server.base_url, first.body)
    cached, _ = cached_and_computed(first)
    assert cached >= 0.9 * shared > 10_000, (cached, shared)
    assert json.loads(run.stdout)["usage"]["cache_read_input_tokens"] >= cached
