"""A control is evidence only when it measures up to a yardstick the tool trains itself (issue 28,
items 1, 4 and 5): bp's frozen control of the same seed; the embedding and the readout each checked
as their own group; one rule one method however it is spelled; folders mean one thing; and (d)
with no seed spread does not decide. Each class through the entrance a user would take, on tiny runs
(digits, width 16, 2 blocks, 1–2 epochs)."""
from __future__ import annotations

import contextlib
import io
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import creditaudit
from creditaudit import store
from creditaudit.check import check_path
from creditaudit.cli import main as cli_main
from creditaudit.config import RunConfig, audit_config_from_dict
from creditaudit.errors import CreditAuditError
from creditaudit.experiments import audit, read_audit
from creditaudit.methods import METHODS, resolve_method_name
from creditaudit.model import ResidualMLP
from creditaudit.runs import build_method, build_model

TINY = ["--dataset", "digits", "--width", "16", "--blocks", "2", "--quiet", "--threads", "1",
        "--device", "cpu"]

# Controls that barely train, each a class of issue 28: the rule trains its main run like bp, and
# its frozen control (no trainable block) differently.
RULES = '''
from creditaudit.methods.bp import BP

class TimidControlBP(BP):
    """Its frozen control steps at 1e-3 x the learning rate: embedding and readout move by ~1e-6."""
    def __init__(self, model, settings):
        super().__init__(model, settings)
        if not settings.trainable_blocks:
            for group in self.opt.param_groups:
                group["lr"] *= 1e-3

class OneStepControlBP(BP):
    """Its frozen control takes one optimizer step, then no more."""
    def gradients(self, x, y):
        loss = super().gradients(x, y)
        if not self.settings.trainable_blocks:
            if getattr(self, "_stepped", False):
                for p in self.model.parameters():
                    p.grad = None
            self._stepped = True
        return loss

class ReadoutOnlyControlBP(BP):
    """Its frozen control trains only its readout: the embedding stays at initialisation."""
    def gradients(self, x, y):
        loss = super().gradients(x, y)
        if not self.settings.trainable_blocks:
            for p in self.model.embed_parameters():
                p.grad = None
        return loss
'''


def quiet(argv) -> int:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return cli_main([str(a) for a in argv])


def cli(argv, capsys) -> tuple[int, str, str]:
    code = cli_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(code, err, *needles) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("creditaudit: error:"), (code, err)
    for needle in needles:
        assert re.search(needle, lines[0], re.I), (needle, lines[0])
    return lines[0]


FACTORY = '''
import torch
from creditaudit.model import ResidualMLP

def make():
    torch.manual_seed(0)
    return ResidualMLP(64, d=16, n_blocks=2, n_classes=10)
'''


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    root = tmp_path_factory.mktemp("pkg")
    (root / "yardrules.py").write_text(RULES)
    (root / "yardnets.py").write_text(FACTORY)
    return root


@pytest.fixture(autouse=True)
def _on_path(pkg, monkeypatch):
    monkeypatch.syspath_prepend(str(pkg))


# -- the yardstick's frozen blocks are every method's ------------------------------------------------
@pytest.mark.parametrize("method", sorted(METHODS))
def test_the_initial_weights_depend_on_seed_and_architecture_only(method):
    """bp's frozen control can be every method's yardstick only if a seed gives every method the
    same initial weights: building the method (its feedback, its optimizers) leaves them as the
    seed and the model gave them, and they differ from another seed's."""
    def weights(m, seed):
        config = RunConfig(method=m, dataset="digits", seed=seed, width=16, blocks=2, epochs=1)
        model = build_model(config, (64,), 10)
        build_method(config, model)
        return {k: v.clone() for k, v in model.state_dict().items()}
    mine, bps = weights(method, 3), weights("bp", 3)
    assert mine.keys() == bps.keys() and all(torch.equal(mine[k], bps[k]) for k in mine)
    other = weights(method, 4)
    assert not all(torch.equal(mine[k], other[k]) for k in mine)


# -- weak controls in an audit ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def weak_audit(tmp_path_factory, pkg):
    """An audit of two rules whose controls barely train (ε steps; one step), without bp: the audit
    trains bp's frozen control of each seed itself, as the yardstick."""
    import sys
    sys.path.insert(0, str(pkg))
    out = tmp_path_factory.mktemp("weak")
    try:
        result = audit(audit_config_from_dict({
            "dataset": "digits", "methods": ["yardrules:TimidControlBP", "yardrules:OneStepControlBP"],
            "seeds": [1, 2], "epochs": 2, "controls": ["frozen"], "model": {"width": 16, "blocks": 2},
            "jobs": 1, "device": "cpu", "out": str(out)}), progress=False)
    finally:
        sys.path.remove(str(pkg))
    return out, result


def test_the_audit_trains_the_yardstick_when_bp_is_not_audited(weak_audit):
    out, result = weak_audit
    yard = [r for r in result["runs"] if r["method"] == "bp"]
    assert sorted((r["control"], r["seed"]) for r in yard) == [("frozen", 1), ("frozen", 2)]
    assert all(r["status"] == "finished" for r in yard)
    # one yardstick per recipe × seed: both rules share bp's recipe, so bp's frozen control of each seed
    by_seed = {str(y["seed"]): y["acc"] for y in result["yardstick"]["runs"]}
    assert by_seed == {str(r["seed"]): r["test_acc"] for r in yard}
    assert [m["method"] for m in result["methods"]] == ["yardrules:TimidControlBP", "yardrules:OneStepControlBP"]
    for row in result["methods"]:                     # the gap to the yardstick, per seed and overall
        for seed, s in row["per_seed"].items():
            assert s["yardstick_acc"] == by_seed[seed]
            assert s["yardstick_gap"] == pytest.approx(s["acc"] - s["yardstick_acc"])
        assert row["yardstick_gap"] is not None


@pytest.mark.parametrize("rule", ["TimidControlBP", "OneStepControlBP"])
def test_a_control_that_barely_trained_is_weak_and_cannot_clear(weak_audit, rule):
    """Moved by ε, or one step: against the control alone the run clears by a wide gap (what main
    called "trustworthy"); the control falls short of the yardstick by far more than the
    tolerance, so (d) is decided against the yardstick — never "clears" on the control's word —
    and every report says so."""
    out, result = weak_audit
    row = next(m for m in result["methods"] if m["method"] == f"yardrules:{rule}")
    depth = row["depth"]
    assert min(g["gap"] for g in depth["gaps"]) > 0.2          # the gap main judged by
    # the control's shortfall to the yardstick is its own statistic: weak, and reported
    assert depth["weak_control"] and depth["shortfall"]["mean"] > 0.02 and row["weak_control"]
    # a clear needs the gap to the yardstick to clear too: never on the weak control's word
    assert depth["outcome"] != "clears" or depth["yardstick"]["lower"] >= 0.02 - 1e-6
    assert "falls short of the yardstick" in " ".join(row["notes"] + row["missing"] + row["reasons"])
    # each run alone, as its own diagnosis (and `check RUN`) says: judged against the yardstick too
    for r in result["runs"]:
        if r["method"] == f"yardrules:{rule}" and r["control"] == "none":
            assert r["report"]["verdicts"]["project"]["outcome"] != "trustworthy"
            assert "weak control" in r["report"]["verdict"]
            assert check_path(Path(r["run_dir"]))[1] != 0


def test_a_lone_run_cannot_clear_against_a_control_no_better_than_the_untrained_model(tmp_path, capsys):
    """`diagnose RUN --frozen-control CTRL`, where no yardstick is at hand: a control that moved by
    ε does not beat the untrained model (its seed's initial weights, measured) by the margin, so
    it is weak; the run's wide gap to it is no clear — the project verdict is incomplete and says
    why, the paper's column keeps the paper's rule."""
    for name, extra in (("run", []), ("ctrl", ["--frozen"])):
        assert quiet(["train", *TINY, "--epochs", 2, "--method", "yardrules:TimidControlBP",
                      "--seed", 0, *extra, "--out", tmp_path / name]) == 0
    code, out, err = cli(["diagnose", tmp_path / "run", "--frozen-control", tmp_path / "ctrl",
                          "--eval-batches", 2, "--threads", 1, "--device", "cpu", "--json"], capsys)
    report = __import__("json").loads(out)
    assert report["depth"]["gap"] > 0.05 and report["flags"]["d"] is False      # main: "clears"
    assert report["verdicts"]["project"]["outcome"] != "trustworthy"
    assert "weak control" in report["verdict"] and "untrained model" in report["verdict"]


def test_a_monitored_control_at_a_tiny_learning_rate_is_weak(tmp_path, digits):
    """The Monitor: a control trained at lr 1e-9 moves (its biases leave zero) but stays the
    untrained model; its epoch-0 record gives that accuracy, and the run cannot clear against it."""
    runs = {}
    torch.manual_seed(0)
    model = ResidualMLP(64, d=16, n_blocks=2, n_classes=10)
    test = [digits.eval_batch(0, 360)]
    mon = creditaudit.Monitor(model, digits.eval_batch(0), tmp_path / "run", epochs=2, seed=0,
                              test_batches=test)
    control = None
    for who, lr in (("run", 1e-2), ("ctrl", 1e-9)):
        net = model if who == "run" else control
        m = mon if who == "run" else creditaudit.Monitor(control, digits.eval_batch(0), tmp_path / who,
                                                         epochs=2, seed=0, test_batches=test,
                                                         control_of=mon)
        opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr)
        for _ in range(2):
            for x, y in digits.train_batches(128, torch.Generator().manual_seed(0)):
                loss = F.cross_entropy(net(x), y)
                opt.zero_grad(), loss.backward(), opt.step()
                m.step(loss.detach(), len(y))
            m.epoch_end()
        m.finish()
        runs[who] = m
        if who == "run":
            control = mon.frozen_control()
    report = mon.report
    assert report.depth is not None and report.depth.gap > 0.05 and report.flags["d"] is False
    assert report.project.outcome != "trustworthy" and "weak control" in report.verdict


def test_an_embedding_left_at_init_is_refused_though_the_readout_trained(tmp_path, capsys):
    """The embedding and the readout are each their own group: a control whose readout trained on
    an embedding still at initialisation is no yardstick (main let it through as one group)."""
    for name, extra in (("run", []), ("ctrl", ["--frozen"])):
        assert quiet(["train", *TINY, "--epochs", 1, "--method", "yardrules:ReadoutOnlyControlBP",
                      "--seed", 0, *extra, "--out", tmp_path / name]) == 0
    argv = ["diagnose", tmp_path / "run", "--frozen-control", tmp_path / "ctrl", "--eval-batches", 2,
            "--threads", 1, "--device", "cpu"]
    one_error_line(*cli(argv, capsys)[::2], "never trained its embedding")


def test_a_monitored_control_with_its_embedding_at_init_is_refused(tmp_path, digits):
    """The same class through the Monitor (a model reached through its stream): the control's loop
    trains only the readout."""
    torch.manual_seed(0)
    model = ResidualMLP(64, d=16, n_blocks=2, n_classes=10)
    test = [digits.eval_batch(0, 360)]
    mon = creditaudit.Monitor(model, digits.eval_batch(0), tmp_path / "run", epochs=1, seed=0,
                              test_batches=test)
    opt = torch.optim.AdamW(model.parameters(), 1e-2)
    for x, y in digits.train_batches(128, torch.Generator().manual_seed(0)):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(), loss.backward(), opt.step()
        mon.step(loss.detach(), len(y))
    mon.epoch_end()
    mon.finish()
    control = mon.frozen_control()
    ctrl = creditaudit.Monitor(control, digits.eval_batch(0), tmp_path / "ctrl", epochs=1, seed=0,
                               test_batches=test, control_of=mon)
    opt = torch.optim.AdamW(control.head_parameters(), 1e-2)     # the embedding never trains
    for x, y in digits.train_batches(128, torch.Generator().manual_seed(0)):
        loss = F.cross_entropy(control(x), y)
        opt.zero_grad(), loss.backward(), opt.step()
        ctrl.step(loss.detach(), len(y))
    ctrl.epoch_end()
    with pytest.raises(CreditAuditError, match="never trained its embedding"):
        ctrl.finish()


# -- one rule, one method ----------------------------------------------------------------------------------
def test_one_rule_spelled_three_ways_is_one_method():
    spellings = ["bp", "creditaudit.methods.bp:BP", "creditaudit.methods:BP"]
    assert {resolve_method_name(s) for s in spellings} == {"bp"}
    keys = {RunConfig(method=s, dataset="digits", seed=1).run_key for s in spellings}
    assert len(keys) == 1                                     # one run, trained once
    with pytest.raises(CreditAuditError, match="more than once .*one rule"):
        audit_config_from_dict({"dataset": "digits", "methods": spellings})
    # a user's class re-exported under two module paths is one name too
    assert resolve_method_name("yardrules:TimidControlBP") == "yardrules:TimidControlBP"


def test_one_rule_spelled_three_ways_on_the_command_line(tmp_path, capsys):
    code, _, err = cli(["audit", "--dataset", "digits", "--methods", "bp", "creditaudit.methods.bp:BP",
                        "creditaudit.methods:BP", "--seeds", 1, "--epochs", 1, "--out", tmp_path / "a",
                        "--quiet"], capsys)
    one_error_line(code, err, "more than once", "one rule")


# -- folders mean one thing ------------------------------------------------------------------------------
def test_an_audit_never_writes_into_a_run_folder(tmp_path, capsys):
    assert quiet(["train", *TINY, "--epochs", 1, "--method", "bp", "--seed", 0,
                  "--out", tmp_path / "run"]) == 0
    code, _, err = cli(["audit", "--dataset", "digits", "--methods", "bp", "--seeds", 0, "--epochs", 1,
                        "--out", tmp_path / "run", "--quiet", "--device", "cpu"], capsys)
    one_error_line(code, err, "is a run folder", "new folder")
    assert not (tmp_path / "run" / "audit.json").exists()


def test_audit_own_runs_never_writes_into_a_run_folder_and_check_judges_the_run(tmp_path, digits):
    torch.manual_seed(0)
    runs = []
    for seed, name in ((0, "a"), (1, "b")):
        torch.manual_seed(seed)
        model = ResidualMLP(64, d=16, n_blocks=2, n_classes=10)
        mon = creditaudit.Monitor(model, digits.eval_batch(0), tmp_path / name, epochs=1, seed=seed,
                                  test_batches=[digits.eval_batch(0, 360)])
        opt = torch.optim.AdamW(model.parameters(), 1e-2)
        for x, y in digits.train_batches(128, torch.Generator().manual_seed(seed)):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(), loss.backward(), opt.step()
            mon.step(loss.detach(), len(y))
        mon.epoch_end()
        mon.finish()
        runs.append(tmp_path / name)
    for out in (runs[1], runs[0]):           # another run's folder, or one of the runs' own
        with pytest.raises(CreditAuditError, match="is a run folder"):
            creditaudit.audit_own_runs(runs, out=out, n_test=360)
        assert not (out / "audit.json").exists()
    # an audit.json left in a run folder (by an older creditaudit) does not answer for the run
    own = creditaudit.audit_own_runs(runs, out=tmp_path / "own", n_test=360)
    store.write_sealed_json(runs[1] / "audit.json", store.json_safe(own))
    lines, code, payload = check_path(runs[1])
    assert payload["verdicts"] == [{"name": payload["verdicts"][0]["name"],
                                    "verdict": store.read_sealed_json(runs[1] / "diagnosis.json", "d")["verdict"]}]
    assert len(lines) == 1 and "my-method" not in lines[0]


# -- (d) with no seed spread does not decide ---------------------------------------------------------------
def test_one_seed_with_nothing_to_pool_is_incomplete_and_the_terminal_says_why(tmp_path, capsys):
    (tmp_path / "a.toml").write_text('controls = ["frozen"]\n[model]\nwidth = 16\nblocks = 2\n')
    code, out, _ = cli(["audit", "--config", tmp_path / "a.toml", "--dataset", "digits", "--methods", "bp",
                        "--seeds", 0, "--epochs", 1, "--out", tmp_path / "a", "--device", "cpu",
                        "--jobs", 1, "--quiet"], capsys)
    row = read_audit(tmp_path / "a")["methods"][0]
    assert row["depth"]["outcome"] == "undetermined" and row["verdicts"]["project"]["outcome"] == "incomplete"
    assert code == 3 and "no seed spread" in out and "add a seed" in out
    # the reason is printed once: no note beside the 'missing' line saying it again
    reasons = out.split("\nbp: ")[1].split("\n\n")[0]
    assert reasons.count("add a seed") == 1 and "rests on one seed" not in reasons, reasons


def test_audit_own_runs_checks_controls_against_a_yardstick_the_user_gives(tmp_path, digits):
    """`audit_own_runs(..., yardsticks=[...])`: the user's frozen control trained by backprop, one per
    seed. A control trained at lr 1e-9 is weak against it, (d) is decided against the yardstick, and
    a yardstick that is not a frozen control of a run given is refused in one line."""
    torch.manual_seed(0)
    model = ResidualMLP(64, d=16, n_blocks=2, n_classes=10)
    test = [digits.eval_batch(0, 360)]
    mon = creditaudit.Monitor(model, digits.eval_batch(0), tmp_path / "run", epochs=1, seed=0,
                              test_batches=test)

    def epoch(net, m, lr):
        opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr)
        for x, y in digits.train_batches(128, torch.Generator().manual_seed(0)):
            loss = F.cross_entropy(net(x), y)
            opt.zero_grad(), loss.backward(), opt.step()
            m.step(loss.detach(), len(y))
        m.epoch_end()
        m.finish()
    epoch(model, mon, 1e-2)
    for name, lr in (("ctrl", 1e-9), ("yard", 1e-2)):
        control = mon.frozen_control()
        epoch(control, creditaudit.Monitor(control, digits.eval_batch(0), tmp_path / name, epochs=1, seed=0,
                                           test_batches=test, control_of=mon), lr)
    own = creditaudit.audit_own_runs([tmp_path / "run"], [tmp_path / "ctrl"], out=tmp_path / "own",
                                     n_test=360, yardsticks=[tmp_path / "yard"], quiet=True)
    row = own["methods"][0]
    # the control's shortfall to the yardstick is reported (one seed: no interval to call it weak by)
    assert row["control_shortfall"] > 0.02 and row["per_seed"]["0"]["yardstick_acc"] is not None
    assert row["verdicts"]["project"]["outcome"] != "trustworthy"
    assert "yardstick" in (tmp_path / "own" / "audit.md").read_text()
    with pytest.raises(CreditAuditError, match="yardstick .* is not a frozen control"):
        creditaudit.audit_own_runs([tmp_path / "run"], [tmp_path / "ctrl"], out=tmp_path / "own2",
                                   n_test=360, yardsticks=[tmp_path / "run"], quiet=True)


def test_a_model_trained_elsewhere_is_checked_against_the_yardstick_it_brings(tmp_path, digits, capsys):
    """`diagnose --model ... --frozen-control C --yardstick Y --init-weights I`: a control trained at
    a 1e-4 × learning rate is weak against a backprop-trained yardstick; without --yardstick, against
    the untrained model (measured from --init-weights). Either way the run's wide gap does not clear."""
    from safetensors.torch import save_file
    from creditaudit.methods import MethodSettings, method_class
    torch.manual_seed(0)
    init = ResidualMLP(64, d=16, n_blocks=2, n_classes=10)
    states = {"init": init.state_dict()}
    for name, blocks, lr in (("trained", (0, 1), 1e-2), ("weak", (), 1e-6), ("yard", (), 1e-2)):
        model = ResidualMLP(64, d=16, n_blocks=2, n_classes=10)
        model.load_state_dict(init.state_dict())
        bp = method_class("bp")(model, MethodSettings(epochs=2, trainable_blocks=blocks, lr=lr))
        for _ in range(2):
            for x, y in digits.train_batches(128, torch.Generator().manual_seed(0)):
                bp.train_step(x, y)
        states[name] = model.state_dict()
    for name, state in states.items():
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / f"{name}.safetensors"))
    base = ["diagnose", "--model", "yardnets:make", "--weights", tmp_path / "trained.safetensors",
            "--dataset", "digits", "--eval-batches", 2, "--threads", 1, "--device", "cpu", "--json",
            "--frozen-control", tmp_path / "weak.safetensors", "--init-weights", tmp_path / "init.safetensors"]
    for extra, needle in (([], "untrained model"), (["--yardstick", tmp_path / "yard.safetensors"], "yardstick")):
        code, out, err = cli([*base, *extra], capsys)
        report = __import__("json").loads(out)
        assert report["depth"]["gap"] > 0.05 and report["flags"]["d"] is False, report["depth"]
        assert report["verdicts"]["project"]["outcome"] != "trustworthy"
        assert "weak control" in report["verdict"] and needle in report["verdict"]
    # a yardstick that is not frozen at init is refused in one line
    code, _, err = cli([*base, "--yardstick", tmp_path / "trained.safetensors"], capsys)
    one_error_line(code, err)


# -- the audit's own paths where no yardstick stands (a penalty sweep; a yardstick that failed) -------
def test_without_a_yardstick_run_all_checks_each_control_against_the_untrained_model(tmp_path):
    """run_all with frozen controls but no yardstick (as a penalty sweep trains them): a control
    moved by ε does not beat its seed's untrained model by the margin, so it is weak and no run's
    diagnosis clears (d) against it; with no yardstick decided on, the run's verdict says what is
    missing rather than deciding."""
    from creditaudit.experiments.common import Execution, run_all
    main = RunConfig(method="yardrules:TimidControlBP", dataset="digits", width=16, blocks=2, epochs=2, seed=0)
    frozen = main.replace(trainable_blocks=0)
    outcomes = run_all([main, frozen], tmp_path, execution=Execution(jobs=1, device="cpu"),
                       frozen_of=lambda c: frozen.bind_data(c.data_digest) if c.control == "none" else None,
                       progress=False)
    report = next(o.report for o in outcomes if o.config.control == "none")
    assert report["depth"]["gap"] > 0.05                                 # the gap main judged by
    assert report["verdicts"]["project"]["outcome"] != "trustworthy"
    assert "untrained model" in report["verdict"]


def test_a_reused_diagnosis_is_bound_to_whether_its_control_is_weak():
    """The reuse key of a sealed diagnosis covers what the gate said of its control: the same run
    and settings with a control that has since become weak (its yardstick trained after a failure)
    is diagnosed again, never read back with a stale (d)."""
    from creditaudit.experiments.common import DiagnoseJob, diagnosis_settings
    base = DiagnoseJob(RunConfig(method="dfa", dataset="digits", width=16, blocks=2, epochs=2).to_dict(),
                       "run", "data", "cpu", 1, {}, frozen_acc=0.5)
    weak = replace(base, weak="2.5 points short of the yardstick")
    decided = replace(weak, weak_decided=True)
    assert len({diagnosis_settings(j) for j in (base, weak, decided)}) == 3


def test_each_recipe_gets_its_own_yardstick_and_its_rules_are_judged_against_it(tmp_path):
    """bp (AdamW) and pepita (SGD, its paper's recipe): the audit trains bp's frozen control under
    pepita's recipe too, and pepita's second statistic — the gap to the yardstick — reads that run,
    not bp's AdamW control (issue 33: a yardstick under the same recipe)."""
    result = audit(audit_config_from_dict({
        "dataset": "digits", "methods": ["bp", "pepita"], "seeds": [1, 2], "epochs": 1,
        "controls": ["frozen"], "model": {"width": 16, "blocks": 2}, "jobs": 1, "device": "cpu",
        "out": str(tmp_path / "a")}), progress=False)
    runs = {(r["method"], r["control"], r["seed"], r["config"]["recipe"]["optimizer"]): r for r in result["runs"]}
    for seed in (1, 2):
        sgd = runs[("bp", "frozen", seed, "sgd")]
        adamw = runs[("bp", "frozen", seed, "adamw")]
        assert sgd["status"] == adamw["status"] == "finished"
        pepita_cfg = runs[("pepita", "none", seed, "sgd")]["config"]
        for k in ("recipe", "lr", "weight_decay", "batch_size", "epochs", "width", "blocks", "seed"):
            assert sgd["config"][k] == pepita_cfg[k], k
        row = {r["method"]: r for r in result["methods"]}
        assert row["pepita"]["per_seed"][str(seed)]["yardstick_acc"] == sgd["test_acc"]
        assert row["bp"]["per_seed"][str(seed)]["yardstick_acc"] == adamw["test_acc"]
    depth = {r["method"]: r["depth"] for r in result["methods"]}
    assert depth["pepita"]["yardstick"]["values"] == pytest.approx(
        [runs[("pepita", "none", s, "sgd")]["test_acc"] - runs[("bp", "frozen", s, "sgd")]["test_acc"] for s in (1, 2)])
    # bp's own frozen control is its recipe's yardstick: no shortfall, nothing to say about it
    assert depth["bp"]["shortfall"]["values"] == [0.0, 0.0] and depth["bp"]["control_note"] is None
    assert {tuple(y["for"]) for y in result["yardstick"]["runs"]} == {("bp",), ("pepita",)}
    # K methods tested, Holm: stated once per audit
    assert result["depth_error_rate"]["methods_tested"] == 2
