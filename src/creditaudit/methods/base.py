"""The one interface every credit-assignment method implements.

A method owns the update rule and nothing else: the trainer hands it batches, the protocol asks
it for its credit signal. Adding a method = one file with a `Method` subclass + one line in
`methods/__init__.py` + its tests (docs/ARCHITECTURE.md). A method sees the model only through
`model.ResidualModel`: embed_input, blocks (the residual branches), readout and their parameters.
A method's knobs (λ included) are its `option_defaults`, validated by `resolve_options`.

Conventions shared by all methods:
    e    = softmax(logits) − onehot(y)                       output error, (N, C)
    a_l  = the method's credit signal at residual position h_l, l = 0 … L, (N, d)
           (for BP: g_l = ∂CE/∂h_l of the mean-reduced CE; the sign convention is "direction of
           increasing loss", so a perfect method has cos(a_l, g_l) = +1)
    local loss of block l:  (f_l(h_l.detach()) · a_{l+1}.detach()).sum(-1).mean()
Only blocks listed in `settings.trainable_blocks` may change; the rest stay bit-identical
(the frozen control and the depth ladder rely on it).

The member axis (SPEC §8): a method whose step is also written over a leading member axis
implements `member_gradients` (and, with per-run tensors such as feedback matrices,
`member_feedback`); the trainer then trains K runs of it on K models of one shape (the
architectures in `member_archs`) as one stack (`methods.members.MemberStack`), a lone run being
a stack of one. A method that does not (or a subclass that changed the lone step since) trains as
a stack of one through its lone step.
"""
from __future__ import annotations

import functools
import math
import warnings
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Iterator, Sequence

import torch

from ..errors import CreditAuditError
from ..model import ResidualModel
from ..seeding import derived_generator, from_one_state
from .recipe import SHARED, Recipe, build_optimizer, build_scheduler
from .setting import PaperSetting


@dataclass
class MethodSettings:
    """What a method needs to know about the run. `options` holds method-specific knobs
    (e.g. EP's beta/steps/alpha, the penalty λ `lam`); each method declares and documents its own."""

    epochs: int
    seed: int = 42
    lr: float | None = None             # None: the recipe's; a number overrides it
    weight_decay: float | None = None   # None: the recipe's; a number overrides it
    clip: float = 1.0
    trainable_blocks: tuple[int, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)
    batch_size: int = 128     # the training batch size (a method drawing per-sample noise sizes it by this)
    recipe: Recipe | None = None        # the optimiser and schedule (None: the method's published `recipe`)


@functools.cache
def fused_adamw() -> dict[str, bool]:
    """{"fused": True} where torch has the fused AdamW kernel (CPU and CUDA since torch 2.4: ~6×
    faster than the foreach one on this model's CPU step), else {} (the default implementation).
    Asked on first use, not at import: the probe builds an optimiser, and building one makes torch
    import torch._dynamo (seconds on a busy machine), which a command that trains nothing (a re-run,
    `report`, `check`) never needs."""
    try:
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], fused=True)
        return {"fused": True}
    except (RuntimeError, TypeError, ValueError):
        return {}


class Method(ABC):
    """One credit-assignment rule behind the trainer's single interface.

    Subclasses set `name`, build their optimizers in __init__ with `add_optimizer`, and implement
    `train_step` and `credit`. Methods with random feedback set `random_feedback = True` and
    implement `fresh_feedback_credit` (the null calibration of Γ needs it).
    """

    name: ClassVar[str] = ""
    random_feedback: ClassVar[bool] = False
    # what Γ's null means for this rule, or why it has none, when the generic reading ("the same Γ
    # under fresh random feedback draws") does not say it; the audit's report prints it beside Γ
    null_note: ClassVar[str] = ""
    # one of the seven methods the paper audits; the quick and paper presets train these, the zoo
    # preset every built-in
    paper: ClassVar[bool] = False
    summary: ClassVar[str] = ""      # one line for `audit --help`; default: the class's docstring's first line
    option_defaults: ClassVar[dict[str, Any]] = {}   # the method's knobs (settings.options)
    option_ranges: ClassVar[dict[str, tuple[float, float]]] = {}  # inclusive [low, high] per knob
    option_help: ClassVar[dict[str, str]] = {}       # one line per knob, for --help and the docs
    option_choices: ClassVar[dict[str, tuple[str, ...]]] = {}   # the allowed values of a str knob
    sweep: ClassVar[dict[str, tuple]] = {}           # option → values `penalty-sweep` runs over
    # options that act only on trainable blocks (e.g. the penalty λ on f_l), each with the value a
    # run without trainable blocks is spelled with: such a run is the same whatever their values
    # (`runs.canonical_control`)
    trainable_only_options: ClassVar[dict[str, Any]] = {}
    # the architectures `member_gradients` is written for (empty: the method trains lone)
    member_archs: ClassVar[tuple[type, ...]] = ()
    # the optimiser, schedule, weight decay and batch size the rule's authors published, with the
    # place in the paper (`methods/recipe.py`); the paper's seven keep the shared AdamW recipe
    recipe: ClassVar[Recipe] = SHARED
    # the rule's own paper's setting — data, plain-MLP size, output loss, recipe, epochs — and the
    # numbers the paper reports there, each with its source (methods/setting.py); None: none
    # declared. A subclass does not inherit it (the registry, creditaudit.papers, reads the class's
    # own). `creditaudit reproduce RULE` trains it
    paper_setting: ClassVar["PaperSetting | None"] = None
    # whether the rule's step reads settings.clip. A rule that does not (bp, fa, ep, pc, …) runs the
    # same whatever the clip: its run key ignores it (RunConfig) and `train --clip` is refused. A
    # user's rule may read it, so the default is True
    reads_clip: ClassVar[bool] = True

    @classmethod
    def clips(cls, options: dict[str, Any]) -> bool:
        """Whether the step reads settings.clip under these resolved options (`reads_clip`, unless
        the rule says per option: PEPITA clips under its "backprop" rule only)."""
        return cls.reads_clip

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
            if kind is str:
                if value not in cls.option_choices.get(key, (value,)):
                    raise CreditAuditError(f"option {key} of method {cls.name!r} must be one of "
                                           f"{', '.join(cls.option_choices[key])}, got {value!r}")
                continue
            low, high = cls.option_ranges.get(key, (-math.inf, math.inf))
            if kind is float and not math.isfinite(value):
                raise CreditAuditError(f"option {key} of method {cls.name!r} must be a finite "
                                       f"number, got {value!r}")
            if not low <= value <= high:
                raise CreditAuditError(f"option {key} of method {cls.name!r} must lie in "
                                       f"[{low:g}, {high:g}], got {value!r}")
        return {**cls.option_defaults, **options}

    @classmethod
    def option(cls, options: dict[str, Any], key: str) -> Any:
        """One resolved option value (the default when `options` does not set it)."""
        return {**cls.option_defaults, **options}[key]

    def __init__(self, model: ResidualModel, settings: MethodSettings):
        self.model = model
        self.settings = settings
        self.gen = derived_generator(settings.seed, f"method:{self.name}")
        base = type(self).recipe if settings.recipe is None else settings.recipe
        self.recipe: Recipe = base.with_overrides(settings.lr, settings.weight_decay)
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
        return self.model.embed_parameters()

    def head_params(self) -> list[torch.nn.Parameter]:
        """The readout (out_ln and out_head for the ResMLP): trained on the true CE gradient by
        every method."""
        return self.model.head_parameters()

    def add_optimizer(self, params) -> torch.optim.Optimizer:
        """The run's recipe (`self.recipe`) as torch's optimiser — AdamW (fused where supported),
        Adam or SGD with momentum — and its LR schedule over the run (cosine to 0, step decay at
        the recipe's milestones, or constant), stepped per epoch."""
        opt = build_optimizer(self.recipe, params, fused_adamw())
        self.optimizers.append(opt)
        self.schedulers.append(build_scheduler(self.recipe, opt, self.settings.epochs))
        return opt

    # -- the interface ------------------------------------------------------------------------
    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Update the model on one batch; return the batch's CE loss (detached scalar tensor).

        The built-in methods split the step in two: `gradients` (forward, credit, backward, clip:
        pure tensor work with no host sync, so it compiles with torch.compile(fullgraph=True))
        and `apply_gradients` (the optimizer steps). A user's method may override `train_step`
        as a whole instead; it then trains uncompiled."""
        self.clear_gradients()
        self.prepare_step()
        try:
            loss = self.gradients(x, y)
        finally:
            self.end_step()
        self.apply_gradients()
        return loss

    def prepare_step(self) -> None:
        """Eager work before `gradients`: draws from the method's generators (a compiled graph
        cannot hold a torch.Generator), module patches the step relies on. Nothing by default."""

    def end_step(self) -> None:
        """Eager work after `gradients` (also when it raised): undo what `prepare_step` set up."""

    def gradients(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Fill the .grad of every parameter the step updates (None on entry) and
        return the batch's CE (detached). No .item(), float(), bool() or data-dependent Python
        branch: the trainer may compile it (`step_function`)."""
        raise NotImplementedError(f"{type(self).__name__} implements neither train_step nor gradients")

    def clear_gradients(self) -> None:
        """Every parameter's .grad back to None, before `gradients` fills them (kept after the
        step, so a test or a user can read the update's gradient): the optimised ones, and the
        model's others too — a frozen block still requires grad, so a backward pass writes its
        .grad, which nothing would clear. Left alone, that .grad would pile up over the run, and
        under CUDA graphs it is an output of the last replay that the next one overwrites, which
        torch refuses to read (the frozen control's step failed on a GPU)."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        for p in self.model.parameters():
            p.grad = None

    def apply_gradients(self) -> None:
        """One step of every optimizer on the gradients `gradients` left."""
        for opt in self.optimizers:
            opt.step()

    # -- the member axis --------------------------------------------------------------------
    # everything a lone step runs: a subclass that overrides any of them (sign-symmetry rebuilds
    # fa's B in prepare_step, Kolen–Pollack learns B) computes another step than the member step
    _STEP_PATH: ClassVar[tuple[str, ...]] = ("gradients", "train_step", "prepare_step", "end_step",
                                             "apply_gradients", "clear_gradients")

    @classmethod
    def _lone_step(cls) -> tuple:
        return tuple(getattr(cls, name) for name in cls._STEP_PATH)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "member_gradients" in vars(cls):     # the lone step this member step was written for
            cls._member_step_of = cls._lone_step()

    @classmethod
    def on_member_axis(cls, arch: type) -> bool:
        """Whether K runs of this class on models of class `arch` can train as one stack: the
        class (or an ancestor) defines `member_gradients` for that architecture (`member_archs`),
        and the lone step (every method of `_STEP_PATH`) is still the one it was written beside —
        a subclass or a patch that changes any part of the lone step trains through it, as a stack
        of one."""
        written_for = getattr(cls, "_member_step_of", None)
        if not (written_for is not None and issubclass(arch, cls.member_archs)
                and written_for == cls._lone_step()):
            return False
        # a subclass below the class that wrote `member_gradients` may only set data (a name,
        # option defaults: dfa-penalty): any method it defines (`__init__`, `local_gradients`,
        # fa's `forward`, `add_optimizer`, …) may be one the lone step calls and the member step
        # never does, so such a subclass trains through its own lone step
        for klass in cls.__mro__:
            if "member_gradients" in vars(klass):
                return True
            if any(callable(v) and not isinstance(v, type) or isinstance(v, (classmethod, staticmethod, property))
                   for v in vars(klass).values()):
                return False
        return False

    def member_feedback(self) -> dict[str, torch.Tensor]:
        """This run's fixed tensors the member step reads (e.g. its feedback matrices), by name;
        the stack stacks them along the member axis, so member k reads run k's own draws."""
        return {}

    def member_modules(self) -> dict[str, torch.nn.Module]:
        """This run's auxiliary nets the member step trains or reads besides the model (sb's G_ψ,
        cb's V_φ and its EMA copy V̄), by name. The stack stacks their parameters (K, *shape) into
        `stack.modules[name]` like the model's — the trainable ones into its AdamW, with their
        lone optimizer's state — and `sync` copies member k's slices back into this module."""
        return {}

    def member_prepare_step(self, stack) -> dict[str, torch.Tensor]:
        """`prepare_step` of every member (`stack.methods`), eager, before `member_gradients`:
        each member's draws from its own generator, stacked (K, …); the stack keeps them as
        `stack.drawn` for the step. Called on member 0."""
        return {}

    def member_after_step(self, stack) -> None:
        """Eager work after the stack's AdamW step, before the frozen masks (cb: V̄'s EMA; ep:
        each member's residual and sweep count into its lone Method's epoch sums)."""

    def member_sync(self, stack, k: int) -> None:
        """What this lone Method (member k of `stack`) keeps beyond weights, optimizer state and
        `member_modules` (e.g. sb's and cb's last aux loss), from `stack.log`: the (K,)-leading
        tensors the member step leaves on it. Called by `MemberStack.sync`, per member."""

    def member_gradients(self, stack, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`gradients` over a leading member axis: fill the .grad of `stack.net.params` (stacked
        (K, …) leaves of a `model.members.MemberNet`: the ResMLP, vit-mini or resnet-small) for a
        batch x (K, B, …), y (K, B) and return each member's CE, (K,). `stack` (a `methods.members.MemberStack`) also holds
        `feedback` (the members' `member_feedback`, stacked (K, …)), `modules` (the members'
        `member_modules`' parameters, stacked), `drawn` (this step's `member_prepare_step`),
        `log` (an object the step may leave (K,)-leading tensors on, for `member_sync`), `trains`
        ((K, L) bool: which member trains which block) and `trained` (the blocks some member
        trains, a tuple). Means
        and norms are per member, never across members. Called on member 0, whose knobs (clip,
        options) every member shares. No host sync (it is compiled like `gradients`)."""
        raise NotImplementedError(f"{type(self).__name__} has no member-axis step")

    def compilable(self) -> bool:
        """Whether the step is the `gradients` + `apply_gradients` split (so `gradients` may be
        compiled); False for a method that overrides `train_step` itself."""
        return type(self).train_step is Method.train_step

    def step_function(self, fallback: bool = False, **compile_options):
        """The callable the trainer runs per batch: `train_step`, or with torch.compile options
        (mode="reduce-overhead" = CUDA graphs, backend="eager", …) `gradients` compiled whole
        between the eager `prepare_step` (generator draws) and `apply_gradients`
        (`compiled_step`). A method that overrides `train_step` is never compiled."""
        if not compile_options or not self.compilable():
            return self.train_step
        return compiled_step(self.gradients, self.clear_gradients, self.apply_gradients,
                             self.prepare_step, self.end_step, self.name, fallback, **compile_options)

    @abstractmethod
    def credit(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        """The credit signal a_l this method would use on this batch, l = 0 … L (detached)."""

    def trained_credit(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor] | None:
        """The credit a_0 … a_L exactly as the training step computes it, for a rule whose
        `credit` computes it otherwise (ep and pc relax in float64 with a rounding margin, so
        that Γ reproduces; their steps relax in the model's dtype with a strict test). The
        diagnosis reports the Γ of both (docs/PROTOCOL.md §3.13). None (the default): `credit`
        is the trained credit."""
        return None

    def exact_positions(self, n_blocks: int) -> frozenset[int]:
        """The residual positions l (0 … L = n_blocks) where this rule's credit a_l equals the true
        gradient g_l = ∂CE/∂h_l by construction, up to a positive per-sample factor (fa's a_L: the
        readout backpropagates exactly). Γ_l = 1 there says nothing about the rule, so the
        project's deep Γ and its null leave these positions out (protocol.deep_gamma); the paper's
        mean over 1 … L keeps them. Default: none — a rule of your own keeps every position.
        Each built-in claim is measured (Γ_l = 1 to 1e-6) in tests/test_gamma_exact.py."""
        return frozenset()

    def feedback_pairs(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """(name, W, B) for every forward weight W whose error travels back through a feedback
        weight B of W's shape instead of W itself (fa, sign-symmetry, kolen-pollack). The
        training-time monitor records cos(W, B) of the flattened pair per name (the weight
        alignment of Lillicrap et al. 2016). Default: none. A rule of your own with feedback
        weights returns its pairs here to have them recorded."""
        return []

    def fresh_feedback_credit(self, x: torch.Tensor, y: torch.Tensor,
                              gen: torch.Generator) -> list[torch.Tensor]:
        """Credit with a freshly drawn set of feedback matrices (same distribution) — the null."""
        raise NotImplementedError(f"{self.name} has no random feedback to redraw")

    def fresh_feedback_credits(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                               gen: torch.Generator) -> list[list[torch.Tensor]]:
        """`fresh_feedback_credit` on each of `batches` under one draw: every batch is given `gen`
        at its state on entry, so a rule that draws its feedback from `gen` first draws the same
        feedback for each (Γ's null: one draw is one feedback, docs/PROTOCOL.md). A rule whose draw
        is costly overrides this to draw once and reuse it (fa, dfa: the same values, bit for bit)."""
        return from_one_state(self.fresh_feedback_credit, batches, gen)

    def fresh_feedback_draws(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                             gens: Iterable[torch.Generator]) -> Iterator[list[list[torch.Tensor]]]:
        """Γ's null, draw after draw: `fresh_feedback_credits(batches, gen)` for each of `gens`.
        A rule whose forward pass does not depend on its feedback overrides this to run each
        batch's forward once for every draw (dfa: the same values, bit for bit)."""
        for gen in gens:
            yield self.fresh_feedback_credits(batches, gen)

    def _reproduces(self, cls: type, *names: str) -> bool:
        """Whether this rule's methods `names` are still `cls`'s own. A shortcut `cls` takes for its
        null (one draw for every batch, one forward for every draw) computes what those methods
        compute, so it may stand in for them only then: a subclass with a null of its own (a user's
        sparse or sign-concordant fa, an un-normalised dfa) keeps its own."""
        return all(getattr(type(self), name) is getattr(cls, name) for name in names)

    def end_epoch(self) -> None:
        for opt, sched in zip(self.optimizers, self.schedulers):
            if opt.state:       # an optimizer that never stepped (e.g. an aux net with nothing to fit)
                sched.step()    # keeps its schedule where it is, instead of warning each epoch

    def epoch_log(self) -> dict[str, float]:
        """Method-specific numbers for this epoch's line of the metrics log (e.g. EP's relaxation
        residual); plain floats. Called once per epoch, after the last step, so a method may keep
        device-side running sums during the epoch and read them here (no host sync per step)."""
        return {}

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
            if isinstance(sched, torch.optim.lr_scheduler.MultiStepLR):
                # the checkpoint keeps its milestones Counter as a plain {epoch: count} (no pickle)
                sched.milestones = Counter(sched.milestones)
        self.gen.set_state(state["gen"])
        self.load_extra_state(state["extra"])



def refuse_dropout(model, rule: str, why: str) -> None:
    """One line refusing a model trained with dropout (the plain MLP's `dropout` option) for a rule
    whose step compares several forward passes of one function (`why`): each pass would draw its
    own dropout mask."""
    if getattr(model, "dropout_p", 0.0) > 0:
        raise CreditAuditError(f"method {rule!r} does not train with dropout (arch mlp dropout = "
                               f"{model.dropout_p:g}): {why}, and each pass would draw its own "
                               "mask; set the mlp's dropout to 0")


def refuse_unless_vector_stream(model, rule: str, why: str, dropout_why: str) -> None:
    """One line refusing an architecture other than the ResMLP and the plain MLP for a rule written
    for a per-sample vector stream (`why`: what it would need elsewhere), and dropout (`dropout_why`,
    `refuse_dropout`)."""
    from ..model.plain import PlainMLP
    from ..model.resmlp import ResidualMLP
    if not isinstance(model, (ResidualMLP, PlainMLP)):
        raise CreditAuditError(f"method {rule!r} trains on arch resmlp or mlp only, got "
                               f"{type(model).__name__}: {why}; use --arch resmlp or --arch mlp")
    refuse_dropout(model, rule, dropout_why)


def checked_feedback_pairs(method: Method) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """`method.feedback_pairs()`, each pair checked before cos(W, B) is read from it: a list of
    (name, W, B) with name a string, W a parameter of the method's model (a forward weight: W comes
    first), B a tensor of W's shape other than W itself. A transposed B of a non-square W has
    another shape and is refused; of a square W it cannot be told from shapes — the declared order
    (W, then B as the backward pass uses it) is then the rule's word. Anything else would end in a
    tensor-size error inside the monitor, or record a meaningless cos(W, B): one line naming
    feedback_pairs and the fix instead."""
    name = getattr(method, "name", type(method).__name__)
    fix = ("return a list of (name, W, B): W a forward weight of the model, B the feedback weight "
           "standing in for it, of W's shape (docs/WRITING_A_RULE.md)")
    try:
        pairs = method.feedback_pairs()
    except Exception as err:  # noqa: BLE001 — a user's declaration failing is theirs to fix
        raise CreditAuditError(f"method {name!r}: feedback_pairs() raised {type(err).__name__}: "
                               f"{' '.join(str(err).split())[:160]}; {fix}") from None
    if not isinstance(pairs, (list, tuple)):
        raise CreditAuditError(f"method {name!r}: feedback_pairs() returned a {type(pairs).__name__}; {fix}")
    params = {id(q) for q in method.model.parameters()}
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 3 and isinstance(pair[0], str)
                and all(isinstance(t, torch.Tensor) for t in pair[1:])):
            raise CreditAuditError(f"method {name!r}: feedback_pairs() item {i} is {pair!r:.80}; {fix}")
        key, w, b = pair
        if id(w) not in params:
            raise CreditAuditError(f"method {name!r}: feedback_pairs() {key!r}: its W (shape "
                                   f"{tuple(w.shape)}) is not a parameter of the model — the pair order is "
                                   f"(name, W, B), W first; {fix}")
        if b is w or tuple(b.shape) != tuple(w.shape):
            what = "W itself" if b is w else f"shape {tuple(b.shape)}"
            raise CreditAuditError(f"method {name!r}: feedback_pairs() {key!r}: B is {what}, W has shape "
                                   f"{tuple(w.shape)}{' (B is W transposed?)' if tuple(b.shape) == tuple(w.shape)[::-1] else ''}; {fix}")
    return list(pairs)


def compiled_step(gradients, clear, apply, prepare=None, end=None, name: str = "", fallback: bool = False,
                  **compile_options):
    """A step `clear → prepare → gradients → end → apply` whose `gradients` is compiled whole
    (fullgraph=True: a graph break is an error, not a silent host round trip). The eager
    `prepare`/`end` hold what a graph cannot (generator draws, module patches); `apply` (the
    optimizer steps) stays outside, as AdamW's first call initialises state Dynamo does not trace.
    fallback=True: if the compiled `gradients` raises (a compiler failure: tracing fails before
    anything is updated), warn once and compute the gradients eagerly, then and from then on; the
    optimizer step is never repeated."""
    state = {"gradients": torch.compile(gradients, fullgraph=True, **compile_options)}

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        clear()
        if prepare is not None:
            prepare()
        try:
            compiled = state["gradients"]
            try:
                with torch._dynamo.config.patch(trace_autograd_ops=True):   # backward() in the graph
                    loss = compiled(x, y)
            except Exception as err:  # noqa: BLE001 — a compiler failure must not lose the run
                if not fallback or compiled is gradients:
                    raise
                first = str(err).splitlines()[0] if str(err) else ""
                warnings.warn(f"compiling the {name} step failed ({type(err).__name__}: "
                              f"{first}); training eagerly")
                state["gradients"] = gradients
                clear()
                loss = gradients(x, y)
        finally:
            if end is not None:
                end()
        apply()
        return loss
    return step
