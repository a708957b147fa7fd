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


CONFIG = {"method": "bp", "seed": 1}    # the run config sealed into every checkpoint


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
    store.save_checkpoint(tmp_path, 1, {"model": model.state_dict(), "opt": opt.state_dict()}, {},
                          CONFIG)
    meta, state = store.load_checkpoint(tmp_path)
    assert meta["epoch"] == 1 and meta["version"] == 2 and meta["config"] == CONFIG
    opt2 = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters())
    opt2.load_state_dict(state["opt"])
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_a_newer_checkpoint_replaces_the_older_tensors_file(tmp_path):
    store.save_checkpoint(tmp_path, 1, {"w": torch.ones(2)}, {}, CONFIG)
    store.save_checkpoint(tmp_path, 2, {"w": torch.zeros(2)}, {}, CONFIG)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["checkpoint-e0002.safetensors"]
    assert torch.equal(store.load_checkpoint(tmp_path)[1]["w"], torch.zeros(2))


def test_truncated_foreign_and_missing_checkpoints_give_clear_errors(tmp_path):
    store.save_checkpoint(tmp_path, 3, {"w": torch.randn(100)}, {}, CONFIG)
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


def test_hand_edited_checkpoint_and_config_are_refused(tmp_path):
    """checkpoint.json is sealed (format version 2): any edit, even a valid-JSON one, is refused;
    so is a config.json that no longer matches the config sealed in the checkpoint."""
    store.save_checkpoint(tmp_path, 2, {"w": torch.ones(3)}, {"label": "x"}, CONFIG)
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    path = tmp_path / "checkpoint.json"
    original = path.read_text()
    meta = json.loads(original)
    assert meta[store.SEAL] == store.digest({k: v for k, v in meta.items() if k != store.SEAL})
    store.load_checkpoint(tmp_path)                                   # intact: loads

    for edit in ({"epoch": 7}, {"label": "y"}, {"config": {**CONFIG, "seed": 2}}):
        path.write_text(json.dumps({**meta, **edit}))
        with pytest.raises(CreditAuditError, match="modified after it was written"):
            store.load_checkpoint(tmp_path)
    unsealed = {k: v for k, v in meta.items() if k != store.SEAL}
    path.write_text(json.dumps(unsealed))
    with pytest.raises(CreditAuditError, match="no integrity seal"):
        store.load_checkpoint(tmp_path)
    path.write_text(json.dumps({**meta, "version": 1}))
    with pytest.raises(CreditAuditError, match="version 1"):
        store.load_checkpoint(tmp_path)

    path.write_text(original)
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "seed": 2}))
    with pytest.raises(CreditAuditError, match="does not match the config sealed"):
        store.load_checkpoint(tmp_path)


def test_sealed_json_round_trips_and_refuses_edits(tmp_path):
    path = tmp_path / "status.json"
    record = {"status": "finished", "test_acc": 0.5, "nested": {"a": [1, None, "inf"]}}
    store.write_sealed_json(path, record)
    assert store.read_sealed_json(path, "run's status") == record
    edited = json.loads(path.read_text())
    edited["test_acc"] = 0.9
    path.write_text(json.dumps(edited, indent=4))
    with pytest.raises(CreditAuditError, match="status.json was modified"):
        store.read_sealed_json(path, "run's status")
    # re-formatting alone (indent, key order) is not an edit: the seal is over canonical JSON
    store.write_sealed_json(path, record)
    reformatted = json.loads(path.read_text())
    path.write_text(json.dumps(dict(reversed(list(reformatted.items())))))
    assert store.read_sealed_json(path, "run's status") == record
