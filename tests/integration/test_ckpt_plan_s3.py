"""`rayshard ckpt plan` on an object store (the S3 test server) of the checkpoints issue 38 brings in:
one imported from a torchtitan-named `dcp.save`, and one `rayshard.checkpoint.save` wrote with its
model recorded. The dry run says, per new rank, how many bytes it reads in how many requests, with
the tp groups' banded reads planned as the load makes them (decision 146): every kind at 1.000x."""
from __future__ import annotations

import re

import pytest
import torch.distributed.checkpoint as dcp

import rayshard.checkpoint as ckpt
from rayshard.cluster.cli.main import main
from tests.integration.test_api_checkpoint_tools import _state_dict
from tests.unit.checkpoint_factory import write_checkpoint
from tests.unit.test_dcp_interop import CONFIG, _dcp_state


def _plan(capsys, store: str, run: str) -> list[str]:
    assert main(["ckpt", "plan", run, "--store", store, "--to", "fsdp=2,tp=2"]) == 0
    return capsys.readouterr().out.splitlines()


@pytest.mark.slow  # the banded loads it plans are tested in the default suite (decision 178)
def test_a_dcp_import_and_an_api_save_plan_on_s3_per_rank_with_banded_reads(s3_store, tmp_path, capsys):
    url, _, _ = write_checkpoint(str(tmp_path / "store"), "src", CONFIG, steps=2)
    dcp.save(_dcp_state(url, 2, "torchtitan"), checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert main(["ckpt", "import", str(tmp_path / "dcp"), "--format", "dcp", "--model", "tiny", "--run", "imported",
                 "--store", s3_store, "--quiet"]) == 0
    ckpt.save(_state_dict(url, "rayshard"), f"{s3_store}/api", step=2, model={"preset": "tiny"})
    capsys.readouterr()
    for run in ("imported", "api"):
        out = _plan(capsys, s3_store, run)
        assert out[0] == f"reshard plan for {s3_store}/{run}/checkpoints/step-00000002", out[0]
        ranks = [line.split() for line in out if re.match(r"^\s+[0-3]\s+pp0 dp0 fsdp[01] tp[01]\s", line)]
        assert [int(row[0]) for row in ranks] == [0, 1, 2, 3], out
        # needed MiB, read MiB, received MiB (the columns the group's members read), requests
        assert all(float(row[6]) > 0 and float(row[7]) > 0 and float(row[8]) > 0 and int(row[9]) > 0
                   for row in ranks), ranks
        assert "param 1.000x, exp_avg 1.000x, exp_avg_sq 1.000x" in "\n".join(out)
        total = next(line for line in out if line.strip().startswith("total:"))
        assert "tp ranks by scatter" in total and float(re.search(r"\((\d\.\d+)x;", total).group(1)) <= 1.05, total
