"""The settings and paths the GPU build adds, checked on CPU: dummy weights, CUDA-graph settings and their
memory reserve in the plan, and the model runner's decode-graph path (run eagerly on CPU, same padding)."""
import os
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is decorated (see test_triton_kernels.py)

from ladle import LLM, SamplingParams
from ladle.startup.planner import MiB, PlanInputs, plan_memory
from ladle.startup.profiling import ActivationModel
from ladle.runner.cuda_graphs import DecodeGraphs
from ladle.runner.mixed_graphs import MixedGraphs

pytestmark = [pytest.mark.slow]

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts(n: int, seed: int = 0, longest: int = 39) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(500) for _ in range(rng.randrange(3, longest + 1))]}
            for _ in range(n)]


def test_dummy_load_format_needs_only_a_config(tiny_qwen3_dir: str, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(Path(tiny_qwen3_dir, "config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        src = Path(tiny_qwen3_dir, name)
        if src.exists():
            (tmp_path / name).write_text(src.read_text())
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        LLM(str(tmp_path))
    runs = [LLM(str(tmp_path), load_format="dummy", seed=s) for s in (0, 0, 1)]
    assert runs[0].config.settings["load_format"].value == "dummy"
    outs = [[o.outputs[0].token_ids for o in llm.generate(prompts(3), GREEDY, use_tqdm=False)] for llm in runs]
    assert outs[0] == outs[1]  # the seed fixes the weights
    norms = [p for n, p in runs[2].engine.core.model_executor.runner.model.named_parameters() if n.endswith("norm.weight")]
    assert norms and all(bool((p == 1).all()) for p in norms)
    weights = dict(runs[0].engine.core.model_executor.runner.model.named_parameters())
    other = dict(runs[2].engine.core.model_executor.runner.model.named_parameters())
    embed = "model.embed_tokens.weight"  # the linear layers' weights are packed for oneDNN on CPU (no parameter)
    assert abs(float(weights[embed].std()) - 0.02) < 0.005 and not torch.equal(weights[embed], other[embed])


def test_cuda_graph_settings_on_cpu(tiny_qwen3_dir: str) -> None:
    llm = LLM(tiny_qwen3_dir, max_num_batched_tokens=64)
    setting = llm.config.settings["max_cudagraph_capture_size"]
    assert (setting.value, setting.source) == (0, "derived") and "cpu" in setting.reason
    assert llm.config.plan.inputs.graph_bytes == 0 and llm.engine.core.model_executor.runner.graphs is None
    with pytest.raises(ValueError, match="max_cudagraph_capture_size=8 needs CUDA graphs"):
        LLM(tiny_qwen3_dir, max_cudagraph_capture_size=8)
    with pytest.raises(ValueError, match="must be a positive integer"):
        LLM(tiny_qwen3_dir, max_cudagraph_capture_size=0)
    with pytest.raises(ValueError, match="load_format='pt'"):
        LLM(tiny_qwen3_dir, load_format="pt")
    mode = llm.config.settings["cudagraph_mode"]
    assert (mode.value, mode.source) == ("NONE", "derived")
    with pytest.raises(ValueError, match="cudagraph_mode=FULL needs CUDA graphs"):
        LLM(tiny_qwen3_dir, cudagraph_mode="FULL")
    with pytest.raises(ValueError, match="cudagraph_mode='PIECEWISE': choose one of FULL, FULL_DECODE_ONLY"):
        LLM(tiny_qwen3_dir, cudagraph_mode="PIECEWISE")
    with pytest.raises(ValueError, match="cudagraph_mode needs CUDA graphs, which enforce_eager disables"):
        LLM(tiny_qwen3_dir, cudagraph_mode="FULL_DECODE_ONLY", enforce_eager=True)


def test_plan_reserves_graph_memory() -> None:
    activation = ActivationModel((1 * MiB, 1024.0, 0.0, 0.0), (1 * MiB, 1024.0), 1024, 256, ())
    common = dict(budget=1024 * MiB, budget_reason="test", weights=10 * MiB, kv_bytes_per_token=1024, block_size=16,
                  model_max_len=4096, max_num_seqs=256, on_cpu=False, activation=activation)
    plans = [plan_memory(PlanInputs(**common, graph_bytes=g), {}, lambda n, v, r: v) for g in (0, 64 * MiB)]
    block_bytes = 1024 * 16
    assert plans[0].num_kv_blocks - plans[1].num_kv_blocks == 64 * MiB // block_bytes
    assert any(line.startswith("cuda graphs") for line in plans[1].lines())
    assert not any(line.startswith("cuda graphs") for line in plans[0].lines())
    with pytest.raises(ValueError, match="num_kv_blocks"):
        plan_memory(PlanInputs(**common, graph_bytes=64 * MiB), {"num_kv_blocks": plans[0].num_kv_blocks},
                    lambda n, v, r: v)


def test_runner_decode_graph_path_gives_identical_tokens(tiny_qwen3_dir: str) -> None:
    """The runner sends decode-only steps through DecodeGraphs (eager replay of the padded buffers on CPU),
    with async scheduling on:
    batches of 1..5 decodes pad up to 1/2/4/8 rows, and the tokens equal the plain path's. Padding rows
    (slot -1, context 0) are the Triton kernels' contract, so attention and the fused ops run here in
    Triton's interpreter: everything the CUDA engine runs except the capture itself."""
    pytest.importorskip("triton", reason="triton is not installed (the 'test' extra installs it)")
    from ladle.attention.triton_backend import TritonAttention
    from ladle.models.layers.ops import TritonOps, set_ops

    # The interpreter is slow (each kernel runs program by program in Python): few steps, and prompts of at most
    # 12 tokens under a 16-token step budget, so they still prefill over several steps and finish apart.
    batch = prompts(5, seed=7, longest=12)
    short = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = LLM(tiny_qwen3_dir, max_num_batched_tokens=16)
    want = [o.outputs[0].token_ids for o in plain.generate(batch, short, use_tqdm=False)]
    # Built (and profiled) before the interpreter is in; async scheduling feeds most steps' input tokens to
    # the graph buffers straight from the previous step's device tensor.
    llm = LLM(tiny_qwen3_dir, max_num_batched_tokens=16, async_scheduling=True)
    runner = llm.engine.core.model_executor.runner
    # The whole CUDA code path but capture: the Triton backend and fused ops, run by the interpreter.
    set_ops(runner.model, TritonOps())
    runner.groups = tuple(replace(g, backend=TritonAttention()) for g in runner.groups)
    graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.block_size, llm.config.max_model_len, 8,
                          runner.device, runner.groups)
    used: list[int] = []
    real_run = graphs.run

    def counting_run(chunks, *rest):
        used.append(len(chunks))
        return real_run(chunks, *rest)

    graphs.run = counting_run
    runner.graphs = graphs
    got = [o.outputs[0].token_ids for o in llm.generate(batch, short, use_tqdm=False)]
    assert got == want
    assert used and max(used) == 5 and set(used) - {5}  # ran full and partly finished batches
    assert llm.stats.steps_ahead >= 3
    assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_blocks



@pytest.mark.parametrize("window", [None, 6])
def test_runner_mixed_graph_path_gives_identical_tokens(tiny_qwen3_dir: str, tmp_path: Path,
                                                         window: int | None) -> None:
    """Steps with a prefill chunk go through MixedGraphs (eager replay of the padded buffers on CPU, in
    Triton's interpreter as above): prompts prefilled in chunks beside decodes pad up to a token size, the
    padding one more request that writes no KV, and the tokens equal the plain path's; with a sliding window
    (a Mistral) the window reaches the graph's attention."""
    pytest.importorskip("triton", reason="triton is not installed (the 'test' extra installs it)")
    from ladle.attention.triton_backend import TritonAttention
    from ladle.demo import build_checkpoint
    from ladle.models.layers.ops import TritonOps, set_ops

    path = tiny_qwen3_dir
    if window is not None:
        path = build_checkpoint(tmp_path / "mistral", "mistral", vocab_size=512, hidden_size=64,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                intermediate_size=128, max_position_embeddings=4096, sliding_window=window,
                                seed=2)
    # Short prompts (the interpreter is slow) under a 24-token budget: a full first step pads to the 32 graph,
    # the rest of the prompts beside the first decodes to 16.
    batch = prompts(4, seed=9, longest=12)
    short = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    plain = LLM(path, max_num_batched_tokens=24)
    want = [o.outputs[0].token_ids for o in plain.generate(batch, short, use_tqdm=False)]
    llm = LLM(path, max_num_batched_tokens=24)
    runner = llm.engine.core.model_executor.runner
    set_ops(runner.model, TritonOps())
    runner.groups = tuple(replace(g, backend=TritonAttention()) for g in runner.groups)
    mixed = MixedGraphs(runner.model, runner.kv_caches, runner.block_size, llm.config.max_model_len, 32,
                        llm.config.max_num_seqs, runner.device, runner.groups)
    assert mixed.sizes == (16, 32) and mixed.bucket(17) == 32
    used: list[tuple[int, int]] = []
    real_run = mixed.run

    def counting_run(step, *rest):
        used.append((len(step.token_ids), len(step)))
        return real_run(step, *rest)

    mixed.run = counting_run
    runner.mixed_graphs = mixed
    got = [o.outputs[0].token_ids for o in llm.generate(batch, short, use_tqdm=False)]
    assert got == want
    assert any(t not in mixed.sizes for t, _ in used)  # padded steps
    assert any(n > 1 for _, n in used)  # a chunk beside other requests
    assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_blocks


def test_both_graph_classes_serve_a_model_with_two_kv_groups(tmp_path: Path) -> None:
    """A Qwen3 with layer 0 full and layer 1 windowed keeps two KV groups in one pool: decode-only and mixed
    steps go through DecodeGraphs and MixedGraphs (eager replay on CPU, Triton's interpreter as above) with
    each group's own slots, table and window, and the tokens equal the plain path's."""
    pytest.importorskip("triton", reason="triton is not installed (the 'test' extra installs it)")
    from ladle.attention.triton_backend import TritonAttention
    from ladle.demo import build_checkpoint
    from ladle.models.layers.ops import TritonOps, set_ops

    path = build_checkpoint(tmp_path / "qwen3sw", "qwen3", vocab_size=512, hidden_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                            use_sliding_window=True, sliding_window=6, max_window_layers=1,
                            max_position_embeddings=4096, seed=5)
    batch = prompts(4, seed=11, longest=12)  # longer than the window; short, as the interpreter is slow
    short = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    plain = LLM(path, max_num_batched_tokens=16)
    want = [o.outputs[0].token_ids for o in plain.generate(batch, short, use_tqdm=False)]
    llm = LLM(path, max_num_batched_tokens=16)
    runner = llm.engine.core.model_executor.runner
    assert [g.window for g in runner.groups] == [None, 6]
    set_ops(runner.model, TritonOps())
    runner.groups = tuple(replace(g, backend=TritonAttention()) for g in runner.groups)
    decode = DecodeGraphs(runner.model, runner.kv_caches, runner.block_size, llm.config.max_model_len, 8,
                          runner.device, runner.groups, runner.buffers)
    mixed = MixedGraphs(runner.model, runner.kv_caches, runner.block_size, llm.config.max_model_len, 32,
                        llm.config.max_num_seqs, runner.device, runner.groups, runner.buffers)
    used = {"decode": 0, "mixed": 0}
    for name, graphs in (("decode", decode), ("mixed", mixed)):
        def counting_run(step, *rest, _run=graphs.run, _name=name):
            used[_name] += 1
            return _run(step, *rest)

        graphs.run = counting_run
    runner.graphs, runner.mixed_graphs = decode, mixed
    got = [o.outputs[0].token_ids for o in llm.generate(batch, short, use_tqdm=False)]
    assert got == want
    assert used["decode"] and used["mixed"], used
    assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_blocks
