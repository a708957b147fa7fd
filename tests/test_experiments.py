"""The paper's other experiments through the command line, on small data."""
import json
import re

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
        assert row["depth"]["outcome"] in ("clears", "undercut", "undetermined")   # decided or not: paired
        assert "(d) not evaluated" not in row["verdict"]
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
    # one seed on 360 test samples: a gap within test-set noise of the margin leaves (d)
    # undetermined, so the audit may end "incomplete" (exit 3)
    assert cli_main(["audit", "--methods", "bp", "dfa", *SMALL, "--out", str(out)]) in (0, 3)
    assert cli_main(["thresholds", str(out)]) == 0
    sens = json.loads((out / "thresholds.json").read_text())
    for name in ("growth", "floor", "gain", "depth_margin"):
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


# -- the run key: everything that changes a run is in it ------------------------------------------
CIFAR_SMALL = ["--dataset", "cifar10", "--methods", "bp", "--seeds", "1", "--epochs", "1", "--jobs", "1",
               "--eval-batches", "2", "--quiet"]


def test_other_data_in_the_same_out_are_other_runs(tmp_path):
    """Two CIFAR-format folders with different images, one --out: the second audit trains its own
    runs instead of reusing the first one's (the key holds the data's digest)."""
    from test_data import write_cifar10
    write_cifar10(tmp_path / "a", seed=0)
    write_cifar10(tmp_path / "b", seed=1)
    out = tmp_path / "out"
    keys = {}
    for name in ("a", "b", "a"):
        assert cli_main(["audit", *CIFAR_SMALL, "--data-dir", str(tmp_path / name), "--out", str(out)]) in (0, 1, 3)
        result = json.loads((out / "audit.json").read_text())
        keys.setdefault(name, []).append((result["runs_trained_now"], sorted(r["key"] for r in result["runs"])))
    (trained_a, keys_a), (trained_b, keys_b), (again_a, keys_a2) = keys["a"][0], keys["b"][0], keys["a"][1]
    assert trained_a == 3 and trained_b == 3          # main run, frozen and shallow control each
    assert not set(keys_a) & set(keys_b)
    assert again_a == 0 and keys_a2 == keys_a          # the same data again: reused
    digests = {r["config"]["data_digest"] for r in json.loads((out / "audit.json").read_text())["runs"]}
    assert len(digests) == 1 and len(next(iter(digests))) == 64
    # a run measured on other data than it trained on is refused, not diagnosed
    run_dir = next(r["run_dir"] for r in json.loads((out / "audit.json").read_text())["runs"]
                   if r["control"] == "none")
    assert cli_main(["diagnose", run_dir, "--eval-batches", "2", "--data-dir", str(tmp_path / "b")]) == 2
    assert cli_main(["diagnose", run_dir, "--eval-batches", "2", "--data-dir", str(tmp_path / "a")]) == 0


def test_a_changed_method_default_retrains(tmp_path, monkeypatch):
    """Runs that leave a method option at its default are keyed by the resolved value: when the
    default changes, the audit trains anew into other folders; `train --out` into the old folder
    refuses with one line naming the differing field."""
    from creditaudit import config
    from creditaudit.methods import METHODS
    shipped = config.presets      # the small-model presets of the fixture, without the audit's λ
    monkeypatch.setattr(config, "presets", lambda: {k: {**v, "training": {}} for k, v in shipped().items()})
    argv = ["audit", "--methods", "dfa-penalty", *SMALL, "--out", str(tmp_path), "--quiet"]
    assert cli_main(argv) in (0, 1, 3)
    first = json.loads((tmp_path / "audit.json").read_text())
    assert first["runs_trained_now"] == 4          # the main run, its two controls and the yardstick (bp is not audited)
    assert cli_main(argv) in (0, 1, 3)
    assert json.loads((tmp_path / "audit.json").read_text())["runs_trained_now"] == 0
    cls = METHODS["dfa-penalty"]
    monkeypatch.setattr(cls, "option_defaults", {**cls.option_defaults, "lam": 0.5})
    assert cli_main(argv) in (0, 1, 3)
    second = json.loads((tmp_path / "audit.json").read_text())
    # only the main run retrains: its controls are spelled with λ = 0 whatever the default
    # (runs.canonical_control: λ acts only on trainable blocks), so they are the same runs
    assert second["runs_trained_now"] == 1
    mains = lambda audit: [r for r in audit["runs"] if r["control"] == "none"]
    assert {r["config"]["options"]["lam"] for r in mains(second)} == {0.5}
    assert not {r["key"] for r in mains(first)} & {r["key"] for r in mains(second)}


def test_changed_stop_thresholds_retrain(tmp_path):
    """With --stop-when-flagged the thresholds of the stop rule are part of the run; without it
    they are not (one spelling: no stop, no thresholds)."""
    from creditaudit.config import STOP_THRESHOLD_KEYS, RunConfig
    from creditaudit.data import load_dataset
    from creditaudit.train import train_run
    from creditaudit.verdict import Thresholds, stop_rule
    assert RunConfig(stop_thresholds={"gain": 0.5}) == RunConfig()
    stopping = RunConfig(stop_when_flagged=2)
    assert stopping.stop_thresholds == {k: getattr(Thresholds(), k) for k in STOP_THRESHOLD_KEYS}
    assert RunConfig(stop_when_flagged=2, stop_thresholds={"growth": 10.0}).run_key != stopping.run_key
    toml = tmp_path / "a.toml"
    for gain, status, epochs in ((1e-30, "finished", 2), (1e9, "stopped", 1)):
        toml.write_text(f'dataset = "digits"\nmethods = ["bp"]\nseeds = [1]\nepochs = 2\njobs = 1\n'
                        f'controls = []\n[model]\nwidth = 16\nblocks = 1\n[training]\nstop_when_flagged = 1\n'
                        f'[thresholds]\ngain = {gain}\n')
        # the report of the other thresholds is removed first (an audit never overwrites a report of
        # another configuration); its runs stay, so only the run key decides what is reused
        (tmp_path / "x" / "audit.json").unlink(missing_ok=True)
        assert cli_main(["audit", "--config", str(toml), "--out", str(tmp_path / "x"), "--quiet"]) in (0, 1, 3)
        result = json.loads((tmp_path / "x" / "audit.json").read_text())
        run = result["runs"][0]
        assert result["runs_trained_now"] == 1 and run["config"]["stop_thresholds"]["gain"] == gain
        # the run's own thresholds reached the stop rule its trainer ran
        assert (run["status"], run["epochs_completed"]) == (status, epochs)


def test_a_run_folder_from_before_the_full_key_is_refused_in_one_line(tmp_path, capsys):
    """A folder whose config.json (and sealed checkpoint) lack the fields now part of a run —
    as written before clip, stop thresholds, data digest and code version were recorded — is
    neither reused nor diagnosed: one line, exit 2, naming the fix."""
    new_fields = ("clip", "stop_thresholds", "data_digest", "code_version")
    old = tmp_path / "old"
    argv = ["train", "--dataset", "digits", "--width", "16", "--blocks", "1", "--epochs", "1",
            "--quiet", "--device", "cpu", "--out", str(old)]
    assert cli_main(argv) == 0
    # rewrite the folder as the previous version wrote it: its config without the new fields,
    # sealed into the checkpoint, and the status sealed to that checkpoint
    config = {k: v for k, v in json.loads((old / "config.json").read_text()).items() if k not in new_fields}
    store.atomic_write_json(old / "config.json", config)
    meta = store.read_sealed_json(old / "checkpoint.json", "checkpoint")
    store.write_sealed_json(old / "checkpoint.json", {**meta, "config": config})
    status = store.read_sealed_json(old / "status.json", "status")
    store.write_sealed_json(old / "status.json", {**status, "checkpoint": store.checkpoint_digest(old)})
    capsys.readouterr()
    for command in (argv, ["diagnose", str(old), "--device", "cpu"]):
        assert cli_main(command) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        assert "older creditaudit" in err and "rerun into a fresh --out" in err and "clip" in err


def test_a_folder_of_another_code_version_is_refused_and_audits_key_by_it(tmp_path):
    """Resuming or reusing a folder trained by another training-code version is refused, naming
    the field; in an audit the version is in the key, so such runs train anew in other folders."""
    import pytest
    from creditaudit.config import CODE_VERSION, TRAINING_CODE_VERSION, RunConfig
    from creditaudit.data import load_dataset
    from creditaudit.errors import CreditAuditError
    from creditaudit.train import train_run
    from creditaudit import __version__
    assert CODE_VERSION == f"{__version__}+train{TRAINING_CODE_VERSION}"
    config = RunConfig(dataset="digits", width=16, blocks=1, epochs=1)
    assert config.code_version == CODE_VERSION
    data = load_dataset("digits")
    train_run(config, tmp_path / "r", data=data, progress=False)
    older = config.replace(code_version=f"{__version__}+train{TRAINING_CODE_VERSION - 1}")
    assert older.run_key != config.run_key
    with pytest.raises(CreditAuditError, match="differs in code_version"):
        train_run(older, tmp_path / "r", data=data, progress=False)


@pytest.mark.parametrize("command", [["ladder", "--methods", "bp"], ["penalty-sweep"]])
def test_too_many_eval_batches_are_refused_before_training(command, tmp_path, capsys):
    """ladder and penalty-sweep honour --eval-batches, and refuse a value the test set cannot fill
    before any run trains, as audit does."""
    assert cli_main([*command, *SMALL, "--eval-batches", "100000", "--out", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "too small for 100000 eval batches" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_the_data_digest_follows_the_contents_and_is_computed_once(tmp_path, monkeypatch):
    """ArrayDataset.digest: equal for equal contents (a reload, generated data too, another device
    copy), different when one value changes; hashed once per load, not once per use."""
    import hashlib
    from creditaudit.data import load_dataset
    from test_data import write_cifar10
    write_cifar10(tmp_path / "a", seed=0)
    first = load_dataset("cifar10", tmp_path / "a", download=False)
    assert first.digest == load_dataset("cifar10", tmp_path / "a", download=False).digest
    assert load_dataset("synthetic").digest == load_dataset("synthetic").digest != first.digest
    changed = first.to("cpu")
    changed.x_test = changed.x_test.clone()
    changed.x_test[0, 0, 0, 0] ^= 1
    changed._digest = None
    assert changed.digest != first.digest
    calls = []
    real = hashlib.sha256
    monkeypatch.setattr(hashlib, "sha256", lambda *a: calls.append(1) or real(*a))
    fresh = load_dataset("synthetic")
    for _ in range(3):
        fresh.to("cpu").digest
    assert len(calls) == 1


def test_the_stop_thresholds_are_exactly_those_the_stop_rule_reads():
    """STOP_THRESHOLD_KEYS (what a run with --stop-when-flagged records in its key) is the set of
    thresholds the early-stop rule depends on: moving any of them to an extreme can change the rule's
    decision on a monitor history, moving any other threshold never does."""
    import dataclasses
    from creditaudit.config import STOP_THRESHOLD_KEYS
    from creditaudit.verdict import Thresholds, stop_rule
    history = [{"epoch": 0, "h_norms": [1.0, 1.0], "g_norms": [1.0, 1.0], "max_growth": 1.0, "gain": 0.5,
                "test_acc": 0.5},
               {"epoch": 1, "h_norms": [1.0, 2.0], "g_norms": [1.0, 1.0], "max_growth": 2.0, "gain": 0.5,
                "test_acc": 0.5}]
    decide = lambda **t: stop_rule(1, dataclasses.replace(Thresholds(), **t))(history) is not None
    assert decide() is False
    for f in dataclasses.fields(Thresholds):
        changes = {decide(**{f.name: extreme}) for extreme in (0.0, 1e30)}
        assert (changes != {False}) == (f.name in STOP_THRESHOLD_KEYS), f.name


# -- an audit run again reuses what is sealed and unchanged ---------------------------------------
def test_a_rerun_reuses_every_diagnosis_and_rediagnoses_what_changed(tmp_path, capsys, monkeypatch):
    """Run again with nothing changed, an audit reuses every run and every diagnosis (and its
    report is the same); other thresholds or other eval batches diagnose every run again (its
    runs are still reused). The terminal says how many were reused, in whole sentences at 80 and
    120 columns: no verdict cut, counts and plurals right."""
    out = tmp_path / "a"
    toml = tmp_path / "a.toml"
    argv = ["audit", "--config", str(toml), "--out", str(out), "--quiet"]

    def audit(thresholds: str = "", eval_batches: int = 4, columns: int = 120):
        toml.write_text(f'dataset = "digits"\nmethods = ["bp", "dfa"]\nseeds = [1]\nepochs = 2\njobs = 1\n'
                        f'eval_batches = {eval_batches}\n[model]\nwidth = 16\nblocks = 2\n{thresholds}')
        monkeypatch.setenv("COLUMNS", str(columns))
        capsys.readouterr()
        assert cli_main(argv) in (0, 1, 3)
        return json.loads((out / "audit.json").read_text()), capsys.readouterr().out

    first, _ = audit()
    # bp and dfa: a frozen control is gated, not diagnosed (its accuracy is all the audit reads)
    assert first["diagnoses"] == 2 and first["diagnoses_reused"] == 0
    assert all(r["report"] is None for r in first["runs"] if r["control"] != "none")
    for columns in (80, 120):
        again, printed = audit(columns=columns)
        assert (again["runs_trained_now"], again["diagnoses_reused"]) == (0, 2)
        assert [r["report"] for r in again["runs"]] == [r["report"] for r in first["runs"]]
        assert all(len(line) <= columns for line in printed.splitlines()
                   if len(line.split()) > 1), printed        # a path longer than the line aside
        flat = " ".join(printed.split())
        assert "0 runs trained now, 2 of 2 diagnoses reused" in flat and "2 methods × 1 seed → 6 runs" in flat
        assert "…" not in printed and flat.count("Of 2 methods, ") == 1 and "\nnext: " in printed
        masked = lambda text: re.sub(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?", "#", " ".join(text.split()))
        for row in again["methods"]:                   # every caveat audit.md gives is on the terminal,
            assert f"{row['method']}: {'incomplete' if row['verdict'].startswith('incomplete') else row['verdict']}" in flat
            for text in [*(row.get("missing") or []), *(row.get("notes") or [])]:   # once for all its seeds
                body = re.sub(r"^\S+/s\d+: ", "", re.sub(r"^\([a-d]′?\) ", "", " ".join(text.split())))
                assert masked(body.rstrip(".")) in masked(flat), body
    for changed in ({"thresholds": "[thresholds]\ngrowth = 3.0\n"}, {"eval_batches": 3}):
        (out / "audit.json").unlink()     # an audit never overwrites a report of other settings
        result, printed = audit(**changed)
        assert (result["runs_trained_now"], result["diagnoses_reused"]) == (0, 0), changed
        assert "0 of 2 diagnoses reused" in " ".join(printed.split())


def test_an_audit_of_zero_initialised_blocks_says_its_frozen_control_is_a_shallow_network(tmp_path, capsys):
    """w2_std = 0: every residual branch starts at exactly 0, so the frozen control is the shallow
    network. Measured on the control (not read from a setting), stated on every main run's
    diagnosis, in audit.md and on the terminal; with the default init, not said."""
    for w2, said in ((0.0, True), (0.01, False)):
        toml = tmp_path / f"{w2}.toml"
        toml.write_text(f'dataset = "digits"\nmethods = ["bp"]\nseeds = [1]\nepochs = 2\njobs = 1\n'
                        f'eval_batches = 4\n[model]\nwidth = 16\nblocks = 2\nw2_std = {w2}\n')
        out = tmp_path / f"a{w2}"
        capsys.readouterr()
        assert cli_main(["audit", "--config", str(toml), "--out", str(out), "--quiet"]) in (0, 1, 3)
        printed = " ".join(capsys.readouterr().out.split())
        result = json.loads((out / "audit.json").read_text())
        main = next(r for r in result["runs"] if r["control"] == "none")
        notes = " ".join(main["report"]["notes"])
        assert ("exactly a shallow network" in notes) is said
        assert ("exactly a shallow network" in printed) is said
        assert ("beat no blocks at all" in (out / "audit.md").read_text()) is said
