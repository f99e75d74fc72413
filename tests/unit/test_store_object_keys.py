"""Manifest object keys that escape their checkpoint are refused; storage options from the
environment never carry credentials."""
import json

import pytest

from rayshard.storage.options import StorageOptions
from rayshard.plans.errors import CheckpointError, ConfigError
from rayshard.plans.checkpoint.manifest.object_keys import check_object_keys, escape_reason


@pytest.mark.parametrize("key", ["attempt-0a1b2c/rank-00000.safetensors", "attempt-x/sub/rank-00001.safetensors",
                                 "model-00001-of-00002.safetensors"])
def test_plain_relative_keys_are_accepted(key):
    assert escape_reason(key) is None


@pytest.mark.parametrize("key, reason", [
    ("../other-run/checkpoints/step-00000002/attempt-a/rank-00000.safetensors", "'..'"),
    ("attempt-a/../../x", "'..'"),
    ("/etc/passwd", "absolute"),
    ("s3://other-bucket/key", "another filesystem"),
    ("file:///etc/passwd", "another filesystem"),
    ("C:/Windows/x", "another filesystem"),
    ("attempt-a\\..\\x", "backslash"),
    ("attempt-a//rank", "empty"),
    ("./rank", "'.'"),
    ("", "empty"),
    ("attempt-a/rank\n", "control"),
])
def test_escaping_keys_are_refused_with_the_reason(key, reason):
    assert reason in escape_reason(key)
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        check_object_keys(["attempt-a/rank-00000.safetensors", key], "s3://b/run/checkpoints/step-00000002")


def test_storage_options_come_from_the_standard_variables_without_credentials():
    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9000", "AWS_REGION": "eu-west-1",
           "AWS_ACCESS_KEY_ID": "AKIA-SECRET-ID", "AWS_SECRET_ACCESS_KEY": "very-secret",
           "RAYSHARD_S3_PART_SIZE_MIB": "16", "RAYSHARD_S3_READ_TIMEOUT_S": "2.5"}
    options = StorageOptions.from_env(env)
    assert (options.endpoint_url, options.region, options.part_size_mib, options.read_timeout_s) == \
        ("http://127.0.0.1:9000", "eu-west-1", 16, 2.5)
    shipped = json.dumps(options.fsspec_conf())
    assert "very-secret" not in shipped and "AKIA-SECRET-ID" not in shipped
    assert StorageOptions.from_env({"AWS_ENDPOINT_URL_S3": "http://a:1", "AWS_ENDPOINT_URL": "http://b:2"}).endpoint_url == "http://a:1"


def test_bad_storage_settings_say_which_variable_to_fix():
    with pytest.raises(ConfigError, match="RAYSHARD_S3_MAX_CONCURRENCY"):
        StorageOptions.from_env({"RAYSHARD_S3_MAX_CONCURRENCY": "many"})
    with pytest.raises(ConfigError, match="at least 5 MiB"):
        StorageOptions.from_env({"RAYSHARD_S3_PART_SIZE_MIB": "1"})

