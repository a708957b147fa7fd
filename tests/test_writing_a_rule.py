"""docs/WRITING_A_RULE.md's worked examples, run as written: each ```python block of the section
"Worked examples from a user's side" is saved as the file its first line names, in a package of a
tmp folder put on sys.path, and trained and audited like a user's rule (PKG.MODULE:CLASS)."""
from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from creditaudit import store
from creditaudit.cli import main
from creditaudit.config import RunConfig
from creditaudit.data import load_dataset
from creditaudit.errors import CreditAuditError
from creditaudit.methods import method_class
from creditaudit.methods.dfa import DFA
from creditaudit.runs import build_method, build_model
from creditaudit.train import train_run

DOC = Path(__file__).resolve().parents[1] / "docs" / "WRITING_A_RULE.md"
SMALL = dict(dataset="digits", epochs=2, width=16, blocks=2, batch_size=128)


def _blocks() -> dict[str, str]:
    """{relative file: code} of the worked examples' blocks."""
    section = DOC.read_text().split("## Worked examples from a user's side", 1)[1]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    files = {}
    for code in blocks:
        first = code.splitlines()[0]
        assert first.startswith("# userrules/"), f"a worked example must start with its file name: {first!r}"
        files[first[2:]] = code
    return files


@pytest.fixture
def userrules(tmp_path, monkeypatch):
    """The examples as the package `userrules` in tmp_path/project, importable; removed after."""
    root = tmp_path / "project"
    (root / "userrules").mkdir(parents=True)
    (root / "userrules" / "__init__.py").write_text("")
    for name, code in _blocks().items():
        (root / name).write_text(code)
    monkeypatch.syspath_prepend(str(root))
    yield root
    for mod in [m for m in sys.modules if m == "userrules" or m.startswith("userrules.")]:
        del sys.modules[mod]


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def _build(spec, digits, **options):
    config = RunConfig(method=spec, options=options, **SMALL)
    torch.manual_seed(0)
    model = build_model(config, digits.input_shape, digits.n_classes)
    return config, model, build_method(config, model)


def test_the_section_has_the_three_examples():
    assert sorted(_blocks()) == ["userrules/credit_dropout.py", "userrules/raw_dfa.py",
                                 "userrules/sparse_fa.py"]


def test_sparse_fa_replaces_the_feedback_wholesale(userrules, digits, tmp_path):
    """Every feedback matrix has the asked density of non-zeros with FA's scale restored; the
    run trains on it, its checkpoint holds the sparse matrices, Γ's null draws sparse ones too."""
    spec = "userrules.sparse_fa:SparseFA"
    _, model, method = _build(spec, digits, density=0.25)
    for pair in method.feedback:
        for key, b in pair.items():
            nonzero = (b != 0).double().mean().item()
            assert abs(nonzero - 0.25) < 0.06, (key, nonzero)
            w = dict(model.blocks[0].named_modules())[key].weight
            bound = 1 / math.sqrt(w[0].numel())                   # FA's U(−bound, bound)
            assert b.abs().max().item() <= bound / math.sqrt(0.25) + 1e-6
    x, y = digits.eval_batch(0)
    gen = torch.Generator().manual_seed(3)
    seen = []
    real = sys.modules["userrules.sparse_fa"].draw_sparse_feedback
    sys.modules["userrules.sparse_fa"].draw_sparse_feedback = lambda *a: seen.append(a) or real(*a)
    try:
        credit = method.fresh_feedback_credit(x, y, gen)
    finally:
        sys.modules["userrules.sparse_fa"].draw_sparse_feedback = real
    assert len(seen) == 1 and len(credit) == model.n_blocks + 1

    run = train_run(RunConfig(method=spec, options={"density": 0.25}, **SMALL), tmp_path / "run",
                    data=digits, progress=False)
    assert run.status["status"] == "finished"
    saved = store.load_checkpoint(tmp_path / "run")[1]["method"]["extra"]["feedback"]
    for l, pair in enumerate(run.method.feedback):
        for key, b in pair.items():
            assert torch.equal(saved[f"block{l}"][key], b)
            assert 0.1 < (b != 0).double().mean().item() < 0.4


@pytest.mark.parametrize("spec", ["userrules.sparse_fa:SparseFA", "userrules.raw_dfa:RawDFA",
                                  "userrules.credit_dropout:CreditDropoutDFA", "scfa:SignConcordantFA"])
def test_the_null_of_a_subclass_is_its_own_credit_under_fresh_feedback(spec, userrules, digits, monkeypatch):
    """Γ's null asks a rule for all its draws at once (`fresh_feedback_draws`, which fa and dfa
    answer with shortcuts: one draw for every batch, one forward for every draw). A subclass's
    null must still be its own `fresh_feedback_credit` — sparse feedback for SparseFA, the raw
    credit for RawDFA, sign-synced magnitudes for docs/examples/scfa.py —, draw by draw, each batch
    given the generator at the same state."""
    from creditaudit.seeding import from_one_state
    monkeypatch.syspath_prepend(str(DOC.parent / "examples"))
    _, model, method = _build(spec, digits)
    model.eval()
    batches = [digits.eval_batch(i) for i in range(3)]
    draws = list(method.fresh_feedback_draws(batches, (torch.Generator().manual_seed(s) for s in (5, 6))))
    assert len(draws) == 2
    for draw, seed in zip(draws, (5, 6)):
        expected = from_one_state(method.fresh_feedback_credit, batches, torch.Generator().manual_seed(seed))
        for got, want in zip(draw, expected):
            assert len(got) == len(want) == model.n_blocks + 1
            assert all(torch.equal(a, b) for a, b in zip(got, want))
    sys.modules.pop("scfa", None)


def test_credit_dropout_resumes_bit_identically(userrules, digits, tmp_path, monkeypatch, every_epoch):
    """Per-step draws from self.gen: a run killed after epoch 1 and resumed equals the run trained
    straight through, every metric and weight; and the draws do change the training."""
    spec = "userrules.credit_dropout:CreditDropoutDFA"
    config = RunConfig(method=spec, options={"p": 0.5}, **SMALL)
    whole = train_run(config, tmp_path / "whole", data=digits, progress=False)

    real_save = store.save_checkpoint

    def save_then_die(run_dir, epoch, state, meta, cfg):
        real_save(run_dir, epoch, state, meta, cfg)
        if epoch == 1:
            raise KeyboardInterrupt                   # the process dies after epoch 1's checkpoint
    monkeypatch.setattr(store, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train_run(config, tmp_path / "killed", data=digits, progress=False)
    monkeypatch.setattr(store, "save_checkpoint", real_save)
    resumed = train_run(config, tmp_path / "killed", data=digits, progress=False)

    strip = lambda h: [{k: v for k, v in r.items() if k != "wall_time"} for r in h]
    assert strip(resumed.history) == strip(whole.history)
    a, b = resumed.model.state_dict(), whole.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(resumed.method.gen.get_state(), whole.method.gen.get_state())

    plain = train_run(RunConfig(method=spec, options={"p": 0.0}, **SMALL), tmp_path / "p0",
                      data=digits, progress=False)
    assert strip(plain.history) != strip(whole.history)          # the mask is applied


def test_raw_dfa_keeps_the_credit_size_and_its_range(userrules, digits, tmp_path, capsys):
    """dfa's credit is rms-normalised per sample; the raw rule's is gain·e·Bᵀ on the same B (a DFA
    subclass shares dfa's generator), so the two differ by exactly that per-sample rms."""
    spec = "userrules.raw_dfa:RawDFA"
    _, model, raw = _build(spec, digits, gain=2.0)
    dfa = DFA(model, dataclasses.replace(raw.settings, options={}))
    for b_raw, b_dfa in zip(raw.feedback, dfa.feedback):
        assert torch.equal(b_raw, b_dfa)
    x, y = digits.eval_batch(0)
    for a_raw, a_dfa in zip(raw.credit(x, y), dfa.credit(x, y)):
        rms = (a_raw / 2.0).pow(2).mean(-1, keepdim=True).sqrt()
        assert torch.allclose(a_dfa, (a_raw / 2.0) / (rms + 1e-6), rtol=1e-4, atol=1e-6)
        assert a_dfa.pow(2).mean(-1).sqrt().sub(1).abs().max() < 1e-3   # dfa: rms 1 per sample
    assert len(raw.fresh_feedback_credit(x, y, torch.Generator().manual_seed(1))) == model.n_blocks + 1

    code = main(["train", "--method", spec, "--dataset", "digits", "--epochs", "1", "--out",
                 str(tmp_path / "bad"), "--option", "gain=500"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "must lie in [0.001, 100]" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "bad" / "checkpoint.json").exists()


def test_a_plugin_run_folder_says_how_to_import_its_rule(userrules, tmp_path, capsys):
    """The run folder records where the rule came from; once it is not importable, `diagnose` and
    `check` say in one line which PYTHONPATH makes it so, and work again with it."""
    spec = "userrules.sparse_fa:SparseFA"
    run = tmp_path / "run"
    assert main(["train", "--method", spec, "--dataset", "digits", "--epochs", "1", "--width", "16",
                 "--blocks", "2", "--out", str(run), "--quiet"]) == 0
    assert main(["diagnose", str(run)]) == 0
    origin = json.loads((run / "method_origin.json").read_text())
    assert origin["sys_path_entry"] == str(userrules.resolve())
    assert origin["file"] == str((userrules / "userrules" / "sparse_fa.py").resolve())
    capsys.readouterr()

    sys.path.remove(str(userrules))
    for mod in [m for m in sys.modules if m == "userrules" or m.startswith("userrules.")]:
        del sys.modules[mod]
    for command in (["diagnose", str(run)], ["check", str(run)]):
        assert main(command) == 2
        err = capsys.readouterr().err.strip()
        assert err.endswith(f"rule {spec} is not importable; run with PYTHONPATH={userrules.resolve()} "
                            "or pip install it"), err
        assert len(err.splitlines()) == 1
    sys.path.insert(0, str(userrules))
    assert main(["check", str(run)]) in (0, 1, 3)


def test_a_rule_without_a_name_is_refused(userrules):
    (userrules / "userrules" / "nameless.py").write_text(
        "from creditaudit.methods.fa import FA\n\nclass Nameless(FA):\n    name = ''\n")
    with pytest.raises(CreditAuditError, match="set a class attribute name"):
        method_class("userrules.nameless:Nameless")
