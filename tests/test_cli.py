"""`ladle generate` and `ladle demo-model`, and the scheduling diagnostics the seed reports asked for."""
import logging
import re

from ladle import LLM, SamplingParams
from ladle.entrypoints.cli import main


def test_generate_prints_text_profile_and_summary(tiny_qwen3_dir, capsys, tmp_path):
    prompt_file = tmp_path / "p.txt"
    prompt_file.write_text("def f(x):\n    return x " * 20)
    rc = main(["generate", "--model", tiny_qwen3_dir, "--prompt", "hello world", "--prompt-file", str(prompt_file),
               "--max-new-tokens", "5", "--max-num-batched-tokens", "64", "--max-prefill-length", "32",
               "--batch-size", "3", "--profile", "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0
    assert captured.out.count("--- request") == 3  # batch of 3 requests cycling through the 2 prompts
    assert "step  tokens  chunks  decodes" in captured.out
    assert "largest step" in captured.out
    # The resolved settings table marks typed flags explicit and the rest default or derived.
    assert re.search(r"max_num_batched_tokens +64 +explicit", captured.err)
    for line in captured.err.splitlines():
        if line.startswith(("max_prefill_length", "max_num_batched_tokens")):
            assert line.split()[2] == "explicit"
        if line.startswith("block_size"):
            assert line.split()[2] == "default"


def test_generate_reports_bad_settings_clearly(tiny_qwen3_dir, capsys):
    rc = main(["generate", "--model", tiny_qwen3_dir, "--max-model-len", "99999", "--no-progress"])
    assert rc == 2
    assert "max_model_len=99999 exceeds the model's max_position_embeddings=4096" in capsys.readouterr().err
    rc = main(["generate", "--model", tiny_qwen3_dir, "--max-num-batched-tokens", "0", "--no-progress"])
    assert rc == 2 and "max_num_batched_tokens must be a positive integer" in capsys.readouterr().err


def test_demo_model_command(tmp_path, capsys):
    assert main(["demo-model", str(tmp_path / "demo")]) == 0
    assert "RANDOM weights" in capsys.readouterr().out
    assert (tmp_path / "demo" / "model.safetensors").exists()
    assert "random" in (tmp_path / "demo" / "README.md").read_text().lower()


def test_one_debug_line_per_prefill_chunk(tiny_qwen3_dir, caplog):
    llm = LLM(tiny_qwen3_dir, max_num_batched_tokens=64, max_prefill_length=40)
    with caplog.at_level(logging.DEBUG, logger="ladle.scheduler"):
        llm.generate({"prompt_token_ids": list(range(100))}, SamplingParams(max_tokens=2), use_tqdm=False)
    lines = [r.getMessage() for r in caplog.records if "prefill chunk" in r.getMessage()]
    assert lines == [
        "prefill chunk request=0 chunk_size=40 remain=100 cached=0 budget=40 chunked=True",
        "prefill chunk request=0 chunk_size=40 remain=60 cached=40 budget=40 chunked=True",
        "prefill chunk request=0 chunk_size=20 remain=20 cached=80 budget=40 chunked=False",
    ]


def test_vllm_alias_long_prefill_token_threshold(tiny_qwen3_dir):
    llm = LLM(tiny_qwen3_dir, max_num_batched_tokens=64, long_prefill_token_threshold=24)
    assert llm.config.max_prefill_length == 24
    assert llm.config.settings["max_prefill_length"].source == "explicit"
    llm.generate({"prompt_token_ids": list(range(50))}, SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.stats.prefill_chunks["0"] == [24, 24, 2]
