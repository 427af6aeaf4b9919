"""One bounded device run: checks the Triton kernels on the GPU, times ladle, runs the seed-A scenario and
the HF transformers peer, prints a short table and writes results.json. See benchmarks/GPU.md.

Weights are random, built in place on the device (no checkpoint, no download): throughput does not depend
on weight values, and every generation ignores EOS so lengths are exact.
    python benchmarks/gpu_h200.py --out "$OUT"            # H200, about 8 minutes
    python benchmarks/gpu_h200.py --dry-run --out /tmp/b  # tiny shapes on CPU, checks the control flow
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the device machine has no network; fail fast, never hang
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a bare checkout there has ladle uninstalled

import torch  # noqa: E402

from gpu_checks import engine_vs_hf, ops_check  # noqa: E402
from gpu_experts import expert_tiering_check  # noqa: E402
from gpu_engine import decode_batch1, generate, peak, prefill_speed, prompts, set_async  # noqa: E402
from gpu_quant import fp8_check  # noqa: E402
from gpu_structured import structured_check  # noqa: E402
from gpu_kernels import decode_graphs, kernel_check, kernel_speed, mixed_graphs, sync  # noqa: E402
from gpu_gguf import gguf_check  # noqa: E402
from gpu_host_tier import host_tier_check  # noqa: E402
from gpu_prefix import prefix_checkpoint_check  # noqa: E402
from gpu_spec import spec_decode_check  # noqa: E402
from gpu_table import table  # noqa: E402
from gpu_tp import tensor_parallel  # noqa: E402

GiB = 2**30
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128)
QWEN3_14B = dict(vocab_size=151936, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                 num_attention_heads=40, num_key_value_heads=8, head_dim=128)
# Same head grouping as the real shapes (4 and 5 query heads per KV head), small enough for a CPU.
TINY_8B = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=8, num_key_value_heads=2, head_dim=16)
TINY_14B = dict(TINY_8B, num_attention_heads=10)


@dataclass(frozen=True)
class Sizes:
    decode_prompt: int = 128
    decode_new: int = 256
    prefill_prompt: int = 16384
    prefill_chunks: tuple[int, ...] = (2048, 8192)
    long_prompt: int = 131072
    long_new: int = 4
    offline_in: int = 1000
    offline_out: int = 1000
    offline_requests: int = 1024
    offline_seconds: float = 150.0
    seed_requests: int = 16
    seed_prompt: int = 3338
    seed_budget: int = 1024
    seed_new: int = 20
    seed_context: int = 40960  # Qwen3-14B's; start-up profiles activations up to it
    hf_batch1: tuple[int, int] = (128, 256)  # prompt, new tokens
    hf_batch64: tuple[int, int] = (1000, 256)
    hf_batch: int = 64
    graph_context: int = 512
    graph_batches: tuple[int, ...] = (1, 64)
    mixed_steps: tuple[tuple[int, int], ...] = ((1, 15), (16, 48), (32, 96), (64, 192))  # (decodes, chunk)


DRY = Sizes(decode_prompt=16, decode_new=8, prefill_prompt=256, prefill_chunks=(64, 128), long_prompt=1024,
            long_new=2, offline_in=32, offline_out=8, offline_requests=6, offline_seconds=60.0, seed_requests=4,
            seed_prompt=100, seed_budget=64, seed_new=3, seed_context=512, hf_batch1=(16, 8), hf_batch64=(32, 8),
            hf_batch=4, graph_context=40, graph_batches=(1, 3), mixed_steps=((3, 9),))


class Run:
    """Results and the time budget: a section runs only if its estimate fits in what is left, and a section
    that fails is recorded with its error, so one bad section never loses the others."""

    def __init__(self, budget_s: float, out_dir: Path, device: torch.device, only: tuple[str, ...] = (),
                 merge: dict[str, Any] | None = None) -> None:
        self.start, self.budget, self.out_dir, self.device = time.perf_counter(), budget_s, out_dir, device
        self.only = only  # section-name prefixes to run (a rerun of what failed); empty: all
        # merge: an earlier run's results, whose sections this run keeps unless it runs them again
        self.results: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                                        "torch": torch.__version__, "sections": dict((merge or {}).get("sections", {}))}
        out_dir.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.start)

    def section(self, name: str, estimate_s: float, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        if self.only and not any(name.startswith(p) for p in self.only):
            return None
        if self.left() < estimate_s:
            self.results["sections"][name] = {"skipped": f"needs ~{estimate_s:.0f}s, {self.left():.0f}s left"}
            print(f"[skip] {name}", flush=True)
            return None
        print(f"[run ] {name} ({self.left():.0f}s left)", flush=True)
        t0 = time.perf_counter()
        try:
            res = fn()
        except Exception as e:  # noqa: BLE001 - record and go on: the other sections still count
            res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
            print(res["traceback"], file=sys.stderr, flush=True)
        res["section_s"] = round(time.perf_counter() - t0, 1)
        self.results["sections"][name] = res
        (self.out_dir / "results.json").write_text(json.dumps(self.results, indent=1, default=str))
        return res


def qwen3_config(shape: dict[str, int], max_len: int) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**shape, max_position_embeddings=max_len, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                       architectures=["Qwen3ForCausalLM"], eos_token_id=shape["vocab_size"] - 1)


def build_engine(config: Any, workdir: Path, device: torch.device, **engine_kwargs: Any) -> Any:
    """An EngineCore on random weights (load_format="dummy": the directory holds only config.json), so
    start-up, memory planning, profiling and graph capture run exactly as for a real checkpoint."""
    from ladle.config.engine_args import EngineArgs
    from ladle.engine.core import EngineCore

    path = workdir / f"model-{config.num_hidden_layers}x{config.hidden_size}"
    config.save_pretrained(path)
    args, explicit = EngineArgs.from_kwargs(model=str(path), device=str(device), load_format="dummy",
                                            **engine_kwargs)
    return EngineCore(args, explicit)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def ladle_8b(run: Run, a: argparse.Namespace, s: Sizes, shape: dict, workdir: Path, ids: itertools.count) -> None:
    # Context past 128K so a 131,072-token prompt plus its new tokens is admitted on the default settings.
    config = qwen3_config(shape, s.long_prompt + 2048)
    vocab, box = config.vocab_size, {}

    def start() -> dict:
        t0, graph_error = time.perf_counter(), None
        try:
            core = build_engine(config, workdir, run.device)
        except Exception as e:  # noqa: BLE001 - a failed graph capture must not cost every 8B section
            graph_error = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
            print(graph_error, file=sys.stderr, flush=True)
            free(run.device)
            core = build_engine(config, workdir, run.device, enforce_eager=True)
        box["core"] = core
        built = time.perf_counter() - t0
        generate(core, prompts(2, 16, vocab, 1), 4, ids)  # warm-up at small shapes
        c = core.config
        return dict(startup_s=round(built, 1), max_model_len=c.max_model_len, max_num_seqs=c.max_num_seqs,
                    max_num_batched_tokens=c.max_num_batched_tokens, num_kv_blocks=c.num_kv_blocks,
                    cudagraph_capture_size=c.max_cudagraph_capture_size, cudagraph_mode=c.cudagraph_mode,
                    graph_memory_gib=round(core.model_executor.graph_memory_bytes / GiB, 3),
                    plan_graph_memory_gib=round(c.plan.inputs.graph_bytes / GiB, 3), graph_error=graph_error,
                    plan=c.plan.lines())

    run.section("ladle_8b_startup", 60, start)
    core = box.pop("core", None)
    if core is None:
        return
    run.section("ladle_8b_decode_batch1", 25, lambda: decode_batch1(core, s.decode_prompt, s.decode_new, vocab, ids,
                                                                    box))
    run.section("ladle_8b_decode_cuda_graphs", 30, lambda: decode_graphs(core, s.graph_context, s.graph_batches))
    run.section("ladle_8b_mixed_cuda_graphs", 30, lambda: mixed_graphs(core, s.graph_context, s.mixed_steps))
    for chunk in s.prefill_chunks:
        run.section(f"ladle_8b_prefill_chunk{chunk}", 15, lambda c=chunk: prefill_speed(core, s.prefill_prompt, c,
                                                                                        a.peak_tflops))
    run.section("ladle_8b_prompt_131k", 45,
                lambda: peak(core, lambda: generate(core, prompts(1, s.long_prompt, vocab, 3), s.long_new, ids)))

    def offline() -> dict:
        seconds = min(s.offline_seconds, run.left() - a.reserve_s)
        set_async(core, bool(box.get("async_ok")))  # only once batch-1 showed the same tokens both ways
        res = generate(core, prompts(s.offline_requests, s.offline_in, vocab, 4), s.offline_out, ids,
                       time.perf_counter() + seconds)
        set_async(core, False)
        return dict(res, time_limit_s=round(seconds, 1))

    run.section("ladle_8b_offline_1000x1000", 40, offline)


def seed_a(run: Run, s: Sizes, shape: dict, workdir: Path, ids: itertools.count) -> dict:
    """Seed report 000: 16 x 3,338-token prompts at a 1,024-token step budget must complete."""
    core = build_engine(qwen3_config(shape, s.seed_context), workdir, run.device,
                        max_num_batched_tokens=s.seed_budget)
    res = peak(core, lambda: generate(core, prompts(s.seed_requests, s.seed_prompt, core.hf_config.vocab_size, 5),
                                      s.seed_new, ids))
    return dict(res, completed=res["finished"] == s.seed_requests, budget=s.seed_budget)


def hf_peer(run: Run, s: Sizes, shape: dict) -> None:
    """HF transformers generate (SDPA attention, its default cache) on the same shape and device."""
    from transformers import AutoModelForCausalLM

    device = run.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = qwen3_config(shape, 40960)
    box: dict[str, Any] = {}

    def build() -> dict:
        t0 = time.perf_counter()
        with torch.device(device):
            box["m"] = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
        return dict(build_s=round(time.perf_counter() - t0, 1))

    def gen(batch: int, plen: int, new: int) -> dict:
        model = box["m"]
        ids = torch.tensor(prompts(batch, plen, config.vocab_size, 6), device=device)
        kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
        times = []
        with torch.inference_mode():
            for n in (1, new):  # one token alone gives the prefill time to subtract
                sync(device)
                t0 = time.perf_counter()
                out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
                sync(device)
                times.append(time.perf_counter() - t0)
        assert out.shape[1] == plen + new
        return dict(batch=batch, prompt=plen, new=new, prefill_s=round(times[0], 3), wall_s=round(times[1], 3),
                    output_tok_s=round(batch * new / times[1], 1),
                    decode_tok_s=round(batch * (new - 1) / max(1e-9, times[1] - times[0]), 1))

    if "error" in (run.section("hf_build", 30, build) or {"error": "skipped"}):
        return
    run.section("hf_batch1", 20, lambda: (gen(1, 8, 2), gen(1, *s.hf_batch1))[1])  # a tiny warm-up first
    run.section(f"hf_batch{s.hf_batch}", 40, lambda: gen(s.hf_batch, *s.hf_batch64))
    box.clear()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_results"), help="folder for results.json")
    ap.add_argument("--time-budget", type=float, default=450.0, help="seconds; sections that would overrun skip")
    ap.add_argument("--reserve-s", type=float, default=150.0, help="kept for seed-A and HF when sizing offline")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for MFU (H200 SXM)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU: checks the control flow")
    ap.add_argument("--only", default="", help="comma-separated section-name prefixes to run, e.g. ladle_8b,hf")
    ap.add_argument("--merge", default="", help="an earlier results.json whose other sections the output keeps")
    a = ap.parse_args(argv)
    if a.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported: the kernel check runs on CPU
        device, s, shape8, shape14 = torch.device("cpu"), DRY, TINY_8B, TINY_14B
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device; use --dry-run to check the script on CPU")
        device, s, shape8, shape14 = torch.device("cuda"), Sizes(), QWEN3_8B, QWEN3_14B
    merge = json.loads(Path(a.merge).read_text()) if a.merge else None
    run = Run(a.time_budget, Path(a.out), device, tuple(p for p in a.only.split(",") if p), merge)
    ids = itertools.count()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        run.section("kernel_check", 20, lambda: kernel_check(device, small=a.dry_run))
        run.section("ops_check", 10, lambda: ops_check(device, small=a.dry_run))
        run.section("fp8_check", 30, lambda: fp8_check(device, small=a.dry_run))
        run.section("engine_vs_hf", 120, lambda: engine_vs_hf(device, workdir, small=a.dry_run))
        run.section("structured_check", 30, lambda: structured_check(device, workdir, small=a.dry_run))
        free(device)  # the check sections' blocks, still reserved, would count against the engine's budget
        ladle_8b(run, a, s, shape8, workdir, ids)
        free(device)
        run.section("seed_a_14b", 60, lambda: seed_a(run, s, shape14, workdir, ids))
        free(device)
        hf_peer(run, s, shape8)
        free(device)
        run.section("tensor_parallel", 120, lambda: tensor_parallel(device, workdir, qwen3_config(shape8, 8192),
                                                                    small=a.dry_run))
        free(device)
        # After every goal's section, so it only takes time they left.
        run.section("expert_tiering", 90, lambda: expert_tiering_check(device, workdir, small=a.dry_run))
        free(device)
        run.section("spec_decode", 60, lambda: spec_decode_check(device, workdir, small=a.dry_run))
        free(device)
        run.section("prefix_checkpoints", 45, lambda: prefix_checkpoint_check(device, workdir, small=a.dry_run))
        free(device)
        run.section("host_tier", 60, lambda: host_tier_check(device, workdir, small=a.dry_run))
        free(device)
        run.section("gguf", 45, lambda: gguf_check(device, workdir, small=a.dry_run))
        free(device)
        if device.type == "cuda":  # tile-tuning data: last, so it only ever takes time nothing else needed
            run.section("kernel_speed", 30, lambda: kernel_speed(device))
    run.results["total_s"] = round(time.perf_counter() - run.start, 1)
    (run.out_dir / "results.json").write_text(json.dumps(run.results, indent=1, default=str))
    print(f"\n== ladle on {run.results['device']} ({run.results['total_s']} s) ==\n{table(run.results)}")
    print(f"results: {run.out_dir / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
