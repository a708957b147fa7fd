"""The audit end to end on small data: outputs, agreement with diagnose, reuse, failures, config errors."""
import json

import pytest

from creditaudit.cli import main as cli_main
from creditaudit.config import audit_config_from_dict, load_audit_toml
from creditaudit.data import load_dataset
from creditaudit.errors import CreditAuditError
from creditaudit.experiments import audit, eval_batches
from creditaudit.protocol import Thresholds, diagnose
from creditaudit.train import load_run

TINY = {"dataset": "digits", "methods": ["bp", "dfa"], "seeds": [1, 2], "epochs": 2,
        "model": {"width": 32, "blocks": 2}, "jobs": 1}


def _quiet(msg):
    pass


@pytest.fixture(scope="module")
def tiny_audit(tmp_path_factory):
    out = tmp_path_factory.mktemp("audit")
    result = audit(audit_config_from_dict({**TINY, "out": str(out)}), log=_quiet)
    return out, result


def test_audit_numbers_match_a_direct_diagnose_of_the_same_checkpoints(tiny_audit):
    out, result = tiny_audit
    saved = json.loads((out / "audit.json").read_text())
    assert saved["methods"][0]["method"] == "bp" and len(saved["runs"]) == 2 * 2 * 3
    data = load_dataset("digits")
    for entry in saved["runs"]:
        if entry["control"] != "none":
            continue
        run = load_run(entry["run_dir"])
        frozen = next(r for r in saved["runs"] if r["control"] == "frozen"
                      and r["method"] == entry["method"] and r["seed"] == entry["seed"])
        direct = diagnose(run.model, eval_batches(data, 8), method=run.method,
                          frozen_acc=frozen["test_acc"], test_acc=run.test_acc,
                          thresholds=Thresholds(), monitor_history=run.history, rho=True,
                          label=run.config.label).to_dict()
        for key in ("verdict", "residual_norms", "bp_grad_norms", "readout_gain", "gamma",
                    "stability", "flags", "null", "rho"):
            assert direct[key] == entry["report"][key], key
    bp_row = saved["methods"][0]
    bp_accs = [r["test_acc"] for r in saved["runs"] if r["method"] == "bp" and r["control"] == "none"]
    assert bp_row["acc"] == pytest.approx(sum(bp_accs) / 2)
    assert bp_row["strategies"]["accuracy only"] == "accept"


def test_rerunning_trains_nothing_and_a_new_seed_trains_only_its_runs(tiny_audit):
    out, _ = tiny_audit
    again = audit(audit_config_from_dict({**TINY, "out": str(out)}), log=_quiet)
    assert again["runs_trained_now"] == 0
    more = audit(audit_config_from_dict({**TINY, "seeds": [1, 2, 3], "out": str(out)}), log=_quiet)
    trained = [r for r in more["runs"] if r["trained_now"]]
    assert len(trained) == 2 * 3  # per method: the new seed's run, its frozen and shallow controls
    assert {r["seed"] for r in trained} == {3}
    assert {(r["method"], r["control"]) for r in trained} == {
        (m, c) for m in ("bp", "dfa") for c in ("none", "frozen", "shallow")}


def test_a_run_that_raises_is_reported_failed_and_the_audit_completes(tmp_path, monkeypatch):
    from creditaudit.methods.dfa import DFA

    def boom(self, x, y):
        raise RuntimeError("simulated crash in a method")
    monkeypatch.setattr(DFA, "train_step", boom)
    result = audit(audit_config_from_dict({**TINY, "seeds": [1], "out": str(tmp_path)}), log=_quiet)
    statuses = {(r["method"], r["control"]): r["status"] for r in result["runs"]}
    assert statuses[("dfa", "none")] == "failed"
    assert statuses[("bp", "none")] == "finished"
    dfa_row = next(r for r in result["methods"] if r["method"] == "dfa")
    assert dfa_row["failed"] and "simulated crash" in dfa_row["failed"][0]["message"]
    # no diagnosed run: the method is not declared trustworthy, nor counted by any strategy
    assert dfa_row["verdict"].startswith("incomplete")
    assert set(dfa_row["strategies"].values()) == {"n/a (no run)"}
    assert (tmp_path / "audit.json").exists()


@pytest.mark.parametrize("raw, needle", [
    ({"methods": ["bp", "dfaa"]}, "unknown method 'dfaa'"),
    ({"epochs": 0}, "epochs"),
    ({"seeds": "42"}, "seeds"),
    ({"model": {"widht": 64}}, "widht"),
    ({"training": {"lr": -1}}, "lr"),
    ({"thresholds": {"growth": "big"}}, "growth"),
    ({"bogus": 1}, "bogus"),
    ({"preset": "huge"}, "preset"),
    ({"controls": ["frozen", "deep"]}, "controls"),
    ({"dataset": "imagenet"}, "unknown dataset"),
])
def test_bad_config_values_fail_before_training(raw, needle, tmp_path, monkeypatch):
    monkeypatch.setattr("creditaudit.experiments.run_all",
                        lambda *a, **k: pytest.fail("training started on a bad config"))
    with pytest.raises(CreditAuditError, match=needle):
        audit(audit_config_from_dict({**TINY, "out": str(tmp_path), **raw}), log=_quiet)


def test_toml_config_errors_name_the_key_and_the_cli_prints_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('methods = ["bp"]\n[model]\nwidth = 64\ndepth = 3\n')
    assert cli_main(["audit", "--config", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "depth" in err and "allowed" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()
    (tmp_path / "broken.toml").write_text("methods = [\n")
    assert cli_main(["audit", "--config", str(tmp_path / "broken.toml")]) == 2
    assert "not valid TOML" in capsys.readouterr().err


def test_shipped_preset_files_are_valid_and_match_the_presets():
    from pathlib import Path
    root = Path(__file__).resolve().parents[1] / "examples"
    quick = audit_config_from_dict(load_audit_toml(root / "quick.toml"))
    preset = audit_config_from_dict({"preset": "quick"})
    assert (quick.dataset, quick.methods, quick.seeds, quick.epochs) == \
        (preset.dataset, preset.methods, preset.seeds, preset.epochs)
    paper = audit_config_from_dict(load_audit_toml(root / "paper.toml"))
    assert paper.dataset == "cifar10" and paper.epochs == 100 and paper.seeds == (42, 123, 456)
    assert len(quick.run_configs()) == 7 * 3 * 3
