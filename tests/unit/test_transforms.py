"""Declarative mappings: every rule, the derived inverse, grouping, and the TP-aware fused order."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from rayshard.cluster.checkpoint.transform_exec import run_group
from rayshard.plans.errors import CheckpointError
from rayshard.plans.transforms.mapping import (Add, Alias, Application, Cast, ConcatRows, Drop, Mapping, Meta, Rename, SplitRows, Stack,
                                        Transpose, Unalias, Unstack, match)


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
    (Unstack("l.{layer}.w", "h.{layer}.e.{expert+2}.w", 4), Stack("h.{layer}.e.{expert+2}.w", "l.{layer}.w", 4)),
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


# ---- experts: placeholder offsets and stacked <-> per-expert tensors ----------------------------


def test_an_offset_placeholder_renumbers_and_its_inverse_numbers_back():
    mapping = Mapping((Rename("e.{expert}.w", "hf.{expert+8}.w"),))
    tensors = {f"e.{e}.w": _distinct(2, start=10 * e) for e in range(3)}
    out = _apply(mapping, tensors)
    assert sorted(out) == ["hf.10.w", "hf.8.w", "hf.9.w"]
    assert torch.equal(out["hf.8.w"], torch.tensor([0.0, 0.5])) and torch.equal(out["hf.10.w"], torch.tensor([20.0, 20.5]))
    back = _apply(mapping.inverse(), out)
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)
    # hf.3 would be expert -5: it matches no rule, and a strict mapping names it.
    with pytest.raises(CheckpointError, match=r"covers 1 tensor\(s\): hf\.3\.w\."):
        mapping.inverse().plan({"hf.3.w": Meta((2,), "float32"), **{n: Meta((2,), "float32") for n in out}})
    assert match("hf.{expert+1}.w", "hf.0.w") is None and match("hf.{expert+1}.w", "hf.1.w") == {"expert": "0"}
    assert match("hf.{expert-1}.w", "hf.0.w") == {"expert": "1"}


def test_unstack_names_each_part_with_its_offset_index_and_stack_puts_it_back():
    stacked = _distinct(3, 2, 2)  # part e is [[4e, 4e + .5], [4e + 1, 4e + 1.5]] (times 0.5 steps)
    mapping = Mapping((Unstack("l.{layer}.stacked", "hf.{layer}.part.{expert+1}", 3),))
    out = _apply(mapping, {"l.0.stacked": stacked})
    assert sorted(out) == ["hf.0.part.1", "hf.0.part.2", "hf.0.part.3"]
    assert torch.equal(out["hf.0.part.1"], torch.tensor([[0.0, 0.5], [1.0, 1.5]]))
    assert torch.equal(out["hf.0.part.3"], torch.tensor([[4.0, 4.5], [5.0, 5.5]]))
    assert all(part.is_contiguous() for part in out.values())  # written to safetensors as is
    assert mapping.inverse().rules == (Stack("hf.{layer}.part.{expert+1}", "l.{layer}.stacked", 3),)
    assert torch.equal(_apply(mapping.inverse(), out)["l.0.stacked"], stacked)


# Two experts of two hidden units over dim 2, written out by hand. Ours: per expert, rows
# interleave (gate_j, up_j); HF's per-expert Hub tensors hold gate and up apart; transformers'
# in-memory fused gate_up_proj holds gate in the first half of the rows, up in the second.
OUR_GATE_UP = torch.tensor([[[0.0, 0.5], [1.0, 1.5], [2.0, 2.5], [3.0, 3.5]],    # expert 0: gate_0 up_0 gate_1 up_1
                            [[4.0, 4.5], [5.0, 5.5], [6.0, 6.5], [7.0, 7.5]]])   # expert 1
HUB_GATE = {0: torch.tensor([[0.0, 0.5], [2.0, 2.5]]), 1: torch.tensor([[4.0, 4.5], [6.0, 6.5]])}
HUB_UP = {0: torch.tensor([[1.0, 1.5], [3.0, 3.5]]), 1: torch.tensor([[5.0, 5.5], [7.0, 7.5]])}
FUSED_GATE_UP = torch.tensor([[[0.0, 0.5], [2.0, 2.5], [1.0, 1.5], [3.0, 3.5]],
                              [[4.0, 4.5], [6.0, 6.5], [5.0, 5.5], [7.0, 7.5]]])
OUR_DOWN = torch.tensor([[[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]], [[6.0, 7.0], [8.0, 9.0], [10.0, 11.0]]])  # [E, D=3, F=2]


def _hub_mapping(offset: str = "") -> Mapping:
    expert = "{expert" + offset + "}"
    return Mapping((Unstack("l.{layer}.experts.gate_up", f"h.{{layer}}.experts.{expert}.gate_up", 2),
                    SplitRows(f"h.{{layer}}.experts.{expert}.gate_up",
                              (f"h.{{layer}}.experts.{expert}.gate_proj", f"h.{{layer}}.experts.{expert}.up_proj"), (1, 1), 2),
                    Unstack("l.{layer}.experts.down", f"h.{{layer}}.experts.{expert}.down_proj", 2)))


def test_stacked_interleaved_experts_to_per_expert_gate_and_up_and_back():
    ours = {"l.0.experts.gate_up": OUR_GATE_UP, "l.0.experts.down": OUR_DOWN}
    out = _apply(_hub_mapping(), ours)
    assert sorted(out) == sorted(f"h.0.experts.{e}.{p}" for e in (0, 1) for p in ("gate_proj", "up_proj", "down_proj"))
    for e in (0, 1):
        assert torch.equal(out[f"h.0.experts.{e}.gate_proj"], HUB_GATE[e]), e
        assert torch.equal(out[f"h.0.experts.{e}.up_proj"], HUB_UP[e]), e
        assert torch.equal(out[f"h.0.experts.{e}.down_proj"], OUR_DOWN[e]), e  # [D, F], not transposed
    back = _apply(_hub_mapping().inverse(), out)
    assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)
    renumbered = _apply(_hub_mapping("+6"), ours)  # stored expert e is expert e + 6 on the other side
    assert torch.equal(renumbered["h.0.experts.7.up_proj"], HUB_UP[1]) and "h.0.experts.0.up_proj" not in renumbered
    assert torch.equal(_apply(_hub_mapping("+6").inverse(), renumbered)["l.0.experts.gate_up"], OUR_GATE_UP)


def test_the_same_rules_reach_transformers_fused_gate_first_layout():
    mapping = Mapping((Unstack("gate_up", "e.{expert}.gate_up", 2), SplitRows("e.{expert}.gate_up", ("e.{expert}.g", "e.{expert}.u"), (1, 1), 2),
                       ConcatRows(("e.{expert}.g", "e.{expert}.u"), "e.{expert}.fused", (2, 2), 1), Stack("e.{expert}.fused", "fused", 2)))
    out = _apply(mapping, {"gate_up": OUR_GATE_UP})
    assert torch.equal(out["fused"], FUSED_GATE_UP)
    assert torch.equal(_apply(mapping.inverse(), out)["gate_up"], OUR_GATE_UP)


def _hub_metas(drop=(), rename=None):
    metas = {f"h.1.experts.{e}.{p}": Meta((2, 2) if p != "down_proj" else (3, 2), "float32")
             for e in (0, 1) for p in ("gate_proj", "up_proj", "down_proj")}
    for name in drop:
        metas.pop(name)
    for old, new in (rename or {}).items():
        metas[new] = metas.pop(old)
    return metas


def test_stacking_names_the_missing_and_unexpected_parts_in_one_line():
    inverse = _hub_mapping().inverse()
    with pytest.raises(CheckpointError) as dropped:
        inverse.plan(_hub_metas(drop=[f"h.1.experts.1.{p}" for p in ("gate_proj", "up_proj", "down_proj")]))
    assert str(dropped.value).startswith("l.1.experts.down: stacking 2 tensors h.{layer}.experts.{expert}.down_proj "
                                         "(indices 0..1) but missing h.1.experts.1.down_proj; Fix: ")
    with pytest.raises(CheckpointError) as renumbered:
        inverse.plan(_hub_metas(rename={f"h.1.experts.1.{p}": f"h.1.experts.3.{p}" for p in ("gate_proj", "up_proj", "down_proj")}))
    assert "but missing h.1.experts.1.down_proj; unexpected h.1.experts.3.down_proj; Fix" in str(renumbered.value)
    assert "\n" not in str(renumbered.value)
    with pytest.raises(CheckpointError, match=r"concatenating .*h\.1\.experts\.0\.up_proj'\] are missing"):
        inverse.plan(_hub_metas(drop=["h.1.experts.0.up_proj"]))


def test_unstack_and_stack_refuse_what_does_not_fit():
    with pytest.raises(CheckpointError, match=r"dim 0 of \[3, 2\] cannot be unstacked into 2 tensors"):
        Mapping((Unstack("s", "p.{expert}", 2),)).plan({"s": Meta((3, 2), "float32")})
    with pytest.raises(CheckpointError, match=r"p\.1: shape \[3\] float32 differs from p\.0 \[2\] float32"):
        Mapping((Stack("p.{expert}", "s", 2),)).plan({"p.0": Meta((2,), "float32"), "p.1": Meta((3,), "float32")})
    with pytest.raises(CheckpointError, match="plus exactly one that numbers the parts"):
        Unstack("l.{layer}.s", "p.{expert}", 2)
    with pytest.raises(CheckpointError, match="plus exactly one that numbers the parts"):
        Stack("p.{layer}.{expert}", "s", 2)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(0, 3), st.lists(st.integers(1, 3), max_size=2), st.integers(1, 3))
def test_any_unstack_then_its_derived_inverse_is_the_identity(count, offset, inner, layers):
    stacked = {f"l.{layer}.w": _distinct(count, *inner, start=100 * layer) for layer in range(layers)}
    mapping = Mapping((Unstack("l.{layer}.w", f"h.{{layer}}.e.{{expert+{offset}}}.w", count),))
    parts = _apply(mapping, stacked)
    assert sorted(parts) == sorted(f"h.{layer}.e.{e + offset}.w" for layer in range(layers) for e in range(count))
    assert all(torch.equal(parts[f"h.{layer}.e.{e + offset}.w"], stacked[f"l.{layer}.w"][e])
               for layer in range(layers) for e in range(count))
    back = _apply(mapping.inverse(), parts)
    assert back.keys() == stacked.keys() and all(torch.equal(back[k], stacked[k]) for k in stacked)


def test_unstack_and_stack_errors_word_by_word():
    with pytest.raises(CheckpointError) as raised:
        Unstack("l.{layer}.s", "p.{expert}", 2)
    assert str(raised.value) == ("Unstack: 'p.{expert}' must use the placeholders of 'l.{layer}.s' plus exactly one that "
                                 "numbers the parts (e.g. {expert}), or the mapping cannot be inverted")
    with pytest.raises(CheckpointError) as raised:
        Stack("p.{layer}.{expert}", "s", 2)
    assert str(raised.value) == ("Stack: 'p.{layer}.{expert}' must use the placeholders of 's' plus exactly one that "
                                 "numbers the parts (e.g. {expert}), or the mapping cannot be inverted")
    with pytest.raises(CheckpointError) as raised:
        Unstack("s", "p.{expert}", 0)
    assert str(raised.value) == "Unstack s: count must be 1 or more, not 0"
    with pytest.raises(CheckpointError) as raised:
        Mapping((Stack("p.{expert}", "s", 4),)).plan({"p.0": Meta((2,), "float32"), "p.3": Meta((2,), "float32"),
                                                      "p.5": Meta((2,), "float32")})
    assert str(raised.value) == ("s: stacking 4 tensors p.{expert} (indices 0..3) but missing p.1, p.2; unexpected p.5; "
                                 "Fix: give every part exactly once under its own index (a model config with this many "
                                 "parts, and no part dropped or renumbered)")
