"""What a client sees of an engine failure names no file of the server's: the model and tokenizer paths become
their labels (in every form an exception quotes), any other path <path>; text that only looks like one stays."""
from __future__ import annotations

import os

from ladle.serving.path_redactor import PathRedactor


def test_named_paths_become_labels_and_other_paths_go(tmp_path):
    model = tmp_path / "ckpts" / "m"
    redact = PathRedactor.of({"<model>": str(model), "<tokenizer>": None})
    text = (f"model directory '{model}' has no config.json; {model}/model.safetensors; {model}2/x; "
            f"/other{model}; No such file: '/home/alice/.cache/ladle/p.json' (~/secret)")
    out = redact(text)
    assert out == ("model directory '<model>' has no config.json; <model>/model.safetensors; <path>; <path>; "
                   "No such file: '<path>' (<path>)"), out


def test_relative_and_resolved_forms_are_named_too(tmp_path, monkeypatch):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "d").mkdir()
    os.symlink(real, tmp_path / "d" / "link")
    monkeypatch.chdir(tmp_path)
    # A bare name ("tok") is a word, matched nowhere; a relative path is matched as given, absolute and resolved.
    redact = PathRedactor.of({"<model>": "d/link/", "<tokenizer>": "tok"})
    text = f"{real}/a {tmp_path}/d/link/b d/link/c tok/d"
    assert redact(text) == "<model>/a <model>/b <model>/c tok/d"


def test_text_that_only_looks_like_a_path_stays():
    redact = PathRedactor.of({"<model>": "/ckpt/m"})
    text = "engine process 7 was killed by SIGKILL; 12 tokens/s, 3/4 done, see http://host/x"
    assert redact(text) == text
