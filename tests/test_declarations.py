"""A user rule's declarations are validated before use (issue 34, item 6): a recipe that is not a
Recipe, feedback pairs of another shape than their forward weights (or in the wrong order), a
method option given twice — each refused in one line naming the declaration and the fix, exit 2 —
while an honest user rule with the same declarations done right trains as before."""
from __future__ import annotations

import sys
import textwrap

import pytest

from creditaudit.cli import main as cli_main

TINY = ["--dataset", "digits", "--width", "16", "--blocks", "2", "--epochs", "1", "--quiet",
        "--threads", "1", "--device", "cpu"]

RULES = '''
import torch
from creditaudit.methods import Recipe
from creditaudit.methods.fa import FA
from creditaudit.methods.bp import BP

class HonestFA(FA):
    """fa with an SGD recipe of its own: every declaration as documented."""
    name = "honest-fa"
    recipe = Recipe(optimizer="sgd", lr=0.01, momentum=0.9, weight_decay=0.0, schedule="constant")

class StrRecipe(BP):
    name = "str-recipe"
    recipe = "adamw"

class DictRecipe(BP):
    name = "dict-recipe"
    recipe = {"optimizer": "adamw", "lr": 1e-3}

class PropertyRecipe(BP):
    name = "property-recipe"
    @property
    def recipe(self):
        return Recipe()

class WrongSizeB(FA):
    name = "wrong-size-b"
    def feedback_pairs(self):
        return [(k, w, b[..., :-1]) for k, w, b in super().feedback_pairs()]

class TransposedB(FA):
    """On vit-mini, W is (3·width, width) in attention, (4·width, width) in the MLP: its transpose
    has another shape (resmlp's are square: no shape can tell a transposed B there)."""
    name = "transposed-b"
    def feedback_pairs(self):
        return [(k, w, b.T) for k, w, b in super().feedback_pairs()]

class SwappedPair(FA):
    name = "swapped-pair"
    def feedback_pairs(self):
        return [(k, b, w) for k, w, b in super().feedback_pairs()]

class RaisingPairs(FA):
    name = "raising-pairs"
    def feedback_pairs(self):
        raise AttributeError("no feedback here")
'''


@pytest.fixture(scope="module")
def rules(tmp_path_factory):
    root = tmp_path_factory.mktemp("rules")
    (root / "declared_rules.py").write_text(textwrap.dedent(RULES))
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    sys.modules.pop("declared_rules", None)


def one_line(argv, capsys) -> str:
    code = cli_main([str(a) for a in argv])
    lines = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert code == 2 and len(lines) == 1, (code, lines)
    return lines[0]


@pytest.mark.parametrize("rule, kind", [("StrRecipe", "str"), ("DictRecipe", "dict"),
                                        ("PropertyRecipe", "property")])
def test_a_recipe_that_is_not_a_recipe_is_refused_in_one_line(rule, kind, rules, tmp_path, capsys):
    line = one_line(["train", "--method", f"declared_rules:{rule}", *TINY, "--out", tmp_path / "r"], capsys)
    assert f"recipe must be a class attribute recipe = Recipe(...)" in line and f"got a {kind}" in line
    assert not (tmp_path / "r" / "checkpoint.json").exists()


@pytest.mark.parametrize("rule, needle", [
    ("WrongSizeB", r"B is shape \(\d+, \d+\), W has shape"),
    ("TransposedB", r"B is shape \((\d+), (\d+)\), W has shape \(\2, \1\) \(B is W transposed\?\)"),
    ("SwappedPair", r"its W \(shape .*\) is not a parameter of the model — the pair order is \(name, W, B\)"),
    ("RaisingPairs", r"feedback_pairs\(\) raised AttributeError: no feedback here")])
def test_feedback_pairs_not_shaped_like_their_weights_are_refused_in_one_line(rule, needle, rules, tmp_path, capsys):
    """These ended in "inconsistent tensor size" from metrics.py (wrong size), or recorded a
    meaningless cos(W, B) (transposed, swapped); refused before the first step, naming
    feedback_pairs."""
    import re
    arch = ["--arch", "vit-mini", "--arch-option", "heads=2"] if rule == "TransposedB" else []
    line = one_line(["train", "--method", f"declared_rules:{rule}", *TINY, *arch, "--out", tmp_path / "r"], capsys)
    assert line.startswith("creditaudit: error:") and "feedback_pairs()" in line, line
    assert re.search(needle, line), line
    assert "Traceback" not in line


@pytest.mark.parametrize("flag, key", [("--option", "beta"), ("--arch-option", "heads")])
def test_an_option_given_twice_is_refused(flag, key, tmp_path, capsys):
    """`--option beta=0.2 --option beta=0.3` silently took the last value; the same value twice is
    refused too (a second spelling is as likely a typo as intent)."""
    base = (["--method", "ep"] if flag == "--option" else ["--arch", "vit-mini"])
    for values in (("0.2", "0.3"), ("2", "2")):
        line = one_line(["train", *TINY, *base, flag, f"{key}={values[0]}", flag, f"{key}={values[1]}",
                         "--out", tmp_path / "r"], capsys)
        assert f"{flag} {key} is given twice" in line and "give each key once" in line


def test_an_honest_user_rule_is_accepted_unchanged(rules, tmp_path, capsys):
    """Its recipe, feedback pairs and (default) exact positions pass the checks: it trains, its
    weight alignment is recorded per pair, and `diagnose` measures it."""
    import json
    assert cli_main(["train", "--method", "declared_rules:HonestFA", *TINY, "--out", str(tmp_path / "r")]) == 0
    lines = [json.loads(l) for l in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    aligned = [l["weight_alignment"] for l in lines if "weight_alignment" in l]
    assert aligned and all(-1 <= v <= 1 for row in aligned for v in row.values())
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    assert config["recipe"]["optimizer"] == "sgd"
    capsys.readouterr()
    assert cli_main(["diagnose", str(tmp_path / "r"), "--threads", "1", "--device", "cpu",
                     "--eval-batches", "2"]) == 0
