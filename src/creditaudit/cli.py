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
