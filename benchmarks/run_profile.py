"""Where one quick-audit run's time goes, per method: the rule's steps, the per-epoch record (the
monitor on the fixed eval batch and the test set's per-example correctness), the alignment probe
(Γ of the credit, at the epochs `train._probes_alignment` picks), checkpoint writes, and the rest.

Each method's main run of the quick preset (MNIST-1D, ResMLP d=256 L=4, 15 epochs, its audit
options) and, with --controls, its frozen control, trains lone on one thread under cProfile, in
this process, into a temporary folder; the parts are cProfile's cumulative times of the functions
that do them, so they carry its overhead (read them as shares, not as absolute times).

    python benchmarks/run_profile.py                         # the seven methods' main runs
    python benchmarks/run_profile.py --methods bp ep --controls
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
from pathlib import Path

import torch

from creditaudit.config import audit_config_from_dict
from creditaudit.data import load_dataset
from creditaudit.train import keep_freed_host_memory, train_run

# (label, file suffix, function name) of each part, read from the profile's cumulative times
PARTS = (("steps", "methods/members.py", "train_step"),
         ("steps (lone)", "train.py", "guarded"),
         ("monitor", "metrics.py", "monitor_snapshot"),
         ("correctness", "metrics.py", "correctness"),
         ("alignment probe", "train.py", "_alignment"),
         ("checkpoint", "train.py", "_flush"),
         ("state copies", "store.py", "of"))


def cumulative(stats: pstats.Stats, suffix: str, name: str) -> float:
    return sum(row[3] for (path, _, func), row in stats.stats.items()
               if func == name and path.replace("\\", "/").endswith(suffix))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", default=None, help="default: the quick preset's")
    ap.add_argument("--controls", action="store_true", help="profile each method's frozen control too")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    keep_freed_host_memory()
    audit = audit_config_from_dict({"preset": "quick", **({"methods": args.methods} if args.methods else {})})
    data = load_dataset(audit.dataset)
    print(f"{'run':<22}{'total s':>9}" + "".join(f"{label:>16}" for label, *_ in PARTS[:1] + PARTS[2:])
          + f"{'rest':>9}")
    for method in audit.methods:
        base = audit.base_config(method, audit.seeds[0])
        configs = [base] + ([base.replace(trainable_blocks=0)] if args.controls else [])
        for config in configs:
            with tempfile.TemporaryDirectory(prefix="run_profile_") as tmp:
                prof = cProfile.Profile()
                prof.enable()
                train_run(config, Path(tmp) / "run", data=data, progress=False)
                prof.disable()
            stats = pstats.Stats(prof)
            total = cumulative(stats, "train.py", "train_run")
            parts = [cumulative(stats, suffix, name) for _, suffix, name in PARTS]
            parts = [parts[0] + parts[1]] + parts[2:]          # the steps, on the member axis or lone
            rest = total - sum(parts)
            print(f"{config.label:<22}{total:>9.2f}"
                  + "".join(f"{p:>9.2f} ({100 * p / total:>3.0f}%)" for p in parts) + f"{rest:>9.2f}")


if __name__ == "__main__":
    main()
