"""A monitored run folder — what a `Monitor` (monitor.py) writes for a user's own loop — sealed
and read back: its status constants, `seal` (status.json, integrity-sealed), `load_monitored`, what
a monitored frozen control shows the evidence gate (`control_evidence`, `control_accuracy`), and
the diagnosis it sealed at `finish()` (`stored_diagnosis`, for `creditaudit diagnose RUN_DIR`).

The folder has the store's format (checkpoint.json + tensors, metrics.jsonl, sealed status.json
and diagnosis.json) with run.json in place of config.json: it records that the run came from the
user's own loop (source "user-loop"), its planned epochs, label, seed, adapter and the sha256 of
its initial weights (which pairs a run with its frozen control) and the digest of its test
batches (`test_digest`, repeated beside every accuracy: a control is compared on the same test set).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import evidence, store
from .errors import CreditAuditError
from .evidence import ControlEvidence
from .runs import diagnosis_binding, read_status
from .verdict import FLAG_NAMES

SOURCE = "user-loop"
RUN_FILE = "run.json"
RUN_FILES = ("run.json", "config.json", "checkpoint.json", "status.json", "metrics.jsonl")
FINISHED, ENDED_EARLY, INTERRUPTED, STOPPED, DIVERGED = (
    "finished", "ended-early", "interrupted", "stopped", "diverged")


def seal(out: Path, status: dict) -> None:
    """Write the run's status.json, sealed (store.write_sealed_json): the run has ended."""
    try:
        store.write_sealed_json(out / "status.json", store.json_safe(status))
    except OSError as err:
        raise CreditAuditError(f"cannot write {out / 'status.json'} ({err.strerror or err}); "
                               "the checkpoint is kept") from None


# -- reading monitored run folders --------------------------------------------------------------
def is_user_loop_run(run_dir: str | Path) -> bool:
    """Whether `run_dir` was written by a Monitor (a user's own loop)."""
    return (Path(run_dir) / RUN_FILE).exists()


def read_run_info(run_dir: str | Path) -> dict:
    """run.json of a monitored run, checked against the copy sealed in its checkpoint."""
    run_dir = Path(run_dir)
    info = store.read_json(run_dir / RUN_FILE, "monitored run folder (Monitor)")
    if not isinstance(info, dict) or info.get("source") != SOURCE:
        raise CreditAuditError(f"{run_dir / RUN_FILE} is not a monitored run's record")
    meta, _ = store.load_checkpoint(run_dir)
    if meta.get("config") != info:
        raise CreditAuditError(f"{run_dir / RUN_FILE} does not match the record sealed in its "
                               "checkpoint (it was edited); restore it")
    return info


@dataclass
class MonitoredRun:
    """A monitored run folder read back: its record, history, status and diagnosis."""

    run_dir: Path
    info: dict
    history: list[dict]
    status: dict
    diagnosis: dict | None

    @property
    def test_acc(self) -> float | None:
        return self.history[-1]["test_acc"] if self.history else None

    @property
    def finished(self) -> bool:
        return self.status.get("status") == FINISHED

    @property
    def epochs_completed(self) -> int:
        return int(self.history[-1]["epoch"]) if self.history else 0


def load_monitored(run_dir: str | Path) -> MonitoredRun:
    """Read a monitored run folder (every record integrity-checked, its diagnosis bound to this
    run by the evidence gate; nothing unpickled)."""
    run_dir = store.as_path(run_dir, "run_dir")
    if not run_dir.is_dir():
        raise CreditAuditError(f"run folder {run_dir} does not exist")
    info = read_run_info(run_dir)
    _, state = store.load_checkpoint(run_dir)
    status = read_status(run_dir)
    path = run_dir / "diagnosis.json"
    diagnosis = store.read_sealed_json(path, "run's diagnosis") if path.exists() else None
    if diagnosis is not None:     # one copied from another run, or older than the run's status
        evidence.gate(evidence.Evidence(str(run_dir), diagnosis_binding=diagnosis.get("run_binding"),
                                        run_binding=diagnosis_binding(run_dir), check_binding=True))
    return MonitoredRun(run_dir, info, state["history"], status, diagnosis)


def control_evidence(control_dir: str | Path, main_info: dict) -> ControlEvidence:
    """What the monitored folder `control_dir` shows as the frozen control of the run whose
    run.json is `main_info`, for `evidence.gate`: whether it is that run's (a frozen control, from
    its initial weights, built for its run id — not only the same init —, planned for its epochs),
    finished, and what its Monitor found when it was sealed (blocks at init, embedding and readout
    trained, finite weights and logits). Measures only; the gate decides."""
    run = load_monitored(control_dir)
    info, check = run.info, run.status.get("control_check") or {}
    mismatch = None
    if info.get("control") != "frozen":
        mismatch = ("it is not a frozen control (train it under Monitor(mon.frozen_control(), ..., "
                    "control_of=mon))")
    elif info.get("init_sha256") != main_info.get("init_sha256"):
        mismatch = "it starts from other initial weights than this run (the control of another run)"
    elif info.get("control_of_id") is None or info.get("control_of_id") != main_info.get("run_id"):
        mismatch = (f"it was built for another run ({info.get('control_of')}); train this run's own "
                    "control with Monitor(mon.frozen_control(), ..., control_of=mon)")
    elif info.get("epochs") != main_info.get("epochs"):
        mismatch = f"it plans {info.get('epochs')} epochs, the run {main_info.get('epochs')}"
    return ControlEvidence(str(control_dir), mismatch, run.finished, run.test_acc,
                           check.get("blocks_at_init"), check.get("embedding_moved"),
                           check.get("readout_moved"), check.get("finite"),
                           branch_ratio=check.get("branch_ratio"),
                           # the test set each accuracy was measured on (None: a claimed accuracy,
                           # or a folder of an older creditaudit — unverified)
                           test_digest=test_digest(run), run_test_digest=main_info.get("test_digest"),
                           check_digest=True)


def test_digest(run: MonitoredRun) -> str | None:
    """The digest of the test batches every accuracy of the monitored run was measured on (its
    run.json's, which each record repeats), or None when it has none or its last record disagrees
    (a folder written by hand)."""
    digest = run.info.get("test_digest")
    last = run.history[-1].get("test_digest") if run.history else None
    return digest if digest is not None and last == digest else None


def control_accuracy(control_dir: str | Path, main_info: dict) -> float | None:
    """The test accuracy of the frozen control in `control_dir` of the run whose run.json is
    `main_info`, as the evidence gate admits it (None while the control is unfinished or could not
    be checked); a control the gate refuses is one line (CreditAuditError)."""
    return evidence.gate(evidence.Evidence(str(main_info.get("label")), None,
                                           control_evidence(control_dir, main_info))).frozen_acc


class StoredDiagnosis:
    """The diagnosis a Monitor wrote at `finish()`, for `creditaudit diagnose RUN_DIR`: the model
    of a user's loop cannot be rebuilt from its folder, so its diagnosis is read, not recomputed."""

    def __init__(self, run: MonitoredRun):
        self.run = run
        self.report = run.diagnosis

    def to_dict(self) -> dict:
        return self.report

    def to_json(self, **kwargs) -> str:
        import json
        return json.dumps(self.report, allow_nan=False, **kwargs)

    def __str__(self) -> str:
        r, s = self.report, self.run.status
        num = lambda v, spec: "—" if v is None else (v if isinstance(v, str) else format(v, spec))
        title = f"creditaudit report — {r.get('label')} (your own loop, diagnosed at finish())"
        lines = [title, "=" * len(title),
                 f"verdict (project, uses b′): {r['verdict']}",
                 f"verdict (paper, uses b):    {r['paper_verdict']}",
                 f"training: {s.get('status', 'unfinished')}, {self.run.epochs_completed}/"
                 f"{self.run.info.get('epochs')} epochs; test acc {num(self.run.test_acc, '.4f')}",
                 f"‖h_l‖: {', '.join(num(v, '.3g') for v in r['residual_norms'])}",
                 f"‖g_l‖: {', '.join(num(v, '.3g') for v in r['bp_grad_norms'])}",
                 f"(a) max growth {num(r['max_growth'], '.4g')}; (a′) since init "
                 f"{num(r['init_growth'], '.4g')}, ‖h_L‖/‖h_0‖ {num(r['stack_growth'], '.4g')}; "
                 f"(b′) readout gain {num(r['readout_gain'], '.3e')}"]
        if r.get("first_fire"):
            lines.append("first fired during training: " + ", ".join(
                f"{FLAG_NAMES[k].split()[0]} {'never' if v is None else f'epoch {v}'}"
                for k, v in r["first_fire"].items()))
        lines += [f"- {x}" for x in (r.get("reasons") or []) + (r.get("notes") or [])]
        return "\n".join(lines)


def stored_diagnosis(run_dir: str | Path) -> StoredDiagnosis:
    """The sealed diagnosis of a monitored run folder; one line when there is none yet."""
    run = load_monitored(run_dir)
    if run.diagnosis is None:
        raise CreditAuditError(f"{run_dir} has no diagnosis: its Monitor never reached finish() "
                               f"(status {run.status.get('status', 'none: still training or killed')})")
    return StoredDiagnosis(run)        # its binding to this run was checked by load_monitored
