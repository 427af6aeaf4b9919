"""The engine flags are EngineArgs' fields (ladle.entrypoints.cli_args): every field has its flag or is listed as
flagless, and every flag sets a field, so a field added to EngineArgs cannot be forgotten on the command line."""
from __future__ import annotations

import argparse
from dataclasses import fields

from ladle.config.engine_args import ALIASES, EngineArgs
from ladle.entrypoints.cli_args import ENGINE_KEYS, FLAGLESS, add_engine_flags


def _flags() -> dict[str, list[str]]:
    """Each engine flag's field (its dest) and spellings."""
    p = argparse.ArgumentParser(add_help=False)
    add_engine_flags(p)
    return {a.dest: a.option_strings for a in p._actions}


def test_every_field_has_a_flag_or_is_listed_flagless():
    names = {f.name for f in fields(EngineArgs)}
    assert names - FLAGLESS - set(_flags()) == set()
    assert names >= FLAGLESS, "FLAGLESS names a field EngineArgs no longer has"


def test_every_flag_sets_a_field_and_is_spelled_as_vllm_does():
    flags = _flags()
    assert set(flags) <= {f.name for f in fields(EngineArgs)} - FLAGLESS
    for name, spellings in flags.items():
        assert spellings[0] == "--" + name.replace("_", "-")
    for alias, name in ALIASES.items():
        assert "--" + alias.replace("_", "-") in flags[name]


def test_engine_keys_are_the_flagged_fields():
    assert set(ENGINE_KEYS) == set(_flags())
    assert len(ENGINE_KEYS) == len(set(ENGINE_KEYS))
