"""Every knob of a run and of an audit, with its one default (docs/PROTOCOL.md §4 for the paper's).

A `RunConfig` says everything that determines a run's result; it is saved in the run folder and
its hash (`run_key`) identifies the run, so an audit can reuse finished runs. "Everything" means:
the settings, the method's options with its defaults filled in, the stop thresholds of the
early-stop rule, a digest of the data's contents (`data_digest`, bound when the data are loaded)
and the version of the training code (`code_version`: the package version and
`TRAINING_CODE_VERSION`). Where the run happens (device, data folder, output folder) is not part
of it: the same data in another folder is the same run. An `AuditConfig` is methods × seeds (with
their controls) on one dataset and model. The command line builds its options from these
dataclasses (`field_help`), and TOML files are validated against them, so a default lives here
and nowhere else. Method knobs (EP's β, the penalty λ, …) belong to the methods
(`Method.option_defaults`); this module only routes them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from . import __version__
from .errors import CreditAuditError
from .methods import REFERENCE_METHOD
from .verdict import Thresholds

INT64_MAX = 2 ** 63 - 1
PRECISIONS = ("fp32", "tf32", "bf16")   # a run's training-step numerics (RunConfig.precision)
MAX_COUNT = 100_000             # the largest epochs / width / blocks / … accepted: larger is a typo
PENALTY_OPTION = "lam"          # the residual penalty λ: the audit's [training] lam goes to every
                                # method that declares this option

# Bump this when a change to the training code (train.py, methods/, model/, data/) changes what a
# run computes for the same settings: every run key changes with it, so audits retrain instead of
# reusing runs of the old code. The package version is in the key as well. 2: cb draws its noise on
# the CPU generator on every device (its CUDA runs change). Not bumped for the member axis: a lone
# run now steps through baddbmm instead of plain matmuls, the same arithmetic up to rounding order
# (≤ 5e-16 relative in float64, tests/test_members.py against the lone trainer's runs; ≤ 3e-7 in
# float32 after 3 epochs with identical test accuracy). 3: each rule trains under its published
# recipe (methods/recipe.py), and a run records the resolved recipe; the monitor's history records
# the alignment over training (Γ_l, cos(W, B)) every k-th epoch. 4: PEPITA steps as its reference
# code does (no division by the modulation scale, no standing clip, no bias update); Kolen–Pollack
# and sign-symmetry train under their sources' recipes; the plain MLP (arch mlp).
TRAINING_CODE_VERSION = 4
CODE_VERSION = f"{__version__}+train{TRAINING_CODE_VERSION}"

# the thresholds the early-stop rule (verdict.stop_rule: flags (a), (a′), (b′)) reads; a run with
# --stop-when-flagged records them, so other thresholds give another run
STOP_THRESHOLD_KEYS = ("growth", "init_growth", "stack_growth", "gain")


def _help(text: str, **meta) -> dict:
    return {"help": text, **meta}


@dataclass(frozen=True)
class RunConfig:
    """One run: method × dataset × architecture × seed × schedule, plus the depth control.

    trainable_blocks: None = every block trains; k = only the last k blocks train (the depth
    ladder); 0 = the frozen-blocks control. `blocks = 0` is the shallow control.
    stop_when_flagged: end the run once a monitor flag ((a), (a′) or (b′)) has held this many
    consecutive epochs (None = train to the end); stop_thresholds: the thresholds of that rule
    (`STOP_THRESHOLD_KEYS`, defaults of `verdict.Thresholds` filled in; empty without early stop).
    options: the method's options, resolved (its defaults filled in), so a changed default is a
    changed run. data_digest: sha256 of the training/test tensors (`ArrayDataset.digest`), None
    until the data are loaded (`bind_data`). code_version: the training code that trains it.
    recipe: "published" (the method's `Method.recipe`) or "shared" (`methods.SHARED_RECIPE`) on the
    way in, the resolved recipe's settings (a dict, `Recipe.settings`) once built; lr,
    weight_decay, batch_size: None = the recipe's, a value overrides it, and once built they hold
    what the run trains with.
    """

    method: str = field(default=REFERENCE_METHOD, metadata=_help("credit-assignment method, or PKG.MODULE:CLASS"))
    dataset: str = field(default="mnist1d", metadata=_help("dataset"))
    arch: str = field(default="resmlp", metadata=_help("architecture"))
    seed: int = field(default=42, metadata=_help("seed (weights, data order, feedback matrices)"))
    epochs: int = field(default=100, metadata=_help("training epochs"))
    batch_size: int | None = field(default=None, metadata=_help(
        "training batch size (None: the recipe's, else 128)"))
    lr: float | None = field(default=None, metadata=_help(
        "learning rate (None: the recipe's); overrides the recipe's"))
    weight_decay: float | None = field(default=None, metadata=_help(
        "weight decay (None: the recipe's); overrides the recipe's"))
    recipe: Any = field(default="published", metadata=_help(
        "the optimiser and schedule: published (each rule's own paper's: optimiser, lr, momentum, "
        "schedule, weight decay, batch size) or shared (the paper's AdamW recipe for every rule)"))
    width: int = field(default=256, metadata=_help("residual width d (channels for resnet-small)"))
    blocks: int = field(default=4, metadata=_help("number of residual blocks L (≥ 1; --shallow for none)"))
    activation: str = field(default="gelu", metadata=_help("block activation (resmlp)"))
    w2_std: float = field(default=0.01, metadata=_help("init std of each block's last layer"))
    clip: float = field(default=1.0, metadata=_help(
        "gradient-norm clip per block for the rules that clip (the local-credit ones); a rule that "
        "clips nothing ignores it (train refuses it there)"))
    trainable_blocks: int | None = None
    stop_when_flagged: int | None = None
    stop_thresholds: dict[str, float] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    arch_options: dict[str, Any] = field(default_factory=dict)
    data_digest: str | None = None
    code_version: str = CODE_VERSION
    precision: str = field(default="fp32", metadata=_help(
        "training-step numerics: fp32 (default; (b) is the fp32 floor), tf32 (TF32 matmuls and "
        "convolutions on CUDA) or bf16 (bfloat16 autocast); diagnostics are always fp32"))

    def __post_init__(self):
        from .data import DATASET_NAMES
        from .methods import method_class, resolve_method_name
        from .model import ACTIVATIONS, ARCH_OPTIONS, ARCHITECTURES
        # one rule is one method however it is spelled: its run key and folder name use one name
        object.__setattr__(self, "method", resolve_method_name(self.method))
        cls = method_class(self.method)
        if self.dataset not in DATASET_NAMES:
            raise CreditAuditError(
                f"unknown dataset {self.dataset!r}; choose one of: {', '.join(DATASET_NAMES)}")
        if self.arch not in ARCHITECTURES:
            raise CreditAuditError(
                f"unknown architecture {self.arch!r}; choose one of: {', '.join(ARCHITECTURES)}")
        if self.activation not in ACTIVATIONS:
            raise CreditAuditError(
                f"unknown activation {self.activation!r}; choose one of: {', '.join(ACTIVATIONS)}")
        self._resolve_recipe(cls)
        for name in ("seed", "epochs", "batch_size", "width", "blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise CreditAuditError(f"{name} must be an integer, got {value!r}")
        for name in ("epochs", "batch_size", "width"):
            if not 1 <= getattr(self, name) <= (10 ** 7 if name == "batch_size" else MAX_COUNT):
                raise CreditAuditError(f"{name} must be a positive integer ≤ "
                                       f"{10 ** 7 if name == 'batch_size' else MAX_COUNT}, got {getattr(self, name)!r}")
        if not 0 <= self.seed <= INT64_MAX:
            raise CreditAuditError(f"seed must lie in 0 … 2^63−1, got {self.seed}")
        if not 0 <= self.blocks <= MAX_COUNT:
            raise CreditAuditError(f"blocks must be an integer in 0 … {MAX_COUNT}, got {self.blocks!r}")
        k = self.trainable_blocks
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= self.blocks):
            raise CreditAuditError(
                f"trainable_blocks must be an integer in 0..{self.blocks} (the number of blocks), got {k!r}")
        if k == self.blocks:  # "all blocks train" has one spelling, so equal runs share one key
            object.__setattr__(self, "trainable_blocks", None)
        for name in ("w2_std",):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise CreditAuditError(f"{name} must be a finite number ≥ 0, got {value!r}")
        self._refuse_unread_model_settings()
        if isinstance(self.clip, bool) or not isinstance(self.clip, (int, float)) \
                or not math.isfinite(self.clip) or self.clip <= 0:
            raise CreditAuditError(f"clip must be a finite number > 0, got {self.clip!r}")
        object.__setattr__(self, "clip", float(self.clip))
        if not isinstance(self.options, dict):
            raise CreditAuditError(f"options must be a table of method options, got {self.options!r}")
        # resolved: the defaults filled in (a changed default changes the key), floats as floats
        # (lam = 1 and lam = 1.0 are one run)
        object.__setattr__(self, "options", {
            k: float(v) if isinstance(cls.option_defaults[k], float) else v
            for k, v in sorted(cls.resolve_options(self.options).items())})
        if not cls.clips(self.options):     # a rule that clips nothing is one run whatever the clip
            object.__setattr__(self, "clip", float(default(RunConfig, "clip")))
        unknown = sorted(set(self.arch_options) - set(ARCH_OPTIONS[self.arch]))
        if unknown:
            raise CreditAuditError(f"architecture {self.arch!r} has no option(s) {', '.join(unknown)}; "
                                   f"its options: {', '.join(ARCH_OPTIONS[self.arch]) or 'none'}")
        from .model import resolve_arch_options
        resolve_arch_options(self.arch, self.arch_options)     # each value, refused in one line now
        if self.precision not in PRECISIONS:
            raise CreditAuditError(f"precision must be one of {', '.join(PRECISIONS)}, got "
                                   f"{self.precision!r}")
        swf = self.stop_when_flagged
        if swf is not None and (not isinstance(swf, int) or isinstance(swf, bool) or not 1 <= swf <= MAX_COUNT):
            raise CreditAuditError(
                f"stop_when_flagged must be ≥ 1 epoch, got {self.stop_when_flagged!r}")
        object.__setattr__(self, "stop_thresholds", _stop_thresholds(self.stop_thresholds, swf))
        if self.data_digest is not None and not (isinstance(self.data_digest, str)
                                                 and len(self.data_digest) == 64):
            raise CreditAuditError(f"data_digest must be a sha256 hex digest, got {self.data_digest!r}")
        if not isinstance(self.code_version, str):
            raise CreditAuditError(f"code_version must be a string, got {self.code_version!r}")

    def _refuse_unread_model_settings(self) -> None:
        """A model setting the architecture does not read is refused: kept, it would change the run
        key (a retrain) and the record while the network stays the same one."""
        unread = {"resnet-small": ("activation", "its blocks are ReLU BasicBlocks"),
                  "mlp": ("w2_std", "the plain MLP has no residual branch to start near identity")}
        if self.arch in unread:
            name, why = unread[self.arch]
            if getattr(self, name) != default(RunConfig, name):
                raise CreditAuditError(
                    f"{self.arch} does not read {name} ({why}), got {name} = {getattr(self, name)!r}; "
                    f"remove --{name.replace('_', '-')} (or {name} in [model])")

    def _resolve_recipe(self, method_cls) -> None:
        """`recipe` "published" / "shared" → the resolved recipe's settings (a dict; the run key
        hashes these, not the switch, so a rule whose published recipe is the shared one is the
        same run under either); an explicit lr / weight decay / batch size overrides the recipe's,
        and the three fields then hold the values the run trains with. A recorded dict (a run's
        config.json) is validated and kept."""
        from .methods import Recipe
        from .methods.recipe import resolve
        for name in ("lr", "weight_decay"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value < 0):
                raise CreditAuditError(f"{name} must be a finite number ≥ 0, got {value!r}")
        b = self.batch_size
        if b is not None and (not isinstance(b, int) or isinstance(b, bool)):
            raise CreditAuditError(f"batch_size must be an integer, got {b!r}")
        if b is not None and not 1 <= b <= 10 ** 7:
            raise CreditAuditError(f"batch_size must be a positive integer ≤ {10 ** 7}, got {b!r}")
        if isinstance(self.recipe, str):
            recipe = resolve(method_cls.recipe, self.recipe, self.lr, self.weight_decay, self.batch_size)
        elif isinstance(self.recipe, dict):
            recipe = Recipe.from_settings(self.recipe).with_overrides(self.lr, self.weight_decay,
                                                                      self.batch_size).concrete()
        else:
            raise CreditAuditError(f"recipe must be published or shared, got {self.recipe!r}")
        object.__setattr__(self, "recipe", recipe.settings())
        object.__setattr__(self, "lr", recipe.lr)
        object.__setattr__(self, "weight_decay", recipe.weight_decay)
        object.__setattr__(self, "batch_size", recipe.train_batch_size)

    @property
    def resolved_recipe(self):
        """The run's recipe (`methods.Recipe`), with the method's citation when it is the
        method's published one, else the shared recipe's."""
        from .methods import SHARED_RECIPE, Recipe, method_class
        for candidate in self._recipe_candidates():
            settings = candidate.with_overrides(self.lr, self.weight_decay, self.batch_size).concrete().settings()
            if settings == self.recipe:
                return Recipe.from_settings(self.recipe, candidate.citation)
        return Recipe.from_settings(self.recipe)

    def _recipe_candidates(self) -> list:
        """The recipes a run's may be, first match naming it: the rule's published one (its
        recipe on the audit's own network, adapted from its paper), the shared one, and the
        recipe of the rule's own paper setting (`creditaudit reproduce`; bp's is the rule's)."""
        from .methods import SHARED_RECIPE, method_class
        cls = method_class(self.method)
        papers = [] if cls.__dict__.get("paper_setting") is None else [cls.__dict__["paper_setting"].recipe]
        return [cls.recipe, SHARED_RECIPE, *papers]

    @property
    def recipe_record(self) -> dict[str, Any]:
        """The run's recipe for a report (audit.json): its settings, the milestones in this run's
        epochs, a compact label and a description, the citation, and whether it is the rule's
        published recipe adapted to the audit's setting ("published": its paper's optimiser, lr,
        weight decay and batch size, its step milestones at the same fractions of this run, on
        this audit's network and data), the shared one (both: the paper's seven), the recipe of
        the rule's paper setting ("paper setting", `creditaudit reproduce`), or none of them (an
        explicit lr, weight decay or batch size over it)."""
        from .methods import SHARED_RECIPE, method_class
        recipe = self.resolved_recipe
        cls = method_class(self.method)
        published = cls.recipe.concrete().settings()
        setting = cls.__dict__.get("paper_setting")
        source = [name for name, settings in (
            ("published", published), ("shared", SHARED_RECIPE.concrete().settings()),
            ("paper setting", None if setting is None else setting.recipe.concrete().settings()))
            if settings == self.recipe]
        return {**self.recipe, "milestone_epochs": recipe.milestone_epochs(self.epochs),
                "label": recipe.compact(), "description": recipe.describe(self.epochs),
                "citation": recipe.citation, "source": " = ".join(source) or "overridden"}

    @property
    def trainable_block_ids(self) -> tuple[int, ...]:
        """Indices of the blocks that train: the last k, or all of them."""
        k = self.blocks if self.trainable_blocks is None else self.trainable_blocks
        return tuple(range(self.blocks - k, self.blocks))

    @property
    def control(self) -> str:
        """'shallow', 'frozen', 'ladder-k' or 'none' — the depth control this run is."""
        if self.blocks == 0:
            return "shallow"
        if self.trainable_blocks == 0:
            return "frozen"
        if self.trainable_blocks is not None and self.trainable_blocks < self.blocks:
            return f"ladder-{self.trainable_blocks}"
        return "none"

    @property
    def lam(self) -> float:
        """The residual penalty λ this run trains with (0 for methods without one)."""
        from .methods import method_class
        cls = method_class(self.method)
        return float(cls.option(self.options, PENALTY_OPTION)) if PENALTY_OPTION in cls.option_defaults else 0.0

    @property
    def label(self) -> str:
        """A short human name: method[λ][/control]/seed."""
        name = self.method + (f"(λ={self.lam:g})" if self.lam else "")
        if self.control != "none":
            name += f"/{self.control}"
        return f"{name}/s{self.seed}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunConfig":
        """A saved config back (every field present: a config.json of an older creditaudit, which
        lacks fields that are now part of a run, is refused rather than completed with guesses)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise CreditAuditError(
                f"unknown run config key(s) {unknown}; allowed: {', '.join(sorted(known))}")
        missing = sorted(known - set(d))
        if missing:
            raise OutdatedRunConfig(
                f"the run config was written by an older creditaudit (no {', '.join(missing)}); "
                "its run cannot be checked against this version's settings — rerun into a fresh --out")
        return cls(**d)

    def replace(self, **changes) -> "RunConfig":
        return dataclasses.replace(self, **changes)

    def bind_data(self, digest: str) -> "RunConfig":
        """This config with the digest of the data it trains on; refused if it names other data."""
        if self.data_digest not in (None, digest):
            raise CreditAuditError(
                f"the {self.dataset} data loaded now (digest {digest[:12]}) are not the data this run "
                f"was set up with (digest {self.data_digest[:12]}); point --data-dir at the run's "
                "data, or rerun into a fresh --out")
        return self if self.data_digest == digest else self.replace(data_digest=digest)

    @property
    def rule_code(self) -> str | None:
        """For a user's rule (PKG.MODULE:CLASS), the digest of the code it runs: its module and
        every module of its own package it imports, transitively (`methods.rule_code`); None for
        a built-in rule, whose code `code_version` covers."""
        from .methods import METHODS
        from .methods.rule_code import code_digest, code_of
        return None if self.method in METHODS else code_digest(code_of(self.method))

    @property
    def run_key(self) -> str:
        """A stable 12-hex-digit hash of the resolved config: every field, so every setting,
        resolved option, stop threshold, the data digest and the code version; for a user's rule
        also the digest of its code (`rule_code`: an edit of the rule or of a helper it imports is
        another run). A built-in rule's key hashes the fields alone, as it always has, so existing
        run folders keep their keys."""
        fields = self.to_dict()
        code = self.rule_code
        if code is not None:
            fields["rule_code"] = code
        blob = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def recipe_yardstick(config: RunConfig) -> RunConfig | None:
    """The yardstick of `config`'s frozen control: the reference method's (bp's) frozen control
    with every other setting of `config` — its recipe (optimiser, schedule, lr, weight decay,
    batch size) included, so that a control trained under SGD is not judged against one trained
    under AdamW. None for a run with no block to freeze."""
    if config.blocks == 0:
        return None
    return config.replace(method=REFERENCE_METHOD, options={}, trainable_blocks=0)


def recipe_key(config: RunConfig) -> str:
    """The resolved recipe's settings as one key (methods sharing it pool their seed spread)."""
    blob = json.dumps({"recipe": config.recipe, "lr": config.lr, "weight_decay": config.weight_decay,
                       "batch_size": config.batch_size}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


class OutdatedRunConfig(CreditAuditError):
    """A config.json from before a field became part of a run (see `RunConfig.from_dict`)."""


def _stop_thresholds(given: Any, stop_when_flagged: int | None) -> dict[str, float]:
    """The early-stop rule's thresholds, resolved: every `STOP_THRESHOLD_KEYS` value (defaults of
    `verdict.Thresholds` filled in) when the run stops early, {} when it does not (one spelling)."""
    if not isinstance(given, dict):
        raise CreditAuditError(f"stop_thresholds must be a table of thresholds, got {given!r}")
    defaults = dataclasses.asdict(Thresholds())
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise CreditAuditError(f"unknown threshold(s) {', '.join(unknown)}; "
                               f"allowed: {', '.join(defaults)}")
    for key, value in given.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value < 0:
            raise CreditAuditError(f"threshold {key} must be a finite number ≥ 0, got {value!r}")
    if stop_when_flagged is None:
        return {}
    return {k: float(given.get(k, defaults[k])) for k in STOP_THRESHOLD_KEYS}


def default(cls, name: str) -> Any:
    """The default of dataclass field `name` (for the command line's --help)."""
    f = cls.__dataclass_fields__[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def field_help(cls, name: str) -> str:
    return cls.__dataclass_fields__[name].metadata.get("help", "")


# -- audits -----------------------------------------------------------------------------------
MODEL_KEYS = ("arch", "width", "blocks", "activation", "w2_std")
TRAINING_KEYS = ("batch_size", "lr", "weight_decay", "clip", PENALTY_OPTION, "stop_when_flagged", "precision")
THRESHOLD_KEYS = tuple(f.name for f in dataclasses.fields(Thresholds))
CONTROLS = ("frozen", "shallow")
EXECUTORS = ("local", "ray")


@dataclass(frozen=True)
class AuditConfig:
    """An audit: methods × seeds (each with its frozen and shallow controls) on one dataset/model."""

    dataset: str = field(default="mnist1d", metadata=_help("dataset"))
    methods: tuple[str, ...] = field(default=(REFERENCE_METHOD,), metadata=_help("methods to audit"))
    seeds: tuple[int, ...] = field(default=(42, 123, 456), metadata=_help("seeds"))
    epochs: int = field(default=100, metadata=_help("training epochs per run"))
    out: str = field(default="audits/audit", metadata=_help("audit folder"))
    data_dir: str = field(default="data", metadata=_help("where datasets live"))
    device: str = field(default="auto", metadata=_help("cpu, cuda, cuda:N or auto"))
    jobs: int = field(default=0, metadata=_help(
        "parallel workers, each a run or a stack at a time (0 = one per CPU core; 1 on CUDA, where N "
        "workers share the GPU and a Ray task asks 1/N of it)"))
    controls: tuple[str, ...] = CONTROLS
    eval_batches: int = field(default=8, metadata=_help("disjoint eval batches for the diagnostics (≥ 8 for (c))"))
    executor: str = field(default="local", metadata=_help("where runs execute"))
    address: str | None = field(default=None, metadata=_help("Ray cluster address (auto or HOST:PORT)"))
    max_retries: int = field(default=3, metadata=_help("Ray: retries of a run whose worker died"))
    recipe: str = field(default="published", metadata=_help(
        "published: each rule under its paper's optimiser, schedule, weight decay and batch size; "
        "shared: every rule under the paper's AdamW recipe (a like-for-like comparison)"))
    stack: bool | None = field(default=None, metadata=_help(
        "train runs that share a model shape as one batched stack (None: where measured to pay — "
        "always on CUDA, not on CPU)"))
    model: dict[str, Any] = field(default_factory=dict)
    training: dict[str, Any] = field(default_factory=dict)
    thresholds: dict[str, float] = field(default_factory=dict)
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    preset: str | None = None
    # a method's own recipe settings (`Recipe.settings()`), overriding `recipe` for that method:
    # `creditaudit reproduce` trains each rule and bp under its paper's recipe this way
    recipes: dict[str, dict[str, Any]] = field(default_factory=dict)

    def run_configs(self) -> list[RunConfig]:
        """Every run the audit needs, validated (so a bad value fails before any training)."""
        runs = []
        for method in self.methods:
            for seed in self.seeds:
                base = self.base_config(method, seed)
                runs.append(base)
                if "frozen" in self.controls and base.blocks > 0:
                    runs.append(base.replace(trainable_blocks=0))
                if "shallow" in self.controls and base.blocks > 0:
                    runs.append(base.replace(blocks=0))
        keys = {c.run_key for c in runs}
        return runs + [c for c in self.yardstick_configs() if c.run_key not in keys]

    def yardstick_configs(self) -> list[RunConfig]:
        """The yardsticks of the audit's frozen controls: for every distinct recipe × seed, the
        reference method's (bp's) frozen control under that recipe (`recipe_yardstick`) — the same
        frozen blocks (a seed's initial weights depend on the seed and the model alone), embedding
        and readout trained by exact gradients on the same data, budget and recipe. A rule that
        shares bp's recipe shares bp's own frozen control; every other recipe gets its own, trained
        once and reused by each rule under it (docs/PROTOCOL.md "The yardstick")."""
        if "frozen" not in self.controls:
            return []
        found: dict[str, RunConfig] = {}
        for method in self.methods:
            for seed in self.seeds:
                yard = recipe_yardstick(self.base_config(method, seed))
                if yard is not None:
                    found.setdefault(yard.run_key, yard)
        return list(found.values())

    def base_config(self, method: str, seed: int) -> RunConfig:
        """The main run of `method` at `seed`: the audit's λ goes to every method that declares it,
        and [options.METHOD] may override it per method."""
        from .methods import method_class
        training = dict(self.training)
        lam = training.pop(PENALTY_OPTION, None)
        options = dict(self.options.get(method, {}))
        if lam is not None and PENALTY_OPTION in method_class(method).option_defaults:
            options.setdefault(PENALTY_OPTION, lam)
        model = dict(self.model)
        arch_options = model.pop("options", {})
        recipe = dict(self.recipes[method]) if method in self.recipes else self.recipe
        return RunConfig(method=method, dataset=self.dataset, seed=seed, epochs=self.epochs,
                         recipe=recipe, options=options, arch_options=dict(arch_options),
                         stop_thresholds=dict(self.thresholds), **model, **training)


def presets() -> dict[str, dict[str, Any]]:
    """The shipped audits (also as examples/quick.toml, examples/paper.toml and examples/zoo.toml).
    quick and paper train the paper's seven methods (`Method.paper`), zoo every built-in."""
    from .methods import METHODS
    paper = [name for name, cls in METHODS.items() if cls.paper]
    quick = {"dataset": "mnist1d", "methods": paper, "seeds": [42, 123, 456], "epochs": 15,
             "out": "audits/quick", "training": {PENALTY_OPTION: 1e-2}}
    return {
        # MNIST-1D needs no download; 15 epochs rather than the paper's 100 keep the whole audit small.
        "quick": quick,
        # The paper's protocol: CIFAR-10, 100 epochs, from --data-dir.
        "paper": {"dataset": "cifar10", "methods": paper, "seeds": [42, 123, 456], "epochs": 100,
                  "out": "audits/paper", "training": {PENALTY_OPTION: 1e-2}},
        # Every built-in rule through one protocol (docs/RULES.md): the quick preset's data,
        # seeds, epochs and sizes.
        "zoo": {**quick, "methods": list(METHODS), "out": "audits/zoo"},
    }


PRESET_NAMES = ("quick", "paper", "zoo")             # the first is the default
# where the experiments other than `audit` write when no --out is given
EXPERIMENT_OUT = {"ladder": "audits/ladder", "penalty-sweep": "audits/penalty_sweep",
                  "identity-check": "audits/identity_check"}
# what a threshold of the config file may be: (low, high, (low included, high included), why); a
# value outside would make its flag fire on every run or never (the Python API takes any number,
# which tests use to force a flag)
THRESHOLD_RANGES = {
    "growth": (1.0, math.inf, (True, False), "a block amplification ratio; below 1 a shrinking stream fires (a)"),
    "init_growth": (1.0, math.inf, (True, False), "a growth ratio since initialisation; below 1 an unchanged stream fires (a′)"),
    "stack_growth": (1.0, math.inf, (True, False), "the ratio ‖h_L‖/‖h_0‖; below 1 an unamplified stream fires (a′)"),
    "floor": (0.0, 1.0, (False, False), "a gradient norm; 0 turns (b) off, and the paper's is 1e-7"),
    "gain": (0.0, math.inf, (False, False), "a readout gain ratio; 0 turns (b′) off"),
    "drift": (0.0, 1.0, (True, False), "a mean inner product of unit vectors, at most 1, so 1 or more never fires"),
    "depth_margin": (0.0, 1.0, (True, False), "a fraction of accuracy (0.02 = 2 points); 1 or more can never clear"),
}
TOP_KEYS = ("preset", "dataset", "data_dir", "methods", "seeds", "epochs", "out", "device", "jobs",
            "controls", "eval_batches", "executor", "address", "max_retries", "stack", "recipe")


def _check_keys(table: dict, allowed: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        raise CreditAuditError(
            f"unknown key(s) {', '.join(unknown)} in {where}; allowed: {', '.join(allowed)}")


def _merge(base: dict, override: dict) -> dict:
    merged = dict(base)
    for key, value in override.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and isinstance(
            merged.get(key), dict) else value
    return merged


def _int(raw: dict, key: str, where: str, low: int, what: str) -> int:
    value = raw.get(key, default(AuditConfig, key))
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= MAX_COUNT:
        raise CreditAuditError(f"{key} in {where} must be {what} (at most {MAX_COUNT}), got {value!r}")
    return value


def audit_config_from_dict(raw: dict[str, Any], where: str = "the audit config") -> AuditConfig:
    """Validate a (TOML-shaped) dict into an AuditConfig; every problem names the key and the fix."""
    from .methods import resolve_method_name
    preset = raw.get("preset")
    if preset is not None:
        if preset not in PRESET_NAMES:
            raise CreditAuditError(f"unknown preset {preset!r} in {where}; choose one of: {', '.join(PRESET_NAMES)}")
        raw = _merge(presets()[preset], raw)
    _check_keys(raw, TOP_KEYS + ("model", "training", "thresholds", "options", "recipes"), where)
    for section, keys in (("model", MODEL_KEYS + ("options",)), ("training", TRAINING_KEYS),
                          ("thresholds", THRESHOLD_KEYS), ("options", None)):
        table = raw.get(section, {})
        if not isinstance(table, dict):
            raise CreditAuditError(f"[{section}] in {where} must be a table, got {table!r}")
        if keys is not None:
            _check_keys(table, keys, f"[{section}] of {where}")
    methods = raw.get("methods", list(default(AuditConfig, "methods")))
    if not isinstance(methods, list) or not methods or not all(isinstance(m, str) for m in methods):
        raise CreditAuditError(f"methods in {where} must be a non-empty list of method names, "
                               f"e.g. methods = [\"bp\"]; got {methods!r}")
    spelled = methods
    methods = [resolve_method_name(m) for m in methods]     # one rule, one name, however spelled
    dupes = sorted({m for m in methods if methods.count(m) > 1})
    if dupes:
        ways = [s for s, m in zip(spelled, methods) if m == dupes[0]]
        raise CreditAuditError(f"methods in {where} lists {dupes[0]} more than once "
                               f"({', '.join(ways)} are one rule); list each once")
    for method in raw.get("options", {}):
        if not isinstance(raw["options"][method], dict):
            raise CreditAuditError(f"[options.{method}] in {where} must be a table of that method's options")
        resolve_method_name(method)
    options = {resolve_method_name(k): dict(v) for k, v in raw.get("options", {}).items()}
    recipes = raw.get("recipes", {})
    if not isinstance(recipes, dict) or not all(isinstance(v, dict) for v in recipes.values()):
        raise CreditAuditError(f"[recipes] in {where} must hold one table of recipe settings per method "
                               "([recipes.METHOD]: optimizer, lr, weight_decay, momentum, nesterov, betas, "
                               "schedule, milestones, gamma, batch_size)")
    from .methods.recipe import Recipe
    known = [f.name for f in dataclasses.fields(Recipe) if f.name != "citation"]
    for method, table in recipes.items():
        _check_keys(table, tuple(known), f"[recipes.{method}] of {where}")
    recipes = {resolve_method_name(k): Recipe(**v).settings() for k, v in recipes.items()}
    from .methods import method_class
    for method, table in options.items():        # also for a method the audit does not run
        method_class(method).resolve_options(table)
    seeds = raw.get("seeds", list(default(AuditConfig, "seeds")))
    if not isinstance(seeds, list) or not seeds or not all(
            isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= INT64_MAX for s in seeds):
        raise CreditAuditError(f"seeds in {where} must be a non-empty list of integers in 0 … 2^63−1, "
                               f"got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise CreditAuditError(f"seeds in {where} lists a seed more than once; list each once")
    controls = raw.get("controls", list(CONTROLS))
    if not isinstance(controls, list) or any(c not in CONTROLS for c in controls):
        raise CreditAuditError(f"controls in {where} must be a list drawn from {list(CONTROLS)}, got {controls!r}")
    thresholds = raw.get("thresholds", {})
    for key, value in thresholds.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
                or value < 0:
            raise CreditAuditError(f"threshold {key} in {where} must be a finite number ≥ 0, got {value!r}")
        low, high, closed, meaning = THRESHOLD_RANGES[key]
        if not (low < value if not closed[0] else low <= value) or not (value < high if not closed[1]
                                                                         else value <= high):
            span = f"{'[' if closed[0] else '('}{low:g}, {high:g}{']' if closed[1] else ')'}"
            raise CreditAuditError(f"threshold {key} in {where} must lie in {span}, got {value!r}: {meaning}")
    lam = raw.get("training", {}).get(PENALTY_OPTION)
    if lam is not None and (isinstance(lam, bool) or not isinstance(lam, (int, float))
                            or not math.isfinite(lam) or lam < 0):
        # checked here too: it reaches only the methods that declare λ, and may reach none
        raise CreditAuditError(f"{PENALTY_OPTION} in [training] of {where} must be a finite number ≥ 0, "
                               f"got {lam!r}")
    model = dict(raw.get("model", {}))
    if not isinstance(model.get("options", {}), dict):
        raise CreditAuditError(f"options in [model] of {where} must be a table of architecture options "
                               f"([model.options]), got {model['options']!r}")
    if "blocks" in model and (not isinstance(model["blocks"], int) or model["blocks"] < 1):
        raise CreditAuditError(f"blocks in [model] of {where} must be ≥ 1 (the shallow control, no "
                               f"blocks, is trained by the audit itself), got {model['blocks']!r}")
    executor = raw.get("executor", default(AuditConfig, "executor"))
    if executor not in EXECUTORS:
        raise CreditAuditError(f"executor in {where} must be one of {', '.join(EXECUTORS)}, got {executor!r}")
    address = raw.get("address")
    if address is not None and not isinstance(address, str):
        raise CreditAuditError(f"address in {where} must be a string (auto or HOST:PORT), got {address!r}")
    if address is not None and executor != "ray":    # it would be ignored: the runs stay local
        raise CreditAuditError(f"address in {where} names a Ray cluster, but the executor is "
                               f"{executor!r}; add --executor ray (executor = \"ray\"), or drop the address")
    for key in ("dataset", "out", "data_dir", "device"):
        if key in raw and (not isinstance(raw[key], str) or not raw[key].strip()):
            raise CreditAuditError(f"{key} in {where} must be a non-empty string, got {raw[key]!r}")
    stack = raw.get("stack")
    if stack is not None and not isinstance(stack, bool):
        raise CreditAuditError(f"stack in {where} must be true or false, got {stack!r}")
    from .methods import RECIPE_CHOICES
    recipe = raw.get("recipe", default(AuditConfig, "recipe"))
    if recipe not in RECIPE_CHOICES:
        raise CreditAuditError(f"recipe in {where} must be one of {', '.join(RECIPE_CHOICES)}, "
                               f"got {recipe!r}")
    config = AuditConfig(
        dataset=raw.get("dataset", default(AuditConfig, "dataset")), methods=tuple(methods),
        seeds=tuple(seeds), epochs=_int(raw, "epochs", where, 1, "a positive integer"),
        out=str(raw.get("out", default(AuditConfig, "out"))),
        data_dir=str(raw.get("data_dir", default(AuditConfig, "data_dir"))),
        device=str(raw.get("device", default(AuditConfig, "device"))),
        jobs=_int(raw, "jobs", where, 0, "an integer ≥ 0 (0 = automatic)"), controls=tuple(controls),
        eval_batches=_int(raw, "eval_batches", where, 1, "a positive integer"),
        executor=executor, address=address,
        max_retries=_int(raw, "max_retries", where, 0, "an integer ≥ 0"), stack=stack, recipe=recipe,
        model=model, training=dict(raw.get("training", {})), thresholds=dict(thresholds),
        options=options, preset=preset, recipes=recipes)
    config.run_configs()  # every run validated now: nothing trains on a bad config
    return config


def with_method_options(raw: dict[str, Any], given: Sequence[tuple[str, Any]],
                        where: str = "the audit settings", flag: str = "--option") -> dict[str, Any]:
    """`raw` with method options given as KEY=VALUE pairs (the command line's `--option`) written
    into its [options.METHOD] tables, so that they are exactly what those tables would say:

    - METHOD.KEY=VALUE sets KEY for METHOD, which the audit must train;
    - KEY=VALUE sets KEY for every audited method that declares it (as [training] lam does for λ);
      a key no audited method declares is refused, since it would change nothing.

    A pair overrides the same key of the TOML's table; the values are validated by
    `audit_config_from_dict` like any table's."""
    from .methods import METHODS, method_class, resolve_method_name
    if not given:
        return raw
    seen: dict[str, Any] = {}
    for key, value in given:             # a key given twice: the last would silently win
        if key in seen:
            raise CreditAuditError(f"{flag} {key} is given twice ({flag} {key}={seen[key]!r} and "
                                   f"{flag} {key}={value!r}); give each key once")
        seen[key] = value
    audited = audit_config_from_dict(raw, where).methods      # after the preset, in one spelling
    tables: dict[str, dict[str, Any]] = {}
    for method, table in (raw.get("options") or {}).items():  # a TOML table, however its method is spelled
        tables.setdefault(resolve_method_name(method), {}).update(table)
    for key, value in given:
        spelled, _, name = key.rpartition(".")      # option names have no dot; rule names may
        if spelled:
            method = resolve_method_name(spelled)
            if method not in audited:
                raise CreditAuditError(f"{flag} {key}={value} names {method}, which this audit does "
                                       f"not train ({', '.join(audited)}); add it to the methods or "
                                       "drop the option")
            targets = [method]
        else:
            targets = [m for m in audited if name in method_class(m).option_defaults]
        if not targets:
            elsewhere = [m for m, cls in METHODS.items() if name in cls.option_defaults]
            hint = (f"{', '.join(elsewhere)} declare{'s' if len(elsewhere) == 1 else ''} it: add "
                    f"{'that method' if len(elsewhere) == 1 else 'one of them'} to the methods" if elsewhere
                    else "the methods' options are listed by `creditaudit audit --help`")
            raise CreditAuditError(f"{flag} {key}={value}: no audited method ({', '.join(audited)}) "
                                   f"has an option {name!r}; {hint}")
        for method in targets:
            tables.setdefault(method, {})[name] = value
    return {**raw, "options": tables}


def load_audit_toml(path: str | Path) -> dict[str, Any]:
    """Read an audit TOML file into a dict (validated later by audit_config_from_dict)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise CreditAuditError(f"config file {path} not found") from None
    except IsADirectoryError:
        raise CreditAuditError(f"config file {path} is a folder; give a .toml file") from None
    except tomllib.TOMLDecodeError as err:
        raise CreditAuditError(f"{path} is not valid TOML: {err}") from None
    except UnicodeDecodeError:
        raise CreditAuditError(f"{path} is not a text file (not UTF-8); give an audit TOML file, "
                               "e.g. examples/quick.toml") from None
    except RecursionError:        # tomllib recurses once per nesting level
        raise CreditAuditError(f"{path} nests tables or arrays too deeply to be an audit config; "
                               "an audit TOML is at most three levels deep (e.g. [options.METHOD])") from None
    except OSError as err:
        raise CreditAuditError(f"cannot read config file {path} ({err.strerror or err})") from None
