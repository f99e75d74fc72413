"""Which nodes hold a copy of a snapshot file: the writer's own node and the next one.

A snapshot lives only in host memory, so it survives the loss of a node only if every file has a
copy on a second node. The writer's node keeps the first copy (no network hop for it) and the next
node in a ring over the sorted node ids keeps the second: each node's replicas are spread over one
neighbour, which any reader can compute from the node list alone, without an index.
"""
from __future__ import annotations

from collections.abc import Sequence


def snapshot_holders(writer_node: str, nodes: Sequence[str], copies: int = 2) -> tuple[str, ...]:
    """The nodes that keep a file written on writer_node: writer_node first (when it has a keeper),
    then its successors in the sorted ring of nodes, `copies` in all (fewer if fewer nodes exist).
    """
    ring = sorted(set(nodes))
    if not ring:
        raise ValueError("no node keeps snapshots: start a snapshot keeper first")
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    start = ring.index(writer_node) if writer_node in ring else _successor(ring, writer_node)
    return tuple(ring[(start + offset) % len(ring)] for offset in range(min(copies, len(ring))))


def _successor(ring: list[str], node: str) -> int:
    """The first ring position after node's place in the sorted order (a writer on a node with no
    keeper sends both copies away)."""
    return next((index for index, name in enumerate(ring) if name > node), 0)
