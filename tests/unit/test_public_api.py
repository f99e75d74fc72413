"""The public API (docs/api.md): every name in `rayshard.__all__` is there, documented, light to
import, and works on a real store."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import rayshard
from rayshard.plans.training.model_spec import preset
from tests.unit.checkpoint_factory import write_checkpoint

REPO = Path(__file__).resolve().parents[2]


def test_every_public_name_resolves_and_is_documented():
    documented = set(re.findall(r"`(\w+)", (REPO / "docs" / "api.md").read_text()))
    for name in rayshard.__all__:
        assert getattr(rayshard, name) is not None
        assert name in documented, f"{name} is in rayshard.__all__ but not in docs/api.md"
    assert len(set(rayshard.__all__)) == len(rayshard.__all__)


def test_importing_rayshard_loads_neither_torch_nor_ray_nor_pyarrow():
    """Every Ray worker and every `rayshard` command imports the package first: it must cost
    nothing until a public name is used."""
    probe = "import sys, rayshard\nprint(sorted(m for m in ('torch', 'ray', 'pyarrow') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_notebook_reads_a_store_through_the_public_names(tmp_path):
    write_checkpoint(str(tmp_path), "exp", preset("tiny"), steps=3)
    store = rayshard.Store(str(tmp_path))
    ref = store.resolve("exp")
    assert isinstance(ref, rayshard.CheckpointRef) and (ref.run, ref.step) == ("exp", 3)
    (entry,) = rayshard.Catalog(store).checkpoints("exp")
    assert isinstance(entry, rayshard.CheckpointEntry) and entry.whole and entry.step == 3 and entry.latest
    assert rayshard.Catalog(str(tmp_path)).table().column("step").to_pylist() == [3]
    with pytest.raises(rayshard.CheckpointError, match="exp@9"):
        store.resolve("exp@9")


def test_a_star_import_and_an_unknown_name_behave_as_for_any_module():
    namespace: dict = {}
    exec("from rayshard import *", namespace)
    assert set(rayshard.__all__) <= set(namespace)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        rayshard.Nope  # noqa: B018


def test_public_errors_share_one_base():
    assert issubclass(rayshard.ConfigError, rayshard.RayshardError)
    assert issubclass(rayshard.CheckpointError, rayshard.RayshardError)
    with pytest.raises(rayshard.ConfigError):
        rayshard.ParallelLayout(dp=0)


def test_the_checkpoint_module_is_public_and_loaded_only_when_named():
    probe = ("import sys, rayshard\nassert 'rayshard.checkpoint' not in sys.modules\n"
             "module = rayshard.checkpoint\nprint(sorted(module.__all__))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(sorted(["save", "async_save", "load", "plan", "LoadedCheckpoint", "LoadPlan", "RankPlan"]))
    documented = (REPO / "docs" / "api.md").read_text()
    assert all(f"`{name}(" in documented for name in ("save", "async_save", "load", "plan"))
