"""What every experiment shares: eval batches, one run trained or diagnosed in a worker, and
`run_all` (train every config through an executor, reusing finished runs, then diagnose them).

Runs are keyed by their resolved config (RunConfig.run_key) and live in `<out>/runs/`, so a second
call reuses finished runs and resumes interrupted ones. A run that raises is recorded as failed
(traceback in its folder) and the rest go on.
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import math
import os
import shutil
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from tqdm.auto import tqdm

from .. import evidence, store
from ..catalog import source_digest
from ..config import AuditConfig, RunConfig, default
from ..data import ArrayDataset, load_dataset, warn_if_labels_unpredicted
from ..errors import CreditAuditError
from ..methods import METHODS
from ..metrics import accuracy
from ..protocol import diagnose
from ..runner import make_executor
from ..runs import (DONE, Run, as_device, build_model, control_evidence, diagnosis_binding, yardstick_evidence,
                    existing_run_is_done, failure_record, load_run, read_status, run_dir_for,
                    superseded_by_code, write_diagnosis)
from ..train import can_stack, group_stacks, train_run, train_runs
from ..verdict import Thresholds, stop_rule
from .sizing import StackSizing, cpu_sizing, cuda_free_bytes, gpu_share, plan_stacks, probe_member_bytes


def eval_batches(data: ArrayDataset, k: int, size: int = 128) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K disjoint, fixed test batches for the diagnostics.

    Batches hold 128 samples when the test set has K × 128; a smaller test set (MNIST-1D has 1000)
    is split into K equal batches of ⌊n_test / K⌋ instead, so that the K ≥ 8 batches of the
    stability measure stay disjoint.
    """
    check_eval_batches(len(data.y_test), k)
    size = min(size, len(data.y_test) // k)
    return [data.eval_batch(i, size) for i in range(k)]


def check_eval_batches(n_test: int, k: int) -> None:
    if k < 1 or n_test // k < 1:
        raise CreditAuditError(f"the test set ({n_test} samples) is too small for {k} eval batches; "
                               f"use --eval-batches {max(1, min(8, n_test))} or fewer")


# -- one run, in a worker ---------------------------------------------------------------------
_DATA_CACHE: dict[tuple, ArrayDataset] = {}


def dataset(name: str, data_dir: str, device: str, label_probe: bool = False) -> ArrayDataset:
    """The data, loaded once per process. `label_probe`: warn when a linear probe cannot tell the
    labels from random (`load_dataset`); the driver asks for it once, workers never repeat it."""
    key = (name, str(data_dir), str(device))
    if key not in _DATA_CACHE:
        _DATA_CACHE[key] = load_dataset(name, data_dir, device, label_probe=False)
    if label_probe:
        warn_if_labels_unpredicted(_DATA_CACHE[key], _DATA_CACHE[key].describe())
    return _DATA_CACHE[key]


@dataclass
class Job:
    """What a worker needs: the run, where it lives, and how to judge the monitor."""

    config: dict
    run_dir: str
    data_dir: str
    device: str
    threads: int
    thresholds: dict = field(default_factory=dict)
    compile_step: bool | None = False         # train_run's compile_step (None: on CUDA only)
    warn_dir: str | None = None               # the call's shared record of warnings shown (`told_once`)


def train_job(job: Job) -> dict[str, Any]:
    """Train (or reuse) one run; never raises — a failure comes back as a record."""
    torch.set_num_threads(job.threads)
    config = RunConfig.from_dict(job.config)
    run_dir = Path(job.run_dir)
    t0 = time.perf_counter()
    try:
        was_done = read_status(run_dir).get("status") in DONE
        data = dataset(config.dataset, job.data_dir, job.device)
        run = train_run(config, run_dir, data=data, device=job.device, progress=False,
                        stop_rule=stop_rule(config.stop_when_flagged, Thresholds(**config.stop_thresholds)),
                        compile_step=job.compile_step)
        (run_dir / "error.txt").unlink(missing_ok=True)
        return {"status": run.status["status"], "message": run.status["message"],
                "trained": not was_done, "seconds": time.perf_counter() - t0}
    except Exception as err:  # noqa: BLE001 — one failed run must not stop the others
        return failure_record(run_dir, err, time.perf_counter() - t0)


@dataclass
class DiagnoseJob(Job):
    frozen_acc: float | None = None           # the control accuracy the evidence gate admitted
    depth_why: str | None = None              # else why (d) is not evaluated
    weak: str | None = None                   # why the admitted control is weak (evidence.gate)
    weak_decided: bool = False                # weak against a yardstick the audit decides (d) on
    missing_evidence: list = field(default_factory=list)
    n_eval: int = default(AuditConfig, "eval_batches")
    rho: bool = True
    control_binding: dict | None = None       # the frozen control as it stands (`diagnosis_binding`)
    control_note: str | None = None           # the gate's note on what that control is


def diagnosis_settings(job: DiagnoseJob) -> str:
    """A digest of everything a run's diagnosis depends on besides the run itself (which
    `runs.diagnosis_binding` binds): the run's config, thresholds, eval batches, Γ's null draws,
    ρ or not, what the evidence gate admitted of the frozen control and the control's own identity,
    checkpoint and status, and the package's source (a changed measurement is a changed diagnosis).
    Where it runs (device, threads, data folder) is not part of it: a diagnosis is device-independent."""
    return store.digest(store.json_safe({
        "config": job.config, "thresholds": job.thresholds, "n_eval": job.n_eval, "rho": job.rho,
        "null_k": inspect.signature(diagnose).parameters["null_k"].default,
        "frozen_acc": job.frozen_acc, "depth_why": job.depth_why,
        # whether the control is weak, and against what (d) is then decided, change the report
        "weak": job.weak, "weak_decided": job.weak_decided,
        "missing_evidence": list(job.missing_evidence), "control": job.control_binding,
        "control_note": job.control_note,
        # a user's rule (PKG.MODULE:CLASS): the code it runs, helpers included, is part of what its
        # diagnosis measures (a corrected `credit` or helper is measured again)
        "rule_source": _rule_source(job.config.get("method")),
        "source": source_digest(skip=_NOT_DIAGNOSIS)}))


def _rule_source(spec) -> str | None:
    """The digest of the code a user's rule PKG.MODULE:CLASS runs: its module and every module of
    its own package it imports, transitively (`RunConfig.rule_code`, `methods.rule_code`: an edited
    helper is re-diagnosed too); None for a built-in rule, whose code `source_digest` covers."""
    if not isinstance(spec, str) or ":" not in spec:
        return None
    from ..methods.rule_code import code_digest, code_of
    try:
        return code_digest(code_of(spec))
    except CreditAuditError:         # not importable now: nothing to reuse a diagnosis against
        return "not importable"


# the modules no diagnosis is computed by: editing them leaves every sealed diagnosis reusable
_NOT_DIAGNOSIS = ("cli.py", "commands", "__main__.py", "catalog.py", "check.py", "lint", "api.py", "report",
                  "runner", "trackers.py", "lightning.py")


def reusable_diagnosis(job: DiagnoseJob) -> dict | None:
    """The sealed diagnosis.json beside the job's run when it was made of this run as it stands now
    (`diagnosis_binding`) and of these settings (`diagnosis_settings`): the report as `diagnose_job`
    would give it again. None when any of that differs, or the file is missing, unsealed or damaged."""
    path = Path(job.run_dir) / "diagnosis.json"
    if not path.exists():
        return None
    try:
        stored = store.read_sealed_json(path, "a diagnosis")
        if stored.get("settings_binding") != diagnosis_settings(job) or \
                stored.get("run_binding") != store.json_safe(diagnosis_binding(Path(job.run_dir))):
            return None
    except (CreditAuditError, OSError, ValueError):
        return None
    return {k: v for k, v in stored.items() if k not in ("run_binding", "settings_binding")}


YARDSTICK_CHECK = "yardstick_check.json"


def _yardstick_binding(run_dir: Path, margin: float) -> dict:
    """What a yardstick's check (`evidence.gate_yardstick` on `runs.yardstick_evidence`) is made of:
    the run as it stands (`diagnosis_binding`), the margin, and the package's source (a changed
    check, or a changed backprop, is checked again)."""
    return store.json_safe({"run": diagnosis_binding(Path(run_dir)), "margin": margin,
                            "source": source_digest(skip=_NOT_DIAGNOSIS)})


def _kept_yardstick_check(run_dir: Path, margin: float) -> dict | None:
    """The sealed outcome of this yardstick's check when it was made of the run as it stands, at
    this margin, by this code; None otherwise (then it is checked again). Reusing it keeps a re-run
    with nothing to do from building the yardstick's rule (whose optimiser imports torch._dynamo)."""
    path = Path(run_dir) / YARDSTICK_CHECK
    if not path.exists():
        return None
    try:
        kept = store.read_sealed_json(path, "a yardstick check")
        if kept.get("binding") != _yardstick_binding(run_dir, margin):
            return None
    except (CreditAuditError, OSError, ValueError):
        return None
    refused = kept.get("refused")
    return {"refused": refused if isinstance(refused, str) else None}


def _keep_yardstick_check(run_dir: Path, margin: float, refused: str | None) -> None:
    try:
        store.write_sealed_json(Path(run_dir) / YARDSTICK_CHECK,
                                {"binding": _yardstick_binding(run_dir, margin), "refused": refused})
    except (CreditAuditError, OSError):
        pass            # only a cache: the check is made again next time


@dataclass
class GateJob:
    """One check of the evidence gate, run in a worker (`gate_job`): `kind` "yardstick" (bp's
    frozen control of a seed, judged on its own: `evidence.gate_yardstick`), "shallow" (a shallow
    control must have trained) or "control" (the frozen control at `control_dir` of the main run
    at `run_dir`, whose config is `config`; `yardstick_acc` the seed's checked yardstick's)."""

    kind: str
    run_dir: str
    dataset: str
    data_dir: str
    threads: int
    margin: float
    label: str = ""
    config: dict | None = None
    control_dir: str | None = None
    yardstick_acc: float | None = None


def _init_acc(config: RunConfig, shape: dict[str, Any], data: ArrayDataset) -> float:
    """The accuracy of the model `config` builds as its seed initialises it (the data's `shape`:
    input_shape, n_classes), on the test split."""
    init = build_model(config, tuple(shape["input_shape"]), shape["n_classes"])
    return accuracy(init.eval(), data.eval_batches("test", 1000))


def gate_job(job: GateJob) -> dict[str, Any]:
    """The evidence gate's check `job` (`GateJob`): {"refused": None} when it passes — with
    "admission" (`evidence.Admission` as a dict) for a frozen control —, {"refused": why} when the
    gate refuses it. Its loads and forward passes run in a worker, beside the others: the driver
    never builds a rule (whose optimiser imports torch._dynamo) to judge its controls."""
    if job.threads:                  # 0: in the driver, whose thread count stays its own
        torch.set_num_threads(job.threads)
    data = dataset(job.dataset, job.data_dir, "cpu")
    try:
        if job.kind == "yardstick":
            run = load_run(job.run_dir, "cpu")
            evidence.gate_yardstick(yardstick_evidence(run, *data.eval_batch(0),
                                                       _init_acc(run.config, run.shape, data)), job.margin)
            return {"refused": None}
        if job.kind == "shallow":
            evidence.gate(evidence.Evidence(job.label, None, control_evidence(
                None, load_run(job.run_dir, "cpu", method=False), data.eval_batch(0)[0])))
            return {"refused": None}
        config = RunConfig.from_dict(job.config)
        control = load_run(job.control_dir, "cpu", method=False)
        ev = control_evidence(config, control, data.eval_batch(0)[0])
        # a control must beat the untrained model by the margin, with or without a yardstick: the
        # run's model at its seed's initialisation, built from the run's settings and the data's
        # shape (the same as the control's when `control_evidence` finds no mismatch); the run's
        # folder itself is loaded, and checked, by its diagnosis. Another run's control (it may
        # be of other data) is refused for that alone.
        if ev.mismatch is None:
            ev = replace(ev, init_acc=_init_acc(config, control.shape, data))
        if job.yardstick_acc is not None:
            ev = replace(ev, yardstick_acc=job.yardstick_acc)
        admission = evidence.gate(evidence.Evidence(job.label, None, ev, depth_margin=job.margin))
        return {"refused": None, "admission": asdict(admission)}
    except CreditAuditError as err:
        return {"refused": str(err)}


def _gate_failed(record: dict) -> str | None:
    """Why a gate job's record refuses: its own reason, or a worker that died on it (the check
    was not made, so nothing it guards is admitted)."""
    if "refused" in record:
        return record["refused"]
    return f"the evidence gate could not check it: {record.get('message') or record.get('error')}"


def diagnose_job(job: DiagnoseJob) -> dict[str, Any]:
    """Diagnose one trained run from its checkpoint; the report dict is also saved beside it, bound
    to the run and to the settings it was made with (`diagnosis_settings`), so an audit run again
    reuses it (`reusable_diagnosis`)."""
    torch.set_num_threads(job.threads)
    try:
        run = load_run(job.run_dir, job.device)
        data = dataset(run.config.dataset, job.data_dir, job.device)
        report = diagnose_run(run, eval_batches(data, job.n_eval), frozen_acc=job.frozen_acc,
                              depth_why=job.depth_why, weak_control=job.weak,
                              weak_decided_across_seeds=job.weak_decided,
                              missing_evidence=job.missing_evidence,
                              thresholds=Thresholds(**job.thresholds), rho=job.rho,
                              run_data=data, notes=[job.control_note] if job.control_note else []).to_dict()
        write_diagnosis(Path(job.run_dir), report, settings=diagnosis_settings(job))
        return report
    except Exception as err:  # noqa: BLE001
        return {"error": f"{type(err).__name__}: {err}"}


def diagnose_run(run: Run, batches, *, control: Run | None = None, frozen_acc: float | None = None,
                 depth_why: str | None = None, weak_control: str | None = None,
                 weak_decided_across_seeds: bool = False, missing_evidence: Sequence[str] = (),
                 thresholds: Thresholds = Thresholds(), rho: bool = False, null_k: int | None = None,
                 run_data: ArrayDataset | None = None, notes: Sequence[str] = ()):
    """`protocol.diagnose` of a run read from its folder: its method, history and status, and
    (d)'s control: a `control` run folder goes through the evidence gate here (`evidence.gate`;
    a control that is not this run's, never trained, or non-finite is refused); or `frozen_acc`
    (with `depth_why` when None, `weak_control` when weak, and the gate's `notes` on it) as the gate already admitted it
    (`run_all`). The run must have
    trained on `run_data` (its data digest), else the diagnosis is refused."""
    if run_data is not None:       # measured on other data than it trained on, nothing it says holds
        run.config.bind_data(run_data.digest)
    control_notes = list(notes)
    diverged = run.status.get("message") if run.status.get("status") == "diverged" else None
    training = {"status": run.status.get("status", "unfinished"),
                "epochs_completed": run.epochs_completed, "epochs_planned": run.config.epochs}
    weak = weak_control
    if control is not None:
        ev = control_evidence(run.config, control, batches[0][0])
        if run_data is not None and ev.mismatch is None:
            # the untrained model's accuracy (the run's seed gives its initial weights): without a
            # yardstick, a control must beat it by the (d) margin
            init = build_model(run.config, tuple(run.shape["input_shape"]), run.shape["n_classes"])
            init = init.to(next(run.model.parameters()).device).eval()
            ev = replace(ev, init_acc=accuracy(init, run_data.eval_batches("test", 1000)))
        admitted = evidence.gate(evidence.Evidence(run.config.label, training, ev,
                                                   depth_margin=thresholds.depth_margin))
        frozen_acc, depth_why, weak = admitted.frozen_acc, admitted.depth_why, admitted.weak
        control_notes += [admitted.note] if admitted.note else []
    report = diagnose(run.model, batches, method=run.method, frozen_acc=frozen_acc, weak_control=weak,
                      weak_decided_across_seeds=weak_decided_across_seeds,
                      test_acc=run.test_acc, thresholds=thresholds, monitor_history=run.history,
                      rho=rho, label=run.config.label, diverged=diverged, training=training,
                      missing_evidence=missing_evidence, depth_unevaluated=depth_why,
                      **({} if null_k is None else {"null_k": null_k}))   # None: diagnose's own default
    report.notes.extend(control_notes)     # what the control is, when it is not what (d) assumes
    recomputed = accuracy(run.model, run_data.eval_batches("test", 1000)) if run_data is not None else None
    if recomputed is not None and run.test_acc is not None and abs(recomputed - run.test_acc) > 0.005:
        report.notes.append(f"the recorded test accuracy {run.test_acc:.4f} and the one recomputed "
                            f"from the checkpoint, {recomputed:.4f}, differ by more than 0.5 points: "
                            "the record and the weights do not belong together, or the data changed.")
    return report


@dataclass
class StackJob:
    """A worker's share of `run_all`: runs of one stack (plain dicts, so it pickles for any executor)."""

    configs: list[dict]
    run_dirs: list[str]
    data_dir: str
    device: str
    threads: int
    compile_step: bool | None = False
    warn_dir: str | None = None               # as Job's


def stack_job(job: StackJob) -> dict[str, Any]:
    """Train one stack in a worker (`train.train_runs`); never raises: {"members": [one
    train_job-style record per run, with "stacked" and "stack_size"]}. A folder that cannot be
    read fails alone; a failure while the stack trains fails every member it holds."""
    torch.set_num_threads(job.threads)
    t0 = time.perf_counter()
    configs = [RunConfig.from_dict(c) for c in job.configs]
    dirs = [Path(d) for d in job.run_dirs]
    records: list[dict | None] = [None] * len(configs)
    try:
        data = dataset(configs[0].dataset, job.data_dir, job.device)
    except Exception as err:  # noqa: BLE001
        return {"members": [failure_record(d, err, time.perf_counter() - t0) for d in dirs]}
    ok = []
    for i, (c, d) in enumerate(zip(configs, dirs)):
        try:                   # one bad folder (another run's, a corrupt status) must not stop the others
            existing_run_is_done(d, c.bind_data(data.digest))
            ok.append(i)
        except Exception as err:  # noqa: BLE001
            records[i] = {**failure_record(d, err, time.perf_counter() - t0), "stacked": False}
    try:
        trained = train_runs([configs[i] for i in ok], [dirs[i] for i in ok], data=data,
                             device=job.device, progress=False, compile_step=job.compile_step)
        for i, t in zip(ok, trained):
            (dirs[i] / "error.txt").unlink(missing_ok=True)
            records[i] = {"status": t.run.status["status"], "message": t.run.status["message"],
                          "trained": t.trained, "seconds": time.perf_counter() - t0,
                          "stacked": t.stack_size > 1, "stack_size": t.stack_size}
    except Exception as err:  # noqa: BLE001 — a failed stack: each of its members failed
        for i in ok:
            records[i] = {**failure_record(dirs[i], err, time.perf_counter() - t0), "stacked": False}
    return {"members": records}


def finished_unit(configs: Sequence[RunConfig], dirs: Sequence[Path], stacked: bool) -> dict[str, Any] | None:
    """The record `train_any` gives for a unit whose every run is finished already (each folder
    holds its bound config, sealed as done, and loads as the trainer would load it: checkpoint
    integrity, metrics log, weights that fit the config), read here in the caller: nothing to train
    needs no worker. None when any run has work left, or a folder needs a worker's failure record
    (another run's folder, an edited checkpoint, a damaged status)."""
    members = []
    try:
        for c, d in zip(configs, dirs):
            if not existing_run_is_done(d, c):
                return None
            # the checks of the trainer's load; the method's own state is checked where a
            # diagnosis is computed (a reused one was computed from this very checkpoint)
            status = load_run(d, "cpu", method=False).status
            (d / "error.txt").unlink(missing_ok=True)      # as train_job leaves a finished run
            members.append({"status": status["status"], "message": status["message"], "trained": False,
                            "seconds": 0.0, **({"stacked": False, "stack_size": 1} if stacked else {})})
    except Exception:  # noqa: BLE001 — the worker records what failed, as for any run
        return None
    return {"members": members}


def train_any(job: Job | StackJob) -> dict[str, Any]:
    """One unit of work: a stack of runs trained as one, or a single run; {"members": [record…]}.
    The warnings it raises are shown as they happen, each distinct one once for every worker of
    the call (`told_once`)."""
    with told_once(job.warn_dir):
        return stack_job(job) if isinstance(job, StackJob) else {"members": [train_job(job)]}


WARNED_PREFIX = ".warned-"     # <out>/.warned-<token>/: which warnings a run_all's workers have shown


@contextlib.contextmanager
def told_once(folder: str | None) -> Iterator[None]:
    """Within: a warning that passes the filters in force is shown, live, by the first process that
    creates its marker file in `folder` (named by its category and message), and by no other: the
    audit's workers share the folder, so torch's "compiling the ep step failed …" on a GPU, or a
    user rule's warning at every step, reads as one line, not one per worker process. Filters,
    "error" ones included, act as before. A marker that cannot be written shows the warning rather
    than lose it. None: warnings show as usual."""
    if folder is None:
        yield
        return
    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        key = hashlib.sha256(f"{category.__module__}.{category.__qualname__}|{message}".encode()).hexdigest()
        try:
            os.close(os.open(os.path.join(folder, key[:32]), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            return                                     # another worker (or run) showed it already
        except OSError:
            pass
        previous(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = previous


def stacking_pays(device: torch.device) -> bool:
    """The `stack=None` (auto) rule of run_all: always on CUDA; on CPU only if CPU_STACK_PAYS."""
    return device.type == "cuda" or CPU_STACK_PAYS


# Measured on the shared 2-core CPU before the member axis (benchmarks/gpu_throughput.py --device
# cpu --shape mnist1d: quick-audit model d=256 L=4, batch 128, input 40; stacked ÷ lone
# run-steps/s): 1 thread — bp 0.99 (K=4), 1.15 (K=12); dfa 1.02 (K=4), 1.38 (K=12). The step is
# matmul-bound on CPU (a batched matmul costs what its K plain ones cost), so stacking does not
# pay reliably there: run_all keeps one run per single-threaded worker per core on CPU.
CPU_STACK_PAYS = False


# The one line `--stack` on a CPU prints (run_all, once). Measured with benchmarks/method_speed.py
# --methods bp,dfa --epochs 1 --repeats 3 --stack 4 (one thread, the 2-core shared box at load ≈ 9;
# stack wall ÷ the same 4 runs one after another, median of 3): bp 0.90, dfa 0.94 (earlier, at load
# ≈ 1.3–1.5: bp 0.95, ep 0.97, sb 0.98, cb 1.05; docs/SPEED.md); benchmarks/stack_archs_speed.py
# (CPU time, load ≈ 9.6): resnet-small width 16 bp 0.96, dfa 0.93; vit-mini d=64 bp 1.11, dfa 1.14.
CPU_STACK_NOTE = ("creditaudit: --stack on a CPU: stacking does not pay there (a stack of 4 took 0.90–0.94× the "
                  "time of its 4 runs one after another on the ResMLP, 0.93–1.14× on resnet-small and vit-mini: "
                  "benchmarks/method_speed.py and stack_archs_speed.py), while lone runs use every core; "
                  "training stacked as asked")


def _alone_because(config: RunConfig, record: dict, group_size: int, use_stack: bool,
                   execution: Execution, limit: int | None = None) -> str:
    """Why a run of `run_all` trained alone (stack size 1), in a few words."""
    if not record.get("trained"):
        return "finished before, reused" if record.get("status") in DONE else "not trained"
    if not use_stack:
        return "stacking off" + (" (--no-stack)" if execution.stack is False else " on a CPU")
    if not can_stack(config):
        if config.stop_when_flagged is not None:
            return "an early-stop rule reads its monitor"
        user = ":" in config.method
        return ("user rule not on the member axis" if user
                else f"{config.method} not on the member axis for {config.arch}")
    if group_size > 1:
        return "resumed at another epoch than its stack"
    if limit == 1:
        return "stacks limited to 1 run (stack size)"
    return "no other run of its shape"


def stack_sizing(configs: Sequence[RunConfig], dev: torch.device, workers: int, data_dir: str) -> StackSizing | None:
    """The largest stack run_all forms, and why (`sizing`): on CUDA measured by a probe step per
    stackable shape against the free memory, and at most ⌈runs / workers⌉ so that `--jobs N`
    workers each get a stack; on a CPU one stack per worker."""
    if dev.type != "cuda":
        return cpu_sizing(len(configs), workers)
    data = dataset(configs[0].dataset, data_dir, "cpu")
    planned = plan_stacks(configs, workers, cuda_free_bytes(dev),
                          lambda c: probe_member_bytes(c, data, dev))
    share = math.ceil(len(configs) / workers)
    if planned is None or workers == 1 or planned.max_size <= share:
        return planned
    return replace(planned, max_size=share,
                   why=f"{planned.why}; at most {share} so that each of the {workers} workers gets a stack")


def default_workers(device: torch.device, n_jobs: int) -> int:
    """CPU: one single-threaded worker per core (small nets scale better across runs than
    within one); CUDA: one process owns the GPU."""
    if device.type == "cuda":
        return 1
    return max(1, min(os.cpu_count() or 1, n_jobs))


# -- running a set of runs --------------------------------------------------------------------
@dataclass
class Outcome:
    """One run of an experiment: its config, where it lives, how training ended, its diagnosis."""

    config: RunConfig
    run_dir: Path
    status: str
    message: str
    trained: bool
    test_acc: float | None = None
    history: list[dict] = field(default_factory=list)
    report: dict | None = None
    epochs_planned: int = 0
    diagnosis_reused: bool = False     # its sealed diagnosis of the same run and settings was reused
    # how it was scheduled: {"id": the stack (unit of work) it trained in, "size": how many runs
    # trained in it together (1: alone), "alone": why it trained alone, or None, and with stacking
    # on "sizing": the audit's largest stack and why (`sizing.StackSizing`)}; None: not trained by
    # run_all (a user's own loop)
    stack: dict | None = None

    @property
    def epochs_completed(self) -> int:
        return int(self.history[-1]["epoch"]) if self.history else 0

    def to_dict(self) -> dict:
        return {"label": self.config.label, "key": self.config.run_key, "method": self.config.method,
                "seed": self.config.seed, "control": self.config.control, "lam": self.config.lam,
                "trainable_blocks": self.config.trainable_blocks, "status": self.status,
                "message": self.message, "trained_now": self.trained,
                "diagnosis_reused": self.diagnosis_reused, "test_acc": self.test_acc,
                "epochs_completed": self.epochs_completed, "epochs_planned": self.config.epochs,
                # the training's own elapsed seconds (a stack's, shared by its members; a resumed
                # run's summed over its sessions), however long ago it trained
                "train_seconds": self.history[-1].get("wall_time") if self.history else None,
                "run_dir": str(self.run_dir), "config": self.config.to_dict(), "stack": self.stack,
                "monitor": [{k: r.get(k) for k in ("epoch", "test_acc", "train_loss", "h_norms",
                                                    "g_norms", "max_growth", "gain", "gamma",
                                                    "weight_alignment")}
                            for r in self.history],
                "report": self.report}


@dataclass(frozen=True)
class Execution:
    """Where and how runs execute (from the audit settings, whose defaults these are)."""

    data_dir: str = default(AuditConfig, "data_dir")
    device: str = default(AuditConfig, "device")
    jobs: int = default(AuditConfig, "jobs")
    executor: str = default(AuditConfig, "executor")
    address: str | None = default(AuditConfig, "address")
    max_retries: int = default(AuditConfig, "max_retries")
    stack: bool | None = default(AuditConfig, "stack")   # one stack per model shape; None = where it pays
    compile_step: bool | None = False  # compile each run's step; None = on CUDA only (the CLI's default)
    label_probe: bool = True           # warn when a linear probe cannot tell the labels from random


def run_all(configs: Sequence[RunConfig], root: Path, *, execution: Execution = Execution(),
            thresholds: Thresholds = Thresholds(), n_eval: int = default(AuditConfig, "eval_batches"),
            rho: bool = True,
            frozen_of: Callable[[RunConfig], RunConfig | None] | None = None,
            yardstick_of: Callable[[RunConfig], RunConfig | None] | None = None,
            progress: bool = True, diagnose_controls: bool = True,
            while_training: Callable[[], None] | None = None,
            keep_workers: list | None = None) -> list[Outcome]:
    """Train every config (reusing finished runs), gate the controls, then diagnose each run that
    ended.

    frozen_of(config) names the frozen control whose accuracy (d) compares against; with
    `diagnose_controls` a control itself is diagnosed too, without ρ (the audit turns it off: it
    reads a control's accuracy alone, through the evidence gate). yardstick_of(config) names the
    yardstick of that control (bp's frozen control of the seed, among `configs`): each run's own
    diagnosis then judges its control against it (a weak control cannot be cleared). One pool of
    workers serves training, the gate and the diagnoses, and ends with the call. `while_training()`
    is called once in the driver when the first unit trained now has finished, while the others
    train: work the caller needs later (imports) done while the driver would only wait; its
    failure is ignored. With `keep_workers` (a list), the executor the call made, if any, is
    appended to it instead of closed: the caller runs more jobs on it and closes it.
    """
    made: list = []
    warned = _warned_folder(Path(root))
    try:
        return _run_all(configs, root, made, execution=execution, thresholds=thresholds, n_eval=n_eval,
                        rho=rho, frozen_of=frozen_of, yardstick_of=yardstick_of, progress=progress,
                        diagnose_controls=diagnose_controls, warned=warned, while_training=while_training)
    finally:
        for executor in made:
            if keep_workers is not None:
                keep_workers.append(executor)
            elif getattr(executor, "close", None) is not None:
                executor.close()
        if warned is not None:
            shutil.rmtree(warned, ignore_errors=True)


def _warned_folder(root: Path) -> str | None:
    """A fresh <root>/.warned-<token>/ for this call's workers (`told_once`; on a cluster it lies on
    the shared --out like the runs); one a killed command left behind is removed first. None
    when it cannot be made: warnings then show as usual."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(WARNED_PREFIX + "*"):
            shutil.rmtree(stale, ignore_errors=True)
        folder = root / f"{WARNED_PREFIX}{os.getpid()}-{time.time_ns()}"
        folder.mkdir()
        return str(folder)
    except OSError:
        return None


def _run_all(configs: Sequence[RunConfig], root: Path, made: list, *, execution: Execution,
             thresholds: Thresholds, n_eval: int, rho: bool,
             frozen_of: Callable[[RunConfig], RunConfig | None] | None,
             yardstick_of: Callable[[RunConfig], RunConfig | None] | None,
             progress: bool, diagnose_controls: bool, warned: str | None = None,
             while_training: Callable[[], None] | None = None) -> list[Outcome]:
    """`run_all`'s work; `made` holds the executor once a job needed one (`run_all` closes it);
    `warned`: the folder its training workers share to show each warning once (`told_once`)."""
    # the command line has resolved "auto" by now; a Python caller's unresolved "auto" (the
    # AuditConfig default) runs on the CPU like every library call without inputs
    dev = as_device(None if execution.device == "auto" else execution.device)
    workers = execution.jobs or default_workers(dev, len(configs))
    # a Ray task reserves one CPU, and parallel local workers share the cores: one thread each
    threads = 1 if workers > 1 or execution.executor == "ray" else max(1, torch.get_num_threads())
    data = dataset(configs[0].dataset, execution.data_dir, "cpu",   # fail fast before any worker starts
                   label_probe=execution.label_probe)
    check_eval_batches(len(data.y_test), n_eval)
    # the data's contents are part of every run's key: other data under the same --out are other runs
    configs = [c.bind_data(dataset(c.dataset, execution.data_dir, "cpu").digest) for c in configs]

    def executor():
        """Made when a job needs it: a re-run with nothing to train or diagnose starts no worker
        process (nor a Ray cluster). A unit of work (a stack or a lone run) asks Ray for 1/workers
        of a GPU: --jobs N stacks share one."""
        if not made:
            made.append(make_executor(execution.executor, workers=workers, address=execution.address,
                                      max_retries=execution.max_retries, gpus_per_job=gpu_share(dev, workers)))
        return made[0]

    dirs = [run_dir_for(root, c) for c in configs]
    for c, d in zip(configs, dirs):     # a user's rule edited since its runs trained: say why it retrains
        why = superseded_by_code(d, c)
        if why:
            print(f"creditaudit: training {c.label} again: {why}", file=sys.stderr)
    train_jobs = [Job(c.to_dict(), str(d), execution.data_dir, str(dev), threads, asdict(thresholds),
                      execution.compile_step, warned) for c, d in zip(configs, dirs)]
    use_stack = stacking_pays(dev) if execution.stack is None else execution.stack
    if execution.stack and dev.type == "cpu":            # asked for where it does not pay: say so, once
        print(CPU_STACK_NOTE, file=sys.stderr)
    sizing = stack_sizing(configs, dev, workers, execution.data_dir) if use_stack else None
    groups = (group_stacks(configs, max_size=sizing.max_size if sizing else None)
              if use_stack else [[i] for i in range(len(configs))])
    units = [StackJob([configs[i].to_dict() for i in g], [str(dirs[i]) for i in g], execution.data_dir,
                      str(dev), threads, execution.compile_step, warned) if len(g) > 1 else train_jobs[g[0]]
             for g in groups]
    bar = tqdm(total=len(configs), desc="runs", unit="run", disable=not progress, dynamic_ncols=True)

    def said(j: int, res: dict) -> None:
        for i, r in zip(groups[j], res.get("members") or [res] * len(groups[j])):
            bar.update(1)
            bar.set_postfix_str(f"{configs[i].label} {r['status']}")
            if r["status"] not in DONE:
                bar.write(f"  {configs[i].label}: {r['status']} — {r['message']}")

    results: list[dict | None] = [finished_unit([configs[i] for i in g], [dirs[i] for i in g], len(g) > 1)
                                  for g in groups]
    # the cheap units last (shallow controls: no blocks), so that the workers' last jobs are short
    # and none idles long while another finishes a deep run (the tail of a 2-worker audit)
    todo_units = sorted((j for j, r in enumerate(results) if r is None),
                        key=lambda j: all(configs[i].blocks == 0 for i in groups[j]))
    waiting = [while_training] if while_training is not None else []

    def trained_one(k: int, res: dict) -> None:
        said(todo_units[k], res)
        if waiting:
            try:
                waiting.pop()()
            except Exception:  # noqa: BLE001 — only a head start on later work
                pass

    try:
        for j, res in enumerate(results):
            if res is not None:
                said(j, res)
        if todo_units:
            trained_now = executor().map(train_any, [units[j] for j in todo_units], trained_one)
            for j, res in zip(todo_units, trained_now):
                results[j] = res
    finally:
        bar.close()
    trained: list[dict] = [{}] * len(configs)
    stacks: list[dict] = [{}] * len(configs)
    # a dead worker's record has no "members": the whole unit failed
    for j, (g, res) in enumerate(zip(groups, results)):
        for i, r in zip(g, res.get("members") or [res] * len(g)):
            trained[i] = r
            size = int(r.get("stack_size") or 1)
            stacks[i] = {"id": j, "size": size,
                         "alone": None if size > 1 else _alone_because(configs[i], r, len(g), use_stack, execution,
                                                                     sizing.max_size if sizing else None),
                         **({"sizing": sizing.to_dict()} if sizing else {})}
    outcomes = []
    for c, d, res, st in zip(configs, dirs, trained, stacks):
        o = Outcome(c, d, res["status"], res["message"], bool(res.get("trained")), stack=st)
        if o.status in DONE:
            o.history = store.load_checkpoint(d)[1]["history"]
            o.test_acc = o.history[-1]["test_acc"]
        outcomes.append(o)

    by_key = {o.config.run_key: o for o in outcomes}
    margin = thresholds.depth_margin

    def finished_yardstick(o: Outcome) -> Outcome | None:
        """The seed's yardstick (bp's frozen control of `o`'s seed) when it finished, else None."""
        yard = yardstick_of(o.config) if yardstick_of else None
        yard = by_key.get(yard.bind_data(o.config.data_digest).run_key) if yard else None
        return yard if yard is not None and yard.status == "finished" and yard.test_acc is not None else None

    def gate_all(jobs: list[GateJob]) -> list[dict]:
        """The gate's checks in the workers where training started them, else here: a re-run with
        nothing to train starts no process to judge its controls (their checks load no rule)."""
        if not jobs:
            return []
        if made:
            return made[0].map(gate_job, jobs, lambda i, r: None)
        return [gate_job(replace(j, threads=0)) for j in jobs]

    # -- the evidence gate. First each yardstick once (`evidence.gate_yardstick`: a control's checks,
    # beating the untrained model by the (d) margin, and its rule computing backprop, Γ = 1 at every
    # position on the probe batch, the project's own code) and each shallow control (a yardstick
    # too: it must have trained); then each run's frozen control, against its seed's yardstick.
    yard_for = {o.config.run_key: finished_yardstick(o) for o in outcomes}   # before any is refused
    yard_refused: dict[str, str | None] = {}
    first: list[tuple[Outcome, GateJob]] = []
    for yard in {y.config.run_key: y for y in yard_for.values() if y is not None}.values():
        kept = _kept_yardstick_check(yard.run_dir, margin)
        if kept is not None:            # checked before, of this run as it stands, by this code
            yard_refused[yard.config.run_key] = kept["refused"]
        else:
            first.append((yard, GateJob("yardstick", str(yard.run_dir), yard.config.dataset,
                                        execution.data_dir, threads, margin, yard.config.label)))
    for o in outcomes:
        if o.config.control == "shallow" and o.status == "finished":
            first.append((o, GateJob("shallow", str(o.run_dir), o.config.dataset, execution.data_dir,
                                     threads, margin, o.config.label)))
    for (o, job), rec in zip(first, gate_all([job for _, job in first])):
        why = _gate_failed(rec)
        if job.kind == "yardstick":
            yard_refused[o.config.run_key] = why
            if "refused" in rec:        # a check that was made (not a dead worker's) is kept
                _keep_yardstick_check(o.run_dir, margin, why)
        elif why is not None:
            o.status, o.message = "refused", why
    for key, why in yard_refused.items():
        if why is not None:
            by_key[key].status, by_key[key].message = "refused", why

    def checked_yardstick(o: Outcome) -> tuple[Outcome | None, str | None]:
        """The seed's yardstick as evidence: (it, None) when it finished and passed the gate,
        (None, why) when refused (then the seed's (d) cannot clear), (None, None) when there is none."""
        yard = yard_for.get(o.config.run_key)
        if yard is None:
            return None, None
        why = yard_refused[yard.config.run_key]
        return (yard, None) if why is None else (None, why)

    def control_of(o: Outcome) -> Outcome | None:
        frozen = frozen_of(o.config) if frozen_of else None
        return by_key.get(frozen.run_key) if frozen else None

    def diagnosed(o: Outcome) -> bool:
        """A run with no residual block (the shallow control) has no depth to diagnose
        (`evidence.check_depth`): its accuracy is all the audit reads of it; nor, with
        `diagnose_controls` off, a frozen control, whose accuracy the gate has admitted or refused."""
        return o.status in DONE and bool(o.config.blocks) and (diagnose_controls or o.config.control != "frozen")

    # then the frozen control of each run (`admit`): (admission, None), or (None, why) when refused —
    # then (d) is not evaluated for the run's seed, and the control is marked refused so that no table
    # pairs a seed with it. A refused yardstick leaves the seed's (d) not evaluated too.
    gated: dict[str, tuple[evidence.Admission | None, str | None]] = {}
    pairs: list[tuple[Outcome, Outcome]] = []
    for o in outcomes:
        control = control_of(o)
        if not diagnosed(o) or control is None or control.status not in (*DONE, "refused"):
            continue
        yard, yard_why = checked_yardstick(o)
        if yard_why is not None:
            gated[o.config.run_key] = None, yard_why
        elif control.status == "refused":      # refused as a yardstick
            gated[o.config.run_key] = None, control.message
        else:
            pairs.append((o, control))
    checks = gate_all([GateJob("control", str(o.run_dir), o.config.dataset, execution.data_dir, threads, margin,
                               o.config.label, o.config.to_dict(), str(control.run_dir),
                               None if checked_yardstick(o)[0] is None else checked_yardstick(o)[0].test_acc)
                       for o, control in pairs])
    for (o, control), rec in zip(pairs, checks):
        if control.status == "refused":        # refused for another run it controls (a λ sweep's)
            gated[o.config.run_key] = None, control.message
            continue
        why = _gate_failed(rec)
        if why is None:
            gated[o.config.run_key] = evidence.Admission(**rec["admission"]), None
        else:
            gated[o.config.run_key] = None, why
            control.status, control.message = "refused", why

    test_labels = data.y_test.tolist()

    def no_signal(o: Outcome, control: Outcome | None) -> list[str]:
        """The gap when the data carry no signal a trained network finds (`evidence.chance_gap`):
        none of the seed's trained arms — its yardstick, the run, its frozen control — beats
        chance. Not the yardstick alone: a frozen-blocks yardstick can sit at chance on data the
        trained run learns (labels a linear read-out of random features misses)."""
        arms = {a.config.run_key: a for a in (finished_yardstick(o), o, control)
                if a is not None and a.status in DONE and a.test_acc is not None}
        gap = evidence.chance_gap([(a.config.label, a.test_acc) for a in arms.values()], test_labels,
                                  data.n_classes)
        return [gap] if gap else []

    diag_jobs, diag_index = [], []
    for i, o in enumerate(outcomes):
        if not diagnosed(o):
            continue
        control = control_of(o)
        admitted, refused = gated.get(o.config.run_key, (None, None))
        diag_jobs.append(DiagnoseJob(o.config.to_dict(), str(o.run_dir), execution.data_dir, str(dev),
                                     threads, asdict(thresholds),
                                     frozen_acc=admitted.frozen_acc if admitted else None,
                                     depth_why=admitted.depth_why if admitted else refused,
                                     weak=admitted.weak if admitted else None,
                                     # against the yardstick: the audit's (d) across seeds decides
                                     weak_decided=checked_yardstick(o)[0] is not None,
                                     missing_evidence=([refused] if refused else []) + no_signal(o, control),
                                     n_eval=n_eval,
                                     rho=rho and o.config.control == "none",
                                     control_note=admitted.note if admitted else None,
                                     control_binding=(diagnosis_binding(control.run_dir)
                                                      if control is not None and control.status in DONE else None)))
        diag_index.append(i)
    # a sealed diagnosis of the same run and settings is reused, not measured again
    for i, job in zip(diag_index, diag_jobs):
        outcomes[i].report = reusable_diagnosis(job)
        outcomes[i].diagnosis_reused = outcomes[i].report is not None
    todo = [(i, job) for i, job in zip(diag_index, diag_jobs) if outcomes[i].report is None]
    # the costly diagnoses first, so that no worker idles while the other ends on one: a rule with
    # Γ's null (20 credits on every eval batch) costs 2–4× one without (benchmarks/run_profile.py)
    todo.sort(key=lambda ij: not getattr(METHODS.get(ij[1].config.get("method")), "random_feedback", False))
    bar = tqdm(total=len(todo), desc="diagnoses", unit="run", disable=not progress or not todo,
               dynamic_ncols=True)
    try:
        reports = executor().map(diagnose_job, [job for _, job in todo], lambda i, r: bar.update(1)) if todo else []
    finally:
        bar.close()
    for (i, _), rep in zip(todo, reports):
        if "error" in rep:
            outcomes[i].message += f"; diagnosis failed: {rep['error']}"
        else:
            outcomes[i].report = rep
    return outcomes


# -- small statistics over seeds ----------------------------------------------------------------
def mean_std(values: Sequence[float | None]) -> tuple[float | None, float | None]:
    """Mean and population std of the finite values; std None for a single value (no spread)."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return None, None
    return statistics.fmean(vals), (statistics.pstdev(vals) if len(vals) > 1 else None)


def median_of(values: Sequence[float]) -> float | None:
    """Median of the measured values (NaN = not measured); None when there are none."""
    vals = [v for v in values if not math.isnan(v)]
    return statistics.median(vals) if vals else None
