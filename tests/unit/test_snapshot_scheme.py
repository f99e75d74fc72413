"""`rayshard-snapshot://` is served from a source tree too, not only from an installed rayshard.

The `fsspec.specs` entry point exists only where rayshard is pip-installed; the lent GPU machine
runs the tree from PYTHONPATH, and there every snapshot failed with "Protocol not known". The rank
and the driver import the filesystem module, which registers the scheme itself.
"""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import sys
import fsspec
registry = sys.modules["fsspec.registry"]  # the module (`fsspec.registry` the attribute is a mapping)
registry.known_implementations.pop("rayshard-snapshot", None)  # as without the installed entry point
registry._registry.pop("rayshard-snapshot", None)
import {module}
print(registry.get_filesystem_class("rayshard-snapshot").__name__)
"""


def _served_after_importing(module: str) -> str:
    done = subprocess.run([sys.executable, "-c", CHECK.format(module=module)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


@pytest.mark.slow  # decision 200: the scheme's other cases and the snapshot e2e runs cover a rank's reads
def test_a_rank_serves_snapshots_without_the_entry_point():
    assert _served_after_importing("rayshard.actors.rank") == "SnapshotFileSystem"


def test_the_driver_serves_snapshots_without_the_entry_point():
    assert _served_after_importing("rayshard.cluster.run.snapshots") == "SnapshotFileSystem"
