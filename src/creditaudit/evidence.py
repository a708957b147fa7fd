"""The evidence gate: the one place that decides whether a run's evidence can support a verdict.

Every way into a verdict — `creditaudit diagnose` / `check` / `audit` (run folders), `--model`
(a model trained elsewhere, usermodel.py), a `PKG:CLASS` rule (trained by the same trainer), the
`Monitor` and the Lightning callback (monitor.py, lightning.py) and `audit_own_runs` — turns what
it has into one `Evidence` record and calls `gate(evidence)`. The entrances only *measure*
(`runs.control_evidence`, `usermodel.control_evidence`, `monitor.control_evidence`,
`runs.diagnosis_binding`); what the measurements mean is decided here, the same way for all.

    refused outright (CreditAuditError, one line):
      - a control that is not the run's own: another architecture, data set, seed, schedule or
        run (`ControlEvidence.mismatch`), or the run's own weights passed as its control;
      - a control whose weights or outputs are non-finite;
      - a control whose blocks moved from initialisation (it is no frozen-blocks control);
      - a control whose embedding or whose readout never moved from initialisation — each judged
        as its own group (a readout trained on a random embedding is no yardstick either);
      - a stored diagnosis bound to another run, another checkpoint or another training status
        (copied from another folder, or made before the run finished or resumed);
      - a control measured on other test batches than its run (`ControlEvidence.test_digest`,
        against the run's own);
    "not evaluated" ((d) gets no frozen accuracy; the verdict is at best "incomplete"):
      - no control; an unfinished control; a control whose blocks, embedding and readout could not
        be compared with the initial weights (`ControlEvidence.unverified`); a control or a run
        whose test batches carry no digest (a claimed accuracy, or a folder of an older creditaudit).
    weak (admitted, but (d) may not clear against it: `Admission.weak`):
      - a control that falls short of the yardstick (the same frozen blocks, embedding and readout
        trained by exact gradients) by more than `verdict.YARDSTICK_TOLERANCE`, when one was given;
        with or without one, a control that does not beat the untrained model (`init_acc`: its
        accuracy at initialisation) by the (d) margin — a yardstick never switches that check off.
        (d) across seeds then judges each weak seed against the yardstick
        (`verdict.depth_decision`); a lone run's (d) cannot clear against it.
    The yardstick is evidence too (`gate_yardstick`): it passes every check a control passes
    (named "the yardstick" in each refusal), and it is refused in one line when it does not beat
    the untrained model by the (d) margin, when it holds the control's own weights (the entrance
    compares them: `mismatch`), or when its credit is not the exact gradient at every position on
    a probe batch (`credit_cos` < 1 − EXACT_COS, measured for the audit's own bp yardstick).

A run's training status (finished, stopped, diverged, unfinished) is judged by
`verdict.training_gaps` inside the diagnosis, and a credit that is non-finite in a seed by the
diagnosis (Γ not evaluated); both are carried, seed by seed, into the method verdict
(`verdict.method_verdict` reads each seed's `missing_evidence`), so no seed's gap becomes a
footnote under a method's "trustworthy".
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from .errors import CreditAuditError


@dataclass(frozen=True)
class ControlEvidence:
    """What an entrance measured about one frozen-blocks control of a run.

    where:          how the user named it (a folder or a weights file), for messages.
    mismatch:       None when it is this run's control; else why not, in words ("arch is
                    'resmlp' there but 'vit' here", "it was built for another run (…)").
    finished:       whether its training finished (all planned epochs).
    acc:            its test accuracy (a fraction), measured like the run's.
    blocks_at_init: every block parameter equals the run's initial one (None: not checkable).
    embedding_moved / readout_moved: some parameter of the embedding (of the readout) differs from
                    its initial value — each its own group (None: not checkable).
    finite:         every weight, and its outputs on the eval batch, are finite (None: not checked).
    unverified:     why blocks/rest could not be checked (e.g. no initial weights were given).
    kind:           "frozen" (the (d) yardstick) or "shallow" (no blocks at all; reported only).
    branch_ratio:   max over its blocks and the eval batch of ‖f_l(h_l)‖ / ‖h_l‖
                    (`metrics.branch_ratios`; None: not measured). 0: every block is the identity.
    yardstick_acc:  the accuracy of the yardstick for this control (None: none given).
    init_acc:       the untrained model's accuracy (its initial weights; None: not measured).
    role:           "control", or "yardstick" when it is judged as a control's yardstick (its
                    name in every message).
    test_digest / run_test_digest: `data.batches_digest` of the test batches its accuracy (the
                    run's accuracy) was measured on; None: not recorded (a claimed accuracy, or an
                    older folder). Unequal: refused; either None: unverified (`unverified_digest`).
    credit_cos:     for a yardstick, min over positions l of Γ_l = cos(a_l, ∂CE/∂h_l) of its method's
                    credit on a probe batch (None: not measured); 1 for an exact-gradient rule.
    control_distance: for a yardstick, ‖θ_yardstick − θ_control‖ / ‖θ_control‖ over every
                    parameter (`weights_distance`; None: not measured); ≤ SAME_WEIGHTS: the
                    control's own weights, refused.
    check_digest:   whether the entrance binds accuracies to their test batches (the Monitor's
                    folders; a run folder binds its whole data set by `data_digest` instead).
    """

    where: str
    mismatch: str | None = None
    finished: bool = True
    acc: float | None = None
    blocks_at_init: bool | None = None
    embedding_moved: bool | None = None
    readout_moved: bool | None = None
    finite: bool | None = None
    unverified: str | None = None
    kind: str = "frozen"                # or "shallow": the audit's no-block control (no (d))
    branch_ratio: float | None = None
    yardstick_acc: float | None = None
    init_acc: float | None = None
    role: str = "control"
    test_digest: str | None = None
    run_test_digest: str | None = None
    credit_cos: float | None = None
    control_distance: float | None = None
    check_digest: bool = False          # whether the entrance binds accuracies to test batches

    @property
    def name(self) -> str:
        """How messages call it: "the yardstick Y", or "the frozen control C"."""
        return f"the yardstick {self.where}" if self.role == "yardstick" else f"the {self.kind} control {self.where}"

    @property
    def rest_moved(self) -> bool | None:
        """Both the embedding and the readout moved (None: one of them not checkable)."""
        if self.embedding_moved is False or self.readout_moved is False:
            return False
        return None if self.embedding_moved is None or self.readout_moved is None else True


@dataclass(frozen=True)
class Evidence:
    """What one run brings to a verdict.

    label:     the run's name in messages.
    training:  {"status", "epochs_completed", "epochs_planned"} (None: a model trained elsewhere,
               taken as final); judged by the diagnosis (`verdict.training_gaps`).
    control:   its frozen-blocks control (None: none given).
    diagnosis_binding / run_binding: for a stored diagnosis, the run it was made of (as recorded
               in it) and the run folder as it is now (`runs.diagnosis_binding`).
    """

    label: str
    training: dict | None = None
    control: ControlEvidence | None = None
    diagnosis_binding: dict | None = None
    run_binding: dict | None = None
    check_binding: bool = False
    depth_margin: float = 0.02      # (d)'s margin: a control with no yardstick must beat init by it


@dataclass(frozen=True)
class Admission:
    """What the gate lets through: (d)'s control accuracy, or None with `depth_why` saying why
    (d) is not evaluated (`protocol.diagnose(depth_unevaluated=...)` states it in the report)."""

    frozen_acc: float | None = None
    depth_why: str | None = None
    weak: str | None = None         # why the control is weak (None: not weak, or not checkable)
    note: str | None = None         # what the admitted control is, when it is not what (d) assumes


# a block whose branch moves no sample's stream by more than this (relative) is the identity
IDENTITY_RATIO = 1e-6


def control_note(c: ControlEvidence) -> str | None:
    """What (d) asks of a control whose blocks are all the identity at initialisation (measured:
    `branch_ratio` ≤ IDENTITY_RATIO, e.g. zero-initialised residual branches): such a frozen
    control is exactly a shallow network, so (d) compares the trained blocks with no blocks at all."""
    if c.kind != "frozen" or c.branch_ratio is None or not c.branch_ratio <= IDENTITY_RATIO:
        return None
    return (f"the frozen control {c.where} is exactly a shallow network (embedding → readout): every "
            f"block is the identity at initialisation (max ‖f_l(h_l)‖/‖h_l‖ = {c.branch_ratio:.1g} on "
            "the eval batch, as with zero-initialised residual branches), so its frozen blocks add "
            "nothing; (d) here asks whether the trained blocks beat no blocks at all, not whether "
            "training beats random blocks")


def _control(c: ControlEvidence) -> tuple[float | None, str | None]:
    if c.mismatch is not None:
        raise CreditAuditError(f"{c.name} is not this run's {c.role}: {c.mismatch}; "
                               f"train the {c.role} with the run's own settings, blocks frozen")
    if c.check_digest and c.test_digest is not None and c.run_test_digest is not None \
            and c.test_digest != c.run_test_digest:
        raise CreditAuditError(f"{c.name} was measured on other test batches than its run (test "
                               f"digest {c.test_digest[:12]} there, {c.run_test_digest[:12]} here): its "
                               f"accuracy is not comparable; measure the {c.role} on the run's own "
                               "test_batches")
    if c.finite is False:
        raise CreditAuditError(f"{c.name} has non-finite weights or outputs; it diverged or is "
                               "corrupt, so its accuracy is no yardstick — train it again")
    if c.blocks_at_init is False:
        raise CreditAuditError(f"{c.name} is not frozen at initialisation: its block parameters "
                               "differ from the run's initial ones; train it with its blocks left at "
                               "their initial values")
    for part, moved in (("embedding", c.embedding_moved), ("readout", c.readout_moved)):
        if moved is False:
            raise CreditAuditError(f"{c.name} never trained its {part}: it still equals the initial "
                                   f"weights, so the {c.role} is no yardstick and any run could clear "
                                   "it; train its embedding and readout like the run (blocks frozen), "
                                   "then pass it")
    if not c.finished:
        return None, f"{c.name} has not finished training"
    if c.acc is None:
        return None, f"{c.name} has no test accuracy"
    if c.unverified is not None:
        return None, f"{c.name} (accuracy {c.acc:.4f}) is unverified: {c.unverified}"
    if c.check_digest and (c.test_digest is None or c.run_test_digest is None):
        whose = "its" if c.test_digest is None else "its run's"
        return None, (f"{c.name} (accuracy {c.acc:.4f}) is unverified: {whose} test accuracy carries "
                      "no digest of the test batches it was measured on (a claimed test_acc without "
                      "test_batches, or a folder of an older creditaudit), so nothing shows that "
                      "the two were measured on the same test set; give both Monitors the same "
                      "test_batches")
    if c.finite is None or c.blocks_at_init is None or c.rest_moved is None:
        return None, (f"{c.name} could not be checked (blocks at initialisation, "
                      "embedding and readout each trained, finite weights)")
    return float(c.acc), None


def weakness(c: ControlEvidence, margin: float) -> str | None:
    """Why the control `c` is weak (None: it is not, or nothing to compare it with): short of its
    yardstick by more than YARDSTICK_TOLERANCE, or not beating the untrained model's accuracy by
    `margin` (the (d) margin) — checked whether or not a yardstick was given."""
    from .verdict import ACC_TOLERANCE, YARDSTICK_TOLERANCE
    if c.acc is None:
        return None
    if c.yardstick_acc is not None:
        short = c.yardstick_acc - c.acc
        if short > YARDSTICK_TOLERANCE + ACC_TOLERANCE:
            return (f"{c.name} ({c.acc:.4f}) falls {100 * short:.1f} points short of "
                    f"its yardstick ({c.yardstick_acc:.4f}), more than the {100 * YARDSTICK_TOLERANCE:g}-"
                    "point tolerance")
    if c.init_acc is not None and c.acc < c.init_acc + margin - ACC_TOLERANCE:
        return (f"{c.name} ({c.acc:.4f}) does not beat the untrained model "
                f"({c.init_acc:.4f}) by the +{100 * margin:g}-point margin"
                + ("" if c.yardstick_acc is not None else ", and no yardstick was given (the same "
                   "frozen blocks, embedding and readout trained by exact gradients)"))
    return None


# a yardstick's credit is the exact gradient: Γ_l = 1 to float precision at every position
EXACT_COS = 1e-6
# weights within this relative distance of the control's are the control's own (a perturbation of
# 1e-6 on a unit-scale weight is 1e-6 of it; any trained difference is orders of magnitude more)
SAME_WEIGHTS = 1e-4


def weights_distance(a: dict, b: dict) -> float:
    """‖θ_a − θ_b‖ / ‖θ_b‖ over the parameters the two state dicts share (float64; inf when b is
    all zeros and a is not): how far the weights `a` are from `b`, relative to b's size."""
    diff = sum(float((a[n].detach().double().cpu() - b[n].detach().double().cpu()).square().sum())
               for n in b if n in a and b[n].is_floating_point())
    size = sum(float(b[n].detach().double().cpu().square().sum()) for n in b if b[n].is_floating_point())
    return (diff / size) ** 0.5 if size > 0 else (0.0 if diff == 0 else float("inf"))


def gate_yardstick(y: ControlEvidence, margin: float) -> float:
    """The accuracy of the yardstick `y` (role "yardstick") as evidence, or one line (CreditAuditError):
    every check a control passes, finished and verified, then: it beats the untrained model
    (`init_acc`) by the (d) margin — a yardstick that does not has learnt nothing a control could
    fall short of —, and its credit, where measured, is the exact gradient at every position
    (min_l Γ_l ≥ 1 − EXACT_COS: a yardstick built from a rule that is not backprop is no yardstick)."""
    from .verdict import ACC_TOLERANCE
    y = y if y.role == "yardstick" else replace(y, role="yardstick")
    acc, why = _control(y)
    if acc is None:
        raise CreditAuditError(f"{why}; a yardstick must be finished and checkable to count — "
                               "finish it (or leave it out)")
    if y.control_distance is not None and not y.control_distance > SAME_WEIGHTS:
        raise CreditAuditError(f"{y.name} holds the frozen control's own weights (relative distance "
                               f"{y.control_distance:.2g} ≤ {SAME_WEIGHTS:g}): a control is no yardstick "
                               "of itself; give the same frozen blocks with embedding and readout "
                               "trained by backprop, a run of its own")
    if y.credit_cos is not None and not y.credit_cos >= 1 - EXACT_COS:
        raise CreditAuditError(f"{y.name} was not trained by exact gradients: its method's credit has "
                               f"Γ = {y.credit_cos:.6g} < 1 − {EXACT_COS:g} against ∂CE/∂h_l on a probe "
                               "batch (the backprop rule was changed, e.g. patched by an imported "
                               "module); audit with the project's own bp, in a fresh --out")
    if y.init_acc is not None and acc < y.init_acc + margin - ACC_TOLERANCE:
        raise CreditAuditError(f"{y.name} ({acc:.4f}) does not beat the untrained model "
                               f"({y.init_acc:.4f}) by the +{100 * margin:g}-point (d) margin: it is "
                               "no yardstick; train its embedding and readout by backprop until it does")
    return acc


def _binding(recorded: dict | None, actual: dict | None, label: str) -> None:
    if not isinstance(recorded, dict):
        raise CreditAuditError(f"the diagnosis of {label} names no run it belongs to (written by an "
                               "older creditaudit, or by hand); run `creditaudit diagnose` on the run "
                               "folder again")
    actual = actual or {}
    for key, what in (("run", "another run"), ("checkpoint", "another checkpoint of the run (it was "
                      "made before the run finished or resumed)"), ("status", "another training "
                      "status (it was made before the run finished or resumed)")):
        if recorded.get(key) != actual.get(key):
            raise CreditAuditError(f"the diagnosis in {label} belongs to {what}; it was copied or is "
                                   "stale — run `creditaudit diagnose` on this run folder again")


def gate(evidence: Evidence) -> Admission:
    """Decide whether `evidence` can support a verdict (the module docstring lists the rules).

    Raises CreditAuditError (one line naming the problem and the fix) for evidence that is
    wrong; returns an `Admission` saying what is usable, what is "not evaluated", and whether the
    control is weak."""
    if evidence.check_binding:
        _binding(evidence.diagnosis_binding, evidence.run_binding, evidence.label)
    if evidence.control is None:
        return Admission()
    acc, why = _control(evidence.control)
    return Admission(acc, why, None if acc is None else weakness(evidence.control, evidence.depth_margin),
                     None if acc is None else control_note(evidence.control))


CHANCE_ALPHA = 1e-3     # the largest chance that an arm which learned nothing is read as learning


def chance_gap(arms: Sequence[tuple[str, float]], y_test: Sequence[int], n_classes: int) -> str | None:
    """None when some arm's test accuracy beats chance; else the evidence gap (a `missing_evidence`
    line: the verdict becomes "incomplete", never "trustworthy").

    `arms`: (label, accuracy on the whole test set `y_test`) of every trained arm of a seed — its
    yardstick (trained by exact gradients), the run, its control: the data carry no signal when
    none of them beats chance (one that does has found one). Chance p₀ = max(1/n_classes, the test labels' majority-class rate): what a prediction
    independent of the inputs scores at most. An arm beats chance when its k = round(acc·n) correct
    answers of n have a one-sided binomial tail P(X ≥ k | n, p₀) < `CHANCE_ALPHA`; on data whose
    labels carry no signal, every arm sits at chance, and every accuracy gap (d) reads is noise."""
    from .data.checks import binomial_tail
    n = len(y_test)
    if not arms or n == 0:
        return None
    counts = [0] * max(n_classes, 1)
    for y in y_test:
        counts[int(y)] += 1
    p0 = max(1 / max(n_classes, 1), max(counts) / n)
    tails = {label: binomial_tail(round(acc * n), n, p0) for label, acc in arms}
    if min(tails.values()) < CHANCE_ALPHA:
        return None
    scores = ", ".join(f"{label} {acc:.3f}" for label, acc in arms)
    return (f"the data carry no signal a trained network finds: {scores} on {n} test samples, chance "
            f"{p0:.3f} (one-sided binomial p ≥ {min(tails.values()):.2g}, not below {CHANCE_ALPHA:g}); "
            "check the labels (shuffled? random?)")


def check_depth(n_blocks: int) -> None:
    """Refuse a residual stream without a step: with no residual block there is no depth whose
    credit could be audited, and every per-position statistic would be empty."""
    if n_blocks < 1:
        raise CreditAuditError("the residual stream has no steps (no residual block): there is no depth "
                               "to audit; give the model's blocks (Adapter(blocks=...) or the "
                               "ResidualStream's steps)")


HISTORY_FIELDS = ("epoch", "h_norms", "g_norms", "gain")    # what the flags read from a monitor line


def check_history(history, n_positions: int) -> None:
    """Refuse a monitor history a verdict cannot rest on: each line needs an integer epoch, the
    readout gain, and the median ‖h_l‖ and ‖g_l‖ at every one of the stream's `n_positions`
    residual positions (a missing ‖g_l‖ would read as (b) fired; a line of another model's depth
    would compare other positions)."""
    if history is None:
        return
    for i, row in enumerate(history):
        if not isinstance(row, dict):
            raise CreditAuditError(f"monitor_history line {i} is a {type(row).__name__}; give the "
                                   "monitor's records (dicts, as in a run's metrics.jsonl)")
        lost = [k for k in HISTORY_FIELDS if k not in row]
        if lost or isinstance(row["epoch"], bool) or not isinstance(row["epoch"], int):
            raise CreditAuditError(f"monitor_history line {i} lacks {', '.join(lost) or 'an integer epoch'}; "
                                   f"each line needs {', '.join(HISTORY_FIELDS)} (as metrics.jsonl records)")
        for key in ("h_norms", "g_norms"):
            if not isinstance(row[key], (list, tuple)) or len(row[key]) != n_positions:
                got = len(row[key]) if isinstance(row[key], (list, tuple)) else type(row[key]).__name__
                raise CreditAuditError(f"monitor_history line {i}: {key} has {got} positions, but the "
                                       f"model's residual stream has {n_positions} (h_0 … h_L); the "
                                       "history belongs to another model")
