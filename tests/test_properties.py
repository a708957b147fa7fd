"""Property tests (hypothesis) over the Python API's inputs (issue 18): whatever accuracies, credits,
controls, NaNs and missing pieces `diagnose()` and `method_verdict()` are given, the verdict is
"trustworthy" only when every flag of it was evaluated on valid evidence from a finished run — and
out-of-range input is one CreditAuditError, never a verdict."""
from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from creditaudit import metrics as M
from creditaudit.errors import CreditAuditError
from creditaudit.model import ResidualMLP
from creditaudit.protocol import diagnose
from creditaudit.verdict import (FLAGS, PAPER_FLAGS, PROJECT_FLAGS, SeedEvidence, Thresholds,
                                 Verdict, method_verdict, verdict_of)

D_IN, WIDTH, BLOCKS = 12, 16, 2


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = ResidualMLP(D_IN, d=WIDTH, n_blocks=BLOCKS)
    torch.manual_seed(1)
    grown = ResidualMLP(D_IN, d=WIDTH, n_blocks=BLOCKS)
    with torch.no_grad():                       # a stream the blocks blow up: (a), (a′), (b′) fire
        for block in grown.blocks:
            block.w2.weight.mul_(1e3)
            block.w2.bias.normal_(0, 1e6)
    gen = torch.Generator().manual_seed(2)
    batches = [(torch.randn(32, D_IN, generator=gen), torch.randint(0, 10, (32,), generator=gen))
               for _ in range(3)]
    x, y = batches[0]
    init = {"epoch": 0, **M.monitor_snapshot(model, x, y).to_dict()}
    return {"models": {"healthy": model, "grown": grown}, "batches": batches, "init": init}


accuracies = st.one_of(
    st.none(), st.floats(0, 1), st.sampled_from([0.0, 1.0, 0.5, 0.02]),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(1.0001, 100), st.floats(-5, -1e-9),
    st.just(float("nan")))
credits = st.sampled_from(["none", "valid", "short", "nan", "inf", "wrong_shape", "zeros"])
trainings = st.sampled_from([None, "finished", "stopped", "diverged", "unfinished", "unknown"])


def _valid_acc(v) -> bool:
    return v is None or (isinstance(v, float) and math.isfinite(v) and 0.0 <= v <= 1.0)


def _method(kind: str, model):
    if kind == "none":
        return None

    def credit(x, y):
        grads = M.bp_gradients(model, x, y).grads
        if kind == "short":
            return grads[:-1]
        if kind == "wrong_shape":
            return [g[:, :3] for g in grads]
        if kind == "nan":
            return [g if l != 1 else torch.full_like(g, float("nan")) for l, g in enumerate(grads)]
        if kind == "inf":
            return [g if l != 0 else torch.full_like(g, float("inf")) for l, g in enumerate(grads)]
        if kind == "zeros":
            return [torch.zeros_like(g) for g in grads]
        return grads
    return credit


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from(["healthy", "grown"]), test_acc=accuracies, frozen_acc=accuracies,
       credit=credits, history=st.sampled_from(["none", "with_init", "no_init"]), training=trainings,
       missing=st.lists(st.sampled_from(["control unverified"]), max_size=1),
       thresholds=st.sampled_from([Thresholds(), Thresholds(gain=1e-12, growth=1e12, stack_growth=1e12,
                                                            init_growth=1e12, floor=0.0)]))
def test_diagnose_is_trustworthy_only_on_complete_valid_evidence(setup, which, test_acc, frozen_acc, credit,
                                                                 history, training, missing, thresholds):
    model, batches = setup["models"][which], setup["batches"]
    x, y = batches[0]
    now = {"epoch": 1, **M.monitor_snapshot(model, x, y).to_dict()}
    hist = {"none": None, "with_init": [setup["init"], now], "no_init": [now]}[history]
    train = None if training is None else {"status": None if training == "unknown" else training,
                                           "epochs_completed": 1 if training == "stopped" else 3,
                                           "epochs_planned": 3}
    kwargs = dict(test_acc=test_acc, frozen_acc=frozen_acc, method=_method(credit, model),
                  monitor_history=hist, training=train, missing_evidence=missing, thresholds=thresholds,
                  diverged="nan loss" if training == "diverged" else None)
    invalid = not (_valid_acc(test_acc) and _valid_acc(frozen_acc)) or credit in ("short", "wrong_shape")
    if invalid:
        with pytest.raises(CreditAuditError) as err:
            diagnose(model, batches, **kwargs)
        assert "\n" not in str(err.value)
        return
    r = diagnose(model, batches, **kwargs)
    d = json.loads(r.to_json())
    assert verdict_of(d, "project") == r.project and verdict_of(d, "paper") == r.paper
    complete = (frozen_acc is not None and credit not in ("nan", "inf") and not missing
                and train in (None,) + tuple(t for t in [train] if t and t["status"] == "finished"))
    for verdict, keys in ((r.project, PROJECT_FLAGS), (r.paper, PAPER_FLAGS)):
        if verdict.trustworthy:
            assert complete, (verdict, kwargs)
            assert all(r.flags[k] is False for k in keys), r.flags
            assert not r.nonfinite and not r.diverged
            if "a_prime" in keys:
                assert history == "with_init" or r.flags["a_prime"] is False
        if verdict.walks_back:
            assert verdict.fired and all(r.flags[k] for k in verdict.fired)
        else:
            assert not any(r.flags[k] for k in keys)
    if r.gamma is not None and credit in ("nan", "inf"):
        assert r.gamma_interpretable is False
        assert any(m.startswith("Γ not evaluated") for m in r.project.missing + r.paper.missing)


seed_report = st.fixed_dictionaries({
    "flags": st.fixed_dictionaries({k: st.sampled_from([True, False, None])
                                    for k in ("a", "a_prime", "b", "b_prime", "c")}),
    "training": st.sampled_from([None, {"status": "finished", "epochs_completed": 3, "epochs_planned": 3},
                                 {"status": "stopped", "epochs_completed": 1, "epochs_planned": 3},
                                 {"status": None, "epochs_completed": 2, "epochs_planned": 3}]),
    "reasons": st.just([])})
seeds = st.lists(st.tuples(st.one_of(st.none(), seed_report), st.one_of(st.none(), st.floats(0, 1)),
                           st.one_of(st.none(), st.floats(0, 1)),
                           st.sampled_from([None, 100, 10000])), min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(seeds=seeds)
def test_method_verdict_is_trustworthy_only_on_complete_evidence(seeds):
    evidence = [SeedEvidence(f"m/s{i}", "finished" if rep else "failed", rep, acc, frozen, n)
                for i, (rep, acc, frozen, n) in enumerate(seeds)]
    judged = method_verdict(evidence, Thresholds())
    for rule, keys in (("project", PROJECT_FLAGS), ("paper", PAPER_FLAGS)):
        verdict = Verdict.from_dict(judged["verdicts"][rule])
        assert verdict.text == judged["verdict" if rule == "project" else "paper_verdict"]
        if verdict.trustworthy:
            for rep, acc, frozen, _ in seeds:
                assert rep is not None and acc is not None and frozen is not None
                assert rep["training"] is None or rep["training"]["status"] == "finished"
                assert all(rep["flags"][k] is False for k in keys if k != "d")
            if rule == "project":
                assert judged["depth"]["outcome"] == "clears" and judged["depth"]["lower"] >= 0.02 - 1e-9
            else:
                assert judged["depth"]["mean"] >= 0.02 - 1e-9


def test_the_flag_table_names_every_flag_of_both_verdicts():
    assert set(PROJECT_FLAGS) == {"a", "a_prime", "b_prime", "d"} and set(PAPER_FLAGS) == {"a", "b", "d"}
    for flag in FLAGS.values():
        d = flag.to_dict()
        assert d["statistics"] and d["takes_back"] and d["sentence"] and d["evaluable"]
        assert all(s["threshold"] in Thresholds.__dataclass_fields__ for s in d["statistics"])
