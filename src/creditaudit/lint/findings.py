"""A finding (`path:line:col: CODE message — fix`) and the `# creditaudit: ignore[...]` comments
that silence findings on their line."""
from __future__ import annotations

import io
import re
import tokenize
from dataclasses import dataclass

_IGNORE = re.compile(r"#\s*creditaudit:\s*ignore(?:\[([^\]]*)\])?", re.IGNORECASE)


@dataclass(frozen=True)
class Finding:
    """One pitfall at `path:line:col` (1-based line and column)."""
    path: str
    line: int
    col: int
    code: str
    message: str
    fix: str

    def format(self) -> str:
        return f"{self.path}:{self.line}:{self.col}: {self.code} {self.message} — fix: {self.fix}"


def _suppressions(source: str) -> dict[int, frozenset[str] | None]:
    """line -> codes silenced there (None: all), from `# creditaudit: ignore[...]` comments."""
    comments: list[tuple[int, str]] = []
    try:  # tokenize so that the marker inside a string literal does not count
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                comments.append((tok.start[0], tok.string))
    except (tokenize.TokenError, SyntaxError):
        comments = [(i, line) for i, line in enumerate(source.splitlines(), 1) if "#" in line]
    out: dict[int, frozenset[str] | None] = {}
    for line, text in comments:
        match = _IGNORE.search(text)
        if match:
            codes = match.group(1)
            out[line] = None if codes is None else frozenset(
                c.strip().upper() for c in codes.split(",") if c.strip())
    return out
