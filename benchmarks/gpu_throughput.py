"""Training-step throughput of every method × architecture, and the projected paper reproduction.

For each architecture (`--archs`) and method (`--methods`, default every built-in one) this times
`--steps` training steps of one run (after `--warmup` untimed ones, median over `--rounds`
blocks), exactly as the trainer runs them (`train.step_runner`: the step compiled into CUDA graphs
on a GPU unless --no-compile, eager on a CPU), and prints per row

  * ms/step        wall time of one step of one run;
  * GPU busy       fraction of that wall time the GPU spends in kernels (torch.profiler over one
                   block of steps; the profiler's own overhead makes it a lower bound), with the
                   kernels launched per step; "n/a (no CUDA)" on a CPU;
  * stacked        run-epochs/s of a stack of `--runs` members (methods.members.MemberStack, the
                   one trainer's step) where the method is on the member axis for the
                   architecture (ResMLP × bp, fa, dfa, dfa-penalty), against the lone rate; "—"
                   elsewhere (those runs train as stacks of one).

Then the projected wall time of the paper's reproduction on this device: `--project-seeds` seeds ×
(main run + frozen + shallow control) of every timed ResMLP method × `--project-epochs` epochs of
`--n-train` samples, each run at its stacked rate where it stacks, else its serial rate (training
steps only; every control costed as its main run, an upper bound).

    python benchmarks/gpu_throughput.py                                  # GPU: paper sizes
    python benchmarks/gpu_throughput.py --width 32 --blocks 2 --n-train 2048 --steps 5 --runs 4
    python benchmarks/gpu_throughput.py --archs resmlp --methods bp dfa --no-compile

Data: random CIFAR-shaped uint8 3×32×32 images with crop+flip augmentation (the CIFAR pipeline).
The last line is `projected_paper_reproduction=<time>`.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from creditaudit.config import RunConfig
from creditaudit.data import ArrayDataset
from creditaudit.methods import METHODS
from creditaudit.model import ARCHITECTURES
from creditaudit.runs import build_method, build_model, resolve_device
from creditaudit.seeding import derived_generator
from creditaudit.methods.members import MemberStack
from creditaudit.train import can_stack, compile_mode_for, precision_context, step_runner

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
ARCH_OPTIONS = {"vit-mini": {"heads": 4, "patch": 4}}


def random_data(n: int, device: torch.device) -> ArrayDataset:
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.randint(0, 256, (n, 3, 32, 32), generator=g, dtype=torch.uint8)
    stat = lambda v: torch.tensor(v).view(3, 1, 1)
    return ArrayDataset("cifar10", images, labels, images[:1000], labels[:1000], n_classes=10,
                        mean=stat(CIFAR_MEAN), std=stat(CIFAR_STD), augment=True).to(device)


def batches_forever(data: ArrayDataset, batch: int, gen: torch.Generator):
    while True:
        for xb, yb in data.train_batches(batch, gen):
            if len(yb) == batch:
                yield xb, yb


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def serial_step(config: RunConfig, data: ArrayDataset, device: torch.device, compile_step):
    """One training step of one run, as the trainer runs it."""
    model = build_model(config, data.input_shape, data.n_classes).to(device)
    method = build_method(config, model)
    step = step_runner(method, compile_mode_for(device, compile_step))
    stream = batches_forever(data, config.batch_size, derived_generator(config.seed, "data"))

    def one():
        step(*next(stream))
    return one


def stacked_step(configs, data, device, compile_step):
    """One step of all members as one stack (MemberStack, each member's own data stream), compiled
    as the trainer compiles it."""
    models = [build_model(c, data.input_shape, data.n_classes).to(device) for c in configs]
    stack = MemberStack([build_method(c, m) for c, m in zip(configs, models)])
    mode = compile_mode_for(device, compile_step)
    step = stack.step_function(fallback=True, mode=mode) if mode is not None else stack.train_step
    streams = [batches_forever(data, configs[0].batch_size, derived_generator(c.seed, "data"))
               for c in configs]

    def one():
        batch = [next(s) for s in streams]
        step(torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch]))
    return one


def seconds_per_step(one, device, steps: int, warmup: int, rounds: int) -> float:
    with precision_context("fp32", device):
        for _ in range(warmup):
            one()
        times = []
        for _ in range(rounds):
            sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                one()
            sync(device)
            times.append((time.perf_counter() - t0) / steps)
    return statistics.median(times)


def gpu_busy(one, device, steps: int) -> tuple[float, float] | None:
    """(kernel time ÷ wall time, kernels per step) over `steps` profiled steps; None off CUDA."""
    if device.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    with precision_context("fp32", device):
        sync(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                one()
            sync(device)
            wall = time.perf_counter() - t0
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    busy_us = sum(getattr(e, "self_device_time_total", None) or e.self_cuda_time_total for e in kernels)
    return busy_us * 1e-6 / wall, sum(e.count for e in kernels) / steps


def duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.1f} s"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", nargs="+", default=list(ARCHITECTURES), choices=list(ARCHITECTURES))
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--width", type=int, default=None, help="default 256 (resmlp, vit-mini) / 64 (resnet-small)")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--n-train", type=int, default=50_000, help="training samples (CIFAR-10: 50000)")
    ap.add_argument("--runs", type=int, default=21, help="members of a timed stack")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per block")
    ap.add_argument("--rounds", type=int, default=3, help="timed blocks (median)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens here)")
    ap.add_argument("--device", default="auto", help="auto (cuda if present, else cpu), cpu, cuda")
    ap.add_argument("--threads", type=int, default=None, help="CPU intra-op threads")
    ap.add_argument("--no-compile", action="store_true", help="time the eager step on CUDA too")
    ap.add_argument("--project-seeds", type=int, default=3)
    ap.add_argument("--project-epochs", type=int, default=100)
    args = ap.parse_args(argv)

    device = resolve_device(args.device)            # a script, like the command line: it decides
    if args.threads:
        torch.set_num_threads(args.threads)
    data = random_data(args.n_train, device)
    compile_step = False if args.no_compile else None
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"CPU, {torch.get_num_threads()} thread(s) — NOT a GPU measurement")
    mode = compile_mode_for(device, compile_step) or "eager"
    print(f"device: {where}; step: {mode}; batch {args.batch}; CIFAR-shaped input, "
          f"{args.n_train} train samples; L={args.blocks}")
    steps_per_epoch = math.ceil(args.n_train / args.batch)
    print(f"{'arch':<13}{'method':<12}{'ms/step':>9}  {'GPU busy':<22}{'stacked run-epochs/s':>22}"
          f"{'serial run-epochs/s':>21}")
    rates: dict[str, float] = {}
    for arch in args.archs:
        width = args.width or (64 if arch == "resnet-small" else 256)
        for name in args.methods:
            config = RunConfig(method=name, dataset="cifar10", arch=arch, width=width,
                               blocks=args.blocks, batch_size=args.batch, epochs=args.project_epochs,
                               arch_options=dict(ARCH_OPTIONS.get(arch, {})))
            one = serial_step(config, data, device, compile_step)
            t = seconds_per_step(one, device, args.steps, args.warmup, args.rounds)
            busy = gpu_busy(one, device, args.steps)
            busy_s = "n/a (no CUDA)" if busy is None else f"{busy[0]:.0%} ({busy[1]:.0f} kernels)"
            serial_rate = 1.0 / (t * steps_per_epoch)
            stacked_s, rate = "—", serial_rate
            if can_stack(config) and args.runs > 1:
                configs = [config.replace(seed=s) for s in range(args.runs)]
                ts = seconds_per_step(stacked_step(configs, data, device, compile_step), device, args.steps,
                                      args.warmup, args.rounds)
                rate = args.runs / (ts * steps_per_epoch)
                stacked_s = f"{rate:.3f} (N={args.runs})"
            if arch == "resmlp":
                rates[name] = max(rate, serial_rate)
            print(f"{arch:<13}{name:<12}{t * 1e3:>9.2f}  {busy_s:<22}{stacked_s:>22}{serial_rate:>21.3f}",
                  flush=True)
    if not rates:
        print("projected_paper_reproduction=n/a (no resmlp rows timed)")
        return
    runs_per_method = args.project_seeds * 3               # main run + frozen + shallow control
    total = sum(runs_per_method * args.project_epochs / r for r in rates.values())
    print(f"projection: {len(rates)} methods × {runs_per_method} runs × {args.project_epochs} epochs "
          f"× {steps_per_epoch} steps, ResMLP d={args.width or 256} L={args.blocks}, each at its best "
          f"rate above (training steps only; controls costed as main runs)")
    print(f"projected_paper_reproduction={duration(total)}")


if __name__ == "__main__":
    main()
