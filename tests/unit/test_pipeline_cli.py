"""`rayshard plan schedule | compare | layers`, driven through the plan_cli registration."""
from __future__ import annotations

import argparse
import json

import pytest

from rayshard.cluster.cli import plan as plan_cli
from rayshard.cluster.cli.main import command_of
from rayshard.plans.pipeline.actions import Schedule
from rayshard.plans.pipeline.checker import check
from rayshard.plans.errors import ConfigError, ScheduleError


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="rayshard")
    commands = parser.add_subparsers(dest="command", required=True)
    plan_cli.register(commands)
    args = parser.parse_args(list(argv))
    return command_of(args)(args)


def test_schedule_prints_validity_step_time_bubble_and_memory(capsys, tmp_path):
    png, plan = tmp_path / "zbh1.png", tmp_path / "plan.json"
    assert run("plan", "schedule", "--schedule", "zbh1", "--pp", "4", "--microbatches", "8",
               "--costs", "F=1,B=2,W=1", "--png", str(png), "--json", str(plan)) == 0
    out = capsys.readouterr().out
    assert "check: ok" in out and "step time 27" in out and "bubble fraction 11.1%" in out
    assert "rank 3  |.  .  .  F0 I0 F1" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lowered = Schedule.from_dict(json.loads(plan.read_text()))
    assert lowered.name == "zbh1" and check(lowered).ok


def test_compare_lists_every_schedule(capsys):
    assert run("plan", "compare", "--pp", "4", "--microbatches", "6") == 0
    out = capsys.readouterr().out
    for name in ("gpipe", "1f1b", "interleaved1f1b", "zbh1", "zbv"):
        assert f"\n{name} " in out
    assert "dualpipev" in out and "at least 2 * pp = 8" in out


def test_layers_prints_placement(capsys):
    assert run("plan", "layers", "--layers", "30", "--pp", "4", "--schedule", "zbv") == 0
    out = capsys.readouterr().out
    assert "v placement" in out and "+embedding" in out and "+head" in out


def test_user_errors_raise_rayshard_errors():
    with pytest.raises(ScheduleError, match="use one of 8, 9"):
        run("plan", "schedule", "--schedule", "dualpipev", "--pp", "4", "--microbatches", "6")
    with pytest.raises(ConfigError, match="exactly 2 stage"):
        run("plan", "schedule", "--schedule", "zbv", "--pp", "4", "--microbatches", "8", "--vpp", "3")
    with pytest.raises(ConfigError, match="sum to 30"):
        run("plan", "layers", "--layers", "30", "--pp", "4", "--layout", "8,7,7,7")


def test_another_module_can_add_a_plan_subcommand():
    parser = argparse.ArgumentParser(prog="rayshard")
    commands = parser.add_subparsers(dest="command", required=True)
    plan_cli.register(commands)
    layout = plan_cli.plan_subcommands(commands).add_parser("layout")
    layout.set_defaults(run_command=lambda args: 7)
    args = parser.parse_args(["plan", "layout"])
    assert args.run_command(args) == 7
