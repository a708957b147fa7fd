"""Fault injection: bad values, edited records, unwritable or full output folders, killed and
concurrent audits, corrupt IDX files, and `check`'s exit codes.

Every case asserts the exit code; a user error is one `creditaudit: error: ...` line on stderr and
never a traceback; and nothing finished is lost (a rerun resumes or reuses it). Cheap cases call
`creditaudit.cli.main` in this process; the ones that need a real process of their own (a file-size
limit, a killed parent, a second process holding the lock) run `python -m creditaudit`.
Linux only (RLIMIT_FSIZE, /proc, PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import resource
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from creditaudit import store
from creditaudit.cli import main as cli_main
from creditaudit.runs import load_run

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="uses RLIMIT_FSIZE, /proc and PR_SET_PDEATHSIG")

TINY = ["--dataset", "digits", "--width", "16", "--blocks", "2", "--seed", "42", "--method", "bp",
        "--quiet", "--threads", "1", "--device", "cpu"]
INT64_OVER = str(2 ** 63)


# -- helpers -----------------------------------------------------------------------------------
def cli(argv, capsys) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of the CLI run in this process."""
    try:
        code = cli_main([str(a) for a in argv])
    except SystemExit as exc:              # argparse refuses a value itself
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def quiet_cli(argv) -> int:
    """The CLI in this process, its output discarded (for fixtures, which have no capsys)."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return cli_main([str(a) for a in argv])


def spawn(argv, **kw) -> subprocess.Popen:
    # the environment as the test stands (its `every_epoch` fixture included), one thread
    return subprocess.Popen([sys.executable, "-m", "creditaudit", *map(str, argv)],
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def one_error_line(code: int, err: str, *needles: str) -> str:
    """Exit 2, exactly one stderr line `creditaudit: error: ...` matching every needle (regex)."""
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("creditaudit: error:"), (code, err)
    for needle in needles:
        assert re.search(needle, lines[0], re.I), (needle, lines[0])
    return lines[0]


def parser_error(code: int, err: str, needle: str) -> None:
    """A value refused by the option parser itself: exit 2, exactly one `creditaudit: error:` line
    naming the option, no usage block, no traceback."""
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, err)
    assert lines[0].startswith("creditaudit: error:") and needle in lines[0], lines[0]


def audit_toml(path: Path) -> Path:
    """An audit TOML with the tiny model (the audit has no --width / --blocks options)."""
    path.write_text("[model]\nwidth = 16\nblocks = 2\n")
    return path


def audit_args(config: Path, out: Path, *, methods=("bp",), seeds=(42,), epochs=2, jobs=1):
    return ["audit", "--config", config, "--dataset", "digits", "--methods", *methods,
            "--seeds", *seeds, "--epochs", epochs, "--out", out, "--jobs", jobs, "--device", "cpu",
            "--quiet"]


def _holds(predicate) -> bool:
    try:
        return bool(predicate())
    except OSError:                    # a file not there yet, or being replaced
        return False


def wait_for(predicate, proc: subprocess.Popen | None = None, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not _holds(predicate):
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the process ended early (exit {proc.returncode}): {out[-1500:]} {err[-1500:]}")
        if time.monotonic() > deadline:
            pytest.fail("timed out waiting")
        time.sleep(0.02)


def _file_size_limit(limit: int):
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]

    def preexec():  # EFBIG instead of death by SIGXFSZ once a write passes the limit
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    return preexec


def _history(run_dir) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "wall_time"} for r in load_run(run_dir).history]


def verdict_code(line: str) -> int:
    """The exit code `check` owes a printed verdict line."""
    if "walk back" in line:
        return 1
    return 0 if re.search(r"\btrustworthy\b", line) and "incomplete" not in line else 3


# -- 1. bad values are refused before any training -----------------------------------------------
@pytest.mark.parametrize("extra, needle", [
    (["--lr", "nan"], "--lr"), (["--lr", "inf"], "--lr"), (["--weight-decay", "nan"], "--weight-decay"),
    (["--w2-std", "inf"], "--w2-std")])
def test_non_finite_option_is_refused_by_the_parser(extra, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(["train", *TINY, "--epochs", 2, *extra], capsys)
    parser_error(code, err, needle)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, needles", [
    (["train", *TINY, "--epochs", 2, "--seed", INT64_OVER], ["seed", "2\\^63"]),
    (["train", *TINY, "--epochs", 2, "--blocks", 0], ["--blocks must be ≥ 1", "--shallow"]),
    (["audit", "--dataset", "digits", "--methods", "bp", "--seeds", INT64_OVER, "--epochs", 2,
      "--out", "aud", "--quiet"], ["seeds", "2\\^63"]),
])
def test_bad_run_value_is_one_line_and_trains_nothing(argv, needles, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    one_error_line(*cli(argv, capsys)[::2], *needles)
    assert list(tmp_path.iterdir()) == []                     # no runs/, no audit folder


@pytest.mark.parametrize("toml, needle", [
    ('[training]\nlr = nan\n', r"lr must be a finite number"),
    ('methods = "bp"\n', r"methods .* must be a non-empty list"),
    ('methods = ["bp", "bp"]\n', r"more than once"),
])
def test_bad_toml_value_is_one_line_and_trains_nothing(toml, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "bad.toml"
    config.write_text(f'dataset = "digits"\nseeds = [42]\nepochs = 2\nout = "aud"\n{toml}')
    one_error_line(*cli(["audit", "--config", config, "--quiet"], capsys)[::2], needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.toml"]


def test_too_many_eval_batches_is_refused_before_training(capsys, tmp_path):
    out = tmp_path / "aud"
    argv = audit_args(audit_toml(tmp_path / "a.toml"), out) + ["--eval-batches", 100000]
    one_error_line(*cli(argv, capsys)[::2], "eval batches", "--eval-batches")
    assert not (out / "runs").exists()


# -- 2. edited records are refused ----------------------------------------------------------------
@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("run") / "r"
    assert quiet_cli(["train", *TINY, "--epochs", 2, "--out", run]) == 0
    return run


def _edit_json(path: Path, edit) -> None:
    obj = json.loads(path.read_text())
    edit(obj)
    path.write_text(json.dumps(obj, indent=2))


def _set_test_acc(meta):
    meta["skeleton"]["__dict__"]["history"][-1]["__dict__"]["test_acc"] = 0.99


@pytest.mark.parametrize("name, edit, needle", [
    ("checkpoint.json", _set_test_acc, "integrity|modified"),
    ("checkpoint.json", lambda m: m.update(epoch=1), "integrity|modified"),
    ("status.json", lambda s: s.update(status="stopped"), "integrity|modified"),
    ("config.json", lambda c: c.update(seed=43), "edited|does not match"),
])
def test_edited_run_record_is_refused(trained_run, name, edit, needle, capsys, tmp_path):
    run = tmp_path / "r"
    shutil.copytree(trained_run, run)
    _edit_json(run / name, edit)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    line = one_error_line(*cli(["diagnose", run, "--threads", 1, "--device", "cpu"], capsys)[::2], needle)
    assert name in line
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before   # refused, nothing rewritten


@pytest.fixture(scope="module")
def bp_audit(tmp_path_factory):
    """bp × 3 seeds × 3 epochs with its controls (case 8; its audit.json is edited in case 2)."""
    root = tmp_path_factory.mktemp("bp_audit")
    out = root / "aud"
    code = quiet_cli(audit_args(audit_toml(root / "a.toml"), out, seeds=(42, 123, 456), epochs=3))
    assert code in (0, 3)
    return out


@pytest.mark.parametrize("command", ["check", "report"])
def test_edited_audit_verdict_is_refused(bp_audit, command, capsys, tmp_path):
    out = tmp_path / "aud"
    shutil.copytree(bp_audit, out)
    flip = lambda v: "walk back: (d)" if v == "trustworthy" else "trustworthy"
    _edit_json(out / "audit.json", lambda a: a["methods"][0].update(verdict=flip(a["methods"][0]["verdict"])))
    md = (out / "audit.md").read_bytes()
    one_error_line(*cli([command, out], capsys)[::2], "audit.json", "integrity|modified")
    assert (out / "audit.md").read_bytes() == md


def test_edited_checkpoint_in_an_audit_fails_that_run_instead_of_passing(bp_audit, capsys, tmp_path):
    """The issue's case: test_acc raised by hand in a finished run's checkpoint.json, then the
    audit rerun. The run is recorded as failed (integrity), never reused or re-trained silently."""
    out = tmp_path / "aud"
    shutil.copytree(bp_audit, out)
    config = audit_toml(tmp_path / "a.toml")
    run = next(out.glob("runs/bp-none-s42-*"))
    _edit_json(run / "checkpoint.json", _set_test_acc)
    edited = (run / "checkpoint.json").read_bytes()
    code, _, err = cli(audit_args(config, out, seeds=(42, 123, 456), epochs=3), capsys)
    assert code == 3 and "Traceback" not in err, (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("creditaudit: 1 run(s) failed"), err
    assert "exit status 3" in lines[0]                               # the closing line explains exit 3
    assert "run the same command again" not in lines[0] and "integrity" in lines[0]   # it would repeat
    result = json.loads((out / "audit.json").read_text())
    bad = next(r for r in result["runs"] if r["label"] == "bp/s42")
    assert bad["status"] == "failed" and re.search("integrity|modified", bad["message"])
    assert result["methods"][0]["verdict"].startswith("incomplete")
    assert not any(r["trained_now"] for r in result["runs"] if r["label"] != "bp/s42")
    assert (run / "checkpoint.json").read_bytes() == edited          # left for the user to restore


# -- 3. an output folder that cannot be written ---------------------------------------------------
def test_read_only_out_folder(capsys, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as root: chmod 0o555 leaves the folder writable "
                        "(test_out_path_blocked_by_a_file covers the same path)")
        one_error_line(*cli(["train", *TINY, "--epochs", 2, "--out", ro / "run"], capsys)[::2],
                       re.escape(str(ro / "run")), "permission")
        config = audit_toml(tmp_path / "a.toml")
        one_error_line(*cli(audit_args(config, ro / "aud"), capsys)[::2], re.escape(str(ro / "aud")))
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o755)


@pytest.mark.parametrize("where", ["parent", "itself"])
def test_out_path_blocked_by_a_file(where, capsys, tmp_path):
    """A file where the output folder (or its parent) should be: refused in one line naming it."""
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder\n")
    run_out = blocker / "run" if where == "parent" else blocker
    says = "cannot write" if where == "parent" else "is a file, not a folder"
    line = one_error_line(*cli(["train", *TINY, "--epochs", 2, "--out", run_out], capsys)[::2], says)
    assert str(run_out) in line
    aud_out = blocker / "aud" if where == "parent" else blocker
    line = one_error_line(*cli(audit_args(audit_toml(tmp_path / "a.toml"), aud_out), capsys)[::2], says)
    assert str(aud_out) in line
    assert blocker.read_text() == "not a folder\n"


# -- 4. a full disk (RLIMIT_FSIZE) mid-training ----------------------------------------------------
def test_full_disk_during_train_keeps_the_last_checkpoint_and_resumes(capsys, tmp_path, every_epoch):
    argv = ["train", *TINY, "--epochs", 3]
    assert cli([*argv, "--out", tmp_path / "whole"], capsys)[0] == 0     # the uninterrupted reference
    # epoch 0 (no optimizer moments yet) fits under the limit; epoch 1's tensors file does not
    limit = next((tmp_path / "whole").glob("checkpoint-e*.safetensors")).stat().st_size - 1
    out = tmp_path / "full"
    proc = spawn([*argv, "--out", out], preexec_fn=_file_size_limit(limit))
    _, err = proc.communicate(timeout=300)
    line = one_error_line(proc.returncode, err, "cannot write to", "run the same command again")
    kept = re.search(r"checkpoint of epoch (\d+) is kept", line)
    assert kept or "no checkpoint is kept yet" in line, line
    if kept:
        meta, _ = store.load_checkpoint(out)                 # the kept checkpoint is intact
        assert meta["epoch"] == int(kept.group(1)) < 3
    assert not (out / "status.json").exists()
    assert cli([*argv, "--out", out], capsys)[0] == 0        # no limit: resumes and finishes
    run = load_run(out)
    assert run.status["status"] == "finished" and run.epochs_completed == 3
    assert _history(out) == _history(tmp_path / "whole")    # exactly the uninterrupted run


def test_full_disk_during_audit_records_the_failed_run_and_rerun_completes(capsys, tmp_path, every_epoch):
    # width 128: the main run's epoch-1 checkpoint (~0.9 MB) passes the limit, its epoch-0 one,
    # the controls' checkpoints and the report files (≤ 0.3 MB) do not
    config = tmp_path / "a.toml"
    config.write_text("[model]\nwidth = 128\nblocks = 2\n")
    out = tmp_path / "aud"
    argv = audit_args(config, out)
    proc = spawn(argv, preexec_fn=_file_size_limit(640 * 1024))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 3 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and re.match(r"creditaudit: 1 run\(s\) failed.*run the same command again",
                                        lines[0]), err
    runs = {r["label"]: r for r in json.loads((out / "audit.json").read_text())["runs"]}
    assert runs["bp/s42"]["status"] == "failed"
    assert re.search(r"cannot write .*checkpoint of epoch 0 is kept", runs["bp/s42"]["message"])
    assert runs["bp/frozen/s42"]["status"] == runs["bp/shallow/s42"]["status"] == "finished"

    code, _, err = cli(argv, capsys)                       # no limit: the failed run resumes
    assert "Traceback" not in err
    result = json.loads((out / "audit.json").read_text())
    runs = {r["label"]: r for r in result["runs"]}
    assert all(r["status"] == "finished" for r in runs.values()), runs
    assert not runs["bp/frozen/s42"]["trained_now"] and not runs["bp/shallow/s42"]["trained_now"]
    assert runs["bp/s42"]["trained_now"] and runs["bp/s42"]["epochs_completed"] == 2
    assert code == (3 if result["methods"][0]["verdict"].startswith("incomplete") else 0), (code, err)


def test_full_disk_while_writing_into_the_audit_folder_is_one_line(bp_audit, capsys, tmp_path):
    """`thresholds DIR` writes thresholds.json into the audit folder: on a full disk, one line, exit
    2. In this process (Python ignores SIGXFSZ), with only the soft limit lowered, then restored."""
    out = tmp_path / "aud"
    shutil.copytree(bp_audit, out)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, hard))
    try:
        code, _, err = cli(["thresholds", out], capsys)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    one_error_line(code, err, "cannot write", "run the same command again")
    json.loads((out / "audit.json").read_text())              # the audit itself is intact


# -- 5 and 6. killing the audit's parent leaves no orphans; a second audit on its folder is refused
def _processes() -> dict[int, tuple[str, int, str]]:
    """pid → (state, ppid, start time) of every process."""
    procs = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            procs[int(entry)] = (fields[0], int(fields[1]), fields[19])
    return procs


def _descendants(root: int) -> dict[int, str]:
    procs, found = _processes(), {root}
    grew = True
    while grew:
        new = {pid for pid, (_, ppid, _) in procs.items() if ppid in found} - found
        found |= new
        grew = bool(new)
    return {pid: procs[pid][2] for pid in found if pid in procs}


def _cmdline_mentions(text: str) -> list[int]:
    hits = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if text in Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace"):
                    hits.append(int(entry))
            except OSError:
                pass
    return hits


def _alive(snapshot: dict[int, str]) -> list[int]:
    procs = _processes()
    return [pid for pid, start in snapshot.items()
            if pid in procs and procs[pid][2] == start and procs[pid][0] not in "ZX"]


def _wait_gone(family: dict[int, str], out: Path, seconds: float = 10.0) -> list:
    """Wait until no process of `family` lives and none names `out`; what is left after `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = _alive(family) + _cmdline_mentions(str(out))
        if not left:
            return []
        time.sleep(0.1)
    return _alive(family) + _cmdline_mentions(str(out))


def _kill_when(argv, out: Path, sig: signal.Signals) -> dict:
    """Start the audit (own session), kill its parent with `sig` once one more run has finished
    (others are then under way in the workers), and say what happened."""
    finished_before = len(list(out.glob("runs/*/status.json")))
    proc = spawn(argv, start_new_session=True)
    try:
        wait_for(lambda: len(list(out.glob("runs/*/status.json"))) > finished_before, proc)
        family = _descendants(proc.pid)
        finished = {p.parent.name for p in out.glob("runs/*/status.json")}
        os.kill(proc.pid, sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return {"code": proc.returncode, "err": err, "family": family, "finished": finished,
            "left": _wait_gone(family, out), "audit_json": (out / "audit.json").exists()}


@pytest.fixture(scope="module")
def killed_then_raced(tmp_path_factory):
    """One audit folder through cases 5 and 6, in the order a user would meet them (one sequence,
    so that the slow part — starting processes that import torch — is paid three times, not six):

    1. the audit (bp, dfa; 6 runs; --jobs 2) is killed with SIGKILL once a run has finished;
    2. the same audit is started again and stopped with SIGTERM once one more run has finished;
    3. the same audit runs to the end in the background (--jobs 1), and while it holds the lock a
       second identical audit is started in this process.
    """
    root = tmp_path_factory.mktemp("killed")
    out = root / "aud"
    argv = audit_args(audit_toml(root / "a.toml"), out, methods=("bp", "dfa"), epochs=10, jobs=2)
    sigkill = _kill_when(argv, out, signal.SIGKILL)
    sigterm = _kill_when(argv, out, signal.SIGTERM)
    first = spawn([*argv, "--jobs", 1])
    try:
        lock = out / ".creditaudit.lock"
        wait_for(lambda: lock.read_text().strip() == str(first.pid), first)
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            t0 = time.monotonic()
            second = cli_main([str(a) for a in [*argv, "--jobs", 1]])
            seconds = time.monotonic() - t0
        still_running = first.poll() is None
        _, first_err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    return {"out": out, "sigkill": sigkill, "sigterm": sigterm,
            "second": (second, err.getvalue(), seconds, still_running),
            "first": (first.returncode, first_err)}


def test_sigkill_of_the_audit_leaves_no_orphans(killed_then_raced):
    k = killed_then_raced["sigkill"]
    assert len(k["family"]) >= 3, k["family"]              # the audit and its two workers at least
    assert k["left"] == [], f"still alive 10 s after the kill: {k['left']}"
    assert k["code"] == -signal.SIGKILL and not k["audit_json"]


def _pid_job(_: int) -> dict:
    return {"pid": os.getpid()}


def test_closing_the_pool_ends_its_workers_and_a_later_map_starts_new_ones():
    """An audit closes its pool once every map has returned: its workers exit (each flushing what
    it printed), none is left running, and the executor still serves a later map."""
    from creditaudit.runner.local import LocalExecutor
    ex = LocalExecutor(2)
    first = {r["pid"] for r in ex.map(_pid_job, [0, 1, 2, 3], lambda i, r: None)}
    procs = list(ex._pool._processes.values())
    assert {p.pid for p in procs} >= first and len(procs) == 2
    ex.close()
    assert not ex.running
    deadline = time.monotonic() + 5
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(p.is_alive() for p in procs), [p.pid for p in procs if p.is_alive()]
    again = {r["pid"] for r in ex.map(_pid_job, [0, 1], lambda i, r: None)}
    assert again and not again & first
    ex.close()


def test_sigterm_of_the_audit_is_a_clean_exit_without_orphans(killed_then_raced):
    k = killed_then_raced["sigterm"]
    assert len(k["family"]) >= 3, k["family"]
    assert k["left"] == [], f"still alive 10 s after SIGTERM: {k['left']}"
    assert k["code"] == 130 and "Traceback" not in k["err"], (k["code"], k["err"])
    lines = k["err"].strip().splitlines()
    assert len(lines) == 1 and "interrupted" in lines[0] and "run the same command again" in lines[0], k["err"]
    assert not k["audit_json"]


def test_second_audit_on_the_same_folder_is_refused_at_once(killed_then_raced):
    code, err, seconds, still_running = killed_then_raced["second"]
    out = killed_then_raced["out"]
    one_error_line(code, err, r"another creditaudit process \(pid \d+\) is working on", re.escape(str(out)))
    assert still_running and seconds < 30     # refused while the first works on, not after it


def test_rerun_after_the_kills_completes_and_keeps_finished_runs(killed_then_raced):
    code, err = killed_then_raced["first"]
    assert code in (0, 3) and "Traceback" not in err, (code, err)
    result = json.loads((killed_then_raced["out"] / "audit.json").read_text())
    runs = result["runs"]
    assert len(runs) == 6 and all(r["status"] == "finished" for r in runs), \
        [(r["label"], r["status"], r["message"]) for r in runs]       # no run failed in a race
    reused = {Path(r["run_dir"]).name for r in runs if not r["trained_now"]}
    assert killed_then_raced["sigterm"]["finished"] <= reused          # finished before a kill: kept
    incomplete = any(m["verdict"].startswith("incomplete") for m in result["methods"])
    assert code == (3 if incomplete else 0)


# -- 7. corrupt IDX files -------------------------------------------------------------------------------
def _write_idx(path: Path, dims, data: bytes = b"") -> None:
    path.write_bytes(bytes([0, 0, 8, len(dims)]) + b"".join(struct.pack(">I", d) for d in dims) + data)


def _mnist_folder(root: Path, n_train: int = 32, n_test: int = 16) -> Path:
    folder = root / "mnist"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        _write_idx(folder / f"{prefix}-images-idx3-ubyte", (n, 28, 28),
                   rng.integers(0, 256, (n, 28, 28), dtype=np.uint8).tobytes())
        _write_idx(folder / f"{prefix}-labels-idx1-ubyte", (n,),
                   rng.integers(0, 10, n, dtype=np.uint8).tobytes())
    return folder


@pytest.mark.parametrize("fault, needle", [
    ("empty train split", "holds 0 images"),
    ("empty test split", "holds 0 images"),
    ("dimensions overflow int64", "header promises"),     # 2^31·2^31·4 = 2^64 wraps to 0 in int64
    ("dimensions beyond the file", "header promises"),
])
def test_corrupt_idx_is_one_line(fault, needle, capsys, tmp_path):
    folder = _mnist_folder(tmp_path / "data")
    images = folder / "train-images-idx3-ubyte"
    if fault == "empty train split":
        _write_idx(images, (0, 28, 28))
        _write_idx(folder / "train-labels-idx1-ubyte", (0,))
    elif fault == "empty test split":
        _write_idx(folder / "t10k-images-idx3-ubyte", (0, 28, 28))
        _write_idx(folder / "t10k-labels-idx1-ubyte", (0,))
    elif fault == "dimensions overflow int64":
        _write_idx(images, (2 ** 31, 2 ** 31, 4))
    else:
        _write_idx(images, (2 ** 32 - 1, 2 ** 32 - 1, 2 ** 32 - 1), b"\0" * 784)
    argv = ["train", *TINY, "--dataset", "mnist", "--data-dir", tmp_path / "data", "--epochs", 1,
            "--out", tmp_path / "run"]
    one_error_line(*cli(argv, capsys)[::2], needle)
    assert not store.has_checkpoint(tmp_path / "run")


# -- 8. `check` exit codes ---------------------------------------------------------------------------
def test_check_exit_code_matches_the_bp_verdict(bp_audit, capsys):
    code, out, err = cli(["check", bp_audit], capsys)
    line = next(l for l in out.splitlines() if l.startswith("bp"))
    assert code == verdict_code(line), (code, line)
    assert code in (0, 3), line                    # bp beats its frozen control: never walk back
    if code == 3:
        assert "incomplete" in line


def test_check_exit_code_matches_the_dfa_verdict(killed_then_raced, capsys):
    code, out, _ = cli(["check", killed_then_raced["out"]], capsys)
    lines = {l.split()[0]: l for l in out.splitlines()}
    assert verdict_code(lines["dfa"]) in (1, 3), lines["dfa"]     # dfa: walk back or incomplete
    codes = [verdict_code(l) for l in lines.values()]
    assert code == (1 if 1 in codes else 3 if 3 in codes else 0), (code, out)


def test_check_of_a_missing_path_is_a_user_error(capsys, tmp_path):
    one_error_line(*cli(["check", tmp_path / "nope"], capsys)[::2], "neither an audit folder")


# -- 9. issue 18: a user model's frozen control is verified --------------------------------------------
USER_MODELS = '''
import torch
from creditaudit.model import ResidualMLP

def make():
    torch.manual_seed(0)
    return ResidualMLP(64, d=16, n_blocks=2, n_classes=10)

def eight_classes():
    torch.manual_seed(0)
    return ResidualMLP(64, d=16, n_blocks=2, n_classes=8)

def wrong_input():
    torch.manual_seed(0)
    return ResidualMLP(40, d=16, n_blocks=2, n_classes=10)

class _NoForward(ResidualMLP):
    forward = torch.nn.Module.forward

def no_forward():
    torch.manual_seed(0)
    return _NoForward(64, d=16, n_blocks=2, n_classes=10)

class _StreamRaises(ResidualMLP):
    def stream(self):
        raise ValueError("no stream today")

def stream_raises():
    torch.manual_seed(0)
    return _StreamRaises(64, d=16, n_blocks=2, n_classes=10)
'''


@pytest.fixture(scope="module")
def user_weights(tmp_path_factory):
    """Init, trained and frozen-control weights of a tiny ResidualMLP on digits, plus the package."""
    import torch
    from safetensors.torch import save_file
    from creditaudit.data import load_dataset
    from creditaudit.methods import MethodSettings, method_class
    from creditaudit.model import ResidualMLP
    root = tmp_path_factory.mktemp("usermodel")
    (root / "pkg").mkdir()
    (root / "pkg" / "faultnets.py").write_text(USER_MODELS)
    torch.manual_seed(0)
    init = ResidualMLP(64, d=16, n_blocks=2, n_classes=10)
    data = load_dataset("digits")
    models = {}
    for name, blocks in (("trained", (0, 1)), ("frozen", ())):
        model = ResidualMLP(64, d=16, n_blocks=2, n_classes=10)
        model.load_state_dict(init.state_dict())
        bp = method_class("bp")(model, MethodSettings(epochs=3, trainable_blocks=blocks, lr=3e-3))
        gen = torch.Generator().manual_seed(0)
        for _ in range(3):
            for x, y in data.train_batches(128, gen):
                bp.train_step(x, y)
            bp.end_epoch()
        models[name] = model
    # a "control" whose blocks trained too: the frozen control with its blocks nudged off init
    moved = {k: v + 0.01 if k.startswith("blocks.") else v for k, v in models["frozen"].state_dict().items()}
    files = {"init": init.state_dict(), "trained": models["trained"].state_dict(),
             "frozen": models["frozen"].state_dict(), "moved": moved}
    for name, state in files.items():
        save_file({k: v.contiguous() for k, v in state.items()}, str(root / f"{name}.safetensors"))
    return root


def _user_args(root: Path, *extra) -> list:
    return ["--model", "faultnets:make", "--weights", root / "trained.safetensors", "--dataset", "digits",
            "--eval-batches", 2, "--threads", 1, "--device", "cpu", *extra]


@pytest.mark.parametrize("control, needle", [
    ("init", "never trained its embedding"),                # the attack: init weights as the control
    ("trained", "same weights as --weights"),             # gap 0 by construction
    ("moved", "not frozen at initialisation"),            # its blocks trained too
])
@pytest.mark.parametrize("command", ["diagnose", "check"])
def test_a_control_that_is_not_a_frozen_control_is_refused(user_weights, control, needle, command,
                                                             capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(user_weights / "pkg"))
    argv = [command, *_user_args(user_weights, "--frozen-control", user_weights / f"{control}.safetensors",
                                 "--init-weights", user_weights / "init.safetensors")]
    one_error_line(*cli(argv, capsys)[::2], needle)


def test_a_weights_path_that_is_a_folder_says_so(user_weights, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(user_weights / "pkg"))
    argv = ["diagnose", *_user_args(user_weights, "--frozen-control", user_weights)]
    one_error_line(*cli(argv, capsys)[::2], "is a folder; give the .safetensors file")


def test_a_real_frozen_control_is_accepted_and_judged(user_weights, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(user_weights / "pkg"))
    argv = ["diagnose", *_user_args(user_weights, "--frozen-control", user_weights / "frozen.safetensors",
                                    "--init-weights", user_weights / "init.safetensors", "--json")]
    code, out, err = cli(argv, capsys)
    assert code == 0, err
    report = json.loads(out)
    assert report["flags"]["d"] is not None and "d" not in report["not_evaluated"]


def test_an_unverified_control_is_never_trustworthy(user_weights, capsys, monkeypatch):
    """Without --init-weights the control cannot be checked: (d) is not evaluated, the verdict is
    incomplete, and `check` exits 3 — even with the init weights passed as the control."""
    monkeypatch.syspath_prepend(str(user_weights / "pkg"))
    for control in ("init", "frozen"):
        extra = ["--frozen-control", user_weights / f"{control}.safetensors"]
        code, out, err = cli(["diagnose", *_user_args(user_weights, *extra, "--json")], capsys)
        assert code == 0, err
        report = json.loads(out)
        assert report["flags"]["d"] is None and "unverified" in report["not_evaluated"]["d"]
        assert report["verdict"].startswith("incomplete") and "--init-weights" in " ".join(report["notes"])
        code, out, _ = cli(["check", *_user_args(user_weights, *extra)], capsys)
        assert code == 3 and "incomplete" in out, (code, out)


@pytest.mark.parametrize("factory, needle", [
    ("eight_classes", "dataset has 10 classes"),
    ("wrong_input", r"inputs \(\d+, 1, 8, 8\) raised"),
    ("no_forward", "without a forward"),
    ("stream_raises", r"\.stream\(\) raised ValueError: no stream today"),
])
def test_a_user_model_that_does_not_fit_the_data_is_one_line(user_weights, factory, needle, capsys,
                                                              monkeypatch, tmp_path):
    import importlib
    from safetensors.torch import save_file
    monkeypatch.syspath_prepend(str(user_weights / "pkg"))
    model = getattr(importlib.import_module("faultnets"), factory)()
    save_file(model.state_dict(), str(tmp_path / "w.safetensors"))
    for command in ("diagnose", "check"):
        argv = [command, "--model", f"faultnets:{factory}", "--weights", tmp_path / "w.safetensors",
                "--dataset", "digits", "--eval-batches", 2, "--device", "cpu"]
        one_error_line(*cli(argv, capsys)[::2], needle)


# -- 10. issue 18: bad values refused in one line, before anything runs ----------------------------------
HUGE = "99999999999999999999"


@pytest.mark.parametrize("argv, needle", [
    (["train", "--epochs", HUGE], "--epochs"),
    (["train", "--batch-size", HUGE], "--batch-size"),
    (["train", "--width", HUGE], "--width"),
    (["train", "--blocks", HUGE], "--blocks"),
    (["train", "--stop-when-flagged", 0], "--stop-when-flagged"),
    (["train", "--trainable-blocks", -1], "--trainable-blocks"),
    (["train", "--threads", -4], "--threads"),
    (["train", "--threads", 0], "--threads"),
    (["train", "--epoch", 3], "unrecognized arguments: --epoch"),          # no abbreviations
    (["audit", "--epoch", 3], "unrecognized arguments: --epoch"),
    (["audit", "--epochs", HUGE], "--epochs"),
    (["audit", "--jobs", -1], "--jobs"),
    (["audit", "--eval-batches", 0], "--eval-batches"),
    (["audit", "--max-retries", -1], "--max-retries"),
    (["ladder", "--epochs", HUGE], "--epochs"),
    (["calibrate", "run", "--null-draws", 0], "--null-draws"),
    (["calibrate", "run", "--null-draws", -5], "--null-draws"),
    (["diagnose", "run", "--eval-batches", -1], "--eval-batches"),
    (["identity-check", "--width", 0], "--width"),
    (["penalty-sweep", "--lambdas", 0.1, 0.1], "more than once"),
    (["penalty-sweep", "--method", "nosuch"], "unknown method 'nosuch'.*bp"),
    (["train", *TINY, "--epochs", 1, "--device", "meta"], "device 'meta' cannot train"),
    (["audit", "--out", ""], "out in the audit settings must be a non-empty string"),
])
def test_bad_option_value_is_one_line_and_runs_nothing(argv, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(argv, capsys)
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, (code, err)
    assert re.search(needle, err), err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("content, needle", [
    (b"", "sets neither epochs nor a preset"),
    (b"# only a comment\n[model]\nwidth = 16\n", "sets neither epochs nor a preset"),
    (bytes(range(256)) * 4, "not a text file"),
    (b"epochs = 99999999999999999999\n", "at most 100000"),
    (b"epochs = 2\njobs = 99999999999999999999\n", "jobs .*at most"),
    (b"epochs = 2\n[model]\nwidth = 99999999999\n", "width .* ≤ 100000"),
    (b"epochs = 2\n[model]\noptions = 3\n", r"options in \[model\] .* must be a table"),
])
def test_empty_binary_or_huge_toml_is_one_line(content, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.toml").write_bytes(content)
    for command in ("audit", "ladder"):
        one_error_line(*cli([command, "--config", "a.toml", "--quiet"], capsys)[::2], needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.toml"]


# -- 11. issue 18: records and reports ------------------------------------------------------------
def test_edited_metrics_log_is_refused_and_a_short_one_accepted(trained_run, capsys, tmp_path):
    run = tmp_path / "r"
    shutil.copytree(trained_run, run)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    # an ended run writes its log whole before its status.json: one short is an edit
    one_error_line(*cli(["diagnose", run, "--threads", 1, "--device", "cpu"], capsys)[::2],
                   "disagrees with the sealed checkpoint")
    (run / "status.json").unlink()          # killed after its last checkpoint, before the log caught up
    assert cli(["diagnose", run, "--threads", 1, "--device", "cpu"], capsys)[0] == 0
    last = json.loads(lines[-1])
    last["test_acc"] = 0.999
    (run / "metrics.jsonl").write_text("\n".join(lines[:-1] + [json.dumps(last)]) + "\n")
    line = one_error_line(*cli(["diagnose", run, "--threads", 1, "--device", "cpu"], capsys)[::2],
                          "disagrees with the sealed checkpoint", "epoch 2")
    assert "metrics.jsonl" in line


def test_check_of_an_undiagnosed_run_gives_advice_that_works(trained_run, capsys, tmp_path):
    run = tmp_path / "r"
    shutil.copytree(trained_run, run)
    (run / "diagnosis.json").unlink(missing_ok=True)
    line = one_error_line(*cli(["check", run], capsys)[::2], "no diagnosis yet")
    advice = re.search(r"`creditaudit (diagnose [^`]*)`", line).group(1).split()
    advice = [str(run) if a == str(run) else a for a in advice if a not in ("--frozen-control", "CONTROL_DIR")]
    assert cli([*advice, "--threads", 1, "--device", "cpu"], capsys)[0] == 0      # follow it
    code, out, _ = cli(["check", run], capsys)
    assert code == 3 and "incomplete" in out, (code, out)     # no control given: incomplete, not a loop


def test_a_control_path_that_is_a_file_says_so(trained_run, capsys, tmp_path):
    (tmp_path / "control.safetensors").write_bytes(b"x")
    one_error_line(*cli(["diagnose", trained_run, "--frozen-control", tmp_path / "control.safetensors",
                         "--device", "cpu"], capsys)[::2], "is a file", "run folder")
    one_error_line(*cli(["diagnose", tmp_path / "control.safetensors", "--device", "cpu"], capsys)[::2],
                   "is a file, not a run folder")


def test_audit_refuses_to_replace_a_report_of_another_configuration(bp_audit, capsys, tmp_path):
    """The issue's case: the ADD_A_METHOD command without --out replaced a 7-method report."""
    out = tmp_path / "aud"
    shutil.copytree(bp_audit, out)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    config = audit_toml(tmp_path / "a.toml")
    for argv in (audit_args(config, out, methods=("dfa",), seeds=(42, 123, 456), epochs=3),   # other methods
                 audit_args(config, out, seeds=(42,), epochs=3),                             # fewer seeds
                 audit_args(config, out, seeds=(42, 123, 456), epochs=4)):                   # other schedule
        one_error_line(*cli(argv, capsys)[::2], "already holds the report of a different audit", "--out")
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".creditaudit.lock"}
    assert after == {k: v for k, v in before.items() if k != ".creditaudit.lock"}


def test_a_failed_report_write_leaves_the_old_report_whole(bp_audit, capsys, tmp_path, monkeypatch):
    import creditaudit.report as report
    out = tmp_path / "aud"
    shutil.copytree(bp_audit, out)
    (out / "audit.md").write_text("the previous report\n")

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(report, "report_html", full_disk)      # report.html is written after audit.md
    one_error_line(*cli(["report", out], capsys)[::2], "cannot write|no space")
    assert (out / "audit.md").read_text() == "the previous report\n"
    assert not list(out.glob(".report-*"))                     # no staging folder left behind


def test_second_train_on_one_folder_is_refused(capsys, tmp_path):
    from creditaudit.experiments.lock import audit_lock
    out = tmp_path / "run"
    with audit_lock(out):                                      # another `train` holds the folder
        one_error_line(*cli(["train", *TINY, "--epochs", 1, "--out", out], capsys)[::2],
                       "another creditaudit process", re.escape(str(out)))
    assert not store.has_checkpoint(out)
    assert cli(["train", *TINY, "--epochs", 1, "--out", out], capsys)[0] == 0   # free again: trains


def test_a_raising_user_method_under_train_is_one_line_with_error_txt(capsys, tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "raisingrule.py").write_text(
        "from creditaudit.methods.bp import BP\n\n"
        "class Raising(BP):\n    name = 'raising'\n\n"
        "    def train_step(self, x, y):\n        raise RuntimeError('my rule has a bug')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "pkg"))
    argv = ["train", *TINY, "--method", "raisingrule:Raising", "--epochs", 1, "--out", tmp_path / "run"]
    code, _, err = cli(argv, capsys)
    assert code == 3 and "Traceback" not in err and len(err.strip().splitlines()) == 1, (code, err)
    assert "my rule has a bug" in err and "error.txt" in err
    assert "my rule has a bug" in (tmp_path / "run" / "error.txt").read_text()
    assert store.has_checkpoint(tmp_path / "run")              # epoch 0 is kept for the rerun


def test_ladder_where_every_run_fails_exits_3_and_says_what_to_change(capsys, tmp_path):
    config = tmp_path / "a.toml"
    config.write_text("[model]\nwidth = 8\nblocks = 1\narch = \"vit-mini\"\n")
    argv = ["ladder", "--config", config, "--dataset", "synthetic", "--methods", "bp", "--seeds", 42,
            "--epochs", 1, "--out", tmp_path / "lad", "--jobs", 1, "--device", "cpu", "--quiet"]
    code, _, err = cli(argv, capsys)
    assert code == 3 and "Traceback" not in err, (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "every run" in lines[0] and "needs image data" in lines[0], err
    assert "run the same command again" not in lines[0]       # it would fail the same way


CREDIT_RULES = '''
from creditaudit.methods.bp import BP

class Short(BP):
    name = "short"
    def credit(self, x, y):
        return super().credit(x, y)[:1]

class WrongShape(BP):
    name = "wrongshape"
    def credit(self, x, y):
        return [a[:, :3] for a in super().credit(x, y)]

class NotAList(BP):
    name = "notalist"
    def credit(self, x, y):
        return "nope"

class Raises(BP):
    name = "raises"
    def credit(self, x, y):
        raise ValueError("credit bug")
'''


@pytest.mark.parametrize("rule, needle", [
    ("Short", r"returned \[\(\d+, 16\)\]; it must return a list of 3 tensors"),
    ("WrongShape", r"returned \[\(\d+, 3\), .*shaped like h_l"),
    ("NotAList", "returned str"),
    ("Raises", "raised ValueError: credit bug"),
])
@pytest.mark.parametrize("command", ["diagnose", "calibrate"])
def test_a_rule_whose_credit_is_malformed_is_one_line(rule, needle, command, capsys, tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "creditrules.py").write_text(CREDIT_RULES)
    monkeypatch.syspath_prepend(str(tmp_path / "pkg"))
    run = tmp_path / "run"
    assert cli(["train", *TINY, "--method", f"creditrules:{rule}", "--epochs", 1, "--out", run], capsys)[0] == 0
    one_error_line(*cli([command, run, "--device", "cpu", "--threads", 1], capsys)[::2], needle)


def test_ladder_refuses_to_replace_a_result_of_other_settings(capsys, tmp_path):
    config = audit_toml(tmp_path / "a.toml")
    argv = ["ladder", "--config", config, "--dataset", "digits", "--seeds", 42, "--epochs", 1,
            "--out", tmp_path / "lad", "--jobs", 1, "--device", "cpu", "--quiet"]
    assert cli([*argv, "--methods", "bp"], capsys)[0] == 0
    assert cli([*argv, "--methods", "bp"], capsys)[0] == 0          # the same settings: reused
    before = (tmp_path / "lad" / "ladder.json").read_bytes()
    one_error_line(*cli([*argv, "--methods", "dfa"], capsys)[::2], "already holds a ladder.json of other settings")
    assert (tmp_path / "lad" / "ladder.json").read_bytes() == before
