"""The package layout pyproject.toml cannot state by itself: one import name, `rayshard`.

The repository keeps its layers at the root (plans/, storage/, actors/, cluster/, and configs/ as
data); the distribution installs them under `rayshard` and nothing else at top level, so no
generic name (`plans`, `cluster`) collides with a user's own. Everything else is in pyproject.toml.
"""
from setuptools import find_packages, setup

LAYERS = ("plans", "storage", "actors", "cluster")

setup(
    packages=["rayshard", "rayshard.configs"]
    + [f"rayshard.{name}" for name in find_packages(include=[f"{layer}*" for layer in LAYERS])],
    package_dir={"rayshard": "rayshard", "rayshard.configs": "configs", **{f"rayshard.{layer}": layer for layer in LAYERS}},
    package_data={"rayshard.configs": ["*.yaml"]},
)
