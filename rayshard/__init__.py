"""rayshard: distributed training on Ray, and checkpoints that any layout can resume.

The public API is what `__all__` names here, and the module `rayshard.checkpoint` (a DCP-shaped
`save` / `async_save` / `load` / `plan` for any training loop); docs/api.md lists both. Everything
else (`rayshard.plans`, `rayshard.storage`, `rayshard.actors`, `rayshard.cluster`) is internal and
may change between releases. Importing this package costs nothing: each public name is imported the first time it is
used (PEP 562), because every Ray worker and every `rayshard` command imports this package first,
and the catalog alone would bring pyarrow's dataset module (half a second) into each of them.
"""
import importlib as _importlib
from pathlib import Path as _Path

# The product's specification keeps the layers (plans/, storage/, actors/, cluster/) at the
# repository's root. An installed wheel maps them inside this package (setup.py's package_dir);
# a checkout used as it is (a `ray job submit --working-dir`, `python -m rayshard` from the
# repository) has them beside this folder, so the package also looks there.
_CHECKOUT = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).resolve().parent / "plans").is_dir() and (_CHECKOUT / "plans" / "__init__.py").is_file():
    __path__.append(str(_CHECKOUT))  # noqa: F821 (a package's own __path__)

__version__ = "0.1.0"

# Public name -> the module that defines it.
_PUBLIC = {
    # the catalog: what a store holds, and how a checkpoint is named
    "Catalog": "rayshard.cluster.catalog.catalog",
    "CheckpointEntry": "rayshard.cluster.catalog.catalog",
    "Leftover": "rayshard.cluster.catalog.catalog",
    "Store": "rayshard.cluster.catalog.store",
    "CheckpointRef": "rayshard.cluster.catalog.store",
    # layouts and the training configuration
    "ParallelLayout": "rayshard.plans.layout.parallel_layout",
    **{name: "rayshard.plans.config" for name in (
        "TrainConfig", "ModelChoice", "PipelineConfig", "NumericsConfig", "DataConfig", "OptimizerConfig",
        "CheckpointConfig", "ResourcesConfig", "MetricsConfig")},
    # what rayshard raises for bad input and damaged checkpoints
    **{name: "rayshard.plans.errors" for name in ("RayshardError", "ConfigError", "CheckpointError")},
}
__all__ = list(_PUBLIC)


# Public modules: `rayshard.checkpoint` imports torch, so it is loaded when first named.
_PUBLIC_MODULES = ("checkpoint",)


def __getattr__(name: str):
    if name in _PUBLIC_MODULES:
        return _importlib.import_module(f"rayshard.{name}")
    if name not in _PUBLIC:
        raise AttributeError(f"module 'rayshard' has no attribute {name!r}")
    value = getattr(_importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
