import json

import pytest
import torch
from hypothesis import given, settings, strategies as st

from creditaudit import store
from creditaudit.errors import CreditAuditError

leaves = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                   st.floats(allow_nan=False), st.text(max_size=5),
                   st.integers(1, 4).map(lambda n: torch.arange(n, dtype=torch.float32)))
nested = st.recursive(leaves, lambda kids: st.one_of(
    st.lists(kids, max_size=3), st.tuples(kids, kids),
    st.dictionaries(st.text(max_size=4), kids, max_size=3),
    st.dictionaries(st.integers(0, 9), kids, max_size=3)), max_leaves=12)


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b and type(a) is type(b)


@settings(max_examples=60, deadline=None)
@given(nested)
def test_flatten_roundtrip_preserves_structure_types_and_tensors(obj):
    tensors = {}
    skeleton = store.flatten_state(obj, tensors)
    json.dumps(skeleton)  # the skeleton is plain JSON
    assert _equal(store.unflatten_state(json.loads(json.dumps(skeleton)), tensors), obj)


def test_optimizer_state_roundtrips_through_a_checkpoint(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    store.save_checkpoint(tmp_path, 1, {"model": model.state_dict(), "opt": opt.state_dict()}, {})
    meta, state = store.load_checkpoint(tmp_path)
    assert meta["epoch"] == 1
    opt2 = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters())
    opt2.load_state_dict(state["opt"])
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_a_newer_checkpoint_replaces_the_older_tensors_file(tmp_path):
    store.save_checkpoint(tmp_path, 1, {"w": torch.ones(2)}, {})
    store.save_checkpoint(tmp_path, 2, {"w": torch.zeros(2)}, {})
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["checkpoint-e0002.safetensors"]
    assert torch.equal(store.load_checkpoint(tmp_path)[1]["w"], torch.zeros(2))


def test_truncated_foreign_and_missing_checkpoints_give_clear_errors(tmp_path):
    store.save_checkpoint(tmp_path, 3, {"w": torch.randn(100)}, {})
    tensors = tmp_path / "checkpoint-e0003.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:-50])
    with pytest.raises(CreditAuditError, match="truncated or corrupt"):
        store.load_checkpoint(tmp_path)

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "checkpoint.json").write_text(json.dumps({"state_dict": {}}))
    with pytest.raises(CreditAuditError, match="not a creditaudit checkpoint"):
        store.load_checkpoint(foreign)
    (foreign / "checkpoint.json").write_bytes(b"\x80\x04\x95 pickle bytes")
    with pytest.raises(CreditAuditError, match="not valid JSON"):
        store.load_checkpoint(foreign)
    with pytest.raises(CreditAuditError, match="no checkpoint"):
        store.load_checkpoint(tmp_path / "nowhere")
    with pytest.raises(CreditAuditError, match="run folder"):
        store.load_checkpoint(tensors)


def test_json_safe_gives_strict_json():
    safe = store.json_safe({"a": [1.0, float("nan"), float("inf"), -float("inf")], "b": (2, "x"),
                            3: torch.tensor([0.5])})
    assert safe == {"a": [1.0, None, "inf", "-inf"], "b": [2, "x"], "3": [0.5]}
    json.dumps(safe, allow_nan=False)
