"""Devices (issue 16 §4): "auto" is resolved once, by the command line; every library function runs
where its inputs are. The suite runs on the device of the `device` fixture
(CREDITAUDIT_TEST_DEVICE=cuda python -m pytest), the CPU by default."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from creditaudit import runs
from creditaudit.config import RunConfig
from creditaudit.data import load_dataset
from creditaudit.errors import CreditAuditError

SRC = Path(__file__).resolve().parents[1] / "src" / "creditaudit"
TINY = dict(dataset="digits", width=16, blocks=2, epochs=1)


def test_only_the_command_line_calls_the_device_resolver():
    command_line = lambda p: p.name == "cli.py" or p.parent.name == "commands"   # cli.py and its handlers
    callers = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                     if re.search(r"\bresolve_device\(", p.read_text()) and p.name != "runs.py")
    assert callers and all(command_line(SRC / c) for c in callers), callers
    assert "torch.cuda.is_available" not in "".join(
        p.read_text() for p in SRC.rglob("*.py") if not command_line(p) and p.name != "runs.py")


def test_library_functions_refuse_auto_and_name_the_fix(tmp_path):
    from creditaudit.train import train_run
    with pytest.raises(CreditAuditError, match="command line"):
        runs.as_device("auto")
    with pytest.raises(CreditAuditError, match="command line"):
        train_run(RunConfig(**TINY), tmp_path / "r", device="auto", progress=False)
    assert runs.as_device(None) == torch.device("cpu")
    assert runs.as_device(None, torch.device("meta")) == torch.device("meta")


def test_a_library_call_runs_where_its_inputs_are(tmp_path, device, monkeypatch):
    """Fake the GPU user's mistake on any machine: were anything in the library to resolve
    "auto", it would get the `meta` device and every number below would be unreadable."""
    from creditaudit.experiments import eval_batches
    from creditaudit.experiments.common import diagnose_run
    from creditaudit.train import train_runs
    from creditaudit.train import train_run
    monkeypatch.setattr(runs, "resolve_device", lambda *a, **k: torch.device("meta"))
    if device.type == "cpu":      # and a resolver bound elsewhere would pick a GPU that is not there
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    data = load_dataset("digits").to(device)
    config = RunConfig(**TINY)
    run = train_run(config, tmp_path / "run", data=data, progress=False)
    control = train_run(config.replace(trainable_blocks=0), tmp_path / "frozen", data=data,
                        progress=False)
    assert next(run.model.parameters()).device.type == device.type
    report = diagnose_run(run, eval_batches(data, 8), control=control, run_data=data)
    assert report.verdict.split(":")[0] in ("trustworthy", "walk back", "incomplete")
    assert all(v == v for v in report.residual_norms)                    # real numbers, not meta
    assert runs.load_run(tmp_path / "run").model.out_head.weight.device.type == "cpu"
    trained = train_runs([config.replace(seed=1), config.replace(seed=2)],
                         [tmp_path / "s1", tmp_path / "s2"], data=data, progress=False)
    assert [t.run.status["status"] for t in trained] == ["finished", "finished"]
    assert [t.stack_size for t in trained] == [2, 2]


def test_a_python_audit_without_a_device_runs_on_the_cpu(tmp_path, monkeypatch):
    """AuditConfig's "auto" is the command line's to resolve; left unresolved (a Python caller),
    the experiments run on the CPU, like every library call without inputs."""
    from creditaudit.config import audit_config_from_dict
    from creditaudit.experiments import audit
    monkeypatch.setattr(runs, "resolve_device", lambda *a, **k: torch.device("meta"))
    result = audit(audit_config_from_dict({"dataset": "digits", "methods": ["bp"], "seeds": [1],
                                           "epochs": 1, "jobs": 1, "out": str(tmp_path),
                                           "model": {"width": 16, "blocks": 2}}), progress=False)
    assert all(r["status"] == "finished" for r in result["runs"])
