"""`rayshard.checkpoint.load` from an object store bands row-parallel DTensors as the trainer's load
does (docs/decisions.md 146, 172): real gloo ranks forked from the test (no Ray) load, from the S3
test server (moto behind the test proxy, which records every request), a state dict whose
`Shard(1)` tensors a mesh dim cuts into column slices far below the 256 KiB under which an object
store reads a column slice as whole rows.

Each load runs twice on the same checkpoint: banded (the default on an object store) and with
`RAYSHARD_READ_ONCE=0` (every rank reads its own pieces, the API's load before decision 172). Both
are bit-exact; the banded one reads each stored chunk of a banded tensor once across its group
instead of once per member, in fewer GET requests and about 1/tp the bytes. A user's loop
(RowwiseParallel over tp) resumes through bands bit for bit and trains on as before."""
from __future__ import annotations

import pytest
import torch

import rayshard.checkpoint as ckpt
from tests.forked_ranks import run_ranks
from tests.nested_state import nested

ROWS, COLUMNS = 64, 48  # a row of 192 bytes: a column slice of it is read as whole rows on S3
SOURCE_RANKS = 4


@pytest.fixture(autouse=True)
def _bounded_exchanges(monkeypatch):
    monkeypatch.setenv("RAYSHARD_CHECKPOINT_TIMEOUT_S", "60")  # forked ranks inherit it


def _global(name: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(ROWS, COLUMNS, generator=generator)


# Shard(1) on the load's tp dim. Each source file holds one chunk of each, back to back, so a rank
# reading both chunks of a file reads them in one GET: the GETs count files read per rank.
NAMES = ("model.down.weight", "optim.state.down.weight.exp_avg")


def _save_rows(rank: int, init_method: str, world_size: int, results, where: str) -> None:
    """Four ranks save every tensor sharded by rows: four chunks per tensor, in four files."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
        state = nested({name: distribute_tensor(_global(name), mesh, [Shard(0)]) for name in NAMES})
        results[rank] = ckpt.save(state, where, step=1).url
    except Exception as error:  # noqa: BLE001 (the test reads every rank's line)
        results[rank] = f"error {type(error).__name__}: {error}"
    finally:
        dist.destroy_process_group()


def _load_tp(rank: int, init_method: str, world_size: int, results, spec: dict) -> None:
    """Load onto mesh `spec["mesh"]`: Shard(1) on tp (and Shard(0) on dp_shard, as FSDP2 x TP
    places a row-parallel weight and its moments)."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    os.environ["RAYSHARD_READ_ONCE"] = spec["read_once"]
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        names = [name for name, _ in spec["mesh"]]
        mesh = init_device_mesh("cpu", tuple(size for _, size in spec["mesh"]), mesh_dim_names=tuple(names))
        outer = [Shard(0)] if "dp_shard" in names else []
        flat = {name: distribute_tensor(torch.zeros(ROWS, COLUMNS), mesh, outer + [Shard(1)]) for name in NAMES}
        expected = {name: distribute_tensor(_global(name), mesh, flat[name].placements).to_local() for name in NAMES}
        if rank == spec.get("without_exp_avg_on"):  # this rank's loop asks for the weight only
            del flat[NAMES[1]]
        plan = ckpt.plan(nested(flat), spec["where"])
        ckpt.load(nested(flat), spec["where"])
        results[rank] = {"exact": all(torch.equal(flat[name].to_local(), expected[name]) for name in flat),
                         "planned_read": plan.bytes_read, "planned_requests": sum(r.requests for r in plan.ranks)}
    except Exception as error:  # noqa: BLE001
        results[rank] = {"error": f"{type(error).__name__}: {error}"}
    finally:
        dist.destroy_process_group()


def _data_gets(proxy) -> tuple[int, list]:
    gets = [target for method, target in proxy.requests if method == "GET" and ".safetensors" in target]
    return len(gets), gets


def _load_twice(fault_proxy, where: str, mesh: list) -> dict:
    """GETs of tensor data and the loads' reports, banded and not."""
    outcome = {}
    for read_once in ("auto", "0"):
        fault_proxy.requests.clear()
        world = 1
        for _, size in mesh:
            world *= size
        reports = run_ranks(_load_tp, world, {"where": where, "mesh": mesh, "read_once": read_once})
        assert all(report.get("exact") for report in reports.values()), reports
        outcome[read_once] = (_data_gets(fault_proxy)[0], reports[0])
    return outcome


def _saved(s3_store) -> str:
    where = f"{s3_store}/rows"
    urls = run_ranks(_save_rows, SOURCE_RANKS, where)
    assert len(set(urls.values())) == 1 and not str(urls[0]).startswith("error"), urls
    return where


def test_a_tp2_load_from_s3_reads_each_banded_chunk_once_bit_exact(s3_store, fault_proxy):
    where = _saved(s3_store)
    outcome = _load_twice(fault_proxy, where, [["tp", 2]])
    (banded, report), (alone, alone_report) = outcome["auto"], outcome["0"]
    # Alone, each tp rank reads its column slices as whole rows: all four files, one GET each.
    # Banded, the band's rows are split in two shares of two whole chunks (files): each file once.
    assert (alone, banded) == (2 * 4, 4)
    # The plan says the same: half the bytes (every chunk whole, so no header is read).
    chunks = len(NAMES) * ROWS * COLUMNS * 4
    assert (alone_report["planned_read"], report["planned_read"]) == (2 * chunks, chunks)
    assert (alone_report["planned_requests"], report["planned_requests"]) == (alone, banded)


@pytest.mark.slow
def test_an_fsdp2_x_tp2_load_from_s3_bands_within_each_tp_group_bit_exact(s3_store, fault_proxy):
    """Two tp groups ({0, 1}, {2, 3}), each banding its fsdp half's rows: two chunks a band."""
    where = _saved(s3_store)
    outcome = _load_twice(fault_proxy, where, [["dp_shard", 2], ["tp", 2]])
    banded, alone = outcome["auto"][0], outcome["0"][0]
    assert (alone, banded) == (4 * 2, 4)  # alone: every rank reads its fsdp half's two files; banded: each once


def test_members_that_ask_for_different_tensors_read_those_alone_and_wait_on_nobody(s3_store, fault_proxy):
    """Rank 1's state dict leaves the moment out: the band of the moment is not agreed (rank 1 would
    never join its scatters), so rank 0 reads its slice of it alone; the weight is still banded."""
    where = _saved(s3_store)
    reports = run_ranks(_load_tp, 2, {"where": where, "mesh": [["tp", 2]], "read_once": "auto", "without_exp_avg_on": 1})
    assert all(report.get("exact") for report in reports.values()), reports
    # The weight's four chunks once across the pair (rank 1: two GETs), the moment's four by rank 0
    # alone, two of them in one GET with its share of the weight (back to back in a file): 2 + 4.
    assert _data_gets(fault_proxy)[0] == 6


@pytest.mark.slow  # the default suite's budget: test_a_tp2_load_... runs the same path
def test_a_corrupt_byte_in_a_chunk_read_in_shares_fails_every_rank_naming_it(s3_store, fault_proxy):
    """One stored chunk per tensor (saved by one process): the band's two shares each read half of
    it, so neither member can check it alone; where the parts meet, the flipped byte is found."""
    from rayshard.cluster.catalog.store import Store
    from rayshard.storage.manifest_io import read_manifest

    where = f"{s3_store}/one"
    ref = ckpt.save(nested({name: _global(name) for name in NAMES}), where, step=1)
    down = next(chunk for chunk in read_manifest(ref.url)[0] if chunk.kind == "param")
    store = Store(s3_store)
    path = f"{ref.url.removeprefix('s3://')}/{down.file}"
    data = bytearray(store.fs.cat_file(path))
    data[down.byte_start + 4 * COLUMNS * 40 + 8] ^= 0x40  # row 40: the second share's
    store.fs.pipe_file(path, bytes(data))
    reports = run_ranks(_load_tp, 2, {"where": where, "mesh": [["tp", 2]], "read_once": "auto"})
    errors = [reports[rank].get("error", "") for rank in range(2)]
    assert "checksum mismatch" in errors[0] and "down.weight (param)" in errors[0], errors
    assert "read in parts by several ranks" in errors[0], errors
    assert errors[1].startswith(f"RanksFailed: load of {where} failed on rank 0: "), errors


@pytest.mark.slow  # the default suite's budget: test_a_tp2_load_... runs the same path
def test_a_loop_resumes_on_tp2_from_s3_through_bands_bit_for_bit(s3_store, tmp_path, monkeypatch):
    """A user's loop (tests/integration/api_checkpoint_job.py: RowwiseParallel `down`, whose weight
    and moments are Shard(1) on tp) saves on fsdp2 to S3 and resumes on tp2 from it: the resumed
    state saved again equals the saved one tensor for tensor, and training continues as before."""
    from rayshard.cluster.checkpoint.digest import diff_checkpoints
    from tests.integration.api_checkpoint_job import forked_job

    saved = run_ranks(forked_job, 2, {"mesh": [["dp_shard", 2]], "where": f"{s3_store}/loop", "steps": 4,
                                      "save_at": [2]})
    assert all("exception" not in saved[rank] for rank in range(2)), saved
    import os

    import rayshard.cluster.api.checkpoint as api

    real, marks = api.hand_over_lists, tmp_path / "banded"
    marks.mkdir()

    def noting(bands, replicas=()):  # the forked ranks inherit it: each notes the keys it banded
        (marks / str(os.getpid())).write_text("\n".join(sorted(band.key for band in bands)))
        return real(bands, replicas)

    monkeypatch.setattr(api, "hand_over_lists", noting)
    resumed = run_ranks(forked_job, 2, {"mesh": [["tp", 2]], "load": f"{s3_store}/loop",
                                        "resave": str(tmp_path / "runs" / "again"), "steps": 4})
    assert all("exception" not in resumed[rank] for rank in range(2)), resumed
    assert [d for d in diff_checkpoints(saved[0]["refs"][0], resumed[0]["resaved"]) if d.status != "equal"] == []
    banded = [mark.read_text().split() for mark in marks.iterdir()]
    assert banded == [["model.down.weight", "optim.state.down.weight.exp_avg", "optim.state.down.weight.exp_avg_sq"]] * 2
    for step, loss in resumed[0]["losses"].items():
        assert abs(loss - saved[0]["losses"][step]) <= 2.5e-6 * abs(saved[0]["losses"][step]), step
