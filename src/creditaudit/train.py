"""The trainer: runs any method plug-in on any dataset, epoch by epoch, into a run folder.

It knows nothing about a method's update rule or about verdicts: it draws batches, calls
`method.train_step`, steps the schedules, evaluates, records the training-time monitor ((a), (b),
(b′) statistics and accuracy on one fixed eval batch, plus the method's own `epoch_log`), and
checkpoints. An early-stop rule, when wanted, is handed in (`verdict.stop_rule`). A killed run
resumes from its last completed epoch and ends with exactly the weights and metrics of an
uninterrupted run (CPU, same thread count; on CUDA up to kernel nondeterminism).

Where and how fast: a run trains on the device it is given, else where its data are, else the CPU
(never "auto": the command line resolves that). A step touches the host never: the epoch's order
and augmentation are drawn before its first batch (`ArrayDataset.train_batches`), the loss is summed
on the device, and the monitor reads numbers once per epoch. The step runs in the run's
`precision` (`precision_context`: fp32 by default, TF32 or bf16 autocast opt-in); the monitor and
every diagnosis run outside it, in fp32. On CUDA the method's `gradients` is compiled with
mode "reduce-overhead" (CUDA graphs) when asked: `compile_step=None` = on CUDA only (the command
line's default; --no-compile turns it off), True = always, False = never (the library default, so
a Python caller and the test suite pay no compilation unless they ask).
"""
from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from safetensors import SafetensorError
from tqdm.auto import tqdm

from . import store
from .config import RunConfig
from .data import ArrayDataset, load_dataset
from .errors import CreditAuditError
from .metrics import accuracy, monitor_snapshot
from .runs import Run, as_device, build_method, build_model, data_shape, existing_run_is_done, load_run
from .seeding import derived_generator

StopRule = Callable[[Sequence[dict]], "str | None"]


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


@contextlib.contextmanager
def precision_context(precision: str, device: torch.device):
    """The numerics of the training steps run inside it (RunConfig.precision):

        fp32  float32 storage and arithmetic: TF32 switched off for matmuls and cuDNN convolutions
              (cuDNN allows TF32 by default, which would make a ResNet's "fp32" steps TF32)
        tf32  float32 storage, TF32 matmuls and convolutions on CUDA (no effect on a CPU)
        bf16  torch.autocast to bfloat16 on the device (weights and optimizer state stay float32)

    Global switches are restored on exit, so the monitor and the diagnoses after it are fp32."""
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
        torch.backends.cudnn.allow_tf32 = precision == "tf32"
        if precision == "bf16":
            with torch.autocast(device.type, dtype=torch.bfloat16):
                yield
        else:
            yield
    finally:
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = cudnn


def compile_mode_for(device: torch.device, compile_step: bool | None) -> str | None:
    """torch.compile mode of the step, or None for eager: compile_step False → eager; True →
    compiled; None → compiled on CUDA only. On CUDA the mode is "reduce-overhead" (CUDA graphs:
    one launch per step instead of ~100 kernels), elsewhere "default"."""
    if compile_step is None:
        compile_step = device.type == "cuda"
    if not compile_step:
        return None
    return "reduce-overhead" if device.type == "cuda" else "default"


def step_runner(method, mode: str | None):
    """The per-batch step: the method's eager `train_step`, or with a compile `mode` its compiled
    step, which falls back to eager gradients (with one warning) if compiling fails."""
    return method.step_function(fallback=True, mode=mode) if mode is not None else method.train_step


def no_exit(step: Callable, label: str) -> Callable:
    """`step`, with a SystemExit raised inside it (a method of the user's calling sys.exit) turned
    into a CreditAuditError: the run stays unfinished (no status.json; the last finished epoch's
    checkpoint is kept), the audit records it as failed and the command line exits non-zero —
    never a silent exit 0 that a CI could read as a passed check. A KeyboardInterrupt passes on:
    it stops training like Ctrl-C (exit 130, resumable)."""
    def guarded(x, y):
        try:
            return step(x, y)
        except SystemExit as err:
            raise CreditAuditError(f"the method's step called sys.exit({err.code!r}) in run {label}; "
                                   "the run is unfinished (its finished epochs are kept) — remove "
                                   "the exit, then train again") from None
    return guarded


def train_run(config: RunConfig, out: str | Path, *, data_dir: str | Path | None = None,
              device: str | torch.device | None = None, data: ArrayDataset | None = None,
              progress: bool = True, stop_rule: StopRule | None = None,
              compile_step: bool | None = False,
              on_epoch: Callable[[Sequence[dict]], None] | None = None) -> Run:
    """Train `config` into folder `out`, resuming from its checkpoint if one exists.

    A folder holding a different config (any field, the data digest and code version included) is
    refused. A finished run is returned as is. An unbound `config` (data_digest None) is bound to
    the loaded data; a bound one must match them. Returns the
    `Run`; its `status["status"]` is "finished", "diverged" (non-finite values: the last finite
    checkpoint and metrics are kept) or "stopped" (`stop_rule` returned a message).
    A failure to write (read-only folder, full disk) raises CreditAuditError; the last complete
    checkpoint stays readable and the same call resumes from it. `on_epoch(history)`, when given,
    sees the monitor history after each recorded epoch (e.g. trackers.TensorBoardLog).
    device: where to train (default: where `data` are, else the CPU). compile_step: compile the
    step (False, the default: eager; None: on CUDA only; `compile_mode_for`). Neither changes the
    run's config.
    """
    out = Path(out)
    dev = as_device(device, data.device if data is not None else None)
    if config.data_digest is None:      # the data's contents are part of the run: bind them first
        data = data if data is not None else load_dataset(config.dataset, data_dir, dev)
        config = config.bind_data(data.digest)
    if existing_run_is_done(out, config):
        return load_run(out, dev)
    data = data if data is not None else load_dataset(config.dataset, data_dir, dev)
    config.bind_data(data.digest)       # other data than the config's are refused, not trained on;
    data = data.to(dev)                 # digested before the move: cached on the caller's object
    try:                # after the data loaded: a refused dataset leaves no half-made run folder
        out.mkdir(parents=True, exist_ok=True)
        store.atomic_write_json(out / "config.json", config.to_dict())
    except OSError as err:
        raise _write_error(out, err, None) from None

    data_gen = derived_generator(config.seed, "data")
    history: list[dict] = []
    if store.has_checkpoint(out):
        run = load_run(out, dev)
        model, method, history = run.model, run.method, run.history
        data_gen.set_state(run.state["data_gen"])
        torch.set_rng_state(run.state["torch_rng"])
    else:
        model = build_model(config, data.input_shape, data.n_classes).to(dev)
        method = build_method(config, model)
    eval_x, eval_y = data.eval_batch(0)

    def save(epoch: int) -> None:
        try:
            store.save_checkpoint(out, epoch, {
                "model": model.state_dict(), "method": method.state_dict(),
                "data_gen": data_gen.get_state(), "torch_rng": torch.get_rng_state(),
                "history": history,
            }, {**data_shape(data), "label": config.label}, config.to_dict())
            store.write_metrics(out, history)
        except (OSError, SafetensorError) as err:  # safetensors reports ENOSPC/EFBIG as its own error
            raise _write_error(out, err, epoch - 1 if epoch else None) from None

    def finish(status: str, message: str, wall: float | None = None) -> Run:
        last = history[-1]
        try:
            store.write_sealed_json(out / "status.json", store.json_safe({
                "status": status, "message": message, "epochs_completed": last["epoch"],
                "epochs_planned": config.epochs, "test_acc": last["test_acc"],
                "wall_time": last["wall_time"] if wall is None else wall,
                "checkpoint": store.checkpoint_digest(out)}))
        except OSError as err:
            raise _write_error(out, err, last["epoch"]) from None
        return load_run(out, dev)

    t0 = time.perf_counter() - (history[-1]["wall_time"] if history else 0.0)
    if not history:  # epoch 0: the model at init, the reference for every later growth figure
        history.append(_record(0, None, model, data, eval_x, eval_y, 0.0, {}))
        save(0)
    if on_epoch is not None:
        on_epoch(history)
    start = history[-1]["epoch"]
    bar = tqdm(range(start + 1, config.epochs + 1), desc=config.label, disable=not progress,
               initial=start, total=config.epochs, leave=False)
    step = no_exit(step_runner(method, compile_mode_for(dev, compile_step)), config.label)
    for epoch in bar:
        model.train()
        loss_sum = torch.zeros((), device=dev)
        with precision_context(config.precision, dev):
            for x, y in data.train_batches(config.batch_size, data_gen):
                loss_sum += step(x, y).float() * len(y)
        method.end_epoch()
        train_loss = float(loss_sum) / len(data.y_train)
        record = _record(epoch, train_loss, model, data, eval_x, eval_y, time.perf_counter() - t0,
                         method.epoch_log())
        if not (_finite(train_loss) and all(_finite(v) for v in record["h_norms"])
                and weights_finite(model)):
            bad = store.json_safe(record)
            return finish("diverged", f"non-finite values at epoch {epoch} (train loss {train_loss}, "
                          f"‖h_l‖ {bad['h_norms']}); kept the checkpoint of epoch {epoch - 1}",
                          record["wall_time"])
        history.append(record)
        save(epoch)
        if on_epoch is not None:
            on_epoch(history)
        bar.set_postfix(loss=f"{train_loss:.3f}", acc=f"{record['test_acc']:.3f}",
                        hL=f"{record['h_norms'][-1]:.2g}")
        message = stop_rule(history) if stop_rule is not None else None
        if message:
            return finish("stopped", message)
    return finish("finished", f"trained {config.epochs} epochs")


def weights_finite(model: torch.nn.Module) -> bool:
    """Whether every parameter is finite (one host read per epoch): a step can leave non-finite
    weights whose eval batch still reads finite (e.g. a NaN in a weight the batch does not reach),
    and such a checkpoint must not be kept as the run's last finite one."""
    return bool(torch.stack([p.isfinite().all() for p in model.parameters()]).all())


def _record(epoch: int, train_loss: float | None, model, data: ArrayDataset, eval_x: torch.Tensor,
            eval_y: torch.Tensor, wall: float, method_log: dict[str, float]) -> dict[str, Any]:
    """One line of the metrics log: losses, test accuracy, the monitor on the fixed eval batch."""
    model.eval()
    snap = monitor_snapshot(model, eval_x, eval_y)
    return {"epoch": epoch, "train_loss": train_loss,
            "test_acc": accuracy(model, data.eval_batches("test", 1000)),
            **snap.to_dict(), **method_log, "wall_time": wall}


def _write_error(out: Path, err: Exception, kept_epoch: int | None) -> CreditAuditError:
    """One line for a failed write: what failed, what is kept, how to resume."""
    reason = getattr(err, "strerror", None) or " ".join(str(err).split())
    kept = (f"the checkpoint of epoch {kept_epoch} is kept" if kept_epoch is not None
            else "nothing was trained yet")
    return CreditAuditError(f"cannot write to {out} ({reason}); {kept} — free space or "
                            "fix the folder's permissions, then run the same command again to resume")
