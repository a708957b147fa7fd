"""Tests for the audit protocol: flags, verdicts, report, monitor history, threshold sensitivity."""
from __future__ import annotations

import copy
import json
import math
import re
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from creditaudit import metrics as M
from creditaudit.methods import MethodSettings
from creditaudit.methods.bp import BP
from creditaudit.model import ResidualMLP, ResidualStream
from creditaudit.errors import CreditAuditError
from creditaudit.protocol import Report, diagnose
from creditaudit.sensitivity import threshold_sensitivity
from creditaudit.verdict import Thresholds, fires_a, fires_b, fires_b_prime, first_fire_epochs


@pytest.fixture(scope="module")
def batches(digits):
    """8 disjoint batches of 128 from the training split (the test split has only 360)."""
    return [digits.eval_batch(i, 128, split="train") for i in range(8)]


@pytest.fixture(scope="module")
def trained(digits):
    """BP (the package's own method) on digits for 150 steps."""
    torch.manual_seed(0)
    model = ResidualMLP(digits.d_in, d=64, n_blocks=4)
    bp = BP(model, MethodSettings(epochs=1, lr=3e-3, trainable_blocks=(0, 1, 2, 3)))
    gen = torch.Generator().manual_seed(0)
    for _ in range(150):
        idx = torch.randint(0, len(digits.y_train), (128,), generator=gen)
        bp.train_step(digits.x_train[idx], digits.y_train[idx])
    return model, bp


def history_of(model, x, y, init=None):
    """A two-line monitor history (epoch 0 = `init`, or the model itself; epoch 1 = the model), as
    the trainer records it, so every flag of the verdict can be evaluated."""
    now = {"epoch": 1, **M.monitor_snapshot(model, x, y).to_dict()}
    return [{**(now if init is None else init), "epoch": 0}, now]


def exploded(d_in: int) -> ResidualMLP:
    """Blocks scaled to explode: W2 × 1e3 and a large random bias (a constant one LN would remove)."""
    torch.manual_seed(2)
    model = ResidualMLP(d_in, d=64, n_blocks=4)
    with torch.no_grad():
        for block in model.blocks:
            block.w2.weight.mul_(1e3)
            block.w2.bias.normal_(0, 1e6)
    return model


# ---------------------------------------------------------------------------------------------
# Flags (a), (b), (b′)
# ---------------------------------------------------------------------------------------------

def test_exploded_model_fires_a_b_and_b_prime(digits, batches):
    r = diagnose(exploded(digits.d_in), batches)
    assert r.flags["a"] and r.flags["b"] and r.flags["b_prime"]
    assert r.max_growth > 1e3
    assert r.verdict.startswith("walk back: (a) EXPLODED, ")
    assert r.verdict.endswith(", (b′) ATTENUATED") and "(b) AT FLOOR" not in r.verdict
    assert r.paper_verdict == "walk back: (a) EXPLODED, (b) AT FLOOR"
    assert not r.trustworthy
    # one reason per fired flag, each saying which reported number it invalidates
    fired = [k for k in r.flags if r.flags[k] and k != "c"]
    assert len(r.reasons) == len(fired) >= 3
    for prefix in ("(a) EXPLODED", "(b) AT FLOOR", "(b′) ATTENUATED"):
        assert sum(s.startswith(prefix) for s in r.reasons) == 1, prefix
    assert all("Γ" in s or "accuracy" in s for s in r.reasons)


def test_fresh_and_trained_models_fire_nothing(digits, batches, trained):
    torch.manual_seed(1)
    fresh = ResidualMLP(digits.d_in, d=64, n_blocks=4)
    model, bp = trained
    x, y = batches[0]
    torch.manual_seed(0)
    init = {"epoch": 0, **M.monitor_snapshot(ResidualMLP(digits.d_in, d=64, n_blocks=4), x, y).to_dict()}
    for m, method, hist in [(fresh, None, history_of(fresh, x, y)),
                            (model, bp, history_of(model, x, y, init))]:
        # without a frozen control (d) is not measured; nothing else fires
        r = diagnose(m, batches, method=method)
        assert r.flags["d"] is None
        assert not any(r.flags.values()), r.flags
        assert not r.verdict.startswith("walk back") and not r.paper_verdict.startswith("walk back")
        assert r.reasons == []
        # with every piece of evidence (a frozen control it clears, the monitor history) it is trusted
        r = diagnose(m, batches, method=method, frozen_acc=0.0, monitor_history=hist)
        assert all(v is False for v in r.flags.values()), r.flags
        assert r.verdict == r.paper_verdict == "trustworthy"
        assert r.reasons == [] and r.trustworthy
    assert r.gamma == [pytest.approx(1.0, abs=1e-5)] * 5 and r.gamma_interpretable
    assert r.eval_acc > 0.9


def test_thresholds_are_parameters(digits, batches):
    torch.manual_seed(1)
    fresh = ResidualMLP(digits.d_in, d=64, n_blocks=4)
    r = diagnose(fresh, batches, thresholds=Thresholds(growth=1.0, gain=100.0))
    assert r.flags["a"] and r.flags["b_prime"] and not r.flags["b"]


def test_b_and_b_prime_disagreement_is_explained(digits, batches, trained):
    # (b) without (b′): a model that fits its eval batches — ‖g_L‖ tiny, readout healthy
    confident = copy.deepcopy(trained[0])
    with torch.no_grad():
        confident.out_head.weight.mul_(3)
        confident.out_head.bias.mul_(3)
    x, y = batches[0]
    r = diagnose(confident, batches, frozen_acc=0.0, monitor_history=history_of(confident, x, y))
    assert r.flags["b"] and not r.flags["b_prime"]
    assert r.verdict == "trustworthy" and r.paper_verdict == "walk back: (b) AT FLOOR"
    assert any(n.startswith("(b) fired but the readout gain is healthy") for n in r.notes)
    # (b′) without (b): a moderately exploded stream on a high-loss batch
    torch.manual_seed(3)
    mild = ResidualMLP(digits.d_in, d=64, n_blocks=4)
    with torch.no_grad():
        for block in mild.blocks:
            block.w2.bias.normal_(0, 1e3)
    r = diagnose(mild, batches)
    assert r.flags["b_prime"] and not r.flags["b"]
    assert any(n.startswith("(b′) fired but (b) did not") for n in r.notes)


# ---------------------------------------------------------------------------------------------
# (d) depth utility
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("test_acc, frozen_acc, fires", [
    (0.306, 0.349, True), (0.36, 0.349, True), (0.369, 0.349, False), (0.615, 0.349, False)])
def test_d_fires_unless_two_points_clear(digits, batches, test_acc, frozen_acc, fires):
    torch.manual_seed(1)
    r = diagnose(ResidualMLP(digits.d_in, d=64, n_blocks=4), batches, test_acc=test_acc,
                 frozen_acc=frozen_acc)
    assert r.flags["d"] is fires and r.depth.undercut is fires      # the verdict sets undercut
    assert r.depth.gap == pytest.approx(test_acc - frozen_acc, nan_ok=True)
    assert ("(d) UNDERCUT" in r.verdict) is fires
    assert ("(d) UNDERCUT" in r.paper_verdict) is fires


def test_d_defaults_to_eval_accuracy(batches, trained):
    model, _ = trained
    r = diagnose(model, batches, frozen_acc=0.5)
    assert r.depth.acc == pytest.approx(r.eval_acc) and r.flags["d"] is False


# ---------------------------------------------------------------------------------------------
# Non-finite models
# ---------------------------------------------------------------------------------------------

def test_non_finite_stream_gives_a_report_not_an_exception(digits, batches, trained):
    model = copy.deepcopy(trained[0])
    with torch.no_grad():
        model.blocks[1].w1.weight[0, 0] = float("inf")
    r = diagnose(model, batches, method=lambda x, y: M.bp_gradients(model, x, y).grads,
                 rho=[2], frozen_acc=0.1)
    assert r.nonfinite and r.flags["a"]
    assert "non-finite" in r.verdict and "non-finite" in r.paper_verdict
    text = json.dumps(r.to_dict(), allow_nan=False)
    back = json.loads(text)
    assert back["max_growth"] is None and back["flags"]["a"] is True
    assert "non-finite" in str(r)
    with torch.no_grad():
        model.blocks[1].w1.weight[0, 0] = float("nan")
    assert "non-finite" in diagnose(model, batches).verdict
    head_only = copy.deepcopy(trained[0])
    with torch.no_grad():
        head_only.out_head.weight[0, 0] = float("nan")
    r = diagnose(head_only, batches)
    assert "non-finite" in r.verdict and r.to_json()


# ---------------------------------------------------------------------------------------------
# Report shape
# ---------------------------------------------------------------------------------------------

def test_report_dict_and_table(digits, batches, trained):
    model, bp = trained
    r = diagnose(model, batches, method=bp, frozen_acc=0.5, rho=True, label="bp seed 0",
                 monitor_history=[{"epoch": 1, "h_norms": [1, 2, 2, 2, 2], "g_norms": [1e-3] * 5,
                                   "max_growth": 2.0, "gain": 0.5, "test_acc": 0.9}])
    d = json.loads(json.dumps(r.to_dict(), allow_nan=False))
    for key in ("verdict", "paper_verdict", "flags", "residual_norms", "bp_grad_norms",
                "readout_gain", "max_growth", "stability", "gamma", "thresholds", "reasons"):
        assert key in d
    assert {"a", "b", "b_prime", "c", "d"} <= set(d["flags"])
    assert len(d["residual_norms"]) == len(d["bp_grad_norms"]) == len(d["stability"]) == 5
    assert {k: d["thresholds"][k] for k in ("growth", "floor", "gain", "drift", "depth_margin")} \
        == {"growth": 50.0, "floor": 1e-7, "gain": 1e-2, "drift": 0.30, "depth_margin": 0.02}
    assert [x["layer"] for x in d["rho"]] == [1, 2, 3, 4]
    assert all(x["bp"] > 0.95 and abs(x["random"]) < 0.05 for x in d["rho"])
    assert PAPER_KEYS(d["first_fire"]) == {"a": None, "b": None, "b_prime": None}
    table = str(r)
    assert "bp seed 0" in table and "verdict (paper's rule, uses b)" in table and "ρ bp" in table
    assert len({len(line) for line in table.splitlines()[6:12]}) == 1   # fixed-width rows


def test_model_mode_is_restored(batches, trained):
    model, _ = trained
    model.train()
    diagnose(model, batches)
    assert model.training


def test_null_calibration_runs_for_random_feedback(digits, batches, trained):
    model, _ = trained

    class RandomFeedback:
        random_feedback = True

        def credit(self, x, y):
            return self.fresh_feedback_credit(x, y, torch.Generator().manual_seed(0))

        def fresh_feedback_credit(self, x, y, gen):
            e = model(x).softmax(-1) - F.one_hot(y, 10).float()
            return [e.detach() @ torch.randn(10, 64, generator=gen) for _ in range(5)]

    r = diagnose(model, batches[:2], method=RandomFeedback(), null_k=5)
    assert r.null is not None and len(r.gamma_z) == 5
    assert "null μ±σ" in str(r)
    assert diagnose(model, batches[:2], method=RandomFeedback(), null=False).null is None


# ---------------------------------------------------------------------------------------------
# Monitor history and threshold sensitivity
# ---------------------------------------------------------------------------------------------

def PAPER_KEYS(first_fire: dict) -> dict:
    """The (a), (b), (b′) entries of a first-fire dict (it may carry further flags)."""
    return {k: first_fire[k] for k in ("a", "b", "b_prime")}


def test_first_fire_epochs():
    hist = []
    for epoch in range(1, 13):
        growth = 2.0 if epoch < 9 else 700.0                      # (a) at 9
        g_last = 1e-4 if epoch < 4 else 4e-9                      # (b) at 4
        gain = 0.5 if epoch < 6 else 1e-4                         # (b′) at 6
        hist.append({"epoch": epoch, "h_norms": [1.0, growth], "g_norms": [1e-3, g_last],
                     "max_growth": growth, "gain": gain, "test_acc": 0.3})
    assert PAPER_KEYS(first_fire_epochs(hist)) == {"a": 9, "b": 4, "b_prime": 6}
    assert PAPER_KEYS(first_fire_epochs(hist, Thresholds(growth=1000))) == \
        {"a": None, "b": 4, "b_prime": 6}
    json_rows = [{"epoch": 1, "h_norms": [1.0, None], "g_norms": [None, None], "gain": None}]
    assert PAPER_KEYS(first_fire_epochs(json_rows)) == {"a": 1, "b": 1, "b_prime": 1}
    assert all(v is None for v in first_fire_epochs([]).values())
    assert PAPER_KEYS(first_fire_epochs([])) == {"a": None, "b": None, "b_prime": None}


def test_flag_predicates_take_json_safe_values():
    t = Thresholds()
    assert fires_a("inf", t) and fires_a(None, t) and fires_a(51.0, t) and not fires_a(50.0, t)
    assert fires_b(None, t) and fires_b(9e-8, t) and not fires_b(1e-7, t)
    assert fires_b_prime(None, t) and fires_b_prime(0.009, t) and not fires_b_prime(0.01, t)


def _synthetic(label, growth, g_last, gain, s_mid=0.1, gap=None):
    return {"label": label, "max_growth": growth, "bp_grad_norms": [1.0, g_last],
            "readout_gain": gain, "stability_mid": s_mid,
            "depth": None if gap is None else {"gap": gap},
            "thresholds": {"growth": 50.0, "floor": 1e-7, "gain": 1e-2, "drift": 0.3,
                           "depth_margin": 0.02}}


def test_threshold_sensitivity_intervals():
    runs = [_synthetic("bp", 11.0, 1.02e-4, 0.45, 0.099, 0.266),
            _synthetic("ep", 3.0, 5e-4, 1.16, -0.036, 0.05),
            _synthetic("dfa", 694.0, 4.18e-9, 1e-4, 0.2, -0.043),
            _synthetic("sb", "inf", 1e-12, 8.2e-5, 0.992, 0.104),
            _synthetic("broken", None, None, None, None, None)]
    d, table = threshold_sensitivity(runs)
    json.dumps(d, allow_nan=False)
    assert d["growth"]["interval"] == [11.0, 694.0]
    assert d["growth"]["n_fired"] == 2 and d["growth"]["n_unmeasured"] == 1
    assert d["floor"]["interval"] == [4.18e-9, 1.02e-4]
    assert d["gain"]["interval"] == [1e-4, 0.45]
    assert d["drift"]["interval"] == [0.2, 0.992]
    assert d["depth_margin"]["interval"] == [-0.043, 0.05]
    assert "growth" in table and "[11, 694)" in table
    d2, _ = threshold_sensitivity(runs[:2])                            # nobody fires
    assert d2["growth"]["interval"] == [11.0, "inf"]


def test_threshold_sensitivity_accepts_reports(digits, batches):
    torch.manual_seed(1)
    reports = [diagnose(ResidualMLP(digits.d_in, d=64, n_blocks=4), batches),
               diagnose(exploded(digits.d_in), batches)]
    assert isinstance(reports[0], Report)
    d, _ = threshold_sensitivity(reports)
    lo, hi = d["growth"]["interval"]
    assert lo == pytest.approx(reports[0].max_growth) and hi == pytest.approx(reports[1].max_growth)


# ---------------------------------------------------------------------------------------------
# The residual-stream interface and speed
# ---------------------------------------------------------------------------------------------

class UserNet(nn.Module):
    """A model written elsewhere: tanh residual blocks, no LayerNorm, its own attribute names."""

    def __init__(self, d_in=64, width=48, depth=3, classes=10):
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.res = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh(),
                                               nn.Linear(width, width)) for _ in range(depth))
        self.cls = nn.Linear(width, classes)


def test_hand_built_stream_can_be_diagnosed(digits, batches):
    torch.manual_seed(0)
    net = UserNet(digits.d_in)
    stream = ResidualStream(embed=lambda x: net.inp(x.flatten(1)),   # digits come as (N, 1, 8, 8)
                            steps=[lambda h, f=f: h + f(h) for f in net.res],
                            readout=net.cls, branches=list(net.res))
    credit = lambda x, y: M.bp_gradients(stream, x, y).grads
    r = diagnose(stream, batches, method=credit, rho=[1, 3], frozen_acc=0.0,
                 monitor_history=history_of(stream, *batches[0]))
    assert len(r.residual_norms) == 4 and r.mid_layer == 1
    assert r.verdict == "trustworthy"
    assert r.gamma == [pytest.approx(1.0, abs=1e-5)] * 4
    assert r.rho[0].dtype == "float32" and r.rho[0].bp > 0.95 and r.rho[1].method > 0.95
    json.dumps(r.to_dict(), allow_nan=False)


def test_diagnose_is_fast_on_the_default_model():
    torch.manual_seed(0)
    model = ResidualMLP(40)                            # paper width/depth, MNIST-1D input
    gen = torch.Generator().manual_seed(0)
    eval_batches = [(torch.randn(128, 40, generator=gen), torch.randint(0, 10, (128,), generator=gen))
                    for _ in range(10)]
    start = time.perf_counter()
    r = diagnose(model, eval_batches)
    assert time.perf_counter() - start < 3.0
    assert not math.isnan(r.stability_mid)


# ---------------------------------------------------------------------------------------------
# Inputs a user can get wrong (issue 18): one clear error, or "not evaluated" — never "trustworthy"
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, words", [
    ({"test_acc": 97.5, "frozen_acc": 0.9}, "pass 0.975"),         # a percent
    ({"test_acc": 0.9, "frozen_acc": 98.89}, "pass 0.9889"),
    ({"test_acc": 1.5, "frozen_acc": 0.2}, "not an accuracy in [0, 1]"),
    ({"test_acc": -0.1, "frozen_acc": 0.2}, "not an accuracy in [0, 1]"),
    ({"test_acc": float("nan"), "frozen_acc": 0.2}, "test_acc is NaN"),
    ({"frozen_acc": float("nan")}, "frozen_acc is NaN"),
    ({"frozen_acc": "0.5"}, "is not a number"),
    ({"frozen_acc": True}, "is not a number")])
def test_accuracies_outside_zero_one_are_refused(batches, trained, kwargs, words):
    with pytest.raises(CreditAuditError, match=re.escape(words)) as err:
        diagnose(trained[0], batches, **kwargs)
    assert "\n" not in str(err.value) and "fraction" in str(err.value)


def test_malformed_batches_give_one_clear_error(batches, trained):
    x, y = batches[0]
    for bad in ([x], [(x,)], [(x, y, y)], [(x, y.float())], [(x, y[:5])], [{"x": x, "y": y}], 3, []):
        with pytest.raises(CreditAuditError, match="eval") as err:
            diagnose(trained[0], bad)
        assert "(x, y)" in str(err.value)


def test_credit_of_the_wrong_length_or_shape_is_an_error(batches, trained):
    model, _ = trained
    grads = lambda x, y: M.bp_gradients(model, x, y).grads
    with pytest.raises(CreditAuditError, match="has 1 entries; it must be a list of 5 tensors"):
        diagnose(model, batches[:2], method=lambda x, y: grads(x, y)[:1])
    with pytest.raises(CreditAuditError, match="must have the shape of h_2"):
        diagnose(model, batches[:2], method=lambda x, y: [*grads(x, y)[:2], torch.zeros(3), *grads(x, y)[3:]])
    with pytest.raises(CreditAuditError, match="callable"):
        diagnose(model, batches[:2], method=42)


def test_non_finite_credit_leaves_gamma_not_evaluated_and_the_verdict_incomplete(batches, trained):
    model, _ = trained
    x, y = batches[0]

    def nan_credit(x, y):
        grads = M.bp_gradients(model, x, y).grads
        return [g if l != 3 else torch.full_like(g, float("nan")) for l, g in enumerate(grads)]
    full = dict(frozen_acc=0.0, monitor_history=history_of(model, x, y))
    assert diagnose(model, batches[:2], method=lambda x, y: M.bp_gradients(model, x, y).grads,
                    **full).trustworthy                               # the same model, a valid credit
    r = diagnose(model, batches[:2], method=nan_credit, **full)
    assert not r.trustworthy and r.project.outcome == "incomplete" and r.paper.outcome == "incomplete"
    assert "Γ not evaluated" in r.verdict and "position(s) 3" in r.verdict
    assert r.gamma_interpretable is False and math.isnan(r.gamma[3])
    assert any("Γ not evaluated" in n for n in r.notes)


def test_a_statistic_that_cannot_be_computed_leaves_its_flag_not_evaluated(batches, trained, monkeypatch):
    """A finite model whose gain cannot be computed (NaN: e.g. no sample with a logit error) gets
    (b′) "not evaluated" with the reason, not a pass and not a fire."""
    model, _ = trained
    x, y = batches[0]
    monkeypatch.setattr(M, "readout_gain_from", lambda pooled: float("nan"))
    r = diagnose(model, batches[:2], frozen_acc=0.0, monitor_history=history_of(model, x, y))
    assert r.flags["b_prime"] is None and "could not be computed" in r.not_evaluated["b_prime"]
    assert r.project.outcome == "incomplete" and "(b′) not evaluated" in r.verdict
    assert r.paper.trustworthy                                        # the paper's verdict has no (b′)


def test_missing_evidence_keeps_both_verdicts_from_trustworthy(batches, trained):
    model, _ = trained
    x, y = batches[0]
    r = diagnose(model, batches[:2], frozen_acc=0.0, monitor_history=history_of(model, x, y),
                 missing_evidence=["the frozen control is unverified (no --init-weights)"])
    assert r.project.outcome == r.paper.outcome == "incomplete"
    assert r.verdict == "incomplete: the frozen control is unverified (no --init-weights)"


def test_verdict_is_structured_in_json(batches, trained):
    from creditaudit.verdict import Verdict, verdict_of
    r = diagnose(exploded(64), batches[:2], frozen_acc=0.9, test_acc=0.5)
    d = json.loads(r.to_json())
    project = verdict_of(d)
    assert project == r.project and project.walks_back and set(project.fired) >= {"a", "d"}
    assert Verdict.from_dict(d["verdicts"]["paper"]).text == d["paper_verdict"] == r.paper_verdict
    assert d["reasons_by_flag"]["a"].startswith("(a) EXPLODED")


def test_labels_out_of_range_and_malformed_history_are_one_line():
    """Bad inputs to the Python API are a CreditAuditError naming the fix, never a traceback."""
    from creditaudit.errors import CreditAuditError
    from creditaudit.model import ResidualMLP
    torch.manual_seed(0)
    model = ResidualMLP(12, d=8, n_blocks=1, n_classes=4)
    x = torch.randn(16, 12)
    with pytest.raises(CreditAuditError, match="labels 0 … 9, but the model has 4 classes"):
        diagnose(model, [(x, torch.arange(16) % 10)])
    with pytest.raises(CreditAuditError, match="monitor_history must be the monitor's records"):
        diagnose(model, [(x, torch.arange(16) % 4)], monitor_history=[{}])
    with pytest.raises(CreditAuditError, match="thresholds must be a verdict.Thresholds"):
        diagnose(model, [(x, torch.arange(16) % 4)], thresholds=None)
