"""`creditaudit reproduce RULE`: the rule and bp in the rule's own paper's setting (papers.py),
audited as any audit is, with the paper's numbers beside ours."""
from __future__ import annotations

import shutil
import textwrap

from ..errors import CreditAuditError


def _listing(width: int, only: str | None = None) -> str:
    """Every paper setting, one entry each (`only`: that rule's alone)."""
    from ..papers import PAPERS
    lines = ["paper settings (creditaudit reproduce RULE):"]
    name = max(map(len, PAPERS)) + 1            # the rules' column
    for rule, p in PAPERS.items():
        if only is not None and rule != only:
            continue
        unverified = lambda r: "" if r.verified else " (unverified)"
        bp = f", bp {p.bp.error:.2f} %{unverified(p.bp)}" if p.bp is not None else ""
        number = ("no paper number" if p.reported is None else
                  f"{p.reported.error:.2f} % test error{unverified(p.reported)}{bp}")
        lines.append(textwrap.fill(
            f"{rule:<{name}}{p.dataset}, {p.network}, {p.epochs} epochs — {p.citation}: {number}",
            width, subsequent_indent=" " * name, break_long_words=False))
    return "\n".join(lines)


def reproduce_raw(args, paper) -> dict:
    """The audit settings of `paper`'s setting, with the command line's seeds, epochs and where."""
    methods = [paper.rule] + (["bp"] if paper.rule != "bp" else [])
    raw = {"dataset": paper.dataset, "methods": methods, "epochs": args.epochs or paper.epochs,
           "out": args.out or f"audits/reproduce/{paper.rule}", "model": paper.model(),
           "recipes": {m: r for m, r in paper.recipes().items() if m in methods},
           "options": {paper.rule: dict(paper.options)} if paper.options else {}}
    if args.seeds:
        raw["seeds"] = args.seeds
    for key in ("data_dir", "device", "jobs", "eval_batches"):
        value = getattr(args, key, None)
        if value is not None:
            raw[key] = value
    from ..runs import resolve_device
    raw["device"] = str(resolve_device(raw.get("device", "auto")))
    return raw


def machine(device: str) -> str:
    """The machine the runs trained on, in words: CPU model and cores, or the GPU; torch's version."""
    import os
    import platform

    import torch
    if device.startswith("cuda") and torch.cuda.is_available():
        where = torch.cuda.get_device_name(torch.device(device))
    else:
        model = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                             model)
        except OSError:
            pass
        where = f"{model}, {os.cpu_count()} cores"
    return f"{where}; torch {torch.__version__}"


def cmd_reproduce(args) -> int:
    from ..config import audit_config_from_dict
    from ..methods import resolve_method_name
    from ..papers import paper as paper_of
    from ..report.reproduction import reproduction_terminal
    from .audit import run_audit
    width = max(60, shutil.get_terminal_size((120, 24)).columns)
    if args.list:     # with a rule: that rule's setting alone (an unknown one is refused as below)
        print(_listing(width, paper_of(resolve_method_name(args.rule)).rule if args.rule else None))
        return 0
    if not args.rule:
        from ..papers import PAPERS
        raise CreditAuditError(f"name a rule to reproduce, e.g. `creditaudit reproduce {next(iter(PAPERS))}`; "
                               "`creditaudit reproduce --list` shows the paper settings")
    paper = paper_of(resolve_method_name(args.rule))
    raw = reproduce_raw(args, paper)
    config = audit_config_from_dict(raw, where=f"the paper setting of {paper.rule}")
    record = {**paper.record(config.epochs, len(config.seeds)), "machine": machine(config.device)}
    return run_audit(args, config, f"{paper.rule} as in {paper.citation}", reproduction=record,
                     extra_lines=lambda result: ["", *reproduction_terminal(result)])
