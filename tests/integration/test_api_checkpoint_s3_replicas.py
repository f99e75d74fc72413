"""`rayshard.checkpoint.load` from an object store reads each piece that several ranks hold alike
once and broadcasts it (docs/decisions.md 234): real gloo ranks forked from the test (no Ray) load
from the S3 test server (moto behind the test proxy, which records every request).

Each load runs twice on the same checkpoint: read once (the default on an object store) and with
`RAYSHARD_READ_ONCE=0` (every rank reads its own pieces, the API's load before decision 234).
Both are bit-exact; read once, the ranks together read one copy of the replicated state instead
of one per replica, in as many fewer GET requests."""
from __future__ import annotations

import pytest
import torch

import rayshard.checkpoint as ckpt
from tests.forked_ranks import run_ranks
from tests.nested_state import nested

ROWS, COLUMNS = 64, 48
SOURCE_RANKS = 4
MATRICES = ("model.up.weight", "optim.state.up.weight.exp_avg")
NORM = "model.norm.weight"  # a plain tensor when saved: written once


@pytest.fixture(autouse=True)
def _bounded_exchanges(monkeypatch):
    monkeypatch.setenv("RAYSHARD_CHECKPOINT_TIMEOUT_S", "60")  # forked ranks inherit it


def _global(name: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(*((COLUMNS,) if name == NORM else (ROWS, COLUMNS)), generator=generator)


def _save(rank: int, init_method: str, world_size: int, results, where: str) -> None:
    """Four ranks save the matrices sharded by rows (four files), the norm once."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
        state = {name: distribute_tensor(_global(name), mesh, [Shard(0)]) for name in MATRICES}
        results[rank] = ckpt.save(nested({**state, NORM: _global(NORM)}), where, step=1).url
    except Exception as error:  # noqa: BLE001 (the test reads every rank's line)
        results[rank] = f"error {type(error).__name__}: {error}"
    finally:
        dist.destroy_process_group()


def _load(rank: int, init_method: str, world_size: int, results, spec: dict) -> None:
    """Load as `spec["kind"]` places the state: "hsdp", a (dp_replicate 2, dp_shard 2) mesh with
    the matrices (Replicate, Shard(0)) and the norm replicated on both dims; "plain", every
    tensor a plain tensor on every rank (a DDP loop's state dict)."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.set_num_threads(1)
    os.environ["RAYSHARD_READ_ONCE"] = spec["read_once"]
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        names = (*MATRICES, NORM)
        if spec["kind"] == "hsdp":
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
            placements = {name: [Replicate(), Shard(0)] for name in MATRICES} | {NORM: [Replicate(), Replicate()]}
            flat = {name: distribute_tensor(torch.zeros_like(_global(name)), mesh, placements[name]) for name in names}
            expected = {name: distribute_tensor(_global(name), mesh, placements[name]).to_local() for name in names}
            local = {name: tensor.to_local() for name, tensor in flat.items()}
        else:
            flat = {name: torch.zeros_like(_global(name)) for name in names}
            expected, local = {name: _global(name) for name in names}, flat
        if rank == spec.get("without_norm_on"):  # this rank's loop does not ask for the norm
            del flat[NORM]
        plan = ckpt.plan(nested(flat), spec["where"])
        ckpt.load(nested(flat), spec["where"])
        results[rank] = {"exact": all(torch.equal(local[name], expected[name]) for name in flat),
                         "planned_read": plan.bytes_read}
    except Exception as error:  # noqa: BLE001
        results[rank] = {"error": f"{type(error).__name__}: {error}"}
    finally:
        dist.destroy_process_group()


def _data_gets(proxy) -> int:
    return sum(1 for method, target in proxy.requests if method == "GET" and ".safetensors" in target)


def _saved(s3_store, run: str = "replicas") -> str:
    where = f"{s3_store}/{run}"
    urls = run_ranks(_save, SOURCE_RANKS, where)
    assert len(set(urls.values())) == 1 and not str(urls[0]).startswith("error"), urls
    return where


def _load_twice(fault_proxy, where: str, kind: str) -> dict:
    """(data GETs, planned bytes) of the load read once and of the load read by every rank."""
    outcome = {}
    for read_once in ("auto", "0"):
        fault_proxy.requests.clear()
        reports = run_ranks(_load, 4, {"where": where, "kind": kind, "read_once": read_once})
        assert all(report.get("exact") for report in reports.values()), reports
        outcome[read_once] = (_data_gets(fault_proxy), reports[0]["planned_read"])
    return outcome


STATE_BYTES = (len(MATRICES) * ROWS + 1) * COLUMNS * 4  # one copy of everything, every chunk read whole


def test_a_ddp_loop_on_four_ranks_reads_one_copy_of_its_plain_tensors_bit_exact(s3_store, fault_proxy):
    outcome = _load_twice(fault_proxy, _saved(s3_store), "plain")
    (gets, planned), (gets_alone, planned_alone) = outcome["auto"], outcome["0"]
    assert (planned, planned_alone) == (STATE_BYTES, 4 * STATE_BYTES)
    assert gets < gets_alone and gets_alone >= 4 * SOURCE_RANKS, (gets, gets_alone)


@pytest.mark.slow  # the default suite's budget: the DDP case above runs the same path
def test_an_hsdp_load_reads_each_shard_once_across_its_replicas_bit_exact(s3_store, fault_proxy):
    """The matrices' two dp_shard halves once each across dp_replicate (not twice); the norm,
    replicated on both dims of a mesh spanning every rank, once across all four."""
    outcome = _load_twice(fault_proxy, _saved(s3_store), "hsdp")
    (gets, planned), (gets_alone, planned_alone) = outcome["auto"], outcome["0"]
    norm = COLUMNS * 4
    assert (planned, planned_alone) == (STATE_BYTES, 2 * (STATE_BYTES - norm) + 4 * norm)
    assert gets < gets_alone, (gets, gets_alone)


def test_a_rank_that_does_not_ask_for_a_replica_leaves_it_read_alone_and_waits_on_nobody(s3_store, fault_proxy):
    """Rank 1's state dict leaves the norm out: the norm is not agreed (rank 1 would never join its
    broadcast), so the other three read it each for itself; the matrices are still read once."""
    where = _saved(s3_store)
    reports = run_ranks(_load, 4, {"where": where, "kind": "plain", "read_once": "auto", "without_norm_on": 1})
    assert all(report.get("exact") for report in reports.values()), reports


def test_a_corrupt_byte_in_a_replica_fails_every_rank_naming_it(s3_store, fault_proxy):
    """The member that reads the matrix finds the flipped byte; the others, which would have
    received what it read, fail naming that rank, and nobody is left waiting."""
    from rayshard.cluster.catalog.store import Store
    from rayshard.storage.manifest_io import read_manifest

    where = _saved(s3_store, "corrupt")
    url = ckpt.plan({"model": {"norm.weight": torch.zeros(COLUMNS)}}, where).url
    chunk = next(chunk for chunk in read_manifest(url)[0] if chunk.name == "up.weight" and chunk.kind == "param")
    store = Store(s3_store)
    path = f"{url.removeprefix('s3://')}/{chunk.file}"
    data = bytearray(store.fs.cat_file(path))
    data[chunk.byte_start + 4 * COLUMNS + 8] ^= 0x40
    store.fs.pipe_file(path, bytes(data))
    reports = run_ranks(_load, 4, {"where": where, "kind": "plain", "read_once": "auto"})
    errors = [reports[rank].get("error", "") for rank in range(4)]
    readers = [rank for rank, error in enumerate(errors) if not error.startswith("RanksFailed")]
    assert len(readers) == 1, errors
    assert "checksum mismatch" in errors[readers[0]] and "up.weight (param)" in errors[readers[0]], errors
    assert all(error.startswith(f"RanksFailed: load of {where} failed on rank {readers[0]}: ")
               for rank, error in enumerate(errors) if rank != readers[0]), errors
