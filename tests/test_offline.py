"""The offline LLM path end to end: preemption, rejection, sampling features, chat."""
import random

import pytest
import torch

from hf_oracle import hf_greedy, hf_logprobs
from ladle import LLM, SamplingParams


def prompts_of(lens, vocab=500, seed=0):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(n)]} for n in lens]


@pytest.fixture(scope="module")
def llm(tiny_qwen3_dir):
    return LLM(tiny_qwen3_dir, max_num_batched_tokens=64, max_prefill_length=32)


def test_preemption_keeps_outputs_identical(tiny_qwen3_dir):
    prompts = prompts_of([40] * 8, seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = [SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=24, ignore_eos=True)
              for i in range(8)]
    roomy = LLM(tiny_qwen3_dir, max_num_batched_tokens=128)
    # 40 + 24 = 64 tokens = 4 blocks per request: 9 blocks hold about 2 of the 8 requests.
    tight = LLM(tiny_qwen3_dir, max_num_batched_tokens=128, num_kv_blocks=9)
    for params in (greedy, seeded):
        want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
        assert got == want
    assert tight.stats.num_preemptions > 0 and roomy.stats.num_preemptions == 0
    assert tight.engine.core.kv.num_free_blocks == 9


def test_request_that_can_never_fit_is_rejected_before_any_work(tiny_qwen3_dir):
    llm = LLM(tiny_qwen3_dir, max_model_len=256, num_kv_blocks=8)  # 8 blocks = 128 tokens
    params = SamplingParams(temperature=0, max_tokens=16)
    with pytest.raises(ValueError, match=r"prompt 1: .*250 tokens.*max_model_len=256"):
        llm.generate(prompts_of([10, 250, 10]), params, use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt 0: .*whole pool has 8"):
        llm.generate(prompts_of([150]), params, use_tqdm=False)
    assert llm.stats.num_steps == 0 and not llm.engine.has_unfinished_requests()
    outs = llm.generate(prompts_of([10, 10]), params, use_tqdm=False)  # the engine still serves
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(llm):
    prompts = prompts_of([5, 30, 70], seed=1)
    p = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], p, use_tqdm=False)][::-1]
    assert a == b  # same seed, different batch order: same tokens
    other = llm.generate(prompts, SamplingParams(temperature=1.0, seed=8, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in other] != a
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    top1 = llm.generate(prompts, SamplingParams(temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in top1] == [o.outputs[0].token_ids for o in greedy]


def test_a_scheduler_that_schedules_nothing_with_work_left_fails_loudly(llm, monkeypatch):
    """Admission guarantees a lone request fits, so an empty step with requests waiting is a bug: the core
    raises with the counts instead of spinning forever."""
    from ladle.engine.scheduler_output import SchedulerOutput

    core = llm.engine.core
    core.add_request(core.make_request("stuck", [1, 2, 3], SamplingParams(max_tokens=2)))
    monkeypatch.setattr(core.scheduler, "schedule", lambda: SchedulerOutput())
    with pytest.raises(RuntimeError, match="scheduler made no progress with 1 waiting, 0 running"):
        core.step()
    monkeypatch.undo()
    core.abort_requests(["stuck"])
    assert not core.has_unfinished_requests()


def test_the_engine_seed_makes_unseeded_sampling_reproducible(tiny_qwen3_dir):
    """Rows without a seed draw from the runner's generator, seeded by the engine's seed (vLLM's `seed`), not
    from torch's global one, which anything else in the process may advance."""
    prompts = prompts_of([6, 20], seed=2)
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)

    def run(seed: int) -> list[list[int]]:
        llm = LLM(tiny_qwen3_dir, seed=seed, max_model_len=256, num_kv_blocks=32)
        torch.rand(1000)  # the global generator moves; the engine's draws must not
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    first = run(11)
    assert run(11) == first and run(12) != first


def test_n_samples_share_a_prompt_and_differ(llm):
    out = llm.generate(prompts_of([20]), SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=10),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_stop_strings_cut_text_and_finish_with_stop(llm):
    prompt = prompts_of([12], seed=5)
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    text = base[0].outputs[0].text
    # a 3-character stop string with no blank, first occurring after the text's start
    i = next(i for i in range(4, len(text) - 3) if " " not in text[i:i + 3] and text.find(text[i:i + 3]) == i)
    stop = text[i:i + 3]
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)]
    assert len(cut.token_ids) < 30
    length = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert length[0].outputs[0].finish_reason == "length"


def test_stop_token_ids_and_min_tokens(llm, hf_qwen3):
    prompt = prompts_of([15], seed=9)
    ids = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    stop_tok = ids[4]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                              stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[: ids.index(stop_tok) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    late = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, min_tokens=ids.index(stop_tok) + 2,
                                               ignore_eos=True, stop_token_ids=[stop_tok]), use_tqdm=False)
    assert len(late[0].outputs[0].token_ids) > ids.index(stop_tok) + 1


def test_eos_ends_generation_like_hf(llm, hf_qwen3):
    eos = frozenset(llm.engine.core.eos_token_ids)
    for p in prompts_of([3, 9, 40, 100], seed=11):
        want = hf_greedy(hf_qwen3, p["prompt_token_ids"], 40, stop_ids=eos)
        got = llm.generate(p, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
        assert got.token_ids == want
        assert got.finish_reason == ("stop" if want[-1] in eos else "length")


def test_logprobs_equal_hf_log_softmax(llm, hf_qwen3):
    prompt = prompts_of([50], seed=2)[0]
    out = llm.generate(prompt, SamplingParams(temperature=0.7, seed=3, max_tokens=8, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    ref = hf_logprobs(hf_qwen3, prompt["prompt_token_ids"], out.token_ids)
    assert len(out.logprobs) == 8
    for step, (tok, lps) in enumerate(zip(out.token_ids, out.logprobs)):
        assert tok in lps and 3 <= len(lps) <= 4
        for tid, lp in lps.items():
            assert abs(lp.logprob - ref[step, tid].item()) < 1e-4
            assert lp.decoded_token is not None
        top3 = torch.topk(ref[step], 3).indices.tolist()
        assert set(top3) <= set(lps)


def test_chat_renders_the_template(llm):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert out.prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert out.prompt.endswith("<|im_start|>assistant\n")
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == tok.encode(out.prompt, add_special_tokens=False)
    assert 1 <= len(out.outputs[0].token_ids) <= 6
    two = llm.chat([msgs, [{"role": "user", "content": "Hi"}]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(two) == 2


def test_string_prompts_and_mismatched_params(llm):
    outs = llm.generate(["hello world", "def f(x):"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert [o.prompt for o in outs] == ["hello world", "def f(x):"]
    assert outs[0].prompt_token_ids == llm.get_tokenizer().encode("hello world")
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["a"], [SamplingParams(), SamplingParams()], use_tqdm=False)
    with pytest.raises(TypeError):
        llm.generate([123], use_tqdm=False)
    with pytest.raises(TypeError, match="unknown engine argument"):
        LLM("x", max_num_batched_token=5)
