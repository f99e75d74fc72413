"""What each rank asks the cluster for, and what to say when the cluster cannot give it.

Pure arithmetic over resource dictionaries (as `ray.cluster_resources()` returns them), so every
rank count x CPU count is a unit test. Ray keeps resource quantities in fixed point with four
decimals; shares are floored to that grain, so `ranks` equal shares never add up to more than
the cluster holds (rounding 2/3 to 0.67 once asked for 2.01 CPUs of 2 and waited forever).
"""
from __future__ import annotations

from rayshard.plans.errors import ConfigError

GRAIN = 10_000  # Ray's resource unit: 1/10000 of a CPU or GPU
MAX_CPUS_PER_RANK = 1.0  # a rank runs torch with one thread; more CPUs would idle


def equal_cpu_share(cpus: float, ranks: int) -> float:
    """The largest share of `cpus`, at most one CPU and a whole number of Ray's grains, that
    `ranks` ranks can all hold at once (0 when even one grain each does not fit)."""
    if ranks < 1:
        raise ConfigError("ranks", ranks, "need at least one rank", "use a layout with one rank or more")
    grains = round(cpus * GRAIN) // ranks  # integer arithmetic: no float sum can creep over
    return min(MAX_CPUS_PER_RANK, grains / GRAIN)


def rank_bundle(cluster: dict[str, float], ranks: int, cpus_per_rank: float | None = None,
                gpus_per_rank: float | None = None) -> dict[str, float]:
    """One rank's placement-group bundle. Defaults: one GPU per rank where the cluster has GPUs
    (CPU ranks with gloo where it has none), and an equal share of the CPUs."""
    gpus = gpus_per_rank if gpus_per_rank is not None else (1.0 if cluster.get("GPU", 0) >= 1 else 0.0)
    cpus = cpus_per_rank if cpus_per_rank is not None else equal_cpu_share(cluster.get("CPU", 0), ranks)
    if cpus <= 0 and not gpus:  # too many ranks for even one grain each: ask for one grain, fail bounded
        cpus = 1 / GRAIN
    bundle = {"CPU": _grain(cpus)} if cpus > 0 else {}
    if gpus:
        bundle["GPU"] = _grain(gpus)
    return bundle


def _grain(amount: float) -> float:
    return max(1, round(amount * GRAIN)) / GRAIN


def ranks_offered(cluster: dict[str, float], bundle: dict[str, float]) -> tuple[int, str]:
    """How many ranks of `bundle` the cluster's total resources hold, and why, e.g.
    (2, "2 CPUs / 1 CPU per rank")."""
    counts = {kind: int(round(cluster.get(kind, 0) * GRAIN) // round(amount * GRAIN))
              for kind, amount in bundle.items() if amount > 0}
    if not counts:
        return 0, "the bundle asks for nothing"
    kind = min(counts, key=counts.get)
    return counts[kind], f"{cluster.get(kind, 0):g} {kind}s / {bundle[kind]:g} {kind} per rank"


def describe_resources(bundle: dict[str, float]) -> str:
    return ", ".join(f"{amount:g} {kind}" for kind, amount in sorted(bundle.items()))


def placement_failure(ranks: int, bundle: dict[str, float], free: dict[str, float], total: dict[str, float],
                      waited_s: float) -> str:
    """One line: what the job asked for, what the cluster has (free and total per resource), a fix."""
    have = "; ".join(f"{kind} {free.get(kind, 0):g} free of {total.get(kind, 0):g}" for kind in sorted(bundle))
    offered, why = ranks_offered(total, bundle)
    if offered >= ranks:
        fix = ("wait for the other jobs holding them to finish (`ray status`), lower --cpus-per-rank, "
               "or raise --start-timeout")
    else:
        fix = _fix_for(ranks, bundle, total)
    return (f"{ranks} ranks x {{{describe_resources(bundle)}}} were not granted within {waited_s:g} s; the cluster has "
            f"{have} (room for {offered} such ranks: {why}). Fix: {fix}")


def _fix_for(ranks: int, bundle: dict[str, float], total: dict[str, float]) -> str:
    fixes = []
    if bundle.get("GPU", 0) > 0 and total.get("GPU", 0) < ranks * bundle["GPU"]:
        fixes.append("add GPU nodes, use fewer ranks" + ("" if total.get("GPU", 0) else ", or --gpus-per-rank 0 for CPU ranks"))
    if bundle.get("CPU", 0) > 0 and total.get("CPU", 0) < ranks * bundle["CPU"]:
        share = equal_cpu_share(total.get("CPU", 0), ranks)
        fixes.append(f"pass --cpus-per-rank {share:g} (or leave it unset for an equal share)" if share > 0
                     else "use fewer ranks or add CPU nodes")
    return "; ".join(fixes) or "use fewer ranks or add nodes"


def not_ready_failure(not_ready: list[int], ranks: int, waited_s: float) -> str:
    return (f"rank actor(s) {not_ready} of {ranks} did not start within {waited_s:g} s although their resources "
            "were granted. Fix: check `ray status` and the actors' logs (a worker that cannot import torch or "
            "build its runtime_env never starts), or raise --start-timeout on a slow or loaded cluster")
