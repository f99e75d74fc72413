"""Pipeline orders in torch.distributed.pipelining's CSV format: torch's own dumps pass our checker
(compute-only and with its transfers), and a broken order is refused naming rank, step and action."""
from __future__ import annotations

import csv
import types

import pytest
import torch
from torch.distributed.pipelining import schedules as torch_schedules

from rayshard.cluster.cli.main import main
from rayshard.plans.errors import ConfigError, ScheduleError
from rayshard.plans.pipeline.actions import Kind
from rayshard.plans.pipeline.checker import check
from rayshard.plans.pipeline.csv_order import lowered_as_written, parse_pipeline_csv, schedule_of
from rayshard.plans.pipeline.lowering import lower
from rayshard.plans.pipeline.partition import Placement
from rayshard.plans.pipeline.schedules import build_schedule

TORCH_SCHEDULES = {"interleaved1f1b": (torch_schedules.ScheduleInterleaved1F1B, "looped"),
                   "zbv": (torch_schedules.ScheduleZBVZeroBubble, "v")}


def torch_csv(name: str, path, pp: int = 2, microbatches: int = 4, fmt: str = "compute_only") -> list[list[str]]:
    """torch's own schedule, dumped with its `_dump_csv` (stages are stand-ins: the order depends
    only on their indices and counts)."""
    schedule_class, placement = TORCH_SCHEDULES[name]
    stages = pp * 2
    own = [0, pp] if placement == "looped" else [0, stages - 1]  # rank 0's stages
    standins = [types.SimpleNamespace(num_stages=stages, group_size=pp, group_rank=0, stage_index=index,
                                      is_first=index == 0, is_last=index == stages - 1, stage_index_to_group_rank=None,
                                      submod=torch.nn.Linear(1, 1)) for index in own]
    schedule_class(standins, n_microbatches=microbatches)._dump_csv(str(path), format=fmt)
    with open(path, newline="") as handle:
        return list(csv.reader(handle))


@pytest.mark.parametrize("name", sorted(TORCH_SCHEDULES))
@pytest.mark.parametrize("fmt", ["compute_only", "compute_comms"])
def test_torch_dumps_pass_our_checker(tmp_path, name, fmt):
    order = parse_pipeline_csv(torch_csv(name, tmp_path / "order.csv", fmt=fmt))
    assert (order.pp, order.vpp, order.microbatches) == (2, 2, 4)
    assert order.placement is (Placement.LOOPED if name == "interleaved1f1b" else Placement.V)
    assert order.has_transfers is (fmt == "compute_comms")
    lowered = lowered_as_written(order) if order.has_transfers else lower(schedule_of(order))
    assert check(lowered).ok, check(lowered).describe()
    assert order.splits_backward is (name == "zbv")


def test_torch_interleaved_order_is_ours(tmp_path):
    """The same compute order as rayshard's own interleaved 1F1B, action for action."""
    order = parse_pipeline_csv(torch_csv("interleaved1f1b", tmp_path / "order.csv"))
    ours = build_schedule("interleaved1f1b", 2, 4, 2)
    assert [list(actions) for actions in schedule_of(order).ranks] == ours.ranks


def test_a_missing_backward_is_named(tmp_path):
    rows = torch_csv("interleaved1f1b", tmp_path / "order.csv")
    rows[1] = [cell for cell in rows[1] if cell != "3B2"]
    with pytest.raises(ScheduleError, match=r"stage 3 microbatch 2 has 0 B, 0 I and 0 W.*Fix: add or remove 3B2"):
        parse_pipeline_csv(rows)


def test_a_receive_that_waits_on_its_own_rank_is_named(tmp_path):
    """Rank 1 waits for stage 0's forward of microbatch 1 before it sends microbatch 0's: rank 0
    sends microbatch 1 only after receiving microbatch 0's gradient, which needs that send."""
    rows = [["0F0", "0SEND_F0", "0RECV_B0", "0B0", "0F1", "0SEND_F1", "0RECV_B1", "0B1"],
            ["1RECV_F0", "1F0", "1RECV_F1", "1B0", "1SEND_B0", "1F1", "1B1", "1SEND_B1"]]
    report = check(lowered_as_written(parse_pipeline_csv(rows)))
    assert not report.ok
    assert "rank 1" in report.describe() and "RECV_F" in report.describe(), report.describe()


@pytest.mark.parametrize("rows, message", [
    ([["0F0", "0X0"]], r"rank 0 step 1 \('0X0'\): not an action"),
    ([["0F0", "0B0"], ["0F1"]], r"stage 0's forwards run on rank 0"),
    ([["1F0", "1B0"]], r"stage\(s\) \[0\] never run a forward"),
    ([["0F0", "2F0"], ["1F0"]], r"3 stages over 2 ranks"),
    ([["0F0", "(0F1;0F0)OVERLAP_F_B"]], r"an overlapped cell holds one F then one B"),
])
def test_malformed_files_are_refused_naming_the_cell(rows, message):
    with pytest.raises(ScheduleError, match=message):
        parse_pipeline_csv(rows)


def test_a_placement_we_cannot_cut_for_is_refused():
    assert parse_pipeline_csv([["0F0", "0B0", "2F0", "2B0"], ["1F0", "1B0", "3F0", "3B0"]]).placement is Placement.LOOPED
    assert parse_pipeline_csv([["0F0", "0B0", "3F0", "3B0"], ["1F0", "1B0", "2F0", "2B0"]]).placement is Placement.V
    blocked = parse_pipeline_csv([["0F0", "0B0", "1F0", "1B0"], ["2F0", "2B0", "3F0", "3B0"]])
    with pytest.raises(ScheduleError, match=r"places stages on ranks as \[0, 0, 1, 1\], which is neither"):
        blocked.placement


def test_plan_schedule_from_csv_checks_and_simulates(tmp_path, capsys):
    torch_csv("zbv", tmp_path / "zbv.csv", fmt="compute_comms")
    assert main(["plan", "schedule", "--from-csv", str(tmp_path / "zbv.csv"), "--no-grid"]) == 0
    out = capsys.readouterr().out
    assert "pp=2, vpp=2, 4 microbatches, 4 stages (v placement); transfers as written" in out
    assert "bubble fraction" in out
    with open(tmp_path / "zbv.csv", newline="") as handle:
        broken = list(csv.reader(handle))
    broken[0] = [cell for cell in broken[0] if cell != "0SEND_F1"]
    with open(tmp_path / "broken.csv", "w", newline="") as handle:
        csv.writer(handle).writerows(broken)
    assert main(["plan", "schedule", "--from-csv", str(tmp_path / "broken.csv"), "--no-grid"]) == 1
    assert "RECV_F" in capsys.readouterr().out


def test_train_takes_pp_vpp_and_microbatches_from_the_file(tmp_path):
    from rayshard.cluster.cli.commands.train import config_from_args
    from rayshard.cluster.cli.main import build_parser

    torch_csv("zbv", tmp_path / "zbv.csv")
    config = config_from_args(build_parser().parse_args(["train", "--schedule-csv", str(tmp_path / "zbv.csv"),
                                                         "--dp", "1", "--tp", "1"]))
    pipeline = config.pipeline
    assert (config.layout.pp, config.layout.vpp, pipeline.microbatches, pipeline.schedule) == (2, 2, 4, "csv")
    assert config.pipeline.splits_backward
    with pytest.raises(ConfigError, match=r"microbatches=2: the schedule file has 4"):
        config_from_args(build_parser().parse_args(["train", "--schedule-csv", str(tmp_path / "zbv.csv"),
                                                    "--microbatches", "2", "--dp", "1", "--tp", "1"]))
