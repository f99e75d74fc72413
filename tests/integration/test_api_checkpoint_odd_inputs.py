"""`rayshard.checkpoint` with inputs its first tests did not try (found by an adversarial review,
eleventh session): a tensor with no elements, parameters as destinations (a model's own state dict
with `keep_vars=True`, which DCP fills), tensors on the meta device, values only some ranks hold,
and names a save cannot honour (a run called `latest`, a step past eight digits, a committed
checkpoint's directory as the run). Each either works as DCP's would or is refused in one line,
with nothing committed."""
from __future__ import annotations

import os

import pytest
import torch

import rayshard.checkpoint as ckpt
from rayshard.cluster.api import checkpoint as api_module
from rayshard.cluster.catalog.store import Store
from rayshard.plans.errors import CheckpointError, ConfigError
from tests.forked_ranks import run_ranks


@pytest.fixture(autouse=True)
def _leases_released():
    """This process's saves keep their runs' writer leases until it exits (decision 97); give
    them back after each test, while its S3 server still answers the release."""
    yield
    api_module._release_leases()


def test_a_tensor_with_no_elements_is_kept_and_loads_back(tmp_path):
    where = str(tmp_path / "r")
    ckpt.save({"model": {"w": torch.arange(3.0), "mask": torch.zeros(0, 4)}}, where, step=1)
    into = {"model": {"w": torch.zeros(3), "mask": torch.zeros(0, 4)}}
    ckpt.load(into, where)
    assert torch.equal(into["model"]["w"], torch.arange(3.0)) and into["model"]["mask"].shape == (0, 4)
    with pytest.raises(CheckpointError, match="mask"):  # its shape is recorded and checked like any other
        ckpt.load({"model": {"w": torch.zeros(3), "mask": torch.zeros(0, 5)}}, where)


def _linear(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(6, 5)


def test_a_models_parameters_are_filled_in_place_from_an_object_store(s3_store):
    """Every byte from an object store is copied into place (no direct read), where a parameter
    that requires grad refused `copy_` into a view of itself."""
    source = _linear(0)
    ckpt.save({"model": source.state_dict()}, f"{s3_store}/params", step=1)
    target = _linear(1)
    ckpt.load({"model": target.state_dict(keep_vars=True)}, f"{s3_store}/params")
    assert torch.equal(target.weight, source.weight) and torch.equal(target.bias, source.bias)
    assert target.weight.requires_grad  # still the model's own parameter


def _load_parameters_on_replicas(rank: int, init_method: str, world_size: int, results, where: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        target = _linear(1 + rank)
        try:  # replicated plain tensors: read once, handed over to the other replica (object stores)
            ckpt.load({"model": target.state_dict(keep_vars=True)}, where)
            results[rank] = {"weight": target.weight.detach().tolist(), "bias": target.bias.detach().tolist()}
        except Exception as error:  # noqa: BLE001 - reported to the test
            results[rank] = {"error": f"{type(error).__name__}: {error}"}
    finally:
        dist.destroy_process_group()


def test_replicas_fill_their_parameters_through_the_hand_over(s3_store):
    source = _linear(0)
    ckpt.save({"model": source.state_dict()}, f"{s3_store}/replicas", step=1)
    answers = run_ranks(_load_parameters_on_replicas, 2, f"{s3_store}/replicas")
    for rank in range(2):
        assert answers[rank] == {"weight": source.weight.tolist(), "bias": source.bias.tolist()}, answers[rank]


def test_a_tensor_on_the_meta_device_is_refused_in_one_line(tmp_path):
    where = str(tmp_path / "r")
    ckpt.save({"model": {"w": torch.arange(3.0)}}, where, step=1)
    for call in (lambda: ckpt.load({"model": {"w": torch.empty(3, device="meta")}}, where),
                 lambda: ckpt.save({"model": {"w": torch.empty(3, device="meta")}}, where, step=2)):
        with pytest.raises(CheckpointError, match="meta device.*to_empty") as refused:
            call()
        assert "\n" not in str(refused.value)
    assert Store(str(tmp_path)).committed_steps("r") == [1]


def _save_rank_values(rank: int, init_method: str, world_size: int, results, where: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        state = {"model": {"w": torch.arange(4.0)}, "shared": {"epoch": 3 + rank}, f"only_rank{rank}": {"pos": 10 * rank + 7}}
        ckpt.save(state, where, step=1)
        into = {"model": {"w": torch.zeros(4)}, "shared": {"epoch": -1}, f"only_rank{rank}": {"pos": -1}}
        ckpt.load(into, where)
        results[rank] = {"shared": into["shared"]["epoch"], "own": into[f"only_rank{rank}"]["pos"]}
    finally:
        dist.destroy_process_group()


def test_values_any_rank_holds_are_saved_and_each_rank_gets_its_own_back(tmp_path):
    """A value key only one rank holds (a pipeline stage's entries, a rank's own loader state) is
    saved; a key every rank holds keeps the first rank's value, as DCP keeps one copy."""
    where = str(tmp_path / "r")
    answers = run_ranks(_save_rank_values, 2, where)
    assert answers[0] == {"shared": 3, "own": 7} and answers[1] == {"shared": 3, "own": 17}


@pytest.mark.parametrize("where, step, says", [
    ("{root}/latest", 1, "reserved"),
    ("{root}/r", 100_000_000, "from 0 to 99,999,999"),
    ("{root}/r/checkpoints/step-00000001", 2, "names a checkpoint directory, not a run"),
])
def test_a_save_it_could_not_honour_is_refused_in_one_line(tmp_path, where, step, says):
    root = str(tmp_path)
    ckpt.save({"model": {"w": torch.arange(3.0)}}, f"{root}/r", step=1)
    with pytest.raises(ConfigError, match=says) as refused:
        ckpt.save({"model": {"w": torch.arange(3.0)}}, where.format(root=root), step=step)
    assert "\n" not in str(refused.value)
    assert Store(root).committed_steps("r") == [1] and not os.path.exists(f"{root}/r/checkpoints/step-00000001/checkpoints")


def test_a_checkpoint_directory_without_its_manifest_is_named_as_such(tmp_path):
    ref = ckpt.save({"model": {"w": torch.arange(3.0)}}, str(tmp_path / "r"), step=1)
    os.remove(f"{ref.url}/manifest.parquet")
    with pytest.raises(ConfigError, match="checkpoint directory.*no manifest"):
        ckpt.load({"model": {"w": torch.zeros(3)}}, ref.url)
