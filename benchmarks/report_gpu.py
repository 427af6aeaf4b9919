"""The report section of the H200 device run (benchmarks/gpu_h200.py): the goals, and the run's own table once
results/gpu_h200.json exists."""
from __future__ import annotations

import json

from gpu_table import table as gpu_table  # the device script's own summary, so both always agree
from report_common import RESULTS, notes, table

GPU_GOALS = [
    ("batch-1 decode, Qwen3-8B shape", ">= 240 tok/s (82% of the ~293 tok/s bandwidth limit)",
     "ladle_8b_decode_batch1"),
    ("offline 1000 in / 1000 out", ">= 10,000 output tok/s", "ladle_8b_offline_1000x1000"),
    ("prefill MFU at chunk 8192", ">= 60%", "ladle_8b_prefill_chunk8192"),
    ("131,072-token prompt, default settings", "completes; activation peak <= 3 GiB", "ladle_8b_prompt_131k"),
    ("seed A on the Qwen3-14B shape", "completes; largest step <= 1024", "seed_a_14b"),
    ("steps with a prefill chunk (16-256 tokens beside decodes)", "graph replay faster than eager, same hidden "
     "states", "ladle_8b_mixed_cuda_graphs"),
    ("FP8 block GEMM at 1 and 16 rows (4096 x 4096)", "under bf16's time (half the bytes), error within bf16's",
     "fp8_check"),
    ("FP8 and MXFP4 grouped expert GEMMs", "the torch path's result within bf16 rounding", "fp8_check"),
    ("experts in host memory behind a 25% device cache", "greedy agreement with resident, decode and prefill ratios",
     "expert_tiering"),
    ("speculative decoding: n-gram (copying model), MTP (DeepSeek-V4)", "the plain run's tokens (fp32); batch-1 "
     "decode faster with drafts", "spec_decode"),
    ("prefix hits from state checkpoints (Qwen3.5, DeepSeek-V4)", "replies as without caching; TTFT under it",
     "prefix_checkpoints"),
]


def gpu_section() -> list[str]:
    """The H200 device run (issue 7): its table when results/gpu_h200.json exists, else what will run."""
    lines = ["## GPU: the H200 device run", "",
             "One bounded script, `python benchmarks/gpu_h200.py --out \"$OUT\"` (about 8 minutes on an H200; "
             "`--dry-run` checks it on CPU), documented section by section in `benchmarks/GPU.md`. It checks the "
             "Triton kernels and the whole CUDA engine against HF transformers, then times ladle on a Qwen3-8B "
             "shape and seed A on a Qwen3-14B shape, with HF transformers `generate` (batch 1 and 64) as the peer "
             "in the same run. Goals:", ""]
    lines += table(["measurement", "goal", "section"], [[a, b, f"`{c}`"] for a, b, c in GPU_GOALS]) + [""]
    path = RESULTS / "gpu_h200.json"
    if not path.exists():
        return lines + ["**Not measured yet.** No session has had the device machine long enough to run it "
                        "(see the history in `benchmarks/GPU.md`); the numbers will be placed here, with the "
                        "HF peer from the same run, by copying `$OUT/results.json` to "
                        "`benchmarks/results/gpu_h200.json` and rerunning this report.", ""]
    r = json.loads(path.read_text())
    return lines + [f"Measured on {r['device']}, torch {r['torch']}, {r.get('total_s')} s in all:", "", "```",
                    gpu_table(r), "```", ""] + notes("gpu_h200")
