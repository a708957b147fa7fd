"""The Monitor in a user's own loop: the docs' example reproduces `creditaudit audit`, the run
folder reads like a trained run's, flags warn / stop, and bad use is one line with nothing lost."""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import creditaudit
from creditaudit import store
from creditaudit.cli import main
from creditaudit.data import load_dataset
from creditaudit.errors import CreditAuditError
from creditaudit.monitor import load_monitored

DOC = Path(__file__).resolve().parents[1] / "docs" / "YOUR_OWN_LOOP.md"


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def doc_section(heading: str, kind: str = "python") -> str:
    """The one ```kind block of the docs/YOUR_OWN_LOOP.md section whose "## " heading starts so."""
    sections = [s for s in DOC.read_text().split("\n## ") if s.startswith(heading)]
    assert len(sections) == 1, f"docs/YOUR_OWN_LOOP.md has no one section {heading!r}"
    blocks = re.findall(rf"```{kind}\n(.*?)```", sections[0], re.S)
    assert len(blocks) == 1, f"the section {heading!r} must hold exactly one ```{kind} block"
    return blocks[0]


def _doc_example() -> str:
    return doc_section("Reproducing `creditaudit audit` in your loop")


def test_doc_example_matches_creditaudit_audit(tmp_path, monkeypatch, capsys):
    """The hand-written DFA loop of the docs, monitored, gives the same runs (monitor lines,
    accuracies) and the same method verdict as `creditaudit audit --methods dfa` on those seeds."""
    from creditaudit.config import audit_config_from_dict
    from creditaudit.experiments import audit
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", creditaudit.FlagFired)
        exec(compile(_doc_example(), str(DOC), "exec"), scope)
    mine = scope["audit"]
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert printed == mine["methods"][0]["verdict"]

    cfg = audit_config_from_dict({"dataset": "digits", "methods": ["dfa"], "seeds": scope["SEEDS"],
                                  "epochs": scope["EPOCHS"], "controls": ["frozen"],
                                  "model": {"width": scope["WIDTH"], "blocks": scope["BLOCKS"]},
                                  "out": str(tmp_path / "ref"), "jobs": 1, "device": "cpu",
                                  "stack": False})
    ref = audit(cfg, progress=False)
    a, b = ref["methods"][0], mine["methods"][0]
    assert b["paper_verdict"] == a["paper_verdict"] and b["first_fire"] == a["first_fire"]
    assert {k: v for k, v in b["flags"].items() if k != "d"} == {k: v for k, v in a["flags"].items() if k != "d"}
    # the audit also trains each seed's yardstick (bp's frozen control); your loop gave none, so
    # its (d) rests on the gaps to the control alone: the same gaps, seed by seed, and an undercut
    # (which only the own control decides) is one in both
    assert b["depth"]["control"]["values"] == pytest.approx(a["depth"]["control"]["values"], abs=1e-9)
    assert (b["depth"]["outcome"] == "undercut") == (a["depth"]["outcome"] == "undercut")
    for key in ("acc", "frozen_acc", "depth_gap", "h_L", "g_L", "gain", "max_growth", "init_growth",
                "stack_growth"):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-9), key
    # run by run, line by line: the monitor records what the trainer records
    ref_runs = {(r["seed"], r["control"]): r for r in ref["runs"] if r["method"] == "dfa"}
    for r in mine["runs"]:
        other = ref_runs[(r["seed"], r["control"])]
        assert r["test_acc"] == pytest.approx(other["test_acc"], abs=1e-9)
        assert len(r["monitor"]) == len(other["monitor"]) == scope["EPOCHS"] + 1
        for mine_row, ref_row in zip(r["monitor"], other["monitor"]):
            assert set(mine_row) == set(ref_row)
            for key in ("h_norms", "g_norms"):
                assert mine_row[key] == pytest.approx(ref_row[key], rel=1e-5)
            assert mine_row["gain"] == pytest.approx(ref_row["gain"], rel=1e-5)
    trained = json.loads((tmp_path / "runs" / "dfa-s42" / "metrics.jsonl").read_text().splitlines()[1])
    ref_dir = next(Path(r["run_dir"]) for r in ref["runs"] if r["seed"] == 42 and r["control"] == "none"
                   and r["method"] == "dfa")
    ref_line = json.loads((ref_dir / "metrics.jsonl").read_text().splitlines()[1])
    # the same fields, so verdict code reads both — but the alignment over training, which needs
    # the credit the trainer asks its Method for and this loop hands the Monitor none of
    assert set(trained) == set(ref_line) - {"gamma", "weight_alignment"}

    # the CLI reads the folders like a trained run's and an audit's
    from creditaudit.check import exit_code
    from creditaudit.verdict import verdict_of
    assert main(["check", "audits/mine"]) == exit_code([verdict_of(b)])
    # each run's own diagnosis gained (d) when its control finished: as `diagnose RUN --frozen-control`
    for r in ref["runs"]:
        if r["control"] == "none":
            mine_diag = load_monitored(tmp_path / "runs" / f"dfa-s{r['seed']}").diagnosis
            if "weak control" not in r["report"]["verdict"]:     # the audit had a yardstick; your loop none
                assert mine_diag["verdict"] == r["report"]["verdict"]
            assert mine_diag["depth"]["gap"] == pytest.approx(r["report"]["depth"]["gap"], abs=1e-12)
    assert main(["check", "runs/dfa-s42"]) == exit_code([verdict_of(load_monitored(tmp_path / "runs" / "dfa-s42").diagnosis)])
    assert main(["diagnose", "runs/dfa-s42"]) == 0
    assert "your own loop" in capsys.readouterr().out
    assert (tmp_path / "audits" / "mine" / "audit.md").exists()


class Foreign(nn.Module):
    """A residual net that is not a creditaudit class: stem → layers (branches) → norm → head."""

    def __init__(self, d_in=64, d=16, n=2, c=10):
        super().__init__()
        self.stem = nn.Linear(d_in, d)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU(),
                                                  nn.Linear(d, d)) for _ in range(n))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, c)

    def forward(self, x):
        h = self.stem(x.flatten(1))
        for f in self.layers:
            h = h + f(h)
        return self.head(self.norm(h))


ADAPTER = creditaudit.Adapter(embed=lambda m, x: m.stem(x.flatten(1)), blocks="layers",
                              readout=("norm", "head"))


def _bp_epoch(model, data, mon, gen, opt, scale=None):
    for x, y in data.train_batches(256, gen):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        mon.step(loss, len(y))
    if scale is not None:           # a "method" whose blocks blow the stream up
        with torch.no_grad():
            for f in model.layers:
                f[3].weight.mul_(scale)


def test_monitor_with_a_credit_records_gamma_over_training(tmp_path, digits):
    """With credit=, each line the Monitor records at the trainer's alignment epochs carries Γ_l
    (here: BP's own credit, so Γ_l = 1); a credit of the wrong shape is refused in one line."""
    from creditaudit.metrics import bp_gradients
    torch.manual_seed(0)
    model = Foreign()
    stream = creditaudit.adapter.stream_of(model, ADAPTER)
    credit = lambda x, y: bp_gradients(stream, x, y).grads
    x, y = digits.eval_batch(0)
    mon = creditaudit.Monitor(model, (x, y), tmp_path / "run", epochs=2, adapter=ADAPTER, seed=0,
                              credit=credit, test_batches=[digits.eval_batch(0, 360)])
    opt = torch.optim.AdamW(model.parameters(), 1e-2)
    for _ in range(2):
        _bp_epoch(model, digits, mon, torch.Generator().manual_seed(0), opt)
        mon.epoch_end()
    mon.finish()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [len(r["gamma"]) for r in lines] == [3, 3, 3]
    assert all(g == pytest.approx(1.0, abs=1e-5) for r in lines for g in r["gamma"])
    with pytest.raises(CreditAuditError, match=r"credit must return \[a_0, …, a_L\]"):
        creditaudit.Monitor(model, (x, y), tmp_path / "bad", epochs=1, adapter=ADAPTER,
                            credit=lambda x, y: credit(x, y)[:-1])      # refused at the first line


def test_foreign_model_through_adapter_and_frozen_control(tmp_path, digits):
    torch.manual_seed(0)
    model = Foreign()
    x, y = digits.eval_batch(0)
    mon = creditaudit.Monitor(model, (x, y), tmp_path / "run", epochs=1, adapter=ADAPTER, seed=0,
                              test_batches=[digits.eval_batch(0, 360)])
    median = lambda t: float(t.norm(dim=-1).double().quantile(0.5))   # numpy's even-count median
    with torch.no_grad():
        h = model.stem(x.flatten(1))
        norms = [median(h)]
        for f in model.layers:
            h = h + f(h)
            norms.append(median(h))
    assert mon.history[0]["h_norms"] == pytest.approx(norms, rel=1e-6)
    opt = torch.optim.AdamW(model.parameters(), 1e-2)
    _bp_epoch(model, digits, mon, torch.Generator().manual_seed(0), opt)
    mon.epoch_end()
    mon.finish()

    control = mon.frozen_control()
    frozen = {n for n, p in control.named_parameters() if not p.requires_grad}
    assert frozen == {n for n, _ in control.named_parameters() if n.startswith("layers.")}
    init = store.load_checkpoint(tmp_path / "run")[1]["init"]
    assert all(torch.equal(v, init[k]) for k, v in control.state_dict().items())
    ctrl = creditaudit.Monitor(control, (x, y), tmp_path / "ctrl", epochs=1, adapter=ADAPTER,
                               control_of=tmp_path / "run", seed=0,
                               test_batches=[digits.eval_batch(0, 360)])
    assert ctrl.info["control"] == "frozen" and ctrl.info["control_of"] == str(tmp_path / "run")
    with pytest.raises(CreditAuditError, match="is a control; pass it in controls="):
        creditaudit.audit_own_runs([tmp_path / "ctrl"], out=tmp_path / "audit", n_test=360)
    with pytest.raises(CreditAuditError, match="is not a frozen control"):
        creditaudit.audit_own_runs([tmp_path / "run"], [tmp_path / "run"], out=tmp_path / "audit", n_test=360)
    with pytest.raises(CreditAuditError, match="n_test must be the number of test samples"):
        creditaudit.audit_own_runs([tmp_path / "run"], out=tmp_path / "audit", n_test=0)
    with pytest.raises(CreditAuditError, match="does not start from the initial weights"):
        creditaudit.Monitor(model, (x, y), tmp_path / "bad", epochs=1, adapter=ADAPTER,
                            control_of=mon)


def test_not_residual_and_bad_adapter_are_one_line(tmp_path, digits):
    batch = digits.eval_batch(0)
    with pytest.raises(CreditAuditError, match="exposes no residual stream"):
        creditaudit.Monitor(Foreign(), batch, tmp_path / "a", epochs=1)
    with pytest.raises(CreditAuditError, match="has no attribute 'blocks'.*stem, layers, norm, head"):
        creditaudit.Monitor(Foreign(), batch, tmp_path / "b", epochs=1,
                            adapter=creditaudit.Adapter(embed="stem", blocks="blocks", readout="head"))
    narrowing = Foreign()
    narrowing.layers[1][3] = nn.Linear(16, 8)
    with pytest.raises(CreditAuditError, match="block 1 .*not residual"):
        creditaudit.Monitor(narrowing, batch, tmp_path / "c", epochs=1, adapter=ADAPTER)
    assert not any((tmp_path / n).exists() for n in "abc")    # nothing half-written


def test_bad_use_is_one_line_and_loses_nothing(tmp_path, digits):
    torch.manual_seed(0)
    model = creditaudit.ResidualMLP(64, d=16, n_blocks=2)
    mon = creditaudit.Monitor(model, digits.eval_batch(0), tmp_path / "run", epochs=3)
    with pytest.raises(CreditAuditError, match="before any step"):
        mon.epoch_end(test_acc=0.5)
    mon.step(torch.tensor(2.0), 10)
    with pytest.raises(CreditAuditError, match="needs the test accuracy"):
        mon.epoch_end()
    with pytest.raises(CreditAuditError, match="fraction"):
        mon.epoch_end(test_acc=93.0)
    mon.epoch_end(0, test_acc=0.5)
    mon.step(torch.tensor(1.0))
    with pytest.raises(CreditAuditError, match="does not follow"):
        mon.epoch_end(5, test_acc=0.5)
    assert load_monitored(tmp_path / "run").epochs_completed == 1
    before = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()}
    with pytest.raises(CreditAuditError, match="already holds a run"):
        creditaudit.Monitor(model, digits.eval_batch(0), tmp_path / "run", epochs=3)
    assert {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()} == before
    # stopped early by the user: never trustworthy
    report = mon.finish()
    assert load_monitored(tmp_path / "run").status["status"] == "ended-early"
    assert report.verdict.startswith("incomplete") and "unfinished" in report.verdict
    with pytest.raises(CreditAuditError, match="has ended"):
        mon.step(torch.tensor(1.0))


def test_nan_loss_is_recorded_as_diverged(tmp_path, digits):
    torch.manual_seed(0)
    model = creditaudit.ResidualMLP(64, d=16, n_blocks=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with creditaudit.Monitor(model, digits.eval_batch(0), tmp_path / "run", epochs=3) as mon:
            mon.step(torch.tensor(1.0), 4)
            mon.epoch_end(test_acc=0.3)
            mon.step(torch.tensor(float("nan")), 4)
            mon.epoch_end(test_acc=0.3)
            raise AssertionError("epoch_end must raise StopRun on a NaN loss")
    run = load_monitored(tmp_path / "run")
    assert run.status["status"] == "diverged" and "non-finite" in run.status["message"]
    assert run.epochs_completed == 1                     # the last finite epoch is kept
    assert run.diagnosis["verdict"].startswith("walk back") and run.diagnosis["diverged"]
    assert any("diverged" in str(w.message) for w in caught)


def test_interrupted_and_never_finished_runs_are_incomplete(tmp_path, digits):
    model = creditaudit.ResidualMLP(64, d=16, n_blocks=2)
    with pytest.raises(KeyboardInterrupt):
        with creditaudit.Monitor(model, digits.eval_batch(0), tmp_path / "int", epochs=2) as mon:
            mon.step(torch.tensor(1.0))
            mon.epoch_end(test_acc=0.2)
            raise KeyboardInterrupt
    assert load_monitored(tmp_path / "int").status["status"] == "interrupted"
    assert main(["check", str(tmp_path / "int")]) == 3
    mon = creditaudit.Monitor(model, digits.eval_batch(0), tmp_path / "open", epochs=2)
    mon.step(torch.tensor(1.0))
    mon.epoch_end(test_acc=0.2)
    assert load_monitored(tmp_path / "open").status == {}
    assert main(["check", str(tmp_path / "open")]) == 3


def test_first_fire_warns_calls_back_and_stop_rule_stops(tmp_path, digits):
    torch.manual_seed(0)
    model = Foreign()
    opt = torch.optim.SGD(model.parameters(), 0.0)
    seen = []
    gen = torch.Generator().manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with creditaudit.Monitor(model, digits.eval_batch(0), tmp_path / "run", epochs=10,
                                 adapter=ADAPTER, stop_when_flagged=2,
                                 on_flag=lambda k, e, r: seen.append((k, e))) as mon:
            for epoch in range(10):
                _bp_epoch(model, digits, mon, gen, opt, scale=300.0)
                mon.epoch_end(epoch, test_acc=0.1)
    fired = [w for w in caught if issubclass(w.category, creditaudit.FlagFired)]
    assert ("a", 1) in seen and ("b_prime", 1) in seen
    assert len(fired) == len(seen) == len({k for k, _ in seen})       # once per flag
    run = load_monitored(tmp_path / "run")
    assert run.status["status"] == "stopped" and run.epochs_completed == 2
    assert run.diagnosis["verdict"].startswith("walk back") and "(a) EXPLODED" in run.diagnosis["verdict"]
    assert run.diagnosis["first_fire"]["a"] == 1


class _NoSync(torch.Tensor):
    """A loss that fails the test if anything reads it back to the host while armed."""

    armed = False

    def _read(self):
        if _NoSync.armed:
            raise AssertionError("Monitor.step read the loss on the host")

    def item(self):
        self._read()
        return super().item()

    def __float__(self):
        self._read()
        return super().__float__()

    def tolist(self):
        self._read()
        return super().tolist()


def test_step_never_reads_the_loss_back(tmp_path, digits):
    model = creditaudit.ResidualMLP(64, d=16, n_blocks=2)
    mon = creditaudit.Monitor(model, digits.eval_batch(0), tmp_path / "run", epochs=1)
    _NoSync.armed = True
    try:
        for value, n in ((2.0, 3), (1.0, 1)):
            mon.step(torch.Tensor._make_subclass(_NoSync, torch.tensor(value)), n)
    finally:
        _NoSync.armed = False
    record = mon.epoch_end(test_acc=0.5)                  # the epoch's one host read
    assert record["train_loss"] == pytest.approx((2.0 * 3 + 1.0) / 4)


def test_a_control_that_is_not_this_runs_frozen_control_is_refused(tmp_path, digits):
    """(d) against a control that never trained, was planned for other epochs, or belongs to
    another run from the same initial weights would turn a run "trustworthy": each is one line."""
    import torch.nn.functional as F
    from creditaudit.model import ResidualMLP
    batch = digits.eval_batch(0)
    test = [digits.eval_batch(0, 360)]

    def loop(model, mon, epochs, params=None):
        opt = torch.optim.AdamW(params if params is not None else
                                [p for p in model.parameters() if p.requires_grad], lr=3e-3)
        gen = torch.Generator().manual_seed(0)
        for _ in range(epochs):
            for x, y in digits.train_batches(64, gen):
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                mon.step(loss.detach(), len(y))
            mon.epoch_end()

    def run(name):
        torch.manual_seed(0)                                   # every run here: the same init
        model = ResidualMLP(64, d=16, n_blocks=2, n_classes=10)
        mon = creditaudit.Monitor(model, batch, tmp_path / name, epochs=2, seed=0, test_batches=test)
        loop(model, mon, 2)
        mon.finish()
        return model, mon

    model, mon = run("a")
    idle = creditaudit.Monitor(mon.frozen_control(), batch, tmp_path / "idle", epochs=2, seed=0,
                               test_batches=test, control_of=mon)
    with pytest.raises(CreditAuditError, match="never trained its (embedding|readout): it still equals"):
        loop(idle.model, idle, 2, params=list(model.parameters()))   # its optimizer holds the run's
        idle.finish()
    short = creditaudit.Monitor(mon.frozen_control(), batch, tmp_path / "short", epochs=1, seed=0,
                                test_batches=test, control_of=mon)
    with pytest.raises(CreditAuditError, match="plans 1 epochs, the run 2"):
        loop(short.model, short, 1)
        short.finish()
    _, other = run("b")                                        # same init, another run
    theirs = creditaudit.Monitor(other.frozen_control(), batch, tmp_path / "theirs", epochs=2, seed=0,
                                 test_batches=test, control_of=other)
    loop(theirs.model, theirs, 2)
    theirs.finish()
    with pytest.raises(CreditAuditError, match="was built for another run"):
        mon.finish(frozen_control=tmp_path / "theirs")
    with pytest.raises(CreditAuditError, match="was built for another run"):
        creditaudit.audit_own_runs([tmp_path / "a"], [tmp_path / "theirs"], out=tmp_path / "audit", n_test=360)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CreditAuditError, match="is a file"):
        creditaudit.audit_own_runs([tmp_path / "b"], out=tmp_path / "file", n_test=360)
    creditaudit.audit_own_runs([tmp_path / "b"], out=tmp_path / "audit", n_test=360)
    with pytest.raises(CreditAuditError, match="already holds the report of another audit"):
        creditaudit.audit_own_runs([tmp_path / "a"], out=tmp_path / "audit", n_test=360)
    creditaudit.audit_own_runs([tmp_path / "b"], out=tmp_path / "audit", n_test=360)   # the same: fine


def test_a_zero_initialised_model_is_told_its_frozen_control_is_shallow(tmp_path, digits):
    """Your own loop, a model whose residual branches start at 0: its Monitor-trained frozen control
    measures every block as the identity, and the run's diagnosis says the control equals a
    shallow network and what (d) then asks."""
    test = [digits.eval_batch(0, 360)]
    batch = digits.eval_batch(0)

    def train(model, mon):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], 1e-2)
        _bp_epoch(model, digits, mon, torch.Generator().manual_seed(0), opt)
        mon.epoch_end()
        mon.finish()
    torch.manual_seed(0)
    model = creditaudit.ResidualMLP(64, d=16, n_blocks=2, n_classes=10, w2_std=0.0)
    mon = creditaudit.Monitor(model, batch, tmp_path / "run", epochs=1, seed=0, test_batches=test)
    train(model, mon)
    ctrl = creditaudit.Monitor(mon.frozen_control(), batch, tmp_path / "ctrl", epochs=1, seed=0,
                               test_batches=test, control_of=mon)
    train(ctrl.model, ctrl)
    assert load_monitored(tmp_path / "ctrl").status["control_check"]["branch_ratio"] == 0.0
    notes = " ".join(load_monitored(tmp_path / "run").diagnosis["notes"])
    assert "exactly a shallow network" in notes and "beat no blocks at all" in notes


def test_the_monitor_guards_the_thread_count_as_the_command_line_does(tmp_path, digits, monkeypatch):
    """A Monitor in a user's loop on a busy machine: torch at more threads than the idle cores is
    lowered to them (the command line's `threads.idle_threads`), with one CreditAuditWarning that
    says what it did and how to choose; threads=N sets N, threads=None leaves torch alone, a
    count below the idle cores is never raised, and a bad value is one line. The command line's
    default is the same function."""
    from creditaudit import threads as guard
    from creditaudit.commands.running import set_threads as _set_threads
    from creditaudit.errors import CreditAuditWarning
    before = torch.get_num_threads()
    monkeypatch.setattr(guard, "idle_threads", lambda: 1)             # a busy 2-core machine
    model = lambda: creditaudit.ResidualMLP(64, d=8, n_blocks=2)
    try:
        torch.set_num_threads(2)
        with pytest.warns(CreditAuditWarning, match=r"torch was set to 2 CPU threads with 1 core\(s\) idle: set to 1"):
            creditaudit.Monitor(model(), digits.eval_batch(0), tmp_path / "a", epochs=1)
        assert torch.get_num_threads() == 1
        with warnings.catch_warnings():
            warnings.simplefilter("error", CreditAuditWarning)        # nothing to say: no warning
            creditaudit.Monitor(model(), digits.eval_batch(0), tmp_path / "b", epochs=1)
            torch.set_num_threads(2)
            creditaudit.Monitor(model(), digits.eval_batch(0), tmp_path / "c", epochs=1, threads=None)
            assert torch.get_num_threads() == 2
            creditaudit.Monitor(model(), digits.eval_batch(0), tmp_path / "d", epochs=1, threads=3)
            assert torch.get_num_threads() == 3
        with pytest.raises(CreditAuditError, match="threads must be a number of CPU threads"):
            creditaudit.Monitor(model(), digits.eval_batch(0), tmp_path / "e", epochs=1, threads=0)
        assert not (tmp_path / "e").exists()
        torch.set_num_threads(4)
        _set_threads(type("Args", (), {"threads": None})())
        assert torch.get_num_threads() == 1                           # the CLI: the same idle count
    finally:
        torch.set_num_threads(before)
