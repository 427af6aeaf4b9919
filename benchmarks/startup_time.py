"""Startup time: `ladle plan` to its exit and `ladle serve` to its first healthy /health, on the demo model, the
first start with an empty profile cache and the next ones with it. With --python, the same for an older
checkout (see server_abuse.py for making such a venv), as the same run's peer:

    python benchmarks/startup_time.py --out benchmarks/results/startup_new.json
    python benchmarks/startup_time.py --python /tmp/oldvenv/bin/python --out benchmarks/results/startup_old.json
    python benchmarks/startup_time.py --compare benchmarks/results/startup_old.json \
      benchmarks/results/startup_new.json --out benchmarks/results/startup.md
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_sweep import free_port, wait_healthy  # noqa: E402


def time_plan(python: str, model: str, env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([python, "-m", "ladle.entrypoints.cli", "plan", "--model", model], env=env, cwd="/",
                   check=True, capture_output=True)
    return time.perf_counter() - start


def time_serve(python: str, model: str, env: dict[str, str]) -> float:
    port = free_port()
    proc = subprocess.Popen([python, "-m", "ladle.entrypoints.cli", "serve", "--model", model, "--port", str(port)],
                            env=env, cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return wait_healthy(port, proc, 600, poll_s=0.05)
    finally:
        proc.terminate()
        proc.wait(60)


def measure(python: str, model: str, repeats: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for command, timer in (("plan", time_plan), ("serve", time_serve)):
        with tempfile.TemporaryDirectory() as cache:  # the first start finds no profile
            env = dict(os.environ, LADLE_PROFILE_CACHE_DIR=cache, TOKENIZERS_PARALLELISM="false")
            out[command] = [round(timer(python, model, env), 2) for _ in range(1 + repeats)]
            print(command, out[command], flush=True)
    return out


def compare(old_path: str, new_path: str) -> str:
    old, new = (json.loads(Path(p).read_text()) for p in (old_path, new_path))
    lines = ["## Startup time", "",
             "`python benchmarks/startup_time.py` (commands in its docstring): seconds from launch to `ladle plan`'s "
             "exit and to `ladle serve`'s first healthy `/health`, on the demo model (20 MiB), with an empty "
             "profile cache and then again (median of the later starts), before this wave's startup work and "
             "after it, one after the other on this machine.", "",
             "| command | before: first | before: next | after: first | after: next | after: next / first |",
             "|---|---|---|---|---|---|"]
    for command in ("plan", "serve"):
        a, b = old["times"][command], new["times"][command]
        a_next, b_next = statistics.median(a[1:]), statistics.median(b[1:])
        lines.append(f"| {command} | {a[0]:.1f} | {a_next:.1f} | {b[0]:.1f} | {b_next:.1f} | {b_next / b[0]:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=sys.executable, help="the interpreter whose ladle is measured")
    ap.add_argument("--model", default=None, help="default: the demo model, built into a temp dir")
    ap.add_argument("--repeats", type=int, default=3, help="starts after the first (default 3)")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.compare:
        Path(args.out).write_text(compare(*args.compare))
        return
    model = args.model
    if model is None:
        from ladle.demo import build_demo_model

        model = str(Path(tempfile.gettempdir()) / "ladle-startup-demo")
        if not (Path(model) / "config.json").exists():
            build_demo_model(model)
    times = measure(args.python, model, args.repeats)
    Path(args.out).write_text(json.dumps({"python": args.python, "model": model, "times": times}, indent=1))


if __name__ == "__main__":
    main()
