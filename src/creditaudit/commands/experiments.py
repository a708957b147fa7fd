"""`creditaudit ladder`, `penalty-sweep` and `identity-check`: the experiments beside the audit."""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import CreditAuditError
from .audit import experiment_config
from .exits import experiment_exit
from .running import compile_step, locked_out, set_threads


def cmd_ladder(args) -> int:
    from ..config import EXPERIMENT_OUT
    from ..experiments import ladder
    from ..experiments.audit import execution_of
    from ..report.figures import ladder_figure
    from ..report.tables import ladder_table
    from ..verdict import Thresholds
    config = experiment_config(args)
    out = Path(args.out or EXPERIMENT_OUT["ladder"])
    from ..runs import refuse_run_folder
    refuse_run_folder(out, "the ladder", own="ladder.json")
    bases = [config.base_config(m, s) for m in config.methods for s in config.seeds]
    with locked_out(out):
        _refuse_other_result(out / "ladder.json", {"base": [c.to_dict() for c in bases]})
        result = ladder(bases, out, execution=execution_of(config, compile_step(args), not args.no_label_probe),
                        thresholds=Thresholds(**config.thresholds), n_eval=config.eval_batches,
                        progress=not args.quiet)
        ladder_figure(result, out / "ladder.png")
    print(ladder_table(result))
    print(f"written: {out / 'ladder.json'}, {out / 'ladder.png'}")
    return experiment_exit(result, "ladder.json")


def cmd_penalty(args) -> int:
    from ..config import EXPERIMENT_OUT, PENALTY_OPTION
    from ..experiments import penalty_sweep
    from ..experiments.audit import execution_of
    from ..methods import sweep_defaults
    from ..report.figures import penalty_figure
    from ..report.tables import penalty_table
    from ..verdict import Thresholds
    from ..methods import method_class, resolve_method_name
    sweeps = sweep_defaults()
    method = resolve_method_name(args.method) if args.method else next(iter(sweeps))
    if args.lambdas and len(set(args.lambdas)) != len(args.lambdas):
        dupes = sorted({f"{v:g}" for v in args.lambdas if args.lambdas.count(v) > 1})
        raise CreditAuditError(f"--lambdas lists {', '.join(dupes)} more than once; list each λ once")
    from ..methods import methods_with_option
    if method not in sweeps and PENALTY_OPTION not in method_class(method).option_defaults:
        raise CreditAuditError(f"method {method!r} has no penalty option ({PENALTY_OPTION}) to sweep; "
                               f"choose one of {', '.join(methods_with_option(PENALTY_OPTION))}")
    if method not in sweeps and not args.lambdas:
        raise CreditAuditError(f"method {method!r} declares no λ sweep; give --lambdas, or choose one "
                               f"of {', '.join(sweeps)}")
    lambdas = args.lambdas or list(sweeps[method][1])
    swept = sweeps[method][0] if method in sweeps else PENALTY_OPTION
    if any(key.rpartition(".")[2] == swept for key, _ in args.option):   # the sweep sets it per point
        raise CreditAuditError(f"--option {swept}=… gives the value penalty-sweep sweeps; give the "
                               f"values as --lambdas instead")
    config = experiment_config(args, [method])
    out = Path(args.out or EXPERIMENT_OUT["penalty-sweep"])
    from ..runs import refuse_run_folder
    refuse_run_folder(out, "the penalty sweep", own="penalty_sweep.json")
    bases = [config.base_config(method, s) for s in config.seeds]
    with locked_out(out):
        _refuse_other_result(out / "penalty_sweep.json", {"base": [c.to_dict() for c in bases],
                                                          "lambdas": [float(v) for v in lambdas]})
        result = penalty_sweep(bases, out, lambdas=lambdas,
                               execution=execution_of(config, compile_step(args), not args.no_label_probe),
                               thresholds=Thresholds(**config.thresholds), n_eval=config.eval_batches,
                               progress=not args.quiet)
        penalty_figure(result, out / "penalty_sweep.png")
    print(penalty_table(result))
    print(f"written: {out / 'penalty_sweep.json'}, {out / 'penalty_sweep.png'}")
    return experiment_exit(result, "penalty_sweep.json")


def _refuse_other_result(path: Path, wanted: dict) -> None:
    """Refuse to replace a ladder's or sweep's result file with one of other settings (the audit
    does the same for audit.json): the finished result is kept."""
    from ..store import json_safe, read_sealed_json
    if not path.exists():
        return
    old = read_sealed_json(path, f"creditaudit result ({path.name})")
    wanted = json.loads(json.dumps(json_safe(wanted)))
    if any(old.get(k) != v for k, v in wanted.items()):
        raise CreditAuditError(f"{path.parent} already holds a {path.name} of other settings (methods, "
                               "seeds, schedule, model or λ); give this one its own --out, or delete "
                               "that folder to replace it")


def cmd_identity(args) -> int:
    from ..config import RunConfig
    from ..experiments import identity_check_experiment
    from ..report.figures import identity_figure
    from ..report.tables import identity_table
    from ..runs import resolve_device
    if args.blocks < 1:
        raise CreditAuditError(f"--blocks must be ≥ 1, got {args.blocks}")
    set_threads(args)
    config = RunConfig(dataset=args.dataset, arch=args.arch, width=args.width, blocks=args.blocks,
                       activation=args.activation, w2_std=args.w2_std)
    out = Path(args.out)
    from ..runs import refuse_run_folder
    refuse_run_folder(out, "the identity check", own="identity_check.json")
    result = identity_check_experiment(config, args.seeds, out, data_dir=args.data_dir,
                                       device=resolve_device(args.device))
    identity_figure(result, out / "identity_check.png")
    print(identity_table(result))
    print(f"written: {out / 'identity_check.json'}, {out / 'identity_check.png'}")
    return 0
