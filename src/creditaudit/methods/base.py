"""The one interface every credit-assignment method implements (SPEC §5, last paragraph).

A method owns the update rule and nothing else: the trainer hands it batches, the protocol asks
it for its credit signal. Adding a method = one file with a `Method` subclass + one line in
`methods/__init__.py` + its tests.

Conventions shared by all methods:
    e    = softmax(logits) − onehot(y)                       output error, (N, C)
    a_l  = the method's credit signal at residual position h_l, l = 0 … L, (N, d)
           (for BP: g_l = ∂CE/∂h_l of the mean-reduced CE; the sign convention is "direction of
           increasing loss", so a perfect method has cos(a_l, g_l) = +1)
    local loss of block l:  (f_l(h_l.detach()) · a_{l+1}.detach()).sum(-1).mean()
Only blocks listed in `settings.trainable_blocks` may change; the rest stay bit-identical
(the frozen control and the depth ladder rely on it).
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from ..errors import CreditAuditError
from ..metrics import bp_gradients
from ..model import ResidualMLP
from ..seeding import derived_generator


@dataclass
class MethodSettings:
    """What a method needs to know about the run. `options` holds method-specific knobs
    (e.g. EP's beta/steps/alpha, the bridges' hidden width); each method documents its own."""

    epochs: int
    seed: int = 42
    lr: float = 1e-3
    weight_decay: float = 0.01
    clip: float = 1.0
    lam: float = 0.0
    trainable_blocks: tuple[int, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)


def _fused_adamw_supported() -> bool:
    """The fused AdamW kernel (CPU and CUDA since torch 2.4) is ~6× faster than the foreach one
    on this model's CPU step; older torch falls back to the default implementation."""
    try:
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], fused=True)
        return True
    except (RuntimeError, TypeError, ValueError):
        return False


_FUSED = {"fused": True} if _fused_adamw_supported() else {}


def output_error(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """e = softmax(logits) − onehot(y), (N, C)."""
    return logits.softmax(-1) - F.one_hot(y, logits.shape[-1]).to(logits.dtype)


def rms_normalise(a: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """a / (rms(a) + eps), per sample along the feature dimension."""
    return a / (a.pow(2).mean(-1, keepdim=True).sqrt() + eps)


@dataclass
class LocalForward:
    """`Method.local_forward`'s result: logits (graph to the head only), h_0 … h_L (detached
    values), h_0 = embed(x) with its graph, and f_l(h_l.detach()) with graph per trainable block."""

    logits: torch.Tensor
    hidden: list[torch.Tensor]
    h0: torch.Tensor
    branches: dict[int, torch.Tensor]


def bp_credit(model: ResidualMLP, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """g_l = ∂CE/∂h_l (mean-reduced CE) at every residual position, l = 0 … L — the same
    reference the protocol measures against (`metrics.bp_gradients`)."""
    return bp_gradients(model, x, y).grads


class Method(ABC):
    """One credit-assignment rule behind the trainer's single interface.

    Subclasses set `name`, build their optimizers in __init__ with `add_optimizer`, and implement
    `train_step` and `credit`. Methods with random feedback set `random_feedback = True` and
    implement `fresh_feedback_credit` (the null calibration of Γ needs it).
    """

    name: ClassVar[str] = ""
    random_feedback: ClassVar[bool] = False
    option_defaults: ClassVar[dict[str, Any]] = {}   # the method's knobs (settings.options)
    option_ranges: ClassVar[dict[str, tuple[float, float]]] = {}  # inclusive [low, high] per knob

    @classmethod
    def resolve_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        """Defaults overridden by `options`; an unknown key or a wrong type is a user error."""
        unknown = sorted(set(options) - set(cls.option_defaults))
        if unknown:
            allowed = ", ".join(cls.option_defaults) or "none"
            raise CreditAuditError(f"method {cls.name!r} has no option(s) {', '.join(unknown)}; "
                                   f"its options: {allowed}")
        for key, value in options.items():
            default = cls.option_defaults[key]
            kind = float if isinstance(default, float) else type(default)
            if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else kind):
                raise CreditAuditError(f"option {key} of method {cls.name!r} must be a "
                                       f"{kind.__name__}, got {value!r}")
            low, high = cls.option_ranges.get(key, (-math.inf, math.inf))
            if not low <= value <= high:
                raise CreditAuditError(f"option {key} of method {cls.name!r} must lie in "
                                       f"[{low:g}, {high:g}], got {value!r}")
        return {**cls.option_defaults, **options}

    def __init__(self, model: ResidualMLP, settings: MethodSettings):
        self.model = model
        self.settings = settings
        self.gen = derived_generator(settings.seed, f"method:{self.name}")
        self.optimizers: list[torch.optim.Optimizer] = []
        self.schedulers: list[torch.optim.lr_scheduler.LRScheduler] = []

    # -- parameters by role -------------------------------------------------------------------
    def trainable(self, block: int) -> bool:
        return block in self.settings.trainable_blocks

    def block_params(self, block: int) -> list[torch.nn.Parameter]:
        return list(self.model.blocks[block].parameters())

    def trainable_block_params(self) -> list[torch.nn.Parameter]:
        return [p for l in range(self.model.n_blocks) if self.trainable(l) for p in self.block_params(l)]

    def embed_params(self) -> list[torch.nn.Parameter]:
        return list(self.model.embed.parameters())

    def head_params(self) -> list[torch.nn.Parameter]:
        """out_ln and out_head: trained on the true CE gradient by every method."""
        return list(self.model.out_ln.parameters()) + list(self.model.out_head.parameters())

    def local_param_groups(self) -> list[dict[str, Any]]:
        """AdamW parameter groups of a local-credit method: embed, each trainable block, head."""
        return ([{"params": self.embed_params()}]
                + [{"params": self.block_params(l)} for l in range(self.model.n_blocks)
                   if self.trainable(l)]
                + [{"params": self.head_params()}])

    def local_forward(self, x: torch.Tensor) -> "LocalForward":
        """One forward pass that is at once the model's forward and every local loss's graph.

        Each block sees its input detached, h_{l+1} = h_l + f_l(h_l) with h_l.detach(), so the
        values are exactly the model's forward, while the graph holds only the local pieces:
        embed(x) for the embedding, f_l(h_l.detach()) per trainable block, and the readout of
        h_L.detach() for the head. A local method thus pays for one forward per step, not two.
        """
        h0 = self.model.embed(x.flatten(1))
        h = h0.detach()
        hidden, branches = [h], {}
        for l, block in enumerate(self.model.blocks):
            if self.trainable(l):
                f = block(h)
                branches[l] = f
                h = h + f.detach()
            else:
                with torch.no_grad():
                    h = h + block(h)
            hidden.append(h)
        return LocalForward(self.model.readout(h), hidden, h0, branches)

    def local_update(self, opt: torch.optim.Optimizer, y: torch.Tensor, fwd: "LocalForward",
                     credit: list[torch.Tensor], lam: float = 0.0) -> torch.Tensor:
        """One fused step of a local-credit method (dfa, dfa-penalty, sb, cb), given a_0 … a_L:

            J = CE(out_head(out_ln(h_L.detach())), y)                            out_ln, out_head
              + (embed(x) · a_0).sum(-1).mean()                                  embed
              + Σ_{l trainable} (f_l(h_l.detach()) · a_{l+1}).sum(-1).mean()    block l
                                + λ · mean_i ‖f_l(h_l.detach())_i‖²

        The parameter sets of the terms are disjoint, so ONE backward of J gives each part exactly
        the gradient of its own loss; then each trainable block's gradient is clipped to norm
        `settings.clip` and one optimizer step is taken. Returns the batch CE (detached).
        """
        a = [t.detach() for t in credit]
        ce = F.cross_entropy(fwd.logits, y)
        total = ce + (fwd.h0 * a[0]).sum(-1).mean()
        for l, f in fwd.branches.items():
            total = total + (f * a[l + 1]).sum(-1).mean()
            if lam:
                total = total + lam * f.pow(2).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        total.backward()
        for l in fwd.branches:
            torch.nn.utils.clip_grad_norm_(self.block_params(l), self.settings.clip)
        opt.step()
        return ce.detach()

    def add_optimizer(self, params) -> torch.optim.Optimizer:
        """AdamW(lr, weight decay) with cosine annealing to 0 over the run (stepped per epoch)."""
        opt = torch.optim.AdamW(params, lr=self.settings.lr, weight_decay=self.settings.weight_decay,
                                **_FUSED)
        self.optimizers.append(opt)
        self.schedulers.append(torch.optim.lr_scheduler.CosineAnnealingLR(
            opt, T_max=max(1, self.settings.epochs), eta_min=0.0))
        return opt

    # -- the interface ------------------------------------------------------------------------
    @abstractmethod
    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Update the model on one batch; return the batch's CE loss (detached scalar tensor)."""

    @abstractmethod
    def credit(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        """The credit signal a_l this method would use on this batch, l = 0 … L (detached)."""

    def fresh_feedback_credit(self, x: torch.Tensor, y: torch.Tensor,
                              gen: torch.Generator) -> list[torch.Tensor]:
        """Credit with a freshly drawn set of feedback matrices (same distribution) — the null."""
        raise NotImplementedError(f"{self.name} has no random feedback to redraw")

    def end_epoch(self) -> None:
        for sched in self.schedulers:
            sched.step()

    # -- checkpointing ------------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        """Method state beyond the model weights (feedback matrices, auxiliary nets): tensors,
        numbers, strings, and nested dicts/lists of them. Saved in the run's checkpoint."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore what `extra_state` returned."""

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizers": [opt.state_dict() for opt in self.optimizers],
            "schedulers": [s.state_dict() for s in self.schedulers],
            "gen": self.gen.get_state(),
            "extra": self.extra_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for opt, s in zip(self.optimizers, state["optimizers"]):
            opt.load_state_dict(s)
        for sched, s in zip(self.schedulers, state["schedulers"]):
            sched.load_state_dict(s)
        self.gen.set_state(state["gen"])
        self.load_extra_state(state["extra"])
