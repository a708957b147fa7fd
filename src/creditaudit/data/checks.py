"""Whether a loaded dataset can carry a verdict at all, checked before any training or diagnosis.

A verdict compares accuracies (the run's with its controls') and reads gradients of the loss on
these data. `check_learnable` refuses, in one line each, only what cannot carry a verdict by
construction:

- one class (in either split): accuracy is 100 % for any network;
- non-finite inputs, or inputs that are all the same sample: nothing to learn from;
- inputs whose magnitude overflows float32 in a forward: a pre-LN block squares its input
  (LayerNorm's variance, ‖h‖² of the monitor), so a sample of norm ‖x‖ ≥ √(float32 max) ≈ 1.8e19
  overflows at once; we refuse from `OVERFLOW_NORM` = 1e16 (three orders of magnitude of margin for
  the embedding's gain).

Labels that look independent of the inputs (random labels, a shuffled cache) are only *warned*
about (`warn_if_labels_unpredicted`, a `LabelProbeWarning`; `--no-label-probe` silences it): the
probe is linear, and a failed test of dependence is no evidence of independence — labels that
depend on the inputs nonlinearly (a class that raises every pixel's brightness, read one-vs-rest)
fail it although a network learns them. Data whose labels carry no signal are caught where it
shows, after training: an audit seed none of whose trained arms (its yardstick, the run, its
control) beats chance is "incomplete" (`evidence.chance_gap`), never "trustworthy".

The probe: closed-form ridge regression of one-hot labels on standardised inputs, fitted on up to
`PROBE_N` training samples (a fixed subset: seed 0) and scored on up to `PROBE_N` test samples.
If the labels are independent of the inputs, the probe's prediction is independent of each test
label, so its accuracy p ≤ max_c P(y = c) =: p₀ (the majority-class rate of the test subset) and
the count of correct test predictions is at most Binomial(n, p₀) in the upper tail. We warn when
the one-sided binomial test cannot reject that null at `PROBE_ALPHA` = 1e-3, so data with random
labels pass silently in at most 0.1 % of draws. Real data sit far from that edge (the probe on the
bundled sets, tests/test_data_checks.py: digits 0.93 of 360, synthetic 0.69 of 500, mnist1d 0.23 of
1000, against chance bounds 0.11–0.14: p < 1e-29). Cost: one (n × n) kernel solve on the CPU
(n ≤ 1000), a few tens of milliseconds; the result is remembered per content digest.
"""
from __future__ import annotations

import math

import torch

import warnings

from ..errors import CreditAuditError, CreditAuditWarning
from .tensors import ArrayDataset

PROBE_N = 1000               # samples per split the probe reads
PROBE_ALPHA = 1e-3           # the largest chance that labels independent of the inputs pass
PROBE_RIDGE = 1e-2           # ridge strength, relative to the kernel's mean diagonal
OVERFLOW_NORM = 1e16         # refuse samples of this norm or more (√(float32 max) ≈ 1.8e19)
CHUNK = 4096                 # samples per pass of the checks that read every sample

_passed: set[str] = set()    # digests already checked in this process
_probed: set[str] = set()    # digests whose labels the probe already read in this process


class LabelProbeWarning(CreditAuditWarning):
    """A linear probe cannot tell the labels from random ones (see the module docstring)."""


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X ≥ k) for X ~ Binomial(n, p), summed in log space (exact; n is at most a few thousand)."""
    if k <= 0:
        return 1.0
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    i = torch.arange(k, n + 1, dtype=torch.float64)
    log_terms = (math.lgamma(n + 1) - torch.lgamma(i + 1) - torch.lgamma(n - i + 1)
                 + i * math.log(p) + (n - i) * math.log1p(-p))
    return float(torch.logsumexp(log_terms, 0).exp().clamp(max=1.0))


def probe_accuracy(data: ArrayDataset) -> tuple[int, int, float]:
    """(correct, n, p₀): the ridge probe's correct predictions on n test samples and the chance
    bound p₀ = the test subset's majority-class rate (see the module docstring)."""
    gen = torch.Generator().manual_seed(0)
    pick = lambda n: torch.randperm(n, generator=gen)[:PROBE_N]
    tr, te = pick(len(data.y_train)), pick(len(data.y_test))
    x = data.prepare(data.x_train.cpu()[tr]).flatten(1).double()
    xt = data.prepare(data.x_test.cpu()[te]).flatten(1).double()
    y, yt = data.y_train.cpu()[tr], data.y_test.cpu()[te]
    mu, sd = x.mean(0), x.std(0).clamp_min(1e-12)
    x, xt = (x - mu) / sd, (xt - mu) / sd
    onehot = torch.nn.functional.one_hot(y, data.n_classes).double()
    onehot = onehot - onehot.mean(0)
    kernel = x @ x.T                                           # dual ridge: (n × n), any input width
    lam = PROBE_RIDGE * float(kernel.diagonal().mean()) + 1e-12
    alpha = torch.linalg.solve(kernel + lam * torch.eye(len(x), dtype=x.dtype), onehot)
    pred = (xt @ x.T @ alpha).argmax(1)
    p0 = float(torch.bincount(yt, minlength=data.n_classes).max()) / len(yt)
    return int((pred == yt).sum()), len(yt), p0


def _max_norm(data: ArrayDataset, raw: torch.Tensor) -> float:
    """The largest ‖x_i‖ of the prepared inputs (normalised as the network sees them), in float64,
    a chunk at a time (a CIFAR split prepared at once would be gigabytes)."""
    return max(float(data.prepare(raw[i:i + CHUNK]).flatten(1).double().norm(dim=1).max())
               for i in range(0, len(raw), CHUNK))


def check_learnable(data: ArrayDataset, where: str) -> None:
    """Refuse (one line, naming `where` the data came from) data that cannot carry a verdict."""
    if data.digest in _passed:
        return
    for split, y in (("training", data.y_train), ("test", data.y_test)):
        classes = torch.unique(y)
        if len(classes) < 2:
            raise CreditAuditError(f"{where}: every {split} label is {int(classes[0]) if len(classes) else '—'} "
                                   "(one class): any network scores 100 %, so no verdict can be "
                                   "drawn; use data with at least two classes")
    for split, x in (("training", data.x_train), ("test", data.x_test)):
        xf = x.cpu()
        if xf.is_floating_point() and not bool(torch.isfinite(xf).all()):
            raise CreditAuditError(f"{where}: the {split} inputs hold NaN or ±inf; fix or regenerate "
                                   "the data")
    for split, raw in (("training", data.x_train), ("test", data.x_test)):
        norm = _max_norm(data, raw.cpu())
        if norm >= OVERFLOW_NORM:
            raise CreditAuditError(f"{where}: a {split} input has norm {norm:.3g}; a forward in "
                                   f"float32 squares it and overflows (limit {OVERFLOW_NORM:.0e}); "
                                   "rescale the inputs (standardise them)")
    x = data.x_train.cpu().flatten(1)
    if all(bool((x[i:i + CHUNK] == x[:1]).all()) for i in range(0, len(x), CHUNK)):
        raise CreditAuditError(f"{where}: every training input is the same sample (constant "
                               "inputs): nothing can be learned from them; fix or regenerate the data")
    _passed.add(data.digest)


def warn_if_labels_unpredicted(data: ArrayDataset, where: str) -> None:
    """Warn (`LabelProbeWarning`, once per content digest and process) when a linear probe cannot
    tell the labels from random ones at `PROBE_ALPHA`. Never refuses: labels a linear probe misses
    may still be learned (nonlinear dependence), and labels that carry no signal leave the audit
    "incomplete" after training, where it shows (`evidence.chance_gap`)."""
    if data.digest in _probed:
        return
    _probed.add(data.digest)
    correct, n, p0 = probe_accuracy(data)
    p_value = binomial_tail(correct, n, p0)
    if p_value >= PROBE_ALPHA:
        warnings.warn(LabelProbeWarning(
            f"{where}: a linear probe cannot tell the labels from random ones — it scores "
            f"{correct}/{n} = {correct / n:.3f} on held-out samples, chance is {p0:.3f} (binomial "
            f"p = {p_value:.2g} ≥ {PROBE_ALPHA:g}); labels that depend on the inputs nonlinearly "
            "can do that, shuffled or random ones do too (check them); if the labels carry no "
            "signal, the audit ends \"incomplete\" after training; --no-label-probe silences this"),
            stacklevel=3)
