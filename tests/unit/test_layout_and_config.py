"""Layouts and configs: every constraint gives an error naming the field, the constraint and a fix."""
import pytest
from hypothesis import given, settings, strategies as st

from rayshard.plans.config import ModelChoice, TrainConfig, with_overrides
from rayshard.plans.errors import ConfigError
from rayshard.plans.layout.parallel_layout import ParallelLayout, RankCoords
from rayshard.plans.training.model_spec import preset


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4), st.integers(1, 4))
def test_rank_and_coordinates_round_trip_with_tp_innermost(dp, fsdp, tp, pp):
    layout = ParallelLayout(dp=dp, fsdp=fsdp, tp=tp, pp=pp)
    seen = set()
    for rank in range(layout.world_size):
        coords = layout.coords_of(rank)
        assert layout.rank_of(coords) == rank
        seen.add(coords)
    assert len(seen) == layout.world_size
    if tp > 1:
        assert layout.coords_of(1) == RankCoords(pp=0, dp=0, fsdp=0, tp=1)
    data_ranks = {layout.data_rank_of(r) for r in range(layout.world_size)}
    assert data_ranks == set(range(dp * fsdp))


def test_layout_parse_and_describe():
    layout = ParallelLayout.parse("dp=2, tp=2")
    assert (layout.dp, layout.tp, layout.world_size) == (2, 2, 4)
    assert layout.describe() == "dp2 x tp2"
    assert ParallelLayout.from_dict(layout.to_dict()) == layout
    with pytest.raises(ConfigError, match="dp=N"):
        ParallelLayout.parse("dp2")
    assert ParallelLayout.parse(str(layout)) == layout  # what messages print reads back


@pytest.mark.parametrize("text, fragment", [
    ("dp=1,dp=2", "gives dp twice"), ("dp=1,,tp=2", "has an empty item"), ("dp=2,", "has an empty item"),
    ("", "is empty"), ("  ", "is empty"), ("tp=two", "cannot read 'tp=two'"), ("xp=2", "cannot read 'xp=2'"),
])
def test_a_layout_text_is_read_strictly(text, fragment):
    with pytest.raises(ConfigError, match=f"{fragment}.*Fix: write it as dp=N"):
        ParallelLayout.parse(text)


@pytest.mark.parametrize("kwargs, field, fragment", [
    (dict(dp=0), "dp", ">= 1"),
    (dict(pp=1, vpp=2), "vpp", "pp > 1"),
])
def test_bad_layouts_name_the_constraint(kwargs, field, fragment):
    with pytest.raises(ConfigError) as error:
        ParallelLayout(**kwargs)
    assert error.value.field == field and fragment in str(error.value) and "Fix:" in str(error.value)


def _config(**kwargs):
    base = dict(model=ModelChoice.named("tiny"))
    base.update(kwargs)
    return TrainConfig(**base)


@pytest.mark.parametrize("overrides, field, fragment", [
    ({"layout.tp": 4}, "layout.tp", "kv heads (2)"),
    ({"resources.world_size": 8, "layout.dp": 2}, "world_size", "dp*fsdp*tp*pp"),
    ({"seq_len": 0}, "seq_len", "positive"),
    ({"seq_len": 100000}, "seq_len", "max_seq_len"),
    ({"global_batch": 7, "layout.dp": 2}, "global_batch", "multiple of dp*fsdp"),
    ({"pipeline.microbatches": 3}, "microbatches", "divide the per-rank batch"),
    ({"steps": 0}, "steps", "at least 1"),
    ({"run": "bad/name"}, "run", "letters"),
    ({"optimizer.lr": -1.0}, "optimizer.lr", "lr > 0"),
    ({"layout.pp": 8}, "layout.pp", "exceed the model's 4 layers"),
    ({"checkpoint.every": -1}, "ckpt_every", ">= 0"),
])
def test_bad_configs_name_field_constraint_and_fix(overrides, field, fragment):
    with pytest.raises(ConfigError) as error:
        with_overrides(_config(), **overrides).validate()
    message = str(error.value)
    assert error.value.field == field, message
    assert fragment in message and "Fix:" in message


@pytest.mark.parametrize("global_batch, microbatches, fix, following_it", [
    # Per-rank batch 2: DualPipeV on pp=2 needs >= 4 microbatches, and 4 does not divide 2. Each
    # error's fix must satisfy the other rule too, rather than send the user back and forth.
    (2, 2, "raise --global-batch to a multiple of 4 and use --microbatches 4", (4, 4)),
    (2, 4, "raise --global-batch to a multiple of 4 and use --microbatches 4", (4, 4)),
    (8, 2, "use --microbatches in [4, 8]", (8, 4)),
    (12, 5, "use --microbatches in [4, 6, 12]", (12, 6)),
])
def test_a_pipeline_microbatch_fix_meets_the_schedule_and_the_batch_at_once(global_batch, microbatches, fix, following_it):
    config = with_overrides(_config(), global_batch=global_batch,
                            **{"pipeline.microbatches": microbatches, "pipeline.schedule": "dualpipev",
                               "layout.pp": 2, "layout.vpp": 2, "resources.world_size": 2})
    with pytest.raises(ConfigError) as error:
        config.validate()
    assert error.value.field == "microbatches" and str(error.value).endswith(fix), str(error.value)
    fixed_batch, fixed_microbatches = following_it
    with_overrides(config, global_batch=fixed_batch, **{"pipeline.microbatches": fixed_microbatches}).validate()


def test_model_constraints():
    with pytest.raises(ConfigError, match="must divide model.n_heads"):
        preset("tiny", n_kv_heads=3)
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("huge")


def test_from_dict_rejects_unknown_keys_and_reads_sections():
    config = TrainConfig.from_dict({"model": {"preset": "tiny", "tie_embeddings": True},
                                    "layout": {"dp": 2, "tp": 2}, "optimizer": {"lr": 1e-3}, "steps": 5})
    assert config.model.spec.tie_embeddings and config.layout.world_size == 4 and config.optimizer.lr == 1e-3
    with pytest.raises(ConfigError, match="unknown key"):
        TrainConfig.from_dict({"stepz": 5})
    with pytest.raises(ConfigError, match="unknown key"):
        TrainConfig.from_dict({"layout": {"dq": 2}})


LAYOUT_FIX = "write it as dp=N,fsdp=N,tp=N,pp=N,vpp=N,ep=N (any subset, each once; degrees left out are 1)"


@pytest.mark.parametrize("text, constraint", [
    ("", "is empty"), ("dp=2,", "has an empty item"), ("tp=two", "cannot read 'tp=two'"),
    ("dp=1,dp=2", "gives dp twice"),
])
def test_a_layout_text_error_names_the_field_the_text_and_the_fix(text, constraint):
    with pytest.raises(ConfigError) as error:
        ParallelLayout.parse(text)
    assert (error.value.field, error.value.value, error.value.constraint) == ("layout", text, constraint)
    assert str(error.value) == f"layout={text!r}: {constraint}. Fix: {LAYOUT_FIX}"


@pytest.mark.parametrize("field, value", [("dp", 0), ("tp", True), ("fsdp", 1.5), ("pp", "2")])
def test_a_degree_that_is_not_a_positive_integer_is_refused_by_name(field, value):
    with pytest.raises(ConfigError) as error:  # True is an int to Python, "2" would not compare with 1
        ParallelLayout(**{field: value})
    assert str(error.value) == (f"{field}={value!r}: every parallel degree must be an integer >= 1. "
                                f"Fix: set --{field} to 1 or more")


def test_virtual_stages_without_a_pipeline_are_refused_with_the_fix():
    with pytest.raises(ConfigError) as error:
        ParallelLayout(vpp=2)
    assert str(error.value) == "vpp=2: virtual pipeline stages need pp > 1. Fix: set --vpp 1, or --pp 2 or more"


@pytest.mark.parametrize("rank", [-1, 4])
def test_a_rank_outside_the_world_has_no_coordinates(rank):
    with pytest.raises(ValueError, match=rf"^rank {rank} is outside world size 4$"):
        ParallelLayout(dp=2, tp=2).coords_of(rank)
    assert ParallelLayout(dp=2, tp=2).coords_of(3) == RankCoords(pp=0, dp=1, fsdp=0, tp=1)


@pytest.mark.parametrize("layout, text", [
    (ParallelLayout(), "single rank"), (ParallelLayout(pp=2, vpp=2), "pp2 x vpp2"),
    (ParallelLayout(dp=2, fsdp=2, tp=2, pp=3, vpp=3), "dp2 x fsdp2 x tp2 x pp3 x vpp3"),
])
def test_describe_lists_every_degree_above_one_in_the_written_order(layout, text):
    assert layout.describe() == text
