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
from typing import Any

from .errors import CreditAuditError


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
        for name in ("lr", "weight_decay", "lam", "w2_std"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise CreditAuditError(f"{name} must be a number ≥ 0, got {value!r}")
        if self.stop_when_flagged is not None and self.stop_when_flagged < 1:
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
