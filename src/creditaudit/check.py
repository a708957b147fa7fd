"""`creditaudit check`: the verdicts of an audit or a run as an exit code, for a paper's CI.

    0  every method trustworthy        1  some method walks back
    3  none walks back, some incomplete (a flag not evaluated, a run unfinished, no control)
    2  a user error (the CLI's)
"""
from __future__ import annotations

from pathlib import Path

from . import evidence, store
from .errors import CreditAuditError
from .runs import diagnosis_binding
from .verdict import Verdict, verdict_of

TRUSTWORTHY, WALK_BACK, INCOMPLETE = 0, 1, 3


def exit_code(verdicts: list[Verdict]) -> int:
    if any(v.walks_back for v in verdicts):
        return WALK_BACK
    if not verdicts or not all(v.trustworthy for v in verdicts):
        return INCOMPLETE
    return TRUSTWORTHY


def _verdict(result: dict, where: str) -> Verdict:
    try:
        return verdict_of(result)
    except (ValueError, KeyError, TypeError):
        raise CreditAuditError(f"{where} holds no structured verdict (written by an older creditaudit?); "
                               "run the audit or diagnosis again to rewrite it") from None


def check_report(report: dict) -> tuple[list[str], int, dict]:
    """(one line, exit code, payload) for one fresh diagnosis (e.g. of a user's model)."""
    name, verdict = str(report.get("label") or "model"), report["verdict"]
    code = exit_code([_verdict(report, "the diagnosis")])
    return [f"{name}  {verdict}"], code, {"exit_code": code, "verdicts": [{"name": name, "verdict": verdict}]}


def check_path(path: Path) -> tuple[list[str], int, dict]:
    """(one line per method or run, exit code, JSON payload) for an audit folder or a run folder."""
    path = Path(path)
    # a run folder is judged as the run, even if an (older) audit wrote its audit.json there
    is_run = any((path / name).exists() for name in ("diagnosis.json", "run.json", "config.json"))
    if (path / "audit.json").exists() and not is_run:
        audit = store.read_sealed_json(path / "audit.json", "creditaudit audit (audit.json)")
        results = audit.get("methods") or []
        rows = [(str(m["method"]) + (f" (λ={m['lam']:g})" if m.get("lam") else ""), m["verdict"])
                for m in results]
        where = f"{path / 'audit.json'}"
    elif (path / "diagnosis.json").exists():
        report = store.read_sealed_json(path / "diagnosis.json", "run's diagnosis")
        # a diagnosis copied from another folder, or made before the run finished or resumed,
        # is refused by the evidence gate
        evidence.gate(evidence.Evidence(str(path), diagnosis_binding=report.get("run_binding"),
                                        run_binding=diagnosis_binding(path), check_binding=True))
        results = [report]
        rows = [(str(report.get("label") or path.name), report["verdict"])]
        where = f"{path / 'diagnosis.json'}"
    elif (path / "run.json").exists():     # a Monitor's folder whose loop never reached finish()
        from .monitor import load_monitored
        run = load_monitored(path)
        unfinished = Verdict("project", "incomplete", missing=(
            f"the run was not finished (status {run.status.get('status', 'none')}, "
            f"{run.epochs_completed}/{run.info.get('epochs')} epochs)",))
        results = [{"verdicts": {"project": unfinished.to_dict()}}]
        rows = [(str(run.info.get("label") or path.name), unfinished.text)]
        where = f"{path / 'run.json'}"
    elif (path / "config.json").exists():
        raise CreditAuditError(_undiagnosed_advice(path))
    else:
        raise CreditAuditError(f"{path} is neither an audit folder (audit.json) nor a run folder; "
                               "point at the folder `creditaudit audit --out` wrote")
    code = exit_code([_verdict(r, where) for r in results])
    width = max(len(name) for name, _ in rows) if rows else 0
    lines = [f"{name:<{width}}  {verdict}" for name, verdict in rows]
    return lines, code, {"path": str(path), "exit_code": code,
                         "verdicts": [{"name": n, "verdict": v} for n, v in rows]}


def _undiagnosed_advice(path: Path) -> str:
    """What to do with a run folder that has no diagnosis: a control is no run to diagnose with a
    control of its own — it is the yardstick of another run."""
    config = store.read_json(path / "config.json", "run config")
    blocks = config.get("blocks") if isinstance(config, dict) else None
    trainable = config.get("trainable_blocks") if isinstance(config, dict) else None
    if blocks == 0:
        return (f"{path} is a shallow control (no blocks): it has no depth to diagnose and no verdict "
                "of its own; an audit reads its accuracy beside the run it controls — check the "
                "audit folder (creditaudit audit --out DIR), or diagnose the run itself")
    if trainable == 0:
        return (f"{path} is a frozen-blocks control: it is judged as the control of its run — run "
                f"`creditaudit diagnose RUN_DIR --frozen-control {path}`, then check RUN_DIR")
    return (f"{path} has no diagnosis yet; run `creditaudit diagnose {path} --frozen-control "
            "CONTROL_DIR` (it saves diagnosis.json there), then check again")
