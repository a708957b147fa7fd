"""Run-epochs per second of a stack of N ResMLP runs against the same N runs trained serially.

Times blocks of `--steps` training steps (after `--warmup` untimed ones), alternating `--rounds`
times between
  * the stack: creditaudit.stacked.StackTrainer — one batched step of all N members, each member's
    batch drawn and augmented from its own data generator, exactly as `train_stack` does;
  * serial: one run's `method.train_step` (every run of the stack has the same shape and cost),
and extrapolates to run-epochs per second (N runs × steps per epoch) and to the wall time of
`--project-runs` runs × `--project-epochs` epochs (default 63 × 100) both ways. The per-epoch
monitor, evaluation and checkpoint (the same per run either way) are not timed.

    python benchmarks/gpu_throughput.py                                   # GPU: 63 runs, CIFAR-shaped
    python benchmarks/gpu_throughput.py --runs 4 --steps 20              # CPU smoke test
    python benchmarks/gpu_throughput.py --device cpu --shape mnist1d --runs 12 --threads 1

Data: `--shape cifar` = 50,000 random uint8 3×32×32 images with crop+flip augmentation (CIFAR
pipeline); `--shape mnist1d` = 4,000 random 40-dim float features (the quick audit's input).
The members are seeds 0 … N−1 of `--method` with every block training (the costliest member).
The last line is `stack_speedup=<stacked run-epochs/s ÷ serial run-epochs/s>`.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from creditaudit.config import RunConfig
from creditaudit.data import ArrayDataset
from creditaudit.runs import build_method, build_model, resolve_device
from creditaudit.seeding import derived_generator
from creditaudit.stacked import STACKABLE_METHODS, StackTrainer

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


def random_data(shape: str, n: int, device: torch.device) -> ArrayDataset:
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 10, (n,), generator=g)
    if shape == "cifar":
        images = torch.randint(0, 256, (n, 3, 32, 32), generator=g, dtype=torch.uint8)
        stat = lambda v: torch.tensor(v).view(3, 1, 1)
        return ArrayDataset("cifar10", images, labels, images[:1000], labels[:1000], n_classes=10,
                            mean=stat(CIFAR_MEAN), std=stat(CIFAR_STD), augment=True).to(device)
    x = torch.randn(n, 40, generator=g)
    return ArrayDataset("mnist1d", x, labels, x[:1000], labels[:1000], n_classes=10).to(device)


def batches_forever(data: ArrayDataset, batch: int, gen: torch.Generator):
    while True:
        for xb, yb in data.train_batches(batch, gen):
            if len(yb) == batch:
                yield xb, yb


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stacked_step(configs, data, device):
    """One stacked step of all members (StackTrainer, each member's own data stream)."""
    models = [build_model(c, data.input_shape, data.n_classes).to(device) for c in configs]
    methods = [build_method(c, m) for c, m in zip(configs, models)]
    trainer = StackTrainer(configs, models, methods, device)
    streams = [batches_forever(data, configs[0].batch_size, derived_generator(c.seed, "data"))
               for c in configs]

    def one():
        batch = [next(s) for s in streams]
        trainer.train_step(torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch]))
    return one


def serial_step(config, data, device):
    """One step of one serial run."""
    model = build_model(config, data.input_shape, data.n_classes).to(device)
    method = build_method(config, model)
    stream = batches_forever(data, config.batch_size, derived_generator(config.seed, "data"))

    def one():
        method.train_step(*next(stream))
    return one


def time_both(stack_one, serial_one, device, steps, warmup, rounds) -> tuple[float, float]:
    """Seconds per step of each, medians over `rounds` alternating blocks of `steps` (alternating,
    so a busy shared machine slows both alike)."""
    for one in (stack_one, serial_one):
        for _ in range(warmup):
            one()
    times: tuple[list, list] = ([], [])
    for _ in range(rounds):
        for one, out in zip((stack_one, serial_one), times):
            sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                one()
            sync(device)
            out.append((time.perf_counter() - t0) / steps)
    return statistics.median(times[0]), statistics.median(times[1])


def hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=63, help="members of the stack (N)")
    ap.add_argument("--method", default="bp", choices=STACKABLE_METHODS)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--shape", choices=("cifar", "mnist1d"), default="cifar")
    ap.add_argument("--n-train", type=int, default=None, help="default 50000 (cifar) / 4000 (mnist1d)")
    ap.add_argument("--steps", type=int, default=50, help="timed steps per block")
    ap.add_argument("--rounds", type=int, default=3, help="alternating stacked/serial blocks (median)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", default="auto", help="auto (cuda if present, else cpu), cpu, cuda")
    ap.add_argument("--threads", type=int, default=None, help="CPU intra-op threads")
    ap.add_argument("--project-runs", type=int, default=63)
    ap.add_argument("--project-epochs", type=int, default=100)
    args = ap.parse_args(argv)

    device = resolve_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    n_train = args.n_train or (50_000 if args.shape == "cifar" else 4_000)
    data = random_data(args.shape, n_train, device)
    base = RunConfig(method=args.method, dataset=data.name, width=args.width, blocks=args.blocks,
                     batch_size=args.batch, epochs=args.project_epochs)
    configs = [base.replace(seed=s) for s in range(args.runs)]
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"CPU, {torch.get_num_threads()} thread(s)")
    if device.type != "cuda":
        print("NOTE: this is a CPU measurement, NOT a GPU measurement (no CUDA device used).")
    print(f"device: {where}; {args.method}, ResMLP d={args.width} L={args.blocks}, batch {args.batch}, "
          f"{args.shape}-shaped input {tuple(data.input_shape)}, {n_train} train samples, N={args.runs}")

    steps_per_epoch = math.ceil(n_train / args.batch)
    t_stack, t_serial = time_both(stacked_step(configs, data, device),
                                  serial_step(configs[0], data, device), device, args.steps,
                                  args.warmup, args.rounds)
    stacked_rate = args.runs / (t_stack * steps_per_epoch)          # run-epochs per second
    serial_rate = 1.0 / (t_serial * steps_per_epoch)
    total = args.project_runs * args.project_epochs
    print(f"stacked: {t_stack * 1e3:.2f} ms per step of {args.runs} runs "
          f"({args.runs / t_stack:.1f} run-steps/s) = {stacked_rate:.3f} run-epochs/s")
    print(f"serial:  {t_serial * 1e3:.2f} ms per step of 1 run "
          f"({1 / t_serial:.1f} run-steps/s) = {serial_rate:.3f} run-epochs/s")
    print(f"projected {args.project_runs} runs × {args.project_epochs} epochs "
          f"({steps_per_epoch} steps/epoch, training steps only): "
          f"stacked {hours(total / stacked_rate)}, serial {hours(total / serial_rate)}")
    print(f"stack_speedup={stacked_rate / serial_rate:.2f}")


if __name__ == "__main__":
    main()
