"""The audit protocol of docs/PROTOCOL.md: diagnostics → flags → verdict, for one trained model.

    (a)  EXPLODED    max_l ‖h_{l+1}‖/‖h_l‖ > 50                 scale stability
    (b)  AT FLOOR    ‖g_L‖ < 1e-7                                reference validity (paper)
    (b′) ATTENUATED  readout gain ‖g_L‖/‖∂CE/∂logits‖ < 1e-2     reference validity (this project)
    (c)  DRIFT       cross-batch stability s_{L/2} > 0.30        descriptive: never changes a verdict
    (d)  UNDERCUT    test acc < frozen-blocks acc + 0.02         depth utility

    project verdict = "trustworthy" if none of (a), (b′), (d) fires, else "walk back: <fired>"
    paper verdict   = the same with (b) in place of (b′), shown beside it for comparability

A residual stream (or readout) that goes non-finite counts as (a) fired ("non-finite residual
stream"), and its (b)/(b′) as fired too: a NaN reference gradient is no reference.

`diagnose` measures everything on the eval batches the caller hands it (a list of (x, y)); the
protocol knows no training loop. Norms, gain, accuracy and Γ pool the samples of all batches (each
batch's CE mean-reduced over that batch, the paper's convention — use batches of 128 so the floor
threshold means what it says); s_l needs the batches separately.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch

from . import metrics as M
from .model import as_stream
from .seeding import derived_generator
from .store import json_safe
from .store import json_number as _num
from .verdict import (FLAG_NAMES, PAPER_FLAGS, PROJECT_FLAGS, Thresholds, _fmt, disagreement,
                      fires_a, fires_a_prime, fires_b, fires_b_prime, fires_c, fires_d,
                      first_fire_epochs, growth_since_init, reasons, stack_growth, training_gaps,
                      verdict_string)


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
    flags: dict[str, bool | None]             # a, b, b_prime, c, d
    verdict: str
    paper_verdict: str
    reasons: list[str]                        # one sentence per fired flag
    notes: list[str] = field(default_factory=list)   # (b)/(b′) disagreement and other caveats
    gamma: list[float] | None = None          # Γ_l, l = 0 … L
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
        return self.verdict == "trustworthy"

    def to_dict(self) -> dict:
        d = {
            "label": self.label, "verdict": self.verdict, "paper_verdict": self.paper_verdict,
            "flags": self.flags, "reasons": self.reasons, "notes": self.notes,
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
            "rho": None if self.rho is None else [r.to_dict() for r in self.rho],
            "depth": None if self.depth is None else self.depth.to_dict(),
            "first_fire": self.first_fire, "diverged": self.diverged,
            "init_growth": self.init_growth, "stack_growth": self.stack_growth,
            "not_evaluated": self.not_evaluated, "training": self.training,
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
                 f"verdict (project, uses b′): {self.verdict}",
                 f"verdict (paper, uses b):    {self.paper_verdict}", ""]
        rho_by_layer = {r.layer: r for r in self.rho or []}
        head = f"{'layer':>5}  {'‖h_l‖':>10}  {'‖g_l‖':>10}  {'s_l':>7}"
        if self.gamma is not None:
            head += f"  {'Γ_l':>8}"
        if self.null is not None:
            head += f"  {'null μ±σ':>15}  {'z':>7}"
        if self.rho:
            head += f"  {'ρ method':>8}  {'ρ bp':>7}  {'ρ bp32':>7}  {'ρ rand':>7}"
        lines += [head, "-" * len(head)]
        for l, (hn, gn) in enumerate(zip(self.residual_norms, self.bp_grad_norms)):
            row = f"{l:>5}  {_fmt(hn, '10.3e')}  {_fmt(gn, '10.3e')}  {_fmt(self.stability[l], '+7.3f')}"
            if self.gamma is not None:
                mark = "" if self.gamma_interpretable else "*"
                row += f"  {_fmt(self.gamma[l], '+7.3f') + mark:>8}"
            if self.null is not None:
                ms = f"{_fmt(self.null.mean[l], '+.3f')}±{_fmt(self.null.std[l], '.3f')}"
                row += f"  {ms:>15}  {_fmt(self.gamma_z[l], '+7.1f'):>7}"
            if self.rho:
                r = rho_by_layer.get(l)
                row += (f"  {_fmt(r.method, '+8.3f') if r and r.method is not None else '':>8}"
                        f"  {_fmt(r.bp, '+7.3f') if r else '':>7}"
                        f"  {_fmt(r.bp_model_precision, '+7.3f') if r else '':>7}"
                        f"  {_fmt(r.random, '+7.3f') if r else '':>7}")
            lines.append(row)
        if self.gamma is not None and not self.gamma_interpretable:
            lines.append("  * Γ uninterpretable: (b) or (b′) fired, the reference gradient is invalid")
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
                         f"   (acc {self.depth.acc:.4f} vs frozen {self.depth.frozen_acc:.4f})")
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
    raise TypeError("method must be a creditaudit Method or a callable (x, y) -> [a_0, …, a_L]")


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
             training: dict | None = None) -> Report:
    """Run the docs/PROTOCOL.md protocol on `model` (a ResidualStream or a model with `.stream()`).

    eval_batches:    list of (x, y); protocol: K ≥ 8 disjoint batches of 128 (s_l needs K ≥ 2).
    method:          a Method, or a callable (x, y) -> [a_0 … a_L]; gives Γ (and the null).
    frozen_acc:      accuracy of the frozen-blocks control; without it (d) is None (not measured).
    test_acc:        the headline accuracy for (d); defaults to the accuracy on the eval batches.
    monitor_history: per-epoch monitor dicts → the epoch each of (a), (b), (b′) first fired.
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
                     not finish makes the verdict at best "incomplete" (None: a model trained
                     elsewhere, taken as final).
    Never raises on a non-finite model: the report says so instead.
    """
    if not eval_batches:
        raise ValueError("diagnose needs at least one eval batch")
    module = model if isinstance(model, torch.nn.Module) else None
    was_training = module.training if module is not None else False
    if module is not None:
        module.eval()                  # per-sample forward: BatchNorm/Dropout in eval mode
    try:
        return _diagnose(model, list(eval_batches), method, frozen_acc, test_acc, thresholds,
                         monitor_history, null, null_k, null_seed, rho, rho_m, rho_eps, rho_seed,
                         label, diverged, training)
    finally:
        if module is not None:
            module.train(was_training)


def _diagnose(model, batches, method, frozen_acc, test_acc, t, history, null, null_k, null_seed,
              rho, rho_m, rho_eps, rho_seed, label, diverged, training) -> Report:
    stream = as_stream(model)
    bps = [M.bp_gradients(stream, x, y) for x, y in batches]
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
    if depth is not None:
        depth.undercut = fires_d(depth.gap, t)
        if depth.undercut is None:      # a non-finite accuracy: the network certainly does not clear it
            depth.undercut = True
    monitor_now = [_num(v) for v in history[-1]["h_norms"]] if history else None
    monitor_init = ([_num(v) for v in history[0]["h_norms"]]
                    if history and int(history[0]["epoch"]) == 0 else None)
    init_growth = growth_since_init(monitor_now, monitor_init) if monitor_now else float("nan")
    stack = stack_growth(h_norms) if not nonfinite else float("nan")
    flags = {"a": bool(diverged) or fires_a(growth, t),
             "a_prime": True if (diverged or nonfinite) else fires_a_prime(init_growth, stack, t),
             "b": fires_b(g_norms[-1], t), "b_prime": fires_b_prime(gain, t),
             "c": fires_c(stability[mid], t), "d": None if depth is None else depth.undercut}
    if training and training.get("status") == "stopped" and history:
        # --stop-when-flagged ended the run: the monitor's flags that held are evidence too
        last = history[-1]
        flags["a"] = flags["a"] or fires_a(last["max_growth"], t)
        flags["b_prime"] = flags["b_prime"] or fires_b_prime(last["gain"], t)
        flags["a_prime"] = flags["a_prime"] or bool(fires_a_prime(init_growth, stack_growth(monitor_now), t))
    not_evaluated = {}
    if flags["a_prime"] is None:
        not_evaluated["a_prime"] = ("no initialisation was recorded for this model, so only the "
                                    f"whole-stack ratio ‖h_L‖/‖h_0‖ = {stack:.3g} could be measured")
    if flags["d"] is None:
        not_evaluated["d"] = ("no accuracy of a matching, finished frozen-blocks control was given "
                              "(creditaudit diagnose --frozen-control RUN_DIR)")
    missing = training_gaps(training)

    report = Report(label, len(batches), len(pooled.logits), t, h_norms, g_norms, gain, growth,
                    pooled.loss, eval_acc, M.median(M.per_sample_norm(pooled.logit_grad)),
                    nonfinite, stability, mid, flags,
                    verdict_string(flags, PROJECT_FLAGS, nonfinite, missing),
                    verdict_string(flags, PAPER_FLAGS, nonfinite, missing), [], depth=depth,
                    diverged=diverged, init_growth=init_growth, stack_growth=stack,
                    not_evaluated=not_evaluated, training=training)
    report.notes = disagreement(report)
    report.notes += [f"{FLAG_NAMES[k].split()[0]} not evaluated: {why}." for k, why in not_evaluated.items()]
    report.notes += [f"not a final result: {gap}." for gap in missing]
    if len(batches) < 8:
        report.notes.append(f"cross-batch stability used K = {len(batches)} batches; the protocol asks "
                            "for K ≥ 8, so s_l is noisier than the paper's.")

    credit_fn = _credit_fn(method)
    if credit_fn is not None:
        credits = [credit_fn(x, y) for x, y in batches]
        report.gamma = M.gradient_cosine(M.pool_samples(credits), pooled.grads)
        report.gamma_interpretable = not (flags["b"] or flags["b_prime"])
        if null is None:
            null = bool(getattr(method, "random_feedback", False))
        if null:
            report.null = M.null_calibration(method, stream, batches, None, k=null_k,
                                             seed=null_seed)
            report.gamma_z = report.null.z(report.gamma)
    if rho:
        layers = range(1, stream.n_blocks + 1) if rho is True else rho
        x0, y0 = batches[0]
        a0 = credit_fn(x0, y0) if credit_fn is not None else None
        report.rho = [M.perturbation_with_controls(model, x0, y0, l, a0, m=rho_m, eps=rho_eps,
                                                   gen=derived_generator(rho_seed, f"rho:{l}"))
                      for l in layers]
        if a0 is not None:
            report.nudge = [M.nudging_test(model, x0, y0, l, a0) for l in layers]
    if history is not None:
        report.first_fire = first_fire_epochs(history, t)
    report.reasons = reasons(report)     # last: a reason may cite ρ_BP measured above
    return report


