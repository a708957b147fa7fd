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
    "not evaluated" ((d) gets no frozen accuracy; the verdict is at best "incomplete"):
      - no control; an unfinished control; a control whose blocks, embedding and readout could not
        be compared with the initial weights (`ControlEvidence.unverified`).
    weak (admitted, but (d) may not clear against it: `Admission.weak`):
      - a control that falls short of the yardstick (the same frozen blocks, embedding and readout
        trained by exact gradients) by more than `verdict.YARDSTICK_TOLERANCE`, when one was given;
        without one, a control that does not beat the untrained model (`init_acc`: its accuracy at
        initialisation) by the (d) margin. (d) across seeds then judges each weak seed against
        the yardstick (`verdict.depth_decision`); a lone run's (d) cannot clear against it.

A run's training status (finished, stopped, diverged, unfinished) is judged by
`verdict.training_gaps` inside the diagnosis, and a credit that is non-finite in a seed by the
diagnosis (Γ not evaluated); both are carried, seed by seed, into the method verdict
(`verdict.method_verdict` reads each seed's `missing_evidence`), so no seed's gap becomes a
footnote under a method's "trustworthy".
"""
from __future__ import annotations

from dataclasses import dataclass
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
        raise CreditAuditError(f"the {c.kind} control {c.where} is not this run's control: {c.mismatch}; "
                               "train the control with the run's own settings, blocks frozen")
    if c.finite is False:
        raise CreditAuditError(f"the {c.kind} control {c.where} has non-finite weights or outputs; it "
                               "diverged or is corrupt, so its accuracy is no yardstick — train it again")
    if c.blocks_at_init is False:
        raise CreditAuditError(f"the {c.kind} control {c.where} is not frozen at initialisation: its "
                               "block parameters differ from the run's initial ones; train the control "
                               "with its blocks left at their initial values")
    for part, moved in (("embedding", c.embedding_moved), ("readout", c.readout_moved)):
        if moved is False:
            raise CreditAuditError(f"the {c.kind} control {c.where} never trained its {part}: it still "
                                   "equals the initial weights, so the control is no yardstick and any "
                                   "run could clear it; train its embedding and readout like the run "
                                   "(blocks frozen), then pass it")
    if not c.finished:
        return None, f"the {c.kind} control {c.where} has not finished training"
    if c.acc is None:
        return None, f"the {c.kind} control {c.where} has no test accuracy"
    if c.unverified is not None:
        return None, (f"the {c.kind} control {c.where} (accuracy {c.acc:.4f}) is unverified: "
                      f"{c.unverified}")
    if c.finite is None or c.blocks_at_init is None or c.rest_moved is None:
        return None, (f"the {c.kind} control {c.where} could not be checked (blocks at initialisation, "
                      "embedding and readout each trained, finite weights)")
    return float(c.acc), None


def weakness(c: ControlEvidence, margin: float) -> str | None:
    """Why the control `c` is weak (None: it is not, or nothing to compare it with): short of its
    yardstick by more than YARDSTICK_TOLERANCE, or — without a yardstick — not beating the
    untrained model's accuracy by `margin` (the (d) margin)."""
    from .verdict import ACC_TOLERANCE, YARDSTICK_TOLERANCE
    if c.acc is None:
        return None
    if c.yardstick_acc is not None:
        short = c.yardstick_acc - c.acc
        if short > YARDSTICK_TOLERANCE + ACC_TOLERANCE:
            return (f"the frozen control {c.where} ({c.acc:.4f}) falls {100 * short:.1f} points short of "
                    f"its yardstick ({c.yardstick_acc:.4f}), more than the {100 * YARDSTICK_TOLERANCE:g}-"
                    "point tolerance")
        return None
    if c.init_acc is not None and c.acc < c.init_acc + margin - ACC_TOLERANCE:
        return (f"the frozen control {c.where} ({c.acc:.4f}) does not beat the untrained model "
                f"({c.init_acc:.4f}) by the +{100 * margin:g}-point margin, and no yardstick was given "
                "(the same frozen blocks, embedding and readout trained by exact gradients)")
    return None


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
