"""The command line: `creditaudit train | diagnose | calibrate | audit | ladder | penalty-sweep |
identity-check | thresholds`. User errors print one line and exit 2, without a traceback."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import __version__
from .errors import CreditAuditError


def _option(text: str) -> tuple[str, object]:
    """KEY=VALUE for a method option; the value is read as JSON when it parses (numbers, bools)."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", default="bp", help="bp, fa, dfa, dfa-penalty, ep, sb, cb (default bp)")
    p.add_argument("--dataset", default="mnist1d",
                   help="mnist1d (default), digits, synthetic, cifar10, cifar100, mnist, fashion-mnist")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--width", type=int, default=256, help="residual width d (default 256)")
    p.add_argument("--blocks", type=int, default=4, help="number of residual blocks L (default 4)")
    p.add_argument("--activation", default="gelu")
    p.add_argument("--w2-std", type=float, default=0.01, help="init std of each block's W2")
    p.add_argument("--lam", type=float, default=0.0, help="residual penalty λ (dfa-penalty)")
    depth = p.add_mutually_exclusive_group()
    depth.add_argument("--frozen", action="store_true", help="blocks frozen at init (the control)")
    depth.add_argument("--shallow", action="store_true", help="no blocks at all")
    depth.add_argument("--trainable-blocks", type=int, metavar="K",
                       help="only the last K blocks train (K=0 is the frozen control)")
    p.add_argument("--stop-when-flagged", type=int, metavar="N",
                   help="end the run once a monitor flag ((a), (b), (b′)) has held N epochs")
    p.add_argument("--option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                   help="method option, e.g. --option beta=0.1 (see README, Methods)")


def _add_where_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", default="data", help="where datasets live (default ./data)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")


def _cmd_train(args) -> int:
    from .config import RunConfig
    from .train import train_run
    trainable = 0 if args.frozen else args.trainable_blocks
    config = RunConfig(method=args.method, dataset=args.dataset, seed=args.seed, epochs=args.epochs,
                       batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay,
                       width=args.width, blocks=0 if args.shallow else args.blocks,
                       activation=args.activation, w2_std=args.w2_std, lam=args.lam,
                       trainable_blocks=trainable, stop_when_flagged=args.stop_when_flagged,
                       options=dict(args.option))
    out = Path(args.out or f"runs/{config.method}-{config.dataset}-s{config.seed}-{config.run_key}")
    run = train_run(config, out, data_dir=args.data_dir, device=args.device, progress=not args.quiet)
    last = run.history[-1]
    fired = run.status.get("first_fire", {})
    print(f"{config.label}: {run.status['status']} — {run.status['message']}")
    print(f"  test acc {last['test_acc']:.4f} | median ‖h_L‖ {last['h_norms'][-1]:.3g} | "
          f"‖g_L‖ {last['g_norms'][-1]:.3g} | readout gain {last['gain']:.3g} | "
          f"max block growth {last['max_growth']:.3g} | {run.status['wall_time']:.1f} s")
    print("  first fired: " + ", ".join(f"({k.replace('_prime', '′')}) "
                                        f"{'never' if v is None else f'epoch {v}'}"
                                        for k, v in fired.items()))
    print(f"  run folder: {out}")
    return 0


def _load_for_diagnosis(args):
    """The run, its eval batches and (optionally) its frozen control's accuracy."""
    from .experiments import eval_batches
    from .train import load_run
    from .data import load_dataset
    from .train import resolve_device
    if args.eval_batches < 1:
        raise CreditAuditError(f"--eval-batches must be ≥ 1 (8 or more for stability (c)), got {args.eval_batches}")
    run = load_run(args.run_dir, resolve_device(args.device))
    frozen_acc = None
    if args.frozen_control:
        control = load_run(args.frozen_control, "cpu")
        if control.config.trainable_blocks != 0:
            raise CreditAuditError(f"{args.frozen_control} is not a frozen-blocks control "
                                   "(train one with `creditaudit train ... --frozen`)")
        frozen_acc = control.test_acc
    data = load_dataset(run.config.dataset, args.data_dir, next(run.model.parameters()).device)
    return run, eval_batches(data, args.eval_batches), frozen_acc


def _cmd_diagnose(args) -> int:
    from .protocol import Thresholds, diagnose
    run, batches, frozen_acc = _load_for_diagnosis(args)
    report = diagnose(run.model, batches, method=run.method, frozen_acc=frozen_acc,
                      test_acc=run.test_acc, thresholds=Thresholds(), monitor_history=run.history,
                      rho=args.rho, label=run.config.label,
                      diverged=run.status.get("message") if run.status.get("status") == "diverged" else None)
    print(report.to_json(indent=2) if args.json else report)
    return 0


def _cmd_calibrate(args) -> int:
    from .protocol import Thresholds, diagnose
    run, batches, _ = _load_for_diagnosis(args)
    report = diagnose(run.model, batches, method=run.method, test_acc=run.test_acc,
                      thresholds=Thresholds(), rho=True, null_k=args.null_draws,
                      label=run.config.label)
    if args.json:
        print(report.to_json(indent=2))
        return 0
    from .report import calibration_table
    print(calibration_table(report.to_dict()))
    return 0


def _audit_raw(args) -> dict:
    """The audit's settings: preset or TOML file, then command-line overrides."""
    from .config import load_audit_toml
    raw = load_audit_toml(args.config) if args.config else {"preset": args.preset or "quick"}
    if args.config and args.preset:
        raw["preset"] = args.preset
    for key in ("dataset", "epochs", "out", "device", "data_dir", "jobs", "eval_batches"):
        value = getattr(args, key)
        if value is not None:
            raw[key] = value
    if args.methods:
        raw["methods"] = [m for item in args.methods for m in item.replace(",", " ").split()]
    if args.seeds:
        raw["seeds"] = args.seeds
    return raw


def _cmd_audit(args) -> int:
    from .config import audit_config_from_dict
    from .experiments import audit
    from .report import audit_table, write_report
    config = audit_config_from_dict(_audit_raw(args), where=args.config or "the audit settings")
    print(f"creditaudit audit — {config.preset or 'custom'}: {len(config.run_configs())} runs → {config.out}")
    result = audit(config)
    files = write_report(result, Path(config.out))
    print()
    print(audit_table(result))
    print(f"\naudit written to {config.out}/ ({', '.join(sorted(p.name for p in files.values()))}); "
          f"{result['runs_trained_now']} runs trained now, {result['wall_time']:.0f} s")
    return 0


def _experiment_bases(args):
    """(base RunConfigs over the seeds, thresholds) for ladder / penalty-sweep."""
    from .config import audit_config_from_dict
    raw = _audit_raw(args)
    raw.setdefault("out", "audits/quick")
    config = audit_config_from_dict(raw, where=args.config or "the settings")
    return config, [config.base_config(m, s) for m in config.methods for s in config.seeds]


def _run_experiment(args, name: str, run, figure, table, **extra) -> int:
    """ladder / penalty-sweep: bases from the settings, run, then <out>/<name>.json, .png, table."""
    from .protocol import Thresholds
    config, bases = _experiment_bases(args)
    out = Path(args.out or Path(config.out) / name)
    result = run(bases, out, data_dir=config.data_dir, device=config.device, jobs=config.jobs,
                 thresholds=Thresholds(**config.thresholds), **extra)
    figure(result, out / f"{name}.png")
    print(table(result))
    print(f"written: {out / (name + '.json')}, {out / (name + '.png')}")
    return 0


def _cmd_ladder(args) -> int:
    from .experiments import ladder
    from .report import ladder_figure, ladder_table
    return _run_experiment(args, "ladder", ladder, ladder_figure, ladder_table)


def _cmd_penalty(args) -> int:
    from .experiments import penalty_sweep
    from .report import penalty_figure, penalty_table
    args.methods = ["dfa-penalty"]
    return _run_experiment(args, "penalty_sweep", penalty_sweep, penalty_figure, penalty_table,
                           lambdas=args.lambdas)


def _cmd_identity(args) -> int:
    from .config import RunConfig
    from .experiments import identity_check_experiment
    from .report import identity_figure, identity_table
    config = RunConfig(dataset=args.dataset, width=args.width, blocks=args.blocks,
                       activation=args.activation, w2_std=args.w2_std)
    out = Path(args.out)
    result = identity_check_experiment(config, args.seeds, out, data_dir=args.data_dir)
    identity_figure(result, out / "identity_check.png")
    print(identity_table(result))
    print(f"written: {out / 'identity_check.json'}, {out / 'identity_check.png'}")
    return 0


def _cmd_thresholds(args) -> int:
    from .protocol import Thresholds, threshold_sensitivity
    from .report import sensitivity_figure
    from .store import atomic_write_json, read_json
    audit_dir = Path(args.audit_dir)
    result = read_json(audit_dir / "audit.json", "creditaudit audit folder (with audit.json)")
    runs = result.get("runs") if isinstance(result, dict) else None
    reports = [r["report"] for r in runs or [] if isinstance(r, dict) and r.get("report")
               and r.get("control") == "none"]
    if not reports:
        raise CreditAuditError(f"{audit_dir}/audit.json holds no diagnosed runs; is it an audit folder?")
    try:
        thresholds = Thresholds(**result.get("thresholds", {}))
    except TypeError as err:
        raise CreditAuditError(f"{audit_dir}/audit.json has unreadable thresholds ({err})") from None
    sensitivity, table = threshold_sensitivity(reports, thresholds)
    atomic_write_json(audit_dir / "thresholds.json", sensitivity)
    sensitivity_figure(reports, sensitivity, audit_dir / "thresholds.png")
    print(table)
    print(f"written: {audit_dir / 'thresholds.json'}, {audit_dir / 'thresholds.png'}")
    return 0


def _cmd_lint(args) -> int:
    from .lint import run_lint
    return run_lint(args.paths, sys.stdout)


def _add_audit_args(p: argparse.ArgumentParser, experiment: bool = False) -> None:
    p.add_argument("--preset", choices=["quick", "paper"],
                   help="quick (default: MNIST-1D, no download) or paper (CIFAR-10, 100 epochs)")
    p.add_argument("--config", help="audit TOML file (see examples/quick.toml)")
    p.add_argument("--dataset")
    if not experiment:
        p.add_argument("--methods", nargs="+", help="e.g. --methods bp dfa ep")
    p.add_argument("--seeds", nargs="+", type=int)
    p.add_argument("--epochs", type=int)
    p.add_argument("--out")
    p.add_argument("--device")
    p.add_argument("--data-dir", dest="data_dir")
    p.add_argument("--jobs", type=int, help="worker processes (default: one per CPU core; 1 on CUDA)")
    p.add_argument("--eval-batches", dest="eval_batches", type=int,
                   help="eval batches for the diagnostics (default 8)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="creditaudit",
        description="Train non-backprop credit-assignment methods on a pre-LN residual MLP and audit "
                    "whether their accuracy and gradient-cosine figures mean anything.")
    p.add_argument("--version", action="version", version=f"creditaudit {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    t = sub.add_parser("train", help="train one run into a run folder (resumes if interrupted)")
    _add_run_args(t)
    _add_where_args(t)
    t.add_argument("--out", help="run folder (default runs/METHOD-DATASET-sSEED-KEY)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(func=_cmd_train)

    for name, func, helptext in (
            ("diagnose", _cmd_diagnose, "audit one run: diagnostics (a)–(d), Γ, verdict"),
            ("calibrate", _cmd_calibrate, "ρ per layer beside its BP/random controls, Γ beside its null")):
        d = sub.add_parser(name, help=helptext)
        d.add_argument("run_dir", help="a run folder written by `creditaudit train`")
        d.add_argument("--json", action="store_true", help="print the report as JSON")
        d.add_argument("--eval-batches", type=int, default=8, help="disjoint test batches (default 8)")
        _add_where_args(d)
        if name == "diagnose":
            d.add_argument("--frozen-control", metavar="RUN_DIR",
                           help="the frozen-blocks control run of the same method and seed, for (d)")
            d.add_argument("--rho", action="store_true", help="also measure ρ at layers 1…L")
        else:
            d.add_argument("--null-draws", type=int, default=20, help="fresh feedback draws (default 20)")
        d.set_defaults(func=func, frozen_control=None)

    a = sub.add_parser("audit", help="train + diagnose methods × seeds with controls; write the report")
    _add_audit_args(a)
    a.set_defaults(func=_cmd_audit)

    lad = sub.add_parser("ladder", help="accuracy vs number of trainable blocks k = 0…L")
    _add_audit_args(lad)
    lad.set_defaults(func=_cmd_ladder)

    pen = sub.add_parser("penalty-sweep", help="dfa-penalty over λ with Γ, its null and ρ")
    _add_audit_args(pen, experiment=True)
    pen.add_argument("--lambdas", nargs="+", type=float, default=[0.0, 1e-4, 1e-3, 1e-2, 1e-1])
    pen.set_defaults(func=_cmd_penalty)

    ident = sub.add_parser("identity-check", help="how close a fresh stack is to the identity")
    ident.add_argument("--dataset", default="mnist1d")
    ident.add_argument("--seeds", nargs="+", type=int, default=[42, 123, 456])
    ident.add_argument("--width", type=int, default=256)
    ident.add_argument("--blocks", type=int, default=4)
    ident.add_argument("--activation", default="gelu")
    ident.add_argument("--w2-std", type=float, default=0.01)
    ident.add_argument("--out", default="audits/identity_check")
    ident.add_argument("--data-dir", default="data")
    ident.set_defaults(func=_cmd_identity)

    th = sub.add_parser("thresholds", help="threshold sensitivity over an audit's runs")
    th.add_argument("audit_dir", help="an audit folder (with audit.json)")
    th.set_defaults(func=_cmd_thresholds)

    lint = sub.add_parser("lint", help="check your own training/eval code for the protocol's pitfalls")
    lint.add_argument("paths", nargs="+", metavar="PATH", help="Python files or folders to check")
    lint.set_defaults(func=_cmd_lint)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CreditAuditError as err:
        print(f"creditaudit: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("creditaudit: interrupted; finished epochs are saved — run the same command again to "
              "resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
