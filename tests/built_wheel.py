"""A wheel of rayshard built from a copy of the sources, for tests of what an installed user gets.

The build runs on a copy because setuptools writes build/ and an egg-info beside the sources."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("rayshard", "plans", "storage", "actors", "cluster", "configs", "setup.py", "pyproject.toml", "README.md")


def build_wheel(work: Path) -> Path:
    source, out = work / "source", work / "wheel"
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            source.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / name, source / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                           "--wheel-dir", str(out), str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = out.glob("rayshard-*.whl")
    return wheel


def unpack(wheel: Path, target: Path) -> Path:
    """The wheel's files as pip would place them in site-packages (pure Python: a plain unzip)."""
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(target)
    return target
