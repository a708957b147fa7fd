"""How many runs one stack holds, and how much of a GPU one unit of work asks for (SPEC §8).

On CUDA the size is measured, not guessed: before `run_all` forms its stacks, one probe step of a
stack of 1 and of `PROBE_K` runs of each stackable shape is taken in the driver, and the growth of
`torch.cuda.max_memory_allocated` between them is the memory one more member costs (its weights,
AdamW state, activations and gradients); what a stack of one needs beyond that, plus the data the
worker holds on the device, is the stack's fixed cost. `size_stacks` then fits members into each
worker's share of `torch.cuda.mem_get_info()`'s free memory, less a safety margin and a per-process
allowance for the CUDA context (which the allocator does not see). On a CPU nothing is probed:
stacking stays off unless asked, and an asked-for stack is split over the workers as before.

The probe's numbers are eager-mode: a step compiled into a CUDA graph (`--compile`, the CUDA
default) keeps its own memory pool, which the margin is there to absorb.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch

from ..config import RunConfig
from ..data import ArrayDataset
from ..methods.members import MemberStack
from ..runs import build_method, build_model
from ..seeding import derived_generator
from ..train import can_stack, precision_context, stack_key

PROBE_K = 2                       # the probe's stack: 1 run, then PROBE_K runs
MARGIN = 0.8                      # the share of free memory the stacks may fill
CONTEXT_BYTES = 512 * 2 ** 20     # an allowance per worker process for its CUDA context (not measured)


@dataclass(frozen=True)
class StackSizing:
    """The largest stack `run_all` forms (None: no limit) and why, as audit.json records it."""

    max_size: int | None
    why: str
    per_member_bytes: int | None = None
    fixed_bytes: int | None = None
    free_bytes: int | None = None
    workers: int = 1

    def to_dict(self) -> dict:
        return asdict(self)


def _mib(n: float) -> str:
    return f"{n / 2 ** 20:.0f} MiB"


def size_stacks(per_member: int, fixed: int, free: int, workers: int, n_runs: int,
                margin: float = MARGIN, context: int = CONTEXT_BYTES) -> StackSizing:
    """The stack size that fits: each of `workers` processes gets `margin` × `free` / `workers`,
    less its CUDA context and the stack's `fixed` bytes; the rest holds ⌊rest / per_member⌋
    members, at least 1 (a run that does not fit trains alone: the GPU then says so itself) and at
    most `n_runs`."""
    if per_member <= 0 or free < 0 or workers < 1 or n_runs < 1:
        raise ValueError(f"size_stacks needs per_member > 0, free ≥ 0, workers ≥ 1 and n_runs ≥ 1, got "
                         f"{per_member}, {free}, {workers}, {n_runs}")
    share = margin * free / workers
    room = share - context - fixed
    fit = max(1, min(n_runs, math.floor(room / per_member))) if room > 0 else 1
    why = (f"{_mib(per_member)} per member (probe step), {_mib(fixed)} fixed; {_mib(free)} free on the GPU, "
           f"{margin:.0%} of it over {workers} worker{'s' if workers > 1 else ''}: "
           + (f"stacks of at most {fit}" if room >= 2 * per_member else "no room for more than 1 per stack"))
    return StackSizing(fit, why, int(per_member), int(fixed), int(free), workers)


def probe_member_bytes(config: RunConfig, data: ArrayDataset, device: torch.device,
                       k: int = PROBE_K) -> tuple[int, int]:
    """(bytes one more member costs, fixed bytes of a stack) of one training step of `config`'s
    shape on CUDA: the peak allocation of a stack of 1 and of `k` (seeds seed … seed + k − 1),
    each from the allocation before it; fixed = the stack of one's peak less one member, plus the
    data on the device. The global RNG is left as it was."""
    dev = torch.device(device)
    with torch.random.fork_rng(devices=[dev]):
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        on_dev = data.to(dev)
        data_bytes = torch.cuda.memory_allocated(dev) - base
        peaks = {}
        for size in (1, k):
            start = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            probe_step(config, on_dev, dev, size)
            torch.cuda.synchronize(dev)
            peaks[size] = torch.cuda.max_memory_allocated(dev) - start
            torch.cuda.empty_cache()
        del on_dev
        torch.cuda.empty_cache()
    per = max(1, math.ceil((peaks[k] - peaks[1]) / (k - 1)))
    return per, max(0, peaks[1] - per) + data_bytes


def probe_step(config: RunConfig, data: ArrayDataset, dev: torch.device, size: int) -> torch.Tensor:
    """One step of a stack of `size` runs of `config`'s shape, as `train._train_stack` takes it
    (on any device); the members' losses, (size,)."""
    configs = [config.replace(seed=config.seed + i) for i in range(size)]
    models = [build_model(c, data.input_shape, data.n_classes).to(dev) for c in configs]
    methods = [build_method(c, m) for c, m in zip(configs, models)]
    batches = [next(iter(data.train_batches(c.batch_size, derived_generator(c.seed, "data")))) for c in configs]
    x, y = torch.stack([b[0] for b in batches]), torch.stack([b[1] for b in batches])
    with precision_context(config.precision, dev):
        if size > 1:
            return MemberStack(methods).train_step(x, y).detach()
        return methods[0].train_step(x[0], y[0]).detach().reshape(1)


def plan_stacks(configs: Sequence[RunConfig], workers: int, free: int,
                measure: Callable[[RunConfig], tuple[int, int]]) -> StackSizing | None:
    """The stack size for `configs` on a GPU with `free` bytes and `workers` processes sharing it:
    `measure(config)` (e.g. `probe_member_bytes`) once per stackable shape, and the smallest size
    that fits any of them (`group_stacks` takes one limit). None when no config can stack."""
    shapes: dict[str, RunConfig] = {}
    for c in configs:
        if can_stack(c):
            shapes.setdefault(stack_key(c), c)
    if not shapes:
        return None
    counts: dict[str, int] = {}
    for c in configs:
        if can_stack(c):
            counts[stack_key(c)] = counts.get(stack_key(c), 0) + 1
    # one limit serves every shape (group_stacks takes one), so each shape's fit is capped by the
    # largest shape's count, not its own: a shape with 2 runs must not cap another's stacks at 2
    most = max(counts.values())
    fits = []
    for key, c in shapes.items():
        try:
            fits.append(size_stacks(*measure(c), free, workers, most))
        except Exception as err:  # noqa: BLE001 — a probe that fails (out of memory, a rule's bug) stacks nothing
            what = " ".join(f"{type(err).__name__}: {err}".split())[:200]
            fits.append(StackSizing(1, f"the probe step of {c.method} failed ({what}): no stacks", workers=workers))
    worst = min(fits, key=lambda s: (s.max_size, -(s.per_member_bytes or 0)))
    if len(fits) > 1:
        worst = StackSizing(worst.max_size, f"{worst.why} (the tightest of {len(fits)} shapes probed)",
                            worst.per_member_bytes, worst.fixed_bytes, worst.free_bytes, workers)
    return worst


def cuda_free_bytes(device: torch.device) -> int:
    """Free memory on the GPU now (`torch.cuda.mem_get_info`), after this process's cache is emptied."""
    torch.cuda.empty_cache()
    return int(torch.cuda.mem_get_info(device)[0])


def cpu_sizing(n_runs: int, workers: int) -> StackSizing:
    """On a CPU: an asked-for stack is split so that every worker gets one (today's rule)."""
    size = math.ceil(n_runs / workers)
    return StackSizing(size, f"CPU: at most {size} runs per stack, one stack per worker ({workers})",
                       workers=workers)


def gpu_share(device: torch.device, workers: int) -> float:
    """The GPU a unit of work (a stack or a lone run) asks Ray for: 1 / workers of one GPU on CUDA
    (`--jobs N`: N stacks share each GPU), none on a CPU."""
    return 1.0 / max(1, workers) if device.type == "cuda" else 0.0
