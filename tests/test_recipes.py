"""A recipe per rule (methods/recipe.py): each rule trains under the optimiser, schedule, weight
decay and batch size its paper publishes, `--recipe shared` trains every rule under the paper's
AdamW recipe, a run records the resolved recipe (config.json and its run key), an explicit lr /
weight decay overrides it, a resumed SGD + step-decay run ends bit-identical to an uninterrupted
one, and no SGD or Adam recipe reaches the member axis (its one optimizer is a fused AdamW)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from creditaudit import store
from creditaudit.cli import main as cli_main
from creditaudit.config import RunConfig, audit_config_from_dict
from creditaudit.errors import CreditAuditError
from creditaudit.methods import METHODS, SHARED_RECIPE, MethodSettings, Recipe
from creditaudit.methods.members import MemberStack
from creditaudit.methods.recipe import step_at
from creditaudit.model import build_model
from creditaudit.runs import build_method
from creditaudit.runs import build_model as build_run_model
from creditaudit.train import can_stack, group_stacks, train_run

EPOCHS = 15


@pytest.fixture(scope="module")
def synthetic():
    from creditaudit.data import load_dataset
    return load_dataset("synthetic")

# what each paper names (the method files cite where): optimizer class, lr, momentum, nesterov,
# weight decay, scheduler class, its milestones in a 15-epoch run, gamma, batch size
PUBLISHED = {
    "pepita": (torch.optim.SGD, 0.01, 0.9, False, 0.0, torch.optim.lr_scheduler.MultiStepLR, [9, 14], 0.1, 64),
    "local-loss": (torch.optim.Adam, 5e-4, None, None, 0.0, torch.optim.lr_scheduler.MultiStepLR,
                   [8, 11, 13, 14], 0.25, 128),
    "drtp": (torch.optim.SGD, 1e-4, 0.9, True, 0.0, torch.optim.lr_scheduler.ConstantLR, [], None, 100),
    # the authors' released code (plain SGD, lr 0.3, no decay, constant); on the routed weights W
    # and their B the rule's own λ_KP (option `decay`, default the paper's ImageNet 1e-4)
    "kolen-pollack": (torch.optim.SGD, 0.3, 0.0, False, (0.0, 1e-4), torch.optim.lr_scheduler.ConstantLR,
                      [], None, 128),
    # BioTorch's sign-symmetry benchmark config: lr × 0.1 at 100, 150, 200 of 250 → 6, 9, 12 of 15
    "sign-symmetry": (torch.optim.SGD, 0.1, 0.9, False, 1e-4, torch.optim.lr_scheduler.MultiStepLR,
                      [6, 9, 12], 0.1, 128),
    # Baydin et al.'s MNIST MLP as orobix/fwdgrad configures it: plain SGD lr 2e-4, batch 64 (their
    # per-iteration exponential decay has no Recipe schedule: constant)
    "fg-w": (torch.optim.SGD, 2e-4, 0.0, False, 0.0, torch.optim.lr_scheduler.ConstantLR, [], None, 64),
    # Ren et al.'s released supervised config: SGD m0.9 lr 0.05, wd 1e-4, cosine, batch 256
    "fg-a": (torch.optim.SGD, 0.05, 0.9, False, 1e-4, torch.optim.lr_scheduler.CosineAnnealingLR, [], None, 256),
    "lg-fg-a": (torch.optim.SGD, 0.05, 0.9, False, 1e-4, torch.optim.lr_scheduler.CosineAnnealingLR, [],
                None, 256),
    # Hinton's FF code (ffnew.m:12-21, 130-135) as SGD: the layers at lr 0.1·ε = 1e-3, weight decay 1e-3,
    # the softmax readout at 10× the lr and 3× the decay; ε constant for half the run, then linear to 0
    "forward-forward": (torch.optim.SGD, (1e-3, 1e-2), 0.9, False, (1e-3, 3e-3),
                        torch.optim.lr_scheduler.LambdaLR, [], None, 100),
    # Meulemans et al.'s MNIST configs: Adam at lr / target_stepsize (normalize_lr), constant, batch 128
    # (the feedback Adam is the rule's own, outside the recipe)
    "dtp": (torch.optim.Adam, 6.185037324617764e-05 / 0.21951187497378802, None, None, 0.0,
            torch.optim.lr_scheduler.ConstantLR, [], None, 128),
    "ddtp-linear": (torch.optim.Adam, 2.0354415171962153e-05 / 0.06096940412767466, None, None, 0.0,
                    torch.optim.lr_scheduler.ConstantLR, [], None, 128),
}
SHARED = (torch.optim.AdamW, 1e-3, None, None, 0.01, torch.optim.lr_scheduler.CosineAnnealingLR, [], None, 128)


def _built(config: RunConfig):
    model = build_run_model(config, (40,), 10)
    return build_method(config, model)


def _check(method, expected) -> None:
    opt_cls, lr, momentum, nesterov, wd, sched_cls, milestones, gamma, batch = expected
    wds = wd if isinstance(wd, tuple) else (wd,)
    lrs = lr if isinstance(lr, tuple) else (lr,)
    seen = set()
    assert method.optimizers and len(method.optimizers) == len(method.schedulers)
    for opt, sched in zip(method.optimizers, method.schedulers):
        assert type(opt) is opt_cls
        for group in opt.param_groups:
            assert any(group["lr"] == pytest.approx(r) for r in lrs), group["lr"]
            assert any(group["weight_decay"] == pytest.approx(w) for w in wds), group["weight_decay"]
            seen.add(next(w for w in wds if group["weight_decay"] == pytest.approx(w)))
            if momentum is not None:
                assert group["momentum"] == momentum and group["nesterov"] is nesterov
        assert type(sched) is sched_cls
        if sched_cls is torch.optim.lr_scheduler.MultiStepLR:
            assert sorted(sched.milestones.elements()) == milestones and sched.gamma == gamma
    assert seen == set(wds)
    assert method.settings.batch_size == batch


@pytest.mark.parametrize("name", list(METHODS))
def test_each_rule_builds_the_optimizer_its_paper_names(name):
    """Published: the zoo rules with a recipe get their paper's optimiser and schedule; the paper's
    seven and the rules without one the shared AdamW. Shared: AdamW + cosine for every rule."""
    config = RunConfig(method=name, dataset="mnist1d", width=8, blocks=2, epochs=EPOCHS)
    _check(_built(config), PUBLISHED.get(name, SHARED))
    assert config.batch_size == PUBLISHED.get(name, SHARED)[-1]
    shared = config.replace(recipe="shared", lr=None, weight_decay=None, batch_size=None)
    expected = {"kolen-pollack": SHARED[:4] + ((0.01, 1e-4),) + SHARED[5:],
                # forward-forward's readout keeps its 10× lr and 3× decay under any recipe
                "forward-forward": SHARED[:1] + ((1e-3, 1e-2), None, None, (0.01, 0.03)) + SHARED[5:]}
    _check(_built(shared), expected.get(name, SHARED))
    assert (shared.run_key == config.run_key) is (name not in PUBLISHED)
    if METHODS[name].paper:
        assert METHODS[name].recipe == SHARED_RECIPE
    assert METHODS[name].recipe.citation.strip()          # every rule says where its recipe is from


def test_the_learning_rate_follows_the_published_step_schedule():
    """PEPITA's lr × 0.1 at 60 and 90 of 100 epochs, scaled to 15: epochs 9 and 14."""
    method = _built(RunConfig(method="pepita", dataset="mnist1d", width=8, blocks=2, epochs=EPOCHS))
    lrs = []
    for _ in range(EPOCHS):
        lrs.append(method.optimizers[0].param_groups[0]["lr"])
        method.optimizers[0].step()       # no gradients: a no-op step, so the scheduler may step
        method.schedulers[0].step()
    assert lrs == pytest.approx([0.01] * 9 + [1e-3] * 5 + [1e-4])
    assert Recipe(optimizer="sgd", schedule="step", milestones=step_at((60, 90), of=100)) \
        .milestone_epochs(2) == [1, 2]


def test_the_run_records_its_resolved_recipe(tmp_path, synthetic):
    """config.json holds the resolved recipe; a zoo rule's key differs between the recipes, a
    paper rule's does not (its runs are reused under either switch value); an explicit lr and
    weight decay override the recipe's and the record shows them."""
    config = RunConfig(method="pepita", dataset="synthetic", width=8, blocks=1, epochs=1)
    run = train_run(config, tmp_path / "p", data=synthetic, progress=False)
    saved = json.loads((tmp_path / "p" / "config.json").read_text())
    assert saved["recipe"]["optimizer"] == "sgd" and saved["recipe"]["momentum"] == 0.9
    assert saved["recipe"]["batch_size"] == 64 == saved["batch_size"]
    assert RunConfig.from_dict(saved).run_key == run.config.run_key
    assert config.replace(recipe="shared").run_key != config.run_key
    bp = RunConfig(method="bp", dataset="synthetic", width=8, blocks=1, epochs=1)
    assert bp.replace(recipe="shared").run_key == bp.run_key
    mine = RunConfig(method="pepita", dataset="synthetic", width=8, blocks=1, epochs=1, lr=0.5, weight_decay=0.2)
    assert (mine.recipe["lr"], mine.recipe["weight_decay"], mine.recipe["optimizer"]) == (0.5, 0.2, "sgd")
    assert mine.recipe_record["source"] == "overridden"
    group = _built(mine).optimizers[0].param_groups[0]
    assert (group["lr"], group["weight_decay"]) == (0.5, 0.2)
    # the direct Python API resolves the same way: None is the recipe's, a number overrides it
    model = build_model("resmlp", (40,), 10, width=8, blocks=1)
    lone = METHODS["pepita"](model, MethodSettings(epochs=3, lr=0.5))
    assert type(lone.optimizers[0]) is torch.optim.SGD and lone.optimizers[0].param_groups[0]["lr"] == 0.5


def test_a_resumed_sgd_step_decay_run_equals_an_uninterrupted_one(tmp_path, synthetic, monkeypatch, every_epoch):
    """SGD momentum buffers and MultiStepLR state travel through the (unpickled, safetensors +
    JSON) checkpoint: a run killed after epoch 2 of 4 (its lr decays after epochs 2 and 4)
    and resumed ends with exactly the weights and optimizer state of an uninterrupted one."""
    config = RunConfig(method="pepita", dataset="synthetic", width=8, blocks=2, epochs=4)
    assert config.resolved_recipe.milestone_epochs(4) == [2, 4]
    whole = train_run(config, tmp_path / "whole", data=synthetic, progress=False)
    real_save = store.save_checkpoint

    def save_then_die(run_dir, epoch, state, meta, config):
        real_save(run_dir, epoch, state, meta, config)
        if epoch == 2:
            raise KeyboardInterrupt
    monkeypatch.setattr(store, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train_run(config, tmp_path / "killed", data=synthetic, progress=False)
    monkeypatch.setattr(store, "save_checkpoint", real_save)
    resumed = train_run(config, tmp_path / "killed", data=synthetic, progress=False)
    assert resumed.status["status"] == "finished"
    a, b = whole.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    buffers = lambda run: [s["momentum_buffer"] for s in run.method.optimizers[0].state.values()]
    assert buffers(whole) and all(torch.equal(x, y) for x, y in zip(buffers(whole), buffers(resumed)))
    assert [s.get_last_lr() for s in whole.method.schedulers] == [s.get_last_lr() for s in resumed.method.schedulers]
    assert resumed.method.schedulers[0].get_last_lr()[0] == pytest.approx(1e-4)   # decayed twice


def test_no_sgd_or_adam_recipe_reaches_the_member_axis():
    """The stack steps one fused AdamW: a run under another recipe never stacks, and MemberStack
    refuses such Methods rather than train them as AdamW."""
    base = RunConfig(method="bp", dataset="synthetic", width=8, blocks=1, epochs=1)
    assert can_stack(base) and can_stack(base.replace(recipe="shared"))
    sgd = base.replace(recipe={**base.recipe, "optimizer": "sgd", "momentum": 0.9})
    assert not can_stack(sgd)
    assert group_stacks([sgd, sgd.replace(seed=1), base, base.replace(seed=1)]) == [[0], [1], [2, 3]]
    model = build_run_model(sgd, (40,), 10)
    with pytest.raises(ValueError, match="AdamW"):
        MemberStack([build_method(sgd, model)])


def test_a_lone_sgd_run_of_a_member_axis_method_trains(tmp_path, synthetic):
    """A lone run is a stack of one for bp under AdamW; under SGD it steps through its lone step."""
    config = RunConfig(method="bp", dataset="synthetic", width=8, blocks=1, epochs=2)
    sgd = config.replace(recipe={**config.recipe, "optimizer": "sgd", "momentum": 0.9, "lr": 0.05})
    run = train_run(sgd, tmp_path / "r", data=synthetic, progress=False)
    assert run.status["status"] == "finished" and type(run.method.optimizers[0]) is torch.optim.SGD


def test_rmsprop_is_torch_s_rmsprop_with_lua_torch_s_defaults():
    """Nøkland's DFA code trains with Lua torch's optim.rmsprop (alpha 0.99, epsilon 1e-8)."""
    from creditaudit.methods.recipe import Recipe, build_optimizer
    p = torch.nn.Parameter(torch.ones(3))
    opt = build_optimizer(Recipe(optimizer="rmsprop", lr=1e-4, weight_decay=0.0, schedule="constant"), [p], {})
    assert type(opt) is torch.optim.RMSprop
    group = opt.param_groups[0]
    assert (group["lr"], group["alpha"], group["eps"], group["momentum"]) == (1e-4, 0.99, 1e-8, 0.0)
    assert Recipe(optimizer="rmsprop", lr=1e-4).compact() == "RMSprop lr1e-4 cos"


@pytest.mark.parametrize("bad", [
    {"recipe": "bogus"}, {"recipe": 3}, {"recipe": {"optimizer": "sgd"}},
    {"recipe": {**SHARED_RECIPE.concrete().settings(), "optimizer": "lbfgs"}},
    {"recipe": {**SHARED_RECIPE.concrete().settings(), "schedule": "step"}},          # no milestones
    {"recipe": {**SHARED_RECIPE.concrete().settings(), "milestones": [0.5]}},          # not step
    {"recipe": {**SHARED_RECIPE.concrete().settings(), "momentum": 0.9}},              # AdamW
    {"recipe": {**SHARED_RECIPE.concrete().settings(), "lr": float("nan")}},
    {"recipe": {**SHARED_RECIPE.concrete().settings(), "extra": 1}},
    {"lr": -1.0}, {"weight_decay": "x"}, {"batch_size": 0},
])
def test_a_bad_recipe_is_one_user_error(bad):
    with pytest.raises(CreditAuditError):
        RunConfig(method="bp", **bad)


def test_the_switch_on_the_command_line_and_in_the_toml(tmp_path, capsys):
    assert audit_config_from_dict({"preset": "zoo", "recipe": "shared"}).run_configs()[0].recipe \
        == SHARED_RECIPE.concrete().settings()
    with pytest.raises(CreditAuditError, match="recipe"):
        audit_config_from_dict({"preset": "zoo", "recipe": "paper"})
    assert cli_main(["train", "--recipe", "nope"]) == 2
    assert "--recipe" in capsys.readouterr().err


def test_the_report_shows_each_rule_s_recipe_and_the_comparison(tmp_path):
    """audit.json carries the resolved recipe per rule; audit.md, rules.md, report.html and the
    terminal table (≤ 120 columns) show it; `recipe_comparison` puts the two audits side by side
    and names the rules whose verdict changes. A tiny real audit of two rules, one epoch, width 16,
    under both recipes, through docs/rules/regenerate.py's `regenerate`."""
    import importlib.util
    from creditaudit.experiments import read_audit
    from creditaudit.report import compact_table, recipe_comparison
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("regenerate", root / "docs" / "rules" / "regenerate.py")
    regenerate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(regenerate)
    site = tmp_path / "site"
    (site / "docs" / "rules").mkdir(parents=True)
    (site / "docs" / "RULES.md").write_text("x\n<!-- rules:begin -->\nold\n<!-- rules:end -->\ny\n"
                                            "<!-- recipes:begin -->\nold\n<!-- recipes:end -->\nz\n")
    (site / "tiny.toml").write_text('preset = "zoo"\ndataset = "digits"\nseeds = [1]\nepochs = 1\n'
                                    'eval_batches = 1\njobs = 1\n[model]\nwidth = 16\nblocks = 2\n')
    status = regenerate.regenerate(["--config", "tiny.toml", "--methods", "bp", "pepita"], root=site)
    assert status in (0, 3)
    published, shared = read_audit(site / "audits" / "zoo"), read_audit(site / "audits" / "zoo-shared")
    rows = {r["method"]: r for r in published["methods"]}
    assert rows["pepita"]["recipe"]["optimizer"] == "sgd" and rows["pepita"]["recipe"]["source"] == "published"
    assert rows["bp"]["recipe"]["source"] == "published = shared"
    assert {r["method"]: r["recipe"]["optimizer"] for r in shared["methods"]} == {"bp": "adamw", "pepita": "adamw"}
    # bp's runs are one run under both recipes: the shared audit trained only pepita's anew
    # (the published audit also trains bp's frozen control under pepita's SGD recipe: its yardstick)
    assert shared["runs_trained_now"] == 3 and published["runs_trained_now"] == 7
    page = (site / "docs" / "RULES.md").read_text()
    comparison = recipe_comparison(published, shared)
    assert comparison in page and "SGD m0.9 lr1e-2 step" in comparison and "AdamW lr1e-3 cos" in comparison
    assert (site / "docs" / "rules" / "audit_shared.json").exists()
    for name in ("audit.md", "rules.md", "report.html"):
        text = (site / "audits" / "zoo" / name).read_text()
        assert "SGD m0.9 lr1e-2 step" in text or "momentum 0.9" in text, name
        assert "Dellaferrera" in text, name
    terminal = compact_table(published)
    assert "SGD m0.9 lr1e-2 step" in terminal and max(map(len, terminal.splitlines())) <= 120
    with pytest.raises(CreditAuditError):
        recipe_comparison(shared, published)
