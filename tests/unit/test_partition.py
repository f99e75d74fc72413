"""Stage partition: balanced cuts, explicit layouts, placements, and the queries both ways."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rayshard.plans.errors import ConfigError
from rayshard.plans.pipeline.partition import Placement, parse_layout, partition_layers, stage_ranks


def best_bottleneck(costs: list[float], stages: int) -> float:
    """Brute force: the least possible max stage cost over all cuts with non-empty stages."""
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), stages - 1):
        bounds = (0,) + cuts + (len(costs),)
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@settings(max_examples=60, deadline=None)
@given(
    costs=st.lists(st.sampled_from([0.5, 1.0, 1.0, 2.0, 3.5]), min_size=2, max_size=11),
    pp=st.integers(1, 4),
    vpp=st.integers(1, 2),
    embedding=st.sampled_from([0.0, 1.5]),
    head=st.sampled_from([0.0, 2.5]),
)
def test_balanced_cut_is_optimal_contiguous_and_complete(costs, pp, vpp, embedding, head):
    stages = pp * vpp
    if len(costs) < stages:
        with pytest.raises(ConfigError, match="at least one layer each"):
            partition_layers(costs, pp, vpp, Placement.LOOPED)
        return
    partition = partition_layers(costs, pp, vpp, Placement.LOOPED, embedding, head)
    layers = [layer for span in partition.stage_layers for layer in span]
    assert layers == list(range(len(costs)))
    assert all(len(span) >= 1 for span in partition.stage_layers)
    with_ends = list(costs)
    with_ends[0] += embedding
    with_ends[-1] += head
    assert max(partition.stage_costs) == pytest.approx(best_bottleneck(with_ends, stages))
    assert sum(partition.stage_costs) == pytest.approx(sum(with_ends))


def test_even_costs_split_evenly_and_uneven_counts_are_fine():
    partition = partition_layers([1.0] * 30, pp=4)
    assert sorted(len(span) for span in partition.stage_layers) == [7, 7, 8, 8]
    assert max(partition.stage_costs) == 8


def test_embedding_and_head_costs_push_layers_off_the_end_stages():
    partition = partition_layers([1.0] * 12, pp=4, embedding_cost=2.0, head_cost=2.0)
    assert [len(span) for span in partition.stage_layers] == [2, 4, 4, 2]
    assert partition.stage_costs == (4.0, 4.0, 4.0, 4.0)


def test_placements():
    assert stage_ranks(4, 1, Placement.SINGLE) == (0, 1, 2, 3)
    assert stage_ranks(4, 3, Placement.LOOPED) == (0, 1, 2, 3) * 3
    assert stage_ranks(4, 2, Placement.V) == (0, 1, 2, 3, 3, 2, 1, 0)
    with pytest.raises(ConfigError, match="exactly two stages per rank"):
        stage_ranks(4, 3, Placement.V)
    with pytest.raises(ConfigError, match="one stage per rank"):
        stage_ranks(4, 2, Placement.SINGLE)


def test_queries_answer_both_ways_for_v_placement():
    partition = partition_layers([1.0] * 16, pp=4, vpp=2, placement=Placement.V)
    assert partition.stage_layers[0] == range(0, 2) and partition.stage_layers[7] == range(14, 16)
    assert partition.stage_of_layer(15) == 7 and partition.rank_of_layer(15) == 0
    assert partition.rank_of_layer(0) == 0 and partition.rank_of_layer(7) == 3 and partition.rank_of_layer(8) == 3
    assert partition.stages_of_rank(1) == [1, 6]
    assert partition.layers_of_rank(0) == [0, 1, 14, 15]
    assert partition.rank_costs() == [4.0] * 4
    with pytest.raises(ConfigError, match="layers 0..15"):
        partition.stage_of_layer(16)


def test_explicit_counts_and_ranges():
    counts = partition_layers([1.0] * 10, pp=2, vpp=2, placement=Placement.LOOPED, layout=[1, 4, 4, 1])
    assert counts.stage_layers == (range(0, 1), range(1, 5), range(5, 9), range(9, 10))
    assert counts.layers_of_rank(0) == [0, 5, 6, 7, 8]
    ranges = partition_layers([1.0] * 6, pp=2, layout=[[0, 1, 2, 3], [4, 5]])
    assert ranges.stage_layers == (range(0, 4), range(4, 6))
    head_only = partition_layers([1.0] * 4, pp=2, layout=[4, 0], head_cost=3.0)
    assert head_only.stage_costs == (4.0, 3.0) and head_only.stage_of_layer(3) == 0


@pytest.mark.parametrize(
    "layout, message",
    [
        ([4, 4, 4], "has 3 stages but pp=4 x vpp=1 needs 4"),
        ([4, 4, 4, 5], "add up to 17 layers but the model has 16"),
        ([4, 0, 8, 4], "stage 1 holds no layers"),
        ([[0, 1, 2, 3], [4, 6], [5, 7, 8, 9, 10, 11], [12, 13, 14, 15]], "not consecutive"),
        ([[0, 1, 2, 3], [3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 13, 14, 15]], "layer 3 is on both stage 0 and stage 1"),
        ([[0, 1, 2, 3], [4, 5], [7, 8, 9, 10, 11], [12, 13, 14, 15]], "layers \\[6\\]"),
        ([[0, 1, 2, 3], [8, 9, 10, 11], [4, 5, 6, 7], [12, 13, 14, 15]], "model order"),
        ([[0, 1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11], [12, 13, 14, 16]], "names layer 16"),
        ([-1, 5, 6, 6], "cannot be negative"),
    ],
)
def test_explicit_layout_errors_say_what_is_wrong(layout, message):
    with pytest.raises(ConfigError, match=message) as error:
        partition_layers([1.0] * 16, pp=4, layout=layout)
    assert "Fix:" in str(error.value)


def test_parse_layout():
    assert parse_layout("8,7,7,8") == [8, 7, 7, 8]
    assert parse_layout("0-2,3,4-5") == [[0, 1, 2], [3], [4, 5]]
    with pytest.raises(ConfigError, match="neither layer counts nor layer ranges"):
        parse_layout("a,b")


def test_bad_costs_are_rejected():
    with pytest.raises(ConfigError, match="non-negative"):
        partition_layers([1.0, -1.0], pp=1)
