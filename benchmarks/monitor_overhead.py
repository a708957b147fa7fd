"""What the Monitor adds to an epoch of a user's own loop, at its default cadence (one line per epoch).

A plain PyTorch BP loop (AdamW, batch 128) on CIFAR-shaped random data (default 50,000 3×32×32
inputs, the paper's ResMLP d=256 L=4) that computes its test accuracy on 1,000 samples each epoch,
timed with and without `creditaudit.Monitor` (step() per batch; epoch_end() with the loop's own test
accuracy: the monitor line on one 128-sample batch, a checkpoint with the initial weights, the
metrics line). The two variants alternate, `--repeats` epochs each, on fresh models. Printed: the
ratio of the median epoch times (A/B: on a shared machine it carries the load's noise), and the
time spent inside the Monitor's calls per epoch (timed directly) over the plain epoch; the last
line is the A/B ratio:

    python benchmarks/monitor_overhead.py                 # CPU
    python benchmarks/monitor_overhead.py --device cuda
    ...
    monitor_overhead_ratio=<monitored / plain>
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import creditaudit


def random_data(n: int, device: torch.device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n + 1000, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (n + 1000,), generator=g)
    return x[:n].to(device), y[:n].to(device), x[n:].to(device), y[n:].to(device)


def epoch(model, opt, data, batch: int, mon=None, inside: list | None = None) -> float:
    """Seconds for one epoch of the user's loop (train + its own test accuracy); with a Monitor,
    the seconds spent inside its calls are appended to `inside`."""
    x, y, xt, yt = data
    dev = x.device
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    spent = 0.0
    order = torch.randperm(len(y), device=dev)
    model.train()
    for i in range(0, len(y), batch):
        idx = order[i:i + batch]
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if mon is not None:
            t1 = time.perf_counter()
            mon.step(loss, len(idx))
            spent += time.perf_counter() - t1
    model.eval()
    with torch.no_grad():
        acc = float((model(xt).argmax(-1) == yt).float().mean())
    if mon is not None:
        t1 = time.perf_counter()
        mon.epoch_end(test_acc=acc)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        spent += time.perf_counter() - t1
        if inside is not None:
            inside.append(spent)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def overhead(n: int, device: torch.device, repeats: int, width: int, blocks: int,
             batch: int = 128) -> tuple[float, float, float]:
    """(median plain epoch, median monitored epoch, median seconds inside the Monitor per epoch),
    alternating the two loops."""
    data = random_data(n, device)
    plain, monitored, inside = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        make = lambda: creditaudit.ResidualMLP(3 * 32 * 32, d=width, n_blocks=blocks).to(device)
        m_plain, m_mon = make(), make()
        o_plain = torch.optim.AdamW(m_plain.parameters(), 1e-3)
        o_mon = torch.optim.AdamW(m_mon.parameters(), 1e-3)
        mon = creditaudit.Monitor(m_mon, (data[2][:128], data[3][:128]), Path(tmp) / "run",
                                  epochs=repeats + 1)
        epoch(m_plain, o_plain, data, batch)            # warm-up of both (allocator, kernels)
        epoch(m_mon, o_mon, data, batch, mon)
        for _ in range(repeats):
            plain.append(epoch(m_plain, o_plain, data, batch))
            monitored.append(epoch(m_mon, o_mon, data, batch, mon, inside))
        mon.finish()
    return statistics.median(plain), statistics.median(monitored), statistics.median(inside)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--n-train", type=int, default=50_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    plain, monitored, inside = overhead(args.n_train, device, args.repeats, args.width, args.blocks)
    print(f"device {device}, {args.n_train} samples, ResMLP d={args.width} L={args.blocks}, batch 128, "
          f"threads {torch.get_num_threads()}")
    print(f"plain epoch {plain:.3f} s, monitored epoch {monitored:.3f} s (medians of {args.repeats})")
    print(f"inside the Monitor: {inside:.3f} s per epoch = {100 * inside / plain:.1f} % of the plain epoch")
    print(f"monitor_overhead_ratio={monitored / plain:.3f}")


if __name__ == "__main__":
    main()
