"""Shared fixtures: one local Ray instance per test session, small configs."""
from __future__ import annotations

pytest_plugins = ["tests.s3_fixtures", "tests.azure_fixtures"]  # moto S3 and Azurite servers, fault proxies, per-test buckets

import os

import pytest

from rayshard.plans.config import (CheckpointConfig, DataConfig, ModelChoice, NumericsConfig, OptimizerConfig,
                                   PipelineConfig, TrainConfig)
from rayshard.plans.layout.parallel_layout import ParallelLayout

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Ray waits 30 s for a new GCS to publish its port; the first start of a fresh clone's .venv, on a
# CI machine other jobs load, once took longer ("Timed out waiting for file .../gcs_server_port_*",
# the first e2e test's own cluster). 120 s is Ray's own wait for its slower RocksDB backend; the
# scenarios' subprocesses and `ray start` inherit it. (It is also Ray's count of retries when a
# driver joins a cluster, so a dead RAY_ADDRESS would take two minutes to fail: no test uses one.)
os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")


@pytest.fixture(scope="session")
def ray_session():
    """Started once; logical CPUs let 8 ranks share 2 real cores with fractional bundles."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=8, num_gpus=0, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def rank_pool(ray_session):
    """Eight live RankActors shared by the session: each training run borrows the first N, so
    tests pay the process start and torch import once instead of once per run."""
    from rayshard.cluster.run.rank_group import start_actors

    placement, actors = start_actors(8, start_timeout_s=600)  # eight torch imports on a loaded 2-core machine
    yield actors
    for actor in actors:
        ray_session.kill(actor)
    ray_session.util.remove_placement_group(placement)


@pytest.fixture(scope="session")
def run_training(rank_pool):
    """train(config) on the shared actor pool."""
    from rayshard.cluster.run.train import train

    return lambda config: train(config, rank_pool)


def small_config(tmp_path, layout=None, *, schedule="1f1b", microbatches=1, stage_layout=None, schedule_csv=None,
                 pipeline_timeout_s=None, precision="fp32", ac="none", compile=False, sequence_parallel=False,
                 ckpt_every=0, resume=None, verify_resume=False, async_save=False, **overrides) -> TrainConfig:
    """The tiny model on a small corpus slice: fast enough for many runs per session. The pipeline,
    numerics and checkpoint settings that tests vary most are keywords here, each put in its section;
    anything else is a TrainConfig field (a section whole, e.g. model=ModelChoice.named("moe-tiny"))."""
    values = dict(
        model=ModelChoice.named("tiny"), layout=layout or ParallelLayout(), steps=10, global_batch=8, seq_len=32,
        seed=7, optimizer=OptimizerConfig(lr=3e-3, min_lr=3e-4, warmup_steps=3),
        data=DataConfig(source="stdlib", max_bytes=1_000_000), store=str(tmp_path / "store"), run="t",
        pipeline=PipelineConfig(schedule=schedule, microbatches=microbatches, stage_layout=stage_layout,
                                schedule_csv=schedule_csv, timeout_s=pipeline_timeout_s),
        numerics=NumericsConfig(precision=precision, ac=ac, compile=compile, sequence_parallel=sequence_parallel),
        checkpoint=CheckpointConfig(every=ckpt_every, resume=resume, verify_resume=verify_resume, async_save=async_save),
    )
    values.update(overrides)
    return TrainConfig(**values).validate()


# The default suite must stay under 15 minutes on 2 cores (docs/decisions.md 113). Training runs
# written once over both object stores (the `object_store` fixture) exercise the same code above
# the backend seam twice; in the default suite they run on S3, and on Azure under -m slow. Azure's
# own conformance (tests/integration/test_storage_backends.py, test_commit_protocol.py, the
# catalog and credential tests), which starts no Ray, stays in the default suite; a test that starts
# none but is long on Azure says so with @pytest.mark.slow_on_azure.
_RUNS_RAY = {"ray_session", "rank_pool", "run_training"}


@pytest.hookimpl(tryfirst=True)  # before `-m 'not slow'` deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        callspec = getattr(item, "callspec", None)
        on_azure = callspec is not None and (callspec.params.get("object_store") == "az"
                                             or callspec.params.get("store") == "az")
        if on_azure and (_RUNS_RAY & set(item.fixturenames) or item.get_closest_marker("slow_on_azure")):
            item.add_marker(pytest.mark.slow)
