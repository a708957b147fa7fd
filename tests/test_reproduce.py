"""`creditaudit reproduce`: each paper setting resolves to the documented network, loss and recipe,
runs end to end on a tiny MNIST-format folder, and its comparison says only what its numbers show;
docs/REPRODUCTIONS.md is the rendering of the committed audits."""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from creditaudit.cli import main
from creditaudit.commands.reproduce import reproduce_raw
from creditaudit.config import audit_config_from_dict
from creditaudit.papers import PAPERS, Paper, Reported, paper
from creditaudit.report.reproduction import comparison, reproductions_page
from creditaudit.errors import CreditAuditError
from test_data import write_idx_set

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = {"fa", "dfa", "kolen-pollack", "drtp", "pepita", "local-loss", "ep", "pc"}


def _args(**kw):
    base = dict(epochs=None, out=None, seeds=None, data_dir=None, device="cpu", jobs=None,
                eval_batches=None)
    return argparse.Namespace(**{**base, **kw})


def test_every_rule_the_issue_names_has_a_paper_setting():
    assert REQUIRED <= set(PAPERS)


@pytest.mark.parametrize("rule", sorted(PAPERS))
def test_a_paper_setting_resolves_to_its_documented_network_loss_and_recipe(rule):
    p = PAPERS[rule]
    config = audit_config_from_dict(reproduce_raw(_args(seeds=[42]), p))
    runs = config.run_configs()
    main = next(c for c in runs if c.method == rule and c.control == "none")
    assert (main.arch, main.width, main.blocks, main.activation) == ("mlp", p.width, p.blocks, p.activation)
    assert main.arch_options == {"loss": p.loss, "dropout": p.dropout, "init": p.init, "bias": int(p.bias),
                                 **({} if p.norm == "none" else {"norm": p.norm})}
    assert main.recipe == p.recipe.settings() and main.epochs == p.epochs and main.dataset == p.dataset
    for key, value in p.options.items():
        assert main.options[key] == value
    bp = next(c for c in runs if c.method == "bp" and c.control == "none")
    assert bp.recipe == (p.bp_recipe or p.recipe).settings()
    frozen = next(c for c in runs if c.method == rule and c.control == "frozen")
    assert frozen.trainable_blocks == 0          # every hidden layer frozen, the readout trained
    # every number and recipe says where it comes from
    assert p.citation and p.code and p.recipe.citation
    for reported in (p.reported, p.bp):
        assert reported is None or (reported.source and 0 < reported.error < 100)
    assert p.reported is not None or any("no paper number" in d or "could not be read" in d
                                         for d in p.deviations)


def test_an_unknown_rule_is_refused_in_one_line():
    with pytest.raises(CreditAuditError, match="no paper setting for 'sb'.*reproduce --list"):
        paper("sb")


def _audit(rule: str, per_seed_acc: list[float], bp_acc: list[float], reported: Reported | None,
           bp: Reported | None, epochs: int = 10, paper_epochs: int = 10) -> dict:
    p = Paper(rule=rule, citation="X 2020", code="x/y", dataset="mnist", width=8, blocks=1,
              activation="tanh", recipe=PAPERS["fa"].recipe, epochs=paper_epochs, reported=reported, bp=bp)
    row = lambda m, accs: {"method": m, "per_seed": {str(i): {"status": "finished", "acc": a}
                                                    for i, a in enumerate(accs)}}
    return {"reproduction": p.record(epochs, len(per_seed_acc)),
            "methods": [row(rule, per_seed_acc), row("bp", bp_acc)]}


def test_the_comparison_says_within_miss_unverified_and_reduced_only_when_the_numbers_say_so():
    exact = Reported(2.0, "Table 1", sd=0.1)
    rows = comparison(_audit("fa", [0.979, 0.981], [0.97], exact, Reported(3.0, "Table 1")))
    assert rows[0]["ours"] == pytest.approx(2.0) and rows[0]["ours_sd"] == pytest.approx(0.1414, abs=1e-3)
    assert rows[0]["outcome"] == "within its spread"                 # |0.0| ≤ 0.1
    assert rows[1]["difference"] == pytest.approx(0.0) and rows[1]["outcome"] == "within its spread"
    miss = comparison(_audit("fa", [0.975], [0.97], exact, None))
    assert miss[0]["difference"] == pytest.approx(0.5) and miss[0]["outcome"] == "miss"   # 0.5 > sd 0.1
    assert miss[1]["outcome"] == "no paper number" and miss[1]["paper"] is None
    no_sd = comparison(_audit("fa", [0.9755], [0.97], Reported(2.0, "Table 1"), None))
    assert no_sd[0]["outcome"] == "within its spread"                # 0.45 ≤ the default 0.5
    short = comparison(_audit("fa", [0.9], [0.97], exact, None, epochs=2, paper_epochs=10))
    assert short[0]["outcome"] == "reduced budget"
    unverified = comparison(_audit("fa", [0.98], [0.97], Reported(2.0, "recalled", verified=False), None))
    assert unverified[0]["outcome"] == "paper's number unverified"
    failed = _audit("fa", [0.98], [0.97], exact, None)
    failed["methods"][0]["per_seed"]["0"]["status"] = "failed"
    assert comparison(failed)[0]["outcome"] == "no finished run"


def test_reproduce_runs_end_to_end_on_a_tiny_mnist_folder(tmp_path, capsys):
    write_idx_set(tmp_path / "data" / "mnist", (True, True, False, False))
    out = tmp_path / "out"
    status = main(["reproduce", "fa", "--epochs", "1", "--seeds", "42", "--data-dir", str(tmp_path / "data"),
                   "--out", str(out), "--quiet", "--jobs", "1"])
    printed = capsys.readouterr().out
    assert status in (0, 3)
    audit = json.loads((out / "audit.json").read_text())
    assert audit["reproduction"]["rule"] == "fa" and audit["reproduction"]["reduced_budget"]
    assert {r["method"] for r in audit["methods"]} == {"fa", "bp"}
    rows = comparison(audit)
    assert [r["method"] for r in rows] == ["fa", "bp"]
    assert all(r["outcome"] == "reduced budget" and r["ours"] is not None for r in rows)
    md = (out / "audit.md").read_text()
    assert "## Reproduction" in md and "reduced budget: 1 of the paper's 400 epochs" in md
    assert "reproduction of fa" in printed and "2.20" in printed
    assert "Reproduction" in (out / "report.html").read_text()
    # the frozen control trained the readout alone: every hidden layer is at its initialisation
    frozen = next(r for r in audit["runs"] if r["method"] == "fa" and r["control"] == "frozen")
    assert frozen["status"] == "finished"


def test_a_setting_whose_data_are_missing_is_refused_in_one_line(tmp_path, capsys):
    """No MNIST in --data-dir and no way to download it (tests reach no network): one line naming
    the missing file and where to put it, exit 2, no traceback and no audit written."""
    status = main(["reproduce", "fa", "--epochs", "1", "--seeds", "42", "--data-dir", str(tmp_path / "d"),
                   "--out", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and "Traceback" not in err
    problem = [line for line in err.splitlines() if not line.startswith("downloading ")]   # progress
    assert len(problem) == 1 and "train-images-idx3-ubyte" in problem[0] and "mnist" in problem[0]
    assert not (tmp_path / "out" / "audit.json").exists()


def test_list_names_every_paper_setting_with_its_number(capsys):
    assert main(["reproduce", "--list"]) == 0
    printed = capsys.readouterr().out
    for rule, p in PAPERS.items():
        assert rule in printed
        if p.reported is not None:
            assert f"{p.reported.error:.2f} %" in printed


def test_list_with_a_rule_shows_that_rule_s_setting_alone(capsys):
    """`reproduce dfa --list` listed every setting, the rule given silently ignored."""
    assert main(["reproduce", "dfa", "--list"]) == 0
    out = capsys.readouterr().out
    entries = [l for l in out.splitlines()[1:] if l and not l.startswith(" ")]   # wrapped lines indent
    assert len(entries) == 1 and entries[0].startswith("dfa ") and "Nøkland" in " ".join(out.split())
    assert main(["reproduce", "nope", "--list"]) == 2


def test_reproduce_without_a_rule_or_with_a_bad_one_says_so_in_one_line(capsys):
    assert main(["reproduce"]) == 2
    assert "name a rule to reproduce" in capsys.readouterr().err
    assert main(["reproduce", "sb"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no paper setting for 'sb'" in err and "\n" not in err


def test_reproductions_page_is_the_rendering_of_the_committed_audits():
    from creditaudit.experiments import read_audit
    page = (ROOT / "docs" / "REPRODUCTIONS.md").read_text()
    begin, end = "<!-- reproductions:begin -->\n", "<!-- reproductions:end -->"
    assert begin in page and end in page
    folder = ROOT / "docs" / "reproductions"
    audits = {rule: read_audit(folder / f"{rule}.json") for rule in PAPERS if (folder / f"{rule}.json").exists()}
    assert audits, "docs/reproductions/ holds no committed reproduction"
    assert page.split(begin, 1)[1].split(end, 1)[0] == reproductions_page(audits)
    # every rule with a committed audit has its row, and the page names no rule it did not run
    table = page.split(begin, 1)[1].split(end, 1)[0]
    rows = {m.group(1) for m in re.finditer(r"^\| ([a-z-]+) \|", table, re.M)} - {"rule"}   # less the head
    assert rows == set(audits)


def _parallel():
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "docs" / "reproductions" / "parallel.py"
    spec = importlib.util.spec_from_file_location("parallel_reproductions", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_parallel_runner_paces_a_rule_by_its_slowest_main_run_without_its_start_up(tmp_path):
    """docs/reproductions/parallel.py (the lent GPU's reproductions): a rule's pace is its slowest
    main run's seconds per epoch after the first epoch (which holds the start-up: a long first
    epoch must not cut the budget), and a rule that cannot finish restarts at what fits."""
    parallel = _parallel()

    def run(name, walls):
        folder = tmp_path / "runs" / name
        folder.mkdir(parents=True)
        (folder / "metrics.jsonl").write_text("".join(
            json.dumps({"epoch": e, "wall_time": w}) + "\n" for e, w in enumerate(walls)))
    run("fa-none-s42-aaa", [0.0, 30.0, 32.0, 34.0, 36.0])          # 30 s of start-up, then 2 s/epoch
    run("fa-none-s123-bbb", [0.0, 3.0, 6.0, 9.0])                  # 3 s/epoch: the slowest
    run("fa-frozen-s42-ccc", [0.0, 1.0, 50.0, 99.0])               # a control: not the pace
    assert parallel.progress(tmp_path, "fa") == (3, 3.0)
    assert parallel.progress(tmp_path, "dfa") is None               # no run yet
    run("dfa-none-s42-ddd", [0.0, 5.0])                             # too early to tell
    assert parallel.progress(tmp_path, "dfa") is None

    audit = parallel.AUDIT_SECONDS
    assert parallel.plan(10, 2.0, 100, 2, left=1000) == (2 * 2.0 * 90 + audit, None)
    finish, fit = parallel.plan(10, 2.0, 400, 2, left=300)
    assert finish > 300 and fit == int((300 - audit - 5) / 4.0 * 0.85)
    assert parallel.plan(10, 50.0, 400, 2, left=60)[1] == 0        # not one epoch fits
