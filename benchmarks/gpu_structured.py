"""The device script's structured-output section: constrained rows (a JSON schema, a regex) beside
unconstrained ones through the CUDA engine (graphs on), every constrained output valid and every unconstrained
row's tokens the same as without them; then batch-16 decode constrained against unconstrained."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import torch

from ladle.demo import build_checkpoint, demo_model_kwargs

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "n", "tags"], "additionalProperties": False}
REGEX = r"[a-z]{2,5}-[0-9]{1,3}"
LONG = {"type": "array", "minItems": 10000, "items": {"type": "integer", "minimum": 0, "maximum": 9999}}


def _run(core: Any, prompts: list[list[int]], params: list[Any], tag: str) -> tuple[list[list[int]], list[str]]:
    """Each request's tokens and finish reason, stepping the core until all finish."""
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        core.add_request(core.make_request(f"{tag}{i}", p, sp))
        tokens[f"{tag}{i}"] = []
    while core.has_unfinished_requests():
        for o in core.step():
            tokens[o.request_id] += o.new_token_ids
            if o.finish_reason:
                finish[o.request_id] = o.finish_reason
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    return [tokens[r] for r in ids], [finish[r] for r in ids]


def structured_check(device: torch.device, workdir: Path, small: bool) -> dict[str, Any]:
    import jsonschema
    from transformers import AutoTokenizer

    from ladle.config.engine_args import EngineArgs
    from ladle.engine.core import EngineCore
    from ladle.sampling_params import SamplingParams, StructuredOutputsParams as SO

    path = build_checkpoint(workdir / "structured", **demo_model_kwargs())
    tok = AutoTokenizer.from_pretrained(path)
    extra = {} if device.type != "cuda" else dict(max_cudagraph_capture_size=32)
    args, explicit = EngineArgs.from_kwargs(model=str(path), device=str(device), dtype="float32",
                                            max_num_batched_tokens=128, kv_cache_memory_bytes="1GiB", **extra)
    core = EngineCore(args, explicit)
    prompts = [tok.encode(f"request {i}: the answer is") for i in range(6)]
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    json_p = SamplingParams(temperature=0.8, seed=1, max_tokens=400, structured_outputs=SO(json=SCHEMA))
    regex_p = SamplingParams(temperature=0, max_tokens=40, structured_outputs=SO(regex=REGEX))
    alone, _ = _run(core, prompts[0::3], [plain, plain], "alone")
    mixed = [plain, json_p, regex_p, plain, json_p, regex_p]
    got, finish = _run(core, prompts, mixed, "mixed")
    texts = [tok.decode(t, skip_special_tokens=True) for t in got]  # the EOS that ended a row, as frontends do
    valid = []
    for i in (1, 4):
        try:
            jsonschema.validate(json.loads(texts[i]), SCHEMA)
            valid.append(True)
        except ValueError:
            valid.append(False)
    valid += [bool(re.fullmatch(REGEX, texts[i])) for i in (2, 5)]
    res: dict[str, Any] = dict(unconstrained_unchanged=[got[0], got[3]] == alone, constrained_valid=valid,
                               finish=finish, samples=texts[1:3])
    batch, new = (4, 8) if small else (16, 64)
    bp = [tok.encode(f"row {i}") for i in range(batch)]
    for name, sp in (("unconstrained", SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)),
                     ("constrained", SamplingParams(temperature=0, max_tokens=new, ignore_eos=True,
                                                    structured_outputs=SO(json=LONG)))):
        _run(core, bp, [sp] * batch, f"warm-{name}")
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out, _ = _run(core, bp, [sp] * batch, f"time-{name}")
        res[f"batch{batch}_{name}_tok_s"] = round(sum(map(len, out)) / (time.perf_counter() - t0), 1)
    res["constrained_over_unconstrained"] = round(res[f"batch{batch}_constrained_tok_s"]
                                                  / res[f"batch{batch}_unconstrained_tok_s"], 3)
    res["ok"] = res["unconstrained_unchanged"] and all(valid)
    core.shutdown()
    return res
