"""A re-run with nothing to do costs nothing: no worker process is started when every run is
finished and every diagnosis reusable, and torch._dynamo (which only compiling needs) is not
imported. (That its figures are not drawn again: tests/test_report.py.)"""
from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import creditaudit
import creditaudit.runner.local as local
from creditaudit.cli import main as cli_main

SMALL = ('dataset = "digits"\nmethods = ["bp", "fa"]\nseeds = [1]\nepochs = 1\ndevice = "cpu"\n'
         '[model]\nwidth = 8\nblocks = 1\n')


def _audit(tmp_path: Path) -> list[str]:
    return ["audit", "--config", str(tmp_path / "small.toml"), "--out", str(tmp_path / "out"), "--quiet",
            "--jobs", "2"]


def _audit_json(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "out" / "audit.json").read_text())


def test_a_rerun_with_nothing_to_train_starts_no_process_and_no_dynamo(tmp_path, monkeypatch, capsys):
    (tmp_path / "small.toml").write_text(SMALL)
    pools = []

    def pool(max_workers, **kwargs):        # a thread stands in for the spawned workers: the same jobs
        pools.append(max_workers)             # (one at a time: runs seed torch's global RNG as they build)
        return ThreadPoolExecutor(1)

    monkeypatch.setattr(local, "ProcessPoolExecutor", pool)
    first_code = cli_main(_audit(tmp_path))
    first = _audit_json(tmp_path)
    assert first_code in (0, 3) and first["runs_trained_now"] == len(first["runs"]) > 1
    # the first run needed its workers, once: one pool trains, gates the controls and diagnoses
    assert pools == [2]

    def refuse(*args, **kwargs):
        raise AssertionError("a worker pool was started with nothing to train or diagnose")

    monkeypatch.setattr(local, "ProcessPoolExecutor", refuse)
    monkeypatch.setattr(local, "get_context", refuse)
    assert cli_main(_audit(tmp_path)) == first_code
    again = _audit_json(tmp_path)
    assert again["runs_trained_now"] == 0 and again["diagnoses_reused"] == first["diagnoses"] > 0
    assert again["methods"] == first["methods"]       # the same verdicts from the same evidence
    assert [r["status"] for r in again["runs"]] == [r["status"] for r in first["runs"]]

    # a fresh process, as a user's re-run is: nothing it does imports torch._dynamo
    src = Path(creditaudit.__file__).resolve().parents[1]
    script = ("import json, sys\nfrom creditaudit.cli import main\n"
              f"code = main({_audit(tmp_path)!r})\n"
              "print(json.dumps({'code': code, 'dynamo': 'torch._dynamo' in sys.modules}))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**__import__("os").environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"code": first_code, "dynamo": False}
    assert _audit_json(tmp_path)["runs_trained_now"] == 0


def test_the_driver_imports_while_runs_train_and_the_workers_draw_the_figures(tmp_path, monkeypatch):
    """The audit's driver only waits while its workers train: it imports what the tables and
    figures need then (once, after the first run, before the last), and the report draws its
    figures in the same workers (one job per figure), which are closed when the command ends."""
    import creditaudit.commands.audit as audit_command
    (tmp_path / "small.toml").write_text(SMALL)
    submitted, pools, finished_then = [], [], []

    class Pool(ThreadPoolExecutor):          # threads stand in for the spawned workers
        def submit(self, fn, *args, **kwargs):
            submitted.append(fn.__name__)
            return super().submit(fn, *args, **kwargs)

        def shutdown(self, *args, **kwargs):
            pools.remove(self)
            return super().shutdown(*args, **kwargs)

    def pool(max_workers, **kwargs):
        pools.append(Pool(1))
        return pools[-1]

    def imports():
        finished_then.append(len(list((tmp_path / "out" / "runs").glob("*/status.json"))))
    monkeypatch.setattr(local, "ProcessPoolExecutor", pool)
    monkeypatch.setattr(audit_command, "_import_what_follows", imports)
    assert cli_main(_audit(tmp_path)) in (0, 3)
    n_runs = len(_audit_json(tmp_path)["runs"])
    assert len(finished_then) == 1 and 1 <= finished_then[0] < n_runs
    assert submitted.count("draw_job") == 5 and submitted[-5:] == ["draw_job"] * 5
    assert pools == []                       # closed when the command ended
