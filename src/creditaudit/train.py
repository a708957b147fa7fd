"""The one trainer: runs any method plug-in on any dataset, epoch by epoch, into run folders.

It knows nothing about a method's update rule or about verdicts: it draws batches, calls the
step, steps the schedules, evaluates, records the training-time monitor ((a), (b), (b′)
statistics and accuracy on one fixed eval batch, plus the method's own `epoch_log`; every k-th
epoch also the alignment over training: Γ_l of the method's credit and, for a rule with feedback
weights, cos(W, B) — `_alignment`), and checkpoints.

A single run is a stack of one (SPEC §8). `train_runs` trains K runs that share a model shape
and everything but their seed and trainable blocks (`stack_key`) as one stack: when their method
is on the member axis for the architecture (`Method.on_member_axis`: bp, fa, dfa, dfa-penalty,
ep, sb and cb on the ResMLP, vit-mini and resnet-small), the step is `methods.members.MemberStack`'s — one batched step of every member on
(K, B, …) batches, each member with its own data order, init, feedback draws, clipping, frozen
mask, auxiliary nets, AdamW state and LR schedule — and `train_run` is `train_runs` of one. A method that is not
on the member axis (the zoo's other rules, a user's `PKG:CLASS`) trains as a stack of one through its lone `train_step`, exactly as before. Each
member's folder is what a lone run writes (config.json, checkpoints, metrics.jsonl, sealed
status.json); the global torch RNG is each member's own while its work runs, and is what its
checkpoint records. A member that goes non-finite is finished as "diverged" alone (its folder as
a lone diverged run's) while the others train on, its slices reset to its last checkpoint and
masked (members share no arithmetic: AdamW is elementwise, means and norms are per member). In a stack of K > 1,
`wall_time` is the stack's elapsed time, shared by its members.

An early-stop rule, when wanted, is handed in (`verdict.stop_rule`). A killed run resumes from
its last checkpoint and ends with exactly the weights and metrics of an uninterrupted run (CPU,
same thread count; on CUDA up to kernel nondeterminism); resumed members at one checkpoint epoch
stack again. A checkpoint is written once `CHECKPOINT_SECONDS` of training have passed since the
last one, and when the run ends (`_checkpoint`); an epoch not yet written is kept as a host copy
and written if training stops before the next write (Ctrl-C, a failing step, divergence), so a
kill the process cannot catch loses at most those seconds.

Where and how fast: a run trains on the device it is given, else where its data are, else the CPU
(never "auto": the command line resolves that). A step touches the host never: the epoch's order
and augmentation are drawn before its first batch (`ArrayDataset.train_batches`), the loss is summed
on the device, and the monitor reads numbers once per epoch. The step runs in the run's
`precision` (`precision_context`: fp32 by default, TF32 or bf16 autocast opt-in); the monitor and
every diagnosis run outside it, in fp32. On CUDA the method's `gradients` is compiled with
mode "reduce-overhead" (CUDA graphs) when asked: `compile_step=None` = on CUDA only (the command
line's default; --no-compile turns it off), True = always, False = never (the library default, so
a Python caller and the test suite pay no compilation unless they ask).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from safetensors import SafetensorError
from tqdm.auto import tqdm

from . import store
from .config import RunConfig
from .data import ArrayDataset, load_dataset
from .errors import CreditAuditError
from .methods import METHODS, method_class
from .methods.base import checked_feedback_pairs
from .methods.members import MemberStack
from .metrics import alignment_every, correctness, credit_alignment, monitor_snapshot, weight_alignment
from .model import ARCH_CLASSES
from .runs import (Run, as_device, build_method, build_model, data_shape, existing_run_is_done, load_run,
                   moved_weights, record_method_origin, weights_digest)
from .seeding import derived_generator

StopRule = Callable[[Sequence[dict]], "str | None"]

# Seconds of training between two checkpoints of a run. Writing one (the tensors, their digest,
# the sealed history, fsyncs) took ~55 ms on one thread of a 2-core CPU: after every 0.5-s epoch
# of the quick audit's runs, 6–10 % of their training; the whole audit took 4.5 % less without
# them (paired timings, docs/SPEED.md). An epoch that takes longer than this is written as
# before, every one. CHECKPOINT_ENV overrides it (0: after every epoch, as the resume tests need).
CHECKPOINT_SECONDS = 10.0
CHECKPOINT_ENV = "CREDITAUDIT_CHECKPOINT_SECONDS"


def checkpoint_seconds() -> float:
    """The seconds of training between a run's checkpoints: CHECKPOINT_ENV when set, else
    CHECKPOINT_SECONDS."""
    raw = os.environ.get(CHECKPOINT_ENV, "").strip()
    if not raw:
        return CHECKPOINT_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise CreditAuditError(f"{CHECKPOINT_ENV}={raw!r} is not a number of seconds: set it to one ≥ 0 "
                               f"(0: a checkpoint after every epoch), or unset it for "
                               f"{CHECKPOINT_SECONDS:g}")
    return value


_HOST_MEMORY_KEPT = False


def keep_freed_host_memory() -> bool:
    """Have glibc's malloc keep freed host memory for the next step instead of returning it to
    the OS (Linux/glibc only; elsewhere nothing happens): blocks up to 32 MiB come from the heap
    (M_MMAP_THRESHOLD) and the heap is not trimmed below 1 GiB of free top (M_TRIM_THRESHOLD).

    Why: by default a freed tensor of more than a few hundred KiB goes back to the OS, and the
    next step's tensor of that size faults in fresh pages. On the CPU a step of ep, sb or cb
    allocates and frees many such tensors (cb's bridge target alone (draws·L·N, H) = 2 MiB at the
    quick audit's shape), and the page faults cost a third of their step: benchmarks/method_speed.py,
    one thread, CPU-time ratios to BP: cb 3.01 → 2.23, ep 3.04 → 2.58, sb 3.05 → 2.53, BP itself
    unchanged. Numerics are untouched. The memory a process holds then stays near its peak, which
    the trainer reaches every step anyway. Returns whether the setting took; called once per
    process by `train_runs` (and by benchmarks that time steps as the trainer runs them)."""
    global _HOST_MEMORY_KEPT
    if not _HOST_MEMORY_KEPT:
        try:
            import ctypes
            libc = ctypes.CDLL("libc.so.6")
            m_trim_threshold, m_mmap_threshold = -1, -3                    # glibc's mallopt params
            _HOST_MEMORY_KEPT = bool(libc.mallopt(m_mmap_threshold, 32 * 2 ** 20)
                                     and libc.mallopt(m_trim_threshold, 2 ** 30))
        except (OSError, AttributeError):                # not glibc (macOS, Windows, musl): as is
            _HOST_MEMORY_KEPT = False
    return _HOST_MEMORY_KEPT


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


@contextlib.contextmanager
def precision_context(precision: str, device: torch.device):
    """The numerics of the training steps run inside it (RunConfig.precision):

        fp32  float32 storage and arithmetic: TF32 switched off for matmuls and cuDNN convolutions
              (cuDNN allows TF32 by default, which would make a ResNet's "fp32" steps TF32)
        tf32  float32 storage, TF32 matmuls and convolutions on CUDA (no effect on a CPU)
        bf16  torch.autocast to bfloat16 on the device (weights and optimizer state stay float32)

    Global switches are restored on exit, so the monitor and the diagnoses after it are fp32.
    Inductor's hint that TF32 is "available but not enabled" is silenced inside: here that is the
    setting's choice (--precision tf32 enables it), not an oversight."""
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
        torch.backends.cudnn.allow_tf32 = precision == "tf32"
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"TensorFloat32 tensor cores .* not enabled")
            if precision == "bf16":
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    yield
            else:
                yield
    finally:
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = cudnn


def compile_mode_for(device: torch.device, compile_step: bool | None) -> str | None:
    """torch.compile mode of the step, or None for eager: compile_step False → eager; True →
    compiled; None → compiled on CUDA only. On CUDA the mode is "reduce-overhead" (CUDA graphs:
    one launch per step instead of ~100 kernels), elsewhere "default"."""
    if compile_step is None:
        compile_step = device.type == "cuda"
    if not compile_step:
        return None
    return "reduce-overhead" if device.type == "cuda" else "default"


def step_runner(method, mode: str | None):
    """The per-batch step: the method's eager `train_step`, or with a compile `mode` its compiled
    step, which falls back to eager gradients (with one warning) if compiling fails."""
    return method.step_function(fallback=True, mode=mode) if mode is not None else method.train_step


def no_exit(step: Callable, label: str) -> Callable:
    """`step`, with a SystemExit raised inside it (a method of the user's calling sys.exit) turned
    into a CreditAuditError: the run stays unfinished (no status.json; the last finished epoch's
    checkpoint is kept), the audit records it as failed and the command line exits non-zero —
    never a silent exit 0 that a CI could read as a passed check. A KeyboardInterrupt passes on:
    it stops training like Ctrl-C (exit 130, resumable)."""
    def guarded(x, y):
        try:
            return step(x, y)
        except SystemExit as err:
            raise CreditAuditError(f"the method's step called sys.exit({err.code!r}) in run {label}; "
                                   "the run is unfinished (its finished epochs are kept) — remove "
                                   "the exit, then train again") from None
    return guarded


def train_run(config: RunConfig, out: str | Path, *, data_dir: str | Path | None = None,
              device: str | torch.device | None = None, data: ArrayDataset | None = None,
              progress: bool = True, stop_rule: StopRule | None = None,
              compile_step: bool | None = False,
              on_epoch: Callable[[Sequence[dict]], None] | None = None,
              align_every: int | None = None) -> Run:
    """Train `config` into folder `out`, resuming from its checkpoint if one exists: a stack of
    one (`train_runs`).

    A folder holding a different config (any field, the data digest and code version included) is
    refused. A finished run is returned as is. An unbound `config` (data_digest None) is bound to
    the loaded data; a bound one must match them. Returns the
    `Run`; its `status["status"]` is "finished", "diverged" (non-finite values: the last finite
    checkpoint and metrics are kept) or "stopped" (`stop_rule` returned a message).
    A failure to write (read-only folder, full disk) raises CreditAuditError; the last complete
    checkpoint stays readable and the same call resumes from it. `on_epoch(history)`, when given,
    sees the monitor history after each recorded epoch (e.g. trackers.TensorBoardLog).
    device: where to train (default: where `data` are, else the CPU). compile_step: compile the
    step (False, the default: eager; None: on CUDA only; `compile_mode_for`). align_every: record
    Γ_l and cos(W, B) every k-th epoch (None: `alignment_every`; epoch 0 and the last always). None
    of them changes the run's config or its weights.
    """
    return train_runs([config], [out], data_dir=data_dir, device=device, data=data, progress=progress,
                      stop_rule=stop_rule, compile_step=compile_step, align_every=align_every,
                      on_epoch=None if on_epoch is None else (lambda i, history: on_epoch(history)))[0].run


# -- which runs stack ---------------------------------------------------------------------------
def can_stack(config: RunConfig) -> bool:
    """Whether `config` can share a stack with other runs: its method is on the member axis for
    its architecture (`Method.on_member_axis`), its recipe is AdamW (the stack steps one fused
    AdamW), and no early-stop rule reads its monitor (such a run trains as a stack of one)."""
    if config.stop_when_flagged is not None or config.recipe["optimizer"] != "adamw":
        return False
    return method_class(config.method).on_member_axis(ARCH_CLASSES[config.arch])


def stackable() -> str:
    """The built-in methods on the member axis, per architecture, in words (for --help)."""
    archs: dict[tuple[str, ...], list[str]] = {}       # architectures with the same methods, together
    for arch, cls in ARCH_CLASSES.items():
        names = tuple(name for name, m in METHODS.items() if m.on_member_axis(cls))
        if names:
            archs.setdefault(names, []).append(arch)
    return "; ".join(f"{', '.join(names)} on {', '.join(a)}" for names, a in archs.items())


def stack_key(config: RunConfig) -> str:
    """Configs with equal keys can share a stack: every field of the run but its seed and
    trainable blocks (so a new RunConfig field separates stacks without touching this)."""
    return json.dumps({k: v for k, v in config.to_dict().items() if k not in ("seed", "trainable_blocks")},
                      sort_keys=True)


def group_stacks(configs: Sequence[RunConfig], max_size: int | None = None) -> list[list[int]]:
    """Indices of `configs` grouped into stacks (first-seen order; each group at most `max_size`);
    a config that cannot stack is a group of its own."""
    groups: dict[Any, list[int]] = {}
    for i, c in enumerate(configs):
        key = stack_key(c) if can_stack(c) else ("alone", i)
        groups.setdefault(key, []).append(i)
    out = []
    for idx in groups.values():
        size = max_size or len(idx)
        out.extend(idx[j:j + size] for j in range(0, len(idx), size))
    return out


# -- the one trainer --------------------------------------------------------------------------
@dataclass
class Trained:
    """One run of `train_runs`: its folder read back, and how many runs its last stack held."""

    run: Run
    stack_size: int
    trained: bool


@dataclass
class _Member:
    """A run inside a stack: its lone model and Method (the folder's view of it), its data order
    and its global torch RNG state, its history."""

    config: RunConfig
    out: Path
    model: torch.nn.Module
    method: Any
    data_gen: torch.Generator
    rng: torch.Tensor
    history: list[dict] = field(default_factory=list)
    run: Run | None = None                 # set once the member's folder is finished
    init_weights: str | None = None        # digest of the seed's initial weights (`weights_digest`)
    written: int | None = None             # the epoch of its last checkpoint on disk (None: none yet)
    written_at: float = field(default_factory=time.perf_counter)   # when it was written (or started)
    pending: tuple[int, store.FlatState, int] | None = None   # (epoch, state, len(history)) not yet written


def train_runs(configs: Sequence[RunConfig], outs: Sequence[str | Path], *,
               data_dir: str | Path | None = None, device: str | torch.device | None = None,
               data: ArrayDataset | None = None, progress: bool = True,
               stop_rule: StopRule | None = None, compile_step: bool | None = False,
               on_epoch: Callable[[int, Sequence[dict]], None] | None = None,
               align_every: int | None = None) -> list[Trained]:
    """Train runs that can share a stack (one `stack_key`, all `can_stack`; or a single run of
    any method) into their folders: THE trainer. Members that start from the same epoch (fresh
    runs; resumed runs at one checkpoint epoch) train as one stack on the member axis when their
    method is on it (`methods.members.MemberStack`), a lone run as a stack of one; a run of a
    method that is not on the member axis trains through its lone `train_step`. Each member's
    folder is what a lone run writes. Finished folders are returned as they are. Raises what
    `train_run` raises. on_epoch(i, history): after each recorded epoch of member i."""
    configs, outs = list(configs), [Path(o) for o in outs]
    every = checkpoint_seconds()
    if align_every is not None and (isinstance(align_every, bool) or not isinstance(align_every, int)
                                    or align_every < 1):
        raise CreditAuditError(f"align_every must be a positive number of epochs, got {align_every!r}")
    if len(configs) != len(outs):
        raise ValueError("train_runs needs one folder per config")
    if len(configs) > 1 and (len({stack_key(c) for c in configs}) > 1 or not all(map(can_stack, configs))):
        raise ValueError("train_runs trains several runs only as one stack: configs that can_stack "
                         "and share one stack_key")
    dev = as_device(device, data.device if data is not None else None)
    if any(c.data_digest is None for c in configs):   # the data's contents are part of each run
        data = data if data is not None else load_dataset(configs[0].dataset, data_dir, dev)
        configs = [c.bind_data(data.digest) for c in configs]
    results: list[Trained | None] = [None] * len(configs)
    for i, (c, o) in enumerate(zip(configs, outs)):
        if existing_run_is_done(o, c):
            results[i] = Trained(load_run(o, dev), 1, False)
    todo = [i for i, r in enumerate(results) if r is None]
    if not todo:
        return results                                   # type: ignore[return-value]
    keep_freed_host_memory()
    data = data if data is not None else load_dataset(configs[0].dataset, data_dir, dev)
    for i in todo:
        configs[i].bind_data(data.digest)  # other data than the config's are refused, not trained on;
    data = data.to(dev)                    # digested before the move: cached on the caller's object
    members = {i: _start_member(configs[i], outs[i], data, dev) for i in todo}
    by_epoch: dict[int, list[int]] = {}
    for i in todo:                         # a stack's members step together: one start epoch each
        by_epoch.setdefault(members[i].history[-1]["epoch"] if members[i].history else 0, []).append(i)
    for group in by_epoch.values():
        _train_stack([members[i] for i in group], data, dev, progress, stop_rule, compile_step,
                     None if on_epoch is None else (lambda j, h, group=group: on_epoch(group[j], h)),
                     align_every, every)
        for i in group:
            results[i] = Trained(members[i].run, len(group), True)
    return results                                       # type: ignore[return-value]


def _start_member(config: RunConfig, out: Path, data: ArrayDataset, dev: torch.device) -> _Member:
    """The member of a run folder: resumed from its checkpoint, else built as a lone run builds
    it (model from the seed, then the Method and its draws), with the global RNG state that
    follows; its config written first."""
    try:            # after the data loaded: a refused dataset leaves no half-made run folder
        out.mkdir(parents=True, exist_ok=True)
        store.atomic_write_json(out / "config.json", config.to_dict())
        record_method_origin(out, config.method)    # how `check`/`diagnose` later re-import a user's rule
    except OSError as err:
        raise _write_error(out, err, None) from None
    data_gen = derived_generator(config.seed, "data")
    if store.has_checkpoint(out):
        run = load_run(out, dev)
        data_gen.set_state(run.state["data_gen"])
        return _Member(config, out, run.model, run.method, data_gen, run.state["torch_rng"], run.history,
                       init_weights=run.init_weights, written=run.history[-1]["epoch"])
    model = build_model(config, data.input_shape, data.n_classes)
    # PROTOCOL §3.7: a run starts from the weights its seed gives; recorded before the method
    # exists, checked after its __init__ and at epoch 0 (a rule that pretrains inside __init__
    # would be judged on weights no step of it produced)
    init = weights_digest(model)
    model = model.to(dev)
    method = build_method(config, model)
    if weights_digest(model) != init:
        raise moved_weights(config.method, "in its __init__, before its first step")
    return _Member(config, out, model, method, data_gen, torch.get_rng_state(), init_weights=init)


@contextlib.contextmanager
def _own_rng(m: _Member):
    """The global torch RNG is the member's own while its work runs (its lone steps, its monitor
    line); the state it leaves is kept as the member's. After a stack, the global RNG holds the
    last member's state: for a lone run its own, as a lone trainer leaves it."""
    torch.set_rng_state(m.rng)
    try:
        yield
    finally:
        m.rng = torch.get_rng_state()


def _checkpoint(m: _Member, epoch: int, data: ArrayDataset, every: float) -> None:
    """Member m's state after `epoch`, taken now (a host copy: `store.FlatState`), and written
    when `every` seconds have passed since its last checkpoint; else kept until the next one, the
    run's end (`_finish`) or an interruption (`_flush`)."""
    m.pending = (epoch, store.FlatState.of({
        "model": m.model.state_dict(), "method": m.method.state_dict(),
        "data_gen": m.data_gen.get_state(), "torch_rng": m.rng, "history": m.history,
    }), len(m.history))
    if time.perf_counter() - m.written_at >= every:
        _flush(m, data)


def _flush(m: _Member, data: ArrayDataset) -> None:
    """Write member m's state not yet on disk, if any: its checkpoint, then the metrics log of
    the same epochs."""
    if m.pending is None:
        return
    epoch, state, n = m.pending
    try:
        store.save_checkpoint(m.out, epoch, state, {
            **data_shape(data), "label": m.config.label,
            **({"init_weights": m.init_weights} if m.init_weights else {})}, m.config.to_dict())
        store.write_metrics(m.out, m.history[:n])
    except (OSError, SafetensorError) as err:  # safetensors reports ENOSPC/EFBIG as its own error
        raise _write_error(m.out, err, m.written) from None
    m.pending, m.written, m.written_at = None, epoch, time.perf_counter()


def _finish(m: _Member, status: str, message: str, dev: torch.device, data: ArrayDataset,
            wall: float | None = None) -> None:
    """End member m's folder: its last recorded epoch written (`_flush`; a diverged member's is
    the last finite one), then the log whole and the sealed status."""
    _flush(m, data)
    last = m.history[-1]
    try:
        # the log whole before the status that ends the run: a run killed between its last
        # checkpoint and its log, then resumed, ends with a complete metrics.jsonl too
        store.write_metrics(m.out, m.history)
        store.write_sealed_json(m.out / "status.json", store.json_safe({
            "status": status, "message": message, "epochs_completed": last["epoch"],
            "epochs_planned": m.config.epochs, "test_acc": last["test_acc"],
            "test_digest": last.get("test_digest"),
            "wall_time": last["wall_time"] if wall is None else wall,
            **({"init_weights": m.init_weights} if m.init_weights else {}),
            "checkpoint": store.checkpoint_digest(m.out)}))
    except OSError as err:
        raise _write_error(m.out, err, last["epoch"]) from None
    m.run = load_run(m.out, dev)


def _retire(stack: MemberStack | None, k: int, m: _Member, live: list[int]) -> None:
    """Member k's folder is finished: it leaves the live members, and its stack slices are masked
    at its last checkpoint's weights while the others train on."""
    live.remove(k)
    if stack is not None and live:
        stack.retire(k, m.run.method)


def _train_stack(members: list[_Member], data: ArrayDataset, dev: torch.device, progress: bool,
                 stop_rule: StopRule | None, compile_step: bool | None,
                 on_epoch: Callable[[int, Sequence[dict]], None] | None,
                 align_every: int | None = None, every: float = CHECKPOINT_SECONDS) -> None:
    """Train members that start from one epoch, together, to their end; each folder finished.
    Checkpoints come `every` seconds (`_checkpoint`); whatever stops the training (Ctrl-C, an
    error) first writes each member's last recorded epoch that is not on disk yet."""
    try:
        _train_members(members, data, dev, progress, stop_rule, compile_step, on_epoch, align_every, every)
    except BaseException:
        for m in members:
            try:
                _flush(m, data)
            except Exception:  # noqa: BLE001 — the error that stopped training is the one to report
                pass
        raise


def _train_members(members: list[_Member], data: ArrayDataset, dev: torch.device, progress: bool,
                   stop_rule: StopRule | None, compile_step: bool | None,
                   on_epoch: Callable[[int, Sequence[dict]], None] | None,
                   align_every: int | None, every: float) -> None:
    first = members[0]
    K = len(members)
    # an SGD or Adam recipe steps through the lone step: the stack's one optimizer is AdamW
    on_axis = first.method.on_member_axis(type(first.model)) and first.method.recipe.optimizer == "adamw"
    stack = MemberStack([m.method for m in members]) if on_axis else None
    if stack is None and K > 1:
        raise ValueError(f"{first.config.method} is not on the member axis: its runs train one at a time")
    eval_x, eval_y = data.eval_batch(0)
    t0 = time.perf_counter() - (first.history[-1]["wall_time"] if first.history else 0.0)
    for k, m in enumerate(members):
        if not m.history:  # epoch 0: the model at init, the reference for every later growth figure
            with _own_rng(m):
                m.history.append(_record(0, None, m.model, data, eval_x, eval_y, 0.0, {},
                                         m.method if _probes_alignment(m.config, 0, align_every) else None))
            if m.init_weights is not None and weights_digest(m.model) != m.init_weights:
                raise moved_weights(m.config.method, "before its first step (at epoch 0: in credit, "
                                    "feedback_pairs or the stack's construction)")
            _checkpoint(m, 0, data, every)
        if on_epoch is not None:
            on_epoch(k, m.history)
    start = first.history[-1]["epoch"]
    label = first.config.label if K == 1 else f"{first.config.method} stack of {K}"
    bar = tqdm(range(start + 1, first.config.epochs + 1), desc=label, disable=not progress,
               initial=start, total=first.config.epochs, leave=False)
    mode = compile_mode_for(dev, compile_step)
    if stack is not None:
        step = stack.step_function(fallback=True, mode=mode) if mode is not None else stack.train_step
    else:
        lone = no_exit(step_runner(first.method, mode), first.config.label)
        step = lambda x, y: lone(x[0], y[0]).unsqueeze(0)            # a lone step on a stack of one
    live = list(range(K))
    for epoch in bar:
        for m in members:
            m.model.train()
        loss_sum = torch.zeros(K, device=dev)
        with precision_context(first.config.precision, dev), \
                (_own_rng(first) if stack is None else contextlib.nullcontext()):
            for batches in zip(*(data.train_batches(first.config.batch_size, m.data_gen) for m in members)):
                y = torch.stack([b[1] for b in batches])             # (K, B): member k's batch in row k
                loss_sum += step(torch.stack([b[0] for b in batches]), y).float() * y.shape[1]
        if stack is not None:
            stack.sync()
            stack.end_epoch()
        else:
            first.method.end_epoch()
        losses = loss_sum.tolist()
        wall = time.perf_counter() - t0
        for k in list(live):
            m = members[k]
            train_loss = losses[k] / len(data.y_train)
            with _own_rng(m):
                record = _record(epoch, train_loss, m.model, data, eval_x, eval_y, wall,
                                 m.method.epoch_log(),
                                 m.method if _probes_alignment(m.config, epoch, align_every) else None)
            if not (_finite(train_loss) and all(_finite(v) for v in record["h_norms"])
                    and weights_finite(m.model)):
                bad = store.json_safe(record)
                _finish(m, "diverged", f"non-finite values at epoch {epoch} (train loss {train_loss}, "
                        f"‖h_l‖ {bad['h_norms']}); kept the checkpoint of epoch {epoch - 1}", dev, data,
                        record["wall_time"])
                _retire(stack, k, m, live)
                continue
            m.history.append(record)
            _checkpoint(m, epoch, data, every)
            if on_epoch is not None:
                on_epoch(k, m.history)
            message = stop_rule(m.history) if stop_rule is not None else None
            if message:
                _finish(m, "stopped", message, dev, data)
                _retire(stack, k, m, live)
        if K == 1 and live:
            bar.set_postfix(loss=f"{losses[0] / len(data.y_train):.3f}",
                            acc=f"{first.history[-1]['test_acc']:.3f}",
                            hL=f"{first.history[-1]['h_norms'][-1]:.2g}")
        if not live:
            return
    for k in live:
        _finish(members[k], "finished", f"trained {members[k].config.epochs} epochs", dev, data)


def weights_finite(model: torch.nn.Module) -> bool:
    """Whether every parameter is finite (one host read per epoch): a step can leave non-finite
    weights whose eval batch still reads finite (e.g. a NaN in a weight the batch does not reach),
    and such a checkpoint must not be kept as the run's last finite one."""
    return bool(torch.stack([p.isfinite().all() for p in model.parameters()]).all())


def _probes_alignment(config: RunConfig, epoch: int, every: int | None) -> bool:
    """Whether epoch `epoch`'s record probes the alignment: never for a frozen or shallow control
    (nothing reads a control's Γ: the audit's alignment over training is its main runs', and a
    control's credit runs only to train its embedding), else at epoch 0, the last and every k-th."""
    if config.control in ("frozen", "shallow"):
        return False
    every = alignment_every(config.epochs) if every is None else every
    return epoch == 0 or epoch == config.epochs or epoch % every == 0


def _alignment(model, method, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """Alignment over training on the monitor's fixed eval batch: "gamma" = Γ_l, l = 0 … L, the
    cosine of the method's credit with ∂CE/∂h_l (metrics.gradient_cosine, as the diagnosis
    measures it), and for a rule with feedback weights (`Method.feedback_pairs`)
    "weight_alignment" = cos(W, B) per pair. The credit runs under a forked global RNG, so probing
    never changes what the run trains; the lone Method of a stack member reads its own synced
    state, so a member's values are its lone run's."""
    dev = x.device
    out: dict[str, Any] = {}
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        try:
            credit = method.credit(x, y)
        except Exception:  # noqa: BLE001 — a rule's broken credit is the diagnosis' to report
            credit = None
    # a credit that raised or is malformed gets no Γ here: training does not need it, and the
    # diagnosis refuses it in one line naming the fault (protocol._credits)
    gamma = credit_alignment(model, credit, x, y) if credit is not None else None
    if gamma is not None:
        out["gamma"] = gamma
    pairs = checked_feedback_pairs(method)      # a malformed declaration: one line, naming it
    if pairs:
        out["weight_alignment"] = weight_alignment(pairs)
    return out


def _record(epoch: int, train_loss: float | None, model, data: ArrayDataset, eval_x: torch.Tensor,
            eval_y: torch.Tensor, wall: float, method_log: dict[str, float],
            method=None) -> dict[str, Any]:
    """One line of the metrics log: losses, test accuracy, the monitor on the fixed eval batch,
    and with `method` (at the epochs `_probes_alignment` picks) the alignment over training."""
    model.eval()
    snap = monitor_snapshot(model, eval_x, eval_y)
    finite = all(_finite(v) for v in snap.h_norms)     # a diverged line is discarded anyway
    align = _alignment(model, method, eval_x, eval_y) if method is not None and finite else {}
    correct = correctness(model, data.eval_batches("test", 1000))
    # test_correct: one bit per test example (store.pack_correct) beside the accuracy, the evidence
    # (d)'s variance over the shared test set reads (depth.py); N/8 bytes a line, sealed with the
    # history in the checkpoint, so resume and stacking keep it bit for bit
    return {"epoch": epoch, "train_loss": train_loss,
            "test_acc": int(correct.sum()) / max(len(correct), 1),
            "test_digest": data.test_digest,       # what test_acc was measured on (data.batches_digest)
            **snap.to_dict(), **align, **method_log, "wall_time": wall,
            "test_correct": store.pack_correct(correct.numpy())}



def _write_error(out: Path, err: Exception, kept_epoch: int | None) -> CreditAuditError:
    """One line for a failed write: what failed, what is kept, how to resume."""
    reason = getattr(err, "strerror", None) or " ".join(str(err).split())
    kept = (f"the checkpoint of epoch {kept_epoch} is kept" if kept_epoch is not None
            else "no checkpoint is kept yet (the run starts from its first epoch)")
    return CreditAuditError(f"cannot write to {out} ({reason}); {kept} — free space or "
                            "fix the folder's permissions, then run the same command again to resume")
