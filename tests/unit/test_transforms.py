"""Declarative mappings: every rule, the derived inverse, grouping, and the TP-aware fused order."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from cluster.checkpoint.transform_exec import run_group
from plans.errors import CheckpointError
from plans.checkpoint.transforms import (Add, Alias, Application, Cast, ConcatRows, Drop, Mapping, Meta, Rename, SplitRows,
                                        Transpose, Unalias, match)


def _apply(mapping: Mapping, tensors: dict) -> dict:
    plan = mapping.plan({n: Meta(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in tensors.items()})
    out = {}
    for group in plan.groups:
        out.update(run_group(group, {s: tensors[s] for s in group.sources}))
    assert {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in out.items()} == \
        {n: (m.shape, m.dtype) for n, m in plan.outputs.items()}  # the symbolic plan predicts the tensors
    return out


def _distinct(*shape, start=0.0):
    # Asymmetric values: a swapped, transposed or mis-grouped element cannot go unnoticed.
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) * 0.5 + start


def test_patterns_match_layer_and_expert_indices_only():
    assert match("layers.{layer}.experts.{expert}.w1", "layers.12.experts.3.w1") == {"layer": "12", "expert": "3"}
    assert match("layers.{layer}.w", "layers.x.w") is None
    assert match("norm.weight", "layers.0.attention_norm.weight") is None  # anchored, not a suffix match
    assert match("*", "anything.at.all") == {}


def test_rename_with_layer_and_expert_patterns_and_its_inverse():
    mapping = Mapping((Rename("layers.{layer}.experts.{expert}.w1", "model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight"),
                       Rename("norm.weight", "model.norm.weight")))
    tensors = {f"layers.{l}.experts.{e}.w1": _distinct(2, 3, start=l * 10 + e) for l in range(2) for e in range(3)}
    tensors["norm.weight"] = _distinct(3)
    out = _apply(mapping, tensors)
    assert torch.equal(out["model.layers.1.mlp.experts.2.gate_proj.weight"], tensors["layers.1.experts.2.w1"])
    back = _apply(mapping.inverse(), out)
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)


def _fused_qkv(n_heads, n_kv, head_dim, dim):
    q, k, v = _distinct(n_heads * head_dim, dim), _distinct(n_kv * head_dim, dim, start=1000), _distinct(n_kv * head_dim, dim, start=2000)
    r = n_heads // n_kv
    rows = []
    for g in range(n_kv):  # per kv head: its r query heads, then k_g, then v_g (plans/training/model_spec.py)
        rows += [q[(g * r + i) * head_dim:(g * r + i + 1) * head_dim] for i in range(r)]
        rows += [k[g * head_dim:(g + 1) * head_dim], v[g * head_dim:(g + 1) * head_dim]]
    return torch.cat(rows), q, k, v


def test_gqa_qkv_split_recovers_heads_and_every_tp_row_block_holds_whole_groups():
    n_heads, n_kv, hd, dim = 8, 4, 3, 5
    fused, q, k, v = _fused_qkv(n_heads, n_kv, hd, dim)
    split = SplitRows("qkv", ("q", "k", "v"), (n_heads // n_kv * hd, hd, hd), n_kv)
    out = _apply(Mapping((split,)), {"qkv": fused})
    assert torch.equal(out["q"], q) and torch.equal(out["k"], k) and torch.equal(out["v"], v)
    assert torch.equal(_apply(Mapping((split,)).inverse(), out)["qkv"], fused)
    # TP-aware: tp rank t's contiguous row block of the fused tensor splits, with groups/tp groups,
    # into exactly the heads that rank computes (q heads of its kv groups, its k and v heads).
    tp = 2
    block = fused.shape[0] // tp
    for t in range(tp):
        local = SplitRows("qkv", ("q", "k", "v"), split.rows, n_kv // tp)
        part = _apply(Mapping((local,)), {"qkv": fused[t * block:(t + 1) * block]})
        assert torch.equal(part["q"], q.chunk(tp)[t]) and torch.equal(part["k"], k.chunk(tp)[t])
        assert torch.equal(part["v"], v.chunk(tp)[t])


def test_gate_up_interleaved_per_hidden_unit():
    gate, up = _distinct(6, 4), _distinct(6, 4, start=100)
    fused = torch.stack([gate, up], dim=1).reshape(12, 4)  # row 2j gate_j, row 2j+1 up_j
    mapping = Mapping((SplitRows("gate_up", ("gate", "up"), (1, 1), 6),))
    out = _apply(mapping, {"gate_up": fused})
    assert torch.equal(out["gate"], gate) and torch.equal(out["up"], up)
    assert torch.equal(_apply(mapping.inverse(), out)["gate_up"], fused)


def test_transpose_cast_drop_add_and_their_inverses():
    w = _distinct(3, 4)
    mapping = Mapping((Transpose("w"), Cast("w", to="float64", source="float32"),
                       Drop("buffer", shape=(2,), dtype="float32", fill=1.5), Add("extra", (2,), "float32", 0.0)))
    out = _apply(mapping, {"w": w, "buffer": torch.full((2,), 1.5)})
    # w is [[0, .5, 1, 1.5], [2, 2.5, 3, 3.5], [4, 4.5, 5, 5.5]]; its transpose, written out by hand
    # (a reshape to (4, 3) has the right shape and round-trips too, but reads [[0, .5, 1], ...]).
    transposed = torch.tensor([[0.0, 2.0, 4.0], [0.5, 2.5, 4.5], [1.0, 3.0, 5.0], [1.5, 3.5, 5.5]], dtype=torch.float64)
    assert torch.equal(out["w"], transposed) and "buffer" not in out
    assert out["w"].is_contiguous()  # written to safetensors as is
    assert torch.equal(out["extra"], torch.zeros(2))
    back = _apply(mapping.inverse(), out)
    assert torch.equal(back["w"], w) and torch.equal(back["buffer"], torch.full((2,), 1.5)) and "extra" not in back


def test_a_drop_that_does_not_say_what_to_restore_has_no_inverse():
    with pytest.raises(CheckpointError, match="cannot be inverted"):
        Mapping((Drop("layers.{layer}.rotary.inv_freq"),)).inverse()


def test_tied_weights_alias_is_not_written_and_is_checked_on_the_way_back():
    mapping = Mapping((Rename("tok", "embed"), Alias("lm_head", of="embed")))
    embedding = _distinct(4, 2)
    out = _apply(mapping, {"tok": embedding})
    assert set(out) == {"embed"}  # the other side ties lm_head itself
    back = _apply(mapping.inverse(), {"embed": embedding, "lm_head": embedding.clone()})
    assert set(back) == {"tok"}
    with pytest.raises(CheckpointError, match="tied copy"):
        _apply(mapping.inverse(), {"embed": embedding, "lm_head": embedding + 1})


def test_strict_mappings_name_the_tensors_no_rule_covers():
    with pytest.raises(CheckpointError, match="no rule of the mapping covers 1 tensor.*stray"):
        Mapping((Rename("a", "b"),)).plan({"a": Meta((1,), "float32"), "stray": Meta((1,), "float32")})


def test_a_split_whose_rows_do_not_fit_the_config_is_refused():
    with pytest.raises(CheckpointError, match="cannot be split"):
        Mapping((SplitRows("qkv", ("q", "k"), (2, 1), 3),)).plan({"qkv": Meta((10, 4), "float32")})


def test_groups_load_only_what_belongs_together():
    mapping = Mapping((SplitRows("layers.{layer}.qkv", ("layers.{layer}.q", "layers.{layer}.kv"), (1, 1), 2),
                       Rename("layers.{layer}.norm", "model.layers.{layer}.norm")))
    plan = mapping.plan({f"layers.{l}.{n}": Meta((4, 2) if n == "qkv" else (2,), "float32")
                         for l in range(3) for n in ("qkv", "norm")})
    assert sorted(len(g.sources) for g in plan.groups) == [1] * 6
    assert {g.sources: g.outputs for g in plan.groups}[("layers.1.qkv",)] == ("layers.1.q", "layers.1.kv")


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.lists(st.integers(1, 3), min_size=1, max_size=4), st.integers(1, 3), st.booleans())
def test_any_split_then_its_derived_inverse_is_the_identity(groups, rows, columns, transpose):
    fused = _distinct(groups * sum(rows), columns)
    targets = tuple(f"part{i}" for i in range(len(rows)))
    rules = (SplitRows("fused", targets, tuple(rows), groups),) + ((Transpose("part0"),) if transpose else ())
    mapping = Mapping(rules)
    assert torch.equal(_apply(mapping.inverse(), _apply(mapping, {"fused": fused}))["fused"], fused)
    assert isinstance(mapping.inverse().rules[-1], ConcatRows)


@pytest.mark.parametrize("rule, inverse", [
    (Add("extra", (2, 3), "bfloat16", 0.5), Drop("extra", (2, 3), "bfloat16", 0.5)),
    (Drop("buffer", (4,), "float32", 1.5), Add("buffer", (4,), "float32", 1.5)),
    (Cast("w", to="float64", source="float32"), Cast("w", to="float32", source="float64")),
    (ConcatRows(("q", "k"), "qk", (2, 1), 3), SplitRows("qk", ("q", "k"), (2, 1), 3)),
    (Alias("lm_head", of="embed"), Unalias("lm_head", of="embed")),
    (Unalias("lm_head", of="embed"), Alias("lm_head", of="embed")),
])
def test_each_rule_inverts_to_the_rule_written_out_by_hand(rule, inverse):
    assert rule.inverse() == inverse and inverse.inverse() == rule


DROP_FIX = "Fix: give shape, dtype and fill (and a concrete name), or use the mapping in one direction only"


@pytest.mark.parametrize("drop", [
    Drop("buffer", None, "float32", 1.5), Drop("buffer", (2,), None, 1.5), Drop("buffer", (2,), "float32", None),
    Drop("layers.{layer}.buffer", (2,), "float32", 1.5), Drop("layers.*.buffer", (2,), "float32", 1.5),
])
def test_a_drop_missing_any_of_what_to_restore_is_refused_whole(drop):
    with pytest.raises(CheckpointError) as refused:
        drop.inverse()
    assert str(refused.value) == (f"Drop({drop.pattern!r}) cannot be inverted: it does not say what to restore. {DROP_FIX}")


def test_rules_name_what_they_consume_and_produce():
    state = {"w64": Meta((2,), "float64"), "w32": Meta((3,), "float32"), "x": Meta((1,), "float32")}
    cast = Cast("w*", to="bfloat16", source="float32")
    # w64 matches but holds another dtype, and comes first: skipped, the search goes on.
    assert cast.apply(state) == [(Application(cast, ("w32",), ("w32",)), {"w32": Meta((3,), "bfloat16")})]
    drop = Drop("w*")
    assert drop.apply(state) == [(Application(drop, ("w64",), ()), {}), (Application(drop, ("w32",), ()), {})]
    add = Add("bias", (2,), "float32", 0.0)
    assert add.apply(state) == [(Application(add, (), ("bias",)), {"bias": Meta((2,), "float32")})]
    assert add.apply({**state, "bias": Meta((2,), "float32")}) == []  # already there: nothing to add
