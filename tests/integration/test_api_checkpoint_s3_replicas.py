"""`rayshard.checkpoint.load` from an object store reads each piece that several ranks hold alike
once and broadcasts it (docs/decisions.md 234): real gloo ranks forked from the test (no Ray) load
from the S3 test server (moto behind the test proxy, which records every request).

Each load runs twice on the same checkpoint: read once (the default on an object store) and with
`RAYSHARD_READ_ONCE=0` (every rank reads its own pieces, the API's load before decision 234).
Both are bit-exact; read once, the ranks together read one copy of the replicated state instead
of one per replica: the bytes each load read (its reads' own count, summed over the ranks) and
its plan say so alike."""
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
ODD = {"model.odd.weight": (61, 45), "optim.state.odd.weight.exp_avg": (61, 45), "optim.state.odd.weight.step": ()}


@pytest.fixture(autouse=True)
def _bounded_exchanges(monkeypatch):
    monkeypatch.setenv("RAYSHARD_CHECKPOINT_TIMEOUT_S", "60")  # forked ranks inherit it


def _global(name: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn((COLUMNS,) if name == NORM else ODD.get(name, (ROWS, COLUMNS)), generator=generator)


def _save(rank: int, init_method: str, world_size: int, results, where: str) -> None:
    """Four ranks save the matrices sharded by rows (four files), the norm once."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
        state = {name: distribute_tensor(_global(name), mesh, [Shard(0)]) for name in (*MATRICES, *ODD) if ODD.get(name) != ()}
        plain = {name: _global(name) for name in (NORM, "optim.state.odd.weight.step")}
        results[rank] = ckpt.save(nested({**state, **plain}), where, step=1).url
    except Exception as error:  # noqa: BLE001 (the test reads every rank's line)
        results[rank] = f"error {type(error).__name__}: {error}"
    finally:
        dist.destroy_process_group()


def _load_rank(rank: int, init_method: str, world_size: int, results, spec: dict) -> None:
    """Load as `spec["kind"]` places the state: "hsdp", a (dp_replicate 2, dp_shard 2) mesh with
    the matrices (Replicate, Shard(0)); "dptp", a (dp_replicate 2, tp 2) mesh with the matrices
    (Replicate, Shard(1)), column slices a tp group bands; in both the norm replicated on both
    dims; "plain", every tensor a plain tensor on every rank (a DDP loop's state dict)."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import rayshard.cluster.api.checkpoint as api

    torch.set_num_threads(1)
    os.environ["RAYSHARD_READ_ONCE"] = spec["read_once"]
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    read, real_read = {}, api._read

    def counted(*args):  # what this rank's load read from the store, by its reads' own count
        stats = real_read(*args)
        read["bytes"] = stats["bytes_read"]
        return stats

    api._read = counted
    try:
        names = (*MATRICES, NORM)
        if spec["kind"] == "uneven":  # 6 ranks: (dp_replicate 3, dp_shard 2), 61 rows cut 31 + 30, and a 0-d step
            names = tuple(ODD)
            mesh = init_device_mesh("cpu", (3, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
            placements = {name: [Replicate(), Shard(0)] for name in names}
            flat = {name: distribute_tensor(torch.zeros_like(_global(name)), mesh, placements[name])
                    for name in names if ODD[name]} | {"optim.state.odd.weight.step": torch.zeros(())}
            expected = {name: (distribute_tensor(_global(name), mesh, placements[name]).to_local() if ODD[name]
                               else _global(name)) for name in names}
            local = {name: tensor.to_local() if ODD[name] else tensor for name, tensor in flat.items()}
        elif spec["kind"] in ("hsdp", "dptp"):
            inner = "dp_shard" if spec["kind"] == "hsdp" else "tp"
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", inner))
            cut = Shard(0) if spec["kind"] == "hsdp" else Shard(1)
            placements = {name: [Replicate(), cut] for name in MATRICES} | {NORM: [Replicate(), Replicate()]}
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
                         "planned_read": plan.bytes_read, "read": read["bytes"]}
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


def _loaded(fault_proxy, where: str, kind: str, read_once: str, **spec) -> tuple[int, int, int]:
    """(bytes the ranks' loads read, bytes their plans said, data GETs)."""
    fault_proxy.requests.clear()
    ranks = 6 if kind == "uneven" else 4
    reports = run_ranks(_load_rank, ranks, {"where": where, "kind": kind, "read_once": read_once, **spec})
    assert all(report.get("exact") for report in reports.values()), reports
    return sum(report["read"] for report in reports.values()), reports[0]["planned_read"], _data_gets(fault_proxy)


MATRIX_BYTES, NORM_BYTES = ROWS * COLUMNS * 4, COLUMNS * 4
STATE_BYTES = len(MATRICES) * MATRIX_BYTES + NORM_BYTES  # one copy of everything, every chunk read whole


def _read_once_and_alone(fault_proxy, where: str, kind: str, once: int, alone: int) -> None:
    """Both loads bit-exact, reading (and planning) `once` and `alone` bytes, in fewer GETs once."""
    read, planned, gets = _loaded(fault_proxy, where, kind, "auto")
    read_alone, planned_alone, gets_alone = _loaded(fault_proxy, where, kind, "0")
    assert (read, planned) == (once, once) and (read_alone, planned_alone) == (alone, alone)
    assert gets < gets_alone, (gets, gets_alone)


def test_an_hsdp_load_reads_each_shard_once_across_its_replicas_bit_exact(s3_store, fault_proxy):
    """The matrices' two dp_shard halves once each across dp_replicate (not twice); the norm,
    replicated on both dims of a mesh spanning every rank, once across all four."""
    _read_once_and_alone(fault_proxy, _saved(s3_store), "hsdp", STATE_BYTES,
                         2 * len(MATRICES) * MATRIX_BYTES + 4 * NORM_BYTES)


def test_bands_over_tp_and_the_replicated_norm_are_read_once_in_one_load_bit_exact(s3_store, fault_proxy):
    """dp_replicate 2 x tp 2: each tp group reads its band of whole rows once (its column
    slices, which alone it would read as whole rows twice), the norm is read once by all four."""
    _read_once_and_alone(fault_proxy, _saved(s3_store), "dptp", 2 * len(MATRICES) * MATRIX_BYTES + NORM_BYTES,
                         4 * len(MATRICES) * MATRIX_BYTES + 4 * NORM_BYTES)


@pytest.mark.slow  # the default suite's budget: the corrupt-byte test below loads plain tensors read once too
def test_a_ddp_loop_on_four_ranks_reads_one_copy_of_its_plain_tensors_bit_exact(s3_store, fault_proxy):
    _read_once_and_alone(fault_proxy, _saved(s3_store), "plain", STATE_BYTES, 4 * STATE_BYTES)


@pytest.mark.slow
def test_uneven_shards_over_three_replicas_and_a_0d_step_are_read_once_bit_exact(s3_store, fault_proxy):
    """Six ranks, (dp_replicate 3, dp_shard 2): 61 rows saved as 16 + 15 + 15 + 15 and loaded as
    31 + 30, each half read once across its three replicas; the 0-d step (a plain tensor) once."""
    where = _saved(s3_store)
    read, planned, _ = _loaded(fault_proxy, where, "uneven", "auto")
    read_alone, planned_alone, _ = _loaded(fault_proxy, where, "uneven", "0")
    # Not exact multiples of the tensors' bytes: these files hold other tensors too, and a file
    # read only in part has its safetensors header read and checked as well (23,724 and 68,544 here).
    matrices = 2 * 61 * 45 * 4
    assert (read, read_alone) == (planned, planned_alone)
    assert matrices + 4 <= read < (read_alone / 2.5) and read_alone >= 3 * matrices + 6 * 4


def test_a_group_whose_members_list_other_pieces_reads_them_alone_and_waits_on_nobody(s3_store, fault_proxy):
    """Rank 1's state dict leaves the norm out: the group of all four (the norm's) is not agreed,
    so ranks 0, 2 and 3 read the norm each for itself; the matrices' groups ({0, 2}, {1, 3}
    along dp_replicate) still read each half once."""
    read, planned, _ = _loaded(fault_proxy, _saved(s3_store), "hsdp", "auto", without_norm_on=1)
    assert read == len(MATRICES) * MATRIX_BYTES + 3 * NORM_BYTES


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
    reports = run_ranks(_load_rank, 4, {"where": where, "kind": "plain", "read_once": "auto"})
    assert all("error" in report for report in reports.values()), reports
    errors = [reports[rank].get("error", "") for rank in range(4)]
    readers = [rank for rank, error in enumerate(errors) if not error.startswith("RanksFailed")]
    assert len(readers) == 1, errors
    assert "checksum mismatch" in errors[readers[0]] and "up.weight (param)" in errors[readers[0]], errors
    assert all(error.startswith(f"RanksFailed: load of {where} failed on rank {readers[0]}: ")
               for rank, error in enumerate(errors) if rank != readers[0]), errors
