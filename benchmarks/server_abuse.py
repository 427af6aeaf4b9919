"""The server against abusive clients: what each abuse costs the API process (status, seconds to answer, RSS)
and whether the engine process survives it. Run it on this tree, and with --python on an older checkout for
the same run's peer (a venv that sees the old tree first and this venv's packages, but not the editable
install of this tree, whose import hook would win over any path):

    python benchmarks/server_abuse.py --out benchmarks/results/server_abuse_new.json
    git worktree add /tmp/ladle-old 9a0cdd2 && python3 -m venv /tmp/oldvenv && \
      printf '/tmp/ladle-old\n%s\n' "$(python -c 'import site; print(site.getsitepackages()[0])')" \
        > /tmp/oldvenv/lib/python3.11/site-packages/peer.pth && \
      python benchmarks/server_abuse.py --python /tmp/oldvenv/bin/python --out benchmarks/results/server_abuse_old.json
    python benchmarks/server_abuse.py --compare benchmarks/results/server_abuse_old.json \
      benchmarks/results/server_abuse_new.json --out benchmarks/results/server_abuse.md

The model is the tiny benchmark checkpoint; sizes are the issue's (hostile values, 10 and 50 MB bodies, a
prompt of about 4 MB, 500 prompts x n=128).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import build_model  # noqa: E402
from serve_sweep import free_port, wait_healthy  # noqa: E402

HOSTILE = [
    '{"prompt":"hi","max_tokens":4,"repetition_penalty":5e-324}',
    '{"prompt":"hi","max_tokens":4,"top_p":5e-324,"temperature":1.0}',
    '{"prompt":"hi","max_tokens":4,"top_p":1e-46,"temperature":1.0}',
    '{"prompt":[-1]}', '{"prompt":[18446744073709551616]}', '{"prompt":"\\ud800 hi"}',
    '{"prompt":"hi","temperature":Infinity}',
]


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    return int(Path(f"/proc/{pid}/status").read_text().split(f"{field}:")[1].split()[0]) / 1024


def timed_post(url: str, body: bytes, timeout: float = 300) -> tuple[int, float]:
    start = time.perf_counter()
    try:
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=timeout)
        status = r.status_code
    except httpx.HTTPError as e:
        status = type(e).__name__
    return status, time.perf_counter() - start


def engine_pid(base: str) -> int | None:
    try:
        return httpx.get(base + "/health", timeout=30).json().get("engine_pid")
    except httpx.HTTPError:
        return None


def health_gaps(base: str, stop: threading.Event, out: list[float]) -> None:
    """The latency of /health polled back to back while a big request runs."""
    while not stop.is_set():
        start = time.perf_counter()
        try:
            httpx.get(base + "/health", timeout=60)
        except httpx.HTTPError:
            pass
        out.append(time.perf_counter() - start)
        time.sleep(0.05)


def compare(old_path: str, new_path: str) -> str:
    """The two runs side by side, as the markdown section BENCHMARKS.md includes."""
    old, new = (json.loads(Path(p).read_text())["rows"] for p in (old_path, new_path))
    lines = ["## Server under abuse", "",
             "`python benchmarks/server_abuse.py` (commands in its docstring), on the tiny checkpoint: the server "
             "before the hardening (commit 9a0cdd2) and after it, one after the other on this machine. RSS is the "
             "API process's; the engine runs in its own process.", "",
             "| case | before: status | s | API RSS MiB | after: status | s | API RSS MiB |", "|---|---|---|---|---|---|---|"]
    for a, b in zip(old, new):
        lines.append(f"| {a['case']} | {a['status']} | {a['seconds']} | {a['api_rss_mib']} | {b['status']} | "
                     f"{b['seconds']} | {b['api_rss_mib']} |")
    last_a, last_b = old[-1], new[-1]
    health_a, health_b = old[-2]["max_health_s"], new[-2]["max_health_s"]
    lines += ["", f"Peak API RSS: {last_a['api_peak_rss_mib']} MiB before, {last_b['api_peak_rss_mib']} MiB after. "
              f"Slowest /health while the 4 MB prompt was tokenized: {health_a} s before, {health_b} s after. "
              f"Engine process unchanged through it all: {bool(last_a['engine_pid_unchanged'])} before, "
              f"{bool(last_b['engine_pid_unchanged'])} after.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=sys.executable, help="the interpreter that runs the server")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="write the table of two runs")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.compare:
        Path(args.out).write_text(compare(*args.compare))
        return
    model = build_model("tiny")
    port = free_port()
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    cmd = [args.python, "-m", "ladle.entrypoints.openai.api_server", "--model", model, "--port", str(port),
           "--num-kv-blocks", "512", "--max-num-batched-tokens", "512", "--max-model-len", "4096"]
    # From a neutral directory: `python -m` puts the working directory first on sys.path.
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd="/")
    base = f"http://127.0.0.1:{port}"
    rows: list[dict] = []
    try:
        wait_healthy(port, proc, 180)
        pid0 = engine_pid(base)
        # The API process answers /health; proc is `ladle serve`'s outer process where one exists.
        api = httpx.get(base + "/health", timeout=30).json().get("api_pid", proc.pid)

        def row(case: str, status: int | str, seconds: float, **extra: float) -> None:
            rows.append({"case": case, "status": status, "seconds": round(seconds, 3),
                         "api_rss_mib": round(rss_mib(api), 1), **extra})
            print(rows[-1], flush=True)

        row("idle", 200, 0.0)
        statuses = []
        start = time.perf_counter()
        for _ in range(5):
            for body in HOSTILE:
                statuses.append(timed_post(base + "/v1/completions", body.encode())[0])
        row("hostile values x5", "/".join(sorted({str(s) for s in statuses})), time.perf_counter() - start,
            engine_restarts=float(httpx.get(base + "/health", timeout=120).json().get("engine_restarts", -1)))
        fanout = json.dumps({"prompt": [f"p{i}" for i in range(500)], "n": 128, "max_tokens": 1}).encode()
        row("500 prompts x n=128", *timed_post(base + "/v1/completions", fanout))
        for mb in (10, 50):
            body = json.dumps({"prompt": "hello world " * (mb * 2**20 // 12), "max_tokens": 2}).encode()
            row(f"{mb} MB prompt", *timed_post(base + "/v1/completions", body))
        gaps: list[float] = []
        stop = threading.Event()
        poller = threading.Thread(target=health_gaps, args=(base, stop, gaps))
        body = json.dumps({"prompt": "hello world " * (4 * 2**20 // 12 - 8), "max_tokens": 2}).encode()
        poller.start()
        status, seconds = timed_post(base + "/v1/completions", body)
        stop.set()
        poller.join()
        row("4 MB prompt", status, seconds, max_health_s=round(max(gaps), 3))
        row("after all", 200, 0.0, api_peak_rss_mib=round(rss_mib(api, "VmHWM"), 1),
            engine_pid_unchanged=float(engine_pid(base) == pid0))
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    source = subprocess.run([args.python, "-c", "import ladle; print(ladle.__file__)"], capture_output=True,
                            text=True, cwd="/").stdout.strip()
    Path(args.out).write_text(json.dumps({"ladle": source, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
