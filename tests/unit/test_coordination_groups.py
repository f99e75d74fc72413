"""The checkpoint API's own gloo groups (actors/checkpoint/coordination.py) belong to the world
they were made in: a world destroyed and started again in the same process (an elastic restart,
a test's second world) gets new ones, and the earlier world's are let go so their sockets close."""
import weakref

import torch.distributed as dist

from rayshard.actors.checkpoint import coordination


def _world(path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)


def test_a_new_world_gets_new_groups_and_the_old_ones_are_let_go(tmp_path):
    _world(tmp_path / "first")
    try:
        first = coordination.group_for(None, 30.0)
        assert coordination.group_for(None, 30.0) is first  # one per world, group and timeout
        first_ref = weakref.ref(first)
    finally:
        dist.destroy_process_group()
    del first
    _world(tmp_path / "second")
    try:
        second = coordination.group_for(None, 30.0)
        assert all(key[0] is dist.group.WORLD for key in coordination._GROUPS)
        assert first_ref() is None  # nothing holds the first world's group any more
        assert dist.get_world_size(second) == 1
    finally:
        dist.destroy_process_group()
        coordination._GROUPS.clear()
