"""How each released agent CLI is pointed at `ladle serve` and run for one non-interactive turn, as the README's
"Coding agents" section tells a user: its environment and config files in a scratch HOME, nothing else of the
machine's. Each run is bounded in time; a client that overruns is killed with its process group."""
from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

MODEL = "ladle-test"  # the served model name the tests start ladle serve with
API_KEY = "x"  # ladle serve runs without --api-key here; the clients insist on sending one


@dataclass(frozen=True)
class Run:
    returncode: int | None  # None: killed at its time limit
    stdout: str
    stderr: str


def _environment(home: Path, extra: dict[str, str]) -> dict[str, str]:
    home.mkdir(parents=True, exist_ok=True)
    return {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8", "NO_COLOR": "1", **extra}


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> Run:
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return Run(proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the CLIs start helpers (Codex's sandbox, OpenCode's server)
        out, err = proc.communicate()
        return Run(None, out, err)


def claude(exe: Path, home: Path, workdir: Path, base_url: str, prompt: str, timeout: float,
           resume: bool = False) -> Run:
    """`claude -p` with its JSON result: the Anthropic Messages API at ANTHROPIC_BASE_URL, no traffic of its own.
    resume: go on with the last session in workdir (`--continue`), its history resent before the prompt."""
    env = _environment(home, {"ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": API_KEY,
                              "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
                              "DISABLE_AUTOUPDATER": "1"})
    return _run([str(exe), "-p", prompt, "--output-format", "json", "--model", MODEL, *(["--continue"] * resume)],
                workdir, env, timeout)


def codex(exe: Path, home: Path, workdir: Path, base_url: str, prompt: str, timeout: float) -> Run:
    """`codex exec --json`: a model provider speaking the Responses API, its key from LADLE_API_KEY, read-only
    sandbox (exec's default), no retries (an error is the test's answer, not a reason to wait)."""
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    (home / ".codex" / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "ladle"\n\n[model_providers.ladle]\nname = "ladle"\n'
        f'base_url = "{base_url}/v1"\nwire_api = "responses"\nenv_key = "LADLE_API_KEY"\n'
        "request_max_retries = 0\nstream_max_retries = 0\n")
    env = _environment(home, {"LADLE_API_KEY": API_KEY})
    return _run([str(exe), "exec", "--json", "--skip-git-repo-check", prompt], workdir, env, timeout)


def opencode(exe: Path, home: Path, workdir: Path, base_url: str, prompt: str, timeout: float) -> Run:
    """`opencode run --format json`: a provider of the OpenAI-compatible kind (Chat Completions) in opencode.json."""
    config = home / ".config" / "opencode" / "opencode.json"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json",
        "provider": {"ladle": {"npm": "@ai-sdk/openai-compatible", "name": "ladle",
                               "options": {"baseURL": f"{base_url}/v1", "apiKey": API_KEY},
                               "models": {MODEL: {"name": MODEL}}}},
        "model": f"ladle/{MODEL}", "autoupdate": False, "share": "disabled"}, indent=1))
    env = _environment(home, {"OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1"})
    return _run([str(exe), "run", "--pure", "--format", "json", "--model", f"ladle/{MODEL}", prompt], workdir, env,
                timeout)
