"""Data that cannot carry a verdict are refused before any training or diagnosis (issue 28, item
3; data/checks.py), and the bundled real data never are."""
from dataclasses import replace

import numpy as np
import pytest
import torch

from creditaudit import CreditAuditError
from creditaudit.cli import main as cli_main
from creditaudit.data import ArrayDataset, load_dataset
from creditaudit.data.checks import PROBE_ALPHA, binomial_tail, check_learnable, probe_accuracy


@pytest.fixture(scope="module")
def mnist1d(tmp_path_factory):
    root = tmp_path_factory.mktemp("mnist1d")
    data = load_dataset("mnist1d", root)
    with np.load(root / "mnist1d.npz") as z:
        return data, dict(z)


def test_the_bundled_real_data_are_never_refused(mnist1d):
    """Each passes with a margin no chance could make: p far below PROBE_ALPHA."""
    for data in (load_dataset("digits"), load_dataset("synthetic"), mnist1d[0]):
        correct, n, p0 = probe_accuracy(data)
        assert correct / n > p0 + 0.1 and binomial_tail(correct, n, p0) < 1e-20, (data.name, correct, n, p0)
        check_learnable(data, data.name)


def test_random_labels_are_refused_on_every_draw():
    """Twenty random relabellings of digits: every one refused (each passes with chance ≤ 1e-3)."""
    digits = load_dataset("digits")
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        shuffled = replace(digits, y_train=digits.y_train[torch.randperm(len(digits.y_train), generator=g)],
                           y_test=digits.y_test[torch.randperm(len(digits.y_test), generator=g)], _digest=None)
        with pytest.raises(CreditAuditError, match="labels look independent of the inputs"):
            check_learnable(shuffled, "shuffled digits")


def test_the_binomial_tail_is_exact():
    from math import comb
    for k, n, p in ((0, 5, 0.3), (3, 5, 0.3), (5, 5, 0.3), (40, 100, 0.25)):
        assert binomial_tail(k, n, p) == pytest.approx(sum(comb(n, i) * p ** i * (1 - p) ** (n - i)
                                                           for i in range(k, n + 1)), rel=1e-9)
    assert PROBE_ALPHA == 1e-3


@pytest.mark.parametrize("fault, needle", [
    ("one class", r"every training label is 0 \(one class\)"),
    ("constant inputs", "every training input is the same sample"),
    ("random labels", "labels look independent of the inputs"),
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
    elif fault == "random labels":
        arrays["y"], arrays["y_test"] = (rng.integers(0, 10, len(arrays[k])) for k in ("y", "y_test"))
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
