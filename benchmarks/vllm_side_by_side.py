"""ladle beside vLLM's CPU build: the same random checkpoint, the same token-id workload, each engine in a
fresh process timed around `generate` alone (and its startup), in float32 and bfloat16, and whether their
greedy tokens agree.

vLLM lives in its own virtual environment (nothing in ladle imports it); make it once with
benchmarks/setup_vllm.sh, then:

    python benchmarks/vllm_side_by_side.py --vllm-python /work/vllm-venv/bin/python
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import build_model, model_facts, save  # noqa: E402

from ladle.entrypoints.bench import random_workload  # noqa: E402

HERE = Path(__file__).resolve().parent


def run_worker(python: str, engine: str, model: str, dtype: str, workload: Path) -> dict[str, Any]:
    out = subprocess.run([python, str(HERE / "peer_worker.py"), "--engine", engine, "--model", model,
                          "--dtype", dtype, "--workload", str(workload)], capture_output=True, text=True,
                         timeout=3600)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"{engine} {dtype} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-name", default="qwen3-768")
    ap.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--input-len", type=int, nargs=2, default=[64, 1024])
    ap.add_argument("--output-len", type=int, nargs=2, default=[32, 128])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default="vllm_side_by_side")
    args = ap.parse_args()
    model_dir = build_model(args.model_name)
    work = random_workload(args.num_prompts, tuple(args.input_len), tuple(args.output_len),
                           model_facts(model_dir)["vocab_size"], seed=0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "workload.json"
        path.write_text(json.dumps({"prompts": work.prompts, "output_lens": work.output_lens}))
        for dtype in args.dtypes:
            runs: dict[str, list[dict[str, Any]]] = {"ladle": [], "vllm": []}
            for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits both
                runs["ladle"].append(run_worker(sys.executable, "ladle", model_dir, dtype, path))
                runs["vllm"].append(run_worker(args.vllm_python, "vllm", model_dir, dtype, path))
            med = {e: statistics.median(r["generate_s"] for r in rs) for e, rs in runs.items()}
            same = sum(a == b for a, b in zip(runs["ladle"][0]["tokens"], runs["vllm"][0]["tokens"]))
            row = {"dtype": dtype, "ladle_generate_s": med["ladle"], "vllm_generate_s": med["vllm"],
                   "ladle_over_vllm_speed": round(med["vllm"] / med["ladle"], 3),
                   "ladle_startup_s": statistics.median(r["startup_s"] for r in runs["ladle"]),
                   "vllm_startup_s": statistics.median(r["startup_s"] for r in runs["vllm"]),
                   "greedy_requests_identical": f"{same}/{len(work.prompts)}",
                   "generate_s_per_repeat": {e: [r["generate_s"] for r in rs] for e, rs in runs.items()}}
            print(row, flush=True)
            rows.append(row)
    version = subprocess.run([args.vllm_python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True).stdout.strip()
    save(args.out, {"benchmark": "vllm_side_by_side", "model": args.model_name, "vllm_version": version,
                    "model_config": model_facts(model_dir), "workload": {
                        "num_prompts": args.num_prompts, "input_len": args.input_len,
                        "output_len": args.output_len, "prompt_tokens": work.num_prompt_tokens,
                        "output_tokens": work.num_output_tokens}, "rows": rows})


if __name__ == "__main__":
    main()
