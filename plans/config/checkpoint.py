"""The checkpoint section: when a run commits checkpoints, how, and what it resumes from."""
from __future__ import annotations

from dataclasses import dataclass

from rayshard.plans.errors import ConfigError
from rayshard.plans.options import option


@dataclass(frozen=True)
class CheckpointConfig:
    """Saves and resumes.

    every: commit a checkpoint every N steps (0: only at the end). resume: "latest", "auto",
    "RUN", "RUN@STEP" or a checkpoint URL. verify_resume: after a resume, save the loaded state
    to a side copy and check its per-tensor digests equal the checkpoint's before training on (one
    extra save and two digests per resume). async_save: a save blocks training only while ranks
    copy their state to CPU; uploads run in the background and commit at a later step
    (cluster/run/async_save.py). writer_lease_s: how long the run's writer lease outlives its last
    renewal (renewed every quarter of it): the longest a trainer killed with -9 on another host
    keeps a resubmitted one waiting (on the same host a dead holder is seen at once).
    snapshot_every: every K steps the ranks also save to the snapshot keepers' host memory
    (`rayshard-snapshot://`, two copies on two nodes; never durable, never moves LATEST); a
    restart resumes from the newest whole snapshot when it is newer than LATEST (issue 41). Host
    memory per rank: up to 8 copies of the rank's share of the saved state (12 bytes per trained
    parameter, over tp * pp * fsdp): two staging buffers, and the keepers' two copies of the
    committed snapshot and of the two being written (plans/layout/snapshot_memory.py); the layout
    chooser counts it on CPU ranks, and `rayshard plan layout --snapshot-every 1` prints it.
    """

    every: int = option(0, flag="--ckpt-every", metavar="N", help="commit a checkpoint every N steps (0: at the end only)")
    resume: str | None = option(None, metavar="CKPT",
                                help="latest | auto (latest if the run has checkpoints, else start fresh) | RUN | "
                                     "RUN@STEP | checkpoint URL")
    verify_resume: bool = option(False, help="after resuming, prove the loaded state's digests equal the checkpoint's "
                                             "(one extra save)")
    async_save: bool = option(False, help="checkpoints block training only while ranks copy state to CPU; uploads run "
                                          "in the background")

    snapshot_every: int = option(0, metavar="K",
                                 help="every K steps, also keep a snapshot of the state in the nodes' host memory, "
                                      "replicated to another node: a failure then resumes from it (at most K steps "
                                      "redone) instead of from the last checkpoint; 0: off. Host memory: up to 8 copies of a "
                                      "rank's share of the state per rank (`rayshard plan layout --snapshot-every 1` "
                                      "says how much)")

    writer_lease_s: float = option(120.0, metavar="SECONDS",
                                   help="a run has one trainer at a time: its writer lease lapses this long after the "
                                        "trainer stops renewing it (a killed trainer on another host)")

    def validate(self) -> None:
        if not self.writer_lease_s > 0:
            raise ConfigError("writer_lease_s", self.writer_lease_s, "must be > 0",
                              "set --writer-lease-s to a number of seconds, e.g. 120")
        if self.snapshot_every < 0:
            raise ConfigError("snapshot_every", self.snapshot_every, "must be >= 0 (0: no snapshots)",
                              "set --snapshot-every 0 or more, e.g. 1")
        if self.every < 0:
            raise ConfigError("ckpt_every", self.every, "must be >= 0 (0 saves only at the end)", "set --ckpt-every 0 or more")
