"""Alignment over training (issue 27 item 4): the training-time monitor records Γ_l of the
method's credit every k-th epoch, and cos(W, B) for rules with feedback weights; audit.json
carries both series per run and per method; probing never changes what a run trains."""
from __future__ import annotations

import json

import pytest
import torch

from creditaudit import store
from creditaudit.config import RunConfig
from creditaudit.data import load_dataset
from creditaudit.errors import CreditAuditError
from creditaudit.experiments.audit import alignment_over_training
from creditaudit.experiments.common import Outcome
from creditaudit.methods import METHODS
from creditaudit.metrics import bp_gradients, gradient_cosine, weight_alignment
from creditaudit.runs import build_method, build_model, load_run
from creditaudit.train import alignment_every, train_run

TINY = dict(dataset="synthetic", width=16, blocks=2, batch_size=128)


@pytest.fixture(scope="module")
def synthetic():
    return load_dataset("synthetic")


def _lines(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_fa_records_gamma_and_weight_alignment_every_epoch(tmp_path, synthetic):
    """fa, 3 epochs: every metrics line carries Γ_0 … Γ_L (Γ_L = 1, a_L is exact) and cos(W, B)
    per routed weight; epoch 0's values equal an independent computation on the initial model."""
    config = RunConfig(method="fa", epochs=3, **TINY)
    run = train_run(config, tmp_path / "fa", data=synthetic, progress=False)
    lines = _lines(tmp_path / "fa")
    assert [r["epoch"] for r in lines] == [0, 1, 2, 3]
    assert lines == json.loads(json.dumps(store.json_safe(run.history)))    # the sealed history's copy
    for r in lines:
        assert len(r["gamma"]) == config.blocks + 1 and r["gamma"][-1] == pytest.approx(1.0, abs=1e-5)
        assert sorted(r["weight_alignment"]) == sorted(n for n, _, _ in run.method.feedback_pairs())
        assert len(r["weight_alignment"]) == 2 * config.blocks             # W1, W2 of each block
    # epoch 0, recomputed from the model and the feedback as built (same seed: same draws)
    model = build_model(config.bind_data(synthetic.digest), synthetic.input_shape, synthetic.n_classes)
    method = build_method(config, model)
    model.eval()
    x, y = synthetic.eval_batch(0)
    gamma = gradient_cosine(method.credit(x, y), bp_gradients(model, x, y).grads)
    assert lines[0]["gamma"] == pytest.approx(gamma, rel=1e-6, abs=1e-7)
    for name, w, b in method.feedback_pairs():
        want = float(torch.nn.functional.cosine_similarity(w.detach().flatten().double(),
                                                            b.flatten().double(), dim=0))
        assert lines[0]["weight_alignment"][name] == pytest.approx(want, abs=1e-9)


def test_kolen_pollack_weight_alignment_rises_under_strong_decay(tmp_path, synthetic):
    """Kolen–Pollack: W and B get the same update and decay λ_KP, so W − B contracts and cos(W, B)
    rises from its random start; with a strong decay it does within a few epochs.
    fa's B stays fixed: its cos(W, B) moves far less."""
    settings = dict(epochs=4, lr=1e-2, weight_decay=2.0, **TINY)
    kp = train_run(RunConfig(method="kolen-pollack", recipe="shared", options={"decay": 2.0}, **settings),
                   tmp_path / "kp", data=synthetic,
                   progress=False)
    first, last = kp.history[0]["weight_alignment"], kp.history[-1]["weight_alignment"]
    assert all(abs(first[n]) < 0.3 for n in first)                      # B drawn independently of W
    assert all(last[n] > first[n] + 0.3 for n in first), (first, last)
    fa = train_run(RunConfig(method="fa", **settings), tmp_path / "fa", data=synthetic, progress=False)
    rise = lambda h: min(h[-1]["weight_alignment"][n] - h[0]["weight_alignment"][n] for n in first)
    assert rise(kp.history) > rise(fa.history) + 0.2


def test_align_every_picks_the_probed_epochs_and_never_changes_the_run(tmp_path, synthetic):
    """k = 4 over 6 epochs probes epochs 0, 4 and the last; the weights and every other metric
    equal a run probed every epoch (the probe runs under a forked RNG)."""
    config = RunConfig(method="dfa", epochs=6, **TINY)
    sparse = train_run(config, tmp_path / "sparse", data=synthetic, progress=False, align_every=4)
    dense = train_run(config, tmp_path / "dense", data=synthetic, progress=False, align_every=1)
    assert [r["epoch"] for r in sparse.history if "gamma" in r] == [0, 4, 6]
    assert all("weight_alignment" not in r for r in sparse.history)    # dfa has no feedback weights
    assert all("gamma" in r for r in dense.history)
    strip = lambda h: [{k: v for k, v in r.items() if k not in ("gamma", "wall_time")} for r in h]
    assert strip(sparse.history) == strip(dense.history)
    sa, sd = sparse.model.state_dict(), dense.model.state_dict()
    assert all(torch.equal(sa[k], sd[k]) for k in sa)
    assert alignment_every(15) == 1 and alignment_every(100) == 5 and alignment_every(30) == 2


@pytest.mark.parametrize("method", sorted(METHODS))
def test_probing_never_changes_what_any_rule_trains(tmp_path, synthetic, method):
    """Every built-in rule: a run probed every epoch ends with the same weights and method state
    as one probed at epochs 0 and 3 only (a credit that mutated the rule's state, or drew from an
    RNG the run trains with, would show here)."""
    config = RunConfig(method=method, epochs=3, dataset="synthetic", width=8, blocks=2, batch_size=256)
    dense = train_run(config, tmp_path / "dense", data=synthetic, progress=False, align_every=1)
    sparse = train_run(config, tmp_path / "sparse", data=synthetic, progress=False, align_every=100)
    assert [r["epoch"] for r in sparse.history if "gamma" in r] == [0, 3]
    sa, sd = sparse.model.state_dict(), dense.model.state_dict()
    assert all(torch.equal(sa[k], sd[k]) for k in sa), method
    flat = lambda run: json.dumps(store.json_safe(run.method.extra_state()), default=lambda t: t.tolist())
    assert flat(sparse) == flat(dense), method


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_align_every_must_be_a_positive_count(tmp_path, synthetic, bad):
    with pytest.raises(CreditAuditError, match="align_every"):
        train_run(RunConfig(method="bp", epochs=1, **TINY), tmp_path / "r", data=synthetic,
                  progress=False, align_every=bad)


def test_weight_alignment_is_the_flattened_cosine():
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    assert weight_alignment([("a", w, w), ("b", w, -w), ("c", w, torch.tensor([[0.0, 1.0], [1.0, 0.0]]))]) \
        == pytest.approx({"a": 1.0, "b": -1.0, "c": 0.0})
    assert weight_alignment([]) == {}


def test_audit_aggregates_the_series_over_seeds(tmp_path):
    """Per method: the mean over its main runs per probed epoch; runs without the field (an older
    trainer, the user's own loop) give None rather than a made-up series."""
    config = RunConfig(method="fa", epochs=2, **TINY)
    hist = lambda g, c: [{"epoch": e, "gamma": [g + e, 1.0], "weight_alignment": {"0.w": c + e}} for e in (0, 2)]
    runs = [Outcome(config, tmp_path, "finished", "", False, history=hist(0.1, 0.0)),
            Outcome(config.replace(seed=1), tmp_path, "finished", "", False, history=hist(0.3, 0.2))]
    al = alignment_over_training(runs)
    assert al["epochs"] == [0, 2] and al["seeds"] == [2, 2]
    assert al["gamma"] == [pytest.approx([0.2, 1.0]), pytest.approx([2.2, 1.0])]
    assert al["weight_alignment"] == {"0.w": pytest.approx([0.1, 2.1])}
    old = [Outcome(config, tmp_path, "finished", "", False, history=[{"epoch": 0, "h_norms": [1.0]}])]
    assert alignment_over_training(old) is None
