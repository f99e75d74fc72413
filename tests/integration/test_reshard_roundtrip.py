"""The round-trip matrix: A -> B -> A reproduces A bit for bit, and A -> B keeps A's digests.

Default run: one trained source (dp2 x tp2, 2 steps) resharded offline to every layout and back,
a Ray-actor reshard, and a few load-and-save pairs through real training actors. The full 8 x 8
matrices (offline and through training actors) are marked slow:

    .venv/bin/python -m pytest -m slow tests/integration/test_reshard_roundtrip.py
"""
import io
import itertools
from dataclasses import replace

import pytest
from tqdm import tqdm

from rayshard.cluster.checkpoint.offline_reshard import planned_writes, reshard_checkpoint
from rayshard.cluster.checkpoint.reshard_report import build_plan
from rayshard.cluster.catalog.store import Store
from rayshard.storage.manifest_io import read_manifest
from rayshard.plans.config import ModelChoice
from rayshard.plans.layout.parallel_layout import ParallelLayout
from tests.conftest import small_config
from tests.integration.reshard_helpers import (LAYOUTS, PP_LAYOUTS, chunk_fingerprint, digests, load_and_save,
                                               writer_rank)

SOURCE = ParallelLayout(dp=2, tp=2)
MATRIX = dict(LAYOUTS, **PP_LAYOUTS)


@pytest.fixture(scope="module")
def source(run_training, tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    result = run_training(small_config(root, SOURCE, steps=2, run="src"))
    url = result.checkpoints[-1]
    return Store(str(root / "store")), url, digests(url)


def _training_config(tmp_path, layout, run):
    # 24 sequences split evenly over 1, 2, 3, 4, 6 or 8 data ranks; no step is taken anyway.
    return small_config(tmp_path, layout, run=run, global_batch=24,
                        schedule="interleaved1f1b" if layout.vpp > 1 else "1f1b")


def _assert_written_as_predicted(url, layout):
    """What the ranks wrote is what the offline planner predicts (two callers of one rule, which
    tests/unit/test_writer_selection.py checks against hand-worked cases), and no region twice."""
    chunks, metadata = read_manifest(url)
    regions = [(c.name, c.kind, c.offsets) for c in chunks]
    assert len(regions) == len(set(regions))
    actual = {(c.name, c.kind, c.offsets, c.sizes, writer_rank(c.file)) for c in chunks}
    predicted = {(p.region.name, p.kind, p.region.offsets, p.region.sizes, rank)
                 for rank, pieces in enumerate(planned_writes(chunks, metadata, layout)) for p in pieces}
    assert actual == predicted


def _reshard(store, url, layout, run, **kwargs):
    return reshard_checkpoint(url, layout, store, run, local=kwargs.pop("local", True), log=lambda *_: None, **kwargs).url


def test_a_training_save_writes_exactly_the_predicted_pieces(source):
    """The offline reshard writes what training would: same regions, same writer per piece."""
    _, url, _ = source
    _assert_written_as_predicted(url, SOURCE)
    chunks, _ = read_manifest(url)
    # Replicas share the writing: both dp replicas write (replica 0 alone would write everything).
    writers = {writer_rank(c.file) for c in chunks}
    assert writers == {0, 1, 2, 3}


@pytest.mark.parametrize("name", list(MATRIX))
def test_reshard_there_and_back_is_bit_exact(source, name, tmp_path):
    store, url, source_digests = source
    there = _reshard(store, url, MATRIX[name], f"to-{name}")
    assert digests(there) == source_digests
    back = _reshard(store, there, SOURCE, f"back-{name}")
    assert chunk_fingerprint(back) == chunk_fingerprint(url)
    assert read_manifest(there)[1]["layout"] == MATRIX[name].to_dict()


def test_reshard_on_ray_actors(source, ray_session):
    store, url, source_digests = source
    # num_cpus=0: the session's rank pool holds every logical CPU; the workers only do I/O here.
    shown = io.StringIO()
    with tqdm(desc="reshard", file=shown, unit="B") as bar:  # driven by the driver as each rank's future completes
        result = reshard_checkpoint(url, ParallelLayout(fsdp=3, tp=2), store, "ray-fsdp3-tp2", workers=2, num_cpus=0,
                                    log=lambda *_: None, progress=bar)
    assert result.workers == 2 and result.ranks == 6  # each actor plays three target ranks
    assert bar.n == bar.total == result.bytes_written and "reshard: 100%" in shown.getvalue()
    # Every stored byte is read once (a piece copied on several target ranks is read by the one
    # that writes it), and requests are coalesced across pieces as a load's are (a window of
    # pieces per plan, not a plan per piece): at most what `ckpt plan` prints for a training load
    # onto the layout, whose tp ranks each read their own copy of the norms.
    chunks, metadata = read_manifest(url)
    plan, _ = build_plan(chunks, metadata, ParallelLayout(fsdp=3, tp=2))
    assert result.bytes_written == sum(c.byte_end - c.byte_start for c in chunks)
    assert result.bytes_written <= result.bytes_read <= plan.bytes_read
    assert result.requests <= plan.requests
    assert digests(result.url) == source_digests


@pytest.mark.parametrize("name", ["fsdp3_tp2", "dp2_fsdp2_tp2", "pp2_tp2", "pp2_vpp2"])
def test_load_and_save_in_training_actors_round_trips(source, rank_pool, tmp_path, name):
    store, url, source_digests = source
    there = load_and_save(_training_config(tmp_path, MATRIX[name], f"train-{name}"), url, rank_pool)
    assert digests(there) == source_digests
    _assert_written_as_predicted(there, MATRIX[name])  # what `ckpt reshard` writes is what training writes
    back = load_and_save(_training_config(tmp_path, SOURCE, f"train-back-{name}"), there, rank_pool)
    assert chunk_fingerprint(back) == chunk_fingerprint(url)


def test_on_an_object_store_dp_replicas_read_each_piece_once(rank_pool, s3_store, tmp_path):
    """Through S3 (moto): a dp2 x tp2 load reads the checkpoint once in all (each replica its
    share, then a broadcast), and the state it holds is bit for bit the one saved."""
    config = _training_config(tmp_path, SOURCE, "s3-src")
    from rayshard.cluster.run.train import train

    url = train(replace(config, store=s3_store, steps=1), rank_pool).checkpoints[-1]
    loaded = []
    again = load_and_save(replace(config, store=s3_store, run="s3-again"), url, rank_pool, loaded)
    chunks, _ = read_manifest(url)
    assert sum(r["bytes_read"] for r in loaded) <= 1.01 * sum(c.byte_end - c.byte_start for c in chunks)
    assert chunk_fingerprint(again) == chunk_fingerprint(url)


def _failed_load(config, url, rank_pool) -> dict[int, str]:
    """Load `url` into fresh ranks of `config`, expecting failure; every rank's error (none silent)."""
    from rayshard.cluster.run.rank_group import RankGroup, StepFailed

    group = RankGroup(config, rank_pool)
    try:
        group.call("configure_storage", Store(config.store).storage_conf)
        with pytest.raises(StepFailed) as failed:
            group.call_reporting_failures("load", url)
    finally:
        group.shutdown()
    assert failed.value.silent == []
    return failed.value.failures


def test_a_replica_that_cannot_read_its_share_fails_the_load_on_every_rank(rank_pool, s3_store, tmp_path):
    """Read-once on S3 with one chunk corrupted: the replica that reads it names the tensor and the
    file, every other rank (its dp peer would have received that piece; replica groups of norm
    weights span dp and tp) is told the load failed, and nobody waits on a broadcast that never
    comes (every rank answers)."""
    import fsspec

    from rayshard.cluster.run.train import train

    config = _training_config(tmp_path, SOURCE, "s3-corrupt-src")
    url = train(replace(config, store=s3_store, steps=1), rank_pool).checkpoints[-1]
    chunks, _ = read_manifest(url)
    victim = max((c for c in chunks if c.file.endswith("rank-00000.safetensors")), key=lambda c: c.byte_end - c.byte_start)
    fs, base = fsspec.core.url_to_fs(url)
    data = bytearray(fs.cat_file(f"{base}/{victim.file}"))
    data[(victim.byte_start + victim.byte_end) // 2] ^= 0xFF
    fs.pipe_file(f"{base}/{victim.file}", bytes(data))

    errors = _failed_load(replace(config, store=s3_store, run="s3-corrupt-load"), url, rank_pool)
    named = [rank for rank, message in errors.items() if "checksum mismatch" in message]
    assert len(named) == 1 and victim.name in errors[named[0]] and victim.file in errors[named[0]]
    others = [rank for rank in range(4) if rank != named[0]]
    assert all("a replica of this rank could not load" in errors[rank] for rank in others), errors


def test_a_stage_whose_model_does_not_match_fails_the_load_on_every_rank(rank_pool, s3_store, tmp_path):
    """Read-once on S3 into dp2 x pp2 with two more layers than the checkpoint holds: only the last
    stage's keys are missing, so only its ranks can tell before reading. They name the missing
    keys; the first stage's ranks are told the load failed instead of starting broadcasts or
    waiting in a collective the others never join (every rank answers)."""
    from rayshard.cluster.run.train import train

    config = _training_config(tmp_path, SOURCE, "s3-short-src")
    url = train(replace(config, store=s3_store, steps=1), rank_pool).checkpoints[-1]
    deeper = replace(config.model.spec, n_layers=config.model.spec.n_layers + 2)
    target = replace(_training_config(tmp_path, ParallelLayout(dp=2, pp=2), "s3-deeper"), model=ModelChoice(spec=deeper),
                     store=s3_store)
    errors = _failed_load(target.validate(), url, rank_pool)
    last_stage = [rank for rank in range(4) if ParallelLayout(dp=2, pp=2).coords_of(rank).pp == 1]
    assert all("missing" in errors[rank] and f"layers.{deeper.n_layers - 1}." in errors[rank] for rank in last_stage), errors
    assert all("a replica of this rank could not load (before reading" in errors[rank]
               for rank in range(4) if rank not in last_stage), errors


_resharded: dict = {}


@pytest.mark.slow
@pytest.mark.parametrize("a,b", list(itertools.product(MATRIX, MATRIX)))
def test_full_matrix_offline(source, a, b):
    store, url, source_digests = source
    if a not in _resharded:
        _resharded[a] = _reshard(store, url, MATRIX[a], f"m-{a}")
    start = _resharded[a]
    there = _reshard(store, start, MATRIX[b], f"m-{a}-{b}-b")
    assert digests(there) == source_digests
    back = _reshard(store, there, MATRIX[a], f"m-{a}-{b}-back")
    assert chunk_fingerprint(back) == chunk_fingerprint(start)


# Through training actors: 8 layouts on 1, 2, 4, 6 and 8 ranks covering dp, fsdp, tp, pp, vpp and mixes.
TRAINING_MATRIX = ["single", "dp2", "tp2", "pp2_vpp2", "pp2_tp2", "fsdp3_tp2", "dp2_fsdp2_tp2", "dp2_pp2_tp2"]
_saved_by_training: dict = {}


def _trained_copy(url, name, rank_pool, tmp_path_factory):
    """The source loaded and saved by training actors of layout `name` (once per session)."""
    if name not in _saved_by_training:
        root = tmp_path_factory.mktemp(f"train-{name}")
        _saved_by_training[name] = load_and_save(_training_config(root, MATRIX[name], "a"), url, rank_pool)
    return _saved_by_training[name]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("a,b", list(itertools.product(TRAINING_MATRIX, TRAINING_MATRIX)))
def test_full_matrix_through_training_actors(source, rank_pool, tmp_path, tmp_path_factory, a, b):
    _, url, source_digests = source
    start = _trained_copy(url, a, rank_pool, tmp_path_factory)
    there = load_and_save(_training_config(tmp_path, MATRIX[b], "b"), start, rank_pool)
    assert digests(there) == source_digests
    back = load_and_save(_training_config(tmp_path, MATRIX[a], "back"), there, rank_pool)
    assert chunk_fingerprint(back) == chunk_fingerprint(start)


@pytest.fixture(scope="module")
def tied_source(run_training, tmp_path_factory):
    from rayshard.plans.training.model_spec import preset

    root = tmp_path_factory.mktemp("tied")
    tied = preset("tiny", tie_embeddings=True)
    return tied, run_training(small_config(root, ParallelLayout(tp=2), steps=1, run="tied",
                                           model=ModelChoice(spec=tied))).checkpoints[-1]


@pytest.mark.parametrize("layout,schedule", [(ParallelLayout(pp=2), "1f1b"), (ParallelLayout(pp=2, vpp=2), "zbv")],
                         ids=["pp2-1f1b", "pp2-zbv"])
def test_tied_embeddings_through_pipeline_layouts(tied_source, rank_pool, tmp_path, layout, schedule):
    """The last stage's copy of a tied embedding is never written (the first stage's is), and a
    load fills it too — also with the V placement, where rank 0 holds both."""
    tied, url = tied_source
    config = small_config(tmp_path, layout, run=f"tied-{schedule}", model=ModelChoice(spec=tied), global_batch=24,
                          schedule=schedule,
                          microbatches=2)
    there = load_and_save(config, url, rank_pool)
    assert digests(there) == digests(url)
    chunks, _ = read_manifest(there)
    assert sum(1 for c in chunks if c.name == "tok_embeddings.weight" and c.kind == "param") == 1


def test_training_continues_from_an_imported_hugging_face_export(source, run_training, tmp_path):
    """export -> import restores the training state: resuming from the import takes the same
    next step as resuming from the original checkpoint."""
    from rayshard.cluster.checkpoint.hf_interop import export_hf, import_hf

    store, url, source_digests = source
    export_hf(url, str(tmp_path / "hf"), log=lambda *_: None)
    imported = import_hf(str(tmp_path / "hf"), store, "imported", log=lambda *_: None)
    assert digests(imported) == source_digests
    from_original = run_training(small_config(tmp_path, SOURCE, steps=3, run="cont-a", resume=url))
    from_import = run_training(small_config(tmp_path, SOURCE, steps=3, run="cont-b", resume=imported))
    assert from_import.start_step == 2 and from_import.losses[3] == from_original.losses[3]
