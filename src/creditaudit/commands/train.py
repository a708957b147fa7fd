"""`creditaudit train`: one run into a run folder (resumed if interrupted)."""
from __future__ import annotations

from pathlib import Path

from ..errors import CreditAuditError
from .exits import EXIT_INCOMPLETE
from .running import compile_step, given_once, locked_out, set_threads, train_or_record


def _run_config(args):
    from ..config import PENALTY_OPTION, RunConfig
    if args.blocks < 1:
        raise CreditAuditError(f"--blocks must be ≥ 1, got {args.blocks}; for the control without "
                               "blocks use --shallow")
    options = given_once(args.option, "--option")
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
                     arch_options=given_once(args.arch_option, "--arch-option"), precision=args.precision)


def _refuse_unread_clip(args, config) -> None:
    """`--clip` given to a rule whose step clips nothing would change nothing: refused in one line."""
    from ..methods import METHODS, method_class
    cls = method_class(config.method)
    if "clip" in getattr(args, "_given_options", set()) and not cls.clips(config.options):
        clipping = ", ".join(n for n, c in METHODS.items() if c.reads_clip)
        raise CreditAuditError(f"{config.method} clips nothing, so --clip would change nothing; drop it "
                               f"(the rules that clip per block, under some option at least: {clipping})")


def cmd_train(args) -> int:
    from ..data import load_dataset
    from ..runs import refuse_foreign_folder_for_run, resolve_device
    from ..train import train_run
    from ..verdict import Thresholds, first_fire_epochs, stop_rule
    config = _run_config(args)
    _refuse_unread_clip(args, config)
    if args.tensorboard is not None:          # refused now, not after the training it would log
        from ..trackers import check_log_dir
        check_log_dir(args.tensorboard)
    set_threads(args)
    data = load_dataset(config.dataset, args.data_dir, "cpu", label_probe=not args.no_label_probe)
    config = config.bind_data(data.digest)      # the default folder's key names the data too
    out = Path(args.out or f"runs/{config.method.replace(':', '_')}-{config.dataset}-s{config.seed}-{config.run_key}")
    device = resolve_device(args.device)      # a bad device is refused before any folder is made
    refuse_foreign_folder_for_run(out)
    tensorboard = None
    try:
        with locked_out(out, stub="config.json"):   # a second `train` here is refused, as for audits
            if args.tensorboard is not None:
                from ..trackers import TensorBoardLog
                tensorboard = TensorBoardLog(args.tensorboard)
            run = train_or_record(
                train_run, config, out, data=data, device=device, progress=not args.quiet,
                stop_rule=stop_rule(config.stop_when_flagged, Thresholds(**config.stop_thresholds)),
                on_epoch=tensorboard, compile_step=compile_step(args))
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
    if run.status["status"] == "diverged" and fired.get("a") is None:
        # the verdict reads a diverged run as (a) EXPLODED (verdict.py): the terminal says the same
        fired["a"] = f"epoch {run.epochs_completed + 1} (diverged)"
    print("  monitor first fired: " + ", ".join(
        f"({k.replace('_prime', '′')}) {'never' if v is None else v if isinstance(v, str) else f'epoch {v}'}"
        for k, v in fired.items()))
    print(f"  data: {data.describe()}")
    print(f"  run folder: {out}")
    return 0
