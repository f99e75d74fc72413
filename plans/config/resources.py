"""The resources section: what the job asks of the cluster, and how long it waits on it."""
from __future__ import annotations

from dataclasses import dataclass

from rayshard.plans.errors import ConfigError
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.options import file_only, option


@dataclass(frozen=True)
class ResourcesConfig:
    """Ranks, CPUs and GPUs per rank, and the bounds on waiting.

    world_size: an optional cross-check of dp*fsdp*tp*pp. cpus_per_rank, gpus_per_rank: None is an
    equal share of the cluster's CPUs, at most one, and one GPU where the cluster has GPUs.
    start_timeout_s bounds each start-up wait (placement group granted, actors alive);
    call_timeout_s bounds any one call on the ranks (a step, a load, a save), a backstop behind
    the ranks' own collective and storage timeouts (docs/decisions.md); collective_timeout_s
    bounds a collective between ranks (the process group's timeout).
    """

    world_size: int | None = option(None, metavar="N", help="optional check: must equal dp*fsdp*tp*pp")
    cpus_per_rank: float | None = option(
        None, metavar="N", help="CPUs each rank asks Ray for (default: an equal share of the cluster's CPUs, at most 1)")
    gpus_per_rank: float | None = option(
        None, metavar="N", help="GPUs each rank asks Ray for (default: 1 where the cluster has GPUs, else 0: CPU ranks)")
    start_timeout_s: float = option(60.0, flag="--start-timeout", metavar="SECONDS",
                                    help="fail when the ranks' resources are not granted, or their actors not alive, "
                                         "within this (default 60; each start-up wait has this bound)")
    call_timeout_s: float = option(3600.0, flag="--call-timeout", metavar="SECONDS",
                                   help="fail a step, load or save that some rank has not answered within this "
                                        "(default 3600)")
    collective_timeout_s: float = file_only(300.0)

    def validate(self, layout: ParallelLayout) -> None:
        if self.world_size is not None and self.world_size != layout.world_size:
            raise ConfigError("world_size", self.world_size,
                              f"must equal dp*fsdp*tp*pp = {layout.dp}*{layout.fsdp}*{layout.tp}*{layout.pp} = "
                              f"{layout.world_size}", "change --world-size or the parallel degrees so they agree")
        if self.collective_timeout_s <= 0:
            raise ConfigError("collective_timeout_s", self.collective_timeout_s, "must be positive", "set it to e.g. 300")
        for name in ("cpus_per_rank", "gpus_per_rank"):
            value = getattr(self, name)
            if value is not None and (value < 0 or (value > 0 and value < 1e-4)):
                raise ConfigError(name, value, "must be 0 or at least 0.0001 (Ray's resource grain)",
                                  f"pass --{name.replace('_', '-')} 0.5, or leave it unset for the default")
        if self.cpus_per_rank == 0 and not self.gpus_per_rank:
            raise ConfigError("cpus_per_rank", 0, "a CPU rank needs some CPU", "leave --cpus-per-rank unset, or pass e.g. 0.5")
        for name in ("start_timeout_s", "call_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, getattr(self, name), "must be positive", "set it to e.g. 60")
