import torch

from creditaudit import ResidualMLP, ResidualStream, as_stream
from creditaudit.errors import CreditAuditError
import pytest


def test_forward_shapes_and_hidden_states():
    model = ResidualMLP(d_in=12, d=16, n_blocks=3, n_classes=5)
    x = torch.randn(7, 3, 4)  # flattened to (7, 12)
    logits, hidden = model(x, return_hidden=True)
    assert logits.shape == (7, 5)
    assert len(hidden) == 4 and all(h.shape == (7, 16) for h in hidden)
    # h_{l+1} = h_l + f_l(h_l), logits = out_head(out_ln(h_L))
    for l, block in enumerate(model.blocks):
        torch.testing.assert_close(hidden[l + 1], hidden[l] + block(hidden[l]))
    torch.testing.assert_close(logits, model.out_head(model.out_ln(hidden[-1])))
    torch.testing.assert_close(model(x), logits)


def test_w2_init_is_small_so_fresh_stack_is_near_identity():
    torch.manual_seed(0)
    model = ResidualMLP(d_in=40, d=256, n_blocks=4, w2_std=0.01)
    for block in model.blocks:
        assert abs(block.w2.weight.std().item() - 0.01) < 1e-3
        assert torch.count_nonzero(block.w2.bias) == 0
    _, hidden = model(torch.randn(64, 40), return_hidden=True)
    # each block adds ~10 % of ‖h‖; the whole stack stays close in direction to h_0
    for l in range(4):
        rel = (hidden[l + 1] - hidden[l]).norm(dim=-1) / hidden[l].norm(dim=-1)
        assert rel.median() < 0.15
    cos = (hidden[-1] * hidden[0]).sum(-1) / (hidden[-1].norm(dim=-1) * hidden[0].norm(dim=-1))
    assert cos.median() > 0.95


def test_stream_matches_model_and_forward_from():
    model = ResidualMLP(d_in=10, d=8, n_blocks=3)
    stream = as_stream(model)
    x = torch.randn(5, 10)
    logits, hidden = model(x, return_hidden=True)
    for a, b in zip(stream.hidden(x), hidden):
        torch.testing.assert_close(a, b)
    for l in range(4):
        torch.testing.assert_close(stream.forward_from(l, hidden[l]), logits)
    torch.testing.assert_close(stream.branch(1, hidden[1]), model.blocks[1](hidden[1]))
    user = ResidualStream(embed=model.embed, steps=stream.steps, readout=model.readout)
    torch.testing.assert_close(user.branch(1, hidden[1]), model.blocks[1](hidden[1]), atol=1e-6, rtol=1e-5)


def test_unknown_activation_and_unauditable_object_are_clear_errors():
    with pytest.raises(CreditAuditError, match="activation"):
        ResidualMLP(d_in=4, activation="swishy")
    with pytest.raises(CreditAuditError, match="ResidualStream"):
        as_stream(object())


def test_build_model_resmlp_is_the_residual_mlp_with_the_residual_model_interface():
    from creditaudit.model import ARCHITECTURES, ResidualModel, build_model
    assert "resmlp" in ARCHITECTURES
    torch.manual_seed(3)
    built = build_model("resmlp", (1, 8, 8), 10, width=16, blocks=3)
    torch.manual_seed(3)
    direct = ResidualMLP(64, d=16, n_blocks=3, n_classes=10)
    assert isinstance(built, ResidualModel) and isinstance(built, ResidualMLP)
    assert built.stream_shape == (16,) and built.n_blocks == 3 and built.n_classes == 10
    for (name, p), q in zip(built.named_parameters(), direct.parameters()):
        assert torch.equal(p, q), name                       # same init order, same seeded weights
    roles = built.embed_parameters() + [p for b in built.blocks for p in b.parameters()] \
        + built.head_parameters()
    assert sorted(map(id, roles)) == sorted(id(p) for p in built.parameters())   # a partition
    x = torch.randn(5, 1, 8, 8)
    torch.testing.assert_close(built(x), built.readout(as_stream(built).hidden(x)[-1]))
    torch.testing.assert_close(built.embed_input(x), built.embed(x.flatten(1)))
    assert build_model("resmlp", (8,), 4, width=8, blocks=0)(torch.randn(2, 8)).shape == (2, 4)
    with pytest.raises(CreditAuditError, match="unknown architecture"):
        build_model("transformer-xl", (8,), 4, width=8, blocks=1)
    with pytest.raises(CreditAuditError, match="no option"):
        build_model("resmlp", (8,), 4, width=8, blocks=1, options={"heads": 2})
