"""Pipeline checkpoints are layout-free: tied embeddings are written once, under their own name,
and a run saved by one pipeline resumes on another layout on the same loss curve."""
import math

from rayshard.storage.manifest_io import read_manifest
from rayshard.plans.config import ModelChoice, OptimizerConfig
from rayshard.plans.layout.parallel_layout import ParallelLayout
from tests.conftest import small_config


def _config(tmp_path, layout, **overrides):
    # A fixed lr schedule length, so the resumed run follows the uninterrupted run's schedule.
    values = dict(model=ModelChoice.named("tiny", tie_embeddings=True), microbatches=4,
                  optimizer=OptimizerConfig(lr=3e-3, min_lr=3e-4, warmup_steps=3, decay_steps=6))
    values.update(overrides)
    return small_config(tmp_path, layout, **values)


def test_tied_pipeline_checkpoint_resumes_on_another_layout(run_training, tmp_path):
    single = run_training(_config(tmp_path / "single", ParallelLayout(), steps=6, run="single")).losses
    # ZB-V places the first and the last stage, the two holders of the tie, on the same rank.
    saved = run_training(_config(tmp_path / "pipe", ParallelLayout(pp=2, vpp=2), schedule="zbv", steps=3, run="r"))
    chunks, metadata = read_manifest(saved.checkpoints[-1])
    names = {chunk.name for chunk in chunks}
    assert "tok_embeddings.weight" in names and "output.weight" not in names
    embedding = [chunk for chunk in chunks if chunk.name == "tok_embeddings.weight"]
    assert len(embedding) == len({(chunk.kind, tuple(chunk.offsets)) for chunk in embedding})  # each piece once
    resumed = run_training(_config(tmp_path / "pipe", ParallelLayout(pp=2, tp=2), schedule="1f1b", steps=6, run="r",
                                   resume="latest"))
    assert resumed.start_step == 3
    losses = {**saved.losses, **resumed.losses}
    for step, loss in single.items():
        assert math.isclose(losses[step], loss, rel_tol=1e-5), (step, losses[step], loss)
