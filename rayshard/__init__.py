"""rayshard: distributed training on Ray, and checkpoints that any layout can resume.

The public API is what `__all__` names here and in the modules `docs/api.md` lists; everything
else (`rayshard.plans`, `rayshard.storage`, `rayshard.actors`, `rayshard.cluster`) is internal
and may change between releases. Importing this package is light (no torch, no Ray), so
`rayshard --help` and notebooks that only look at a store stay fast.
"""
from pathlib import Path as _Path

# The product's specification keeps the layers (plans/, storage/, actors/, cluster/) at the
# repository's root. An installed wheel maps them inside this package (setup.py's package_dir);
# a checkout used as it is (a `ray job submit --working-dir`, `python -m rayshard` from the
# repository) has them beside this folder, so the package also looks there.
_CHECKOUT = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).resolve().parent / "plans").is_dir() and (_CHECKOUT / "plans" / "__init__.py").is_file():
    __path__.append(str(_CHECKOUT))  # noqa: F821 (a package's own __path__)

from rayshard.cluster.catalog.catalog import Catalog, CheckpointEntry, Leftover  # noqa: E402
from rayshard.cluster.catalog.store import CheckpointRef, Store  # noqa: E402
from rayshard.plans.config import (  # noqa: E402
    CheckpointConfig, DataConfig, MetricsConfig, ModelChoice, NumericsConfig, OptimizerConfig, PipelineConfig,
    ResourcesConfig, TrainConfig)
from rayshard.plans.errors import CheckpointError, ConfigError, RayshardError  # noqa: E402
from rayshard.plans.layout.parallel_layout import ParallelLayout  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    # the catalog: what a store holds, and how a checkpoint is named
    "Catalog", "CheckpointEntry", "Leftover", "Store", "CheckpointRef",
    # layouts and the training configuration
    "ParallelLayout", "TrainConfig", "ModelChoice", "PipelineConfig", "NumericsConfig", "DataConfig",
    "OptimizerConfig", "CheckpointConfig", "ResourcesConfig", "MetricsConfig",
    # what rayshard raises for bad input and damaged checkpoints
    "RayshardError", "ConfigError", "CheckpointError",
]
