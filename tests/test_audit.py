"""The audit end to end on small data: outputs, agreement with diagnose, reuse, failures, config errors."""
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from creditaudit import store
from creditaudit.check import check_path
from creditaudit.cli import main as cli_main
from creditaudit.config import audit_config_from_dict, load_audit_toml
from creditaudit.errors import CreditAuditError
from creditaudit.experiments import STRATEGIES, audit, read_audit, reporting_strategies
from creditaudit.runs import load_run, read_status

TINY = {"dataset": "digits", "methods": ["bp", "dfa"], "seeds": [1, 2], "epochs": 2,
        "model": {"width": 32, "blocks": 2}, "jobs": 1}


@pytest.fixture(scope="module")
def tiny_audit(tmp_path_factory, device):
    out = tmp_path_factory.mktemp("audit")
    result = audit(audit_config_from_dict({**TINY, "out": str(out), "device": str(device)}),
                   progress=False)
    return out, result


def _cli_diagnose(run_dir, frozen_dir, device):
    """`creditaudit diagnose RUN_DIR --frozen-control FROZEN --rho --json` in its own process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "creditaudit", "diagnose", str(run_dir),
                           "--frozen-control", str(frozen_dir), "--rho", "--json",
                           "--device", str(device), "--threads", "1"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_audit_numbers_match_an_independent_cli_diagnose_of_the_same_run_folders(tiny_audit, device):
    out, result = tiny_audit
    saved = read_audit(out)                                  # audit.json, integrity-checked
    assert saved == result
    assert [m["method"] for m in saved["methods"]] == ["bp", "dfa"] and len(saved["runs"]) == 2 * 2 * 3
    checked = 0
    for entry in saved["runs"]:
        if (entry["method"], entry["control"], entry["seed"]) != ("dfa", "none", 1):
            continue                                         # dfa: Γ, its null, ρ and (d) to compare
        frozen = next(r for r in saved["runs"] if r["control"] == "frozen"
                      and r["method"] == entry["method"] and r["seed"] == entry["seed"])
        direct = _cli_diagnose(entry["run_dir"], frozen["run_dir"], device)   # the audit's device
        stored = entry["report"]
        for key in ("verdict", "paper_verdict", "flags", "residual_norms", "bp_grad_norms",
                    "readout_gain", "max_growth", "eval_acc", "gamma", "stability", "null", "rho",
                    "depth", "first_fire"):
            assert direct[key] == stored[key], (entry["label"], key)
        assert direct["depth"]["frozen_acc"] == frozen["test_acc"]
        assert direct["depth"]["acc"] == entry["test_acc"]
        # the audit also left the same diagnosis, sealed, in the run folder, bound to that run
        beside = store.read_sealed_json(os.path.join(entry["run_dir"], "diagnosis.json"), "diagnosis")
        assert beside.pop("run_binding")["run"] == entry["key"]
        assert beside == stored
        checked += 1
    assert checked == 1
    dfa = next(r for r in saved["runs"] if r["method"] == "dfa" and r["control"] == "none")
    assert dfa["report"]["null"] is not None and dfa["report"]["null"]["k"] == 20
    bp_row = saved["methods"][0]
    bp_accs = [r["test_acc"] for r in saved["runs"] if r["method"] == "bp" and r["control"] == "none"]
    assert bp_row["acc"] == pytest.approx(sum(bp_accs) / 2)
    frozen_accs = [r["test_acc"] for r in saved["runs"] if r["method"] == "bp" and r["control"] == "frozen"]
    assert bp_row["frozen_acc"] == pytest.approx(sum(frozen_accs) / 2)


def _row(method, verdict, gamma, acc=0.9):
    structured = {"rule": "project", "outcome": verdict.split(":")[0]}   # the row as audit.json holds it
    return {"method": method, "verdict": verdict, "verdicts": {"project": structured},
            "gamma_mean_all": gamma, "acc": acc}


def test_accuracy_only_accepts_what_the_protocol_walks_back_and_totals_count_walk_backs(
        tmp_path, monkeypatch):
    """Reporting strategies on constructed rows: accuracy only accepts every result that has an
    accuracy (also ones the protocol walks back); accuracy + Γ walks back when mean Γ ≤ 0; the full
    protocol follows the verdict; the totals count the walk-backs of each strategy; a method with
    no trained run counts for none."""
    rows = {"bp": _row("bp", "trustworthy", 1.0),
            "dfa": _row("dfa", "walk back: (a) EXPLODED, (b′) ATTENUATED", 0.05),
            "fa": _row("fa", "walk back: (d) UNDERCUT", -0.1),
            "ep": _row("ep", "incomplete: (d) not evaluated", 0.9),
            "sb": _row("sb", "trustworthy", None),
            "cb": _row("cb", "incomplete: 1/1 runs failed", None, acc=None)}
    expected = {"bp": ("accept", "accept", "accept"),
                "dfa": ("accept", "accept", "walk back"),
                "fa": ("accept", "walk back", "walk back"),
                "ep": ("accept", "accept", "incomplete"),
                "sb": ("accept", "n/a (no credit)", "accept"),
                "cb": ("n/a (no run)",) * 3}
    for name, row in rows.items():
        assert reporting_strategies(row) == dict(zip(STRATEGIES, expected[name])), name
    assert reporting_strategies(_row("x", "walk back: (d) UNDERCUT", 0.0))["accuracy + Γ"] == "walk back"

    # the totals audit() writes, from these rows (training and diagnosis replaced)
    audit_module = importlib.import_module("creditaudit.experiments.audit")  # the module, not audit()
    monkeypatch.setattr(audit_module, "run_all", lambda *a, **k: [])
    monkeypatch.setattr(audit_module, "summarize_method", lambda m, o, t, *noise: dict(rows[m]))
    result = audit(audit_config_from_dict({**TINY, "methods": list(rows), "seeds": [1],
                                           "out": str(tmp_path)}), progress=False)
    assert [r["strategies"] for r in result["methods"]] == \
        [dict(zip(STRATEGIES, expected[m])) for m in rows]
    assert result["strategy_totals"] == {"accuracy only": 0, "accuracy + Γ": 1, "full protocol": 2}
    assert read_audit(tmp_path)["strategy_totals"] == result["strategy_totals"]
    from creditaudit.report import audit_table
    assert "| walks back | 0 of 6 " in audit_table(result)
    assert "| 1 of 6 " in audit_table(result) and "| 2 of 6 " in audit_table(result)


def test_a_shallow_control_is_not_listed_as_a_run_that_failed(tiny_audit):
    """A shallow control has no residual block, so no depth to diagnose: the audit reads only its
    accuracy, and the report does not list it among "Runs that did not finish normally"."""
    out, result = tiny_audit
    shallow = [r for r in result["runs"] if r["control"] == "shallow"]
    assert shallow and all(r["status"] == "finished" for r in shallow)
    assert not any("diagnosis failed" in str(r.get("message") or "") for r in result["runs"])
    from creditaudit.report import audit_table
    assert "did not finish normally" not in audit_table(result)


def test_rerunning_trains_nothing_and_a_new_seed_trains_only_its_runs(tiny_audit):
    out, _ = tiny_audit
    again = audit(audit_config_from_dict({**TINY, "out": str(out)}), progress=False)
    assert again["runs_trained_now"] == 0
    more = audit(audit_config_from_dict({**TINY, "seeds": [1, 2, 3], "out": str(out)}), progress=False)
    trained = [r for r in more["runs"] if r["trained_now"]]
    assert len(trained) == 2 * 3  # per method: the new seed's run, its frozen and shallow controls
    assert {r["seed"] for r in trained} == {3}
    assert {(r["method"], r["control"]) for r in trained} == {
        (m, c) for m in ("bp", "dfa") for c in ("none", "frozen", "shallow")}


def test_a_run_that_raises_is_reported_failed_and_the_audit_completes(tmp_path, monkeypatch, capsys):
    from creditaudit.methods.dfa import DFA

    def boom(self, x, y):
        raise RuntimeError("simulated crash in a method")
    monkeypatch.setattr(DFA, "train_step", boom)
    toml = tmp_path / "tiny.toml"
    toml.write_text('dataset = "digits"\nmethods = ["bp", "dfa"]\nseeds = [1]\nepochs = 2\njobs = 1\n'
                    f'out = "{tmp_path / "out"}"\n[model]\nwidth = 32\nblocks = 2\n')
    assert cli_main(["audit", "--config", str(toml), "--quiet"]) == 3   # a run failed: exit 3
    err = capsys.readouterr().err
    assert "run(s) failed" in err and "dfa" in err
    result = read_audit(tmp_path / "out")
    statuses = {(r["method"], r["control"]): r["status"] for r in result["runs"]}
    assert statuses[("dfa", "none")] == "failed"
    assert statuses[("bp", "none")] == "finished"
    dfa_row = next(r for r in result["methods"] if r["method"] == "dfa")
    assert dfa_row["failed"] and "simulated crash" in dfa_row["failed"][0]["message"]
    failed_dir = next(r for r in result["runs"] if r["label"] == "dfa/s1")["run_dir"]
    assert "simulated crash" in (Path(failed_dir) / "error.txt").read_text()   # the traceback is kept
    # no diagnosed run: the method is not declared trustworthy, nor counted by any strategy
    assert dfa_row["verdict"].startswith("incomplete")
    assert set(dfa_row["strategies"].values()) == {"n/a (no run)"}
    assert result["strategy_totals"]["full protocol"] == sum(
        r["strategies"]["full protocol"] == "walk back" for r in result["methods"])
    assert (tmp_path / "out" / "audit.json").exists() and (tmp_path / "out" / "audit.md").exists()
    _, code, _ = check_path(tmp_path / "out")
    assert code in (1, 3)                                    # never "trustworthy" with a failed method


@pytest.mark.parametrize("raw, needle", [
    ({"methods": ["bp", "dfaa"]}, "unknown method 'dfaa'"),
    ({"methods": "bp"}, "methods"),                          # a string is not a list of methods
    ({"methods": []}, "methods"),
    ({"methods": ["bp", "dfa", "bp"]}, "more than once"),
    ({"seeds": [1, 2, 1]}, "more than once"),
    ({"epochs": 0}, "epochs"),
    ({"seeds": "42"}, "seeds"),
    ({"model": {"widht": 64}}, "widht"),
    ({"model": {"blocks": 0}}, "blocks"),
    ({"training": {"lr": -1}}, "lr"),
    ({"training": {"lr": float("inf")}}, "lr"),
    ({"training": {"lr": float("nan")}}, "lr"),
    ({"thresholds": {"growth": "big"}}, "growth"),
    ({"thresholds": {"gain": float("nan")}}, "gain"),
    ({"thresholds": {"growth": float("inf")}}, "growth"),
    ({"bogus": 1}, "bogus"),
    ({"preset": "huge"}, "preset"),
    ({"controls": ["frozen", "deep"]}, "controls"),
    ({"dataset": "imagenet"}, "unknown dataset"),
    ({"methods": ["bp", "ep"], "options": {"ep": {"beta": float("nan")}}}, "beta"),
])
def test_bad_config_values_fail_before_training(raw, needle, tmp_path, monkeypatch):
    monkeypatch.setattr(importlib.import_module("creditaudit.experiments.audit"), "run_all",
                        lambda *a, **k: pytest.fail("training started on a bad config"))
    with pytest.raises(CreditAuditError, match=needle):
        audit(audit_config_from_dict({**TINY, "out": str(tmp_path), **raw}), progress=False)


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
    (tmp_path / "string.toml").write_text('methods = "bp"\n')
    assert cli_main(["audit", "--config", str(tmp_path / "string.toml"),
                     "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert "methods" in err and "list" in err and not (tmp_path / "s").exists()


def test_shipped_preset_files_are_valid_and_match_the_presets():
    from creditaudit.config import PRESET_NAMES, presets
    root = Path(__file__).resolve().parents[1] / "examples"
    assert set(PRESET_NAMES) == set(presets())
    quick = audit_config_from_dict(load_audit_toml(root / "quick.toml"))
    preset = audit_config_from_dict({"preset": "quick"})
    assert (quick.dataset, quick.methods, quick.seeds, quick.epochs) == \
        (preset.dataset, preset.methods, preset.seeds, preset.epochs)
    paper = audit_config_from_dict(load_audit_toml(root / "paper.toml"))
    assert paper.dataset == "cifar10" and paper.epochs == 100 and paper.seeds == (42, 123, 456)
    from creditaudit.methods import METHODS
    paper_seven = tuple(name for name, cls in METHODS.items() if cls.paper)
    assert quick.methods == paper.methods == paper_seven  # the shipped files list the paper's methods
    assert len(quick.run_configs()) == len(paper_seven) * 3 * 3
    # the audit's λ goes to every method that declares it, as its `lam` option
    lams = {c.method: c.lam for c in quick.run_configs() if c.control == "none"}
    assert lams["dfa-penalty"] == lams["sb"] == lams["cb"] == 1e-2
    assert lams["bp"] == lams["dfa"] == 0.0


# ---------------------------------------------------------------------------------------------
# Sealed records and `creditaudit check`
# ---------------------------------------------------------------------------------------------

def _audit_with(tmp_path, name, verdicts):
    folder = tmp_path / name
    folder.mkdir()
    store.write_sealed_json(folder / "audit.json", {"methods": [
        {"method": m, "verdict": v, "lam": 0.0,
         "verdicts": {"project": {"rule": "project", "outcome": v.split(":")[0]}}}
        for m, v in verdicts.items()]})
    return folder


def test_check_exit_codes_follow_the_verdicts(tmp_path, capsys):
    ok = _audit_with(tmp_path, "ok", {"bp": "trustworthy", "ep": "trustworthy"})
    bad = _audit_with(tmp_path, "bad", {"bp": "trustworthy", "dfa": "walk back: (a) EXPLODED",
                                        "ep": "incomplete: (d) not evaluated"})
    partial = _audit_with(tmp_path, "partial", {"bp": "trustworthy", "ep": "incomplete: x"})
    empty = _audit_with(tmp_path, "empty", {})
    for folder, code in ((ok, 0), (bad, 1), (partial, 3), (empty, 3)):
        assert check_path(folder)[1] == code, folder.name
        assert cli_main(["check", str(folder)]) == code
    capsys.readouterr()
    assert cli_main(["check", str(bad), "--json"]) == 1
    payload = json.loads(capsys.readouterr().out)
    assert payload["exit_code"] == 1 and [v["name"] for v in payload["verdicts"]] == ["bp", "dfa", "ep"]
    # an edited audit.json is refused (exit 2), and so is a folder that is neither kind
    edited = json.loads((bad / "audit.json").read_text())
    edited["methods"][1]["verdict"] = "trustworthy"
    (bad / "audit.json").write_text(json.dumps(edited))
    with pytest.raises(CreditAuditError, match="modified"):
        check_path(bad)
    assert cli_main(["check", str(bad)]) == 2
    assert cli_main(["check", str(tmp_path / "nothing")]) == 2
    assert "modified" in capsys.readouterr().err


def test_a_run_folder_is_checked_by_its_diagnosis_and_hand_edits_are_refused(tiny_audit, tmp_path):
    out, result = tiny_audit
    entry = next(r for r in result["runs"] if r["label"] == "dfa/s1")
    run = tmp_path / "run"
    shutil.copytree(entry["run_dir"], run)
    lines, code, _ = check_path(run)
    verdict = entry["report"]["verdict"]
    assert lines[0].endswith(verdict) and code == (1 if verdict.startswith("walk back")
                                                   else 0 if verdict == "trustworthy" else 3)
    load_run(run)                                              # intact copy: loads

    def refused(name, edit, needle):
        path = run / name
        original = path.read_text()
        record = json.loads(original)
        edit(record)
        path.write_text(json.dumps(record, indent=2))
        with pytest.raises(CreditAuditError, match=needle):
            load_run(run) if name != "diagnosis.json" else check_path(run)
        path.write_text(original)

    refused("diagnosis.json", lambda r: r.update(verdict="trustworthy"), "modified")
    refused("status.json", lambda r: r.update(test_acc=0.99), "modified")
    refused("checkpoint.json", lambda r: r.update(epoch=1), "modified")
    refused("config.json", lambda r: r.update(seed=2), "does not match")
    assert read_status(run)["status"] == "finished"             # restored: accepted again
    audit_json = out / "audit.json"
    record = json.loads(audit_json.read_text())
    record["methods"][0]["acc"] = 1.0
    tampered = tmp_path / "tampered"
    tampered.mkdir()
    (tampered / "audit.json").write_text(json.dumps(record))
    with pytest.raises(CreditAuditError, match="modified"):
        read_audit(tampered)
    assert cli_main(["report", str(tampered)]) == 2


def test_local_executor_maps_in_job_order_and_unknown_executors_are_refused():
    from creditaudit.runner import make_executor
    seen = []
    results = make_executor("local", workers=1).map(lambda j: {"status": "finished", "j": j * j},
                                                     [3, 1, 2], lambda i, r: seen.append((i, r["j"])))
    assert [r["j"] for r in results] == [9, 1, 4] and seen == [(0, 9), (1, 1), (2, 4)]
    with pytest.raises(CreditAuditError, match="unknown executor"):
        make_executor("slurm")


def test_seed_statistics_helpers():
    from creditaudit.experiments.common import mean_std, median_of
    from creditaudit.protocol import deep_gamma
    deep_mean = lambda g: deep_gamma(g)["gamma_deep"]
    assert mean_std([0.5]) == (0.5, None)                     # one seed: no spread to report
    mean, std = mean_std([0.2, 0.4, None, float("nan")])      # unmeasured values are left out
    assert mean == pytest.approx(0.3) and std == pytest.approx(0.1)
    assert mean_std([]) == (None, None) and mean_std([None]) == (None, None)
    assert median_of([3.0, float("nan"), 1.0, 2.0]) == 2.0 and median_of([float("nan")]) is None
    assert deep_mean([9.0, 1.0, "inf"]) == float("inf")       # l = 1 … L, JSON-safe values read back
    assert deep_mean([9.0, 1.0, 3.0]) == 2.0
    assert deep_mean([9.0, None]) is None and deep_mean([9.0]) is None and deep_mean(None) is None


def test_the_workers_get_the_shallow_controls_last(tmp_path, monkeypatch):
    """Training units go to the workers deep runs first and shallow controls (no blocks, the
    cheapest) last, so the audit's last jobs are short and no worker idles through a deep one."""
    from creditaudit.experiments import common
    from creditaudit.runner.local import LocalExecutor
    order = []

    class Recording(LocalExecutor):
        def map(self, fn, jobs, on_done):
            if fn is common.train_any:
                order.extend(j.config["blocks"] for j in jobs)
            return super().map(fn, jobs, on_done)
    monkeypatch.setattr(common, "make_executor", lambda *a, **k: Recording(1))
    audit(audit_config_from_dict({**TINY, "methods": ["bp", "fa"], "seeds": [1, 2], "jobs": 2,
                                  "out": str(tmp_path / "a")}), progress=False)
    assert len(order) == 12 and 0 in order
    first_shallow = order.index(0)
    assert all(b > 0 for b in order[:first_shallow]) and all(b == 0 for b in order[first_shallow:])
