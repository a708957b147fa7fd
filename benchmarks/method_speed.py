"""Training time of each credit-assignment method against BP, at one thread.

Trains BP, EP, SB, CB (and DFA for reference) on MNIST-1D with the quick audit's model (ResMLP
d=256, L=4, batch 128, AdamW defaults, seed 42) for `--epochs` epochs each, by calling
`method.train_step` over each epoch's batches (no trainer, no evaluation). sb and cb run with the
audit's λ = 1e-2. The methods are interleaved within each repeat (bp, ep, sb, cb, dfa, bp, ep, …)
so a busy shared machine slows them alike, and the median over `--repeats` is reported, as wall
seconds per epoch and as CPU (process) seconds per epoch — on a shared machine the CPU time does
not count waiting for a core, so its ratios are the steadier ones. The last lines are the wall
ratios:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/method_speed.py [--epochs 3] [--repeats 3]
    ...
    ep_over_bp=<ratio>
    cb_over_bp=<ratio>

Each method option can be overridden with --set ep.steps=3 (repeatable), to measure a knob.
The steps run with glibc's malloc keeping freed memory, as the trainer runs them
(`train.keep_freed_host_memory`); --malloc-default leaves malloc as it is. Measured (--epochs 2
--repeats 3, CPU-time ratios to BP, the 2-core box at load 6–8): keeping it, cb 2.15–2.25, ep
2.5–2.7, sb 2.4–2.6; the code before it, cb 3.0, ep 2.6–3.1, sb 2.9–3.1; BP's time unchanged.

--stack K also times, for each method on the member axis (methods.members.MemberStack: bp, fa,
dfa, dfa-penalty, ep, sb, cb on the ResMLP), K runs (seeds 42, 43, …) as one stack — each member with its own
data stream, the batches stacked (K, B, …) — against the same K runs one after another (the
lone step), interleaved in each repeat, and prints `<method>_stack<K>_over_lone=<ratio>` (stack
wall ÷ the K lone runs' wall; < 1: the stack is faster per run). Measured with the member axis
(--methods bp,fa,dfa --epochs 1 --repeats 3 --stack 4, one thread, the 2-core box at load 6.5):
bp 0.98, fa 0.88, dfa 0.86 — on a CPU the step is matmul-bound, so a stack saves little; with
--methods bp,ep,sb,cb at load ≈ 1.3–1.5: bp 0.95, ep 0.97, sb 0.98, cb 1.05.
Measured on the 2-core shared dev box, ratios to BP (BP ≈ 0.26 s/epoch), before (EP: 20 gradient
steps; CB: create_graph double backward, per-sample float64 noise) → after, at load ≈ 1:
ep 13.5 → 2.5 (steps 2; steps 3: 3.1–3.3), cb 5.3 → 2.6, sb 2.6 → 2.7 (unchanged code path),
dfa 1.2 → 1.2; under load 4–10 the CPU-time ratios were ep 13.3 → 2.4–2.5, cb 5.7 → 2.4–2.6.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from creditaudit.data import load_dataset
from creditaudit.methods import MethodSettings, method_class
from creditaudit.methods.members import MemberStack
from creditaudit.model import ResidualMLP
from creditaudit.seeding import derived_generator, seed_everything
from creditaudit.train import keep_freed_host_memory


def parse_sets(items: list[str]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for item in items:
        key, value = item.split("=", 1)
        method, option = key.split(".", 1)
        out.setdefault(method, {})[option] = float(value) if "." in value or "e" in value else int(value)
    return out


def timed_run(name: str, data, epochs: int, options: dict, seed: int = 42) -> tuple[float, float]:
    """(wall, CPU) seconds per epoch of `epochs` epochs of train_step for a freshly built model +
    method. The CPU (process) time is what the run itself computed: on a shared machine it does not
    count the time spent waiting for a core, so its ratios are steadier than the wall-clock ones."""
    method = build(name, data, epochs, options, seed)
    gen = derived_generator(seed, "data")
    t0, c0 = time.perf_counter(), time.process_time()
    total = torch.zeros(())
    for _ in range(epochs):
        for x, y in data.train_batches(128, gen):
            total += method.train_step(x, y)
        method.end_epoch()
        method.epoch_log()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert torch.isfinite(total), f"{name}: non-finite loss"
    return wall / epochs, cpu / epochs


def build(name: str, data, epochs: int, options: dict, seed: int):
    seed_everything(seed)
    model = ResidualMLP(data.d_in, d=256, n_blocks=4, n_classes=data.n_classes)
    return method_class(name)(model, MethodSettings(epochs=epochs, seed=seed,
                                                    trainable_blocks=(0, 1, 2, 3), options=options))


def timed_stack(name: str, data, epochs: int, options: dict, k: int) -> float:
    """Wall seconds per epoch of K runs (seeds 42 … 42+K−1) trained as one MemberStack."""
    stack = MemberStack([build(name, data, epochs, options, 42 + i) for i in range(k)])
    gens = [derived_generator(42 + i, "data") for i in range(k)]
    t0 = time.perf_counter()
    total = torch.zeros(k)
    for _ in range(epochs):
        for batches in zip(*(data.train_batches(128, g) for g in gens)):
            x, y = torch.stack([b[0] for b in batches]), torch.stack([b[1] for b in batches])
            total += stack.train_step(x, y)
        stack.sync()
        stack.end_epoch()
    wall = time.perf_counter() - t0
    assert torch.isfinite(total).all(), f"{name}: non-finite loss in the stack"
    return wall / epochs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--methods", default="bp,ep,sb,cb,dfa")
    p.add_argument("--set", action="append", default=[], help="method.option=value, e.g. ep.steps=10")
    p.add_argument("--stack", type=int, default=0, metavar="K",
                   help="also time K runs as one stack against K lone runs (member-axis methods)")
    p.add_argument("--malloc-default", action="store_true",
                   help="leave glibc's malloc as it is (the trainer keeps freed memory: "
                        "train.keep_freed_host_memory), to measure what that saves")
    args = p.parse_args()
    torch.set_num_threads(1)
    if not args.malloc_default:
        keep_freed_host_memory()             # as the trainer does (`train.train_runs`)
    data = load_dataset("mnist1d")
    names = args.methods.split(",")
    sets = parse_sets(args.set)
    lam = {"sb": 1e-2, "cb": 1e-2}            # the quick audit trains the bridges with λ = 1e-2
    options = {n: {**({"lam": lam[n]} if n in lam else {}), **sets.get(n, {})} for n in names}
    timed_run("bp", load_dataset("mnist1d"), 1, {})                # warm-up (allocator, kernels)
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.repeats):
        for n in names:
            wall, used = timed_run(n, data, args.epochs, options[n])
            times[n].append(wall)
            cpu[n].append(used)
        print(f"repeat {r + 1}: " + " | ".join(f"{n} {times[n][-1]:.3f} ({cpu[n][-1]:.3f} cpu)"
                                               for n in names) + " s/epoch", flush=True)
    stacked = [n for n in names if args.stack > 1 and method_class(n).on_member_axis(ResidualMLP)]
    stack_t: dict[str, list[float]] = {n: [] for n in stacked}
    lone_t: dict[str, list[float]] = {n: [] for n in stacked}
    for r in range(args.repeats if stacked else 0):
        for n in stacked:
            lone_t[n].append(sum(timed_run(n, data, args.epochs, options[n], 42 + i)[0]
                                 for i in range(args.stack)))
            stack_t[n].append(timed_stack(n, data, args.epochs, options[n], args.stack))
        print(f"repeat {r + 1}, K={args.stack}: " + " | ".join(
            f"{n} stack {stack_t[n][-1]:.3f} lone {lone_t[n][-1]:.3f}" for n in stacked) + " s/epoch",
              flush=True)
    med = {n: statistics.median(t) for n, t in times.items()}
    med_cpu = {n: statistics.median(t) for n, t in cpu.items()}
    print("median CPU s/epoch: " + ", ".join(f"{n}={med_cpu[n]:.3f}" for n in names)
          + ("; CPU ratios: " + ", ".join(f"{n}/bp={med_cpu[n] / med_cpu['bp']:.2f}" for n in names
                                           if n != "bp") if "bp" in med_cpu else ""))
    print(f"median wall s/epoch over {args.repeats} repeats, {args.epochs} epochs, torch threads "
          f"{torch.get_num_threads()}: " + ", ".join(f"{n}={med[n]:.3f}" for n in names))
    if "bp" in med:
        for n in names:
            if n not in ("bp", "ep", "cb"):
                print(f"{n}_over_bp={med[n] / med['bp']:.2f}")
        for n in ("ep", "cb"):
            if n in med:
                print(f"{n}_over_bp={med[n] / med['bp']:.2f}")
    for n in stacked:
        print(f"{n}_stack{args.stack}_over_lone="
              f"{statistics.median(stack_t[n]) / statistics.median(lone_t[n]):.2f}")


if __name__ == "__main__":
    main()
