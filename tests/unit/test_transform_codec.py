"""Transform rules as data (a user plan's Hugging Face mapping): every rule survives a JSON round
trip as the same rule, shorthand spellings decode to the canonical form, a rule that is not one is
refused in one line naming its position, and a plan keeps its mapping through checkpoint metadata."""
import json

import pytest

from rayshard.plans.transforms.codec import canonical, decode_mapping, decode_rule, encode_rule
from rayshard.plans.transforms.mapping import Add, Alias, Cast, ConcatRows, Drop, Meta, Rename, SplitRows, Stack, Transpose, Unstack
from rayshard.plans.errors import ConfigError
from rayshard.plans.training.model_plan import ModelPlan

RULES = [Rename("a.{layer}.w", "b.{layer}.weight"), SplitRows("f.{layer}", ("x.{layer}", "y.{layer}"), (3, 1), 2),
         ConcatRows(("x.{layer}", "y.{layer}"), "f.{layer}", (3, 1), 2), Transpose("t.*", (1, 0)),
         Cast("*", "bfloat16", "float32"), Add("extra", (2, 5), "float32", 0.5), Drop("gone", (7,), "float32", 1.0),
         Alias("lm_head.weight", "wte.weight"), Rename("e.{expert}.w", "h.{expert+8}.w"),
         Unstack("l.{layer}.experts.w", "h.{layer}.experts.{expert-1}.w", 4), Stack("h.{expert+1}.w", "stacked.w", 2)]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: type(r).__name__)
def test_every_rule_survives_json_as_the_same_rule(rule):
    assert decode_rule(json.loads(json.dumps(encode_rule(rule)))) == rule


def test_shorthands_decode_to_the_canonical_form():
    assert canonical([{"transpose": "p.{layer}.w"}, {"rename": ("a", "b")}]) == (
        {"transpose": ["p.{layer}.w", [0, 1]]}, {"rename": ["a", "b"]})


def test_a_decoded_mapping_plans_like_the_rules_it_spells():
    mapping = decode_mapping([{"concat_rows": [["q.{layer}", "k.{layer}"], "qk.{layer}", [4, 2], 1]},
                              {"transpose": "qk.{layer}"}])
    plan = mapping.plan({"q.0": Meta((4, 3), "float32"), "k.0": Meta((2, 3), "float32")})
    assert plan.outputs == {"qk.0": Meta((3, 6), "float32")}
    assert mapping.inverse().plan(plan.outputs).outputs == {"q.0": Meta((4, 3), "float32"), "k.0": Meta((2, 3), "float32")}


@pytest.mark.parametrize("rules, says", [
    ([{"rename": ["a", "b"]}, {"renam": ["a", "b"]}], r"hf_mapping\[1\]=\{'renam'.*names no rule; known: \["),
    ([{"rename": ["a"]}], r"hf_mapping\[0\].*is not a valid rename .*takes \['source', 'target'\]"),
    ([{"rename": ["a.{layer}", "b"]}], r"hf_mapping\[0\].*same placeholders"),
    ([{"transpose": ["a", [0, 1], 3]}], r"hf_mapping\[0\].*gives 3 arguments"),
    ([["rename", "a", "b"]], r"hf_mapping\[0\].*is not a one-key dict"),
    ({"rename": ["a", "b"]}, r"hf_mapping=.*is not a list of rules"),
])
def test_a_bad_rule_is_refused_in_one_line_naming_it(rules, says):
    with pytest.raises(ConfigError, match=says) as error:
        canonical(rules)
    assert "\n" not in str(error.value) and "Fix: write each rule as a one-key dict" in str(error.value)


def test_a_plan_keeps_its_mapping_and_config_through_json_and_needs_both():
    plan = ModelPlan(hf_mapping=[{"rename": ("a", "b")}], hf_config={"architectures": ("X",), "n": 3})
    again = ModelPlan.from_dict(json.loads(json.dumps({"hf_mapping": plan.hf_mapping, "hf_config": plan.hf_config})))
    assert again == plan and hash(again) == hash(plan) and plan.hf_config["architectures"] == ["X"]
    assert ModelPlan() != plan and ModelPlan().hf_mapping is None
    with pytest.raises(ConfigError, match="give both in the ModelPlan, or neither"):
        ModelPlan(hf_mapping=[{"rename": ["a", "b"]}])
    with pytest.raises(ConfigError, match=r"hf_config.*naming its 'architectures'"):
        ModelPlan(hf_mapping=[], hf_config={"model_type": "gpt2"})
    with pytest.raises(ConfigError, match=r"hf_config='dict': is not JSON"):
        ModelPlan(hf_mapping=[], hf_config={"architectures": ["X"], "bad": object()})
