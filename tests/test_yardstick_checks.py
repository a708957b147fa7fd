"""The yardstick is evidence too, and every accuracy carries the test set it was measured on
(issue 34, items 1, 2 and 7): a yardstick as weak as a control, a yardstick that is the control, a
yardstick built from a patched backprop, and a control measured on rigged test batches — each
through the entrance a user would take, on tiny models (digits, width 16, 2 blocks, 1–2 epochs).
Honest controls and yardsticks keep their verdicts."""
from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F

import creditaudit
from creditaudit.cli import main as cli_main
from creditaudit.errors import CreditAuditError
from creditaudit.model import ResidualMLP

FACTORY = '''
import torch
from creditaudit.model import ResidualMLP

def make():
    torch.manual_seed(0)
    return ResidualMLP(64, d=16, n_blocks=2, n_classes=10)
'''


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


# -- --model: the yardstick a user brings ---------------------------------------------------------
@pytest.fixture(scope="module")
def weights(tmp_path_factory, digits):
    """init, trained (every block), frozen (blocks at init, the rest by bp), yard (the same, another
    lr: an honest yardstick of its own) and eps (init + 1e-6 on the embedding and readout: an
    untrained model that passes for a trained control) as safetensors files."""
    from safetensors.torch import save_file
    from creditaudit.methods import MethodSettings, method_class
    root = tmp_path_factory.mktemp("yardweights")
    (root / "yardnets2.py").write_text(FACTORY)
    torch.manual_seed(0)
    init = ResidualMLP(64, d=16, n_blocks=2, n_classes=10)
    states = {"init": init.state_dict()}
    for name, blocks, lr in (("trained", (0, 1), 1e-2), ("frozen", (), 1e-2), ("yard", (), 5e-3)):
        model = ResidualMLP(64, d=16, n_blocks=2, n_classes=10)
        model.load_state_dict(init.state_dict())
        bp = method_class("bp")(model, MethodSettings(epochs=2, trainable_blocks=blocks, lr=lr))
        for _ in range(2):
            for x, y in digits.train_batches(128, torch.Generator().manual_seed(0)):
                bp.train_step(x, y)
        states[name] = model.state_dict()
    blocks = {n for n, _ in init.named_parameters() if n.startswith("blocks.")}
    states["eps"] = {n: (t + 1e-6 if t.is_floating_point() and n not in blocks else t.clone())
                     for n, t in init.state_dict().items()}
    for name, state in states.items():
        save_file({k: v.contiguous() for k, v in state.items()}, str(root / f"{name}.safetensors"))
    return root


@pytest.fixture
def model_args(weights, monkeypatch):
    monkeypatch.syspath_prepend(str(weights))
    return ["--model", "yardnets2:make", "--weights", weights / "trained.safetensors", "--dataset", "digits",
            "--eval-batches", 2, "--threads", 1, "--device", "cpu",
            "--init-weights", weights / "init.safetensors"]


def test_a_nudged_control_as_its_own_yardstick_is_refused_and_never_trustworthy(weights, model_args, capsys):
    """The issue's input: control and yardstick both the untrained weights + 1e-6. The yardstick
    does not beat the untrained model, so it is refused in one line calling it the yardstick; and
    the same nudged control alone never switches its own check off (not trustworthy, check ≠ 0)."""
    eps = weights / "eps.safetensors"
    code, _, err = cli(["check", *model_args, "--frozen-control", eps, "--yardstick", eps], capsys)
    line = one_error_line(code, err, "untrained model|control's own weights")
    assert line.startswith("creditaudit: error: the yardstick ")
    code, out, _ = cli(["check", *model_args, "--frozen-control", eps, "--json"], capsys)
    assert code != 0 and not json.loads(out)["verdicts"][0]["verdict"].startswith("trustworthy")


def test_a_yardstick_as_weak_as_the_untrained_model_is_refused(weights, model_args, capsys):
    """An honest control with a yardstick that learnt nothing (init + 1e-6): refused, by name."""
    code, _, err = cli(["check", *model_args, "--frozen-control", weights / "frozen.safetensors",
                        "--yardstick", weights / "eps.safetensors"], capsys)
    one_error_line(code, err, "the yardstick .*eps", "does not beat the untrained model")


def test_the_control_itself_as_its_yardstick_is_refused(weights, model_args, capsys):
    """The control's own file as its yardstick (a trained one: it beats the untrained model)."""
    frozen = weights / "frozen.safetensors"
    code, _, err = cli(["check", *model_args, "--frozen-control", frozen, "--yardstick", frozen], capsys)
    one_error_line(code, err, "the yardstick", "control's own weights")


def test_a_yardstick_refusal_calls_it_the_yardstick(weights, model_args, capsys):
    """The initial weights as the yardstick (nothing trained): refused as "the yardstick", not as
    "the frozen control"."""
    code, _, err = cli(["diagnose", *model_args, "--frozen-control", weights / "frozen.safetensors",
                        "--yardstick", weights / "init.safetensors"], capsys)
    line = one_error_line(code, err, "never trained its embedding")
    assert line.startswith("creditaudit: error: the yardstick ") and "the frozen control" not in line


def test_an_honest_yardstick_is_still_accepted(weights, model_args, capsys):
    """A bp-trained control with a bp-trained yardstick of its own: admitted, not weak, and (d)
    measured against the control as before."""
    code, out, err = cli(["diagnose", *model_args, "--json", "--frozen-control", weights / "frozen.safetensors",
                          "--yardstick", weights / "yard.safetensors"], capsys)
    assert code == 0, err
    report = json.loads(out)
    assert report["depth"]["frozen_acc"] is not None and "weak control" not in report["verdict"]
