"""Prefix caching on models with per-request state (Qwen3.5's Gated DeltaNet, DeepSeek-V4's compressors and
compressed KV), through state checkpoints: a request resumed from one gives HF's greedy tokens and the cold
run's logprobs, for prompts whose shared prefix ends before, on and after block and checkpoint boundaries, inside
compression groups and inside and beyond the sliding window; under checkpoint and KV eviction, preemption and an
abort mid-prefill."""
from __future__ import annotations

import random

import pytest

from hf_oracle import hf_greedy, ladle_tokens
from ladle import LLM, SamplingParams
import test_deepseek_v4 as dsv4
import test_qwen3_5 as qwen3_5

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
BASE = 400
# (shared prefix, own suffix): the prefix ends mid-block, on a block, one past it; inside a CSA group (rate 4)
# and an HCA group (16 or 32), past the window; the whole base, and the base less its last token.
SHAPES = [(BASE, 0), (BASE, 40), (47, 3), (64, 9), (65, 30), (130, 20), (200, 7), (131, 90), (BASE - 1, 5)]
MODELS = {"qwen3_5": ("qwen3_5", "gqa"), "qwen3_5_moe": ("qwen3_5", "moe"), **{
    f"dsv4_{mix}": ("dsv4", mix) for mix in dsv4.MIXES}, "dsv4_rate128": ("dsv4", "rate128")}
# The release's rates (4 and 128): every hit below 2,048 tokens lies inside the HCA group's first block.
DSV4_MIXES = dsv4.MIXES | {"rate128": dsv4.MIXES["small_window"] | {"compress_rates": {dsv4.CSA: 4, dsv4.HCA: 128}}}


def shared_prompts(seed: int, shapes: list[tuple[int, int]] = SHAPES) -> list[list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(512) for _ in range(BASE)]
    return [base[:n] + [rng.randrange(512) for _ in range(m)] for n, m in shapes]


def one_by_one(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list:
    """Each prompt after the one before has finished, so every later one can hit the earlier ones' prefixes."""
    return [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0] for p in prompts]


def expected_hits(prompts: list[list[int]], interval: int, block: int = 16) -> list[int]:
    """What each prompt, run after the ones before it, resumes from: the deepest checkpoint an earlier prompt
    stored (every `interval` tokens, and where its prompt ends, rounded down to a block, and a block before
    that) within the prefix they share, short of the prompt's last token."""
    hits = []
    for i, p in enumerate(prompts):
        best = 0
        for q in prompts[:i]:
            shared = next((k for k, (a, b) in enumerate(zip(p, q)) if a != b), min(len(p), len(q)))
            stored = {*range(interval, len(q) + 1, interval), len(q) // block * block, (len(q) - 1) // block * block}
            best = max([best] + [c for c in stored if c <= min(shared, len(p) - 1)])
        hits.append(best)
    return hits


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (checkpoint dir, HF greedy tokens of shared_prompts(5)), each built once when first asked."""
    built: dict[str, tuple[str, list[list[int]]]] = {}

    def get(name: str) -> tuple[str, list[list[int]]]:
        if name not in built:
            family, mix = MODELS[name]
            path = tmp_path_factory.mktemp(name)
            prompts = shared_prompts(5)
            if family == "dsv4":
                hf = dsv4.build(path, 7, **DSV4_MIXES[mix])
                want = [dsv4.hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
            else:
                hf = qwen3_5._build(path, 7, **qwen3_5.MIXES[mix])
                want = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
            built[name] = str(path), want
        return built[name]

    return get


CONFIGS = [(64, None), (4096, 19), pytest.param(7, None, marks=pytest.mark.slow)]


@pytest.mark.parametrize("budget,chunk", CONFIGS)
@pytest.mark.parametrize("name", list(MODELS))
def test_resumed_requests_give_hf_tokens(models, name, budget, chunk):
    path, want = models(name)
    kwargs = {"max_num_batched_tokens": budget} | ({"max_prefill_length": chunk} if chunk else {})
    llm = LLM(path, num_kv_blocks=256, **kwargs)
    outs = one_by_one(llm, shared_prompts(5))
    assert [o.outputs[0].token_ids for o in outs] == want
    stats, kv = llm.stats, llm.engine.core.kv
    interval = llm.engine.core.config.state_checkpoint_interval
    assert interval == max(16, min(budget, chunk or budget) // 16 * 16)
    assert [o.num_cached_tokens for o in outs] == expected_hits(shared_prompts(5), interval)
    assert kv.num_free_blocks == 256 and not kv.state_slots and not kv.pending and not kv.restores
    assert stats.state_checkpoint_bytes == len(kv.checkpoints) * kv.checkpoints.bytes_each > 0


@pytest.mark.parametrize("name", ["qwen3_5", "dsv4_small_window"])
def test_resumed_logprobs_equal_the_cold_run(models, name):
    path, _ = models(name)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    warm = one_by_one(LLM(path, num_kv_blocks=256, max_num_batched_tokens=64), shared_prompts(5), params)
    cold = one_by_one(LLM(path, num_kv_blocks=256, max_num_batched_tokens=64, enable_prefix_caching=False),
                      shared_prompts(5), params)
    assert sum(o.num_cached_tokens for o in warm) > 0
    for w, c in ((w.outputs[0], c.outputs[0]) for w, c in zip(warm, cold)):
        assert w.token_ids == c.token_ids
        for lw, lc in zip(w.logprobs, c.logprobs):
            assert lw.keys() == lc.keys()
            assert all(abs(lw[t].logprob - lc[t].logprob) < 1e-4 for t in lw)


@pytest.mark.parametrize("name", ["qwen3_5", "dsv4_wide_window"])
def test_eviction_of_checkpoints_and_of_kv(models, name):
    """Two checkpoints and a pool that holds about two prompts: both are evicted again and again, and what
    survives still resumes exactly."""
    path, want = models(name)
    llm = LLM(path, num_kv_blocks=32, max_num_batched_tokens=64, num_state_checkpoints=2)
    assert [o.outputs[0].token_ids for o in one_by_one(llm, shared_prompts(5))] == want
    stats, kv = llm.stats, llm.engine.core.kv
    assert stats.state_checkpoints_evicted > 0 and kv.pool.num_evictions > 0
    assert stats.prefix_cache_hit_requests > 0
    assert kv.checkpoints.num_free + len(kv.checkpoints) == 2


def test_a_checkpoint_goes_with_a_window_block_its_hit_reads(models):
    """DeepSeek-V4, window 40, on a pool of 28 blocks: an unrelated prompt after A evicts some of A's blocks, and
    each checkpoint whose window lost a block goes with it (free slots remain, so nothing else evicted them);
    every checkpoint left still has its window, and a prompt sharing A's prefix resumes from the deepest one."""
    path, _ = models("dsv4_wide_window")
    rng = random.Random(3)
    a = [rng.randrange(512) for _ in range(200)]
    other = [rng.randrange(512) for _ in range(200)]
    b = a[:199] + [rng.randrange(512) for _ in range(20)]
    llm = LLM(path, num_kv_blocks=28, max_num_batched_tokens=64)
    one_by_one(llm, [a, other])
    kv = llm.engine.core.kv
    assert kv.pool.num_evictions > 0 and llm.stats.state_checkpoints_evicted > 0 and kv.checkpoints.num_free > 0
    assert kv.windows.by_node.keys() == kv.checkpoints._by_node.keys()
    assert all(kv.pool.block_keys[blk] is not None for blocks in kv.windows.by_node.values() for blk in blocks)
    warm = one_by_one(llm, [b])[0]
    assert warm.num_cached_tokens == 192
    cold = one_by_one(LLM(path, num_kv_blocks=28, max_num_batched_tokens=64, enable_prefix_caching=False), [b])[0]
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids


@pytest.mark.parametrize("name", ["qwen3_5_moe", "dsv4_hca_first"])
def test_preemption_with_checkpoints(models, name):
    """Prompts sharing prefixes, all at once, decoding 24 tokens on a pool too small for them: preemptions,
    recomputation that hits the prefixes (its own and the others'), and the tokens of a cold run on a pool
    that holds everything."""
    path, _ = models(name)
    prompts = shared_prompts(9, [(40, 8), (40, 20), (33, 10), (70, 3), (17, 30), (64, 1)])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    cold = ladle_tokens(LLM(path, num_kv_blocks=256, enable_prefix_caching=False), prompts, params)
    blocks = 12 if name.startswith("qwen") else 16
    llm = LLM(path, num_kv_blocks=blocks, max_num_batched_tokens=64, max_prefill_length=19)
    assert ladle_tokens(llm, prompts, params) == cold
    assert llm.stats.num_preemptions > 0 and llm.stats.prefix_cache_hits > 0
    kv = llm.engine.core.kv
    assert kv.num_free_blocks == blocks and not kv.pending
    assert kv.checkpoints.num_free + len(kv.checkpoints) == kv.checkpoints.num_checkpoints


def test_abort_mid_prefill_keeps_the_checkpoints_it_wrote(models):
    path, want = models("dsv4_small_window")
    llm = LLM(path, num_kv_blocks=256, max_num_batched_tokens=64)
    core = llm.engine.core
    prompts = shared_prompts(5)
    core.add_request(core.make_requests("long", [prompts[1]], GREEDY)[0])
    for _ in range(3):  # three 64-token chunks, each ending on a checkpoint; the third's pending at 192
        core.step()
    core.abort_requests(["long"])
    kv = core.kv
    assert len(kv.checkpoints) == 3 and not kv.pending and kv.checkpoints.num_free == kv.checkpoints.num_checkpoints - 3
    out = one_by_one(llm, [prompts[6]])[0].outputs[0]  # shares 200 tokens: resumes at 192
    assert out.token_ids == want[6] and llm.stats.prefix_cache_hits == 192


def test_checkpoint_settings_are_honoured_or_refused(models, tiny_qwen3_dir):
    path, _ = models("dsv4_small_window")
    llm = LLM(path, num_kv_blocks=64, num_state_checkpoints=3, state_checkpoint_interval=32)
    cfg = llm.engine.core.config
    assert (cfg.num_state_checkpoints, cfg.state_checkpoint_interval) == (3, 32)
    assert cfg.settings["num_state_checkpoints"].source == "explicit"
    # A checkpoint holds the compressor state and a page per compressed layer's partly filled block.
    layout = cfg.kv_layout
    assert layout.checkpoint_bytes(16) > layout.state_bytes_per_request and "3 x" in cfg.report()
    with pytest.raises(ValueError, match="not a multiple of block_size"):
        LLM(path, state_checkpoint_interval=40)
    with pytest.raises(ValueError, match="prefix caching, which is off"):
        LLM(path, num_state_checkpoints=4, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="keeps none: drop it"):
        LLM(tiny_qwen3_dir, num_state_checkpoints=4)


SYSTEM = {"role": "system", "content": "You are a coding agent. " * 12}
USER = {"role": "user", "content": "Fix the failing test in parser.py, please."}
# An agent's next turn re-renders an earlier reply differently (its thinking dropped): the prompt diverges inside
# that reply, before the last turn's prompt end, and no interval checkpoint lies before it.
TURN_A = [SYSTEM, USER, {"role": "assistant", "content": "<think>the stack</think>Reading parser.py."},
          {"role": "user", "content": "Here is the file."}]
TURN_B = [SYSTEM, USER, {"role": "assistant", "content": "Reading parser.py."},
          {"role": "user", "content": "Here is the file."}, {"role": "assistant", "content": "Done."},
          {"role": "user", "content": "Thanks, now the docs."}]


def end_of_user(tok) -> int:
    return len(tok.encode(tok.apply_chat_template([SYSTEM, USER], tokenize=False), add_special_tokens=False))


def test_chat_marks_message_ends_so_an_edited_reply_reuses_what_precedes_it(models):
    """The checkpoint at the end of the message before the re-rendered reply is what the hit resumes from."""
    path, _ = models("dsv4_small_window")
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm = LLM(path, num_kv_blocks=256, max_num_batched_tokens=4096)
    mark = end_of_user(llm.get_tokenizer())
    assert mark > 32 and llm.engine.core.config.state_checkpoint_interval > 200
    llm.chat(TURN_A, params, use_tqdm=False)
    warm = llm.chat(TURN_B, params, use_tqdm=False)[0]
    assert warm.num_cached_tokens == mark // 16 * 16
    cold = LLM(path, num_kv_blocks=256, enable_prefix_caching=False).chat(TURN_B, params, use_tqdm=False)[0]
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids


@pytest.mark.server
@pytest.mark.slow
def test_the_server_reuses_what_precedes_an_edited_reply(models, tmp_path):
    """The same two turns through /v1/chat/completions and the official client: the server marks the message
    ends too, reports the hit as usage.prompt_tokens_details.cached_tokens and on /metrics, and answers as
    the offline engine without a cache does."""
    import openai
    from transformers import AutoTokenizer

    from server_harness import ServerProcess, metric

    path, _ = models("dsv4_small_window")
    mark = end_of_user(AutoTokenizer.from_pretrained(path))
    cold = LLM(path, num_kv_blocks=256, enable_prefix_caching=False).chat(
        TURN_B, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    srv = ServerProcess(path, tmp_path, "--num-kv-blocks", "256", "--max-num-batched-tokens", "4096").start()
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        extra = {"ignore_eos": True}
        first = client.chat.completions.create(model=model, messages=TURN_A, max_tokens=3, temperature=0,
                                               extra_body=extra)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        warm = client.chat.completions.create(model=model, messages=TURN_B, max_tokens=3, temperature=0,
                                              extra_body=extra)
        assert warm.usage.prompt_tokens_details.cached_tokens == mark // 16 * 16
        assert warm.choices[0].message.content == cold.outputs[0].text
        text = srv.metrics()
        assert metric(text, "ladle:prefix_cache_hits_total") == mark // 16 * 16
        assert metric(text, "ladle:state_checkpoints_stored_total") > 0
    finally:
        assert srv.stop() == 0, srv.log()


def test_the_server_marks_the_same_message_ends_as_the_offline_chat(models):
    from transformers import AutoTokenizer

    from ladle.entrypoints.openai.chat.render import ChatPrompt, render
    from ladle.serving.messages import AddRequest

    path, _ = models("dsv4_small_window")
    tok = AutoTokenizer.from_pretrained(path)
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there."},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye."}]
    prompt = ChatPrompt(conv, None, {}, None, True)
    ids, marks, _ = render(tok, prompt, mark=True)
    heads = [tok.encode(tok.apply_chat_template(conv[:n], tokenize=False), add_special_tokens=False) for n in (1, 2, 3)]
    assert marks == tuple(len(h) for h in heads) and all(ids[: len(h)] == h for h in heads)
    assert render(tok, prompt, mark=False)[:2] == (ids, ())
    assert AddRequest("r", [ids], GREEDY, marks).checkpoint_marks == marks


@pytest.mark.slow
def test_seed_b_a_16k_prompt_after_a_7900_token_prefix_computes_only_the_rest(models):
    """The second field report's case on a tiny DeepSeek-V4: another request prefilled the first 7.9K tokens,
    so the 16K-token prompt computes at most 8.2K, and its tokens are the cold run's."""
    path, _ = models("dsv4_small_window")
    rng = random.Random(16)
    prompt = [rng.randrange(512) for _ in range(16_000)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = LLM(path, num_kv_blocks=2600, max_num_batched_tokens=2048)
    llm.generate({"prompt_token_ids": prompt[:7_900]}, params, use_tqdm=False)
    before = llm.stats.prompt_tokens
    warm = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert llm.stats.prompt_tokens - before <= 8_200 and warm.num_cached_tokens == 7_888
    cold = LLM(path, num_kv_blocks=2600, max_num_batched_tokens=2048, enable_prefix_caching=False)
    assert warm.outputs[0].token_ids == cold.generate({"prompt_token_ids": prompt}, params,
                                                      use_tqdm=False)[0].outputs[0].token_ids


def test_a_sliding_window_hit_needs_only_the_blocks_its_window_reads(tmp_path):
    """Mistral, window 32: after the prompt's head blocks were evicted, a prompt sharing 290 tokens still
    resumes at 288, from the two blocks its window reads, and gives the cold run's tokens."""
    from ladle.demo import build_checkpoint
    from ladle.kv_cache.prefix_tree import BlockTokens

    path = build_checkpoint(tmp_path, "mistral", sliding_window=32, seed=3)
    rng = random.Random(2)
    a = [rng.randrange(500) for _ in range(300)]
    b = a[:290] + [rng.randrange(500) for _ in range(20)]
    others = [[rng.randrange(500) for _ in range(200)]]
    llm = LLM(path, num_kv_blocks=24, max_num_batched_tokens=64)
    one_by_one(llm, [a, *others])
    kv = llm.engine.core.kv
    head = kv.tree.walk([BlockTokens(tuple(a[:16]), hash(tuple(a[:16])))])
    assert kv.pool.num_evictions > 0 and kv.pool.get_cached_block((head[0], 0)) is None  # the head is gone
    warm = one_by_one(llm, [b])[0]
    assert warm.num_cached_tokens == 288
    cold = one_by_one(LLM(path, num_kv_blocks=24, max_num_batched_tokens=64, enable_prefix_caching=False), [b])[0]
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
