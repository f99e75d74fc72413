"""The state-dict keys of `rayshard.checkpoint` against the manifest's (name, kind) columns, and
the JSON values it keeps (plans/checkpoint/state_dict_keys.py, decision 106)."""
import pytest
from hypothesis import given, strategies as st

from rayshard.plans.checkpoint.model_check import check_state_dict_matches
from rayshard.plans.checkpoint.state_dict_keys import check_json_value, column_of, key_of
from rayshard.plans.errors import CheckpointError


@pytest.mark.parametrize("key, column", [
    ("model.layers.0.attention.qkv.weight", ("layers.0.attention.qkv.weight", "param")),
    ("optim.state.layers.0.w.exp_avg", ("layers.0.w", "exp_avg")),
    ("optim.state.layers.0.w.exp_avg_sq", ("layers.0.w", "exp_avg_sq")),
    ("optim.state.layers.0.w.step", ("layers.0.w", "step")),
    ("optim.state.x.param", ("optim.state.x.param", "tensor")),  # not an optimizer state: kept whole
    ("optim.state.x.tensor", ("optim.state.x.tensor", "tensor")),
    ("optim.state.step", ("optim.state.step", "tensor")),  # no parameter name before the state
    ("model.", ("model.", "tensor")),
    ("extra.rng", ("extra.rng", "tensor")),
    ("w", ("w", "tensor")),
])
def test_keys_map_to_the_trainers_columns(key, column):
    assert column_of(key) == column
    assert key_of(*column) == key


@given(st.text(alphabet="ab.", min_size=1, max_size=12).map(lambda s: s.strip(".") or "a"),
       st.sampled_from(["", "model.", "optim.state.", "optim."]),
       st.sampled_from(["", ".exp_avg", ".step", ".param", ".tensor"]))
def test_every_key_round_trips(middle, prefix, suffix):
    key = prefix + middle + suffix
    assert key_of(*column_of(key)) == key


def test_two_keys_never_share_a_column():
    keys = ["model.a", "a", "optim.state.a.param", "optim.state.a.exp_avg", "model.optim.state.a.exp_avg",
            "optim.state.model.a.step"]
    assert len({column_of(key) for key in keys}) == len(keys)


def test_json_values_are_kept_and_anything_else_is_refused_in_one_line():
    check_json_value("optim.param_groups", [{"lr": 1e-3, "betas": (0.9, 0.999), "params": ["a"], "fused": None}])
    check_json_value("nan", float("nan"))
    with pytest.raises(CheckpointError) as refused:
        check_json_value("train.rng", {"state": object()})
    assert "\n" not in str(refused.value) and "'train.rng'" in str(refused.value) and "train.rng.state" in str(refused.value)
    with pytest.raises(CheckpointError, match=r"has the key 0 \(int\)"):
        check_json_value("optim.state", {0: {}})


@pytest.mark.parametrize("tensors, values, says", [
    # a dict of numbers where the checkpoint holds tensors beneath the same key
    ({}, ["model"], "'model' holds values in the state dict where the checkpoint holds tensors ('model.bf' ...)"),
    ({}, ["model.bf"], "'model.bf' is a tensor in the checkpoint, not a value"),
    ({}, ["epoch"], "'epoch' is not in the checkpoint"),
    ({"loader": ((2,), "int64")}, [], "'loader' is a value in the checkpoint, not a tensor"),
    ({"model.bf": ((3,), "float32")}, [], "'model.bf' is float32[2, 3] in the checkpoint but float32[3] in the state dict"),
])
def test_a_state_dict_unlike_the_checkpoint_is_named_in_one_line(tensors, values, says):
    stored = {("bf", "param"): ((2, 3), "float32"), ("bf", "exp_avg"): ((2, 3), "float32")}
    with pytest.raises(CheckpointError) as refused:
        check_state_dict_matches(tensors, values, stored, {"loader"}, "load of r")
    assert says in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
