"""A YAML config file read into its mapping, every way it can fail named in one line (`rayshard
train --config`, `rayshard ckpt import --format dcp --config`)."""
from __future__ import annotations

import yaml

from rayshard.plans.errors import ConfigError


def read_config_file(path: str) -> dict:
    """A YAML config file's mapping, or a ConfigError naming the file and what is wrong with it."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle) or {}
    except FileNotFoundError:
        raise ConfigError("--config", path, "file not found", "pass an existing YAML file, e.g. configs/demo.yaml") from None
    except IsADirectoryError:
        raise ConfigError("--config", path, "is a directory", "pass a YAML file, e.g. configs/demo.yaml") from None
    except OSError as error:  # permissions, a broken disk: named as the file's, not the store's
        raise ConfigError("--config", path, f"cannot be read ({error.strerror or error})",
                          "pass a readable YAML file") from None
    except UnicodeDecodeError as error:
        raise ConfigError("--config", path, f"is not UTF-8 text (byte {error.start})",
                          "save the file as UTF-8 YAML") from None
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
        problem = getattr(error, "problem", None) or type(error).__name__
        raise ConfigError("--config", path, f"is not valid YAML{at}: {problem}",
                          "fix the file's syntax (see configs/demo.yaml)") from None
    if not isinstance(data, dict):
        raise ConfigError("--config", path, "the file must hold a YAML mapping", "see configs/demo.yaml for the shape")
    return data
