"""deploy/ manifests parse, and the fields that must agree across them do."""
import json
import re
import shlex
from pathlib import Path

import yaml

from cluster.cli.main import build_parser

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PYPROJECT = (DEPLOY.parent / "pyproject.toml").read_text()


def _yaml(name):
    return yaml.safe_load((DEPLOY / name).read_text())


def _containers(spec):
    found = []
    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "containers":
                    found.extend(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)
    walk(spec)
    return found


def test_every_manifest_uses_one_image_and_the_pinned_ray_version():
    ray_pin = re.search(r'"ray\[default\]==([\d.]+)"', PYPROJECT).group(1)
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert f"rayproject/ray:{ray_pin}-" in dockerfile and "torch==2.13.0" in dockerfile
    images = {_yaml("ray-cluster-aws.yaml")["docker"]["image"]}
    for name in ("kuberay-raycluster.yaml", "kuberay-rayjob.yaml"):
        manifest = _yaml(name)
        images |= {c["image"] for c in _containers(manifest)}
        spec = manifest["spec"].get("rayClusterSpec", manifest["spec"])
        assert spec["rayVersion"] == ray_pin
    assert len(images) == 1, images


def test_auth_mode_and_region_are_set_on_every_ray_process():
    for name in ("kuberay-raycluster.yaml", "kuberay-rayjob.yaml"):
        for container in _containers(_yaml(name)):
            env = {e["name"]: e["value"] for e in container["env"]}
            assert env["RAY_AUTH_MODE"] == "token" and env["AWS_DEFAULT_REGION"] == "us-east-1"
    launcher = _yaml("ray-cluster-aws.yaml")
    for command in launcher["head_start_ray_commands"] + launcher["worker_start_ray_commands"]:
        if "ray start" in command:
            assert "RAY_AUTH_MODE=token" in command
    runtime_env = _yaml("runtime_env.yaml")
    assert runtime_env["env_vars"]["AWS_DEFAULT_REGION"] == "us-east-1"
    assert set(yaml.safe_load(_yaml("kuberay-rayjob.yaml")["spec"]["runtimeEnvYAML"])["env_vars"]) <= set(runtime_env["env_vars"])


def test_job_entrypoint_is_a_valid_rayshard_command_on_the_policy_bucket():
    entrypoint = shlex.split(_yaml("kuberay-rayjob.yaml")["spec"]["entrypoint"])
    assert entrypoint[:4] == ["python", "-m", "cluster", "train"]
    args = build_parser().parse_args(entrypoint[3:])
    assert (DEPLOY.parent / args.config).exists()
    bucket, prefix = re.match(r"s3://([^/]+)/(.+)", args.store).groups()
    policy = json.loads((DEPLOY / "s3-iam-policy.json").read_text())
    resources = [r for statement in policy["Statement"] for r in ([statement["Resource"]] if isinstance(statement["Resource"], str) else statement["Resource"])]
    assert f"arn:aws:s3:::{bucket}" in resources and f"arn:aws:s3:::{bucket}/{prefix}/*" in resources
    # Least privilege: object actions only under the prefix, no bucket-wide or admin actions.
    for statement in policy["Statement"]:
        assert statement["Effect"] == "Allow"
        assert all(action.startswith("s3:") and "*" not in action for action in statement["Action"])


def test_s3_compatible_settings_name_the_standard_variables_without_secrets():
    text = (DEPLOY / "s3-compatible.env").read_text()
    names = {line.split("=", 1)[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= names
    assert "<from your secret store>" in text
