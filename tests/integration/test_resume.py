"""Checkpoints through Ray actors: bit-exact same-layout resume, resume onto another layout,
and a mismatched model listed key by key."""
import json

import pytest

from rayshard.cluster.run.rank_group import RankGroup
from rayshard.cluster.run.resume_check import resume_checks, verify_resumed_state
from rayshard.cluster.catalog.store import Store
from rayshard.plans.config import ModelChoice
from rayshard.plans.errors import CheckpointError
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.training.model_spec import preset
from tests.conftest import small_config

DP2_TP2 = ParallelLayout(dp=2, tp=2)


def _config(tmp_path, layout, **overrides):
    # The lr schedule's length is fixed (it defaults to --steps), so runs that stop early and
    # are resumed follow the same schedule as the uninterrupted run they are compared with.
    from rayshard.plans.config import OptimizerConfig

    optimizer = OptimizerConfig(lr=3e-3, min_lr=3e-4, warmup_steps=3, decay_steps=8)
    return small_config(tmp_path, layout, optimizer=optimizer, **overrides)


@pytest.fixture(scope="module")
def uninterrupted(run_training, tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    return run_training(_config(root, DP2_TP2, steps=8, run="full"))


def test_resume_latest_is_bit_exact(run_training, tmp_path, uninterrupted):
    first = run_training(_config(tmp_path, DP2_TP2, steps=4, run="r"))
    assert first.checkpoints[-1].endswith("step-00000004")
    resumed = run_training(_config(tmp_path, DP2_TP2, steps=8, run="r", resume="latest"))
    assert resumed.start_step == 4
    for step in range(5, 9):
        assert resumed.losses[step] == uninterrupted.losses[step], step  # bit for bit
    # The run's metrics file tells one timeline: steps 1..8, each once.
    lines = (tmp_path / "store" / "r" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 9))


def test_resume_onto_another_layout_continues_the_same_training(run_training, tmp_path, uninterrupted):
    run_training(_config(tmp_path, DP2_TP2, steps=4, run="x", ckpt_every=2))
    store = Store(str(tmp_path / "store"))
    assert store.committed_steps("x") == [2, 4] and store.latest_step("x") == 4
    resumed = run_training(_config(tmp_path, ParallelLayout(fsdp=2), steps=6, run="x", resume="x@4",
                                   verify_resume=True))
    for step in (5, 6):
        assert resumed.losses[step] == pytest.approx(uninterrupted.losses[step], rel=1e-5)
    # What the fsdp2 ranks held after the resharding load has the digests of the dp2 x tp2 checkpoint.
    [check] = resume_checks(store, "x")
    assert check["equal"] and check["step"] == 4 and check["checkpoint"].endswith("step-00000004")
    assert check["tensors"] > 20 and not list((tmp_path / "store" / "x" / "resume-checks").glob("*/*"))


def test_resume_check_names_the_tensors_that_differ(rank_pool, run_training, tmp_path):
    run_training(_config(tmp_path, ParallelLayout(), steps=4, run="v", ckpt_every=2))  # one rank: any layout writes alike
    store = Store(str(tmp_path / "store"))
    group = RankGroup(_config(tmp_path, ParallelLayout(tp=2), steps=6, run="v"), rank_pool)
    try:
        group.call("configure_storage", store.storage_conf)
        group.call("load", store.checkpoint_url("v", 4))
        # Held: step 4. Compared with: step 2. Every trained tensor and the step counters differ.
        with pytest.raises(CheckpointError, match=r"differs from the checkpoint in \d+ tensors: ") as error:
            verify_resumed_state(group, store, "v", 4, store.checkpoint_url("v", 2), "tp2")
    finally:
        group.shutdown()
    assert "exp_avg layers.0.attention.qkv.weight" in str(error.value)
    assert resume_checks(store, "v")[-1]["equal"] is False


def test_mismatched_model_lists_missing_unexpected_and_shape_errors_together(run_training, tmp_path):
    run_training(small_config(tmp_path, ParallelLayout(), steps=1, run="m"))
    # A fifth layer the checkpoint lacks, no output.weight (tied), other ffn shapes: all three kinds
    # of problem, in one error.
    other = preset("tiny", tie_embeddings=True, ffn_dim=96, n_layers=5)
    with pytest.raises(CheckpointError, match="does not match the model") as error:
        run_training(small_config(tmp_path, ParallelLayout(), steps=2, run="m", model=ModelChoice(spec=other),
                                  resume="latest"))
    message = str(error.value)
    assert "missing keys (18)" in message and "layers.4.attention.qkv.weight (param)" in message
    assert "unexpected keys" in message and "output.weight (param)" in message
    assert "shape/dtype mismatches" in message and "feed_forward.gate_up.weight" in message


def test_unknown_checkpoint_addresses_are_clear(run_training, tmp_path):
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        run_training(small_config(tmp_path, ParallelLayout(), run="nothing", resume="latest"))
    run_training(small_config(tmp_path, ParallelLayout(), steps=1, run="one"))
    with pytest.raises(CheckpointError, match=r"Committed steps: \[1\]"):
        run_training(small_config(tmp_path, ParallelLayout(), steps=3, run="one", resume="one@2"))


def test_resume_auto_starts_fresh_then_continues_the_same_run_name(run_training, tmp_path):
    first = run_training(small_config(tmp_path, ParallelLayout(), steps=2, run="auto", resume="auto"))
    assert first.start_step == 0 and first.resumed_from is None
    second = run_training(small_config(tmp_path, ParallelLayout(dp=2), steps=3, run="auto", resume="auto"))
    assert second.start_step == 2 and second.resumed_from.endswith("step-00000002")


def test_an_edit_inside_a_chunk_the_new_layout_reads_in_parts_stops_the_resume(run_training, tmp_path):
    """dp2 x tp2 stores wo as two column halves; fsdp2 reads each half's top rows on one rank and
    bottom rows on the other, so no rank sees a whole chunk. An edit in place (same size, same
    header) must still stop the resume before any step trains on it."""
    from rayshard.storage.manifest_io import read_manifest

    url = run_training(_config(tmp_path, DP2_TP2, steps=2, run="e")).checkpoints[-1]
    chunks, _ = read_manifest(url)
    wo = next(c for c in chunks if c.name == "layers.1.attention.wo.weight" and c.kind == "exp_avg" and c.offsets == (0, 0))
    path = f"{url}/{wo.file}"
    with open(path, "r+b") as handle:
        handle.seek(wo.byte_end - 9)
        byte = handle.read(1)
        handle.seek(wo.byte_end - 9)
        handle.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CheckpointError, match=rf"checksum mismatch in 1 chunk\(s\) read in parts .*{wo.file}: "
                                              r"layers\.1\.attention\.wo\.weight \(exp_avg\)"):
        run_training(_config(tmp_path, ParallelLayout(fsdp=2), steps=4, run="e", resume="latest"))
    assert Store(str(tmp_path / "store")).committed_steps("e") == [2]
