"""A stack of K runs against the same K runs one after another, for vit-mini and resnet-small.

K lone Methods (seeds 0 … K−1, every block trainable) each take `--steps` `train_step`s on its own
fixed random 3×16×16 batch, then one `methods.members.MemberStack` of K such runs takes as many
steps on the K batches stacked (K, B, …); repeated `--repeats` times, interleaved, and the median
process CPU time compared (on a shared machine CPU time does not count waiting for a core). No
trainer, no evaluation. Prints `<arch>_<method>_stack<K>_over_lone=<ratio>` (< 1: the stack is
cheaper per run).

    OMP_NUM_THREADS=1 python benchmarks/stack_archs_speed.py [--k 4] [--methods bp,dfa]

Measured (one thread, the 2-core shared box at load ≈ 9.6, K = 4, B = 128, vit-mini d=64 L=4 4
heads patch 4, resnet-small width 16 L=4): vit-mini bp 1.11, dfa 1.14; resnet-small bp 0.96,
dfa 0.93 — on a CPU stacking does not pay (the audit stacks automatically only on CUDA).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from creditaudit.methods import MethodSettings, method_class
from creditaudit.methods.members import MemberStack
from creditaudit.model import build_model

MODELS = {"vit-mini": dict(width=64, blocks=4, options={"heads": 4, "patch": 4}),
          "resnet-small": dict(width=16, blocks=4)}


def ratio(arch: str, name: str, k: int, batch: int, steps: int, repeats: int,
          shape=(3, 16, 16), sizes: dict | None = None) -> tuple[float, float]:
    """(stack ÷ lone CPU time, lone ms per run-step) of `steps` steps of K runs."""
    sizes = sizes or MODELS[arch]

    def build():
        return [method_class(name)(build_model(arch, shape, 10, **sizes),
                                   MethodSettings(epochs=3, seed=s, trainable_blocks=tuple(range(sizes["blocks"]))))
                for s in range(k)]
    torch.manual_seed(0)
    lone, stack = build(), MemberStack(build())
    xs, ys = torch.randn((k, batch) + tuple(shape)), torch.randint(0, 10, (k, batch))
    for m, x, y in zip(lone, xs, ys):                    # warm-up: optimizer state, kernels
        m.train_step(x, y)
    stack.train_step(xs, ys)
    lone_t, stack_t = [], []
    for _ in range(repeats):
        t = time.process_time()
        for _ in range(steps):
            for m, x, y in zip(lone, xs, ys):
                m.train_step(x, y)
        lone_t.append(time.process_time() - t)
        t = time.process_time()
        for _ in range(steps):
            stack.train_step(xs, ys)
        stack_t.append(time.process_time() - t)
    lone_s = statistics.median(lone_t)
    return statistics.median(stack_t) / lone_s, lone_s / steps / k * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", default="bp,dfa")
    ap.add_argument("--archs", nargs="*", default=list(MODELS))
    args = ap.parse_args()
    torch.set_num_threads(1)
    for arch in args.archs:
        for name in args.methods.split(","):
            r, ms = ratio(arch, name, args.k, args.batch, args.steps, args.repeats)
            print(f"{arch}_{name}_stack{args.k}_over_lone={r:.2f}  (lone {ms:.1f} ms CPU per run-step)",
                  flush=True)


if __name__ == "__main__":
    main()
