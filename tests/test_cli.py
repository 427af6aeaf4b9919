"""The command line as a user meets it: fail fast with one line naming the flag, exit 2 for a usage mistake and 1
for a failure while running, the exact limit in a refusal, the profile cache, a progress bar that moves."""
from __future__ import annotations

import functools
import io
import json
import logging
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tqdm import tqdm

from ladle import LLM, SamplingParams
from ladle.entrypoints.cli import main

LADLE = str(Path(sys.executable).parent / "ladle")  # the installed entry point, as a user runs it


def run_ladle(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([LADLE, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def corrupt_dir(tiny_qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny checkpoint with its weights cut in half: any command that loads it fails."""
    path = shutil.copytree(tiny_qwen3_dir, tmp_path_factory.mktemp("corrupt") / "model")
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return str(path)


@pytest.mark.parametrize(("args", "message"), [
    (["generate", "--temperature", "-1"], "error: --temperature must be >= 0"),
    (["generate", "--max-new-tokens", "0"], "error: --max-new-tokens must be an integer >= 1"),
    (["generate", "--prompt-file", "/no/such/file.txt"], "error: --prompt-file /no/such/file.txt: No such file"),
    (["plan", "--max-num-batched-tokens", "0"], "error: --max-num-batched-tokens must be a positive integer"),
    (["plan", "--max-prefill-length", "512", "--max-num-batched-tokens", "256"],
     "error: --max-prefill-length=512 exceeds --max-num-batched-tokens=256"),
    (["plan", "--num-kv-blocks", "9", "--kv-cache-memory-bytes", "1GiB"], "error: --num-kv-blocks and --kv-cache"),
    (["plan", "--dtype", "fp8"], "error: --dtype='fp8': choose one of"),
    (["plan", "--max-model-len", "99999"], "error: --max-model-len=99999 exceeds the model's max_position_embeddings"),
    (["serve", "--shutdown-timeout", "0"], "error: --shutdown-timeout must be positive"),
])
def test_bad_values_fail_before_anything_loads(corrupt_dir, args, message):
    """Against a checkpoint that cannot load: the bad value is what gets reported, so it was checked first."""
    start = time.monotonic()
    r = run_ladle(*args[:1], "--model", corrupt_dir, *args[1:])
    took = time.monotonic() - start
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and r.stderr.startswith(message), r.stderr
    print(f"{args[0]} {' '.join(args[1:])}: refused in {took:.2f} s")


@pytest.mark.slow
def test_user_mistakes_are_one_line_with_the_right_exit_code(tiny_qwen3_dir, corrupt_dir, tmp_path):
    arch = shutil.copytree(tiny_qwen3_dir, tmp_path / "arch")
    config = json.loads((arch / "config.json").read_text())
    (arch / "config.json").write_text(json.dumps({**config, "architectures": ["MambaForCausalLM"]}))
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    cases = [
        (["plan", "--model", "/no/such/model"], 2, "model directory '/no/such/model' does not exist"),
        (["serve", "/no/such/model"], 2, "model directory '/no/such/model' does not exist"),
        (["plan", "--model", str(arch)], 2, "unsupported architecture 'MambaForCausalLM'"),
        (["plan", "--model", corrupt_dir], 1, "is truncated or corrupt"),
        (["serve", tiny_qwen3_dir, "--port", str(busy.getsockname()[1])], 1, "pick another --port"),
        (["--log-level", "FOO", "plan"], 2, "invalid choice: 'FOO'"),
        (["plan", "--log-level", "LOUD"], 2, "invalid choice: 'LOUD'"),
    ]
    try:
        for args, code, message in cases:
            r = run_ladle(*args)
            assert r.returncode == code and message in r.stderr, (args, r.returncode, r.stderr)
            assert "Traceback" not in r.stderr, r.stderr
    finally:
        busy.close()
    debug = run_ladle("plan", "--model", corrupt_dir, "--log-level", "debug")
    assert debug.returncode == 1 and "Traceback" in debug.stderr  # DEBUG shows where it came from


def test_a_refusal_states_the_exact_largest_value_that_fits(tiny_qwen3_dir, capsys):
    flags = ["plan", "--model", tiny_qwen3_dir, "--memory-budget", "96MiB", "--max-model-len", "4096"]
    assert main([*flags, "--max-num-batched-tokens", "100000000"]) == 2
    err = capsys.readouterr().err
    largest = int(re.search(r"the largest --max-num-batched-tokens that fits is (\d+)", err).group(1))
    assert "MiB" in err and "GiB" in err and largest > 0, err
    assert main([*flags, "--max-num-batched-tokens", str(largest)]) == 0
    assert main([*flags, "--max-num-batched-tokens", str(largest + 1)]) == 2
    capsys.readouterr()


def _profile_source(llm: LLM) -> str:
    return llm.config.settings["activation_profile"].value


@pytest.mark.slow
def test_the_profile_cache_serves_the_second_start(tiny_qwen3_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LADLE_PROFILE_CACHE_DIR", str(tmp_path / "profiles"))
    first = LLM(tiny_qwen3_dir, max_model_len=1024)
    second = LLM(tiny_qwen3_dir, max_model_len=1024)
    assert (_profile_source(first), _profile_source(second)) == ("measured", "cached")
    assert second.config.plan.inputs.activation == first.config.plan.inputs.activation
    assert _profile_source(LLM(tiny_qwen3_dir, max_model_len=1024, profile_cache=False)) == "measured"
    assert _profile_source(LLM(tiny_qwen3_dir, max_model_len=1024, block_size=32)) == "measured"  # another key
    for entry in (tmp_path / "profiles").glob("*.json"):
        entry.write_text("{not json")
    assert _profile_source(LLM(tiny_qwen3_dir, max_model_len=1024)) == "measured"  # unreadable: profiled again


def test_log_level_after_the_subcommand_and_generate_output(tiny_qwen3_dir, capsys, tmp_path):
    prompt_file = tmp_path / "p.txt"
    prompt_file.write_text("def f(x):\n    return x " * 20)
    rc = main(["generate", "--model", tiny_qwen3_dir, "--prompt", "hello world", "--prompt-file", str(prompt_file),
               "--max-new-tokens", "5", "--max-num-batched-tokens", "64", "--max-prefill-length", "32",
               "--batch-size", "3", "--profile", "--no-progress", "--log-level", "INFO"])
    captured = capsys.readouterr()
    assert rc == 0 and logging.getLogger("ladle").level == logging.INFO
    logging.getLogger("ladle").setLevel(logging.NOTSET)
    assert captured.out.count("--- request") == 3  # batch of 3 requests cycling through the 2 prompts
    assert "step  tokens  chunks  decodes" in captured.out and "largest step" in captured.out
    assert re.search(r"max_num_batched_tokens +64 +explicit", captured.err)
    assert re.search(r"activation_profile +(measured|cached) +derived", captured.err)


def test_the_progress_bar_moves_with_every_step(tiny_qwen3_dir):
    llm = LLM(tiny_qwen3_dir, max_num_batched_tokens=64, num_kv_blocks=128)
    out = io.StringIO()
    bar = functools.partial(tqdm, file=out, mininterval=0)
    llm.generate([{"prompt_token_ids": list(range(400))}, {"prompt_token_ids": list(range(1, 300))}],
                 SamplingParams(max_tokens=4), use_tqdm=bar)
    frames = [f for f in out.getvalue().split("\r") if "toks/s" in f]
    before_done = [f for f in frames if " 0/2 " in f]
    # The 400-token prompt takes 7 chunks: the bar shows each step's token rates before any prompt is done.
    assert len(before_done) >= 5, frames[:3]
    assert re.search(r"est\. speed input: [1-9][\d.]* toks/s, output: [\d.]+ toks/s", before_done[-1])


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


def test_long_prefill_token_threshold_says_what_is_long_and_does_not_cap_chunks(tiny_qwen3_dir):
    """It was once an alias of max_prefill_length; now it means one thing, as in vLLM: what counts as long."""
    llm = LLM(tiny_qwen3_dir, max_num_batched_tokens=64, long_prefill_token_threshold=24)
    assert llm.config.max_prefill_length == 64 and llm.config.partial_prefills.long_prefill_token_threshold == 24
    assert llm.config.settings["long_prefill_token_threshold"].source == "explicit"
    assert llm.config.settings["max_prefill_length"].source != "explicit"
    out = llm.generate({"prompt_token_ids": list(range(50))}, SamplingParams(max_tokens=1), use_tqdm=False)
    assert out[0].outputs[0].prefill_chunks == [50]


def test_generate_chat_renders_the_prompt_with_the_chat_template(tiny_qwen3_dir, capsys):
    """--chat sends each prompt as a user message through the model's template (LLM.chat): the prompt grows by
    the template's tokens, which plain generate does not add."""
    args = ["generate", "--model", tiny_qwen3_dir, "--prompt", "hello world", "--max-new-tokens", "2", "--no-progress"]
    assert main(args) == 0
    plain = re.search(r"(\d+) prompt tokens", capsys.readouterr().out).group(1)
    assert main(args + ["--chat"]) == 0
    chat = re.search(r"(\d+) prompt tokens", capsys.readouterr().out).group(1)
    assert int(chat) > int(plain)
