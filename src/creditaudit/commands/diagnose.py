"""`creditaudit diagnose`, `calibrate` and `check`: one run, a diagnosed folder or a model trained
elsewhere (--model) through the protocol."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import CreditAuditError
from .running import set_threads


def _load_for_diagnosis(args):
    """The run, its eval batches and (optionally) its frozen control (judged by the evidence gate
    in `diagnose_run`)."""
    from ..data import load_dataset
    from ..experiments import eval_batches
    from ..runs import load_run, resolve_device
    if not args.run_dir:
        raise CreditAuditError(f"give a run folder: creditaudit {args.command} RUN_DIR (a folder "
                               "written by `creditaudit train`)")
    run = load_run(args.run_dir, resolve_device(args.device))
    control = None
    if getattr(args, "frozen_control", None):
        if Path(args.frozen_control).is_file():
            raise CreditAuditError(f"--frozen-control {args.frozen_control} is a file; for a run folder "
                                   "give the control's run folder (`creditaudit train ... --frozen --out "
                                   "DIR`), a weights file only with --model")
        control = load_run(args.frozen_control, "cpu")
    data = load_dataset(run.config.dataset, args.data_dir, next(run.model.parameters()).device,
                        label_probe=not args.no_label_probe)
    batches = eval_batches(data, args.eval_batches)
    _check_credit(run, *batches[0])
    return run, batches, control, data


def _check_credit(run, x, y) -> None:
    """A method's credit() must give one tensor per residual position h_0 … h_L, each shaped like
    h_l: a rule that does not is refused in one line naming what it returned."""
    import torch
    from ..model import as_stream
    name = run.config.method
    try:
        credit = run.method.credit(x, y)
    except Exception as err:  # noqa: BLE001 — a user's rule failing is theirs to fix
        raise CreditAuditError(f"the credit() of method {name!r} raised {type(err).__name__}: "
                               f"{' '.join(str(err).split())[:200]}; fix the method "
                               "(docs/WRITING_A_RULE.md)") from None
    with torch.no_grad():
        shapes = [tuple(h.shape) for h in as_stream(run.model).hidden(x)]
    got = ([tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__ for a in credit]
           if isinstance(credit, (list, tuple)) else type(credit).__name__)
    if got != shapes:
        raise CreditAuditError(f"the credit() of method {name!r} returned {got}; it must return a list of "
                               f"{len(shapes)} tensors a_0 … a_L shaped like h_l, {shapes} "
                               "(docs/WRITING_A_RULE.md)")


def _diagnose_user_model(args):
    """`--model PKG.MODULE:FACTORY --weights FILE`: a model trained elsewhere (usermodel.py)."""
    from ..data import load_dataset
    from ..experiments import eval_batches
    from ..protocol import diagnose
    from ..runs import resolve_device
    from .. import evidence
    from ..usermodel import user_model_evidence
    if not args.weights or not args.dataset:
        raise CreditAuditError("--model needs --weights FILE.safetensors and --dataset NAME")
    if args.run_dir:
        raise CreditAuditError("give either a run folder or --model/--weights, not both")
    device = resolve_device(args.device)
    data = load_dataset(args.dataset, args.data_dir, device, label_probe=not args.no_label_probe)
    batches = eval_batches(data, args.eval_batches)
    ev = user_model_evidence(args.model, args.weights, data, batches, frozen=args.frozen_control,
                             init=args.init_weights, device=device, yardstick=args.yardstick)
    # the evidence gate: a control that is not this model's, untrained or non-finite is refused; an
    # unverified one is no evidence for (d) (not evaluated, so never "trustworthy")
    admitted = evidence.gate(evidence.Evidence(args.model, None, ev["control"]))
    report = diagnose(ev["model"], batches, frozen_acc=admitted.frozen_acc, test_acc=ev["test_acc"],
                      monitor_history=ev["history"], depth_unevaluated=admitted.depth_why,
                      weak_control=admitted.weak,
                      rho=getattr(args, "rho", False), label=f"{args.model} ({Path(args.weights).name})")
    report.first_fire = None          # two snapshots (init, now) are no training-time monitor
    if admitted.note:                 # what the control is, when it is not what (d) assumes
        report.notes.append(admitted.note)
    return report


def _diagnosis(args):
    from ..experiments.common import diagnose_run
    set_threads(args)
    if args.model:
        return _diagnose_user_model(args)
    if not args.run_dir:
        raise CreditAuditError("give a run folder, or --model PKG.MODULE:FACTORY --weights FILE --dataset NAME")
    run, batches, control, data = _load_for_diagnosis(args)
    return diagnose_run(run, batches, control=control, rho=getattr(args, "rho", False), run_data=data)


def cmd_diagnose(args) -> int:
    from ..monitor import is_user_loop_run, stored_diagnosis
    if args.run_dir and not args.model and is_user_loop_run(args.run_dir):
        if args.frozen_control:    # its model cannot be rebuilt here: (d) is judged in the user's loop
            raise CreditAuditError(f"{args.run_dir} comes from your own loop and was diagnosed at "
                                   "finish(), with (d) once a control monitored with control_of= "
                                   "finished; drop --frozen-control, or call "
                                   "mon.finish(frozen_control=DIR) / creditaudit.audit_own_runs")
        report = stored_diagnosis(args.run_dir)
    else:
        report = _diagnosis(args)
    print(report.to_json(indent=2) if args.json else report)
    if args.run_dir:                  # saved beside the run, so `creditaudit check RUN_DIR` reads it
        from ..runs import write_diagnosis
        try:
            write_diagnosis(Path(args.run_dir), report.to_dict())
        except OSError as err:
            print(f"creditaudit: note: could not save {Path(args.run_dir) / 'diagnosis.json'} "
                  f"({err.strerror or err}); the diagnosis above stands", file=sys.stderr)
    return 0


def cmd_calibrate(args) -> int:
    from ..experiments.common import diagnose_run
    from ..report.tables import calibration_table
    set_threads(args)
    run, batches, _, data = _load_for_diagnosis(args)
    report = diagnose_run(run, batches, rho=True, null_k=args.null_draws, run_data=data)
    print(report.to_json(indent=2) if args.json else calibration_table(report.to_dict()))
    return 0


def cmd_check(args) -> int:
    from ..check import check_path, check_report
    if args.model:
        lines, code, payload = check_report(_diagnosis(args).to_dict())
    elif args.path:
        lines, code, payload = check_path(Path(args.path))
    else:
        raise CreditAuditError("give an audit or run folder, or --model PKG.MODULE:FACTORY --weights FILE")
    print(json.dumps(payload, indent=2) if args.json else "\n".join(lines))
    return code
