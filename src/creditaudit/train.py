"""The trainer: runs any method plug-in on any dataset, epoch by epoch, into a run folder.

It knows nothing about a method's update rule: it draws batches, calls `method.train_step`, steps
the schedules, evaluates, records the training-time monitor ((a), (b), (b′) and accuracy on one
fixed eval batch), and checkpoints. A killed run resumes from its last completed epoch and ends
with exactly the weights and metrics of an uninterrupted run (CPU; on CUDA up to kernel
nondeterminism).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from . import store
from .config import RunConfig
from .data import ArrayDataset, load_dataset
from .errors import CreditAuditError
from .methods import Method, MethodSettings, method_class
from .metrics import accuracy, monitor_snapshot
from .model import ResidualMLP
from .protocol import Thresholds, fires_a, fires_b_prime, first_fire_epochs
from .seeding import derived_generator, seed_everything


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """'auto' → cuda when available, else cpu; anything else must be usable here."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise CreditAuditError(f"unknown device {device!r}; use cpu, cuda, cuda:N or auto") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CreditAuditError(f"device {device!r} asked for, but this machine has no CUDA GPU; "
                               "use --device cpu (or auto)")
    return dev


def build_model(config: RunConfig, data: ArrayDataset) -> ResidualMLP:
    """The run's ResidualMLP, initialised from the run's seed."""
    seed_everything(config.seed)
    return ResidualMLP(data.d_in, d=config.width, n_blocks=config.blocks, n_classes=data.n_classes,
                       activation=config.activation, w2_std=config.w2_std)


def build_method(config: RunConfig, model: ResidualMLP) -> Method:
    settings = MethodSettings(epochs=config.epochs, seed=config.seed, lr=config.lr,
                              weight_decay=config.weight_decay, lam=config.lam,
                              trainable_blocks=config.trainable_block_ids,
                              options=dict(config.options))
    return method_class(config.method)(model, settings)


@dataclass
class Run:
    """A run folder's content, rebuilt: config, model and method at the last checkpoint, history."""

    config: RunConfig
    run_dir: Path
    model: ResidualMLP
    method: Method
    history: list[dict] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)

    @property
    def test_acc(self) -> float | None:
        return self.history[-1]["test_acc"] if self.history else None


def read_config(run_dir: Path) -> RunConfig:
    raw = store.read_json(Path(run_dir) / "config.json", "creditaudit run folder")
    return RunConfig.from_dict(raw)


def read_status(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / "status.json"
    return store.read_json(path, "creditaudit run folder") if path.exists() else {}


def load_run(run_dir: str | Path, device: str | torch.device = "cpu",
             data: ArrayDataset | None = None) -> Run:
    """Rebuild a run from its folder (config.json + checkpoint) without unpickling anything."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CreditAuditError(f"run folder {run_dir} does not exist")
    config = read_config(run_dir)
    meta, state = store.load_checkpoint(run_dir)
    d_in, n_classes = meta["d_in"], meta["n_classes"]
    seed_everything(config.seed)
    model = ResidualMLP(d_in, d=config.width, n_blocks=config.blocks, n_classes=n_classes,
                        activation=config.activation, w2_std=config.w2_std)
    try:
        model.load_state_dict(state["model"])
    except (RuntimeError, KeyError) as err:
        raise CreditAuditError(f"checkpoint in {run_dir} does not fit its config.json ({err})") from None
    model.to(resolve_device(device))
    method = build_method(config, model)
    try:
        method.load_state_dict(state["method"])
    except (KeyError, ValueError, RuntimeError, TypeError) as err:
        raise CreditAuditError(f"the method state in {run_dir} does not fit a {config.method!r} run "
                               f"({type(err).__name__}: {err}); the checkpoint is corrupt or foreign") from None
    return Run(config, run_dir, model, method, state["history"], read_status(run_dir))


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def train_run(config: RunConfig, out: str | Path, *, data_dir: str | Path | None = None,
              device: str | torch.device = "auto", data: ArrayDataset | None = None,
              progress: bool = True, thresholds: Thresholds | None = None) -> Run:
    """Train `config` into folder `out`, resuming from its checkpoint if one exists.

    A folder holding a different config is refused. A finished run is returned as is. Returns the
    `Run`; its `status["status"]` is "finished", "diverged" (non-finite values: the last finite
    checkpoint and metrics are kept) or "stopped" (a monitor flag held `stop_when_flagged` epochs).
    """
    out = Path(out)
    thresholds = thresholds or Thresholds()
    dev = resolve_device(device)
    if (out / "config.json").exists():
        existing = read_config(out)
        if existing != config:
            raise CreditAuditError(
                f"{out} already holds a different run ({existing.label}, key {existing.run_key}); "
                "choose another --out or delete that folder")
        status = read_status(out)
        if status.get("status") in ("finished", "diverged", "stopped"):
            return load_run(out, dev)
    out.mkdir(parents=True, exist_ok=True)
    store.atomic_write_json(out / "config.json", config.to_dict())

    data = (data if data is not None else load_dataset(config.dataset, data_dir, dev)).to(dev)
    model = build_model(config, data).to(dev)
    method = build_method(config, model)
    data_gen = derived_generator(config.seed, "data")
    history: list[dict] = []
    start = 0
    if store.has_checkpoint(out):
        run = load_run(out, dev)
        model, method, history = run.model, run.method, run.history
        _, state = store.load_checkpoint(out)
        data_gen.set_state(state["data_gen"])
        torch.set_rng_state(state["torch_rng"])
        start = history[-1]["epoch"]
    eval_x, eval_y = data.eval_batch(0)

    def save(epoch: int) -> None:
        store.save_checkpoint(out, epoch, {
            "model": model.state_dict(), "method": method.state_dict(),
            "data_gen": data_gen.get_state(), "torch_rng": torch.get_rng_state(),
            "history": history,
        }, {"d_in": data.d_in, "n_classes": data.n_classes, "label": config.label})
        store.write_metrics(out, history)

    def finish(status: str, message: str, wall: float) -> Run:
        fired = first_fire_epochs(history, thresholds)
        store.atomic_write_json(out / "status.json", store.json_safe({
            "status": status, "message": message, "epochs_completed": history[-1]["epoch"],
            "test_acc": history[-1]["test_acc"], "first_fire": fired, "wall_time": wall}))
        return load_run(out, dev)

    t0 = time.perf_counter() - (history[-1]["wall_time"] if history else 0.0)
    if not history:  # epoch 0: the model at init, the reference for every later growth figure
        history.append(_record(0, None, model, data, eval_x, eval_y, 0.0))  # no training loss yet
        save(0)
    bar = tqdm(range(start + 1, config.epochs + 1), desc=config.label, disable=not progress,
               initial=start, total=config.epochs, leave=False)
    for epoch in bar:
        model.train()
        loss_sum = torch.zeros((), device=dev)
        for x, y in data.train_batches(config.batch_size, data_gen):
            loss_sum += method.train_step(x, y) * len(y)
        method.end_epoch()
        train_loss = float(loss_sum) / len(data.y_train)
        record = _record(epoch, train_loss, model, data, eval_x, eval_y, time.perf_counter() - t0)
        if not (_finite(train_loss) and all(_finite(v) for v in record["h_norms"])):
            bad = store.json_safe(record)
            return finish("diverged", f"non-finite values at epoch {epoch} (train loss {train_loss}, "
                          f"‖h_l‖ {bad['h_norms']}); kept the checkpoint of epoch {epoch - 1}",
                          record["wall_time"])
        history.append(record)
        save(epoch)
        bar.set_postfix(loss=f"{train_loss:.3f}", acc=f"{record['test_acc']:.3f}",
                        hL=f"{record['h_norms'][-1]:.2g}")
        held = _flag_streak(history, thresholds)
        if config.stop_when_flagged and held >= config.stop_when_flagged:
            return finish("stopped", f"stopped at epoch {epoch}: a monitor flag held {held} epochs "
                          f"(--stop-when-flagged {config.stop_when_flagged})", record["wall_time"])
    return finish("finished", f"trained {config.epochs} epochs", history[-1]["wall_time"])


def _record(epoch: int, train_loss: float | None, model: ResidualMLP, data: ArrayDataset,
            eval_x: torch.Tensor, eval_y: torch.Tensor, wall: float) -> dict[str, Any]:
    """One line of the metrics log: losses, test accuracy, the monitor on the fixed eval batch."""
    model.eval()
    snap = monitor_snapshot(model, eval_x, eval_y)
    return {"epoch": epoch, "train_loss": train_loss,
            "test_acc": accuracy(model, data.eval_batches("test", 1000)),
            **snap.to_dict(), "wall_time": wall}


def _flag_streak(history: list[dict], thresholds: Thresholds) -> int:
    """How many consecutive epochs, ending now, (a) or (b′) has held.

    (b) alone does not count: it also fires on a healthy model that fits its eval batch (the
    confound (b′) removes), and stopping such a run early would only truncate a good result.
    """
    streak = 0
    for r in reversed(history):
        if not (fires_a(r["max_growth"], thresholds) or fires_b_prime(r["gain"], thresholds)):
            break
        streak += 1
    return streak
