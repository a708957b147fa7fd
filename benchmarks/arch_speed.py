"""Epoch time of each architecture under BP on CIFAR-shaped data, on the CPU.

One BP epoch = 50,000 random 3×32×32 uint8 images, batch 128 (391 steps), the dataset's own
batched crop + flip augmentation and normalisation, `BP.train_step` (AdamW) on a model from
`creditaudit.model.build_model` — built and trained directly, not through the trainer. By default
`--batches 40` steps are timed (wall clock) after `--warmup` untimed ones and the epoch time is extrapolated
(×391/40); `--batches 0` times the whole epoch. Models: resmlp d=256 L=4, vit-mini and
resnet-small at their defaults (d=256 L=4 4 heads patch 4 MLP ratio 2; width 64 L=4).
The line also gives the process CPU seconds per step and the 1-minute load average before and after
each model: on a shared machine a load above the thread count means the wall times are inflated.

    python benchmarks/arch_speed.py                 # torch.set_num_threads(2)
    python benchmarks/arch_speed.py --batches 0     # full epochs
"""
from __future__ import annotations

import argparse
import math
import os
import time

import torch

from creditaudit.data import ArrayDataset
from creditaudit.methods import MethodSettings, method_class
from creditaudit.model import build_model

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
MODELS = {"resmlp": dict(width=256, blocks=4), "vit-mini": dict(width=256, blocks=4),
          "resnet-small": dict(width=64, blocks=4)}


def random_cifar(n: int) -> ArrayDataset:
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, 3, 32, 32), generator=g, dtype=torch.uint8)
    labels = torch.randint(0, 10, (n,), generator=g)
    stat = lambda v: torch.tensor(v).view(3, 1, 1)
    return ArrayDataset("cifar10", images, labels, images[:1000], labels[:1000], n_classes=10,
                        mean=stat(CIFAR_MEAN), std=stat(CIFAR_STD), augment=True)


def step_seconds(arch: str, data: ArrayDataset, batch: int, batches: int, warmup: int) -> tuple[float, int]:
    """(wall s/step, process CPU s/step, steps timed); batches ≤ 0 times the rest of the epoch."""
    torch.manual_seed(0)
    model = build_model(arch, data.input_shape, data.n_classes, **MODELS[arch])
    bp = method_class("bp")(model, MethodSettings(epochs=1, trainable_blocks=tuple(range(model.n_blocks))))
    steps = math.ceil(len(data.y_train) / batch)
    gen = torch.Generator().manual_seed(0)
    it = data.train_batches(batch, gen)
    for _ in range(warmup):
        bp.train_step(*next(it))
    timed = steps - warmup if batches <= 0 else min(batches, steps - warmup)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(timed):
        bp.train_step(*next(it))
    return (time.perf_counter() - t0) / timed, (time.process_time() - c0) / timed, timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--batches", type=int, default=40, help="steps to time (0 = the whole epoch)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--archs", nargs="*", default=list(MODELS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    data = random_cifar(50_000)
    steps = math.ceil(len(data.y_train) / args.batch)
    print(f"torch {torch.__version__}, CPU, {torch.get_num_threads()} threads, 50,000 images 3×32×32, "
          f"batch {args.batch} ({steps} steps/epoch), BP")
    print(f"{'arch':<14}{'params':>10}{'stream':>16}{'ms/step':>10}{'epoch s':>10}{'cpu ms/step':>13}"
          f"{'load':>12}  note")
    for arch in args.archs:
        torch.manual_seed(0)
        model = build_model(arch, data.input_shape, data.n_classes, **MODELS[arch])
        n_params = sum(p.numel() for p in model.parameters())
        load0 = os.getloadavg()[0]
        per_step, cpu_step, timed = step_seconds(arch, data, args.batch, args.batches, args.warmup)
        load = f"{load0:.1f}→{os.getloadavg()[0]:.1f}"
        note = (f"extrapolated: {timed} timed steps × {steps}/{timed}" if timed < steps - args.warmup
                else f"whole epoch timed ({timed} steps after {args.warmup} warm-up, scaled to {steps})")
        print(f"{arch:<14}{n_params:>10,}{str(model.stream_shape):>16}{1000 * per_step:>10.1f}"
              f"{per_step * steps:>10.1f}{1000 * cpu_step:>13.1f}{load:>12}  {note}")


if __name__ == "__main__":
    main()
