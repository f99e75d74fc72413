"""Host memory that snapshots in memory (`--snapshot-every`, issue 41) take per rank.

Pure arithmetic over the rank's share of the saved state, so the config's help, the layout
chooser and `plan layout` state one figure. Where the bytes are:
- each rank's staging buffers: STAGING_BUFFERS copies of its share (a snapshot stages into one
  while the previous snapshot still uploads from the other: docs/decisions.md 163);
- the keepers' copies: KEEPER_COPIES of every file, on two nodes, for the newest committed
  snapshot and for each of the SNAPSHOTS_IN_FLIGHT still being written (an older one is dropped
  only once a newer commits). Spread over the nodes, that is per rank on average.
"""
from __future__ import annotations

STAGING_BUFFERS = 2
SNAPSHOTS_IN_FLIGHT = STAGING_BUFFERS  # a rank stages a snapshot only into a free buffer
KEEPER_COPIES = 2
SHARES_PER_RANK = STAGING_BUFFERS + KEEPER_COPIES * (1 + SNAPSHOTS_IN_FLIGHT)


def snapshot_host_bytes(saved_share_bytes: float) -> float:
    """Host bytes per rank (at most, on average over the nodes) for a rank whose share of a
    checkpoint is `saved_share_bytes`."""
    return SHARES_PER_RANK * saved_share_bytes
