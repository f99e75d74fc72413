"""A warm spare takes a dead GPU rank's GPU (decision 225), on a real GPU.

`tests/integration/test_rank_pool.py` checks the hand-over on a Ray that declares GPUs it does
not have; here the spare, which Ray gave no GPU, takes the dead rank's, then initialises CUDA on
it and computes there. One GPU is enough: the rank and its spare never use it at once.

    python -m pytest tests/gpu/test_gpu_spare.py -q
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUNDLE = {"CPU": 1, "GPU": 1}


def _on_the_gpu(self) -> tuple:
    """Run on the actor: where it computes, and what."""
    ones = torch.ones(1024, device="cuda")
    return torch.cuda.get_device_name(0), float(ones.sum().item()), os.environ.get("CUDA_VISIBLE_DEVICES")


def _scenario(fake_gpu: bool = False) -> None:
    """fake_gpu: on a machine without one, a Ray declaring one (checks the flow, not CUDA)."""
    import ray

    from rayshard.cluster.run.rank_pool import RankPool

    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False,
             **({"num_gpus": 1} if fake_gpu else {}))
    lines = []
    pool = RankPool(start_timeout_s=180, log=lines.append)
    try:
        [rank] = pool.actors_for(1, BUNDLE)
        if not fake_gpu:
            ray.get(rank.__ray_call__.remote(_on_the_gpu), timeout=120)  # the rank holds a CUDA context
        pool.start_spares()
        [spare] = pool.spares.values()
        assert ray.get(spare.__ray_call__.remote(lambda self: (ray.get_gpu_ids(), torch.cuda.is_initialized())),
                       timeout=180) == ([], False)
        victim = ray.get(rank.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
        os.kill(victim, signal.SIGKILL)
        pool.condemn([0])
        [taken] = pool.actors_for(1, BUNDLE)
        assert taken._actor_id == spare._actor_id and "rank(s) [0] from a warm spare" in lines[-1], lines
        assert ray.get(taken.__ray_call__.remote(lambda self: self.device_kind()), timeout=60) == "cuda"
        if not fake_gpu:
            name, total, visible = ray.get(taken.__ray_call__.remote(_on_the_gpu), timeout=120)
            assert total == 1024.0 and visible == pool.devices[0], (name, total, visible)
            print(f"spare computed on {name} (CUDA_VISIBLE_DEVICES={visible}) after the rank it replaced was killed")
    finally:
        pool.release()
        ray.shutdown()


def test_a_spare_takes_a_dead_gpu_ranks_gpu_and_computes_there():
    done = subprocess.run([sys.executable, "-c", "from tests.gpu.test_gpu_spare import _scenario; _scenario()"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    print(done.stdout.strip().splitlines()[-1])
