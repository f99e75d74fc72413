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
    """

    every: int = option(0, flag="--ckpt-every", metavar="N", help="commit a checkpoint every N steps (0: at the end only)")
    resume: str | None = option(None, metavar="CKPT",
                                help="latest | auto (latest if the run has checkpoints, else start fresh) | RUN | "
                                     "RUN@STEP | checkpoint URL")
    verify_resume: bool = option(False, help="after resuming, prove the loaded state's digests equal the checkpoint's "
                                             "(one extra save)")
    async_save: bool = option(False, help="checkpoints block training only while ranks copy state to CPU; uploads run "
                                          "in the background")

    writer_lease_s: float = option(120.0, metavar="SECONDS",
                                   help="a run has one trainer at a time: its writer lease lapses this long after the "
                                        "trainer stops renewing it (a killed trainer on another host)")

    def validate(self) -> None:
        if not self.writer_lease_s > 0:
            raise ConfigError("writer_lease_s", self.writer_lease_s, "must be > 0",
                              "set --writer-lease-s to a number of seconds, e.g. 120")
        if self.every < 0:
            raise ConfigError("ckpt_every", self.every, "must be >= 0 (0 saves only at the end)", "set --ckpt-every 0 or more")
