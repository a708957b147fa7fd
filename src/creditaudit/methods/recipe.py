"""A training recipe: the optimiser, its schedule, weight decay and batch size a rule trains under.

Each `Method` declares the recipe its authors published (`Method.recipe`, with the paper and the
place in it as `citation`); `SHARED` is the paper's own AdamW recipe, which the paper's seven keep
and which `--recipe shared` gives every rule, for a like-for-like comparison. A run resolves its
recipe once (`resolve`), records it in its config and run key, and `Method.add_optimizer` builds
torch's optimiser and LR scheduler from it (`build_optimizer`, `build_scheduler`).

    optimizer   "adamw" (decoupled weight decay), "adam" (L2 weight decay folded into the
                gradient, as torch.optim.Adam), "sgd" (heavy-ball `momentum`, optionally
                `nesterov`; L2 weight decay, as torch.optim.SGD) or "rmsprop" (torch.optim.RMSprop:
                smoothing 0.99, eps 1e-8, the defaults of Lua torch's optim.rmsprop that Nøkland's
                DFA code trains with; L2 weight decay)
    schedule    "cosine": lr_e = lr · (1 + cos(π e / E)) / 2, to 0 over the run's E epochs
                "step":   lr_e = lr · gamma^(number of milestones ≤ e)
                "constant"
                "half-linear": lr_e = lr for the first half of the run, then linearly towards 0:
                          lr_e = lr · (1 + 2(E − (e + 1)))/E once e + 1 > E/2 (Hinton's FF code,
                          ffnew.m:130-135, whose epochs count from 1: its last epoch runs at lr/E)
    milestones  the step schedule's decay points as fractions of the run, in (0, 1]. A paper's
                milestones are given in epochs of its own run of `paper_epochs`; a run of E epochs
                decays at epoch max(1, floor(E · m / paper_epochs + 1/2)) — the same fraction of
                training, rounded to the nearest epoch (`milestone_epochs`). PEPITA's 60 and 90 of
                100 are epochs 9 and 14 (13.5 rounds up) of a 15-epoch run.
    batch_size  the training batch size the paper fixes, or None (the run's default, 128)

Everything but `citation` changes what a run computes, so `settings()` (the run config's record of
the recipe, hashed into the run key) holds everything but the citation. A user's `--lr` and
`--weight-decay` override the recipe's lr and weight decay (`with_overrides`); the recorded recipe
then shows the override.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CreditAuditError

OPTIMIZERS = ("adamw", "adam", "sgd", "rmsprop")
SCHEDULES = ("cosine", "step", "constant", "half-linear")
CHOICES = ("published", "shared")     # --recipe: each rule's own, or SHARED for every rule
DEFAULT_BATCH_SIZE = 128              # a recipe that fixes no batch size trains with this


@dataclass(frozen=True)
class Recipe:
    optimizer: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.01
    momentum: float = 0.0
    nesterov: bool = False
    betas: tuple[float, float] = (0.9, 0.999)
    schedule: str = "cosine"
    milestones: tuple[float, ...] = ()      # fractions of the run (schedule "step")
    gamma: float = 0.1                      # the step schedule's factor per milestone
    batch_size: int | None = None
    citation: str = ""

    def __post_init__(self):
        def bad(what: str, value) -> CreditAuditError:
            return CreditAuditError(f"recipe {what} must be {value}")
        if self.optimizer not in OPTIMIZERS:
            raise bad("optimizer", f"one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.schedule not in SCHEDULES:
            raise bad("schedule", f"one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        for name in ("lr", "weight_decay", "momentum", "gamma"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise bad(name, f"a finite number ≥ 0, got {value!r}")
            object.__setattr__(self, name, float(value))
        if not isinstance(self.nesterov, bool):
            raise bad("nesterov", f"true or false, got {self.nesterov!r}")
        if self.nesterov and (self.optimizer != "sgd" or self.momentum == 0):
            raise bad("nesterov", "false unless the optimizer is sgd with momentum > 0")
        if self.optimizer not in ("sgd", "rmsprop") and self.momentum:
            raise bad("momentum", f"0 for {self.optimizer} (its betas set its averaging)")
        betas = tuple(self.betas) if isinstance(self.betas, (list, tuple)) else ()
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool)
                                      and 0 <= b < 1 for b in betas):
            raise bad("betas", f"two numbers in [0, 1), got {self.betas!r}")
        object.__setattr__(self, "betas", tuple(float(b) for b in betas))
        milestones = tuple(self.milestones) if isinstance(self.milestones, (list, tuple)) else None
        if milestones is None or not all(isinstance(m, (int, float)) and not isinstance(m, bool)
                                         and 0 < m <= 1 for m in milestones) \
                or list(milestones) != sorted(set(milestones)):
            raise bad("milestones", f"increasing fractions of the run in (0, 1], got {self.milestones!r}")
        if (self.schedule == "step") != bool(milestones):
            raise bad("milestones", "given exactly when the schedule is step")
        object.__setattr__(self, "milestones", tuple(float(m) for m in milestones))
        b = self.batch_size
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or not 1 <= b <= 10 ** 7):
            raise bad("batch_size", f"a positive integer or none, got {b!r}")

    # -- what a run records -----------------------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        """Everything that changes what a run computes (all but the citation), JSON-shaped."""
        d = dataclasses.asdict(self)
        del d["citation"]
        d["betas"], d["milestones"] = list(self.betas), list(self.milestones)
        return d

    @classmethod
    def from_settings(cls, settings: dict[str, Any], citation: str = "") -> "Recipe":
        """A recorded recipe back (a run's config.json); an unknown or missing key is refused."""
        if not isinstance(settings, dict):
            raise CreditAuditError(f"a recipe must be a table of settings, got {settings!r}")
        known = {f.name for f in dataclasses.fields(cls)} - {"citation"}
        unknown, missing = sorted(set(settings) - known), sorted(known - set(settings))
        if unknown or missing:
            raise CreditAuditError(
                f"the recorded recipe {'has unknown key(s) ' + ', '.join(unknown) if unknown else ''}"
                f"{'; ' if unknown and missing else ''}{'lacks ' + ', '.join(missing) if missing else ''}; "
                "rerun into a fresh --out")
        return cls(**settings, citation=citation)

    def with_overrides(self, lr: float | None = None, weight_decay: float | None = None,
                       batch_size: int | None = None) -> "Recipe":
        """This recipe with the user's explicit lr / weight decay / batch size (None: the recipe's)."""
        changes = {k: v for k, v in (("lr", lr), ("weight_decay", weight_decay), ("batch_size", batch_size))
                   if v is not None}
        return dataclasses.replace(self, **changes) if changes else self

    @property
    def train_batch_size(self) -> int:
        return DEFAULT_BATCH_SIZE if self.batch_size is None else self.batch_size

    def concrete(self) -> "Recipe":
        """This recipe with its batch size spelled out (a run records the one it trains with)."""
        return self if self.batch_size is not None else dataclasses.replace(self, batch_size=self.train_batch_size)

    def milestone_epochs(self, epochs: int) -> list[int]:
        """The step schedule's decay epochs in a run of `epochs` (see the module docstring)."""
        return sorted({max(1, math.floor(epochs * m + 0.5)) for m in self.milestones})

    def compact(self) -> str:
        """A few words for a terminal table: "AdamW lr1e-3 cos", "SGD m0.9 lr1e-2 step",
        "NAG m0.9 lr1e-4 const" (NAG: SGD with Nesterov momentum)."""
        optimiser = "NAG" if self.nesterov else {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD",
                                                  "rmsprop": "RMSprop"}[self.optimizer]
        parts = [optimiser] + ([f"m{self.momentum:g}"] if self.momentum else [])
        mantissa, exponent = f"{self.lr:.2e}".split("e")
        parts.append(f"lr{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}")
        parts.append({"cosine": "cos", "step": "step", "constant": "const", "half-linear": "half-lin"}[self.schedule])
        return " ".join(parts)

    def describe(self, epochs: int) -> str:
        """The whole recipe in words, for a run of `epochs` (its step milestones in epochs)."""
        name = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD", "rmsprop": "RMSprop"}[self.optimizer]
        if self.optimizer == "rmsprop":
            name += f" (momentum {self.momentum:g})" if self.momentum else ""
        elif self.optimizer == "sgd":
            name += (f" (momentum {self.momentum:g}{', Nesterov' if self.nesterov else ''})"
                     if self.momentum else " (no momentum)")
        elif self.betas != (0.9, 0.999):
            name += f" (betas {self.betas[0]:g}, {self.betas[1]:g})"
        schedule = {"cosine": "cosine to 0", "constant": "constant lr",
                    "half-linear": "constant lr for the first half of the run, then linear to 0",
                    "step": f"lr × {self.gamma:g} at epoch{'s' if len(self.milestones) > 1 else ''} "
                            f"{', '.join(map(str, self.milestone_epochs(epochs)))} of {epochs}"}[self.schedule]
        return (f"{name}, lr {self.lr:g}, weight decay {self.weight_decay:g}, {schedule}, "
                f"batch {self.train_batch_size}")


def step_at(epochs: tuple[int, ...], of: int) -> tuple[float, ...]:
    """A paper's step milestones, given in epochs of its run of `of` epochs, as fractions of it."""
    return tuple(e / of for e in epochs)


# the paper's recipe (its training scripts): what the paper's seven train under, and every rule under
# --recipe shared
SHARED = Recipe(optimizer="adamw", lr=1e-3, weight_decay=0.01, schedule="cosine",
                citation="the paper's recipe (its training scripts), shared: AdamW lr 1e-3, weight "
                         "decay 0.01, cosine to 0 over the run, batch 128")


def no_published_recipe(why: str) -> Recipe:
    """SHARED, for a rule whose paper gives no recipe this tool can follow; `why` says so."""
    return dataclasses.replace(SHARED, citation=f"{why} — the shared recipe is kept: {SHARED.citation}")


def resolve(published: Recipe, which: str, lr: float | None = None, weight_decay: float | None = None,
            batch_size: int | None = None) -> Recipe:
    """The recipe a run trains under: the method's `published` one or SHARED (`which`), with the
    user's explicit lr / weight decay / batch size over it, its batch size spelled out."""
    if which not in CHOICES:
        raise CreditAuditError(f"recipe must be one of {', '.join(CHOICES)}, got {which!r}")
    return (published if which == "published" else SHARED).with_overrides(lr, weight_decay, batch_size).concrete()


def build_optimizer(recipe: Recipe, params, fused: dict) -> torch.optim.Optimizer:
    """torch's optimiser for `recipe`; `fused` ({"fused": True} where supported) for AdamW and Adam."""
    if recipe.optimizer == "sgd":
        return torch.optim.SGD(params, lr=recipe.lr, momentum=recipe.momentum, nesterov=recipe.nesterov,
                               weight_decay=recipe.weight_decay)
    if recipe.optimizer == "rmsprop":
        return torch.optim.RMSprop(params, lr=recipe.lr, alpha=0.99, eps=1e-8, momentum=recipe.momentum,
                                   weight_decay=recipe.weight_decay)
    cls = torch.optim.AdamW if recipe.optimizer == "adamw" else torch.optim.Adam
    return cls(params, lr=recipe.lr, betas=recipe.betas, weight_decay=recipe.weight_decay, **fused)


def build_scheduler(recipe: Recipe, opt: torch.optim.Optimizer, epochs: int):
    """torch's LR schedule for `recipe` over a run of `epochs`, stepped once per epoch."""
    if recipe.schedule == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, epochs), eta_min=0.0)
    if recipe.schedule == "step":
        return torch.optim.lr_scheduler.MultiStepLR(opt, milestones=recipe.milestone_epochs(epochs),
                                                    gamma=recipe.gamma)
    if recipe.schedule == "half-linear":
        return torch.optim.lr_scheduler.LambdaLR(opt, HalfLinear(max(1, epochs)))
    return torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=0)


class HalfLinear:
    """The "half-linear" factor at epoch e (0-based) of a run of E epochs: Hinton's epsgain at his
    epoch e + 1 (ffnew.m:130-135), 1 while e + 1 ≤ E/2, then (1 + 2(E − e − 1))/E. A class, not a
    lambda, so that LambdaLR's state_dict keeps E with the checkpoint."""

    def __init__(self, epochs: int):
        self.epochs = epochs

    def __call__(self, e: int) -> float:
        epoch, total = e + 1, self.epochs
        return 1.0 if epoch <= total / 2 else max(0.0, (1 + 2 * (total - epoch)) / total)
