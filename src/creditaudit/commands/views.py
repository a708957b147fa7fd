"""`creditaudit thresholds` and `report`: views of an audit folder's audit.json."""
from __future__ import annotations

import shutil
from pathlib import Path

from ..errors import CreditAuditError
from .running import write_report_together


def _audit_folder(path: str) -> Path:
    """The audit folder a view reads and writes into: the folder itself, or its audit.json's folder."""
    path = Path(path)
    if path.is_file():
        if path.name == "audit.json":
            return path.parent
        raise CreditAuditError(f"{path} is a file; give the audit's folder (the one holding audit.json)")
    return path


def cmd_thresholds(args) -> int:
    from ..experiments import read_audit
    from ..report.figures import sensitivity_figure
    from ..report.tables import sensitivity_table
    from ..store import write_sealed_json
    from ..sensitivity import threshold_sensitivity
    from ..verdict import Thresholds
    audit_dir = _audit_folder(args.audit_dir)
    result = read_audit(audit_dir)
    reports = [r["report"] for r in result.get("runs") or [] if r.get("report") and r.get("control") == "none"]
    if not reports:
        raise CreditAuditError(f"{audit_dir}/audit.json holds no diagnosed runs; is it an audit folder?")
    sensitivity, _ = threshold_sensitivity(reports, Thresholds(**result.get("thresholds", {})),
                                           depth={m["method"]: m.get("depth") for m in result.get("methods") or []})
    write_sealed_json(audit_dir / "thresholds.json", sensitivity)
    sensitivity_figure(reports, sensitivity, audit_dir / "thresholds.png")
    print(sensitivity_table(sensitivity))
    print(f"written: {audit_dir / 'thresholds.json'}, {audit_dir / 'thresholds.png'}")
    return 0


def cmd_report(args) -> int:
    from ..experiments import read_audit
    from ..report import compact_table, write_report
    audit_dir = _audit_folder(args.audit_dir)
    result = read_audit(audit_dir)
    files = write_report_together(write_report, result, audit_dir)
    print(compact_table(result, width=max(60, shutil.get_terminal_size((120, 24)).columns), out=str(audit_dir)))
    print(f"\nwritten from {audit_dir / 'audit.json'}: {', '.join(sorted(p.name for p in files.values()))}")
    return 0
