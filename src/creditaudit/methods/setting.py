"""A rule in its own paper's setting: what `creditaudit reproduce RULE` trains, and the number the
paper reports for it. Each rule declares its own (`Method.paper_setting`, beside its recipe);
`creditaudit.papers` is the registry.

A rule audited on the ResMLP on MNIST-1D for 15 epochs runs where no author ran it, so neither its
"published" nor its "shared" recipe is what its authors did. A `PaperSetting` is the authors' own setting —
data, network, output loss, recipe, epochs — and the test error they report for the rule and for
backprop in it, each with the place it comes from (a table of the paper, or a line of the reference
code's README). `reproduce` trains the rule and bp there, audits the runs as any audit does, and puts
the paper's numbers beside ours (report/reproduction.py).

Every setting runs on the plain MLP (`arch mlp`, model/plain.py). What this tool cannot do as the paper
did is listed in `deviations`, one line each; docs/REPRODUCTIONS.md shows them beside the numbers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .recipe import Recipe

# a miss beyond the paper's spread is a finding; where the paper gives no spread, this many points
DEFAULT_SPREAD = 0.5


@dataclass(frozen=True)
class Reported:
    """A test error the paper reports, in percent, and where it says so."""

    error: float                 # test error, percent
    source: str                  # "Table 1, row '7x240 tanh', column DFA"
    sd: float | None = None      # its spread over seeds (percent), when the paper gives one
    seeds: int | None = None     # how many runs the mean is over, when stated
    selection: str = ""          # how the epoch was chosen ("final epoch", "best test epoch", …)
    verified: bool = True        # False: the source could not be read here (`source` says so)

    @property
    def spread(self) -> float:
        """How far ours may lie from it before the miss is a finding: the paper's sd, else 0.5."""
        return self.sd if self.sd is not None else DEFAULT_SPREAD


@dataclass(frozen=True)
class PaperSetting:
    """One rule's paper setting (module docstring). `options` are the rule's own knobs in that
    setting; `bp_recipe` None: bp trains under the rule's recipe, as the paper's baseline did."""

    citation: str
    code: str
    dataset: str
    width: int
    blocks: int
    activation: str
    recipe: Recipe
    epochs: int
    reported: Reported | None
    bp: Reported | None = None
    loss: str = "ce"
    dropout: float = 0.0
    init: str = "torch"
    bias: bool = True
    norm: str = "none"           # the mlp's `norm`: "rms" length-normalises every layer's input
    options: dict[str, Any] = field(default_factory=dict)
    bp_recipe: Recipe | None = None
    deviations: tuple[str, ...] = ()
    rule: str = ""               # the rule's name, filled in by the registry (`papers.PAPERS`)

    @property
    def network(self) -> str:
        """"784-1000-10 tanh, softmax + CE" style, for tables (the input size is the dataset's)."""
        hidden = "-".join([str(self.width)] * self.blocks)
        out = "sigmoid + BCE" if self.loss == "bce" else "softmax + CE"
        drop = f", dropout {self.dropout:g}" if self.dropout else ""
        init = "" if self.init == "torch" else f", {self.init} init"
        norm = "" if self.norm == "none" else ", length-normalised layer inputs"
        return f"{hidden} {self.activation}, {out}{drop}{init}{'' if self.bias else ', no biases'}{norm}"

    def model(self) -> dict[str, Any]:
        """The audit's [model] table for this setting (`norm` only where it is not the default, so
        that the settings without it keep their run keys)."""
        options = {"loss": self.loss, "dropout": self.dropout, "init": self.init, "bias": int(self.bias)}
        if self.norm != "none":
            options["norm"] = self.norm
        return {"arch": "mlp", "width": self.width, "blocks": self.blocks, "activation": self.activation,
                "options": options}

    def recipes(self) -> dict[str, dict[str, Any]]:
        """Each audited method's recipe settings: the rule's, and bp's (the rule's unless stated)."""
        bp = self.bp_recipe if self.bp_recipe is not None else self.recipe
        return {self.rule: self.recipe.settings(), "bp": bp.settings()}

    def record(self, epochs: int, seeds: int) -> dict[str, Any]:
        """What audit.json keeps of the paper (the report renders the comparison from it alone)."""
        def rep(r: Reported | None):
            return None if r is None else {"error": r.error, "sd": r.sd, "seeds": r.seeds,
                                           "source": r.source, "selection": r.selection,
                                           "spread": r.spread, "verified": r.verified}
        return {"rule": self.rule, "citation": self.citation, "code": self.code,
                "dataset": self.dataset, "network": self.network,
                "recipe": self.recipe.describe(self.epochs), "recipe_citation": self.recipe.citation,
                "paper_epochs": self.epochs, "epochs": epochs, "seeds": seeds,
                "reduced_budget": epochs < self.epochs,
                "reported": rep(self.reported), "bp": rep(self.bp),
                "deviations": list(self.deviations)}


# Akrout et al.'s released MNIST code, where fa's and Kolen–Pollack's settings come from
AKROUT = "makrout/Deep-Learning-without-Weight-Transport (commit 688f47a)"
# its MNIST network and budget (run.sh, fcnn/FCNN_BP.py:29-32): 784-500-10 sigmoid, sigmoid outputs
# with binary cross-entropy, weights N(0, 1/(fan_in + fan_out)), 400 epochs, pixels in [0, 1]
# (the reference's ToTensor, not standardised: dataset mnist-01)
AKROUT_NETWORK = dict(dataset="mnist-01", width=500, blocks=1, activation="sigmoid", loss="bce",
                      init="fan-sum-normal", epochs=400)
AKROUT_DEVIATIONS = (
    "the training data are reshuffled every epoch; the reference walks them in one fixed order and "
    "drops the last partial batch (main.py:41-65)",
    "biases learn at the weights' lr; the reference scales the bias step down by a further 1/128 "
    "(fcnn/FCNN_BP.py:182-196)",
    "one binary cross-entropy per class summed over the classes, as the reference's sigmoid output "
    "error σ(z) − y",
)
