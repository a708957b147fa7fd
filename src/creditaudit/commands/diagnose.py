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
    _refuse_model_only(args, "a run folder holds its own weights, data and settings")
    run = load_run(args.run_dir, resolve_device(args.device))
    if run.config.blocks == 0:
        raise CreditAuditError(f"{args.run_dir} is a shallow control ({run.config.label}: no blocks), so it has "
                               "no depth to diagnose; diagnose the run it controls, or `creditaudit check` "
                               "the audit that trained it")
    control = None
    if getattr(args, "frozen_control", None):
        if Path(args.frozen_control).is_file():
            raise CreditAuditError(f"--frozen-control {args.frozen_control} is a file; for a run folder "
                                   "give the control's run folder (`creditaudit train ... --frozen --out "
                                   "DIR`), a weights file only with --model")
        if run.config.control != "none" or not run.config.trainable_block_ids:
            raise CreditAuditError(f"{args.run_dir} is itself a control ({run.config.label}): (d) compares a "
                                   "run whose blocks trained with its control — diagnose the main run with "
                                   f"--frozen-control {args.run_dir}, or this one without --frozen-control")
        control = load_run(args.frozen_control, "cpu")
    data = load_dataset(run.config.dataset, args.data_dir, next(run.model.parameters()).device,
                        label_probe=not args.no_label_probe)
    batches = eval_batches(data, args.eval_batches)
    _check_credit(run, *batches[0])
    return run, batches, control, data


_MODEL_ONLY = ("weights", "init_weights", "yardstick", "dataset")


def _refuse_model_only(args, why: str, also: tuple[str, ...] = ()) -> None:
    """Options that only --model reads are refused where they would be ignored (a run folder, a
    diagnosed folder): a --weights or --dataset that silently changes nothing misleads."""
    given = getattr(args, "_given_options", set())
    named = [name for name in (*_MODEL_ONLY, *also) if name in given]
    if named:
        flag = "--" + named[0].replace("_", "-")
        raise CreditAuditError(f"{flag} applies with --model only (a model trained elsewhere); {why} — "
                               f"drop {flag}")


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
    if args.run_dir and not args.model and not is_user_loop_run(args.run_dir) \
            and _keeps_judged_depth(Path(args.run_dir), report):
        print(f"creditaudit: note: kept {Path(args.run_dir) / 'diagnosis.json'}, which judged (d) against "
              "the run's frozen control; this diagnosis had no control — give --frozen-control CONTROL "
              "to replace it", file=sys.stderr)
    elif args.run_dir:                # saved beside the run, so `creditaudit check RUN_DIR` reads it
        from ..runs import write_diagnosis
        try:
            write_diagnosis(Path(args.run_dir), report.to_dict())
        except OSError as err:
            print(f"creditaudit: note: could not save {Path(args.run_dir) / 'diagnosis.json'} "
                  f"({err.strerror or err}); the diagnosis above stands", file=sys.stderr)
    return 0


def _keeps_judged_depth(run_dir: Path, report) -> bool:
    """Whether the run's saved diagnosis judged (d) against a frozen control while `report` has
    none: it is kept (nothing already computed is lost; `check RUN` keeps answering with it)."""
    from ..runs import diagnosis_binding
    from ..store import read_sealed_json
    if report.depth is not None or not (run_dir / "diagnosis.json").exists():
        return False
    try:
        saved = read_sealed_json(run_dir / "diagnosis.json", "diagnosis")
        current = saved.get("run_binding") == diagnosis_binding(run_dir)
    except (CreditAuditError, OSError, AttributeError):
        return False                   # a broken one is replaced, as before
    return current and isinstance(saved.get("depth"), dict)    # so is one of the run before a retrain


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
        _refuse_model_only(args, f"check reads the diagnosis saved in {args.path} (to diagnose a run against "
                           "its control: creditaudit diagnose RUN --frozen-control CONTROL)",
                           also=("frozen_control", "eval_batches", "init_weights"))
        lines, code, payload = check_path(Path(args.path))
    else:
        raise CreditAuditError("give an audit or run folder, or --model PKG.MODULE:FACTORY --weights FILE")
    print(json.dumps(payload, indent=2) if args.json else "\n".join(lines))
    return code
