"""`creditaudit lint`: each rule on its fixture, the near misses, suppression, exit codes, the CLI,
and proof that the checked code is never executed."""
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from creditaudit.errors import CreditAuditError
from creditaudit.lint import Finding, lint_paths, lint_source, run_lint

FIXTURES = Path(__file__).parent / "lint_fixtures"
SENTINEL = FIXTURES / "_lint_executed_me.txt"  # never_run.py's SENTINEL, were it ever run

# fixture -> the (line, code) of every finding it must give, in order
EXPECTED = {
    "ca101_norm_dim.py": [(7, "CA101"), (8, "CA101"), (9, "CA101"), (10, "CA101"), (11, "CA101")],
    "ca102_cosine_similarity.py": [(n, "CA102") for n in range(10, 15)],
    "ca103_clamped_denominator.py": [(n, "CA103") for n in (10, 11, 12, 13, 14, 17, 20)],
    "ca104_fp16.py": [(n, "CA104") for n in (7, 13, 19, 20, 21)],
    "ca105_torch_load.py": [(6, "CA105")],
    "ca106_feedback.py": [(16, "CA106"), (16, "CA106"), (17, "CA106"), (22, "CA106"),
                          (27, "CA106"), (33, "CA106"), (33, "CA106")],
    "ca107_train_mode.py": [(16, "CA107"), (21, "CA107")],
}


def _codes(findings):
    return [(f.line, f.code) for f in findings]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_rule_fixture_gives_exactly_its_findings(name):
    findings = lint_paths([FIXTURES / name])
    assert _codes(findings) == EXPECTED[name]
    for f in findings:  # one line each, saying why and what to write instead
        line = f.format()
        assert line.startswith(f"{FIXTURES / name}:{f.line}:{f.col}: {f.code} ")
        assert "\n" not in line and " — fix: " in line and f.message and f.fix


def test_ca106_says_which_problem():
    messages = [(f.line, f.message) for f in lint_paths([FIXTURES / "ca106_feedback.py"])]
    unseeded = {line for line, m in messages if "without a seeded generator" in m}
    unsaved = {line for line, m in messages if "never saved with the checkpoint" in m}
    assert unseeded == {16, 17, 27, 33}
    assert unsaved == {16, 22, 33}


def test_near_misses_are_silent():
    assert lint_paths([FIXTURES / "near_misses.py"]) == []


def test_ignore_comment_silences_exactly_its_line_and_codes():
    assert _codes(lint_paths([FIXTURES / "suppressed.py"])) == [
        (9, "CA101"),   # ignore[CA102] on a line that also has a CA101
        (10, "CA102"),  # ignore[CA101, CA105] does not cover CA102
        (11, "CA102"),  # no comment: the line above does not leak down
    ]


def test_lint_source_suppression_inline():
    src = "import torch\nx = torch.load(p, weights_only=False)  # creditaudit: ignore[ca105]\n"
    assert lint_source(src) == []
    assert _codes(lint_source(src.replace("ca105", "CA101"))) == [(2, "CA105")]
    marker_in_string = ('import torch\n'
                        's = "# creditaudit: ignore"; torch.load(p, weights_only=False)\n')
    assert _codes(lint_source(marker_in_string)) == [(2, "CA105")]


def test_finding_format():
    f = Finding("a.py", 3, 5, "CA105", "why", "what")
    assert f.format() == "a.py:3:5: CA105 why — fix: what"


def test_unreadable_sources_are_findings_not_tracebacks(tmp_path):
    (tmp_path / "broken.py").write_text("def f(:\n    pass\n")
    (tmp_path / "latin1.py").write_bytes(b"x = 1\ns = '\xe9'\n")
    (tmp_path / "nul.py").write_bytes(b"x = 1\x00\n")
    findings = lint_paths([tmp_path])
    assert [(Path(f.path).name, f.line, f.code) for f in findings] == [
        ("broken.py", 1, "CA100"), ("latin1.py", 2, "CA100"), ("nul.py", 1, "CA100")]


def test_folders_are_walked_skipping_hidden_and_venv(tmp_path):
    bad = "import torch\ntorch.load(p, weights_only=False)\n"
    for rel in ("pkg/a.py", "pkg/sub/b.py", ".hidden/c.py", ".venv/d.py", "pkg/__pycache__/e.py",
                "lib/site-packages/f.py", "pkg/notes.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(bad)
    findings = lint_paths([tmp_path])
    assert [Path(f.path).relative_to(tmp_path).as_posix() for f in findings] == \
        ["pkg/a.py", "pkg/sub/b.py"]


def test_run_lint_exit_status_and_summary():
    out = io.StringIO()
    assert run_lint([str(FIXTURES / "ca105_torch_load.py")], out) == 1
    lines = out.getvalue().splitlines()
    assert lines[0].startswith(f"{FIXTURES / 'ca105_torch_load.py'}:6:")
    assert lines[-1] == "1 finding in 1 file"
    out = io.StringIO()
    assert run_lint([str(FIXTURES / "near_misses.py")], out) == 0
    assert out.getvalue() == "no findings in 1 file\n"


def test_missing_path_raises_one_clear_error(tmp_path):
    missing = tmp_path / "nope.py"
    with pytest.raises(CreditAuditError) as err:
        run_lint([str(FIXTURES / "near_misses.py"), str(missing)], io.StringIO())
    assert str(missing) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(CreditAuditError):
        lint_paths([missing])


def test_the_linter_never_executes_the_code():
    SENTINEL.unlink(missing_ok=True)
    findings = lint_paths([FIXTURES / "never_run.py"])
    assert _codes(findings) == [(15, "CA105")]  # it was checked ...
    assert not SENTINEL.exists()                # ... and not run


@pytest.fixture(scope="module")
def cli_runs():
    """The three CLI runs, started together: each subprocess pays torch's import once."""
    args = {"findings": [str(FIXTURES)], "clean": [str(FIXTURES / "near_misses.py")],
            "missing": [str(FIXTURES / "no_such_file.py")]}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    SENTINEL.unlink(missing_ok=True)
    procs = {key: subprocess.Popen([sys.executable, "-m", "creditaudit", "lint", *paths],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env=env)
             for key, paths in args.items()}
    results = {}
    for key, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        results[key] = (proc.returncode, out, err)
    return results


def test_cli_reports_findings_with_exit_1(cli_runs):
    code, out, err = cli_runs["findings"]
    assert code == 1, err
    assert f"{FIXTURES / 'ca105_torch_load.py'}:6:" in out
    assert f"{FIXTURES / 'never_run.py'}:15:" in out
    assert "near_misses.py" not in out
    assert out.splitlines()[-1].endswith(f"in {len(list(FIXTURES.glob('*.py')))} files")
    assert not SENTINEL.exists()


def test_cli_clean_file_exit_0(cli_runs):
    code, out, err = cli_runs["clean"]
    assert (code, out, err) == (0, "no findings in 1 file\n", "")


def test_cli_missing_path_exit_2_one_line(cli_runs):
    code, out, err = cli_runs["missing"]
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "no_such_file.py" in err
