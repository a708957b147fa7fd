"""The paper's other experiments through the command line, on small data."""
import json

import pytest

from creditaudit import store
from creditaudit.cli import main as cli_main
from creditaudit.config import RunConfig

SMALL = ["--dataset", "digits", "--seeds", "1", "--epochs", "2", "--jobs", "1"]


@pytest.fixture(autouse=True)
def _small_model(monkeypatch):
    """The experiment subcommands take the model from the preset; shrink it for the tests."""
    from creditaudit import config
    shipped = config.presets

    def small():
        presets = shipped()
        return {**presets, "quick": {**presets["quick"], "model": {"width": 32, "blocks": 2}}}
    monkeypatch.setattr(config, "presets", small)


def test_ladder_covers_k_0_to_L_and_reuses_equal_runs(tmp_path, capsys):
    assert cli_main(["ladder", "--methods", "bp", *SMALL, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "ladder.json").read_text())
    assert [r["k"] for r in result["rows"]] == [0, 1, 2]
    assert all(r["acc"] is not None and r["statuses"] == ["finished"] for r in result["rows"])
    assert (tmp_path / "ladder.png").stat().st_size > 1000
    # k = L is the ordinary full run: one spelling, one key
    assert RunConfig(blocks=2, trainable_blocks=2).run_key == RunConfig(blocks=2).run_key
    assert "k trainable" in capsys.readouterr().out


def test_penalty_sweep_reports_null_and_rho_per_lambda(tmp_path):
    assert cli_main(["penalty-sweep", *SMALL, "--lambdas", "0", "0.1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "penalty_sweep.json").read_text())
    assert result["lambdas"] == [0.0, 0.1]
    assert [r["lam"] for r in result["rows"]] == [0.0, 0.1]
    for row in result["rows"]:
        assert row["method"] == "dfa-penalty"
        assert row["null_deep_std"] is not None and row["null_deep_std"] > 0
        assert row["rho_bp"] > 0.95 and abs(row["rho_random"]) < 0.2
        # every λ is paired with the frozen control, so (d) is evaluated
        assert row["frozen_acc"] is not None and row["n_paired_with_frozen"] == 1
        assert row["flags"]["d"] is not None and "(d) not evaluated" not in row["verdict"]
    runs = result["runs"]
    # λ acts only on trainable blocks: one frozen control (spelled λ = 0) serves every λ, trained once
    assert sorted((r["lam"], r["control"]) for r in runs) == \
        [(0.0, "frozen"), (0.0, "none"), (0.1, "none")]
    assert all(r["status"] == "finished" for r in runs)
    assert (tmp_path / "penalty_sweep.png").exists()


def test_identity_check_grows_with_the_w2_init_scale(tmp_path):
    ratios = {}
    for std in ("0.01", "0.5"):
        out = tmp_path / std
        assert cli_main(["identity-check", "--dataset", "digits", "--seeds", "1", "2",
                         "--w2-std", std, "--width", "64", "--out", str(out)]) == 0
        result = json.loads((out / "identity_check.json").read_text())
        ratios[std] = result["stack_change_mean"]
        assert len(result["block_ratio_mean"]) == 4 and (out / "identity_check.png").exists()
    assert ratios["0.01"] < 0.5 < ratios["0.5"]


def test_thresholds_and_calibrate_on_an_audit(tmp_path, capsys):
    out = tmp_path / "a"
    assert cli_main(["audit", "--methods", "bp", "dfa", *SMALL, "--out", str(out)]) == 0
    assert cli_main(["thresholds", str(out)]) == 0
    sens = json.loads((out / "thresholds.json").read_text())
    for name in ("growth", "floor", "gain"):
        lo, hi = (float(v) for v in sens[name]["interval"])
        assert lo <= sens[name]["current"] <= hi
    assert (out / "thresholds.png").exists()
    assert store.read_sealed_json(out / "thresholds.json", "thresholds") == \
        {k: v for k, v in sens.items() if k != store.SEAL}
    # `report` rebuilds the report from audit.json alone
    (out / "audit.md").unlink()
    assert cli_main(["report", str(out)]) == 0
    assert (out / "audit.md").read_text().startswith("# Credit-assignment audit")
    assert (out / "report.html").exists()
    run_dir = next((out / "runs").glob("dfa-none-*"))
    capsys.readouterr()
    assert cli_main(["calibrate", str(run_dir), "--null-draws", "5"]) == 0
    text = capsys.readouterr().out
    assert "ρ BP" in text and "null" in text
    assert cli_main(["calibrate", str(run_dir), "--json", "--null-draws", "5"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert all(r["bp"] > 0.95 for r in report["rho"]) and report["null"]["k"] == 5
    assert cli_main(["thresholds", str(tmp_path / "nothing")]) == 2
