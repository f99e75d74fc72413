"""Shared by the reshard tests: the layout matrix, fingerprints, and load-and-save in training actors."""
from __future__ import annotations

import re

from rayshard.storage.manifest_io import read_manifest
from rayshard.cluster.checkpoint.digest import digest_checkpoint
from rayshard.plans.layout.parallel_layout import ParallelLayout

# At least 8 layouts on 1..8 ranks, data/tensor-parallel (LAYOUTS) and pipelines (PP_LAYOUTS).
LAYOUTS = {
    "single": ParallelLayout(),
    "dp2": ParallelLayout(dp=2),
    "tp2": ParallelLayout(tp=2),
    "fsdp2": ParallelLayout(fsdp=2),
    "dp2_tp2": ParallelLayout(dp=2, tp=2),
    "fsdp3_tp2": ParallelLayout(fsdp=3, tp=2),  # uneven FSDP shards (64 rows over 3)
    "fsdp6": ParallelLayout(fsdp=6),
    "dp2_fsdp2_tp2": ParallelLayout(dp=2, fsdp=2, tp=2),
    "fsdp8": ParallelLayout(fsdp=8),
}
PP_LAYOUTS = {
    "pp2": ParallelLayout(pp=2),
    "pp2_tp2": ParallelLayout(pp=2, tp=2),
    "pp2_vpp2": ParallelLayout(pp=2, vpp=2),
    "dp2_pp2_tp2": ParallelLayout(dp=2, pp=2, tp=2),
    "pp4": ParallelLayout(pp=4),
}


def digests(url: str) -> dict:
    return {(d.name, d.kind): (d.dtype, d.shape, d.sha256) for d in digest_checkpoint(url)}


def chunk_fingerprint(url: str) -> set:
    """Every chunk's tensor, region, writing rank and CRC32: equal sets mean the same bytes,
    cut the same way, written by the same ranks."""
    chunks, _ = read_manifest(url)
    return {(c.name, c.kind, c.offsets, c.sizes, writer_rank(c.file), c.checksum) for c in chunks}


def writer_rank(file: str) -> int:
    return int(re.search(r"rank-(\d+)", file).group(1))


def load_and_save(config, source_url: str, actors, loaded: list | None = None) -> str:
    """Load a checkpoint into training actors of config.layout and save it again, no step taken.
    `loaded` (a list) receives each rank's load result."""
    from rayshard.actors.checkpoint.stored import check_loaded_parts
    from rayshard.cluster.run.rank_group import RankGroup
    from rayshard.cluster.catalog.store import Store
    from rayshard.cluster.run.train import save_checkpoint

    store = Store(config.store)
    group = RankGroup(config, actors)
    try:
        if hasattr(actors[0], "configure_storage"):
            group.call("configure_storage", store.storage_conf)
        results = group.call("load", source_url)
        check_loaded_parts(source_url, results)  # as the training driver does after a load
        if loaded is not None:
            loaded.extend(results)
        step = results[0]["step"]
        return save_checkpoint(group, store, config, step, source_url, group.setup_info[0].data_fingerprint)
    finally:
        group.shutdown()


def resume_continuity(run_training, tmp_path, config, a, b, before: int, after: int, tolerance: float,
                      tight_steps: int | None = None, ceiling: float | None = None):
    """Train `before` steps on layout `a`, resume on `b` to `before + after`, against an
    uninterrupted run on `a`: every resumed step's loss within `tolerance` (relative), and the
    continuity picture drawn. config(layout, steps, total, run, **overrides) makes each run's
    config (the lr schedule's length is the whole run's in all of them). Returns (picture summary,
    the uninterrupted run, the resumed run).

    tight_steps: only the first `tight_steps` resumed steps are held to `tolerance`. The later ones,
    where float rounding has grown as it does under any change of layout (docs/decisions.md 85),
    are held to `ceiling` and to no further from the uninterrupted run than a run on `b` from
    step 0 is (trained here too)."""
    from rayshard.cluster.pictures.resume_plot import plot_resume
    from rayshard.cluster.catalog.store import Store

    total = before + after
    full = run_training(config(a, total, total, "uninterrupted"))
    run_training(config(a, before, total, "resumed"))
    resumed = run_training(config(b, total, total, "resumed", resume="latest"))
    assert resumed.start_step == before
    relative = lambda run, step: abs(run.losses[step] - full.losses[step]) / abs(full.losses[step])
    for step in range(before + 1, before + (after if tight_steps is None else tight_steps) + 1):
        assert relative(resumed, step) <= tolerance, (step, resumed.losses[step], full.losses[step])
    picture = plot_resume(Store(str(tmp_path / "store")), ["resumed"], str(tmp_path / "resume.png"), reference="uninterrupted")
    assert picture["steps_compared"] == total
    if tight_steps is None:
        assert picture["max_relative_difference"] <= tolerance
    else:
        on_b = run_training(config(b, total, total, "on-b-from-the-start"))
        later = range(before + tight_steps + 1, total + 1)
        drift, layout_drift = (max(relative(run, step) for step in later) for run in (resumed, on_b))
        print(f"max relative difference after the first {tight_steps} resumed steps: {drift:.2e} "
              f"(ceiling {ceiling:.0e}); a run on the target layout from step 0: {layout_drift:.2e}")
        assert drift <= ceiling and drift <= max(tolerance, layout_drift), (drift, ceiling, layout_drift)
    assert len(picture["segments"]) == 2  # layout A, then layout B, in their own colours
    assert (tmp_path / "resume.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return picture, full, resumed
