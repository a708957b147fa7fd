"""CreditAuditCallback inside a real lightning.Trainer: a monitored run, its frozen control, the audit."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

L = pytest.importorskip("lightning")

import creditaudit  # noqa: E402
from creditaudit.data import load_dataset  # noqa: E402
from creditaudit.lightning import CreditAuditCallback  # noqa: E402
from creditaudit.metrics import monitor_snapshot  # noqa: E402
from creditaudit.monitor import load_monitored  # noqa: E402


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
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


ADAPTER = creditaudit.Adapter(embed=lambda m, x: m.net.embed_input(x), blocks="net.blocks",
                              readout="net.readout")


def _fit(module, callback, loader):
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")            # Lightning's advice about workers and logging
        trainer.fit(module, loader)


def test_callback_in_a_real_trainer(tmp_path):
    data = load_dataset("digits")
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data.x_train, data.y_train),
                                         batch_size=128, shuffle=True)
    test = [data.eval_batch(0, 360)]
    torch.manual_seed(0)
    module = Classifier()
    init = {k: v.clone() for k, v in module.state_dict().items()}
    cb = CreditAuditCallback(data.eval_batch(0), tmp_path / "run", adapter=ADAPTER, test_batches=test,
                             seed=0, diagnose_batches=[data.eval_batch(i, 45) for i in range(8)])
    _fit(module, cb, loader)
    run = load_monitored(tmp_path / "run")
    assert run.status["status"] == "finished" and run.epochs_completed == 2
    assert [r["epoch"] for r in run.history] == [0, 1, 2]
    module.eval()
    now = monitor_snapshot(module.net, *data.eval_batch(0))
    assert run.history[-1]["h_norms"] == pytest.approx(now.h_norms, rel=1e-6)
    assert run.history[-1]["gain"] == pytest.approx(now.gain, rel=1e-6)
    assert 0.0 < run.history[-1]["train_loss"] < run.history[1]["train_loss"]   # it did learn
    assert run.diagnosis["training"]["status"] == "finished"

    control = cb.frozen_control()
    assert all(torch.equal(control.state_dict()[k], v) for k, v in init.items())
    ccb = CreditAuditCallback(data.eval_batch(0), tmp_path / "ctrl", adapter=ADAPTER, test_batches=test,
                              seed=0, control_of=cb)
    _fit(control, ccb, loader)
    assert all(torch.equal(control.net.blocks.state_dict()[k], v)
               for k, v in {k[len("net.blocks."):]: v for k, v in init.items()
                            if k.startswith("net.blocks.")}.items())
    audit = creditaudit.audit_own_runs([tmp_path / "run"], [tmp_path / "ctrl"], out=tmp_path / "audit",
                                       method="lightning-bp", n_test=360)
    gap = load_monitored(tmp_path / "run").diagnosis["depth"]["gap"]   # (d) once the control finished
    assert gap == pytest.approx(run.test_acc - load_monitored(tmp_path / "ctrl").test_acc)
    row = audit["methods"][0]
    assert row["n_paired_with_frozen"] == 1
    assert row["depth_gap"] == pytest.approx(run.test_acc - load_monitored(tmp_path / "ctrl").test_acc)


class NoForward(L.LightningModule):
    """A LightningModule with no forward(): training_step reaches the network's parts itself."""

    def __init__(self):
        super().__init__()
        self.net = creditaudit.ResidualMLP(64, d=16, n_blocks=2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_callback_without_forward_logs_through_the_trainers_loggers(tmp_path):
    """Accuracy comes through the adapter (the module has no forward()); every logger of the
    trainer receives each epoch's monitor scalars and flags under trackers.py's names."""
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    data = load_dataset("digits")
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data.x_train, data.y_train),
                                         batch_size=256, shuffle=False)
    test = [data.eval_batch(0, 360)]
    torch.manual_seed(0)
    module = NoForward()
    with pytest.raises(NotImplementedError):        # nothing here may call it
        module(data.x_test[:2])
    seen = []
    cb = CreditAuditCallback(data.eval_batch(0), tmp_path / "run", adapter=ADAPTER, test_batches=test,
                             seed=0, on_epoch=seen.append)
    csv, tb = CSVLogger(tmp_path / "csv", name="m"), TensorBoardLogger(tmp_path / "tb", name="m")
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", logger=[csv, tb], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)
    run = load_monitored(tmp_path / "run")
    assert run.status["status"] == "finished"
    stream = module.net.stream()
    with torch.no_grad():
        x, y = test[0]
        module.eval()
        expected = int((stream.forward_from(0, stream.embed(x)).argmax(-1) == y).sum()) / len(y)
    assert run.test_acc == pytest.approx(expected, abs=1e-12)

    # the CSV logger: one row per epoch record (0 = init), the values the run folder holds
    import csv as csvlib
    rows = [r for r in csvlib.DictReader(open(Path(csv.log_dir) / "metrics.csv"))
            if r.get("creditaudit/epoch")]
    assert [float(r["creditaudit/epoch"]) for r in rows] == [0.0, 1.0, 2.0]
    assert [float(r["creditaudit/gain"]) for r in rows] == pytest.approx([h["gain"] for h in run.history], rel=1e-6)
    assert [float(r["creditaudit/test_acc"]) for r in rows] == pytest.approx([h["test_acc"] for h in run.history])
    for k in ("a", "a_prime", "b", "b_prime"):
        assert {float(r[f"creditaudit/flag/{k}"]) for r in rows} <= {0.0, 1.0}
    assert [float(r["step"]) for r in rows] == [0, 6, 12]      # the trainer's global step (6 batches/epoch)
    # the TensorBoard logger, read back from its event file
    acc = EventAccumulator(tb.log_dir)
    acc.Reload()
    h2 = [e.value for e in acc.Scalars("creditaudit/h_norm/l2")]
    assert h2 == pytest.approx([h["h_norms"][2] for h in run.history], rel=1e-6)
    assert [e.value for e in acc.Scalars("creditaudit/flag/b_prime")] == [r["creditaudit/flag/b_prime"] for r in seen]
    # the user's own on_epoch got the same dicts
    assert [r["creditaudit/epoch"] for r in seen] == [0.0, 1.0, 2.0]
    assert seen[-1]["creditaudit/gain"] == pytest.approx(run.history[-1]["gain"], rel=1e-6)


class ClaimsAccuracy(Classifier):
    """Logs a test accuracy its test batches do not give (issue 28: a claimed 0.99)."""

    def on_train_epoch_end(self):
        self.log("test_acc", 0.99)


def test_callback_refuses_a_logged_accuracy_that_its_test_batches_contradict(tmp_path):
    data = load_dataset("digits")
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data.x_train, data.y_train),
                                         batch_size=128, shuffle=True)
    torch.manual_seed(0)
    cb = CreditAuditCallback(data.eval_batch(0), tmp_path / "run", adapter=ADAPTER,
                             test_batches=[data.eval_batch(0, 360)], test_acc_key="test_acc")
    with pytest.raises(creditaudit.CreditAuditError, match=r"epoch_end\(test_acc=0.99\), but the Monitor measured"):
        _fit(ClaimsAccuracy(), cb, loader)
    assert load_monitored(tmp_path / "run").status["status"] == "interrupted"    # never "finished"
