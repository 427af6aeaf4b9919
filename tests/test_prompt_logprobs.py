"""SamplingParams.prompt_logprobs (vLLM's): None for the first prompt token, then each prompt token's logprob, rank
and the top k, equal to HF transformers' log_softmax of its logits (fp32, CPU); the same for every chunk size
(KV carried over), with the prefix cache skipped for the request's own prompt, under preemption and for n > 1;
the head runs over bounded row slices, so a step's activation peak stays within the plan's."""
import random

import pytest
import torch

from ladle import LLM, SamplingParams
from ladle.sampling_params import InvalidSamplingParam
from ladle.startup.memory import measure_peak

K = 4


def _prompts(lens: list[int], seed: int, vocab: int = 500) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lens]


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@torch.inference_mode()
def _hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """HF's log_softmax over the vocabulary at each prompt position but the last, [len(prompt) - 1, vocab]: row
    p - 1 is the distribution of prompt token p."""
    logits = model(input_ids=torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def _assert_like_hf(entries: list, prompt: list[int], ref: torch.Tensor, k: int, tol: float = 1e-4) -> None:
    """tol: fp32 through other kernels, as for sampled logprobs (tests/test_offline.py)."""
    assert len(entries) == len(prompt) and entries[0] is None
    for p in range(1, len(prompt)):
        row, got, tok = ref[p - 1], entries[p], prompt[p]
        assert tok in got and len(got) in (k, k + 1)
        assert list(got)[0] == tok  # the prompt token first, as vLLM orders it
        assert got[tok].rank == int((row > row[tok]).sum()) + 1
        top = torch.topk(row, k).indices.tolist()
        assert set(top) <= set(got) and set(got) <= set(top) | {tok}
        for tid, lp in got.items():
            assert abs(lp.logprob - row[tid].item()) < tol
            assert lp.decoded_token is not None


def _flat(out) -> list[tuple[int, int, float, int]]:
    """(position, token, logprob, rank) of every entry, in order."""
    return [(p, t, lp.logprob, lp.rank) for p, d in enumerate(out.prompt_logprobs) if d for t, lp in d.items()]


def _assert_same(a, b) -> None:
    fa, fb = _flat(a), _flat(b)
    assert [(p, t, r) for p, t, _, r in fa] == [(p, t, r) for p, t, _, r in fb]  # ids and ranks identical
    assert max(abs(x[2] - y[2]) for x, y in zip(fa, fb)) < 1e-5


@pytest.fixture(scope="module")
def chunked(tiny_qwen3_dir):
    return LLM(tiny_qwen3_dir, max_num_batched_tokens=64, max_prefill_length=13)


def test_prompt_logprobs_equal_hf_log_softmax_under_chunked_prefill(chunked, hf_qwen3):
    prompts = _prompts([70, 9, 41], seed=1)
    outs = _run(chunked, prompts, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=K))
    assert outs[0].outputs[0].prefill_chunks[0] == 13 and len(outs[0].outputs[0].prefill_chunks) > 3
    for prompt, out in zip(prompts, outs):
        _assert_like_hf(out.prompt_logprobs, prompt, _hf_prompt_logprobs(hf_qwen3, prompt), K)
        assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].logprobs is None


def test_untied_head_and_k_zero(tiny_llama_dir, hf_llama):
    """An untied lm_head (llama); k = 0 gives the prompt token alone."""
    llm = LLM(tiny_llama_dir, max_num_batched_tokens=32, max_prefill_length=32)
    prompt = _prompts([50], seed=2)[0]
    ref = _hf_prompt_logprobs(hf_llama, prompt)
    for k in (0, 2):
        out = _run(llm, [prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k))[0]
        _assert_like_hf(out.prompt_logprobs, prompt, ref, k)


def test_the_same_for_every_chunk_size(tiny_qwen3_dir, chunked):
    """Budgets and chunk caps from a few tokens to the whole prompt, alone and beside other requests, give the
    same entries: ids and ranks identical, logprobs within 1e-5."""
    prompts = _prompts([77, 30, 55], seed=3)
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=K, ignore_eos=True)
    want = _run(chunked, prompts, params)
    for kwargs in (dict(max_num_batched_tokens=16, max_prefill_length=5), dict(max_num_batched_tokens=256)):
        llm = LLM(tiny_qwen3_dir, **kwargs)
        got = _run(llm, prompts, params)
        for g, w in zip(got, want):
            _assert_same(g, w)
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
        # One at a time, a prompt is a single chunk at a budget of 256.
        alone = _run(llm, prompts[:1], params)[0]
        _assert_same(alone, want[0])
    assert alone.outputs[0].prefill_chunks == [77]


def test_a_cached_prefix_is_recomputed_not_dropped(tiny_qwen3_dir):
    """vLLM's rule: a request with prompt_logprobs reads nothing from the prefix cache for its prompt, so every
    entry is there; it still leaves its blocks for the requests after it."""
    llm = LLM(tiny_qwen3_dir, max_num_batched_tokens=64, max_prefill_length=16, enable_prefix_caching=True)
    prompt = _prompts([60], seed=4)[0]
    plain = SamplingParams(temperature=0, max_tokens=2)
    first = _run(llm, [prompt], plain)[0]
    with_lps = _run(llm, [prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=K))[0]
    assert with_lps.num_cached_tokens == 0 and all(d is not None for d in with_lps.prompt_logprobs[1:])
    assert with_lps.outputs[0].token_ids == first.outputs[0].token_ids
    again = _run(llm, [prompt], plain)[0]
    assert again.num_cached_tokens > 0 and again.prompt_logprobs is None
    cold = LLM(tiny_qwen3_dir, max_num_batched_tokens=64, max_prefill_length=16)
    _assert_same(with_lps, _run(cold, [prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=K))[0])


def test_under_preemption_and_with_n(tiny_qwen3_dir, chunked):
    """A pool too small for every admitted request preempts some mid-prompt or after it; n = 2 samples share
    one prompt's entries (each computes them: a sample's stream may start before another's)."""
    prompts = _prompts([40] * 6, seed=5)
    params = SamplingParams(temperature=0, max_tokens=24, prompt_logprobs=2, ignore_eos=True)
    want = _run(chunked, prompts, params)
    tight = LLM(tiny_qwen3_dir, max_num_batched_tokens=64, max_prefill_length=19, num_kv_blocks=9)
    got = _run(tight, prompts, params)
    assert tight.stats.num_preemptions > 0
    for g, w in zip(got, want):
        _assert_same(g, w)
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    two = _run(chunked, prompts[:1], SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=4, prompt_logprobs=2))[0]
    assert len(two.outputs) == 2
    _assert_same(two, want[0])


def test_invalid_values_are_refused_by_name():
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(InvalidSamplingParam, match="prompt_logprobs must be an integer >= 0"):
            SamplingParams(prompt_logprobs=bad)


@pytest.mark.slow
def test_head_runs_over_bounded_slices_within_the_plan(tmp_path):
    """A vocabulary large beside the model, so a step's logits dominate its activations: the whole 1,024-token
    chunk's logits and log-probabilities would be 2 x 1024 x 8192 x 4 bytes = 64 MiB, past the plan's per-step
    peak; slices of max_num_seqs rows keep the measured peak of a step with prompt logprobs within it."""
    from ladle.demo import build_checkpoint

    model_dir = build_checkpoint(tmp_path / "wide_vocab", "qwen3", vocab_size=8192, hidden_size=64,
                                 num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 intermediate_size=128, max_position_embeddings=2048)
    step = 1024
    llm = LLM(model_dir, max_num_batched_tokens=step, max_prefill_length=step, max_num_seqs=16, max_model_len=2048)
    planned = llm.config.plan.inputs.activation.predict(step, 2048)
    vocab = llm.engine.core.hf_config.vocab_size
    assert 2 * step * vocab * 4 > planned  # the unsliced head would not fit the plan
    prompt = _prompts([step], seed=6, vocab=vocab)[0]
    outs = []
    peak = measure_peak(lambda: outs.extend(_run(llm, [prompt], SamplingParams(temperature=0, max_tokens=1,
                                                                                prompt_logprobs=5))),
                        torch.device("cpu"))
    assert outs[0].outputs[0].prefill_chunks == [step]
    assert len(outs[0].prompt_logprobs) == step and all(d is not None for d in outs[0].prompt_logprobs[1:])
    assert peak <= planned, f"measured {peak / 2**20:.1f} MiB, planned {planned / 2**20:.1f} MiB"


def test_slices_do_not_change_the_entries(chunked):
    """One row a slice or the whole chunk at once: the same entries."""
    runner = chunked.engine.core.model_executor.runner
    prompt = _prompts([50], seed=7)[0]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3)
    wide = _run(chunked, [prompt], params)[0]
    saved = runner.max_num_seqs
    try:
        runner.max_num_seqs = 1
        narrow = _run(chunked, [prompt], params)[0]
    finally:
        runner.max_num_seqs = saved
    _assert_same(narrow, wide)


@pytest.mark.slow
def test_tensor_parallel_ranks_join_the_head_slices(tiny_qwen3_dir, chunked):
    """At tensor_parallel_size 2 every rank runs the same head slices (the head gathers the vocabulary to rank
    0), so prompt logprobs neither hang nor differ; a slice of 4 rows (max_num_seqs) splits every chunk."""
    prompts = _prompts([45, 30], seed=8)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3)
    want = _run(chunked, prompts, params)
    with LLM(tiny_qwen3_dir, tensor_parallel_size=2, max_num_batched_tokens=32, max_prefill_length=11,
             max_num_seqs=4) as llm:
        got = _run(llm, prompts, params)
    for g, w in zip(got, want):
        _assert_same(g, w)


@pytest.mark.slow
def test_state_layers_and_mtp_drafts(tmp_path):
    """Qwen3.5 (Gated DeltaNet state carried across chunks, prefix hits through state checkpoints): HF's values
    under chunked prefill with a warm prefix cache; with its MTP layer drafting, the same entries (the drafter's
    step path computes them too)."""
    from transformers import AutoModelForCausalLM

    from ladle.demo import build_checkpoint
    from ladle.testing.mtp_checkpoint import add_mtp_layer

    path = build_checkpoint(tmp_path / "q35", "qwen3_5", vocab_size=512, hidden_size=64, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                            linear_value_head_dim=16, max_position_embeddings=4096,
                            layer_types=["linear_attention"] * 3 + ["full_attention"], tie_word_embeddings=False,
                            seed=6)
    prompt = _prompts([45], seed=9)[0]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref = _hf_prompt_logprobs(hf, prompt)
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=K, ignore_eos=True)
    llm = LLM(path, max_num_batched_tokens=32, max_prefill_length=10, enable_prefix_caching=True, max_model_len=1024)
    _run(llm, [prompt], SamplingParams(temperature=0, max_tokens=1))  # leaves blocks and state checkpoints
    want = _run(llm, [prompt], params)[0]
    assert want.num_cached_tokens == 0
    # The delta rule sums its state in another order than HF's 64-token chunks: 1.2e-4 seen.
    _assert_like_hf(want.prompt_logprobs, prompt, ref, K, tol=5e-4)
    drafting = LLM(add_mtp_layer(path, seed=1), max_num_batched_tokens=32, max_prefill_length=10, max_model_len=1024,
                   speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    got = _run(drafting, [prompt], params)[0]
    _assert_same(got, want)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


@pytest.mark.server
@pytest.mark.slow
def test_completions_endpoint(tiny_qwen3_dir, chunked, tmp_path):
    """POST /v1/completions: vLLM's prompt_logprobs extra in each choice, and echo with logprobs reporting the
    prompt's tokens first (the first without a logprob), streamed or not; equal to the offline entries. A
    stream with prompt_logprobs, or more entries than --max-logprobs-per-request, is a 400 naming the field."""
    import asyncio

    import httpx

    from server_harness import ServerProcess, assert_error_envelope, stream_events

    prompt = _prompts([30], seed=10)[0]
    want = _run(chunked, [prompt], SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=2, logprobs=2))[0]
    srv = ServerProcess(tiny_qwen3_dir, tmp_path, "--max-num-batched-tokens", "64", "--max-prefill-length", "13",
                        "--max-logprobs-per-request", "2000").start()
    try:
        body = {"prompt": prompt, "max_tokens": 5, "temperature": 0}
        choice = srv.post("/v1/completions", {**body, "prompt_logprobs": 2}).json()["choices"][0]
        got = choice["prompt_logprobs"]
        assert got[0] is None and len(got) == len(prompt)
        for p in range(1, len(prompt)):
            entries = want.prompt_logprobs[p]
            assert list(got[p]) == [str(t) for t in entries]  # the prompt token first, then by rank
            for t, lp in entries.items():
                e = got[p][str(t)]
                assert abs(e["logprob"] - lp.logprob) < 1e-5 and e["rank"] == lp.rank
                assert e["decoded_token"] == lp.decoded_token

        echoed = srv.post("/v1/completions", {**body, "echo": True, "logprobs": 2}).json()["choices"][0]
        text = chunked.get_tokenizer().decode(prompt)
        assert echoed["text"] == text + want.outputs[0].text
        lps = echoed["logprobs"]
        assert len(lps["tokens"]) == len(prompt) + 5 and lps["text_offset"][0] == 0
        assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
        for p in range(1, len(prompt)):
            assert abs(lps["token_logprobs"][p] - want.prompt_logprobs[p][prompt[p]].logprob) < 1e-5
            assert len(lps["top_logprobs"][p]) in (2, 3)
        for i, tid in enumerate(want.outputs[0].token_ids):
            assert abs(lps["token_logprobs"][len(prompt) + i] - want.outputs[0].logprobs[i][tid].logprob) < 1e-5

        async def stream() -> list:
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as http:
                return await stream_events(http, {**body, "echo": True, "logprobs": 2})

        events = [e for e in asyncio.run(stream()) if isinstance(e, dict)]
        assert "".join(e["choices"][0]["text"] for e in events) == echoed["text"]
        streamed = [t for e in events for t in e["choices"][0]["logprobs"]["token_logprobs"]]
        assert streamed == lps["token_logprobs"]

        assert_error_envelope(srv.post("/v1/completions", {**body, "prompt_logprobs": 1, "stream": True}), 400,
                              param="prompt_logprobs")
        assert_error_envelope(srv.post("/v1/completions", {**body, "prompt": prompt * 10, "prompt_logprobs": 20}),
                              400, param="logprobs")
    finally:
        assert srv.stop() == 0, srv.log()
