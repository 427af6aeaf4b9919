"""An agent's conversation, turn by turn, with prefix caching on and off: TTFT and prompt tokens computed per turn.

Workload (token ids, so every model sees the same shape): a ~4K-token system prompt with tool descriptions,
then 10 turns; each turn resends the whole conversation with the model's last reply (its own generated tokens)
and 300-1,500 tokens of new tool output appended, and decodes a short reply. Caching on, a turn should compute
only what is new (the reply and the tool output, plus less than a block), and its TTFT should stay flat as the
conversation grows; caching off, every turn recomputes everything. Three tiny random-weight models (fp32, CPU):
Qwen3 (attention only), Qwen3.5 (Gated DeltaNet + attention: hits resume from state checkpoints) and
DeepSeek-V4 (sliding window + compressed KV + compressor state). vLLM's CPU build runs the same conversation on
Qwen3 in the same run (it serves neither of the other two on CPU); make its environment once with
benchmarks/setup_vllm.sh. Every (engine, model, caching) runs in a fresh process (benchmarks/agent_turns_worker.py).

    python benchmarks/agent_turns.py --out benchmarks/results/agent_turns.json
    python benchmarks/agent_turns.py --turns 4 --system 1000 --vllm-python ''   # quick, ladle only
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ladle.demo import build_checkpoint  # noqa: E402

WORKER = Path(__file__).resolve().parent / "agent_turns_worker.py"
VLLM_MODELS = ("qwen3",)  # what vLLM's CPU build serves of MODELS

SW, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
MODELS = {
    "qwen3": dict(arch="qwen3", hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, intermediate_size=512),
    "qwen3_5": dict(arch="qwen3_5", hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, intermediate_size=512,
                    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                    linear_value_head_dim=64),
    "deepseek_v4": dict(arch="deepseek_v4", hidden_size=256, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=1, head_dim=64, intermediate_size=512, moe_intermediate_size=128,
                        q_lora_rank=128, num_experts_per_tok=2, n_routed_experts=4, hc_mult=2, o_groups=2,
                        o_lora_rank=64, index_n_heads=4, index_head_dim=32, index_topk=64,
                        layer_types=[SW, CSA, HCA], mlp_layer_types=["hash_moe", "moe", "moe"], sliding_window=128,
                        compress_rates={CSA: 4, HCA: 128}),
}


def conversation(turns: int, system: int, vocab: int, seed: int) -> tuple[list[int], list[list[int]]]:
    """The system prompt and each turn's new tool output (300-1,500 tokens)."""
    rng = random.Random(seed)
    return ([rng.randrange(vocab) for _ in range(system)],
            [[rng.randrange(vocab) for _ in range(rng.randrange(300, 1501))] for _ in range(turns)])


def run_worker(python: str, engine: str, model: Path, caching: str, workload: Path) -> dict[str, Any]:
    out = subprocess.run([python, str(WORKER), "--engine", engine, "--model", str(model), "--caching", caching,
                          "--workload", str(workload)], capture_output=True, text=True, timeout=7200)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"{engine} caching {caching} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--system", type=int, default=4000, help="system prompt + tools text, tokens")
    ap.add_argument("--reply", type=int, default=64, help="tokens the model replies each turn")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--vllm-python", default="/work/vllm-venv/bin/python", help="'' to leave vLLM out")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    results: dict = {"machine": platform.processor() or platform.machine(), "turns": args.turns,
                     "system": args.system, "reply": args.reply, "models": {}, "vllm": {}}
    with tempfile.TemporaryDirectory() as tmp:
        system, tools = conversation(args.turns, args.system, 500, seed=7)
        workload = Path(tmp) / "workload.json"
        workload.write_text(json.dumps({"system": system, "tools": tools, "reply": args.reply}))
        for name in args.models.split(","):
            spec = dict(MODELS[name])
            path = build_checkpoint(Path(tmp) / name, spec.pop("arch"), max_position_embeddings=32768, seed=1,
                                    **spec)
            engines = [("ladle", sys.executable, results["models"])]
            if args.vllm_python and name in VLLM_MODELS:
                engines.append(("vllm", args.vllm_python, results["vllm"]))
            for caching in ("on", "off"):
                replies = {}
                for engine, python, into in engines:  # interleaved, so drift on a shared machine hits both
                    run = run_worker(python, engine, path, caching, workload)
                    into.setdefault(name, {})[caching] = run["rows"]
                    replies[engine] = run["replies"]
                    for r in run["rows"]:
                        print(f"{engine:5} {name:12} caching {caching:3} turn {r['turn']:2} prompt {r['prompt']:6} "
                              f"new {r['new']:5} computed {r['computed']:6} ttft {r['ttft_s'] * 1000:8.1f} ms",
                              flush=True)
                if "vllm" in replies:
                    same = sum(a == b for a, b in zip(replies["ladle"], replies["vllm"]))
                    results["vllm"][name][f"replies_identical_{caching}"] = f"{same}/{len(replies['ladle'])}"
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
