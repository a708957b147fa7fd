"""Epoch speed of creditaudit's own training loop against the research-script yardstick.

Times one training epoch of the project's loop — whole dataset as one uint8 tensor, batched crop +
flip augmentation, the method plug-in's `train_step` — on CIFAR-shaped data (50,000 random
3×32×32 images, default ResMLP d=256 L=4, batch 128), and one epoch of
`../shared/bench/seed_style.py` (per-sample PIL pipeline behind a 2-worker DataLoader) in the same
run, alternating the two, `--repeats` times each. Both see random images, so only speed means
anything. The last line is the ratio of the medians:

    python benchmarks/epoch_speed.py --method bp
    ...
    speedup_vs_seed_style=<ratio>

The yardstick only knows bp and dfa; for any other method the ratio is taken against its dfa
epoch (the closest local-learning loop) and the line says so.
"""
from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from creditaudit.config import RunConfig
from creditaudit.data import ArrayDataset
from creditaudit.runs import build_method, build_model, resolve_device
from creditaudit.seeding import derived_generator

REPO = Path(__file__).resolve().parents[1]
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


def random_cifar(n: int, device: torch.device) -> ArrayDataset:
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, 3, 32, 32), generator=g, dtype=torch.uint8)
    labels = torch.randint(0, 10, (n,), generator=g)
    stat = lambda v: torch.tensor(v).view(3, 1, 1)
    return ArrayDataset("cifar10", images, labels, images[:1000], labels[:1000], n_classes=10,
                        mean=stat(CIFAR_MEAN), std=stat(CIFAR_STD), augment=True).to(device)


def own_epoch(method_name: str, data: ArrayDataset, device: torch.device) -> float:
    """Seconds for one training epoch of the project's loop (model and method built fresh)."""
    config = RunConfig(method=method_name, dataset="cifar10", epochs=1)   # dfa-penalty: λ = 1e-2
    model = build_model(config, data.input_shape, data.n_classes).to(device)
    method = build_method(config, model)
    gen = derived_generator(0, "data")
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    total = torch.zeros((), device=device)
    for x, y in data.train_batches(config.batch_size, gen):
        total += method.train_step(x, y)
    float(total)  # waits for the device
    return time.perf_counter() - t0


def seed_style_epoch(method: str, n: int, yardstick: Path) -> float:
    out = subprocess.run([sys.executable, str(yardstick), "--method", method, "--epochs", "1",
                          "--n", str(n)], capture_output=True, text=True, check=True).stdout
    match = re.search(r"s_per_epoch=([0-9.]+)", out)
    if not match:
        raise RuntimeError(f"unexpected yardstick output: {out!r}")
    return float(match.group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="bp")
    p.add_argument("--n", type=int, default=50000, help="images per epoch (default 50,000)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--yardstick", type=Path, default=REPO.parent / "shared" / "bench" / "seed_style.py")
    args = p.parse_args()
    device = resolve_device(args.device)
    yard_method = args.method if args.method in ("bp", "dfa") else "dfa"
    data = random_cifar(args.n, device)
    own_epoch(args.method, random_cifar(512, device), device)  # warm-up: allocations, kernel choice
    ours, theirs = [], []
    for r in range(args.repeats):
        ours.append(own_epoch(args.method, data, device))
        theirs.append(seed_style_epoch(yard_method, args.n, args.yardstick))
        print(f"repeat {r + 1}: creditaudit {args.method} {ours[-1]:.2f} s/epoch | "
              f"seed_style {yard_method} {theirs[-1]:.2f} s/epoch", flush=True)
    mine, yard = statistics.median(ours), statistics.median(theirs)
    print(f"creditaudit {args.method} s_per_epoch={mine:.3f} ({device}, torch threads "
          f"{torch.get_num_threads()}); seed_style {yard_method} s_per_epoch={yard:.3f}")
    if yard_method != args.method:
        print(f"(the yardstick has no {args.method}; ratio against its {yard_method} epoch)")
    print(f"speedup_vs_seed_style={yard / mine:.2f}")


if __name__ == "__main__":
    main()
