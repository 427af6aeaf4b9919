"""The released agent CLIs the client tests run, pinned, installed from the npm registry into .deps/agents (which git
ignores): `python3 tests/agent_clients/install.py`. CI runs it before the tests; the tests run it themselves where a
client is missing, so the README's test command works on a fresh machine with npm. An install that fails, or no
npm, is an error: the tests never skip a client."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

# client -> (npm package, version): the versions the recorded requests in tests/fixtures/agent_requests come from
PINS: dict[str, tuple[str, str]] = {
    "claude": ("@anthropic-ai/claude-code", "2.1.197"),
    "codex": ("@openai/codex", "0.171.0"),
    "opencode": ("opencode-ai", "1.18.33"),
}
PREFIX = Path(__file__).resolve().parents[2] / ".deps" / "agents"
_ATTEMPTS = 2  # the registry is the network: one retry for a dropped download


def installed(prefix: Path = PREFIX) -> dict[str, Path] | None:
    """Each client's executable where every pinned version is installed under prefix; None otherwise."""
    out = {}
    for client, (package, version) in PINS.items():
        manifest = prefix / "node_modules" / package / "package.json"
        exe = prefix / "node_modules" / ".bin" / client
        if not manifest.is_file() or json.loads(manifest.read_text()).get("version") != version or not exe.exists():
            return None
        out[client] = exe
    return out


def install(prefix: Path = PREFIX) -> dict[str, Path]:
    """The clients' executables, installed first where needed (npm's postinstall scripts put each native binary in
    place; their optional per-platform packages carry it)."""
    found = installed(prefix)
    if found is not None:
        return found
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("the agent client tests need npm (Node.js 18 or later) to install "
                           + ", ".join(f"{p}@{v}" for p, v in PINS.values()))
    prefix.mkdir(parents=True, exist_ok=True)
    cmd = [npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "--no-progress", "--loglevel=error",
           *(f"{p}@{v}" for p, v in PINS.values())]
    for attempt in range(_ATTEMPTS):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if done.returncode == 0:
            break
        if attempt == _ATTEMPTS - 1:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    found = installed(prefix)
    if found is None:
        raise RuntimeError(f"npm installed into {prefix}, but not every pinned client is there: {PINS}")
    return found


if __name__ == "__main__":
    for name, exe in install(Path(sys.argv[1]) if len(sys.argv) > 1 else PREFIX).items():
        print(f"{name}: {exe}")
