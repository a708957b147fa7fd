"""The audit protocol of docs/PROTOCOL.md: diagnostics → flags → verdict, for one trained model.

    (a)  EXPLODED    max_l ‖h_{l+1}‖/‖h_l‖ > 50                 scale stability
    (b)  AT FLOOR    ‖g_L‖ < 1e-7                                reference validity (paper)
    (b′) ATTENUATED  readout gain ‖g_L‖/‖∂CE/∂logits‖ < 1e-2     reference validity (this project)
    (c)  DRIFT       cross-batch stability s_{L/2} > 0.30        descriptive: never changes a verdict
    (d)  UNDERCUT    test acc < frozen-blocks acc + 0.02         depth utility

    project verdict: (a), (a′), (b′), (d)     paper verdict (the paper's rule): (a), (b), (d)
    "walk back: <fired>" when one fired; "trustworthy" only when every one was evaluated on valid
    evidence from a finished run; "incomplete: <what is missing>" otherwise (verdict.py decides).

A residual stream (or readout) that goes non-finite counts as (a) fired ("non-finite residual
stream"), and its (b)/(b′) as fired too: a NaN reference gradient is no reference.

`diagnose` measures everything on the eval batches the caller hands it (a list of (x, y)); the
protocol knows no training loop. Norms, gain, accuracy and Γ pool the samples of all batches (each
batch's CE mean-reduced over that batch, the paper's convention — use batches of 128 so the floor
threshold means what it says); s_l needs the batches separately.

Inputs a user can get wrong (accuracies as percents, NaN, a credit list of the wrong length or
shape, batches that are not (x, y) pairs) raise CreditAuditError with the fix; a statistic that
cannot be computed (a non-finite credit, a gain with no logit error) leaves its flag "not
evaluated", so the verdict is at best "incomplete", never "trustworthy".
"""
from __future__ import annotations

import json
import math
import numbers
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch

from . import evidence, metrics as M
from .errors import CreditAuditError
from .model import ResidualStream, as_stream
from .seeding import derived_generator
from .store import json_safe
from .store import json_number as _num
from .verdict import (FLAG_NAMES, FLAGS, Thresholds, Verdict, _fmt, decide, disagreement,
                      first_fire_epochs, growth_since_init, reasons_by_flag, stack_growth,
                      training_gaps)


# ---------------------------------------------------------------------------------------------
# Deep Γ: the one definition (the audit, the report and the terminal read it from here)
# ---------------------------------------------------------------------------------------------

EXACT_NOTE = "n/a (exact by construction)"


def deep_gamma(gamma: Sequence | None, exact: Sequence[int] = (), null: dict | None = None) -> dict:
    """The deep Γ of one diagnosis, JSON-ready (`Report.to_dict` carries these keys):

        gamma_deep        mean of Γ_l over the project's deep positions: l = 1 … L less the
                          positions where the rule's credit equals ∂CE/∂h_l by construction
                          (`Method.exact_positions`, listed as `gamma_exact`); None when every
                          deep position is exact (`gamma_deep_exact` True: "n/a (exact by
                          construction)") or Γ was not measured
        gamma_deep_paper  the paper's deep Γ, the mean over l = 1 … L (exact positions included),
                          for comparing with the paper's figures
        null_deep_mean, null_deep_std   the null's per-layer mean and std, averaged over the same
                          positions as gamma_deep; gamma_deep_z = (gamma_deep − null_deep_mean)/null_deep_std

    `gamma` is Γ_0 … Γ_L (floats, or JSON numbers with None for NaN); `null` a NullCalibration's
    dict. A position whose Γ is NaN makes its mean None, never a silently partial mean."""
    exact = sorted({int(l) for l in exact})
    out = {"gamma_exact": exact, "gamma_deep": None, "gamma_deep_paper": None,
           "gamma_deep_exact": False, "null_deep_mean": None, "null_deep_std": None,
           "gamma_deep_z": None}
    if not gamma or len(gamma) < 2:
        return out
    paper = list(range(1, len(gamma)))
    deep = [l for l in paper if l not in exact]

    def mean(values, at):
        vals = [_num(values[l]) for l in at]
        return None if not vals or any(math.isnan(v) for v in vals) else sum(vals) / len(vals)

    out["gamma_deep_paper"] = mean(gamma, paper)
    out["gamma_deep_exact"] = not deep
    out["gamma_deep"] = mean(gamma, deep)
    if null and deep:
        out["null_deep_mean"] = mean(null["mean"], deep)
        out["null_deep_std"] = mean(null["std"], deep)
        g, m, sd = out["gamma_deep"], out["null_deep_mean"], out["null_deep_std"]
        if g is not None and m is not None and sd is not None and sd > 0:
            out["gamma_deep_z"] = (g - m) / sd
    return out


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------

@dataclass
class Report:
    """Everything `diagnose` measured and concluded. `str(report)` is a fixed-width table;
    `to_dict()` is JSON-ready (see `json_safe` for how non-finite numbers are written)."""

    label: str
    n_batches: int
    n_samples: int
    thresholds: Thresholds
    residual_norms: list[float]               # (a) median ‖h_l‖, l = 0 … L
    bp_grad_norms: list[float]                # (b) median ‖g_l‖
    readout_gain: float                       # (b′)
    max_growth: float                         # (a) statistic
    eval_loss: float                          # mean CE over the eval batches
    eval_acc: float
    logit_grad_norm: float                    # median ‖∂CE/∂logits_i‖ (what (b′) divides out)
    nonfinite: bool
    stability: list[float]                    # (c) s_l, l = 0 … L
    mid_layer: int                            # L // 2
    flags: dict[str, bool | None]             # a, a_prime, b, b_prime, c, d (None: not evaluated)
    project: Verdict                          # flags (a), (a′), (b′), (d)
    paper: Verdict                            # the paper's rule: (a), (b), (d)
    reasons: list[str]                        # one sentence per fired flag
    notes: list[str] = field(default_factory=list)   # (b)/(b′) disagreement and other caveats
    gamma: list[float] | None = None          # Γ_l, l = 0 … L
    # Γ_l of the credit exactly as training computes it, where `credit` computes it otherwise
    # (ep, pc: float32 and the strict acceptance test, against `gamma`'s float64 with a rounding
    # margin; docs/PROTOCOL.md §3.13); None for every other rule
    gamma_trained: list[float] | None = None
    gamma_exact: list[int] = field(default_factory=list)   # positions exact by construction
    gamma_interpretable: bool | None = None
    null: M.NullCalibration | None = None
    gamma_z: list[float] | None = None
    rho: list[M.PerturbationCorrelation] | None = None
    depth: M.DepthUtility | None = None
    first_fire: dict[str, int | None] | None = None
    diverged: str | None = None               # training ended non-finite: the run's own message
    init_growth: float = float("nan")        # (a′) max_l ‖h_l‖/‖h_l at init‖ (monitor batch); NaN: no init
    stack_growth: float = float("nan")       # (a′) ‖h_L‖/‖h_0‖ (medians over the eval batches)
    not_evaluated: dict[str, str] = field(default_factory=dict)   # flag → why it could not be
    training: dict | None = None              # status, epochs_completed, epochs_planned
    nudge: list[M.NudgeResult] | None = None  # nudging test at the ρ layers (needs a method)
    reasons_by_flag: dict[str, str] = field(default_factory=dict)   # the reasons, keyed by flag
    missing_evidence: list[str] = field(default_factory=list)   # gaps beyond flags and training

    @property
    def verdict(self) -> str:
        """The project verdict's text (decide on `project`, never on this string)."""
        return self.project.text

    @property
    def paper_verdict(self) -> str:
        return self.paper.text

    @property
    def rho_bp_model_precision(self) -> float | None:
        """ρ of the BP gradient in the model's own precision, mean over the measured layers."""
        vals = [r.bp_model_precision for r in self.rho or [] if r.bp_model_precision is not None]
        return sum(vals) / len(vals) if vals else None

    @property
    def stability_mid(self) -> float:
        return self.stability[self.mid_layer]

    @property
    def trustworthy(self) -> bool:
        return self.project.trustworthy

    def deep_gamma(self) -> dict:
        """`deep_gamma` of this report: the project's deep Γ (exact positions left out), the
        paper's, and the null and z over the same positions."""
        null = None if self.null is None else self.null.to_dict()
        return deep_gamma(json_safe(self.gamma) if self.gamma is not None else None,
                          self.gamma_exact, json_safe(null) if null else None)

    def deep_gamma_trained(self) -> float | None:
        """The project's deep Γ (the positions of `gamma_deep`) of the credit as trained, or None."""
        if self.gamma_trained is None:
            return None
        return deep_gamma(json_safe(self.gamma_trained), self.gamma_exact)["gamma_deep"]

    def to_dict(self) -> dict:
        d = {
            "label": self.label, "verdict": self.verdict, "paper_verdict": self.paper_verdict,
            "verdicts": {"project": self.project.to_dict(), "paper": self.paper.to_dict()},
            "flags": self.flags, "reasons": self.reasons, "reasons_by_flag": self.reasons_by_flag,
            "notes": self.notes,
            "nonfinite": self.nonfinite, "n_batches": self.n_batches, "n_samples": self.n_samples,
            "residual_norms": self.residual_norms, "bp_grad_norms": self.bp_grad_norms,
            "readout_gain": self.readout_gain, "max_growth": self.max_growth,
            "eval_loss": self.eval_loss, "eval_acc": self.eval_acc,
            "logit_grad_norm": self.logit_grad_norm,
            "stability": self.stability, "mid_layer": self.mid_layer,
            "stability_mid": self.stability_mid,
            "gamma": self.gamma, "gamma_interpretable": self.gamma_interpretable,
            "null": None if self.null is None else self.null.to_dict(),
            "gamma_z": self.gamma_z,
            **self.deep_gamma(),
            "gamma_trained": self.gamma_trained,
            "gamma_deep_trained": self.deep_gamma_trained(),
            "rho": None if self.rho is None else [r.to_dict() for r in self.rho],
            "depth": None if self.depth is None else self.depth.to_dict(),
            "first_fire": self.first_fire, "diverged": self.diverged,
            "init_growth": self.init_growth, "stack_growth": self.stack_growth,
            "not_evaluated": self.not_evaluated, "training": self.training,
            "missing_evidence": self.missing_evidence,
            "nudge": None if self.nudge is None else [n.to_dict() for n in self.nudge],
            "rho_bp_model_precision": self.rho_bp_model_precision,
            "thresholds": asdict(self.thresholds),
        }
        return json_safe(d)

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), allow_nan=False, **kwargs)

    def __str__(self) -> str:
        t = self.thresholds
        title = f"creditaudit report{' — ' + self.label if self.label else ''}"
        lines = [title, "=" * len(title),
                 f"eval: {self.n_batches} batches, {self.n_samples} samples; "
                 f"loss {_fmt(self.eval_loss, '.4g')}, acc {_fmt(self.eval_acc, '.4f')}",
                 f"verdict (project, uses a′, b′): {self.verdict}",
                 f"verdict (paper's rule, uses b): {self.paper_verdict}", ""]
        rho_by_layer = {r.layer: r for r in self.rho or []}
        head = f"{'layer':>5}  {'‖h_l‖':>10}  {'‖g_l‖':>10}  {'s_l':>7}"
        if self.gamma is not None:
            head += f"  {'Γ_l':>8}"
        if self.gamma_trained is not None:
            head += f"  {'Γ trained':>9}"
        if self.null is not None:
            head += f"  {'null μ±σ':>15}  {'z':>7}"
        if self.rho:
            head += f"  {'ρ method':>8}  {'ρ bp':>7}  {'ρ bp32':>7}  {'ρ rand':>7}"
        lines += [head, "-" * len(head)]
        for l, (hn, gn) in enumerate(zip(self.residual_norms, self.bp_grad_norms)):
            row = f"{l:>5}  {_fmt(hn, '10.3e')}  {_fmt(gn, '10.3e')}  {_fmt(self.stability[l], '+7.3f')}"
            exact = l in self.gamma_exact
            if self.gamma is not None:
                mark = "" if self.gamma_interpretable else "*"
                row += f"  {'exact' if exact else _fmt(self.gamma[l], '+7.3f') + mark:>8}"
            if self.gamma_trained is not None:
                row += f"  {'exact' if exact else _fmt(self.gamma_trained[l], '+7.3f'):>9}"
            if self.null is not None:
                ms = f"{_fmt(self.null.mean[l], '+.3f')}±{_fmt(self.null.std[l], '.3f')}"
                # an uninterpretable Γ gets no z: its distance from the null is no evidence
                z = _fmt(self.gamma_z[l], '+7.1f') if self.gamma_interpretable else "n/a*"
                row += f"  {'—' if exact else ms:>15}  {'—' if exact else z:>7}"
            if self.rho:
                r = rho_by_layer.get(l)
                row += (f"  {_fmt(r.method, '+8.3f') if r and r.method is not None else '':>8}"
                        f"  {_fmt(r.bp, '+7.3f') if r else '':>7}"
                        f"  {_fmt(r.bp_model_precision, '+7.3f') if r else '':>7}"
                        f"  {_fmt(r.random, '+7.3f') if r else '':>7}")
            lines.append(row)
        if self.gamma is not None and not self.gamma_interpretable:
            lines.append("  * Γ uninterpretable: (b) or (b′) fired, the reference gradient is invalid"
                         + ("; no z against the null is given" if self.null is not None else ""))
        if self.gamma is not None:
            lines.append("  " + _deep_gamma_line(self.deep_gamma()))
        if self.gamma_trained is not None:
            lines.append(f"  Γ trained: of the credit exactly as training computes it (model dtype, "
                         f"strict acceptance), deep {_fmt(self.deep_gamma_trained(), '+.3f')}; Γ_l and "
                         "deep Γ above are of the reproducible float64 relaxation (PROTOCOL §3.13)")
        lines += ["", f"{'diagnostic':<17} {'value':>11}  {'threshold':>10}  flag",
                  f"{'(a) max growth':<17} {_fmt(self.max_growth, '11.4g')}  "
                  f"{'> ' + format(t.growth, 'g'):>10}  {self._flag('a')}",
                  f"{'(a′) since init':<17} {_fmt(self.init_growth, '11.4g')}  "
                  f"{'> ' + format(t.init_growth, 'g'):>10}  {self._flag('a_prime')}",
                  f"{'(a′) ‖h_L‖/‖h_0‖':<17} {_fmt(self.stack_growth, '11.4g')}  "
                  f"{'> ' + format(t.stack_growth, 'g'):>10}",
                  f"{'(b) ‖g_L‖':<17} {_fmt(self.bp_grad_norms[-1], '11.3e')}  "
                  f"{'< ' + format(t.floor, 'g'):>10}  {self._flag('b')}",
                  f"{'(b′) readout gain':<17} {_fmt(self.readout_gain, '11.3e')}  "
                  f"{'< ' + format(t.gain, 'g'):>10}  {self._flag('b_prime')}",
                  f"{'(c) s_L/2 (l=' + str(self.mid_layer) + ')':<17} "
                  f"{_fmt(self.stability_mid, '11.3f')}  {'> ' + format(t.drift, 'g'):>10}  "
                  f"{self._flag('c')} (descriptive)"]
        if self.depth is not None:
            lines.append(f"{'(d) acc − frozen':<17} {_fmt(self.depth.gap, '+11.4f')}  "
                         f"{'< ' + format(t.depth_margin, 'g'):>10}  {self._flag('d')}"
                         f"   (acc {self.depth.acc:.4f} vs frozen {self.depth.frozen_acc:.4f}: this run "
                         "alone, as measured; across seeds an audit decides (d) at 5 % error)")
        else:
            lines.append(f"{'(d) acc − frozen':<17} {'—':>11}  {'':>10}  not evaluated (no frozen control)")
        if self.training:
            tr = self.training
            lines.append(f"training: {tr.get('status')}, {tr.get('epochs_completed')}/"
                         f"{tr.get('epochs_planned')} epochs")
        if self.first_fire is not None:
            ff = ", ".join(f"{FLAG_NAMES[k].split()[0]} epoch {v}" if v is not None
                           else f"{FLAG_NAMES[k].split()[0]} never" for k, v in self.first_fire.items())
            lines.append(f"first fired during training: {ff}")
        if self.reasons or self.notes:
            lines.append("")
        lines += [f"- {r}" for r in self.reasons] + [f"- {n}" for n in self.notes]
        return "\n".join(lines)

    def _flag(self, key: str) -> str:
        on = self.flags.get(key)
        return "not evaluated" if on is None else (FLAG_NAMES[key].split(" ", 1)[1] if on else "ok")


def _deep_gamma_line(deep: dict) -> str:
    """One line under the per-layer table: the project's deep Γ (which positions, which left out)
    beside its null, and the paper's mean over 1 … L."""
    exact = deep["gamma_exact"]
    left_out = (f", l = {', '.join(map(str, exact))} left out (exact by construction)" if exact else "")
    if deep["gamma_deep_exact"]:
        text = f"deep Γ: {EXACT_NOTE}"
    else:
        text = f"deep Γ {_fmt(deep['gamma_deep'], '+.3f')}{left_out}"
        if deep["null_deep_mean"] is not None:
            text += (f"; null {_fmt(deep['null_deep_mean'], '+.3f')} ± {_fmt(deep['null_deep_std'], '.3f')}"
                     + (f", z {deep['gamma_deep_z']:+.1f}" if deep["gamma_deep_z"] is not None else ""))
    return text + f"; the paper's deep Γ (mean over l = 1 … L) {_fmt(deep['gamma_deep_paper'], '+.3f')}"


# ---------------------------------------------------------------------------------------------
# diagnose
# ---------------------------------------------------------------------------------------------

def _credit_fn(method) -> Callable | None:
    if method is None:
        return None
    if hasattr(method, "credit"):
        return method.credit
    if callable(method):
        return method
    raise CreditAuditError("method must be a creditaudit Method or a callable (x, y) -> [a_0, …, a_L]; "
                           f"got {type(method).__name__}")


def _accuracy(name: str, value) -> float | None:
    """An accuracy argument as a fraction in [0, 1]; percents, NaN and non-numbers are refused."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise CreditAuditError(f"diagnose: {name}={value!r} is not a number; pass the accuracy as a "
                               "fraction in [0, 1] (e.g. 0.975)")
    x = float(value)
    if math.isnan(x):
        raise CreditAuditError(f"diagnose: {name} is NaN; pass the measured accuracy as a fraction in "
                               "[0, 1], or leave it out (None) if it was not measured")
    if not 0.0 <= x <= 1.0:
        hint = f" (a percent? pass {x / 100:g})" if 1.0 < x <= 100.0 else ""
        raise CreditAuditError(f"diagnose: {name}={x:g} is not an accuracy in [0, 1]{hint}; "
                               "accuracies are fractions")
    return x


def _batches(eval_batches) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The eval batches as a list of (x, y) tensor pairs with matching lengths, or one clear error."""
    fix = "pass eval_batches as a list of (x, y) pairs: x a tensor of inputs, y a tensor of class indices"
    try:
        batches = list(eval_batches)
    except TypeError:
        raise CreditAuditError(f"diagnose: eval_batches is a {type(eval_batches).__name__}; {fix}") from None
    if not batches:
        raise CreditAuditError(f"diagnose needs at least one eval batch; {fix}")
    for i, batch in enumerate(batches):
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2
                and all(isinstance(v, torch.Tensor) for v in batch)):
            raise CreditAuditError(f"diagnose: eval batch {i} is not an (x, y) pair of tensors; {fix}")
        x, y = batch
        if y.dim() != 1 or y.dtype.is_floating_point or y.dtype == torch.bool or len(x) != len(y) or not len(y):
            raise CreditAuditError(f"diagnose: eval batch {i} has x of {len(x)} samples and y of shape "
                                   f"{tuple(y.shape)}, dtype {y.dtype}; {fix} (one integer label per sample)")
    return [(x, y) for x, y in batches]


def _rho_layers(rho) -> bool | list[int]:
    """`rho` as True/False or a list of residual positions (each an int ≥ 0; the upper bound,
    the model's L, is checked once the model is known)."""
    if isinstance(rho, bool):
        return rho
    if rho is None:
        return False
    try:
        layers = list(rho)
    except TypeError:
        layers = None
    if layers is None or isinstance(rho, (str, bytes)) or not all(
            isinstance(l, int) and not isinstance(l, bool) and l >= 0 for l in layers):
        raise CreditAuditError(f"diagnose: rho must be True, False or a list of layer indices "
                               f"0 … L (residual positions h_l), got {rho!r}")
    return layers


EXACT_TOLERANCE = 1e-6     # |1 − Γ_l| at a position declared exact by construction


def _exact_positions(method, n_blocks: int) -> list[int]:
    """The positions the method declares exact by construction (`Method.exact_positions`); none
    for a plain credit callable or a method that declares none. The declaration must be a set (or
    list, tuple) of residual positions 0 … L, each an integer (numpy's included); anything else —
    None, a string, a position of another type or out of range, a declaration that raises — is the
    method's bug, said in one line naming `exact_positions` and the fix."""
    declare = getattr(method, "exact_positions", None)
    if declare is None:
        return []
    name = getattr(method, "name", "")
    fix = (f"return a set of residual positions 0 … {n_blocks} (ints) where the credit is ∂CE/∂h_l "
           "by construction, or an empty set (docs/WRITING_A_RULE.md)")
    try:
        declared = declare(n_blocks)
    except Exception as err:  # noqa: BLE001 — a user's declaration failing is theirs to fix
        raise CreditAuditError(f"method {name!r}: exact_positions({n_blocks}) raised "
                               f"{type(err).__name__}: {' '.join(str(err).split())[:160]}; {fix}") from None
    if not isinstance(declared, (set, frozenset, list, tuple)):
        raise CreditAuditError(f"method {name!r}: exact_positions({n_blocks}) returned a "
                               f"{type(declared).__name__} ({declared!r:.80}); {fix}")
    wrong = [l for l in declared
             if isinstance(l, bool) or not isinstance(l, numbers.Integral) or not 0 <= int(l) <= n_blocks]
    if wrong:
        raise CreditAuditError(f"method {name!r}: exact_positions({n_blocks}) holds "
                               f"{', '.join(f'{l!r} ({type(l).__name__})' for l in wrong[:4])}; {fix}")
    return sorted({int(l) for l in declared})


def _check_exact_claim(method, exact: list[int], gamma: list[float]) -> None:
    """A declared exact position is measured, not believed: Γ_l must be 1 ± `EXACT_TOLERANCE` on
    the eval batches (a positive per-sample factor leaves each cosine 1), or the declaration is
    false — it would drop a measured Γ_l from the deep Γ as "exact by construction" — and is
    refused. A non-finite Γ_l is left to the credit's own gap (Γ not evaluated)."""
    false = [l for l in exact if math.isfinite(gamma[l]) and abs(1.0 - gamma[l]) > EXACT_TOLERANCE]
    if false:
        measured = ", ".join(f"Γ_{l} = {gamma[l]:.4f}" for l in false)
        raise CreditAuditError(f"method {getattr(method, 'name', '')!r}: exact_positions declares "
                               f"position(s) {', '.join(map(str, false))} exact by construction, but the "
                               f"credit measures {measured} there (exact: Γ = 1 ± {EXACT_TOLERANCE:g}); "
                               "leave out of exact_positions every position where the credit is not "
                               "∂CE/∂h_l itself (docs/WRITING_A_RULE.md)")


def _check_null(method, null) -> None:
    """null=True needs credit under fresh feedback: a Method with random feedback, or a callable
    that takes (x, y, gen); anything else is refused here rather than failing mid-diagnosis."""
    if not null or method is None:
        return
    if hasattr(method, "credit"):
        if not getattr(method, "random_feedback", False):
            raise CreditAuditError(f"diagnose: null=True, but method {getattr(method, 'name', '')!r} "
                                   "has no random feedback to redraw; drop null=True (Γ's null is "
                                   "for random-feedback methods)")
        return
    import inspect
    try:
        inspect.signature(method).bind(None, None, None)
    except TypeError:
        raise CreditAuditError("diagnose: null=True needs a credit function that takes (x, y, gen) "
                               "and draws fresh feedback from the torch.Generator gen; this one "
                               "does not take three arguments — add gen, or drop null=True") from None
    except ValueError:              # a builtin without a signature: tried when called
        pass


def _fed_batches(model, batches: list[tuple[torch.Tensor, torch.Tensor]]
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The eval batches as the model can take them, or one clear line saying why not.

    A module's eval inputs are cast to its parameters' floating dtype (float64 inputs for a
    float32 model are measured in float32, the model's own precision; float32 inputs for a
    float64 model in float64). Refused: a model or batch on the meta device (shapes without data),
    a half-precision model (the diagnostics need float32 or float64), batches on another device
    than the model, and inputs the model cannot take (wrong feature count, a non-residual step)."""
    from .adapter import check_residual
    module = model if isinstance(model, torch.nn.Module) else None
    state = list(module.parameters()) + list(module.buffers()) if module is not None else []
    if any(t.is_meta for t in state) or any(t.is_meta for b in batches for t in b):
        raise CreditAuditError("diagnose: the model or an eval batch is on the meta device (shapes "
                               "without values); load the trained weights and pass real tensors")
    floats = [p for p in state if p.is_floating_point()]
    if floats and floats[0].dtype not in (torch.float32, torch.float64):
        raise CreditAuditError(f"diagnose measures in float32 or float64, but the model's parameters "
                               f"are {floats[0].dtype}; pass model.float() (mixed precision belongs "
                               "in autocast during training, not in the weights)")
    if floats:
        device, dtype = floats[0].device, floats[0].dtype
        for i, (x, _) in enumerate(batches):
            if x.device != device:
                raise CreditAuditError(f"diagnose: eval batch {i} is on {x.device} but the model on "
                                       f"{device}; move the batches to the model's device")
        batches = [(x.to(dtype) if x.is_floating_point() else x, y) for x, y in batches]
    stream = as_stream(model)
    if not isinstance(stream, ResidualStream):
        raise CreditAuditError(f"diagnose: {type(model).__name__}.stream() returned a "
                               f"{type(stream).__name__}, not a creditaudit.ResidualStream")
    if not all(callable(step) for step in stream.steps) or not callable(stream.embed) \
            or not callable(stream.readout):
        raise CreditAuditError("diagnose: the residual stream's embed, steps and readout must be "
                               "callables (tensor → tensor); one of them is not")
    for i, (x, y) in enumerate(batches):
        try:
            check_residual(stream, x, torch.zeros_like(y))   # labels: checked in _diagnose, by class
        except CreditAuditError as err:
            raise CreditAuditError(f"diagnose: eval batch {i} (x of shape {tuple(x.shape)}, "
                                   f"{x.dtype}): {err}") from None
        except Exception as err:  # noqa: BLE001 — the readout failing on the stream is the user's
            raise CreditAuditError(f"diagnose: eval batch {i}: the readout failed on h_L "
                                   f"({type(err).__name__}: {' '.join(str(err).split())[:200]})") from None
    return batches


def _credits(credit_fn, batches, hidden_shapes: list[list[torch.Size]]) -> list[list[torch.Tensor]]:
    """The credit a_0 … a_L of every batch, each shaped like its residual position; else one error."""
    out = []
    for i, ((x, y), shapes) in enumerate(zip(batches, hidden_shapes)):
        try:
            credit = credit_fn(x, y)
        except Exception as err:  # noqa: BLE001 — the user's credit failing is theirs to fix
            raise CreditAuditError(f"diagnose: the method's credit raised {type(err).__name__} on eval "
                                   f"batch {i}: {' '.join(str(err).split())[:200]}; fix the method "
                                   "(docs/WRITING_A_RULE.md)") from None
        if not isinstance(credit, (list, tuple)) or len(credit) != len(shapes):
            n = len(credit) if isinstance(credit, (list, tuple)) else type(credit).__name__
            raise CreditAuditError(f"diagnose: the method's credit for eval batch {i} has {n} entries; it "
                                   f"must be a list of {len(shapes)} tensors a_0 … a_L, one per residual "
                                   "position h_0 … h_L")
        for l, (a, shape) in enumerate(zip(credit, shapes)):
            if not isinstance(a, torch.Tensor) or a.shape != shape:
                got = tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__
                raise CreditAuditError(f"diagnose: the credit a_{l} for eval batch {i} is {got}; it must "
                                       f"have the shape of h_{l}, {tuple(shape)}")
        out.append([a.detach() for a in credit])
    return out


def _trained_credits(method, batches, hidden_shapes: list[list[torch.Size]]
                     ) -> list[list[torch.Tensor]] | None:
    """The credit of every batch exactly as the method's training step computes it
    (`Method.trained_credit`), for a rule whose `credit` computes it otherwise (ep, pc); None for
    every other rule and for a plain credit callable."""
    trained = getattr(method, "trained_credit", None)
    if not callable(trained) or trained(*batches[0][:2]) is None:
        return None
    return _credits(trained, batches, hidden_shapes)


# |deep Γ − deep Γ as trained| above this is reported as a note: ten times what rounding moves
# either by (§3.13)
TRAINED_GAMMA_GAP = 0.01


def _trained_gamma_note(report: Report, trained: list[torch.Tensor]) -> str | None:
    """One sentence when the deep Γ of the credit as trained differs from the reported one by more
    than TRAINED_GAMMA_GAP, with the samples that training's relaxation left without any credit
    (a_l = 0 at every l = 1 … L: each counts cos 0 in Γ)."""
    deep, as_trained = report.deep_gamma()["gamma_deep"], report.deep_gamma_trained()
    if deep is None or as_trained is None or abs(deep - as_trained) <= TRAINED_GAMMA_GAP:
        return None
    zero = int(torch.stack([a.flatten(1).abs().amax(-1) == 0 for a in trained[1:]]).all(0).sum())
    return (f"Γ of the credit as trained (model dtype, strict acceptance) is deep {as_trained:+.3f} "
            f"against {deep:+.3f} for the float64 relaxation Γ reports: training's relaxation left "
            f"{zero} of {len(trained[0])} samples without any credit (every trial step rejected by "
            "the float32 test, which rounding decides for a confident sample; docs/PROTOCOL.md §3.13)")


def _pooled_bp(bps: list[M.BPGradients]) -> M.BPGradients:
    """All eval batches' samples as one BPGradients (each batch keeps its own 1/N_j)."""
    cat = lambda ts: torch.cat(ts)
    n_layers = len(bps[0].hidden)
    total = sum(len(b.logits) for b in bps)
    loss = sum(b.loss * len(b.logits) for b in bps) / total
    return M.BPGradients([cat([b.hidden[l] for b in bps]) for l in range(n_layers)],
                         [cat([b.grads[l] for b in bps]) for l in range(n_layers)],
                         cat([b.logit_grad for b in bps]), cat([b.logits for b in bps]), loss)


def diagnose(model, eval_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *,
             method=None, frozen_acc: float | None = None, test_acc: float | None = None,
             thresholds: Thresholds = Thresholds(), monitor_history: Sequence[dict] | None = None,
             null: bool | None = None, null_k: int = 20, null_seed: int = 0,
             rho: bool | Sequence[int] = False, rho_m: int = 32, rho_eps: float = 1e-3,
             rho_seed: int = 0, label: str = "", diverged: str | None = None,
             training: dict | None = None, missing_evidence: Sequence[str] = (),
             depth_unevaluated: str | None = None, weak_control: str | None = None,
             weak_decided_across_seeds: bool = False) -> Report:
    """Run the docs/PROTOCOL.md protocol on `model` (a ResidualStream or a model with `.stream()`).

    eval_batches:    list of (x, y); protocol: K ≥ 8 disjoint batches of 128 (s_l needs K ≥ 2).
                     Floating inputs are cast to a module's parameter dtype (float32 or float64),
                     so the model is measured in its own precision; half-precision weights, meta
                     tensors and inputs the model cannot take are refused in one line.
    method:          a Method, or a callable (x, y) -> [a_0 … a_L] (one tensor per residual position,
                     shaped like it); gives Γ (and the null). A non-finite credit leaves Γ not
                     evaluated and the verdict incomplete.
    frozen_acc:      accuracy (fraction in [0, 1]) of the frozen-blocks control; without it (d) is
                     None (not measured).
    test_acc:        the headline accuracy (fraction in [0, 1]) for (d); defaults to the accuracy
                     on the eval batches.
    monitor_history: per-epoch monitor dicts → the epoch each of (a), (a′), (b), (b′) first fired.
    null:            Γ under `null_k` fresh feedback draws (seeded by `null_seed`); None = do it
                     when the method has random feedback. Needs `method.fresh_feedback_credit`
                     (or, for a plain callable method, that it accepts (x, y, gen)).
                     Costs null_k × K credit computations.
    rho:             True = ρ at the deep positions 1 … L, or a list of layers; on the first eval
                     batch, with its BP and random controls. Off by default (a batched float64
                     forward of M·N states per layer).
    diverged:        the trainer's message when the run ended non-finite; (a) then fires
                     whatever the last finite checkpoint looks like.
    training:        {"status", "epochs_completed", "epochs_planned"} of the run; a run that did
                     not finish, or was stopped early, makes the verdict at best "incomplete"
                     (None: a model trained elsewhere, taken as final).
    missing_evidence: what the caller knows is missing or unchecked (e.g. "the frozen control
                     could not be verified against the initialisation"); each keeps both verdicts
                     from "trustworthy"; the report keeps them (with a non-finite credit's) as
                     `missing_evidence`, which the method verdict across seeds carries on.
    depth_unevaluated: why (d) has no control accuracy, as the evidence gate (evidence.py) said.
    weak_control:    why the control is weak, as the gate said (`Admission.weak`): short of its
                     yardstick, or not beating the untrained model by the margin. An undercut
                     against it stands; a clear does not — the project verdict's (d) is then not
                     evaluated (the paper's column keeps the paper's rule). The reason is carried
                     into the method verdict across seeds (`missing_evidence`) unless
                     `weak_decided_across_seeds` (an audit with a yardstick decides (d) against it).
    Never raises on a non-finite model: the report says so instead. Raises CreditAuditError for
    inputs out of range (accuracies outside [0, 1] or NaN, malformed batches or credit).
    """
    frozen_acc = _accuracy("frozen_acc", frozen_acc)
    test_acc = _accuracy("test_acc", test_acc)
    batches = _batches(eval_batches)
    if not isinstance(thresholds, Thresholds):
        raise CreditAuditError(f"diagnose: thresholds must be a verdict.Thresholds, got {thresholds!r}")
    if monitor_history is not None and not all(
            isinstance(r, dict) and isinstance(r.get("epoch"), int) and isinstance(r.get("h_norms"), (list, tuple))
            for r in monitor_history):
        raise CreditAuditError("diagnose: monitor_history must be the monitor's records (dicts with an "
                               "integer epoch and h_norms, as in a run's metrics.jsonl)")
    rho = _rho_layers(rho)
    for name, value in (("null_k", null_k), ("rho_m", rho_m)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CreditAuditError(f"diagnose: {name} must be a positive integer, got {value!r}")
    _check_null(method, null)
    with M.predicting(model):          # per-sample forward: BatchNorm/Dropout in eval mode
        batches = _fed_batches(model, batches)
        n_blocks = as_stream(model).n_blocks
        if rho is not True and rho and max(rho) > n_blocks:
            raise CreditAuditError(f"diagnose: rho={list(rho)} names a layer beyond the model's "
                                   f"{n_blocks} blocks; layers are 0 … {n_blocks} (positions h_0 … h_L)")
        return _diagnose(model, batches, method, frozen_acc, test_acc, thresholds,
                         monitor_history, null, null_k, null_seed, rho, rho_m, rho_eps, rho_seed,
                         label, diverged, training, list(missing_evidence), depth_unevaluated,
                         weak_control, weak_decided_across_seeds)


def _flags(values: dict, t: Thresholds, nonfinite: bool, diverged: str | None
           ) -> tuple[dict[str, bool | None], dict[str, str]]:
    """Every flag of the table on this run's statistics, and why any could not be evaluated.

    A non-finite stream or a diverged run fires (a) and (a′). On a finite stream a statistic that
    is still NaN could not be computed (e.g. no sample with a non-zero logit error for the gain):
    its flag is not evaluated, never fired or cleared by default."""
    flags = {k: f.fires(values, t) for k, f in FLAGS.items()}
    why: dict[str, str] = {}
    if diverged or nonfinite:
        flags["a"] = flags["a_prime"] = True
        return flags, why
    for k, f in FLAGS.items():
        lost = [st.name for st in f.statistics
                if st.nonfinite_fires and math.isnan(_num(values.get(st.key)))]
        if lost:
            flags[k] = None
            why[k] = f"its statistic ({', '.join(lost)}) could not be computed on these eval batches"
    return flags, why


def _diagnose(model, batches, method, frozen_acc, test_acc, t, history, null, null_k, null_seed,
              rho, rho_m, rho_eps, rho_seed, label, diverged, training, missing,
              depth_why=None, weak=None, weak_decided=False) -> Report:
    stream = as_stream(model)
    evidence.check_depth(stream.n_blocks)
    evidence.check_history(history, stream.n_blocks + 1)
    bps = []
    for i, (x, y) in enumerate(batches):
        with torch.no_grad():
            # the whole batch, not one sample: a BatchNorm left in training mode refuses a batch of 1
            n_classes = stream.forward_from(0, stream.embed(x)).shape[-1]
        if int(y.min()) < 0 or int(y.max()) >= n_classes:
            raise CreditAuditError(f"diagnose: eval batch {i} has labels {int(y.min())} … {int(y.max())}, "
                                   f"but the model has {n_classes} classes; pass labels 0 … {n_classes - 1}")
        bps.append(M.bp_gradients(stream, x, y))
    pooled = _pooled_bp(bps)
    norms = M.medians([M.per_sample_norm(t) for t in pooled.hidden + pooled.grads])  # one host read
    h_norms, g_norms = norms[:len(pooled.hidden)], norms[len(pooled.hidden):]
    gain = M.readout_gain_from(pooled)
    growth = M.max_block_growth(h_norms)
    nonfinite = not bool(torch.stack([torch.isfinite(h).all() for h in pooled.hidden + [pooled.logits]]).all())
    if nonfinite:
        growth = float("nan")
    eval_acc = float((pooled.logits.argmax(-1) == torch.cat([y for _, y in batches])).float().mean())
    stability = M.cross_batch_stability_from([b.grads for b in bps])
    mid = stream.n_blocks // 2

    depth = None
    if frozen_acc is not None:
        depth = M.depth_utility(eval_acc if test_acc is None else test_acc, frozen_acc,
                                t.depth_margin)
    monitor_now = [_num(v) for v in history[-1]["h_norms"]] if history else None
    monitor_init = ([_num(v) for v in history[0]["h_norms"]]
                    if history and int(history[0]["epoch"]) == 0 else None)
    init_growth = growth_since_init(monitor_now, monitor_init) if monitor_now else float("nan")
    stack = stack_growth(h_norms) if not nonfinite else float("nan")
    values = {"max_growth": growth, "init_growth": init_growth, "stack_growth": stack,
              "g_L": g_norms[-1], "readout_gain": gain, "stability_mid": stability[mid],
              "gap": None if depth is None else depth.gap}
    flags, not_evaluated = _flags(values, t, nonfinite, diverged)
    if depth is not None:
        depth.undercut = flags["d"]
    if flags["a_prime"] is None and "a_prime" not in not_evaluated:
        not_evaluated["a_prime"] = ("no initialisation was recorded for this model, so only the "
                                    f"whole-stack ratio ‖h_L‖/‖h_0‖ = {stack:.3g} could be measured")
    if flags["d"] is None:
        not_evaluated["d"] = depth_why or ("no accuracy of a matching, finished frozen-blocks control was given "
                              "(creditaudit diagnose --frozen-control RUN_DIR)")
    if flags["c"] is None:
        not_evaluated["c"] = "s_l needs at least two eval batches with non-zero BP gradients"
    project_flags, weak_gap = flags, []
    if weak and flags["d"] is False:
        # a clear against a weak control is no clear: the project's (d) is not evaluated
        project_flags = {**flags, "d": None}
        weak_gap = [f"(d) cannot clear against a weak control: {weak}"]
    # the caller's and the credit's gaps are carried into the method verdict; the weak control's
    # too, unless the audit decides (d) across seeds against the yardstick
    evidence_gaps = missing + ([] if weak_decided else weak_gap)
    missing = training_gaps(training) + missing

    report = Report(label, len(batches), len(pooled.logits), t, h_norms, g_norms, gain, growth,
                    pooled.loss, eval_acc, M.median(M.per_sample_norm(pooled.logit_grad)),
                    nonfinite, stability, mid, flags, Verdict("project", "incomplete"),
                    Verdict("paper", "incomplete"), [], depth=depth, diverged=diverged,
                    init_growth=init_growth, stack_growth=stack, not_evaluated=not_evaluated,
                    training=training)
    report.notes = disagreement(report)
    report.notes += [f"{FLAG_NAMES[k].split()[0]} not evaluated: {why}." for k, why in not_evaluated.items()]
    report.notes += [f"not a final result: {gap}." for gap in missing]
    if len(batches) < 8:
        report.notes.append(f"cross-batch stability used K = {len(batches)} batches; the protocol asks "
                            "for K ≥ 8, so s_l is noisier than the paper's.")

    credit_fn = _credit_fn(method)
    credits = None
    if credit_fn is not None:
        credits = _credits(credit_fn, batches, [[h.shape for h in b.hidden] for b in bps])
        report.gamma = M.gradient_cosine(M.pool_samples(credits), pooled.grads)
        trained = _trained_credits(method, batches, [[h.shape for h in b.hidden] for b in bps])
        if trained is not None:
            report.gamma_trained = M.gradient_cosine(M.pool_samples(trained), pooled.grads)
            note = _trained_gamma_note(report, M.pool_samples(trained))
            if note:
                report.notes.append(note)
        report.gamma_exact = _exact_positions(method, stream.n_blocks)
        _check_exact_claim(method, report.gamma_exact, report.gamma)
        bad = [l for l, a in enumerate(M.pool_samples(credits)) if not bool(torch.isfinite(a).all())]
        report.gamma_interpretable = not (flags["b"] or flags["b_prime"] or bad)
        if bad:
            # Γ is one of the two numbers the verdict vouches for: without it the verdict cannot
            # say the reported numbers stand
            evidence_gaps.append(f"Γ not evaluated: the method's credit is non-finite at residual "
                                 f"position(s) {', '.join(map(str, bad))}")
            missing.append(evidence_gaps[-1])
            report.notes.append(f"{missing[-1]}.")
        if null is None:
            null = bool(getattr(method, "random_feedback", False))
        if null and not bad:
            report.null = M.null_calibration(method, stream, batches, None, k=null_k,
                                             seed=null_seed)
            report.gamma_z = report.null.z(report.gamma)
    if rho:
        layers = range(1, stream.n_blocks + 1) if rho is True else rho
        x0, y0 = batches[0]
        a0 = credits[0] if credits is not None else None
        report.rho = [M.perturbation_with_controls(model, x0, y0, l, a0, m=rho_m, eps=rho_eps,
                                                   gen=derived_generator(rho_seed, f"rho:{l}"))
                      for l in layers]
        if a0 is not None:
            report.nudge = [M.nudging_test(model, x0, y0, l, a0) for l in layers]
    if history is not None:
        report.first_fire = first_fire_epochs(history, t)
    report.project = decide(project_flags, "project", nonfinite, missing + weak_gap)
    # the paper's column keeps the paper's (d) rule, but no column calls a weak control's clear
    # trustworthy: a yardstick that barely trained is no evidence for either rule
    report.paper = decide(flags, "paper", nonfinite, missing + weak_gap)
    report.missing_evidence = evidence_gaps
    report.reasons_by_flag = reasons_by_flag(report)   # last: a reason may cite ρ_BP measured above
    report.reasons = list(report.reasons_by_flag.values())
    return report
