"""The resolved configuration of one training run (SPEC §4 defaults).

A `RunConfig` says everything that determines a run's result; it is saved as config.json in the
run folder and its hash (`run_key`) identifies the run, so an audit can reuse finished runs.
Where the run happens (device, data folder, output folder) is not part of it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CreditAuditError


LAMBDA_METHODS = ("dfa-penalty", "sb", "cb")  # the methods whose local loss has a λ‖f‖² term


@dataclass(frozen=True)
class RunConfig:
    """One run: method × dataset × model × seed × schedule, plus the depth control.

    trainable_blocks: None = every block trains; k = only the last k blocks train (the depth
    ladder); 0 = the frozen-blocks control. `blocks = 0` is the shallow control.
    stop_when_flagged: end the run once a monitor flag ((a), (b) or (b′)) has held this many
    consecutive epochs (None = train to the end).
    """

    method: str = "bp"
    dataset: str = "mnist1d"
    seed: int = 42
    epochs: int = 100
    batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.01
    width: int = 256
    blocks: int = 4
    activation: str = "gelu"
    w2_std: float = 0.01
    lam: float = 0.0
    trainable_blocks: int | None = None
    stop_when_flagged: int | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        from .data import DATASET_NAMES
        from .methods import METHODS
        from .model import ACTIVATIONS
        if self.method not in METHODS:
            raise CreditAuditError(f"unknown method {self.method!r}; choose one of: {', '.join(METHODS)}")
        if self.dataset not in DATASET_NAMES:
            raise CreditAuditError(
                f"unknown dataset {self.dataset!r}; choose one of: {', '.join(DATASET_NAMES)}")
        if self.activation not in ACTIVATIONS:
            raise CreditAuditError(
                f"unknown activation {self.activation!r}; choose one of: {', '.join(ACTIVATIONS)}")
        for name in ("epochs", "batch_size", "width"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise CreditAuditError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not isinstance(self.blocks, int) or self.blocks < 0:
            raise CreditAuditError(f"blocks must be an integer ≥ 0, got {self.blocks!r}")
        k = self.trainable_blocks
        if k is not None and (not isinstance(k, int) or not 0 <= k <= self.blocks):
            raise CreditAuditError(
                f"trainable_blocks must be an integer in 0..{self.blocks} (the number of blocks), got {k!r}")
        if k == self.blocks:  # "all blocks train" has one spelling, so equal runs share one key
            object.__setattr__(self, "trainable_blocks", None)
        for name in ("lr", "weight_decay", "lam", "w2_std"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise CreditAuditError(f"{name} must be a number ≥ 0, got {value!r}")
        METHODS[self.method].resolve_options(self.options)
        if self.lam and self.method not in LAMBDA_METHODS:
            raise CreditAuditError(f"lam (the residual penalty λ) applies to {', '.join(LAMBDA_METHODS)}, "
                                   f"not to {self.method!r}; drop it or choose dfa-penalty")
        swf = self.stop_when_flagged
        if swf is not None and (not isinstance(swf, int) or isinstance(swf, bool) or swf < 1):
            raise CreditAuditError(
                f"stop_when_flagged must be ≥ 1 epoch, got {self.stop_when_flagged!r}")

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
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise CreditAuditError(
                f"unknown run config key(s) {unknown}; allowed: {', '.join(sorted(known))}")
        return cls(**d)

    def replace(self, **changes) -> "RunConfig":
        return dataclasses.replace(self, **changes)

    @property
    def run_key(self) -> str:
        """A stable 12-hex-digit hash of the resolved config."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


# -- audits -----------------------------------------------------------------------------------
AUDIT_SECTIONS: dict[str, tuple[str, ...]] = {
    "": ("preset", "dataset", "data_dir", "methods", "seeds", "epochs", "out", "device", "jobs",
         "controls", "eval_batches"),
    "model": ("width", "blocks", "activation", "w2_std"),
    "training": ("batch_size", "lr", "weight_decay", "lam", "stop_when_flagged"),
    "thresholds": ("growth", "floor", "gain", "drift", "depth_margin"),
    "options": (),  # [options.METHOD] tables: free-form method options, checked by each method
}
CONTROLS = ("frozen", "shallow")

PRESETS: dict[str, dict[str, Any]] = {
    # MNIST-1D needs no download; epochs chosen so 7 methods × 3 seeds × (run + 2 controls) fit
    # in about ten minutes on a 2-core CPU.
    "quick": {"dataset": "mnist1d", "methods": ["bp", "fa", "dfa", "dfa-penalty", "ep", "sb", "cb"],
              "seeds": [42, 123, 456], "epochs": 15, "out": "audits/quick",
              "training": {"lam": 1e-2}},
    # The paper's protocol (SPEC §4): CIFAR-10, 100 epochs, from --data-dir.
    "paper": {"dataset": "cifar10", "methods": ["bp", "fa", "dfa", "dfa-penalty", "ep", "sb", "cb"],
              "seeds": [42, 123, 456], "epochs": 100, "out": "audits/paper",
              "training": {"lam": 1e-2}},
}


@dataclass(frozen=True)
class AuditConfig:
    """An audit: methods × seeds (each with its frozen and shallow controls) on one dataset/model."""

    dataset: str = "mnist1d"
    methods: tuple[str, ...] = ("bp",)
    seeds: tuple[int, ...] = (42,)
    epochs: int = 20
    out: str = "audits/quick"
    data_dir: str = "data"
    device: str = "auto"
    jobs: int = 0
    controls: tuple[str, ...] = CONTROLS
    eval_batches: int = 8
    model: dict[str, Any] = field(default_factory=dict)
    training: dict[str, Any] = field(default_factory=dict)
    thresholds: dict[str, float] = field(default_factory=dict)
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    preset: str | None = None

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
        return runs

    def base_config(self, method: str, seed: int) -> RunConfig:
        training = dict(self.training)
        lam = training.pop("lam", 0.0) if method == "dfa-penalty" else 0.0
        training.pop("lam", None)
        return RunConfig(method=method, dataset=self.dataset, seed=seed, epochs=self.epochs,
                         lam=lam, options=dict(self.options.get(method, {})), **self.model, **training)


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


def audit_config_from_dict(raw: dict[str, Any], where: str = "the audit config") -> AuditConfig:
    """Validate a (TOML-shaped) dict into an AuditConfig; every problem names the key and the fix."""
    from .methods import METHODS
    preset = raw.get("preset")
    if preset is not None:
        if preset not in PRESETS:
            raise CreditAuditError(f"unknown preset {preset!r} in {where}; choose one of: {', '.join(PRESETS)}")
        raw = _merge(PRESETS[preset], raw)
    _check_keys(raw, AUDIT_SECTIONS[""] + ("model", "training", "thresholds", "options"), where)
    for section in ("model", "training", "thresholds", "options"):
        table = raw.get(section, {})
        if not isinstance(table, dict):
            raise CreditAuditError(f"[{section}] in {where} must be a table, got {table!r}")
        if section != "options":
            _check_keys(table, AUDIT_SECTIONS[section], f"[{section}] of {where}")
    for method in raw.get("options", {}):
        if method not in METHODS:
            raise CreditAuditError(f"[options.{method}] in {where}: unknown method; choose one of: "
                                   f"{', '.join(METHODS)}")
    methods = raw.get("methods", ["bp"])
    if isinstance(methods, str):
        methods = [m for m in methods.replace(",", " ").split() if m]
    if not isinstance(methods, list) or not methods:
        raise CreditAuditError(f"methods in {where} must be a non-empty list, got {methods!r}")
    for m in methods:
        if m not in METHODS:
            raise CreditAuditError(f"unknown method {m!r} in methods of {where}; choose from: {', '.join(METHODS)}")
    seeds = raw.get("seeds", [42])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise CreditAuditError(f"seeds in {where} must be a non-empty list of integers, got {seeds!r}")
    controls = raw.get("controls", list(CONTROLS))
    if not isinstance(controls, list) or any(c not in CONTROLS for c in controls):
        raise CreditAuditError(f"controls in {where} must be a list drawn from {list(CONTROLS)}, got {controls!r}")
    thresholds = raw.get("thresholds", {})
    for key, value in thresholds.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise CreditAuditError(f"threshold {key} in {where} must be a number ≥ 0, got {value!r}")
    for key in ("epochs", "eval_batches"):
        value = raw.get(key, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CreditAuditError(f"{key} in {where} must be a positive integer, got {value!r}")
    jobs = raw.get("jobs", 0)
    if not isinstance(jobs, int) or jobs < 0:
        raise CreditAuditError(f"jobs in {where} must be an integer ≥ 0 (0 = automatic), got {jobs!r}")
    config = AuditConfig(
        dataset=raw.get("dataset", "mnist1d"), methods=tuple(dict.fromkeys(methods)),
        seeds=tuple(dict.fromkeys(seeds)), epochs=raw.get("epochs", 20),
        out=str(raw.get("out", "audits/quick")), data_dir=str(raw.get("data_dir", "data")),
        device=str(raw.get("device", "auto")), jobs=jobs, controls=tuple(controls),
        eval_batches=raw.get("eval_batches", 8), model=dict(raw.get("model", {})),
        training=dict(raw.get("training", {})), thresholds=dict(thresholds),
        options={k: dict(v) for k, v in raw.get("options", {}).items()}, preset=preset)
    config.run_configs()  # every run validated now: nothing trains on a bad config
    return config


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
    except tomllib.TOMLDecodeError as err:
        raise CreditAuditError(f"{path} is not valid TOML: {err}") from None
