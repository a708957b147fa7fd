"""Stacked training: runs that share a model shape train as ONE stack of K members.

One batched forward / backward / AdamW step serves all K members: the parameters of the K
ResidualMLPs are stacked along a leading member axis (torch.func.stack_module_state) and every layer
is a batched matmul over that axis (x: (K, B, …)). Members are independent — the loss is the sum of
the members' losses, so each member's gradient is exactly its own — and AdamW is per element, so an
AdamW over the stacked tensors is K AdamWs.

Supported: arch "resmlp" with the methods bp, fa, dfa and dfa-penalty, without `stop_when_flagged`
(`can_stack`). EP, the state/credit bridges (sb, cb), user methods and the ViT/ResNet stay serial
(`train.train_run`). Members of one stack share `stack_key` (method, options, dataset, model sizes,
schedule, optimiser settings); the seed and the trainable blocks (main run, frozen control, ladder
rungs; the shallow control stacks with other shallow runs) may differ.

Per member, exactly what the serial run does:
  * data order: each member draws its batches from its own `derived_generator(seed, "data")`
    through `data.train_batches`; the K batches are stacked into (K, B, …);
  * init: each member's model is built with `runs.build_model` (its seed), then stacked;
  * feedback matrices: each member's serial Method object is built (`runs.build_method`), so FA's
    B and DFA's B_l are that object's own draws from its own generator;
  * clipping (dfa, dfa-penalty): per member, per trainable block, on that member's block gradient
    norm, with the formula of `torch.nn.utils.clip_grad_norm_`;
  * frozen blocks (frozen control, ladder rungs): a member's non-trainable block parameters are
    restored after each AdamW step (a mask on the update), so they stay bit-identical to init and
    get no weight decay; their gradients are computed (and ignored), as BP's serial run does too;
  * the cosine LR schedule: each member's own serial schedulers are stepped once per epoch and the
    stacked AdamW takes their learning rate;
  * the global torch RNG state recorded in the checkpoint is the member's own (captured after its
    model and method were built, carried through its monitor calls).

Each epoch every live member's weights and AdamW moments are copied back into its serial model and
Method, `train._record` writes its monitor line and `store.save_checkpoint` its checkpoint, so a
member's folder is exactly what `train_run` writes (config.json, checkpoint, metrics.jsonl, sealed
status.json) and `runs.load_run`, `train_run` (reuse, resume) and the audit read it as a serial run.
Differences: `wall_time` is the stack's elapsed time (shared by its members, not per member); the
weights equal the serial run's up to floating-point reassociation (batched vs plain matmuls):
measured ≤ 6e-16 relative in float64 after 3 epochs (tests/test_stack.py), ≤ 3e-7 in float32
(MNIST-1D, d=64, L=4, 3 epochs; test accuracy identical).

Resume rule: a member whose folder is finished is returned as is; a member whose folder holds a
checkpoint beyond epoch 0 resumes serially through `train_run`; the stack trains only members with
no checkpoint or only the epoch-0 one (which the stack rewrites identically). A stack killed
mid-way thus resumes member by member, serially, from each member's last checkpoint.
"""
from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from . import store
from .config import RunConfig
from .data import ArrayDataset, load_dataset
from .errors import CreditAuditError
from .methods.base import _FUSED
from .methods.bp import BP
from .methods.dfa import DFA, DFAPenalty
from .methods.fa import FA
from .model.resmlp import ACTIVATIONS
from .runs import (as_device, build_method, build_model, data_shape, existing_run_is_done,
                   failure_record, read_status)
from .seeding import derived_generator
from .train import _finite, _record, precision_context, train_run, weights_finite

_STEP_KIND = {BP: "backprop", FA: "feedback", DFA: "direct", DFAPenalty: "direct"}  # class → step
STACKABLE_METHODS = tuple(cls.name for cls in _STEP_KIND)
# the stack re-implements these steps: it may stand in for a method only while the class still
# runs the step it was written from (a patched or overridden `gradients` trains serially)
_OWN_STEP = {cls.name: (cls, cls.gradients, cls.train_step) for cls in _STEP_KIND}
STACKABLE_ARCHS = ("resmlp",)


def can_stack(config: RunConfig) -> bool:
    """True when `config` can train as a member of a stack (ResMLP × bp/fa/dfa/dfa-penalty, no
    early stop); EP, sb, cb, user methods, other architectures and stop_when_flagged train serially."""
    if not (config.arch in STACKABLE_ARCHS and config.method in STACKABLE_METHODS
            and config.stop_when_flagged is None):
        return False
    cls, gradients, step = _OWN_STEP[config.method]
    return cls.gradients is gradients and cls.train_step is step


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
        key = stack_key(c) if can_stack(c) else ("serial", i)
        groups.setdefault(key, []).append(i)
    out = []
    for idx in groups.values():
        step = max_size or len(idx)
        out.extend(idx[j:j + step] for j in range(0, len(idx), step))
    return out


def stacking_pays(device: torch.device) -> bool:
    """The `stack=None` (auto) rule of run_all: always on CUDA; on CPU only if CPU_STACK_PAYS."""
    return device.type == "cuda" or CPU_STACK_PAYS


# Measured on the shared 2-core CPU (benchmarks/gpu_throughput.py --device cpu --shape mnist1d:
# quick-audit model d=256 L=4, batch 128, input 40; stacked ÷ serial run-steps/s, alternating
# blocks): 1 thread — bp 0.99 (K=4), 1.15 (K=12); dfa 1.02 (K=4), 1.38 (K=12); 2 threads 0.54–1.34,
# dominated by other load on the box. The step is matmul-bound on CPU (a batched matmul costs what
# its K plain ones cost), so stacking does not pay reliably there: run_all keeps one serial run per
# single-threaded worker per core on CPU.
CPU_STACK_PAYS = False


# -- the stacked ResidualMLP ------------------------------------------------------------------
def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """x (K, B, in), w (K, out, in), b (K, out) → (K, B, out)."""
    return torch.baddbmm(b.unsqueeze(1), x, w.transpose(1, 2))


class _FeedbackLinear(torch.autograd.Function):
    """Stacked `fa.FeedbackLinear`: y = x·Wᵀ + b per member; δx = δy·B, ∂W = δyᵀ·x, ∂b = Σ δy."""

    @staticmethod
    def forward(ctx, x, weight, bias, feedback):
        ctx.save_for_backward(x, feedback)
        return _linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, feedback = ctx.saved_tensors
        grad_x = torch.bmm(grad_out, feedback) if ctx.needs_input_grad[0] else None
        grad_w = torch.bmm(grad_out.transpose(1, 2), x) if ctx.needs_input_grad[1] else None
        grad_b = grad_out.sum(1) if ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


def _layer_norm(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(h, h.shape[-1:], eps=eps) * w.unsqueeze(1) + b.unsqueeze(1)


class StackedResMLP:
    """K ResidualMLPs of one shape as stacked leaf tensors {name: (K, *shape)}."""

    def __init__(self, models: Sequence[torch.nn.Module], activation: str):
        params, buffers = torch.func.stack_module_state(list(models))
        if buffers:
            raise CreditAuditError("stacked training supports models without buffers only")
        self.p = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
        self.n_blocks = models[0].n_blocks
        self.act = ACTIVATIONS[activation]
        self.eps_block = [blk.ln.eps for blk in models[0].blocks]
        self.eps_out = models[0].out_ln.eps

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x.flatten(2), self.p["embed.weight"], self.p["embed.bias"])

    def block(self, l: int, h: torch.Tensor, feedback: dict[str, torch.Tensor] | None = None):
        p, pre = self.p, f"blocks.{l}."
        lin = _linear if feedback is None else (
            lambda x, w, b, name: _FeedbackLinear.apply(x, w, b, feedback[name]))
        z = _layer_norm(h, p[pre + "ln.weight"], p[pre + "ln.bias"], self.eps_block[l])
        if feedback is None:
            z = self.act(_linear(z, p[pre + "w1.weight"], p[pre + "w1.bias"]))
            return _linear(z, p[pre + "w2.weight"], p[pre + "w2.bias"])
        z = self.act(lin(z, p[pre + "w1.weight"], p[pre + "w1.bias"], "w1"))
        return lin(z, p[pre + "w2.weight"], p[pre + "w2.bias"], "w2")

    def readout(self, h: torch.Tensor) -> torch.Tensor:
        z = _layer_norm(h, self.p["out_ln.weight"], self.p["out_ln.bias"], self.eps_out)
        return _linear(z, self.p["out_head.weight"], self.p["out_head.bias"])


def _ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-member mean cross-entropy, (K,)."""
    k, b, c = logits.shape
    return F.cross_entropy(logits.reshape(k * b, c), y.reshape(k * b), reduction="none").view(k, b).mean(1)


def _rms_normalise(a: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return a / (a.pow(2).mean(-1, keepdim=True).sqrt() + eps)


class _StackStep:
    """The batched train step of one method over a StackedResMLP; returns the per-member CE (K,)."""

    def __init__(self, net: StackedResMLP, methods: Sequence[Any], trains: torch.Tensor):
        self.kind = _STEP_KIND[type(methods[0])]
        self.net, self.trains, self.clip = net, trains, methods[0].settings.clip
        self.lam = float(methods[0].lam) if self.kind == "direct" else 0.0   # 0 for dfa, λ for dfa-penalty
        L = net.n_blocks
        if self.kind == "feedback":
            self.feedback = [{name: torch.stack([m.feedback[l][name] for m in methods])
                              for name in ("w1", "w2")} for l in range(L)]
        elif self.kind == "direct":
            # (K, d, C) per feedback matrix; stored transposed once for e·Bᵀ
            self.feedback_t = [torch.stack([m.feedback[j] for m in methods]).transpose(1, 2).contiguous()
                               for j in range(len(methods[0].feedback))]

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return getattr(self, "_" + self.kind)(x, y)

    def _backprop(self, x, y):
        return self._end_to_end(x, y, [None] * self.net.n_blocks)

    def _feedback(self, x, y):
        return self._end_to_end(x, y, self.feedback)

    def _end_to_end(self, x, y, feedback):
        """One backward through the whole stack (bp; fa when `feedback` routes the error through B)."""
        net = self.net
        h = net.embed(x)
        for l in range(net.n_blocks):
            h = h + net.block(l, h, feedback[l])
        ce = _ce(net.readout(h), y)
        ce.sum().backward()
        return ce.detach()

    def _direct(self, x, y):
        net = self.net
        h0 = net.embed(x)
        h, branches = h0.detach(), []
        for l in range(net.n_blocks):
            f = net.block(l, h)
            branches.append(f)
            h = h + f.detach()
        logits = net.readout(h)
        with torch.no_grad():
            e = logits.softmax(-1) - F.one_hot(y, logits.shape[-1]).to(logits.dtype)
            projected = [_rms_normalise(torch.bmm(e, bt)) for bt in self.feedback_t]
            a = [projected[0]] + projected[:net.n_blocks]
        ce = _ce(logits, y)
        total = ce.sum() + (h0 * a[0]).sum(-1).mean(1).sum()
        for l, f in enumerate(branches):
            local = (f * a[l + 1]).sum(-1).mean(1)
            if self.lam:
                local = local + self.lam * f.pow(2).sum(-1).mean(1)
            total = total + (local * self.trains[:, l].to(local.dtype)).sum()
        total.backward()
        self._clip_blocks()
        return ce.detach()

    def _clip_blocks(self) -> None:
        """clip_grad_norm_(block l of member k, clip) for every member and block at once."""
        for l in range(self.net.n_blocks):
            grads = [p.grad for name, p in self.net.p.items()
                     if name.startswith(f"blocks.{l}.") and p.grad is not None]
            if not grads:
                continue
            norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads], dim=1)   # (K, n_params)
            total = norms.norm(dim=1)                                                # (K,)
            coef = torch.clamp(self.clip / (total + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef.view((-1,) + (1,) * (g.dim() - 1)))


# -- members and the run folders ------------------------------------------------------------------
@dataclass
class _Member:
    config: RunConfig
    out: Path
    model: torch.nn.Module
    method: Any
    data_gen: torch.Generator
    rng: torch.Tensor
    history: list[dict] = field(default_factory=list)
    live: bool = True
    result: dict | None = None


def _save(m: _Member, epoch: int, data: ArrayDataset) -> None:
    store.save_checkpoint(m.out, epoch, {
        "model": m.model.state_dict(), "method": m.method.state_dict(),
        "data_gen": m.data_gen.get_state(), "torch_rng": m.rng, "history": m.history,
    }, {**data_shape(data), "label": m.config.label}, m.config.to_dict())
    store.write_metrics(m.out, m.history)


def _finish(m: _Member, status: str, message: str, wall: float | None = None) -> None:
    last = m.history[-1]
    store.write_sealed_json(m.out / "status.json", store.json_safe({
        "status": status, "message": message, "epochs_completed": last["epoch"],
        "epochs_planned": m.config.epochs, "test_acc": last["test_acc"],
        "wall_time": last["wall_time"] if wall is None else wall,
        "checkpoint": store.checkpoint_digest(m.out)}))
    m.live = False


def _record_member(m: _Member, epoch: int, train_loss: float | None, data, eval_x, eval_y,
                   wall: float) -> dict:
    """The serial monitor line, run under the member's own global RNG state."""
    outer = torch.get_rng_state()
    torch.set_rng_state(m.rng)
    try:
        rec = _record(epoch, train_loss, m.model, data, eval_x, eval_y, wall, m.method.epoch_log())
        m.rng = torch.get_rng_state()
    finally:
        torch.set_rng_state(outer)
    return rec


def _plan(config: RunConfig, out: Path) -> str:
    """'done' (finished folder), 'serial' (checkpoint beyond epoch 0: resume serially) or 'stack'."""
    if existing_run_is_done(out, config):
        return "done"
    if store.has_checkpoint(out):
        meta, _ = store.load_checkpoint(out)
        if int(meta.get("epoch", 0)) > 0:
            return "serial"
    return "stack"


def _failure(out: Path, err: BaseException, t0: float) -> dict:
    return {**failure_record(out, err, time.perf_counter() - t0), "stacked": False}


def train_stack(configs: Sequence[RunConfig], out_dirs: Sequence[str | Path],
                data: ArrayDataset | None = None, device: str | torch.device | None = None,
                progress: bool = False, data_dir: str | Path | None = None) -> list[dict]:
    """Train `configs` (all `can_stack`, one `stack_key`) into `out_dirs` as one stack.

    Returns one record per member, in order, shaped like `experiments.common.train_job`'s:
    {"status", "message", "trained", "seconds", "stacked"}. Never raises for a run's failure:
    a failed member (or a failed stack: every member of it) comes back as status "failed" with
    the traceback in its folder's error.txt. device: default where `data` are, else the CPU.
    """
    t0 = time.perf_counter()
    configs, outs = list(configs), [Path(o) for o in out_dirs]
    if len(configs) != len(outs):
        raise ValueError("train_stack needs one out_dir per config")
    keys = {stack_key(c) for c in configs}
    if len(keys) > 1 or not all(can_stack(c) for c in configs):
        raise ValueError("train_stack needs configs that can_stack and share one stack_key")
    dev = as_device(device, data.device if data is not None else None)
    if any(c.data_digest is None for c in configs):  # the data's contents are part of each run's key
        try:
            data = data if data is not None else load_dataset(configs[0].dataset, data_dir, dev)
            configs = [c.bind_data(data.digest) for c in configs]
        except Exception as err:  # noqa: BLE001
            return [_failure(o, err, t0) for o in outs]
    results: list[dict | None] = [None] * len(configs)
    members_at: list[int] = []
    for i, (c, o) in enumerate(zip(configs, outs)):
        try:
            plan = _plan(c, o)
        except Exception as err:  # noqa: BLE001 — one bad folder must not stop the others
            results[i] = _failure(o, err, t0)
            continue
        if plan == "done":
            results[i] = {"status": read_status(o)["status"], "message": read_status(o)["message"],
                          "trained": False, "seconds": 0.0, "stacked": False}
        elif plan == "stack":
            members_at.append(i)
    try:
        if members_at or any(r is None for r in results):
            data = data if data is not None else load_dataset(configs[0].dataset, data_dir, dev)
            configs = [c.bind_data(data.digest) for c in configs]   # refuses other data than bound
            data = data.to(dev)
    except Exception as err:  # noqa: BLE001
        return [r if r is not None else _failure(o, err, t0) for r, o in zip(results, outs)]
    if len(members_at) == 1:  # a stack of one is the serial run
        members_at = []
    if members_at:
        try:
            stacked = _train_members([configs[i] for i in members_at], [outs[i] for i in members_at],
                                     data, dev, progress, t0)
            for i, r in zip(members_at, stacked):
                results[i] = r
        except Exception as err:  # noqa: BLE001
            for i in members_at:
                results[i] = _failure(outs[i], err, t0)
    for i, r in enumerate(results):
        if r is None:  # resume serially (or a lone member)
            t1 = time.perf_counter()
            try:
                run = train_run(configs[i], outs[i], data=data, device=dev, progress=False)
                (outs[i] / "error.txt").unlink(missing_ok=True)
                results[i] = {"status": run.status["status"], "message": run.status["message"],
                              "trained": True, "seconds": time.perf_counter() - t1, "stacked": False}
            except Exception as err:  # noqa: BLE001
                results[i] = _failure(outs[i], err, t1)
    return results  # type: ignore[return-value]


def _train_members(configs: list[RunConfig], outs: list[Path], data: ArrayDataset,
                   dev: torch.device, progress: bool, t0: float) -> list[dict]:
    outer_rng = torch.get_rng_state()
    members = []
    for c, o in zip(configs, outs):
        o.mkdir(parents=True, exist_ok=True)
        store.atomic_write_json(o / "config.json", c.to_dict())
        model = build_model(c, data.input_shape, data.n_classes).to(dev)
        method = build_method(c, model)
        members.append(_Member(c, o, model, method, derived_generator(c.seed, "data"),
                               torch.get_rng_state()))
    torch.set_rng_state(outer_rng)
    first = configs[0]
    K = len(members)
    trainer = StackTrainer([m.config for m in members], [m.model for m in members],
                           [m.method for m in members], dev)

    eval_x, eval_y = data.eval_batch(0)
    for m in members:
        m.history.append(_record_member(m, 0, None, data, eval_x, eval_y, 0.0))
        _save(m, 0, data)
    bar = tqdm(range(1, first.epochs + 1), desc=f"{first.method} stack of {K}", disable=not progress,
               leave=False)
    for epoch in bar:
        loss_sum = torch.zeros(K, device=dev)
        with precision_context(first.precision, dev):
            for batches in zip(*(data.train_batches(first.batch_size, m.data_gen) for m in members)):
                y = torch.stack([b[1] for b in batches])
                loss_sum += trainer.train_step(torch.stack([b[0] for b in batches]), y).float() * y.shape[1]
        trainer.end_epoch()
        wall = time.perf_counter() - t0
        losses = loss_sum.tolist()
        for k, m in enumerate(members):
            if not m.live:
                continue
            trainer.sync_member(k)
            train_loss = losses[k] / len(data.y_train)
            record = _record_member(m, epoch, train_loss, data, eval_x, eval_y, wall)
            if not (_finite(train_loss) and all(_finite(v) for v in record["h_norms"])
                    and weights_finite(m.model)):
                bad = store.json_safe(record)
                _finish(m, "diverged", f"non-finite values at epoch {epoch} (train loss {train_loss}, "
                        f"‖h_l‖ {bad['h_norms']}); kept the checkpoint of epoch {epoch - 1}",
                        record["wall_time"])
                continue
            m.history.append(record)
            _save(m, epoch, data)
        if not any(m.live for m in members):
            break
    for m in members:
        if m.live:
            _finish(m, "finished", f"trained {m.config.epochs} epochs")
    seconds = time.perf_counter() - t0
    out = []
    for m in members:
        status = read_status(m.out)
        (m.out / "error.txt").unlink(missing_ok=True)
        out.append({"status": status["status"], "message": status["message"], "trained": True,
                    "seconds": seconds, "stacked": True, "stack_size": K})
    return out


class StackTrainer:
    """The stacked step for K members built serially (models from `runs.build_model`, Methods from
    `runs.build_method`): train_step on (K, B, …) batches, the per-epoch schedule, and the copy of a
    member's weights and AdamW moments back into its serial model and Method."""

    def __init__(self, configs: Sequence[RunConfig], models: Sequence[torch.nn.Module],
                 methods: Sequence[Any], device: torch.device):
        first = configs[0]
        K, L = len(configs), first.blocks
        self.models, self.methods = list(models), list(methods)
        self.net = net = StackedResMLP(self.models, first.activation)
        trains = torch.tensor([[l in c.trainable_block_ids for l in range(L)] for c in configs],
                              dtype=torch.bool, device=device).view(K, L)
        self.step = _StackStep(net, self.methods, trains)
        # which stacked tensors AdamW updates, and the frozen slices restored after each step
        self.params, self.frozen = [], []
        for name, p in net.p.items():
            if name.startswith("blocks."):
                mask = trains[:, int(name.split(".")[1])]
                if not bool(mask.any()):
                    continue                       # no member trains this block: not optimised
                if not bool(mask.all()):
                    idx = (~mask).nonzero().flatten()
                    self.frozen.append((p, idx, p.detach()[idx].clone()))
            self.params.append(p)
        self.opt = torch.optim.AdamW(self.params, lr=self._member_lr(), weight_decay=first.weight_decay,
                                     **_FUSED)

    def _member_lr(self) -> float:
        return self.methods[0].optimizers[0].param_groups[0]["lr"]

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One batched step of every member on x (K, B, …), y (K, B); returns the CEs (K,)."""
        for p in self.params:
            p.grad = None
        ce = self.step(x, y)
        self.opt.step()
        with torch.no_grad():                      # the mask on the update: frozen slices back
            for p, idx, vals in self.frozen:
                p.index_copy_(0, idx, vals)
        return ce

    def end_epoch(self) -> None:
        """The cosine schedule: each member's own schedulers step, as in Method.end_epoch, and
        the stacked AdamW takes their learning rate."""
        with warnings.catch_warnings():            # the members' optimizers never call step()
            warnings.simplefilter("ignore", UserWarning)
            for method in self.methods:
                for sched in method.schedulers:
                    sched.step()
        for g in self.opt.param_groups:
            g["lr"] = self._member_lr()

    @torch.no_grad()
    def sync_member(self, k: int) -> None:
        """Copy member k's weights and AdamW moments into its serial model and Method."""
        names = {}
        for name, p in self.models[k].named_parameters():
            p.copy_(self.net.p[name][k])
            names[id(p)] = name
        for mopt in self.methods[k].optimizers:
            for group in mopt.param_groups:
                for p in group["params"]:
                    st = self.opt.state.get(self.net.p[names[id(p)]])
                    if st:
                        mopt.state[p] = {key: (v.clone() if key == "step" else v[k].clone())
                                         for key, v in st.items()}


# -- integration: run_all's jobs ----------------------------------------------------------------
@dataclass
class StackJob:
    """A worker's share of `run_all`: a stack of runs (plain dicts, so it pickles for any executor)."""

    configs: list[dict]
    run_dirs: list[str]
    data_dir: str
    device: str
    threads: int


_DATA_CACHE: dict[tuple, ArrayDataset] = {}


def stack_job(job: StackJob) -> dict[str, Any]:
    """Train one stack in a worker; never raises: {"members": [one train_job-style record per run]}."""
    torch.set_num_threads(job.threads)
    configs = [RunConfig.from_dict(c) for c in job.configs]
    t0 = time.perf_counter()
    key = (configs[0].dataset, str(job.data_dir), str(job.device))
    try:
        if key not in _DATA_CACHE:
            _DATA_CACHE[key] = load_dataset(configs[0].dataset, job.data_dir, job.device)
    except Exception as err:  # noqa: BLE001
        return {"members": [_failure(Path(d), err, t0) for d in job.run_dirs]}
    return {"members": train_stack(configs, job.run_dirs, data=_DATA_CACHE[key], device=job.device)}
