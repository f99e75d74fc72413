"""A user model's plan is checked before any rank starts, and its record plans like the reference.

The plan checks name what is wrong (the pattern that matches nothing, the parameter tp cannot
split, the factory that cannot be imported); the record in checkpoint metadata survives JSON and
gives the checkpoint planner each parameter's tp split and pipeline part without the user's code."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from rayshard.actors.model.stage import carve_stage
from rayshard.actors.model.user_model import FactoryModel, describe_factory
from examples.gpt2.model import GPT2, gpt2_plan, tiny_gpt2
from rayshard.plans.checkpoint.regions import rank_regions
from rayshard.plans.config import ModelChoice, NumericsConfig, TrainConfig
from rayshard.plans.errors import ConfigError
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.training.model_plan import ModelPlan, validate_plan
from rayshard.plans.training.tp_fit import check_tp_fits
from rayshard.plans.training.model_spec import ModelConfig, parameter_shapes
from rayshard.plans.training.tp_plan import COLWISE

FACTORY = "examples.gpt2.model:tiny_gpt2"


def _names_and_shapes(module):
    return ([name for name, _ in module.named_modules() if name],
            {name: tuple(p.shape) for name, p in module.named_parameters()})


def _odd_gpt2() -> FactoryModel:
    """Heads of 6 and a vocabulary of 250: q/k/v rows (48) split by 2 and 4, not by 5; the vocabulary
    by any tp (unevenly, decision 118)."""
    return FactoryModel(GPT2(vocab=250, dim=48, layers=2, heads=8, max_seq_len=64), gpt2_plan(48, 250, 64))


def test_the_record_survives_json_and_names_every_parameter_with_its_split():
    model = describe_factory(FACTORY)
    again = ModelConfig.from_dict(json.loads(json.dumps(model.to_dict())))
    assert again == model
    _, shapes = _names_and_shapes(tiny_gpt2().module)
    assert parameter_shapes(again) == shapes
    splits = {name: split for name, _, split in again.user.parameters}
    # Independent of the rule's code: GPT-2's column-parallel rows, row-parallel columns, copies.
    assert splits["wte.weight"] == 0 and splits["lm_head.weight"] == 0
    assert splits["blocks.1.attn.q.weight"] == 0 and splits["blocks.1.attn.q.bias"] == 0
    assert splits["blocks.1.attn.proj.weight"] == 1 and splits["blocks.1.attn.proj.bias"] == -1
    assert splits["blocks.3.mlp.fc.bias"] == 0 and splits["wpe.weight"] == -1 and splits["norm.bias"] == -1
    assert (again.n_layers, again.dim, again.vocab_size, again.family) == (4, 64, 256, "user")


def test_a_pattern_that_names_no_module_is_refused_naming_it():
    made = tiny_gpt2()
    styles = dict(made.plan.tp_styles) | {"blocks.*.attention.wq": COLWISE}
    with pytest.raises(ConfigError, match=r"model plan tp_styles='blocks\.\*\.attention\.wq': matches no module"):
        validate_plan(replace(made.plan, tp_styles=styles), *_names_and_shapes(made.module))


def test_an_unknown_style_and_a_parameter_outside_every_stage_part_are_refused():
    made = tiny_gpt2()
    names, shapes = _names_and_shapes(made.module)
    with pytest.raises(ConfigError, match=r"tp_styles\['lm_head'\]='diagonal': is not a style"):
        validate_plan(replace(made.plan, tp_styles={"lm_head": "diagonal"}), names, shapes)
    with pytest.raises(ConfigError, match=r"model.plan='wpe.weight': is in no block and in neither first_stage"):
        validate_plan(replace(made.plan, first_stage=("wte",)), names, shapes)
    with pytest.raises(ConfigError, match=r"model plan blocks='layers': is not a module"):
        validate_plan(replace(made.plan, blocks="layers"), names, shapes)


def test_a_parameter_tp_cannot_split_is_refused_naming_it_and_its_shape(monkeypatch):
    import examples.gpt2.model as example

    monkeypatch.setattr(example, "odd_gpt2", _odd_gpt2, raising=False)
    model = describe_factory("examples.gpt2.model:odd_gpt2")
    check_tp_fits(model, 2)
    check_tp_fits(model, 4)  # 250 rows of wte and lm_head over 4 ranks: 63, 63, 62, 62
    with pytest.raises(ConfigError, match=r"layout.tp=5: cannot split parameter blocks.0.attn.q.weight of shape \[48, 48\] "
                                          r"along dim 0"):
        TrainConfig(model=ModelChoice(spec=model), layout=ParallelLayout(tp=5), global_batch=8, seq_len=30).validate()


def test_a_factory_that_cannot_be_found_is_named():
    with pytest.raises(ConfigError, match=r"model.factory='examples.gpt2.model': is not 'package.module:function'"):
        describe_factory("examples.gpt2.model")
    with pytest.raises(ConfigError, match=r"model.factory='examples.nowhere:f': cannot be imported"):
        describe_factory("examples.nowhere:f")
    with pytest.raises(ConfigError, match=r"module examples.gpt2.model has no function gpt3"):
        describe_factory("examples.gpt2.model:gpt3")


def test_checkpoint_regions_follow_the_plan_and_the_stage_cut():
    model = describe_factory(FACTORY)
    layout = ParallelLayout(pp=2, tp=2)
    ranks = {layout.coords_of(rank): rank for rank in range(layout.world_size)}
    by_coords = {(c.pp, c.tp): {r.name: r for r in rank_regions(model, layout, rank)} for c, rank in ranks.items()}
    first, last = by_coords[(0, 1)], by_coords[(1, 1)]
    assert {"wte.weight", "wpe.weight", "blocks.1.mlp.fc.weight"} <= set(first) and "lm_head.weight" not in first
    assert {"norm.weight", "lm_head.weight", "blocks.2.attn.q.bias"} <= set(last) and "wte.weight" not in last
    assert (first["wte.weight"].offsets, first["wte.weight"].sizes) == ((128, 0), (128, 64))
    assert (last["blocks.3.attn.proj.weight"].offsets, last["blocks.3.attn.proj.weight"].sizes) == ((0, 32), (64, 32))
    assert first["wpe.weight"].replicated_over == ("tp",)


def test_a_stage_keeps_global_names_and_drops_the_other_stages_parts():
    made = tiny_gpt2()
    stage = carve_stage(made.module, made.plan, range(2, 4), first=False, last=True)
    names = [name for name, _ in stage.named_parameters()]
    assert names[0].startswith("blocks.2.") and "lm_head.weight" in names
    assert stage.wte is None and stage.wpe is None and not any(n.startswith("blocks.1.") for n in names)


def test_the_plan_record_is_pure_data():
    plan = ModelPlan(tp_styles={"a": COLWISE}, first_stage=["x"])
    assert plan.tp_styles == (("a", COLWISE),) and plan.first_stage == ("x",)
    assert hash(plan) == hash(ModelPlan.from_dict(json.loads(json.dumps({"tp_styles": [["a", COLWISE]],
                                                                          "first_stage": ["x"]}))))


def _cli_config(tmp_path, model_section, *flags):
    from rayshard.cluster.cli.commands.train import config_from_args
    from rayshard.cluster.cli.main import build_parser

    path = tmp_path / "run.yaml"
    path.write_text(f"model: {json.dumps(model_section)}\nlayout: {{dp: 2, tp: 2}}\nstore: {tmp_path}/store\n")
    return config_from_args(build_parser().parse_args(["train", "--config", str(path), *flags]))


def test_a_config_files_model_factory_and_the_flag_build_the_same_model(tmp_path):
    from_file = _cli_config(tmp_path, {"factory": FACTORY})
    from_flag = _cli_config(tmp_path, {"preset": "tiny"}, "--model-factory", FACTORY)
    assert from_file.model.spec == from_flag.model.spec == describe_factory(FACTORY)
    assert from_file.model.preset == FACTORY


def test_a_factory_beside_preset_sizes_or_a_preset_flag_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"model=\['dim'\]: sets preset fields beside a factory"):
        _cli_config(tmp_path, {"factory": FACTORY, "dim": 32})
    with pytest.raises(ConfigError, match=r"--model-factory='examples.gpt2.model:tiny_gpt2': names a second model"):
        _cli_config(tmp_path, {"preset": "tiny"}, "--model", "tiny", "--model-factory", FACTORY)


def test_sp_on_a_plan_that_declares_none_is_refused_naming_the_factory():
    model = describe_factory(FACTORY)
    with pytest.raises(ConfigError, match=r"sequence_parallel=True: the plan of examples.gpt2.model:tiny_gpt2 declares no"):
        TrainConfig(model=ModelChoice(FACTORY, model), layout=ParallelLayout(tp=2), global_batch=8, seq_len=32,
                    numerics=NumericsConfig(sequence_parallel=True)).validate()


def test_a_resume_naming_the_same_factory_finds_no_difference_and_another_is_listed_briefly(monkeypatch):
    from rayshard.plans.training.model_spec import model_differences
    import examples.gpt2.model as example

    saved = ModelConfig.from_dict(json.loads(json.dumps(describe_factory(FACTORY).to_dict())))
    assert model_differences(saved, describe_factory(FACTORY)) == []
    monkeypatch.setattr(example, "odd_gpt2", _odd_gpt2, raising=False)
    differences = model_differences(saved, describe_factory("examples.gpt2.model:odd_gpt2"))
    assert differences[:4] == ["vocab_size (256 -> 250)", "dim (64 -> 48)", "n_layers (4 -> 2)", "max_seq_len (256 -> 64)"]
    assert differences[4:6] == ["factory ('examples.gpt2.model:tiny_gpt2' -> 'examples.gpt2.model:odd_gpt2')", "plan"]
    assert differences[6].startswith("parameters (")


def test_a_resume_naming_the_factory_takes_a_changed_hf_mapping_as_no_difference():
    from rayshard.plans.training.model_spec import model_differences

    named = describe_factory(FACTORY)
    assert named.user.plan.hf_mapping  # the example exports as GPT2LMHeadModel
    before_the_mapping = replace(named, user=replace(named.user, plan=replace(named.user.plan, hf_mapping=None,
                                                                               hf_config=None)))
    assert before_the_mapping != named and model_differences(before_the_mapping, named) == []
    other_blocks = replace(named, user=replace(named.user, plan=replace(before_the_mapping.user.plan, blocks="layers")))
    assert model_differences(other_blocks, named) == ["plan"]


def test_an_hf_mapping_that_misses_a_parameter_is_refused_when_the_factory_is_described(monkeypatch):
    import examples.gpt2.model as example

    def lossy_gpt2():
        made = tiny_gpt2()
        rules = [r for r in made.plan.hf_mapping if r != {"rename": ["wpe.weight", "transformer.wpe.weight"]}]
        return FactoryModel(made.module, replace(made.plan, hf_mapping=rules))
    monkeypatch.setattr(example, "lossy_gpt2", lossy_gpt2, raising=False)
    with pytest.raises(ConfigError, match=r"hf_mapping='20 rules': does not fit the model: no rule .* covers 1 tensor\(s\): wpe.weight"):
        describe_factory("examples.gpt2.model:lossy_gpt2")
