"""A profile-cache entry that is well-formed JSON but not what this start would measure (no points, one kind
only, NaN or absurd peaks, wrong shapes) must never stop an engine: it is named, deleted and profiled again."""
from __future__ import annotations

import copy
import json
import logging
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest

from ladle import LLM, SamplingParams
from ladle.startup import profile_cache
from ladle.startup.profiling import profile_shapes

_SMALL = dict(max_model_len=256, num_kv_blocks=16)  # profiles prefill 64/256 tokens, decodes up to 128 rows
_GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
_BOUND = 2**40  # the validator's peak bound in unit tests: any realistic peak is below it


@dataclass(frozen=True)
class Entry:
    name: str  # the file name, i.e. the key this engine's settings give
    raw: dict[str, Any]  # the entry as the engine stored it
    shapes: list[tuple[str, int, int]]


def _source(llm: LLM) -> str:
    return llm.config.settings["activation_profile"].value


@pytest.fixture(scope="module")
def valid_entry(tiny_qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Entry:
    """One start stores the entry; a second proves the validator accepts the engine's own entry."""
    folder = tmp_path_factory.mktemp("valid_profile")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LADLE_PROFILE_CACHE_DIR", str(folder))
        with LLM(tiny_qwen3_dir, **_SMALL) as llm:
            assert _source(llm) == "measured"
        with LLM(tiny_qwen3_dir, **_SMALL) as llm:
            assert _source(llm) == "cached"
    (path,) = folder.glob("*.json")
    raw = json.loads(path.read_text())
    return Entry(path.name, raw, [(p["kind"], p["num_tokens"], p["context"]) for p in raw["points"]])


def _points(raw: dict[str, Any]) -> list[dict[str, Any]]:
    return raw["points"]


def _set_first_peak(value: Any) -> Callable[[dict[str, Any]], Any]:
    def edit(raw: dict[str, Any]) -> Any:
        _points(raw)[0]["peak"] = value
        return raw
    return edit


# Each edit takes a deep copy of the valid entry and returns the JSON value (or raw text) to write.
_BAD: dict[str, Callable[[dict[str, Any]], Any]] = {
    "no points": lambda raw: {"points": []},
    "decode only": lambda raw: {"points": [p for p in _points(raw) if p["kind"] == "decode"]},
    "prefill only": lambda raw: {"points": [p for p in _points(raw) if p["kind"] == "prefill"]},
    "NaN peak": _set_first_peak(math.nan),  # json.dumps writes the bare token NaN
    "string peak": _set_first_peak("1000"),
    "1e18 peak": _set_first_peak(1e18),
    "10**18 peak": _set_first_peak(10**18),  # an integer, but over any device's memory
    "negative peak": _set_first_peak(-5),
    "bool peak": _set_first_peak(True),
    "missing shape": lambda raw: {"points": _points(raw)[:-1]},
    "duplicate point": lambda raw: {"points": _points(raw) + _points(raw)[:1]},
    "not JSON": lambda raw: "{not json",
}


@pytest.mark.parametrize("case", list(_BAD))
def test_a_bad_entry_is_discarded_and_profiled_again(case: str, valid_entry: Entry, tiny_qwen3_dir: str,
                                                     tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    # Per-test folder: the session's shared cache must never hold a corrupted entry.
    monkeypatch.setenv("LADLE_PROFILE_CACHE_DIR", str(tmp_path))
    path = tmp_path / valid_entry.name
    bad = _BAD[case](copy.deepcopy(valid_entry.raw))
    path.write_text(bad if isinstance(bad, str) else json.dumps(bad))
    with caplog.at_level(logging.WARNING, logger="ladle"):
        with LLM(tiny_qwen3_dir, **_SMALL) as llm:
            assert _source(llm) == "measured"
            (out,) = llm.generate([{"prompt_token_ids": [1, 2, 3]}], _GREEDY, use_tqdm=False)
            assert len(out.outputs[0].token_ids) == 4
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and str(path) in r.getMessage()]
    assert len(warnings) == 1 and "discarded, profiling again" in warnings[0], caplog.text
    # The bad file was replaced by a fresh entry this start would accept.
    fresh = json.loads(path.read_text())
    profile_cache.check_entry(fresh, valid_entry.shapes, _BOUND)


def test_shapes_the_profile_repeats_are_cached(tiny_qwen3_dir: str, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Few rows and a context within one tile measure the same decode shape twice (the fit needs both):
    the validator counts shapes, so the engine's own entry is still served."""
    shapes = profile_shapes([64, 256], 256, [2])
    assert shapes.count(("decode", 2, 256)) == 2
    monkeypatch.setenv("LADLE_PROFILE_CACHE_DIR", str(tmp_path))
    sources = []
    for _ in range(2):
        with LLM(tiny_qwen3_dir, max_num_seqs=2, **_SMALL) as llm:
            sources.append(_source(llm))
    assert sources == ["measured", "cached"]


def test_an_unreadable_file_is_named_and_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("LADLE_PROFILE_CACHE_DIR", str(tmp_path))
    (tmp_path / "k.json").write_bytes(b"\xff\xfe")  # not UTF-8
    with caplog.at_level(logging.WARNING, logger="ladle"):
        assert profile_cache.load("k", [], _BOUND) is None
    assert str(tmp_path / "k.json") in caplog.text and "unreadable" in caplog.text
    assert not (tmp_path / "k.json").exists()
    assert profile_cache.load("absent", [], _BOUND) is None  # no file: no warning, nothing to discard
    assert caplog.text.count("discarded") == 1


def test_a_file_that_cannot_be_deleted_still_does_not_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LADLE_PROFILE_CACHE_DIR", str(tmp_path))
    (tmp_path / "k.json").mkdir()  # read_text and unlink both raise OSError
    assert profile_cache.load("k", [], _BOUND) is None
    shutil.rmtree(tmp_path / "k.json")


_SHAPES = [("prefill", 64, 64), ("prefill", 64, 256), ("decode", 16, 256), ("decode", 4, 256)]


def _entry() -> dict[str, Any]:
    return {"points": [dict(kind=k, num_tokens=n, context=c, peak=1000 + i) for i, (k, n, c) in enumerate(_SHAPES)]}


def _with(index: int, **fields: Any) -> dict[str, Any]:
    raw = _entry()
    raw["points"][index].update(fields)
    return raw


def _without(index: int, field: str) -> dict[str, Any]:
    raw = _entry()
    del raw["points"][index][field]
    return raw


def test_the_validator_accepts_a_good_entry() -> None:
    points = profile_cache.check_entry(_entry(), _SHAPES, _BOUND)
    got = [(p.kind, p.num_tokens, p.context, p.peak) for p in points]
    assert got == [(*s, 1000 + i) for i, s in enumerate(_SHAPES)]
    assert profile_cache.check_entry(_with(0, peak=0), _SHAPES, _BOUND)[0].peak == 0
    assert profile_cache.check_entry(_with(0, peak=_BOUND), _SHAPES, _BOUND)[0].peak == _BOUND
    reordered = {"points": _entry()["points"][::-1]}  # order does not matter, only the shapes
    assert len(profile_cache.check_entry(reordered, _SHAPES, _BOUND)) == 4


@pytest.mark.parametrize("raw, why", [
    ([], "not an object"),
    ({"points": {}}, "not an object"),
    ({"points": [], "extra": 1}, "not an object"),
    ({"points": [1]}, "point 0 has int"),
    (_with(1, extra=1), "point 1 has .*extra"),
    (_without(2, "peak"), "point 2 has .*not the fields"),
    (_with(0, kind="Prefill"), "kind 'Prefill'"),
    (_with(0, kind=1), "kind 1"),
    (_with(0, peak="5"), "peak of prefill 64@64 is '5', not an integer"),
    (_with(0, peak=5.0), "peak of prefill 64@64 is 5.0, not an integer"),
    (_with(0, peak=False), "peak of prefill 64@64 is False, not an integer"),
    (_with(0, num_tokens=True), "num_tokens True, not an integer"),
    (_with(0, context=64.5), "context 64.5, not an integer"),
    (_with(0, num_tokens=None), "num_tokens None"),
    (_with(2, peak=-5), r"peak of decode 16@256 is -5"),
    (_with(3, peak=_BOUND + 1), r"peak of decode 4@256 is \d+, outside 0\.\."),
    ({"points": _entry()["points"][:3]}, "missing decode 4@256"),
    ({"points": _entry()["points"] + _entry()["points"][:1]}, "unexpected prefill 64@64"),
    (_with(1, context=999), "missing prefill 64@256; unexpected prefill 64@999"),
])
def test_the_validator_says_what_is_wrong(raw: Any, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        profile_cache.check_entry(raw, _SHAPES, _BOUND)


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_json_constants_are_unreadable(token: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("LADLE_PROFILE_CACHE_DIR", str(tmp_path))
    text = json.dumps(_entry()).replace('"peak": 1000', f'"peak": {token}')
    assert token in text
    (tmp_path / "k.json").write_text(text)
    with caplog.at_level(logging.WARNING, logger="ladle"):
        assert profile_cache.load("k", _SHAPES, _BOUND) is None
    assert f"{token} is not a measured value" in caplog.text and not (tmp_path / "k.json").exists()
