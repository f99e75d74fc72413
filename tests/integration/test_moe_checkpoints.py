"""Mixture-of-experts checkpoints are layout-free: every expert is stored under its global index
(dim 0 of the stacked expert tensors) whatever rank held it, so a checkpoint moves between expert-
parallel degrees, with fsdp, tp and pp changing at the same time, bit for bit, AdamW moments
included. A checkpoint that lost or renumbered an expert is refused with the expert named.

The source trains on dp2 x fsdp2(ep2): experts split over the fsdp ranks and copied over dp, so
the dp replicas share the writing of the expert pieces as they do the rest."""
from __future__ import annotations

import dataclasses

import pytest

from rayshard.storage.manifest_io import read_manifest
from rayshard.cluster.checkpoint.offline_reshard import reshard_checkpoint
from rayshard.cluster.checkpoint.verify import verify
from rayshard.cluster.catalog.store import Store
from rayshard.plans.config import ModelChoice
from rayshard.plans.errors import CheckpointError
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.training.model_spec import preset
from tests.conftest import small_config
from tests.integration.reshard_helpers import (chunk_fingerprint, digests, load_and_save, resume_continuity,
                                               writer_rank)

MOE = preset("moe-tiny")
SOURCE = ParallelLayout(dp=2, fsdp=2, ep=2)
GATE_UP = "layers.1.feed_forward.experts.gate_up.weight"

# ep 1, 2, 4 and 8, alone and with dp, fsdp without ep, tp and pp (offline: the planner's regions).
MATRIX = {
    "single": ParallelLayout(),
    "fsdp2": ParallelLayout(fsdp=2),
    "fsdp2(ep2)": ParallelLayout(fsdp=2, ep=2),
    "fsdp4(ep4)": ParallelLayout(fsdp=4, ep=4),
    "fsdp8(ep8)": ParallelLayout(fsdp=8, ep=8),
    "fsdp2(ep2)xtp2": ParallelLayout(fsdp=2, ep=2, tp=2),
    "dp2xtp2": ParallelLayout(dp=2, tp=2),
    "fsdp2(ep2)xpp2": ParallelLayout(fsdp=2, ep=2, pp=2),
    "pp2xtp2": ParallelLayout(pp=2, tp=2),
    "fsdp4(ep4)xtp2": ParallelLayout(fsdp=4, ep=4, tp=2),
}


def _config(tmp_path, layout, run, **overrides):
    run = run.replace("(", "-").replace(")", "")  # run names are letters, digits, '.', '_' and '-'
    values = dict(model=ModelChoice("moe-tiny", MOE), global_batch=8, seq_len=16, run=run)
    values.update(overrides)
    return small_config(tmp_path, layout, **values)


@pytest.fixture(scope="module")
def source(run_training, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-reshard")
    result = run_training(_config(root, SOURCE, "src", steps=2))
    url = result.checkpoints[-1]
    return Store(str(root / "store")), url, digests(url)


def test_the_source_holds_every_expert_once_with_its_moments(source):
    _, url, found = source
    chunks, _ = read_manifest(url)
    expert_chunks = [c for c in chunks if c.name == GATE_UP and c.kind == "param"]
    # Two fsdp ranks, four experts each, each piece written by one of its two dp replicas.
    assert sorted(c.offsets[0] for c in expert_chunks) == [0, 4]
    assert {c.sizes[0] for c in expert_chunks} == {4}
    assert {kind for name, kind in found if name == GATE_UP} == {"param", "exp_avg", "exp_avg_sq"}
    assert len({writer_rank(c.file) for c in chunks if ".experts." in c.name}) == 4  # replicas share the writing


@pytest.mark.parametrize("name", list(MATRIX))
def test_offline_reshard_there_and_back_is_bit_exact(source, name):
    store, url, source_digests = source
    there = reshard_checkpoint(url, MATRIX[name], store, _run(f"to-{name}"), local=True, log=lambda *_: None).url
    assert digests(there) == source_digests
    back = reshard_checkpoint(there, SOURCE, store, _run(f"back-{name}"), local=True, log=lambda *_: None).url
    assert chunk_fingerprint(back) == chunk_fingerprint(url)


@pytest.mark.parametrize("name", ["fsdp4(ep4)", "fsdp2(ep2)xpp2",
                                  pytest.param("fsdp2(ep2)xtp2", marks=pytest.mark.slow),
                                  pytest.param("single", marks=pytest.mark.slow)])
def test_load_and_save_in_training_actors_round_trips(source, rank_pool, tmp_path, name):
    """Through the ranks' own DTensor placements: ep4, ep2 with pp or tp, and no ep at all."""
    _, url, source_digests = source
    there = load_and_save(_config(tmp_path, MATRIX[name], f"train-{name}"), url, rank_pool)
    assert digests(there) == source_digests
    back = load_and_save(_config(tmp_path, SOURCE, f"train-back-{name}"), there, rank_pool)
    assert chunk_fingerprint(back) == chunk_fingerprint(url)


def _run(name: str) -> str:
    return name.replace("(", "-").replace(")", "").replace(" ", "-")


def _damaged_copy(store, url, run, damage):
    """The checkpoint resharded to a fresh run (same layout), then its manifest rewritten by `damage`."""
    from rayshard.plans.checkpoint.manifest.codec import encode_manifest

    copy = reshard_checkpoint(url, SOURCE, store, run, local=True, log=lambda *_: None).url
    chunks, metadata = read_manifest(copy)
    metadata.pop("format_version")
    with open(f"{copy}/manifest.parquet", "wb") as handle:
        handle.write(encode_manifest(damage(list(chunks)), metadata))
    return copy


def _is_upper_experts(chunk) -> bool:
    return chunk.name == GATE_UP and chunk.kind == "param" and chunk.offsets[0] == 4


DAMAGES = {
    # Experts 4-7 of one layer lost (their rank's piece is gone from the manifest).
    "dropped": (lambda chunks: [c for c in chunks if not _is_upper_experts(c)], r"missing or incomplete: expert 4-7"),
    # Experts 4-7 stored as 8-11 (an ep rank's offset added twice): past the model's 8 experts.
    "renumbered": (lambda chunks: [dataclasses.replace(c, offsets=(8, *c.offsets[1:])) if _is_upper_experts(c) else c
                                   for c in chunks], r"beyond the model's 8 experts: expert 8-11"),
    # Experts 4-7 stored as 0-3 (an ep rank's offset never added): two copies of 0-3, none of 4-7.
    "not offset": (lambda chunks: [dataclasses.replace(c, offsets=(0, *c.offsets[1:])) if _is_upper_experts(c) else c
                                   for c in chunks], r"stored twice: expert 0-3"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_lost_or_renumbered_experts_are_named(source, run_training, tmp_path, damage):
    store, url, _ = source
    change, named = DAMAGES[damage]
    damaged = _damaged_copy(store, url, _run(f"damaged-{damage}"), change)
    problems = verify(damaged).problems
    assert any(GATE_UP in problem and _matches(named, problem) for problem in problems), problems
    # The reshard onto fsdp4(ep4) names the experts of the first target region it cannot fill.
    with pytest.raises(CheckpointError, match=rf"{GATE_UP} \(param\).*\(experts (missing or incomplete|stored twice): expert [0-7]"):
        reshard_checkpoint(damaged, ParallelLayout(fsdp=4, ep=4), store, _run(f"from-{damage}"), local=True, log=lambda *_: None)


def _matches(pattern: str, text: str) -> bool:
    import re

    return re.search(pattern, text) is not None


EP2, EP4 = ParallelLayout(fsdp=2, ep=2), ParallelLayout(fsdp=4, ep=4)
# The long version (test_reshard_continuity.py says why it is split): resumed steps held to 1e-5
# with equal tokens per expert, then a ceiling. Seeds 7, 1, 2, 3 on the machine that drifted most:
# routing first differed 28, never, never and 25 resumed steps in; the later steps reached 6.0e-4,
# 2.4e-7, 2.0e-7 and 4.3e-4, against 4.0e-3 to 4.6e-2 for a run on fsdp4(ep4) from step 0.
TIGHT_STEPS = 15
CEILING = 3e-3  # 5x the worst seed


def _continuity(run_training, tmp_path, before, after, tight_steps=None, ceiling=None):
    """`before` steps on fsdp2(ep2), resumed on fsdp4(ep4) for `after` more, against an
    uninterrupted run on fsdp2(ep2); over the steps held to the tolerance, the tokens each expert
    got match too."""
    from rayshard.plans.config import OptimizerConfig

    def config(layout, steps, total, run, **overrides):
        optimizer = OptimizerConfig(lr=3e-3, min_lr=3e-4, warmup_steps=3, decay_steps=total)
        return _config(tmp_path, layout, run, steps=steps, optimizer=optimizer, **overrides)

    picture, full, resumed = resume_continuity(run_training, tmp_path, config, EP2, EP4, before, after, 1e-5,
                                               tight_steps, ceiling)
    for step in range(before + 1, before + (tight_steps or after) + 1):
        assert resumed.expert_tokens[step] == full.expert_tokens[step], step
    return picture


def test_resumed_on_ep4_the_losses_continue(run_training, tmp_path):
    # 4 + 6 steps as test_reshard_continuity's short case (decision 208; it was 10 + 10): a wrong
    # expert placement or moment shows in the first resumed step, and routing is compared each step.
    _continuity(run_training, tmp_path, before=4, after=6)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fifty_steps_on_ep2_resumed_on_ep4(run_training, tmp_path):
    picture = _continuity(run_training, tmp_path, before=50, after=50, tight_steps=TIGHT_STEPS, ceiling=CEILING)
    print(f"max relative difference over 50 resumed steps: {picture['max_relative_difference']:.2e}")
