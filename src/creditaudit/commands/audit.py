"""`creditaudit audit`: the settings (preset or TOML, then the command line's overrides), the audit,
its report and what to do next."""
from __future__ import annotations

import contextlib
import copy
import shutil
import sys
import textwrap
from pathlib import Path
from typing import Iterator

from ..errors import CreditAuditError
from .exits import EXIT_INCOMPLETE, failed_runs_advice
from .running import compile_step, locked_out, write_report_together


# the top-level keys a flag of the same name replaces
_TOP_FLAGS = ("dataset", "epochs", "out", "device", "data_dir", "jobs", "eval_batches", "executor", "address",
              "max_retries", "stack", "recipe")


def _audit_raw(args) -> dict:
    """The audit's settings: preset or TOML file, then command-line overrides. A file's value that
    a flag overrides is still checked (`_check_overridden`): the file must stand on its own, or
    the next command without the flag would fail on it, or run something else than the file says."""
    from ..config import PRESET_NAMES, load_audit_toml
    raw = load_audit_toml(args.config) if args.config else {"preset": args.preset or PRESET_NAMES[0]}
    file = copy.deepcopy(raw) if args.config else {}
    if args.config and args.preset:
        raw["preset"] = args.preset
    for key in _TOP_FLAGS:
        value = getattr(args, key, None)
        if value is not None:
            raw[key] = value
    if getattr(args, "methods", None):
        raw["methods"] = [m for item in args.methods for m in item.replace(",", " ").split()]
    if args.seeds:
        raw["seeds"] = args.seeds
    for section, flags in (("model", ("arch", "width", "blocks", "arch_option")), ("training", ("lr",))):
        given = [f for f in flags if getattr(args, f, None) not in (None, [])]
        if given and not isinstance(raw.get(section, {}), dict):    # a flag merges into the table
            _not_a_table(section, raw[section], given[0], where=args.config or "the audit settings")
    if getattr(args, "arch", None):
        raw.setdefault("model", {})["arch"] = args.arch
    if args.blocks is not None and args.blocks < 1:
        raise CreditAuditError(f"--blocks must be ≥ 1, got {args.blocks}; the audit trains the shallow "
                               "control (no blocks) itself")
    for section, key in (("model", "width"), ("model", "blocks"), ("training", "lr")):
        if getattr(args, key) is not None:      # as [model] width / blocks and [training] lr say it
            raw[section] = {**raw.get(section, {}), key: getattr(args, key)}
    if getattr(args, "arch_option", None):      # as [model.options] says it; a key given twice refused
        from .running import given_once
        model = raw.setdefault("model", {})
        options = model.get("options", {})
        if not isinstance(options, dict):
            raise CreditAuditError(f"options in [model] of {args.config} must be a table of architecture "
                                   f"options ([model.options]), got {options!r}")
        model["options"] = {**options, **given_once(args.arch_option, "--arch-option")}
    from ..runs import resolve_device
    if args.config and getattr(args, "device", None) is not None and "device" in file:
        resolve_device(file["device"])               # the file's own, which --device overrides
    raw["device"] = str(resolve_device(raw.get("device", "auto")))   # "auto" is decided here, once
    _check_overridden(raw, file, args)
    return raw


# the file's keys a flag replaces: (flag, table or None, key); the device is checked apart, before
# "auto" is resolved
_OVERRIDES = tuple((key, None, key) for key in _TOP_FLAGS + ("methods", "seeds") if key != "device") + (
    ("arch", "model", "arch"), ("width", "model", "width"), ("blocks", "model", "blocks"), ("lr", "training", "lr"))


def _check_overridden(raw: dict, file: dict, args) -> None:
    """Validate each value of the config file that a flag replaces, as the file would run with the
    rest of this command: `--epochs 3` over `epochs = -5` refuses the file's -5, naming the fix."""
    from ..config import audit_config_from_dict
    hidden = [(flag, table, key, source[key]) for flag, table, key in _OVERRIDES
              for source in [file.get(table) if table else file]
              if isinstance(source, dict) and key in source and getattr(args, flag, None) not in (None, [])]
    if hidden:
        audit_config_from_dict(raw, where=str(args.config))   # what runs first: its own errors as they are
    for flag, table, key, value in hidden:
        trial = copy.deepcopy(raw)
        if table:
            trial[table] = {**trial.get(table, {}), key: value}
        else:
            trial[key] = value
        try:
            audit_config_from_dict(trial, where=str(args.config))
        except CreditAuditError as err:
            raise CreditAuditError(f"{err} (--{flag.replace('_', '-')} overrides it on this command "
                                   f"line, but {args.config} must hold valid values: fix or remove "
                                   "it)") from None


def _not_a_table(section: str, value, flag: str, where: str) -> None:
    raise CreditAuditError(f"[{section}] in {where} must be a table, got {value!r}; write it as a "
                           f"[{section}] table (or remove it and give --{flag.replace('_', '-')})")


def _what_ran(args, config) -> str:
    """The header's account of the settings: "preset quick", "preset quick + --methods, --seeds,
    --epochs", "examples/my.toml + --seeds": what actually ran, not only where it started."""
    preset = f"preset {config.preset}" if config.preset else None
    if args.config:
        base = f"{args.config} ({preset})" if preset else str(args.config)
    else:                 # without a file the preset is always named (quick by default)
        base = str(preset)
    given = [f"--{key.replace('_', '-')}" for key in ("methods", "seeds", "epochs", "dataset", "arch",
                                                      "width", "blocks", "lr", "option", "arch_option",
                                                      "eval_batches")
             if getattr(args, key, None)]
    return " + ".join([base, *([", ".join(given)] if given else [])])


def _require_schedule(args, raw: dict) -> None:
    """A config file without a preset must say how long to train (checked after its keys are
    validated): an empty one must not start the default schedule, 100 epochs per run, silently."""
    if args.config and "preset" not in raw and "epochs" not in raw:
        raise CreditAuditError(f"{args.config} sets neither epochs nor a preset; add epochs = 15 (or "
                               'preset = "quick") to it, or pass --epochs N')


def cmd_audit(args) -> int:
    from ..config import audit_config_from_dict, with_method_options
    raw = _audit_raw(args)
    raw = with_method_options(raw, args.option, where=args.config or "the audit settings")
    config = audit_config_from_dict(raw, where=args.config or "the audit settings")
    _require_schedule(args, raw)
    return run_audit(args, config, _what_ran(args, config))


@contextlib.contextmanager
def _workers_kept() -> Iterator[list]:
    """A list for `audit` to leave its worker pool open in (its `keep_workers`), so that the report
    draws its figures there; every pool in it is closed when the block ends, however it ends."""
    pool: list = []
    try:
        yield pool
    finally:
        for executor in pool:
            close = getattr(executor, "close", None)
            if close is not None:
                close()


def _import_what_follows() -> None:
    """Import, while the runs train, what the audit needs once they have: scipy's statistics for
    (d) and matplotlib for the figures (about 2 s on a 2-core CPU). The driver only waits then;
    after training it works alone while the workers wait."""
    import scipy.stats  # noqa: F401

    from ..report import figures  # noqa: F401


def run_audit(args, config, what_ran: str, reproduction: dict | None = None,
              extra_lines=lambda result: []) -> int:
    """Train, diagnose and report the audit `config` (the trackers and the terminal as the
    command line asked), and return the exit status: 0 complete, 3 not. `reproduction`: the
    paper's setting (`creditaudit reproduce`), sealed into audit.json; `extra_lines(result)`: lines
    the terminal prints after the table."""
    from ..experiments import audit
    from ..report import compact_table, write_report
    from ..report.tables import schedule_line, work_done
    from ..runner.local import LocalExecutor
    from ..verdict import Thresholds, verdict_of
    if args.tensorboard is not None:          # refused now, not after the audit it would log
        from ..trackers import check_log_dir
        check_log_dir(args.tensorboard)
    if args.tracker:                          # the same: a missing extra or bad folder, now
        from ..trackers import check_trackers
        check_trackers(args.tracker)
    from ..report.tables import plural
    n_runs = len(config.run_configs())
    width = max(60, shutil.get_terminal_size((120, 24)).columns)   # COLUMNS, else the terminal's
    print(textwrap.fill(f"creditaudit {args.command} ({what_ran}): {plural(len(config.methods), 'method')} "
                        f"× {plural(len(config.seeds), 'seed')} → {plural(n_runs, 'run')} → {config.out}",
                        width, subsequent_indent="    ", break_on_hyphens=False))
    with locked_out(Path(config.out)), _workers_kept() as pool:
        result = audit(config, progress=not args.quiet, compile_step=compile_step(args),
                       label_probe=not args.no_label_probe, reproduction=reproduction,
                       while_training=_import_what_follows, keep_workers=pool)
        # workers already up on this machine (not Ray's: a figure is no cluster task; not a pool a
        # dying worker broke, which a map would start again)
        local = [ex for ex in pool if isinstance(ex, LocalExecutor) and ex.running]
        files = write_report_together(write_report, result, Path(config.out), local[0] if local else None)
    if args.tensorboard is not None:  # every run's monitor history, one log folder per run
        from ..trackers import log_runs
        log_runs(result["runs"], args.tensorboard, Thresholds(**config.thresholds))
    if args.tracker:                  # one tracker run per run folder, its verdict at the end
        from ..trackers import log_judged_runs
        log_judged_runs(result, args.tracker, args.tracker_project or Path(config.out).name,
                        Thresholds(**config.thresholds))
    print()
    print(compact_table(result, width=width, out=str(config.out)))
    for line in extra_lines(result):
        print(textwrap.fill(line, width, subsequent_indent="      ", break_long_words=False))
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
        parts.append(failed_runs_advice(failed, "audit.md"))
    if incomplete:
        parts.append(f"incomplete verdict for {', '.join(incomplete)}: evidence missing or "
                     "undetermined (see 'missing' under Reasons in audit.md)")
    if parts:
        print("creditaudit: " + "; ".join(parts) + " — exit status 3: the audit is not complete "
              "(0 = complete; `creditaudit check` gives the verdicts' status)", file=sys.stderr)
    if failed or incomplete:
        return EXIT_INCOMPLETE
    return 0


def experiment_config(args, methods: list[str] | None = None):
    from ..config import audit_config_from_dict, with_method_options
    raw = _audit_raw(args)
    if methods is not None:
        raw["methods"] = methods
    raw = with_method_options(raw, args.option, where=args.config or "the settings")
    config = audit_config_from_dict(raw, where=args.config or "the settings")
    _require_schedule(args, raw)
    return config
