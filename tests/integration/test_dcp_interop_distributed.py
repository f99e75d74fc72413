"""torch DCP interop across processes, against torch's own DCP code on both sides.

A rayshard checkpoint (tiny, 2 AdamW steps, written through the ranks' save path) is converted to torchtitan's names by hand
(tests/torchtitan_llama.py), loaded into torchtitan's Llama sharded FSDP2 x TP (2 x 2, gloo, four
forked processes) with its AdamW moments and step through `set_state_dict`, and saved with
`dcp.save` as torchtitan lays a checkpoint out (`get_state_dict`, the optimizer flattened). Then:

- `rayshard ckpt import --format dcp` of it is the source checkpoint, digest for digest, and
  `rayshard train --resume` of the import matches, step for step, a resume of the source itself
  (the run that loaded the same weights and moments directly);
- `rayshard ckpt export --format dcp` of the import loads with `dcp.load` on 1, 2 (FSDP2) and 4
  (FSDP2 x TP) ranks, model and optimizer through `set_state_dict` as torchtitan loads them, bit
  for bit equal to the source tensors.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from rayshard.actors.checkpoint.stored import StoredCheckpoint
from rayshard.cluster.catalog.store import Store
from rayshard.cluster.cli.commands.train import config_from_args
from rayshard.cluster.cli.main import build_parser, main
from rayshard.plans.training.model_spec import parameter_shapes, preset
from tests.forked_ranks import run_ranks
from tests.integration.reshard_helpers import digests
from tests.unit.checkpoint_factory import write_checkpoint
from tests.torchtitan_llama import Transformer as TorchtitanLlama
from tests.torchtitan_llama import parallelize, torchtitan_from_ours

CONFIG = preset("tiny")
STEP = 2
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
FULL = StateDictOptions(full_state_dict=True)


def _config(store: str, run: str, steps: int, *extra: str):
    args = build_parser().parse_args(["train", "--store", store, "--run", run, "--steps", str(steps), "--global-batch", "4",
                                      "--seq-len", "32", "--seed", "3", "--model", "tiny", *extra])
    return config_from_args(args)


def _source_tensors(url: str) -> dict[str, dict[str, torch.Tensor]]:
    """kind -> torchtitan name -> the whole tensor (converted by hand from our names)."""
    stored = StoredCheckpoint(url)
    return {kind: torchtitan_from_ours({name: stored.read_region(name, kind, (0,) * len(shape), tuple(shape))
                                        for name, shape in parameter_shapes(CONFIG).items()}, CONFIG)
            for kind in ("param", "exp_avg", "exp_avg_sq")}


def _model_and_optimizer(dp_shard: int, tp: int):
    # The test process computed before forking: OpenMP's thread pool does not survive a fork, and
    # a forked rank's first parallel region would wait on it forever. One thread runs inline.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TorchtitanLlama(CONFIG)
    parallelize(model, dp_shard, tp)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _save_rank(rank, init_method, world_size, results, directory, source, step):
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        model, optimizer = _model_and_optimizer(2, 2)
        _, optimizer_state = get_state_dict(model, optimizer, options=FULL)  # creates AdamW's state
        for name, state in optimizer_state["state"].items():
            state.update(exp_avg=source["exp_avg"][name].clone(), exp_avg_sq=source["exp_avg_sq"][name].clone(),
                         step=torch.tensor(float(step)))
        set_state_dict(model, optimizer, model_state_dict={k: v.clone() for k, v in source["param"].items()},
                       optim_state_dict=optimizer_state, options=FULL)
        model_state, optimizer_state = get_state_dict(model, optimizer, options=FLAT)
        dcp.save({**model_state, "optimizer": optimizer_state}, checkpoint_id=directory)  # torchtitan's layout
        results[rank] = "saved"
    finally:
        dist.destroy_process_group()


def _load_rank(rank, init_method, world_size, results, directory, source, step, tp):
    """What torchtitan's CheckpointManager does on load, then every tensor compared whole."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        model, optimizer = _model_and_optimizer(world_size // tp, tp)
        model_state, optimizer_state = get_state_dict(model, optimizer, options=FLAT)
        state = {**model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=directory)
        set_state_dict(model, optimizer, model_state_dict=model_state,
                       optim_state_dict=state["optimizer"], options=FLAT)
        weights, moments = get_state_dict(model, optimizer, options=FULL)
        differ = [name for name, tensor in weights.items() if not torch.equal(tensor, source["param"][name])]
        for name, entry in moments["state"].items():
            differ += [f"{name}.{kind}" for kind in ("exp_avg", "exp_avg_sq") if not torch.equal(entry[kind], source[kind][name])]
            if entry["step"].item() != step:
                differ.append(f"{name}.step={entry['step'].item()}")
        results[rank] = differ
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(store, source checkpoint url, its tensors under torchtitan's names, the dcp.save directory)."""
    root = tmp_path_factory.mktemp("dcp-interop")
    store = str(root / "store")
    source_url, _, _ = write_checkpoint(store, "source", CONFIG, steps=STEP)  # the rank save path, one process
    source = _source_tensors(source_url)
    directory = str(root / "torchtitan-dcp")
    assert run_ranks(_save_rank, 4, directory, source, STEP) == {rank: "saved" for rank in range(4)}
    # The directory holds the source state as torchtitan names it (torch's own reader says so).
    metadata = FileSystemReader(directory).read_metadata()
    for key in ("layers.0.attention.wq.weight", "optimizer.state.layers.0.attention.wq.weight.exp_avg"):
        assert len(metadata.state_dict_metadata[key].chunks) == 4  # fsdp2 x tp2: four shards of rows
    return store, source_url, source, directory


def test_an_fsdp2_tp_dcp_save_imports_and_resumes_as_its_source(saved, run_training):
    store, source_url, _, directory = saved
    assert main(["ckpt", "import", directory, "--format", "dcp", "--model", "tiny", "--run", "imported", "--store", store,
                 "--quiet"]) == 0
    imported = Store(store).resolve("imported").url
    assert Store(store).committed_steps("imported") == [STEP]
    assert digests(imported) == digests(source_url)
    # `rayshard train --resume`: from the import, and from the source checkpoint itself.
    from_import = run_training(_config(store, "from-import", 5, "--resume", f"imported@{STEP}", "--tp", "2"))
    direct = run_training(_config(store, "direct", 5, "--resume", f"source@{STEP}", "--tp", "2"))
    assert sorted(from_import.losses) == [3, 4, 5]
    assert from_import.losses == direct.losses  # step for step, exactly


@pytest.mark.parametrize("world_size, tp", [(1, 1), (2, 1), (4, 2)])
def test_the_export_loads_with_dcp_on_any_world_size_bit_for_bit(saved, tmp_path_factory, world_size, tp):
    store, _, source, directory = saved
    if not Store(store).committed_steps("imported-for-export"):
        assert main(["ckpt", "import", directory, "--format", "dcp", "--model", "tiny", "--run", "imported-for-export",
                     "--store", store, "--quiet"]) == 0
    out = str(tmp_path_factory.mktemp("export") / "dcp")
    assert main(["ckpt", "export", f"imported-for-export@{STEP}", "--store", store, "--format", "dcp", "--out", out,
                 "--workers", "3", "--quiet"]) == 0
    if world_size == 1:  # plain tensors, no process group
        metadata = FileSystemReader(out).read_metadata()
        loaded = {key: torch.empty(entry.size, dtype=entry.properties.dtype)
                  for key, entry in metadata.state_dict_metadata.items() if hasattr(entry, "size")}
        dcp.load(loaded, checkpoint_id=out, no_dist=True)
        for name, tensor in source["param"].items():
            assert torch.equal(loaded[name], tensor), name
            for kind in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(loaded[f"optimizer.state.{name}.{kind}"], source[kind][name]), (name, kind)
            assert loaded[f"optimizer.state.{name}.step"].item() == STEP
        return
    results = run_ranks(_load_rank, world_size, out, source, STEP, tp)
    assert results == {rank: [] for rank in range(world_size)}
