"""Every `creditaudit …` command the README and docs/ show, in a shell code block or inline, is one
the command line accepts as written: the options exist, take the values shown, and sit under the
subcommand shown (the parser alone: nothing runs). An upper-case stand-in (N, DIR, RULE, <folder>)
is parsed as the value 1, an ellipsis too where it stands for an option's value (else dropped), and a bare mention (`lint`, `audit --config`) is
prose, not parsed. Issue 36 found `audit --option decay=10` recommended by the
README and refused by `audit`; this is the test that would have caught it."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from creditaudit.cli import build_parser
from creditaudit.errors import CreditAuditError

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"", "bash", "sh", "shell", "console"}
COMMAND = re.compile(r"^(?:\S*/)?creditaudit\s+(.*)$")
PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z_]{0,8}|<[^>]*>)$")


def _shell_lines(text: str):
    """The lines of the shell code blocks (fences paired line by line), continuations joined."""
    fence, lines = None, []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = stripped[3:].strip() if fence is None else None
            continue
        if fence is not None and fence in SHELL:
            if lines and lines[-1].endswith("\\"):
                lines[-1] = lines[-1][:-1] + " " + stripped
            else:
                lines.append(stripped)
    return lines


def _inline(text: str):
    prose = re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.S | re.M)
    return re.findall(r"`((?:\S*/)?creditaudit [^`]+)`", prose.replace("\n", " "))


def doc_commands() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for line in _shell_lines(text) + _inline(text):
            for part in re.split(r"\s*(?:&&|\|\||;|\|)\s*", line.split(" #")[0]):
                m = COMMAND.match(part.strip())
                if m:
                    found.append((page.name, m.group(1).strip()))
    return found


COMMANDS = doc_commands()


def test_the_docs_show_commands_at_all():
    """The extraction finds the commands the pages show (the README's two set-up commands among them)."""
    assert len(COMMANDS) > 80
    assert ("README.md", "audit --preset quick") in COMMANDS


@pytest.mark.parametrize("page, command", COMMANDS, ids=[f"{p}: {c[:60]}" for p, c in COMMANDS])
def test_a_command_the_docs_show_is_accepted_as_written(page, command):
    # a stand-in is given a value of every type ("1": a count, a number, a name, a path); so is an
    # ellipsis in an option's place ("--weights ..."); elsewhere ("audit --out A ...") it is dropped
    argv = []
    for token in shlex.split(command):
        if token in ("…", "...") and not (argv and argv[-1].startswith("--")):
            continue
        argv.append("1" if PLACEHOLDER.match(token) or token in ("…", "...") else token)
    if len(argv) <= 1 or "--help" in argv or "-h" in argv:
        pytest.skip("a bare mention of a subcommand, or help")
    try:
        build_parser().parse_args(argv)
    except CreditAuditError as err:
        if len(argv) == 2 and argv[1].startswith("--"):
            pytest.skip("a mention of one option")
        pytest.fail(f"{page} shows `creditaudit {command}`, which the command line refuses: {err}")
