"""W&B and MLflow as first-class trackers: what the Monitor, `audit_own_runs` and `creditaudit
audit --tracker` log is read back from W&B's offline run files and from MLflow's local store, and
holds every monitor scalar per epoch under trackers.epoch_scalars' names, and the verdict at the
end. W&B runs offline into a tmp folder (never the network); MLflow into a local folder store."""
from __future__ import annotations

import glob
import json
import re
import shutil
import struct
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import creditaudit
from creditaudit import trackers
from creditaudit.cli import main
from creditaudit.data import load_dataset
from creditaudit.errors import CreditAuditError


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B offline and silent, writing only under tmp_path; MLflow's folder store allowed."""
    for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
                       "WANDB_DIR": str(tmp_path / "wandb_default"), "WANDB_DISABLE_GIT": "true",
                       "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"),
                       "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"),
                       "WANDB_DATA_DIR": str(tmp_path / "wandb_data"),
                       "MLFLOW_ALLOW_FILE_STORE": "true"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    yield tmp_path
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()          # its service process ends with the test


def _wandb_records(path: str):
    """The protobuf records of a W&B offline run file (a LevelDB-style log of 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    block, pos, buf = 32768, 7, b""
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:                             # a block's tail too short for a header is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):                       # FULL or LAST fragment
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


def wandb_runs(root: Path) -> dict[str, dict]:
    """Every offline W&B run under root by its name: its history rows, its summary, its config
    (the later of a run's resumed files wins) and how many run files it has."""
    runs: dict[str, dict] = {}
    by_id: dict[str, str] = {}
    paths = sorted(glob.glob(str(root / "**" / "offline-run-*" / "run-*.wandb"), recursive=True))
    for _ in range(100):       # W&B's service may still be writing a file when finish() returns
        ended = [any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(p)) for p in paths]
        if all(ended):
            break
        time.sleep(0.1)
    for path in paths:
        history, summary, config, name, run_id = [], {}, {}, None, None
        for rec in _wandb_records(path):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                name, run_id = rec.run.display_name or name, rec.run.run_id
            elif kind == "history":
                history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
            elif kind == "config":
                config.update({i.key: json.loads(i.value_json) for i in rec.config.update})
            elif kind == "summary":
                summary.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.summary.update})
        name = name or by_id.get(run_id)
        by_id[run_id] = name
        entry = runs.setdefault(name, {"history": [], "summary": {}, "config": {}, "files": 0})
        entry["history"] += history
        entry["summary"].update(summary)
        entry["config"].update({k: v.get("value") if isinstance(v, dict) else v for k, v in config.items()})
        entry["files"] += 1
    return runs


def mlflow_runs(uri: str, experiment: str) -> dict[str, object]:
    from mlflow.tracking import MlflowClient
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    return {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}, client


def _train(mon, n):
    for _ in range(n):
        mon.step(torch.tensor(1.5), 10)
        mon.epoch_end(test_acc=0.25)


def test_monitor_logs_to_wandb_and_mlflow(offline, digits):
    """Each epoch's epoch_scalars reach W&B (history rows) and MLflow (metrics, step = epoch); the
    run's status and verdicts arrive at the end (W&B summary, MLflow tags); a control that finishes
    later updates the main run's verdict in both."""
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    uri = (offline / "mlruns").as_uri()
    seen = []
    torch.manual_seed(0)
    model = creditaudit.ResidualMLP(64, d=16, n_blocks=2)
    wb = trackers.WandbLog(project="mine", dir=offline / "wb", name="main")
    ml = trackers.MLflowLog(experiment="mine", tracking_uri=uri, name="main")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", creditaudit.FlagFired)
        # accuracies measured on test_batches (not claimed): a control's accuracy is then known to
        # be measured on its run's test set, which (d) needs (issue 34)
        test = [digits.eval_batch(1)]
        with creditaudit.Monitor(model, digits.eval_batch(0), offline / "run", epochs=2, seed=3,
                                 method="mine", trackers=[wb, ml], on_epoch=seen.append,
                                 test_batches=test) as mon:
            for _ in range(2):
                mon.step(torch.tensor(1.5), 10)
                mon.epoch_end()
        first_verdict = mon.report.verdict
        assert mon.report.to_dict()["depth"] is None             # no control yet: (d) not evaluated
        assert mon.report.to_dict()["missing_evidence"] or first_verdict != "trustworthy"

        runs, client = mlflow_runs(uri, "mine")
        run = runs["main"]
        for key in ("creditaudit/gain", "creditaudit/h_norm/l2", "creditaudit/flag/a"):
            hist = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
            assert [m.step for m in hist] == [0, 1, 2]
            assert [m.value for m in hist] == pytest.approx([s[key] for s in seen], rel=1e-6)
        # the run's own verdict, named so: no audit judged it, so no creditaudit/verdict
        assert run.data.tags["creditaudit/run_verdict"] == first_verdict
        assert run.data.tags["creditaudit/run_paper_verdict"] == mon.report.paper_verdict
        assert "creditaudit/verdict" not in run.data.tags
        assert run.data.params["method"] == "mine" and run.data.params["seed"] == "3"
        assert run.data.params["control"] == "none"
        assert run.info.status == "FINISHED"

        # the frozen control finishes later: the main run is re-diagnosed with (d), and its
        # trackers get the newer verdict; the control itself gets none
        ctrl_log = trackers.MLflowLog(experiment="mine", tracking_uri=uri, name="ctrl")
        ctrl = creditaudit.Monitor(mon.frozen_control(), digits.eval_batch(0), offline / "ctrl",
                                   epochs=2, control_of=mon, trackers=ctrl_log, test_batches=test)
        for _ in range(2):
            for p in [*ctrl.model.embed_parameters(), *ctrl.model.head_parameters()]:
                p.data.add_(0.01)        # embedding and readout both train (each its own group)
            ctrl.step(torch.tensor(1.5), 10)
            ctrl.epoch_end()
        ctrl.finish()
    assert mon.report.to_dict()["depth"] is not None          # (d) now evaluated
    now = mon.report.verdict
    got = wandb_runs(offline / "wb")
    # the W&B run waited open for its control: one folder, every epoch, the newer verdict
    assert list(got) == ["main"] and got["main"]["files"] == 1
    assert len(glob.glob(str(offline / "wb" / "**" / "offline-run-*"), recursive=True)) == 1
    rows = [r for r in got["main"]["history"] if "creditaudit/epoch" in r]
    assert [r["creditaudit/epoch"] for r in rows] == [0, 1, 2]
    for row, want in zip(rows, seen):
        assert {k: row[k] for k in want} == pytest.approx(want, rel=1e-6)
    assert got["main"]["summary"]["creditaudit/run_verdict"] == now
    assert got["main"]["summary"]["creditaudit/status"] == "finished"
    assert got["main"]["config"]["method"] == "mine" and got["main"]["config"]["seed"] == 3
    runs, _ = mlflow_runs(uri, "mine")
    assert runs["main"].data.tags["creditaudit/run_verdict"] == now
    assert not any("verdict" in k for k in runs["ctrl"].data.tags)            # a control: no verdict
    assert runs["ctrl"].data.params["control"] == "frozen"


def test_audit_own_runs_and_cli_audit_log_each_run(offline, digits, monkeypatch):
    """`audit_own_runs(trackers=...)` and `creditaudit audit --tracker` open one tracker run per
    run folder, named by it, once, with its settings (W&B config, MLflow params), its whole monitor
    history and, at the end, its status and — a run of a method — the audit's verdict on its method
    as `creditaudit/verdict`, its own as `creditaudit/run_verdict`; controls get no verdict; one
    summary run per audit holds each method's verdict; MLflow's log lines stay out of W&B's."""
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    monkeypatch.delenv("WANDB_CONSOLE")         # W&B's own setting must keep the console out
    uri = (offline / "mlruns").as_uri()
    torch.manual_seed(1)
    model = creditaudit.ResidualMLP(64, d=16, n_blocks=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", creditaudit.FlagFired)
        with creditaudit.Monitor(model, digits.eval_batch(0), offline / "own" / "r1", epochs=1,
                                 method="mine") as mon:
            _train(mon, 1)
        audit = creditaudit.audit_own_runs([offline / "own" / "r1"], out=offline / "own_audit",
                                           n_test=64, quiet=True, tracker_project="own",
                                           trackers=[f"wandb:{offline / 'wb_own'}", f"mlflow:{uri}"])
    method_verdict = audit["methods"][0]["verdict"]
    got = wandb_runs(offline / "wb_own")["r1"]
    rows = [r for r in got["history"] if "creditaudit/epoch" in r]
    assert [r["creditaudit/gain"] for r in rows] == pytest.approx([r["gain"] for r in mon.history], rel=1e-6)
    assert got["summary"]["creditaudit/run_verdict"] == mon.report.verdict
    assert got["summary"]["creditaudit/verdict"] == method_verdict
    runs, _ = mlflow_runs(uri, "own")
    assert runs["r1"].data.tags["creditaudit/verdict"] == method_verdict
    assert runs["audit-summary"].data.tags["creditaudit/verdict/mine"] == method_verdict

    code = main(["audit", "--dataset", "digits", "--epochs", "1", "--device", "cpu", "--quiet",
                 "--methods", "bp", "--seeds", "42", "--jobs", "1",
                 "--no-stack", "--out", str(offline / "audit"), "--tracker", f"mlflow:{uri}",
                 "--tracker", f"wandb:{offline / 'wb_audit'}", "--tracker-project", "cli"])
    assert code in (0, 3)
    result = json.loads((offline / "audit" / "audit.json").read_text())
    names = sorted(Path(r["run_dir"]).name for r in result["runs"])
    assert len(names) == 3                                  # the run, its frozen and shallow controls
    wb = wandb_runs(offline / "wb_audit")
    ml, client = mlflow_runs(uri, "cli")
    assert sorted(wb) == sorted(ml) == sorted([*names, "audit-summary"])
    assert all(entry["files"] == 1 for entry in wb.values())          # one W&B folder per run
    assert len(glob.glob(str(offline / "wb_audit" / "**" / "offline-run-*"), recursive=True)) == len(wb)
    for log in glob.glob(str(offline / "wb_audit" / "**" / "output.log"), recursive=True):
        assert "mlflow" not in Path(log).read_text().lower(), log
    row = result["methods"][0]
    assert wb["audit-summary"]["summary"]["creditaudit/verdict/bp"] == row["verdict"]
    assert ml["audit-summary"].data.tags["creditaudit/paper_verdict/bp"] == row["paper_verdict"]
    assert ml["audit-summary"].data.params["methods"] == "bp"
    for run in result["runs"]:
        name = Path(run["run_dir"]).name
        history = [json.loads(x) for x in (Path(run["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
        hist = sorted(client.get_metric_history(ml[name].info.run_id, "creditaudit/h_norm/l0"),
                      key=lambda m: m.step)
        assert [m.value for m in hist] == pytest.approx([r["h_norms"][0] for r in history], rel=1e-6)
        assert [r["creditaudit/gain"] for r in wb[name]["history"] if "creditaudit/gain" in r] == \
            pytest.approx([r["gain"] for r in history], rel=1e-6)
        assert ml[name].data.tags["creditaudit/status"] == run["status"]
        assert wb[name]["summary"]["creditaudit/status"] == run["status"]
        for params in (ml[name].data.params, wb[name]["config"]):
            assert str(params["method"]) == "bp" and str(params["seed"]) == "42"
            assert str(params["control"]) == run["control"] and str(params["recipe.optimizer"]) == "adamw"
        if run["control"] == "none":        # the audit's verdict on bp, and this run's own beside it
            assert ml[name].data.tags["creditaudit/verdict"] == row["verdict"]
            assert wb[name]["summary"]["creditaudit/verdict"] == row["verdict"]
            assert ml[name].data.tags["creditaudit/run_verdict"] == run["report"]["verdict"]
        else:
            assert not any("verdict" in k for k in ml[name].data.tags)
            assert not any("verdict" in k for k in wb[name]["summary"])


@pytest.mark.parametrize("spec, match", [
    ("comet:x", "unknown tracker 'comet'"),
    ("tensorboard", "TensorBoard needs a log folder"),
    ("", "unknown tracker ''"),
    ("wandb:/etc/passwd/wb", "cannot log to Weights & Biases in /etc/passwd/wb: /etc/passwd is a file"),
    ("mlflow:file:///tmp/creditaudit-test-mlruns", "MLFLOW_ALLOW_FILE_STORE=true"),
])
def test_bad_tracker_specs_are_one_line(spec, match, tmp_path, capsys, monkeypatch):
    if spec.split(":")[0] in ("wandb", "mlflow"):
        pytest.importorskip(spec.split(":")[0])
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(CreditAuditError, match=match):
        trackers.check_trackers([spec])
    code = main(["audit", "--dataset", "digits", "--epochs", "1", "--methods", "bp", "--seeds", "42",
                 "--out", str(tmp_path / "a"), "--tracker", spec])
    assert code == 2 and not (tmp_path / "a").exists()       # refused before any training
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("module, spec, cls", [("wandb", "wandb", "WandbLog"),
                                               ("mlflow", "mlflow", "MLflowLog")])
def test_missing_extra_is_named(module, spec, cls, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)          # import fails as if not installed
    with pytest.raises(CreditAuditError, match=rf'pip install "creditaudit\[{module}\]"'):
        trackers.check_trackers([spec])
    with pytest.raises(CreditAuditError, match=rf'creditaudit\[{module}\]'):
        getattr(trackers, cls)()


def test_mlflow_folder_store_refusal_names_the_fix(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(CreditAuditError, match="MLFLOW_ALLOW_FILE_STORE=true .* sqlite:///mlflow.db"):
        trackers.MLflowLog(tracking_uri=(tmp_path / "mlruns").as_uri())


def test_monitor_refuses_what_is_not_a_tracker(tmp_path, digits):
    model = creditaudit.ResidualMLP(64, d=16, n_blocks=2)
    for bad in ("wandb", print, [object()]):
        with pytest.raises(CreditAuditError, match="trackers= takes"):
            creditaudit.Monitor(model, digits.eval_batch(0), tmp_path / "r", epochs=1, trackers=bad)
    assert not (tmp_path / "r").exists()


DOC = Path(__file__).resolve().parents[1] / "docs" / "YOUR_OWN_LOOP.md"


def _tracker_snippets() -> list[str]:
    text = DOC.read_text()
    section = text.split("## TensorBoard, W&B, MLflow", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_docs_tracker_snippets_run_as_written(offline, digits, monkeypatch):
    """docs/YOUR_OWN_LOOP.md's snippet per tracker, run as written in place of the loop's Monitor
    line: each logs the run, and W&B's and MLflow's hold its verdict afterwards."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    snippets = _tracker_snippets()
    assert len(snippets) == 3
    monkeypatch.chdir(offline)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")         # the snippet's SQLite store needs none
    verdicts = []
    for i, code in enumerate(snippets):
        torch.manual_seed(0)
        model = creditaudit.ResidualMLP(64, d=16, n_blocks=2)
        scope = {"creditaudit": creditaudit, "model": model, "eval_batch": digits.eval_batch(0), "EPOCHS": 1}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", creditaudit.FlagFired)
            exec(compile(code, f"docs/YOUR_OWN_LOOP.md (tracker snippet {i})", "exec"), scope)
            mon = scope["mon"]
            _train(mon, 1)
            verdicts.append(mon.finish().verdict)
            mon.end_trackers()                            # no control will come: end the W&B run now
        shutil.move("runs", f"runs{i}")                   # each snippet writes runs/dfa-s0
    assert (offline / "tb" / "dfa-s0").is_dir()
    assert wandb_runs(offline / "wandb_logs")["dfa-s0"]["summary"]["creditaudit/run_verdict"] == verdicts[1]
    runs, client = mlflow_runs("sqlite:///mlflow.db", "my-dfa")
    assert runs["dfa-s0"].data.tags["creditaudit/run_verdict"] == verdicts[2]
    assert [m.step for m in client.get_metric_history(runs["dfa-s0"].info.run_id, "creditaudit/gain")] == [0, 1]


def test_lightning_callback_passes_trackers_on(offline, digits):
    """CreditAuditCallback(trackers=...) logs each epoch to MLflow and tags the verdict at the end."""
    L = pytest.importorskip("lightning")
    pytest.importorskip("mlflow")
    import torch.nn.functional as F
    from creditaudit.lightning import CreditAuditCallback

    class Classifier(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = creditaudit.ResidualMLP(64, d=16, n_blocks=2)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    uri = (offline / "mlruns").as_uri()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(digits.x_train, digits.y_train),
                                         batch_size=256)
    torch.manual_seed(0)
    cb = CreditAuditCallback(digits.eval_batch(0), offline / "run", test_batches=[digits.eval_batch(0, 360)],
                             adapter=creditaudit.Adapter(embed=lambda m, x: m.net.embed_input(x),
                                                         blocks="net.blocks", readout="net.readout"),
                             trackers=trackers.MLflowLog(experiment="pl", tracking_uri=uri, name="pl"))
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Classifier(), loader)
    runs, client = mlflow_runs(uri, "pl")
    hist = sorted(client.get_metric_history(runs["pl"].info.run_id, "creditaudit/gain"), key=lambda m: m.step)
    assert [m.value for m in hist] == pytest.approx([r["gain"] for r in cb.monitor.history], rel=1e-6)
    assert runs["pl"].data.tags["creditaudit/run_verdict"] == cb.report.verdict


def test_trackers_flag_by_the_monitors_thresholds(offline, digits):
    """A tracker made with the default thresholds logs the flags the Monitor's own thresholds
    decide (those its verdict uses), not the defaults."""
    pytest.importorskip("mlflow")
    from creditaudit.verdict import Thresholds
    uri = (offline / "mlruns").as_uri()
    torch.manual_seed(0)
    model = creditaudit.ResidualMLP(64, d=16, n_blocks=2)
    log = trackers.MLflowLog(experiment="t", tracking_uri=uri, name="strict")
    strict = Thresholds(growth=1.000001)                   # any growth at all fires (a)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", creditaudit.FlagFired)
        with creditaudit.Monitor(model, digits.eval_batch(0), offline / "run", epochs=1,
                                 thresholds=strict, trackers=log) as mon:
            _train(mon, 1)
    assert all(r["max_growth"] > 1.000001 for r in mon.history)
    runs, client = mlflow_runs(uri, "t")
    flags = [m.value for m in client.get_metric_history(runs["strict"].info.run_id, "creditaudit/flag/a")]
    assert flags == [1.0, 1.0]
    assert trackers.epoch_flags(mon.history[0], None)["a"] is False   # the default would not fire


def test_wandb_keeps_other_libraries_lines_out_of_its_run(offline, monkeypatch, capsys):
    """No cross-talk: while a WandbLog's run is open, what MLflow (or anything else) writes to the
    console does not land in the W&B run's console log — W&B's own console capture is off,
    whatever WANDB_CONSOLE says."""
    pytest.importorskip("wandb")
    import logging
    monkeypatch.delenv("WANDB_CONSOLE")
    log = trackers.WandbLog(project="x", dir=offline / "wb", name="quiet")
    handler = logging.StreamHandler(sys.stderr)
    logging.getLogger("mlflow").addHandler(handler)
    try:
        logging.getLogger("mlflow").warning("an mlflow line")
        print("a line of the user's own", flush=True)
    finally:
        logging.getLogger("mlflow").removeHandler(handler)
    log.end({"creditaudit/status": "finished"})
    assert "an mlflow line" in capsys.readouterr().err          # it was written, to the console
    assert wandb_runs(offline / "wb")["quiet"]["summary"]["creditaudit/status"] == "finished"
    for path in glob.glob(str(offline / "wb" / "**" / "output.log"), recursive=True):
        text = Path(path).read_text()
        assert "an mlflow line" not in text and "a line of the user's own" not in text, path
