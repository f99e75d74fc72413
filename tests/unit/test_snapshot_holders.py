"""Which nodes keep a snapshot file's two copies (plans/checkpoint/snapshot_holders.py)."""
from hypothesis import given, strategies as st
import pytest

from rayshard.plans.checkpoint.snapshot_holders import snapshot_holders

NODES = st.lists(st.text("abcdef0123456789", min_size=4, max_size=8), min_size=1, max_size=12, unique=True)


@given(NODES, st.data())
def test_a_file_is_kept_on_its_writers_node_and_one_other(nodes, data):
    writer = data.draw(st.sampled_from(nodes))
    holders = snapshot_holders(writer, nodes)
    assert holders[0] == writer
    assert len(holders) == min(2, len(nodes)) and len(set(holders)) == len(holders)


@given(NODES, st.data())
def test_losing_any_one_node_leaves_a_copy_of_every_file(nodes, data):
    if len(nodes) < 2:
        return
    lost = data.draw(st.sampled_from(nodes))
    for writer in nodes:
        assert set(snapshot_holders(writer, nodes)) - {lost}


def test_a_writer_without_a_keeper_sends_both_copies_away_in_ring_order():
    assert snapshot_holders("c", ["a", "b", "d"]) == ("d", "a")
    assert snapshot_holders("z", ["a", "b"]) == ("a", "b")


def test_the_ring_does_not_depend_on_the_order_nodes_are_listed_in():
    assert snapshot_holders("b", ["c", "a", "b"]) == snapshot_holders("b", ["a", "b", "c"]) == ("b", "c")
    assert snapshot_holders("c", ["a", "b", "c"]) == ("c", "a")


def test_no_keeper_at_all_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="start a snapshot keeper"):
        snapshot_holders("a", [])
