"""Run as a script by test_expert_tiering: one engine in a fresh process, printing as JSON how much memory of
its own the process holds after a generation (anonymous memory grown since before the engine, plus any of the
checkpoint's pages mapped into it; shared libraries' code is not the engine's), and the settings it derived.
A tiny engine runs first and is dropped, so the baseline holds what any engine's start leaves in the process
(imported modules, the tokenizer library, thread pools), which no memory budget covers."""
import gc
import json
import sys

import torch
import transformers  # noqa: F401 -- imported before the baseline, as the engine's start imports it

from ladle import LLM, SamplingParams


def own_memory(checkpoint: str) -> int:
    anon = mapped = 0
    path = ""
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and not parts[0].endswith(":"):
                path = parts[5] if len(parts) > 5 else ""
            elif parts[0] == "Anonymous:":
                anon += int(parts[1]) * 1024
            elif parts[0] == "Rss:" and path.startswith(checkpoint):
                mapped += int(parts[1]) * 1024
    return anon + mapped


def main() -> None:
    path, budget, warm = sys.argv[1], sys.argv[2], sys.argv[3]
    torch.ones(64, 64) @ torch.ones(64, 64)
    with LLM(warm, max_num_batched_tokens=64, num_kv_blocks=64, profile_cache=False) as llm:
        llm.generate([{"prompt_token_ids": list(range(1, 200))}], SamplingParams(max_tokens=16), use_tqdm=False)
    del llm
    gc.collect()
    base = own_memory(path)
    kwargs = ({"memory_budget": budget} if budget != "none" else {}) | json.loads(sys.argv[4])
    llm = LLM(path, max_num_batched_tokens=64, num_kv_blocks=64, profile_cache=False, **kwargs)
    outs = llm.generate([{"prompt_token_ids": list(range(1, 200))}], SamplingParams(temperature=0, max_tokens=16),
                        use_tqdm=False)
    setting = llm.engine.core.config.settings.get("moe_cache_size")
    print(json.dumps({"growth": own_memory(path) - base, "moe_cache_size": setting.value if setting else None,
                      "tokens": outs[0].outputs[0].token_ids}))


if __name__ == "__main__":
    main()
