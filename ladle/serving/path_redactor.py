"""Failure text for HTTP clients, with the server's filesystem paths taken out: /health answers anyone, and an
engine failure often names a file (a checkpoint moved away, a corrupt shard, a cache directory). The server log
keeps the whole text."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

_PATH_CHAR = r"[^\s'\"(),;\[\]<>{}]"
# An absolute or home-relative POSIX path where a token starts. A path glued to a word, a URL's "//" or a
# placeholder already put in ("<model>/config.json") is left alone, so "tokens/s" and "3/4" survive.
_PATH = re.compile(rf"(?<![\w./~:>-])~?/{_PATH_CHAR}+")
OTHER_PATH = "<path>"


@dataclass(frozen=True)
class PathRedactor:
    """Replaces the named paths with their labels (so "<model>/config.json" still says which file), then any
    other path with <path>."""
    named: tuple[tuple[re.Pattern[str], str], ...]  # (path, label), the longest path first

    @classmethod
    def of(cls, labelled: dict[str, str | None]) -> PathRedactor:
        """labelled: label -> a path as the user gave it (None: not given). Each is also matched as the
        absolute and the resolved path, the forms an exception message is likely to quote."""
        pairs: dict[str, str] = {}
        for label, path in labelled.items():
            if not path:
                continue
            forms = {os.path.abspath(path), os.path.realpath(path)}
            if os.sep in path.rstrip(os.sep):  # a bare relative name ("model") is a word, not a path
                forms.add(os.path.normpath(path))
            for form in forms:
                if form != os.sep:
                    pairs.setdefault(form, label)
        # A whole path only: "/ckpt/m" is not the start of "/ckpt/m2" (though it is of "/ckpt/m/config.json"),
        # nor the end of "/x/ckpt/m".
        ordered = sorted(pairs.items(), key=lambda kv: -len(kv[0]))
        return cls(tuple((re.compile(rf"(?<![\w./~-]){re.escape(path)}(?=/|(?!{_PATH_CHAR}))"), label)
                         for path, label in ordered))

    def __call__(self, text: str) -> str:
        for path, label in self.named:
            text = path.sub(label, text)
        return _PATH.sub(OTHER_PATH, text)
