"""K runs of one method trained as one stack on a leading member axis (SPEC §8; HFTA).

The K lone models and Methods are built exactly as lone runs build them (`runs.build_model`,
`runs.build_method`: each seed's init and each seed's feedback draws), then stacked:

    parameters   stack_models(models) (model/members.py: the ResMLP, vit-mini, resnet-small):
                 one leaf (K, *shape) per parameter name, one (K, *shape) tensor per buffer
    feedback     the members' `member_feedback()` stacked (K, …): member k reads run k's draws
    modules      the members' auxiliary nets (`member_modules()`: sb's G_ψ, cb's V_φ and V̄),
                 each parameter stacked (K, *shape) like the model's; the trainable ones join
                 the AdamW below with their lone optimizer's state
    drawn        each step's per-member draws (`member_prepare_step`: member k's from its own
                 generator, e.g. cb's noise), made eagerly before the step
    trains       (K, L) bool, trains[k, l] = block l is trainable in run k (main run, frozen
                 control, ladder rung; a shallow run has L = 0 and stacks with shallow runs)
    optimizer    ONE fused AdamW over the stacked leaves. AdamW is elementwise, so it is K AdamWs:
                 member k's slices of exp_avg / exp_avg_sq are exactly its lone optimizer's
                 state. Every lone run of the methods here has one lr and weight decay for all
                 its parameter groups, and the members share them (they share a stack key).
                 Only a run whose recipe is AdamW stacks (`train.can_stack`; the paper's seven
                 under either --recipe); an SGD or Adam recipe trains lone.
    frozen       a block some member does not train is masked per member: that member's slices
                 are put back after each AdamW step (no update, no weight decay), so they stay
                 bit-identical to init; a block no member trains is not optimised at all.
    retired      a member whose run ended (diverged, stopped) before the others: its slices
                 (model and auxiliary nets) are reset to its last checkpoint and masked the same
                 way (`retire`).

The step is `member_prepare_step` and `member_gradients` of member 0's Method (its knobs, e.g.
clip and λ, are every member's) followed by the AdamW step, `member_after_step` and the mask.
`sync()` copies each member's weights, auxiliary nets and AdamW state back into its lone model
and Method (and `member_sync` what else it keeps), so checkpoints, the monitor and the diagnosis
read member k as the lone run it is (and a stack of resumed members starts from their lone
AdamW states, stacked); `end_epoch()` steps each member's own LR schedule and hands
the learning rate to the stacked AdamW.
"""
from __future__ import annotations

import warnings
from typing import Sequence

import torch

from ..model.members import stack_models
from .base import Method, compiled_step, fused_adamw


class StepLog:
    """What a member step leaves for `member_sync`: (K,)-leading tensors as attributes (a plain
    object, whose attribute writes a compiled step traces; a dict's keys would be guarded on)."""


class MemberStack:
    """The stack of K lone Methods (one class, one stack key) and its one training step."""

    def __init__(self, methods: Sequence[Method]):
        self.methods = list(methods)
        first = self.methods[0]
        if len({type(m) for m in self.methods}) != 1 or not first.on_member_axis(type(first.model)):
            raise ValueError("MemberStack needs Methods of one class that is on the member axis")
        if first.recipe.optimizer != "adamw" or any(m.recipe != first.recipe for m in self.methods):
            # the stack steps one fused AdamW and hands member 0's scheduled lr to every member: an
            # SGD or Adam recipe trains lone (`train.can_stack`), never silently as AdamW here
            raise ValueError("MemberStack needs Methods of one AdamW recipe (another trains lone)")
        self.net = stack_models([m.model for m in self.methods])
        device = self.net.device
        L = self.net.n_blocks
        self.trains = torch.tensor([[m.trainable(l) for l in range(L)] for m in self.methods],
                                   dtype=torch.bool, device=device).view(len(self.methods), L)
        self.trained = tuple(l for l in range(L) if any(m.trainable(l) for m in self.methods))
        feedback = [m.member_feedback() for m in self.methods]
        self.feedback = {name: torch.stack([f[name] for f in feedback]) for name in feedback[0]}
        modules = [m.member_modules() for m in self.methods]
        self.modules = {name: {n: torch.stack([dict(mods[name].named_parameters())[n].detach()
                                               for mods in modules]).clone().requires_grad_(p.requires_grad)
                               for n, p in module.named_parameters()}
                        for name, module in modules[0].items()}
        self.drawn: dict[str, torch.Tensor] = {}
        self.log = StepLog()
        self.params, self.frozen = [], []
        for name, p in self.net.params.items():
            if name.startswith("blocks."):
                l = int(name.split(".")[1])
                if l not in self.trained:         # no member trains this block: not optimised, and
                    p.requires_grad_(False)           # no backward forms its gradient (a frozen control's
                    continue                          # blocks: a third of their backward)
                frozen = [k for k, m in enumerate(self.methods) if not m.trainable(l)]
                if frozen:
                    idx = torch.tensor(frozen, device=device)
                    self.frozen.append((p, idx, p.detach()[idx].clone()))
            self.params.append(p)
        self.params += [p for module in self.modules.values() for p in module.values() if p.requires_grad]
        lone = first.optimizers[0]
        self.opt = torch.optim.AdamW(self.params, lr=lone.param_groups[0]["lr"],
                                     betas=lone.param_groups[0]["betas"],
                                     weight_decay=lone.param_groups[0]["weight_decay"], **fused_adamw())
        self._stack_optimizer_state()

    def stacked(self) -> dict[str, torch.Tensor]:
        """Every stacked tensor by its lone name: the model's parameters, then "module.param" of
        the auxiliary nets."""
        return {**self.net.params, **{f"{name}.{n}": p for name, module in self.modules.items()
                                      for n, p in module.items()}}

    def _lone(self, method: Method) -> dict[str, torch.Tensor]:
        """`method`'s tensors that `stacked()` stacks, by the same names."""
        return {**dict(method.model.named_parameters()),
                **{f"{name}.{n}": p for name, module in method.member_modules().items()
                   for n, p in module.named_parameters()}}

    def _lone_state(self, k: int, name: str) -> dict | None:
        """Member k's lone AdamW state of parameter `name` (None: not optimised there, or fresh)."""
        p = self._lone(self.methods[k])[name]
        return next((opt.state[p] for opt in self.methods[k].optimizers if p in opt.state), None)

    @torch.no_grad()
    def _stack_optimizer_state(self) -> None:
        """Resumed members (one checkpoint epoch): their lone AdamW states stacked into the fused
        one; a member that does not optimise a stacked tensor (a frozen block) gets zero moments
        for its slices, which its mask never lets act."""
        index = {id(p): name for name, p in self.stacked().items()}
        for p in self.params:
            states = [self._lone_state(k, index[id(p)]) for k in range(len(self.methods))]
            have = next((s for s in states if s), None)
            if have is None:
                continue
            self.opt.state[p] = {key: v.clone() if key == "step" else torch.stack(
                [s[key] if s else torch.zeros_like(v) for s in states]) for key, v in have.items()}

    @property
    def name(self) -> str:
        return self.methods[0].name

    def gradients(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Every member's gradients for x (K, B, …), y (K, B); returns the CEs (K,)."""
        return self.methods[0].member_gradients(self, x, y)

    def clear_gradients(self) -> None:
        """Every stacked tensor's .grad back to None, the optimised ones and those of blocks no
        member trains (a backward pass writes theirs too; see `Method.clear_gradients`)."""
        for p in self.stacked().values():             # a superset of the optimised `params`
            p.grad = None

    def prepare_step(self) -> None:
        """This step's per-member draws (eager: a compiled graph cannot hold a generator)."""
        self.drawn = self.methods[0].member_prepare_step(self)

    @torch.no_grad()
    def apply_gradients(self) -> None:
        """The fused AdamW step, the method's after-step work, then each frozen member slice back
        to its init value."""
        self.opt.step()
        self.methods[0].member_after_step(self)
        for p, idx, init in self.frozen:
            p.index_copy_(0, idx, init)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.clear_gradients()
        self.prepare_step()
        loss = self.gradients(x, y)
        self.apply_gradients()
        return loss

    def step_function(self, fallback: bool = False, **compile_options):
        """`train_step`, or with torch.compile options the step with `gradients` compiled whole
        (`methods.base.compiled_step`)."""
        if not compile_options:
            return self.train_step
        return compiled_step(self.gradients, self.clear_gradients, self.apply_gradients,
                             self.prepare_step, name=self.name, fallback=fallback, **compile_options)

    @torch.no_grad()
    def retire(self, k: int, method: Method) -> None:
        """Member k's run has ended (diverged, stopped) while the others train on: its slices take
        the weights and auxiliary nets of `method` (its folder's last checkpoint, finite) and are
        masked from now on like a frozen block's, so nothing non-finite of it enters the stack's
        arithmetic again."""
        idx = torch.tensor([k], device=self.net.device)
        optimised = {id(p) for p in self.params}
        aux = {id(p) for module in self.modules.values() for p in module.values()}
        stacked = self.stacked()
        for name, p in self._lone(method).items():
            stacked[name][k] = p.detach()
            if id(stacked[name]) in optimised | aux:         # aux: e.g. cb's V̄, moved by its EMA
                self.frozen.append((stacked[name], idx, stacked[name].detach()[idx].clone()))
        self.net.restack_buffers(k, method.model)          # BatchNorm's running statistics

    @torch.no_grad()
    def sync(self) -> None:
        """Each member's weights, auxiliary nets and AdamW state (its slices) into its lone model
        and Method, then `member_sync`."""
        every = self.stacked()
        for k, method in enumerate(self.methods):
            self.net.unstack_into(k, method.model)
            lone = self._lone(method)
            for name, module in self.modules.items():
                for n, p in module.items():
                    lone[f"{name}.{n}"].copy_(p[k])
            stacked = {id(p): every[name] for name, p in lone.items()}
            for opt in method.optimizers:
                for group in opt.param_groups:
                    for p in group["params"]:
                        state = self.opt.state.get(stacked[id(p)])
                        if state:
                            opt.state[p] = {key: (v.clone() if key == "step" else v[k].clone())
                                            for key, v in state.items()}
            method.member_sync(self, k)

    def end_epoch(self) -> None:
        """Each member's own LR schedule steps (`Method.end_epoch`, after `sync` gave its optimizer
        its state), and the stacked AdamW takes the (shared) learning rate."""
        with warnings.catch_warnings():            # the lone optimizers are synced, never stepped
            warnings.simplefilter("ignore", UserWarning)
            for method in self.methods:
                method.end_epoch()
        lr = self.methods[0].optimizers[0].param_groups[0]["lr"]
        for group in self.opt.param_groups:
            group["lr"] = lr
