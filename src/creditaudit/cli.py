"""The command line. Options and their defaults come from the config dataclasses (config.py) and
the registries (methods, datasets, architectures), so --help cannot drift from the code. User errors
print one line and exit 2, without a traceback; `check` exits 0 / 1 / 3 by verdict."""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import sys
import textwrap
import threading
from pathlib import Path

from . import __version__
from .errors import CreditAuditError

EXIT_USER_ERROR, EXIT_WALK_BACK, EXIT_INCOMPLETE, EXIT_INTERRUPTED = 2, 1, 3, 130


# -- option types -------------------------------------------------------------------------------
def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _count(low: int, high: int):
    """An argparse type: an integer in low … high (an out-of-range count is refused, never run;
    the catalog's `max_count` bounds every count whose size is a plan, not a typo)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected an integer in {low} … {high}, got {text}")
        return value
    parse.__name__ = "count"       # argparse names the type in its message
    return parse


def _option(text: str) -> tuple[str, object]:
    """KEY=VALUE for a method option; the value is read as JSON when it parses (numbers, bools)."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return key, value
    if isinstance(parsed, float) and not math.isfinite(parsed):
        raise argparse.ArgumentTypeError(f"option {key} must be finite, got {value!r}")
    return key, parsed


def _choices(names) -> str:
    return ", ".join(names)


def _default_threads() -> int:
    """Threads for a single-run command: the cores the machine's load leaves idle (at least 1, at
    most 4). A small model at the default thread count on a busy machine can run 20× slower than at
    one thread; at 1–2 threads it never crawls."""
    cores = os.cpu_count() or 1
    try:
        busy = round(os.getloadavg()[0])
    except OSError:
        busy = 0
    return max(1, min(4, cores - busy))


def _set_threads(args) -> None:
    import torch
    threads = getattr(args, "threads", None) or _default_threads()
    torch.set_num_threads(threads)


# -- train ----------------------------------------------------------------------------------------
def _run_config(args):
    from .config import PENALTY_OPTION, RunConfig
    if args.blocks < 1:
        raise CreditAuditError(f"--blocks must be ≥ 1, got {args.blocks}; for the control without "
                               "blocks use --shallow")
    options = dict(args.option)
    if args.lam is not None:
        given = options.get(PENALTY_OPTION, args.lam)
        if given != args.lam:       # two spellings of one knob: neither may silently win
            raise CreditAuditError(f"--lam {args.lam:g} and --option {PENALTY_OPTION}={given} give λ "
                                   "twice with different values; give it once")
        options[PENALTY_OPTION] = args.lam
    trainable = 0 if args.frozen else args.trainable_blocks
    return RunConfig(method=args.method, dataset=args.dataset, arch=args.arch, seed=args.seed,
                     epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                     weight_decay=args.weight_decay, recipe=args.recipe, width=args.width,
                     blocks=0 if args.shallow else args.blocks, activation=args.activation,
                     w2_std=args.w2_std, clip=args.clip, trainable_blocks=trainable,
                     stop_when_flagged=args.stop_when_flagged, options=options,
                     arch_options=dict(args.arch_option), precision=args.precision)


def _compile_step(args) -> bool | None:
    """--no-compile: never; otherwise None = where it pays (the step compiled on CUDA only)."""
    return False if args.no_compile else None


def _cmd_train(args) -> int:
    from .data import load_dataset
    from .runs import resolve_device
    from .train import train_run
    from .verdict import Thresholds, first_fire_epochs, stop_rule
    config = _run_config(args)
    if args.tensorboard is not None:          # refused now, not after the training it would log
        from .trackers import check_log_dir
        check_log_dir(args.tensorboard)
    _set_threads(args)
    data = load_dataset(config.dataset, args.data_dir, "cpu")
    config = config.bind_data(data.digest)      # the default folder's key names the data too
    out = Path(args.out or f"runs/{config.method.replace(':', '_')}-{config.dataset}-s{config.seed}-{config.run_key}")
    device = resolve_device(args.device)      # a bad device is refused before any folder is made
    tensorboard = None
    try:
        with _locked_out(out, stub="config.json"):   # a second `train` here is refused, as for audits
            if args.tensorboard is not None:
                from .trackers import TensorBoardLog
                tensorboard = TensorBoardLog(args.tensorboard)
            run = _train_or_record(
                train_run, config, out, data=data, device=device, progress=not args.quiet,
                stop_rule=stop_rule(config.stop_when_flagged, Thresholds(**config.stop_thresholds)),
                on_epoch=tensorboard, compile_step=_compile_step(args))
            if tensorboard is not None and run is not None:
                tensorboard.log(run.history)     # a run found finished is logged whole
    finally:
        if tensorboard is not None:
            tensorboard.close()
    if run is None:
        return EXIT_INCOMPLETE
    last = run.history[-1]
    fired = first_fire_epochs(run.history, Thresholds())
    print(f"{config.label}: {run.status['status']} after {run.epochs_completed}/{config.epochs} epochs "
          f"— {run.status['message']}")
    print(f"  recipe ({config.recipe_record['source']}): {config.recipe_record['description']}")
    # a value the monitor could not measure is None, a non-finite one a string ("inf")
    num = lambda v, spec: "—" if v is None else v if isinstance(v, str) else format(v, spec)
    print(f"  test acc {num(last['test_acc'], '.4f')} | median ‖h_L‖ {num(last['h_norms'][-1], '.3g')} | "
          f"‖g_L‖ {num(last['g_norms'][-1], '.3g')} | readout gain {num(last['gain'], '.3g')} | "
          f"max block growth {num(last['max_growth'], '.3g')} | {run.status['wall_time']:.1f} s")
    print("  monitor first fired: " + ", ".join(
        f"({k.replace('_prime', '′')}) {'never' if v is None else f'epoch {v}'}" for k, v in fired.items()))
    print(f"  data: {data.describe()}")
    print(f"  run folder: {out}")
    return 0


@contextlib.contextmanager
def _locked_out(out: Path, stub: str | None = None):
    """`audit_lock(out)`, and a command refused inside it leaves nothing that blocks the corrected
    command: folders it made that hold only the lock are removed, and `stub` (train's config.json)
    when this command wrote it and no checkpoint followed — a refused model's config.json would
    make the corrected run's folder "a different run"."""
    from .experiments.lock import audit_lock
    made = [p for p in (out, *out.parents) if not p.exists()]
    had_stub = stub is not None and (out / stub).exists()
    with audit_lock(out, made):      # only the holder removes anything (experiments/lock.py)
        try:
            yield
        except CreditAuditError:
            if stub is not None and not had_stub and not (out / "checkpoint.json").exists():
                (out / stub).unlink(missing_ok=True)
                (out / "method_origin.json").unlink(missing_ok=True)    # written beside it for a user's rule
            raise


def _train_or_record(train_run, config, out: Path, **train_kwargs):
    """train_run, with a run that raises (a user's rule, say) recorded like the audit records it:
    its traceback in <out>/error.txt, one line on stderr, and None (exit 3) instead of a traceback."""
    import time
    from .runs import failure_record
    t0 = time.perf_counter()
    try:
        return train_run(config, out, **train_kwargs)
    except (CreditAuditError, OSError, KeyboardInterrupt):
        raise
    except Exception as err:  # noqa: BLE001 — the run failed; its traceback goes to error.txt
        record = failure_record(out, err, time.perf_counter() - t0)
        print(f"creditaudit: the run {config.label} failed: {record['message']}; fix the method or "
              "settings it names, then run the same command again (finished epochs are kept)",
              file=sys.stderr)
        return None


# -- diagnose / calibrate / check -------------------------------------------------------------------
def _load_for_diagnosis(args):
    """The run, its eval batches and (optionally) its frozen control (judged by the evidence gate
    in `diagnose_run`)."""
    from .data import load_dataset
    from .experiments import eval_batches
    from .runs import load_run, resolve_device
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
    data = load_dataset(run.config.dataset, args.data_dir, next(run.model.parameters()).device)
    batches = eval_batches(data, args.eval_batches)
    _check_credit(run, *batches[0])
    return run, batches, control, data


def _check_credit(run, x, y) -> None:
    """A method's credit() must give one tensor per residual position h_0 … h_L, each shaped like
    h_l: a rule that does not is refused in one line naming what it returned."""
    import torch
    from .model import as_stream
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
    from .data import load_dataset
    from .experiments import eval_batches
    from .protocol import diagnose
    from .runs import resolve_device
    from . import evidence
    from .usermodel import user_model_evidence
    if not args.weights or not args.dataset:
        raise CreditAuditError("--model needs --weights FILE.safetensors and --dataset NAME")
    if args.run_dir:
        raise CreditAuditError("give either a run folder or --model/--weights, not both")
    device = resolve_device(args.device)
    data = load_dataset(args.dataset, args.data_dir, device)
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
    from .experiments.common import diagnose_run
    _set_threads(args)
    if args.model:
        return _diagnose_user_model(args)
    if not args.run_dir:
        raise CreditAuditError("give a run folder, or --model PKG.MODULE:FACTORY --weights FILE --dataset NAME")
    run, batches, control, data = _load_for_diagnosis(args)
    return diagnose_run(run, batches, control=control, rho=getattr(args, "rho", False), run_data=data)


def _cmd_diagnose(args) -> int:
    from .monitor import is_user_loop_run, stored_diagnosis
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
        from .runs import write_diagnosis
        try:
            write_diagnosis(Path(args.run_dir), report.to_dict())
        except OSError as err:
            print(f"creditaudit: note: could not save {Path(args.run_dir) / 'diagnosis.json'} "
                  f"({err.strerror or err}); the diagnosis above stands", file=sys.stderr)
    return 0


def _cmd_calibrate(args) -> int:
    from .experiments.common import diagnose_run
    from .report.tables import calibration_table
    _set_threads(args)
    run, batches, _, data = _load_for_diagnosis(args)
    report = diagnose_run(run, batches, rho=True, null_k=args.null_draws, run_data=data)
    print(report.to_json(indent=2) if args.json else calibration_table(report.to_dict()))
    return 0


def _cmd_check(args) -> int:
    from .check import check_path, check_report
    if args.model:
        lines, code, payload = check_report(_diagnosis(args).to_dict())
    elif args.path:
        lines, code, payload = check_path(Path(args.path))
    else:
        raise CreditAuditError("give an audit or run folder, or --model PKG.MODULE:FACTORY --weights FILE")
    print(json.dumps(payload, indent=2) if args.json else "\n".join(lines))
    return code


# -- audit and the other experiments --------------------------------------------------------------
def _audit_raw(args) -> dict:
    """The audit's settings: preset or TOML file, then command-line overrides."""
    from .config import PRESET_NAMES, load_audit_toml
    raw = load_audit_toml(args.config) if args.config else {"preset": args.preset or PRESET_NAMES[0]}
    if args.config and args.preset:
        raw["preset"] = args.preset
    for key in ("dataset", "epochs", "out", "device", "data_dir", "jobs", "eval_batches", "executor",
                "address", "max_retries", "stack", "recipe"):
        value = getattr(args, key, None)
        if value is not None:
            raw[key] = value
    if getattr(args, "methods", None):
        raw["methods"] = [m for item in args.methods for m in item.replace(",", " ").split()]
    if args.seeds:
        raw["seeds"] = args.seeds
    if getattr(args, "arch", None):
        raw.setdefault("model", {})["arch"] = args.arch
    if args.blocks is not None and args.blocks < 1:
        raise CreditAuditError(f"--blocks must be ≥ 1, got {args.blocks}; the audit trains the shallow "
                               "control (no blocks) itself")
    for section, key in (("model", "width"), ("model", "blocks"), ("training", "lr")):
        if getattr(args, key) is not None:      # as [model] width / blocks and [training] lr say it
            raw[section] = {**raw.get(section, {}), key: getattr(args, key)}
    from .runs import resolve_device
    raw["device"] = str(resolve_device(raw.get("device", "auto")))   # "auto" is decided here, once
    return raw


def _what_ran(args, config) -> str:
    """The header's account of the settings: "preset quick", "preset quick + --methods, --seeds,
    --epochs", "examples/my.toml + --seeds": what actually ran, not only where it started."""
    preset = f"preset {config.preset}" if config.preset else None
    if args.config:
        base = f"{args.config} ({preset})" if preset else str(args.config)
    else:                 # without a file the preset is always named (quick by default)
        base = str(preset)
    given = [f"--{key.replace('_', '-')}" for key in ("methods", "seeds", "epochs", "dataset", "arch",
                                                      "width", "blocks", "lr", "option", "eval_batches")
             if getattr(args, key, None)]
    return " + ".join([base, *([", ".join(given)] if given else [])])


def _require_schedule(args, raw: dict) -> None:
    """A config file without a preset must say how long to train (checked after its keys are
    validated): an empty one must not start the default schedule, 100 epochs per run, silently."""
    if args.config and "preset" not in raw and "epochs" not in raw:
        raise CreditAuditError(f"{args.config} sets neither epochs nor a preset; add epochs = 15 (or "
                               'preset = "quick") to it, or pass --epochs N')


def _cmd_audit(args) -> int:
    from .config import audit_config_from_dict, with_method_options
    from .experiments import audit
    from .report import compact_table, write_report
    from .report.tables import schedule_line, work_done
    from .verdict import Thresholds, verdict_of
    raw = _audit_raw(args)
    raw = with_method_options(raw, args.option, where=args.config or "the audit settings")
    config = audit_config_from_dict(raw, where=args.config or "the audit settings")
    _require_schedule(args, raw)
    if args.tensorboard is not None:          # refused now, not after the audit it would log
        from .trackers import check_log_dir
        check_log_dir(args.tensorboard)
    if args.tracker:                          # the same: a missing extra or bad folder, now
        from .trackers import check_trackers
        check_trackers(args.tracker)
    from .report.tables import plural
    n_runs = len(config.run_configs())
    width = max(60, shutil.get_terminal_size((120, 24)).columns)   # COLUMNS, else the terminal's
    print(textwrap.fill(f"creditaudit audit ({_what_ran(args, config)}): {plural(len(config.methods), 'method')} "
                        f"× {plural(len(config.seeds), 'seed')} → {plural(n_runs, 'run')} → {config.out}",
                        width, subsequent_indent="    ", break_on_hyphens=False))
    with _locked_out(Path(config.out)):
        result = audit(config, progress=not args.quiet, compile_step=_compile_step(args))
        files = _write_report_together(write_report, result, Path(config.out))
    if args.tensorboard is not None:  # every run's monitor history, one log folder per run
        from .trackers import log_runs
        log_runs(result["runs"], args.tensorboard, Thresholds(**config.thresholds))
    if args.tracker:                  # one tracker run per run folder, its verdict at the end
        from .trackers import log_judged_runs
        log_judged_runs(result, args.tracker, args.tracker_project or Path(config.out).name,
                        Thresholds(**config.thresholds))
    print()
    print(compact_table(result, width=width, out=str(config.out)))
    failed = [r for r in result["runs"] if r["status"] not in ("finished", "stopped", "diverged")]
    incomplete = [m["method"] for m in result["methods"] if verdict_of(m).outcome == "incomplete"]
    print("\n" + textwrap.fill(f"full table, per-seed values and reasons: {Path(config.out) / 'audit.md'}",
                               width, subsequent_indent="    ", break_long_words=False))
    print(textwrap.fill(f"also written: {', '.join(sorted(p.name for p in files.values() if p.name != 'audit.md'))}; "
                        f"{work_done(result)}, {result['wall_time']:.0f} s", width, subsequent_indent="    "))
    if schedule_line(result):
        print(textwrap.fill(schedule_line(result), width, subsequent_indent="    "))
    parts = []
    if failed:
        parts.append(_failed_runs_advice(failed, "audit.md"))
    if incomplete:
        parts.append(f"incomplete verdict for {', '.join(incomplete)}: evidence missing or "
                     "undetermined (see 'missing' under Reasons in audit.md)")
    if parts:
        print("creditaudit: " + "; ".join(parts) + " — exit status 3: the audit is not complete "
              "(0 = complete; `creditaudit check` gives the verdicts' status)", file=sys.stderr)
    if failed or incomplete:
        return EXIT_INCOMPLETE
    return 0


# a failure that may pass on a second try (the disk, the machine); any other failure repeats
_TRANSIENT = ("cannot write", "interrupted", "worker", "killed", "out of memory")


def _failed_runs_advice(failed: list[dict], where: str) -> str:
    """One clause for failed runs: retry only what a retry can fix; otherwise say what to change."""
    transient = [r for r in failed if any(t in str(r.get("message", "")).lower() for t in _TRANSIENT)]
    if len(transient) == len(failed):
        return (f"{len(failed)} run(s) failed (listed in {where}); run the same command again to "
                "retry them — finished runs are reused")
    first = next(r for r in failed if r not in transient)
    message = " ".join(str(first.get("message", "")).split())
    message = message if len(message) <= 240 else message[:237] + "..."
    return (f"{len(failed)} run(s) failed (listed in {where}); they fail the same way on a rerun "
            f"until the cause is changed — first: {first.get('label')}: {message}")


def _write_report_together(write_report, result: dict, out: Path) -> dict:
    """write_report into a temporary folder beside the report, then move every file in: a write
    that fails (a full disk) leaves the previous report whole rather than half old, half new."""
    import shutil
    import tempfile
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out, prefix=".report-"))
    try:
        staged = write_report(result, staging, previous=out)   # a figure that did not change is kept
        files = {}
        for name, path in staged.items():      # renames within one folder: they need no space
            os.replace(path, out / path.name)
            files[name] = out / path.name
        return files
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _experiment_config(args, methods: list[str] | None = None):
    from .config import audit_config_from_dict, with_method_options
    raw = _audit_raw(args)
    if methods is not None:
        raw["methods"] = methods
    raw = with_method_options(raw, args.option, where=args.config or "the settings")
    config = audit_config_from_dict(raw, where=args.config or "the settings")
    _require_schedule(args, raw)
    return config


def _cmd_ladder(args) -> int:
    from .config import EXPERIMENT_OUT
    from .experiments import ladder
    from .experiments.audit import execution_of
    from .report.figures import ladder_figure
    from .report.tables import ladder_table
    from .verdict import Thresholds
    config = _experiment_config(args)
    out = Path(args.out or EXPERIMENT_OUT["ladder"])
    bases = [config.base_config(m, s) for m in config.methods for s in config.seeds]
    with _locked_out(out):
        _refuse_other_result(out / "ladder.json", {"base": [c.to_dict() for c in bases]})
        result = ladder(bases, out, execution=execution_of(config, _compile_step(args)),
                        thresholds=Thresholds(**config.thresholds), n_eval=config.eval_batches,
                        progress=not args.quiet)
        ladder_figure(result, out / "ladder.png")
    print(ladder_table(result))
    print(f"written: {out / 'ladder.json'}, {out / 'ladder.png'}")
    return _experiment_exit(result, "ladder.json")


def _cmd_penalty(args) -> int:
    from .config import EXPERIMENT_OUT, PENALTY_OPTION
    from .experiments import penalty_sweep
    from .experiments.audit import execution_of
    from .methods import sweep_defaults
    from .report.figures import penalty_figure
    from .report.tables import penalty_table
    from .verdict import Thresholds
    from .methods import resolve_method_name
    sweeps = sweep_defaults()
    method = resolve_method_name(args.method) if args.method else next(iter(sweeps))
    if args.lambdas and len(set(args.lambdas)) != len(args.lambdas):
        dupes = sorted({f"{v:g}" for v in args.lambdas if args.lambdas.count(v) > 1})
        raise CreditAuditError(f"--lambdas lists {', '.join(dupes)} more than once; list each λ once")
    if method not in sweeps and not args.lambdas:
        raise CreditAuditError(f"method {method!r} declares no λ sweep; give --lambdas, or choose one "
                               f"of {_choices(sweeps)}")
    lambdas = args.lambdas or list(sweeps[method][1])
    swept = sweeps[method][0] if method in sweeps else PENALTY_OPTION
    if any(key.rpartition(".")[2] == swept for key, _ in args.option):   # the sweep sets it per point
        raise CreditAuditError(f"--option {swept}=… gives the value penalty-sweep sweeps; give the "
                               f"values as --lambdas instead")
    config = _experiment_config(args, [method])
    out = Path(args.out or EXPERIMENT_OUT["penalty-sweep"])
    bases = [config.base_config(method, s) for s in config.seeds]
    with _locked_out(out):
        _refuse_other_result(out / "penalty_sweep.json", {"base": [c.to_dict() for c in bases],
                                                          "lambdas": [float(v) for v in lambdas]})
        result = penalty_sweep(bases, out, lambdas=lambdas, execution=execution_of(config, _compile_step(args)),
                               thresholds=Thresholds(**config.thresholds), n_eval=config.eval_batches,
                               progress=not args.quiet)
        penalty_figure(result, out / "penalty_sweep.png")
    print(penalty_table(result))
    print(f"written: {out / 'penalty_sweep.json'}, {out / 'penalty_sweep.png'}")
    return _experiment_exit(result, "penalty_sweep.json")


def _refuse_other_result(path: Path, wanted: dict) -> None:
    """Refuse to replace a ladder's or sweep's result file with one of other settings (the audit
    does the same for audit.json): the finished result is kept."""
    from .store import json_safe, read_sealed_json
    if not path.exists():
        return
    old = read_sealed_json(path, f"creditaudit result ({path.name})")
    wanted = json.loads(json.dumps(json_safe(wanted)))
    if any(old.get(k) != v for k, v in wanted.items()):
        raise CreditAuditError(f"{path.parent} already holds a {path.name} of other settings (methods, "
                               "seeds, schedule, model or λ); give this one its own --out, or delete "
                               "that folder to replace it")


def _experiment_exit(result: dict, where: str) -> int:
    """0 when every run of a ladder or sweep ended; else one line and exit 3 (as the audit)."""
    failed = [r for r in result.get("runs") or [] if r["status"] not in ("finished", "stopped", "diverged")]
    if not failed:
        return 0
    every = " (every run)" if len(failed) == len(result["runs"]) else ""
    print(f"creditaudit: {_failed_runs_advice(failed, where)}{every} — exit status 3: the result is "
          "not complete", file=sys.stderr)
    return EXIT_INCOMPLETE


def _cmd_identity(args) -> int:
    from .config import RunConfig
    from .experiments import identity_check_experiment
    from .report.figures import identity_figure
    from .report.tables import identity_table
    from .runs import resolve_device
    if args.blocks < 1:
        raise CreditAuditError(f"--blocks must be ≥ 1, got {args.blocks}")
    _set_threads(args)
    config = RunConfig(dataset=args.dataset, arch=args.arch, width=args.width, blocks=args.blocks,
                       activation=args.activation, w2_std=args.w2_std)
    out = Path(args.out)
    result = identity_check_experiment(config, args.seeds, out, data_dir=args.data_dir,
                                       device=resolve_device(args.device))
    identity_figure(result, out / "identity_check.png")
    print(identity_table(result))
    print(f"written: {out / 'identity_check.json'}, {out / 'identity_check.png'}")
    return 0


def _cmd_thresholds(args) -> int:
    from .experiments import read_audit
    from .report.figures import sensitivity_figure
    from .report.tables import sensitivity_table
    from .store import write_sealed_json
    from .verdict import Thresholds, threshold_sensitivity
    audit_dir = Path(args.audit_dir)
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


def _cmd_report(args) -> int:
    from .experiments import read_audit
    from .report import compact_table, write_report
    audit_dir = Path(args.audit_dir)
    result = read_audit(audit_dir)
    files = _write_report_together(write_report, result, audit_dir)
    print(compact_table(result, width=max(60, shutil.get_terminal_size((120, 24)).columns), out=str(audit_dir)))
    print(f"\nwritten from {audit_dir / 'audit.json'}: {', '.join(sorted(p.name for p in files.values()))}")
    return 0


def _cmd_lint(args) -> int:
    from .lint import run_lint
    return run_lint(args.paths, sys.stdout)


# -- the subcommands: each one's options in one function, its work in `_cmd_<name>` above --------
# Options and defaults come from the catalog (catalog.py: the registries and config dataclasses),
# so --help cannot drift from the code and needs no torch. A new option of a subcommand goes into
# that subcommand's `_options_<name>` (or into the shared group it belongs to: `_run_options` for
# what defines a run, `_audit_options` for audits, ladders and sweeps, `_where_options` for where
# things run, `_user_model_options` for --model).
def _run_options(p: argparse.ArgumentParser, cat) -> None:
    """What defines one run (train): its RunConfig fields."""
    d = cat.run_default
    h = lambda name, extra="": f"{cat.run_help(name)}{extra} (default: {d(name)})"
    p.add_argument("--method", default=d("method"), metavar="NAME",
                   help=h("method", f"; one of {_choices(cat.methods)}"))
    p.add_argument("--dataset", default=d("dataset"), choices=cat.datasets, metavar="NAME",
                   help=h("dataset", f"; one of {_choices(cat.datasets)}"))
    p.add_argument("--arch", default=d("arch"), choices=cat.archs, metavar="NAME",
                   help=h("arch", f"; one of {_choices(cat.archs)}"))
    p.add_argument("--seed", type=int, default=d("seed"), help=h("seed"))
    p.add_argument("--epochs", type=_count(1, cat.max_count), default=d("epochs"), help=h("epochs"))
    p.add_argument("--batch-size", type=_count(1, 10 ** 7), default=d("batch_size"), help=h("batch_size"))
    p.add_argument("--lr", type=_finite_float, default=d("lr"), help=h("lr"))
    p.add_argument("--weight-decay", type=_finite_float, default=d("weight_decay"), help=h("weight_decay"))
    p.add_argument("--recipe", choices=cat.recipes, default=d("recipe"), help=h("recipe"))
    p.add_argument("--width", type=_count(1, cat.max_count), default=d("width"), help=h("width"))
    p.add_argument("--blocks", type=_count(0, cat.max_count), default=d("blocks"), help=h("blocks"))
    p.add_argument("--activation", default=d("activation"), choices=cat.activations, metavar="NAME",
                   help=h("activation", f"; one of {_choices(cat.activations)}"))
    p.add_argument("--w2-std", type=_finite_float, default=d("w2_std"), help=h("w2_std"))
    p.add_argument("--clip", type=_finite_float, default=d("clip"), help=h("clip"))
    p.add_argument("--lam", type=_finite_float, default=None,
                   help="residual penalty λ, for the methods that declare it (default: the method's own)")
    depth = p.add_mutually_exclusive_group()
    depth.add_argument("--frozen", action="store_true", help="blocks frozen at init (the frozen-blocks control)")
    depth.add_argument("--shallow", action="store_true", help="no blocks at all (the shallow control)")
    depth.add_argument("--trainable-blocks", type=_count(0, cat.max_count), metavar="K",
                       help="only the last K blocks train (K=0 is the frozen control) (default: all)")
    p.add_argument("--stop-when-flagged", type=_count(1, cat.max_count), metavar="N",
                   help="end the run once (a) or (b′) has held N epochs (default: train to the end)")
    p.add_argument("--option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                   help="method option, e.g. --option beta=10 (README, Methods) (default: none)")
    p.add_argument("--arch-option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                   help="architecture option, e.g. --arch-option heads=4 (default: none)")
    p.add_argument("--precision", choices=cat.precisions, default=d("precision"), help=h("precision"))
    p.add_argument("--no-compile", action="store_true",
                   help="train the step eagerly (default: compiled into CUDA graphs on a GPU, eager on a CPU)")


def _where_options(p: argparse.ArgumentParser, cat, threads: bool = True) -> None:
    """Where a single-run command reads data and runs: --data-dir, --device, --threads."""
    for name in ("data_dir", "device"):
        p.add_argument(f"--{name.replace('_', '-')}", default=cat.audit_default(name),
                       help=f"{cat.audit_help(name)} (default: {cat.audit_default(name)})")
    if threads:
        p.add_argument("--threads", type=_count(1, 4096), metavar="N",
                       help="CPU threads (default: the idle cores, 1 to 4)")


def _user_model_options(p: argparse.ArgumentParser, cat) -> None:
    """--model and what goes with it: a model trained elsewhere (diagnose, check)."""
    p.add_argument("--model", metavar="PKG.MODULE:FACTORY",
                   help="audit your own model: FACTORY() returns an nn.Module exposing its residual "
                        "stream (docs/ADD_A_METHOD.md) (default: none)")
    p.add_argument("--weights", metavar="FILE",
                   help="with --model: its trained weights (.safetensors) (default: none)")
    p.add_argument("--init-weights", metavar="FILE",
                   help="with --model: its weights at initialisation, for (a′) (default: none)")
    p.add_argument("--yardstick", metavar="FILE",
                   help="with --model and --frozen-control: weights of the same model with its blocks "
                        "at init and embedding and readout trained by backprop; a control more than 2 "
                        "points short of it is weak (default: none: the control must beat the "
                        "untrained model by the margin)")
    p.add_argument("--dataset", choices=cat.datasets, metavar="NAME",
                   help=f"with --model: the data to measure on; one of {_choices(cat.datasets)} "
                        "(default: none)")


def _audit_options(p: argparse.ArgumentParser, cat, methods: bool = True) -> None:
    """An audit's settings (audit, ladder, penalty-sweep): preset or TOML file, then overrides."""
    h = lambda name: f"{cat.audit_help(name)} (default: from the preset or config file)"
    p.add_argument("--preset", choices=cat.presets,
                   help="quick: MNIST-1D, no download, 15 epochs; paper: CIFAR-10, 100 epochs "
                        "(both: the paper's seven methods); zoo: every built-in rule, as quick "
                        "(default: quick, unless --config is given)")
    p.add_argument("--config", metavar="FILE",
                   help="audit TOML file, e.g. examples/quick.toml (default: none, the preset alone)")
    p.add_argument("--dataset", choices=cat.datasets, metavar="NAME",
                   help=f"{h('dataset')}; one of {_choices(cat.datasets)}")
    p.add_argument("--arch", choices=cat.archs, metavar="NAME",
                   help=f"architecture, one of {_choices(cat.archs)} (default: {cat.run_default('arch')})")
    if methods:
        p.add_argument("--methods", nargs="+", metavar="NAME",
                       help=f"methods to audit: some of {_choices(cat.methods)}, or PKG.MODULE:CLASS "
                            "(default: from the preset)")
    p.add_argument("--seeds", nargs="+", type=int, metavar="SEED", help=h("seeds"))
    p.add_argument("--epochs", type=_count(1, cat.max_count), help=h("epochs"))
    # what defines every run, as the [model] and [training] tables of a config file set it
    r = lambda name: f"{cat.run_help(name)} of every run (default: from the config file, else {cat.run_default(name)})"
    p.add_argument("--width", type=_count(1, cat.max_count), help=r("width"))
    p.add_argument("--blocks", type=_count(0, cat.max_count),
                   help=f"number of residual blocks L of every run, ≥ 1: the audit trains the shallow "
                        f"control itself (default: from the config file, else {cat.run_default('blocks')})")
    p.add_argument("--lr", type=_finite_float,
                   help="learning rate of every run, overriding each method's recipe (default: from the "
                        "config file, else each recipe's)")
    p.add_argument("--option", type=_option, action="append", default=[], metavar="[METHOD.]KEY=VALUE",
                   help="method option, as [options.METHOD] in a config file: KEY=VALUE for every audited "
                        "method that declares KEY, METHOD.KEY=VALUE for one; e.g. --option decay=10 "
                        "(the options: --help's end) (default: none)")
    p.add_argument("--out", metavar="DIR", help="output folder (default: audits/<preset>, or as named below)")
    p.add_argument("--device", help=f"{cat.audit_help('device')} (default: {cat.audit_default('device')})")
    p.add_argument("--no-compile", action="store_true",
                   help="train every step eagerly (default: compiled into CUDA graphs on a GPU, eager on a CPU)")
    p.add_argument("--data-dir", dest="data_dir", metavar="DIR",
                   help=f"{cat.audit_help('data_dir')} (default: {cat.audit_default('data_dir')})")
    p.add_argument("--jobs", type=_count(0, 4096), help=f"{cat.audit_help('jobs')} (default: 0)")
    p.add_argument("--eval-batches", dest="eval_batches", type=_count(1, cat.max_count),
                   help=f"{cat.audit_help('eval_batches')} (default: {cat.audit_default('eval_batches')})")
    p.add_argument("--executor", choices=cat.executors,
                   help=f"{cat.audit_help('executor')}: {_choices(cat.executors)} (default: local)")
    p.add_argument("--address", help=f"{cat.audit_help('address')} (default: start a local Ray)")
    p.add_argument("--max-retries", dest="max_retries", type=_count(0, 1000),
                   help=f"{cat.audit_help('max_retries')} (default: {cat.audit_default('max_retries')})")
    stacking = p.add_mutually_exclusive_group()
    stacking.add_argument("--stack", dest="stack", action="store_const", const=True,
                          help=f"train runs of one model shape as one batched stack "
                               f"({cat.stackable}) "
                               "(default: on CUDA only, where it pays)")
    stacking.add_argument("--no-stack", dest="stack", action="store_const", const=False,
                          help="train every run on its own, to compare (default: on CUDA only)")
    p.add_argument("--recipe", choices=cat.recipes,
                   help=f"{cat.audit_help('recipe')} (default: {cat.audit_default('recipe')})")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _eval_batches_option(p: argparse.ArgumentParser, cat, prefix: str = "") -> None:
    p.add_argument("--eval-batches", type=_count(1, cat.max_count), default=cat.audit_default("eval_batches"),
                   help=f"{prefix}{cat.audit_help('eval_batches')} "
                        f"(default: {cat.audit_default('eval_batches')})")


def _options_train(p: argparse.ArgumentParser, cat) -> None:
    p.epilog = cat.knobs + "\n" + p.epilog
    _run_options(p, cat)
    _where_options(p, cat)
    p.add_argument("--out", metavar="DIR", help="run folder (default: runs/METHOD-DATASET-sSEED-KEY)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--tensorboard", metavar="DIR",
                   help="also log every monitor scalar and flag to TensorBoard in DIR (the "
                        "[tensorboard] extra) (default: none)")


def _options_diagnose(p: argparse.ArgumentParser, cat) -> None:
    p.add_argument("run_dir", nargs="?", help="a run folder written by `creditaudit train`")
    _user_model_options(p, cat)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    _eval_batches_option(p, cat)
    _where_options(p, cat)
    p.add_argument("--frozen-control", metavar="RUN_DIR|FILE",
                   help="the frozen-blocks control of the same method, seed and settings "
                        "(a run folder; with --model, its .safetensors weights), for (d) "
                        "(default: none, so the verdict is at best incomplete)")
    p.add_argument("--rho", action="store_true", help="also measure ρ at layers 1…L")


def _options_calibrate(p: argparse.ArgumentParser, cat) -> None:
    p.add_argument("run_dir", nargs="?", help="a run folder written by `creditaudit train`")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    _eval_batches_option(p, cat)
    _where_options(p, cat)
    p.add_argument("--null-draws", type=_count(1, cat.max_count), default=cat.null_k,
                   help=f"fresh feedback draws of Γ's null, 1 … {cat.max_count} (default: {cat.null_k})")


def _options_check(p: argparse.ArgumentParser, cat) -> None:
    p.add_argument("path", nargs="?", help="an audit folder (with audit.json) or a diagnosed run folder")
    p.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    _user_model_options(p, cat)
    p.add_argument("--frozen-control", metavar="FILE",
                   help="with --model: the frozen control's weights (default: none)")
    _eval_batches_option(p, cat, prefix="with --model: ")
    _where_options(p, cat)
    p.set_defaults(run_dir=None)


def _options_audit(p: argparse.ArgumentParser, cat) -> None:
    p.epilog = cat.rules + "\n" + cat.knobs + "\n" + p.epilog
    _audit_options(p, cat)
    p.add_argument("--tensorboard", metavar="DIR",
                   help="also log every run's monitor scalars and flags to TensorBoard, one "
                        "subfolder of DIR per run (the [tensorboard] extra) (default: none)")
    p.add_argument("--tracker", action="append", metavar="KIND[:WHERE]",
                   help="also log every run to a tracker, one tracker run per run folder, with its "
                        "status and verdicts at the end; repeatable: tensorboard:DIR, wandb[:DIR] "
                        "(WANDB_MODE=offline writes only there), mlflow[:TRACKING_URI] (e.g. "
                        "sqlite:///mlflow.db); the [tensorboard], [wandb], [mlflow] extras "
                        "(default: none)")
    p.add_argument("--tracker-project", metavar="NAME",
                   help="the W&B project / MLflow experiment of --tracker (default: the name of "
                        "the --out folder)")


def _options_ladder(p: argparse.ArgumentParser, cat) -> None:
    _audit_options(p, cat)


def _options_penalty(p: argparse.ArgumentParser, cat) -> None:
    _audit_options(p, cat, methods=False)
    p.add_argument("--method", help="the method to sweep (default: the first that declares a sweep)")
    p.add_argument("--lambdas", nargs="+", type=_finite_float, metavar="λ",
                   help="λ values (default: the method's own sweep, 0 1e-4 1e-3 1e-2 1e-1)")


def _options_identity(p: argparse.ArgumentParser, cat) -> None:
    r = cat.run_default
    p.add_argument("--dataset", default=r("dataset"), choices=cat.datasets, metavar="NAME",
                   help=f"inputs to measure on; one of {_choices(cat.datasets)} (default: {r('dataset')})")
    p.add_argument("--arch", default=r("arch"), choices=cat.archs, metavar="NAME",
                   help=f"one of {_choices(cat.archs)} (default: {r('arch')})")
    seeds = list(cat.audit_default("seeds"))
    p.add_argument("--seeds", nargs="+", type=int, default=seeds,
                   help=f"(default: {' '.join(map(str, seeds))})")
    p.add_argument("--width", type=_count(1, cat.max_count), default=r("width"), help=f"(default: {r('width')})")
    p.add_argument("--blocks", type=_count(0, cat.max_count), default=r("blocks"), help=f"(default: {r('blocks')})")
    p.add_argument("--activation", default=r("activation"), choices=cat.activations, metavar="NAME",
                   help=f"one of {_choices(cat.activations)} (default: {r('activation')})")
    p.add_argument("--w2-std", type=_finite_float, default=r("w2_std"), help=f"(default: {r('w2_std')})")
    out = cat.experiment_out["identity-check"]
    p.add_argument("--out", default=out, help=f"(default: {out})")
    _where_options(p, cat)


def _options_thresholds(p: argparse.ArgumentParser, cat) -> None:
    p.add_argument("audit_dir", help="an audit folder (with audit.json)")


def _options_report(p: argparse.ArgumentParser, cat) -> None:
    p.add_argument("audit_dir", help="an audit folder (with audit.json)")


def _options_lint(p: argparse.ArgumentParser, cat) -> None:
    p.add_argument("paths", nargs="+", metavar="PATH", help="Python files or folders to check")


# name, one line of help, example command lines, its options, what runs it
COMMANDS = (
    ("train", "train one run into a run folder (resumes if interrupted)",
     "  creditaudit train --method dfa --dataset mnist1d --epochs 15\n"
     "  creditaudit train --method dfa --dataset mnist1d --epochs 15 --frozen", _options_train, _cmd_train),
    ("diagnose", "audit one run: diagnostics (a)–(d), Γ, verdict",
     "  creditaudit diagnose runs/dfa-RUN --frozen-control runs/dfa-FROZEN\n"
     "  creditaudit diagnose --model mypkg.nets:make --weights trained.safetensors "
     "--dataset cifar10 --frozen-control frozen.safetensors", _options_diagnose, _cmd_diagnose),
    ("calibrate", "ρ per layer beside its BP/random controls, Γ beside its null",
     "  creditaudit calibrate runs/dfa-RUN", _options_calibrate, _cmd_calibrate),
    ("check", "verdict gate for CI: exit 0 trustworthy, 1 walk back, 3 incomplete, 2 error",
     "  creditaudit check audits/quick\n"
     "  creditaudit check --model mypkg.nets:make --weights trained.safetensors --dataset digits "
     "--frozen-control frozen.safetensors", _options_check, _cmd_check),
    ("audit", "train + diagnose methods × seeds with controls; write the report",
     "  creditaudit audit --preset quick\n"
     "  creditaudit audit --config examples/quick.toml --methods bp dfa --seeds 42", _options_audit, _cmd_audit),
    ("ladder", "accuracy vs number of trainable blocks k = 0…L (default out: audits/ladder)",
     "  creditaudit ladder --methods bp dfa --seeds 42 --epochs 15", _options_ladder, _cmd_ladder),
    ("penalty-sweep", "a penalised method over λ, with frozen controls, Γ, its null and ρ "
                      "(default out: audits/penalty_sweep)",
     "  creditaudit penalty-sweep --seeds 42 --epochs 15\n"
     "  creditaudit penalty-sweep --lambdas 0 0.01 --seeds 42 123", _options_penalty, _cmd_penalty),
    ("identity-check", "how close a fresh residual stack is to the identity, over seeds",
     "  creditaudit identity-check --dataset mnist1d --seeds 42 123 456", _options_identity, _cmd_identity),
    ("thresholds", "threshold sensitivity over an audit's runs",
     "  creditaudit thresholds audits/quick", _options_thresholds, _cmd_thresholds),
    ("report", "rewrite audit.md, report.html and the PNGs from audit.json alone",
     "  creditaudit report audits/quick", _options_report, _cmd_report),
    ("lint", "check your own training/eval code for the protocol's pitfalls (never runs it)",
     "  creditaudit lint train.py eval/", _options_lint, _cmd_lint),
)


def build_parser(cat=None) -> argparse.ArgumentParser:
    """The whole command line from `COMMANDS`; `cat` the catalog (default: computed now from the
    registries, so a method added to the registry is in --help at once; `main` reads the cached one)."""
    if cat is None:
        from .catalog import live
        cat = live()
    p = _Parser(
        prog="creditaudit",
        description="Train non-backprop credit-assignment methods and audit whether their accuracy "
                    "and gradient-cosine figures mean anything (docs/PROTOCOL.md).",
        epilog="examples:\n  creditaudit audit --preset quick\n  creditaudit check audits/quick",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"creditaudit {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, helptext, examples, options, func in COMMANDS:
        s = sub.add_parser(name, help=helptext, description=helptext, epilog="examples:\n" + examples,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        s.set_defaults(func=func)
        options(s, cat)
    return p


class _Parser(argparse.ArgumentParser):
    """Bad options are user errors like any other: one line, exit 2 (no usage block). Options are
    never abbreviated (--epoch is not --epochs): a typo must not silently pick an option."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise CreditAuditError(f"{message} (see: {self.prog} --help)")

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but an argument no option takes is refused by the subcommand it was given
        to, so that the message points at that subcommand's --help (`creditaudit audit --help`)."""
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            subs = [a for a in self._actions if isinstance(a, argparse._SubParsersAction)]
            command = getattr(parsed, "command", None)
            owner = subs[0].choices.get(command, self) if subs and command else self
            owner.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed


def _interrupt(signum, frame):
    raise KeyboardInterrupt


# what the report's symbols become on a console that cannot print them (cp1252, ASCII, …)
_ASCII = {"′": "'", "‖": "||", "…": "...", "—": "-", "–": "-", "→": "->", "←": "<-", "≥": ">=",
          "≤": "<=", "≈": "~", "×": "x", "−": "-", "·": "*", "Γ": "Gamma", "λ": "lambda",
          "ρ": "rho", "β": "beta", "σ": "sigma", "τ": "tau", "∂": "d", "√": "sqrt", "∞": "inf",
          "²": "^2", "Δ": "Delta", "ε": "eps", "ψ": "psi", "φ": "phi", "✓": "ok", "✗": "x"}


def _ascii_fallback(err: UnicodeEncodeError):
    text = err.object[err.start:err.end]
    return "".join(_ASCII.get(c, "?") for c in text), err.end


def _printable_console() -> None:
    """stdout/stderr that never raise on a character the console's encoding lacks (a cp1252
    Windows console and the ′ of "(a′)"): such a character is spelled in ASCII instead."""
    import codecs
    codecs.register_error("creditaudit-ascii", _ascii_fallback)
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            with contextlib.suppress(ValueError, OSError):
                stream.reconfigure(errors="creditaudit-ascii")


_WRITE_ERRNOS = {"ENOSPC", "EDQUOT", "EROFS", "EFBIG"}   # the disk, not the path, is the problem


def main(argv: list[str] | None = None) -> int:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)     # SIGTERM stops like Ctrl-C: workers stopped, exit 130
    _printable_console()
    try:
        from .catalog import load
        args = build_parser(load()).parse_args(argv)     # --help ends here with its own SystemExit(0)
        try:
            return args.func(args)
        except SystemExit as err:
            # only the user's code (a --model factory or its forward, a PKG:CLASS rule's step or
            # credit) exits inside a command: a run it was training is unfinished, nothing was
            # judged, and the exit must not read as success (`check` exiting 0)
            raise CreditAuditError(f"code of yours called sys.exit({err.code!r}) inside `creditaudit "
                                   f"{args.command}` (a model factory or forward, or a method's step "
                                   "or credit); nothing was judged and a run it trained is unfinished "
                                   "(its finished epochs are kept) — remove the exit and run the same "
                                   "command again") from None
    except CreditAuditError as err:
        print(f"creditaudit: error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    except OSError as err:        # reading or writing a file: which one the errno says
        import errno
        where = f" {err.filename}" if getattr(err, "filename", None) else ""
        if errno.errorcode.get(err.errno) in _WRITE_ERRNOS:    # a full disk or a read-only one
            print(f"creditaudit: error: cannot write{where} ({err.strerror or err}); finished runs "
                  "are saved — free space or fix permissions, then run the same command again",
                  file=sys.stderr)
        else:                     # no permission, a folder where a file should be, a bad path
            print(f"creditaudit: error: cannot read or write{where} ({err.strerror or err}); fix "
                  "the path or its permissions, then run the same command again", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("creditaudit: interrupted; finished work is saved — run the same command again to "
              "resume", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
