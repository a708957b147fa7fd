"""Data that cannot carry a verdict by construction are refused before any training or diagnosis
(issue 28, item 3; data/checks.py), and the bundled real data never are; labels a linear probe
cannot predict are only warned about (issue 34, item 5), and labels with no signal leave an audit
"incomplete" after training (`evidence.chance_gap`)."""
import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch

from creditaudit import CreditAuditError
from creditaudit.cli import main as cli_main
from creditaudit.data import ArrayDataset, load_dataset
from creditaudit.data.checks import (PROBE_ALPHA, LabelProbeWarning, binomial_tail, check_learnable,
                                     probe_accuracy, warn_if_labels_unpredicted)


@pytest.fixture(scope="module")
def mnist1d(tmp_path_factory):
    root = tmp_path_factory.mktemp("mnist1d")
    data = load_dataset("mnist1d", root)
    with np.load(root / "mnist1d.npz") as z:
        return data, dict(z), root


def test_the_bundled_real_data_are_never_refused(mnist1d):
    """Each passes with a margin no chance could make: p far below PROBE_ALPHA."""
    for data in (load_dataset("digits"), load_dataset("synthetic"), mnist1d[0]):
        correct, n, p0 = probe_accuracy(data)
        assert correct / n > p0 + 0.1 and binomial_tail(correct, n, p0) < 1e-20, (data.name, correct, n, p0)
        check_learnable(data, data.name)
        with warnings.catch_warnings():
            warnings.simplefilter("error", LabelProbeWarning)
            warn_if_labels_unpredicted(replace(data, _digest=None), data.name)


def test_random_labels_are_warned_about_on_every_draw_never_refused():
    """Twenty random relabellings of digits: the probe warns on every one (each passes silently
    with chance ≤ 1e-3), and none is refused — a failed linear test is no proof of independence."""
    digits = load_dataset("digits")
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        shuffled = replace(digits, y_train=digits.y_train[torch.randperm(len(digits.y_train), generator=g)],
                           y_test=digits.y_test[torch.randperm(len(digits.y_test), generator=g)], _digest=None)
        check_learnable(shuffled, "shuffled digits")
        with pytest.warns(LabelProbeWarning, match="a linear probe cannot tell the labels from random"):
            warn_if_labels_unpredicted(shuffled, "shuffled digits")


def brightness_classes(n_train: int = 3000, n_test: int = 1000, seed: int = 0) -> ArrayDataset:
    """Labels that set every input's brightness, but not in order: class c lifts all 64 features by
    one of two levels symmetric about the middle (c or 7 − c), so each class's mean input is the
    same and no linear read-out of the inputs predicts it (one-vs-rest: every label is uncorrelated
    with every feature); |level − 3.5| — one ReLU — does."""
    g = torch.Generator().manual_seed(seed)

    def split(n):
        y = torch.randint(0, 4, (n,), generator=g)
        level = torch.where(torch.rand(n, generator=g) < 0.5, y, 7 - y).float()
        return torch.rand(n, 64, generator=g) - 0.5 + (level[:, None] - 3.5), y      # centred
    (x, y), (xt, yt) = split(n_train), split(n_test)
    return ArrayDataset("brightness", x, y, xt, yt, n_classes=4)


def test_labels_learnable_but_not_linearly_are_warned_about_never_refused():
    """Issue 34 item 5's case: the probe cannot read them (p ≥ PROBE_ALPHA) — the old check
    refused them — yet a small network trained on them beats chance by far."""
    from creditaudit.config import RunConfig
    from creditaudit.runs import build_method, build_model
    data = brightness_classes()
    correct, n, p0 = probe_accuracy(data)
    assert binomial_tail(correct, n, p0) >= PROBE_ALPHA, (correct, n, p0)
    check_learnable(data, "brightness")               # not refused
    with pytest.warns(LabelProbeWarning, match="--no-label-probe silences this"):
        warn_if_labels_unpredicted(data, "brightness")
    torch.manual_seed(0)
    config = RunConfig(method="bp", dataset="synthetic", width=32, blocks=1, lr=1e-2)
    model = build_model(config, data.input_shape, data.n_classes)
    method = build_method(config, model)
    for _ in range(3):
        for i in range(0, len(data.y_train), 64):
            method.train_step(data.prepare(data.x_train[i:i + 64]), data.y_train[i:i + 64])
    acc = float((model(data.prepare(data.x_test)).argmax(-1) == data.y_test).float().mean())
    assert acc > p0 + 0.2, (acc, p0)


def test_the_binomial_tail_is_exact():
    from math import comb
    for k, n, p in ((0, 5, 0.3), (3, 5, 0.3), (5, 5, 0.3), (40, 100, 0.25)):
        assert binomial_tail(k, n, p) == pytest.approx(sum(comb(n, i) * p ** i * (1 - p) ** (n - i)
                                                           for i in range(k, n + 1)), rel=1e-9)
    assert PROBE_ALPHA == 1e-3


@pytest.mark.parametrize("fault, needle", [
    ("one class", r"every training label is 0 \(one class\)"),
    ("constant inputs", "every training input is the same sample"),
    ("overflow", r"norm 6.32e\+38; a forward in float32 squares it and overflows"),
])
def test_a_mnist1d_cache_that_cannot_carry_a_verdict_is_refused(fault, needle, mnist1d, tmp_path, capsys):
    """The cache is intact in form (shapes, finite numbers, labels 0–9), so it used to train and be
    judged "trustworthy"; now `train` refuses it in one line that names the cache."""
    arrays = dict(mnist1d[1])
    rng = np.random.default_rng(0)
    if fault == "one class":
        arrays["y"], arrays["y_test"] = np.zeros_like(arrays["y"]), np.zeros_like(arrays["y_test"])
    elif fault == "constant inputs":
        arrays["x"], arrays["x_test"] = np.ones_like(arrays["x"]), np.ones_like(arrays["x_test"])
    else:
        arrays["x"], arrays["x_test"] = (np.full_like(arrays[k], 1e38) for k in ("x", "x_test"))
    np.savez(tmp_path / "mnist1d.npz", **arrays)
    code = cli_main(["train", "--dataset", "mnist1d", "--data-dir", str(tmp_path), "--width", "16",
                     "--blocks", "2", "--epochs", "1", "--quiet", "--threads", "1", "--device", "cpu",
                     "--out", str(tmp_path / "run")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert f"mnist1d (cache {tmp_path / 'mnist1d.npz'}, 4000/1000, sha " in lines[0]
    assert __import__("re").search(needle, lines[0]), lines[0]
    assert not (tmp_path / "run" / "checkpoint.json").exists()


def test_non_finite_inputs_are_refused():
    digits = load_dataset("digits")
    x = digits.x_train.clone()
    x[3, 0, 2, 2] = float("nan")
    with pytest.raises(CreditAuditError, match="inputs hold NaN"):
        check_learnable(replace(digits, x_train=x, _digest=None), "nan digits")


def test_one_class_in_the_test_split_alone_is_refused():
    digits = load_dataset("digits")
    one = replace(digits, y_test=torch.full_like(digits.y_test, 4), _digest=None)
    with pytest.raises(CreditAuditError, match=r"every test label is 4 \(one class\)"):
        check_learnable(one, "digits")


def test_what_was_loaded_is_named():
    digits = load_dataset("digits")
    assert digits.describe() == f"digits (scikit-learn's bundled copy, 1437/360, sha {digits.digest[:12]})"
    assert isinstance(digits, ArrayDataset)


def test_chance_gap_reads_the_yardstick_against_the_majority_class_by_a_binomial_test():
    """1000 balanced test labels of 10 classes: 0.10–0.12 is chance (p ≥ 1e-3), 0.14 is not; an
    imbalanced test set's chance is its majority rate, not 1/n_classes."""
    from creditaudit.evidence import chance_gap
    balanced = [i % 10 for i in range(1000)]
    assert "no signal a trained network finds" in chance_gap([("bp-frozen-s1", 0.11)], balanced, 10)
    assert "chance 0.100" in chance_gap([("a", 0.10), ("b", 0.12)], balanced, 10)
    assert chance_gap([("bp-frozen-s1", 0.14)], balanced, 10) is None
    assert chance_gap([("a", 0.10), ("b", 0.5)], balanced, 10) is None        # one arm learned
    skewed = [0] * 500 + [i % 9 + 1 for i in range(500)]
    assert "chance 0.500" in chance_gap([("a", 0.51)], skewed, 10)


def test_an_audit_on_labels_without_signal_is_incomplete_never_trustworthy(mnist1d, tmp_path):
    """Random labels are no longer refused at load (the probe only warns): they train, every arm —
    the bp yardstick included — sits at chance, and the verdict says the data carry no signal."""
    from creditaudit.config import audit_config_from_dict
    from creditaudit.experiments import audit
    arrays = dict(mnist1d[1])
    rng = np.random.default_rng(1)
    arrays["y"], arrays["y_test"] = (rng.integers(0, 10, len(arrays[k])) for k in ("y", "y_test"))
    np.savez(tmp_path / "mnist1d.npz", **arrays)
    with pytest.warns(LabelProbeWarning):
        result = audit(audit_config_from_dict({
            "dataset": "mnist1d", "methods": ["bp"], "seeds": [1], "epochs": 1, "jobs": 1,
            "controls": ["frozen"], "model": {"width": 16, "blocks": 2}, "device": "cpu",
            "data_dir": str(tmp_path), "out": str(tmp_path / "audit")}), progress=False)
    # read on every trained arm the gate admitted (the yardstick itself sits at chance, so the
    # yardstick check refuses it first, and says so too)
    gap = "the data carry no signal a trained network finds: "
    row = result["methods"][0]
    assert row["verdicts"]["project"]["outcome"] != "trustworthy"
    assert row["verdicts"]["paper"]["outcome"] != "trustworthy"
    assert any(gap in m for m in row["missing"]), row["missing"]
    run = next(r for r in result["runs"] if r["control"] == "none")
    assert run["report"]["verdicts"]["project"]["outcome"] != "trustworthy"
    assert any(gap in m for m in run["report"]["missing_evidence"])
    # the same audit on the real labels: the yardstick beats chance, and no such gap is recorded
    honest = audit(audit_config_from_dict({
        "dataset": "mnist1d", "methods": ["bp"], "seeds": [1], "epochs": 1, "jobs": 1,
        "controls": ["frozen"], "model": {"width": 16, "blocks": 2}, "device": "cpu",
        "data_dir": str(mnist1d[2]), "out": str(tmp_path / "honest")}), progress=False)
    assert not any("no signal" in m for m in honest["methods"][0]["missing"]), honest["methods"][0]["missing"]
