"""`rayshard train`: a config file from configs/ plus command-line overrides."""
from __future__ import annotations

import argparse
from importlib.resources import files

from rayshard.cluster.cli.arg_types import AT_LEAST_ONE, AT_LEAST_ZERO, NON_NEGATIVE, POSITIVE
from rayshard.cluster.cli.config_flags import add_config_flags
from rayshard.plans.config import TrainConfig

# configs/ ships as package data (rayshard.configs): found the same way in a checkout, an editable
# install and a wheel.
DEFAULT_CONFIG = str(files("rayshard.configs") / "demo.yaml")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """--config, then a flag per config field (generated: cluster/cli/config_flags.py), and
    --model-factory beside --model (a user's model is built by the CLI, not read from a field)."""
    parser.add_argument("--config", metavar="FILE", help="YAML config (default: configs/demo.yaml embedded defaults)")
    groups = add_config_flags(parser, TrainConfig)
    groups["model"].add_argument("--model-factory", metavar="PACKAGE.MODULE:FUNCTION",
                                 help="your own model: a function returning the module and its plan "
                                      "(e.g. examples.gpt2.model:tiny_gpt2; docs/own-models.md)")


def register(commands) -> None:
    parser = commands.add_parser("train", help="train a model on Ray rank actors",
                                 description="Train on Ray: one actor per rank, DP/FSDP x TP x PP, checkpoints to --store.")
    add_config_arguments(parser)
    elastic = parser.add_argument_group("elastic training (survive rank failures and topology changes)")
    elastic.add_argument("--elastic", action="store_true",
                         help="choose the layout from the ranks available; on failure or growth, resume from LATEST on a new layout")
    elastic.add_argument("--min-ranks", type=AT_LEAST_ONE, default=1, metavar="N")
    elastic.add_argument("--max-ranks", type=AT_LEAST_ONE, default=None, metavar="N")
    elastic.add_argument("--max-failures", type=AT_LEAST_ZERO, default=3, metavar="N")
    elastic.add_argument("--backoff-s", type=NON_NEGATIVE, default=1.0, metavar="S", help="first restart delay (doubles)")
    elastic.add_argument("--memory-gib", type=POSITIVE, default=64.0, metavar="GIB", help="memory budget per rank")
    parser.set_defaults(run_command="rayshard.cluster.cli.commands.train:run_train")
