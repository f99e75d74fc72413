"""DTensor's process-wide caches that hold device meshes, emptied before a reused process trains
again and after it leaves its groups.

Two reasons, one per kind of harm:

- Correctness: the sharding caches are keyed by DeviceMesh equality, which compares shapes and
  ranks but not process groups, so a new mesh equal to an earlier run's would pick up that run's
  destroyed groups ("Could not resolve the process group registered under the name 19"), or a new
  group that reused the name, and its collectives would hang or talk to the wrong ranks.
- Resources: every entry holds its mesh, and a mesh holds its process groups. A destroyed gloo
  group lives, with its loop thread and one TCP connection per peer, for as long as anything holds
  it: a reused rank kept every earlier run's groups (four loop threads per run at dp2 x tp2, each
  polling; after a few hundred runs in the test suite's pool they took more CPU than the runs) and
  their connections stayed open after a failure (decision 233). Emptied, the groups go when they
  are destroyed.

The caches are torch's private ones (2.13, and the 2.11 of the GPU image); one that a later
torch lacks is skipped, not an error.
"""
from __future__ import annotations

import importlib

from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

# (module, attribute path) of each cache with a `cache_clear`, beside the two torch clears by name.
_MESH_HOLDING_CACHES = (
    ("torch.distributed.tensor._redistribute", "_gen_transform_infos"),  # keyed by (src, dst) specs
    ("torch.distributed.tensor._collective_utils", "MeshTopoInfo.build_from_mesh"),  # keyed by mesh
    ("torch.distributed.tensor._sharding_prop", "ShardingPropagator._propagate_tensor_meta_cached"),  # by op schema
)


def forget_previous_meshes() -> None:
    """Empty every DTensor cache that keys on, or holds, a device mesh."""
    _clear_sharding_prop_cache()
    clear_redistribute_planner_cache()
    for module_name, path in _MESH_HOLDING_CACHES:
        cache = _attribute(module_name, path)
        if cache is not None and hasattr(cache, "cache_clear"):
            cache.cache_clear()


def _attribute(module_name: str, path: str):
    try:
        found = importlib.import_module(module_name)
    except ImportError:
        return None
    for name in path.split("."):
        found = getattr(found, name, None)
        if found is None:
            return None
    return found
