"""deploy/ files, rendered with example values, validate against the real schemas and start.

Schemas are vendored in tests/data/deploy-schemas/ (README there: source, version, digest):
KubeRay's RayCluster and RayJob CRDs, Ray's cluster-launcher schema, Kubernetes' ServiceAccount.
Beyond the schemas, each test checks what a schema cannot see but a cluster needs to start: a
token on every Ray path, the ServiceAccount that pods and the autoscaler name, /dev/shm, head
requests, an IAM policy that grants exactly the S3 calls rayshard makes (and a policy linter
with zero findings), and a launcher head that may launch its workers.
"""
from __future__ import annotations

import ast
import copy
import functools
import gzip
import importlib.resources
import importlib.util
import json
import re
import shlex
import sys
import types
from pathlib import Path

import botocore.session
import jsonschema
import pytest
import yaml
from botocore import xform_name
from botocore.validate import ParamValidator

from rayshard.cluster.cli.main import build_parser
from rayshard.storage.backends.s3_calls import S3_OPERATIONS

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
SCHEMAS = REPO / "tests" / "data" / "deploy-schemas"
KUBERAY_VERSIONS = ("v1.5.2", "v1.7.0")
IMAGE_HOME = "/home/ray/rayshard"  # the Dockerfile's WORKDIR: where the image holds the repository
Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

EXAMPLE_VALUES = {
    "RAYSHARD_AWS_ACCOUNT_ID": "123456789012",
    "RAYSHARD_AWS_REGION": "eu-west-2",
    "RAYSHARD_BUCKET": "example-rayshard-ckpts",
    "RAYSHARD_IMAGE_REGISTRY": "123456789012.dkr.ecr.eu-west-2.amazonaws.com/ml",
    "RAYSHARD_AMI": "ami-0123456789abcdef0",
    "RAYSHARD_EKS_CLUSTER": "ml-prod",
    "RAYSHARD_AZURE_SUBSCRIPTION_ID": "0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9",
    "RAYSHARD_AZURE_RESOURCE_GROUP": "ml-prod",
    "RAYSHARD_AZURE_STORAGE_ACCOUNT": "examplerayshard",
    "RAYSHARD_AZURE_CONTAINER": "example-rayshard-ckpts",
}


def _load_render():
    spec = importlib.util.spec_from_file_location("deploy_render", DEPLOY / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _load_render()


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("rendered")
    written, skipped = render.render(out, EXAMPLE_VALUES)
    assert not skipped, skipped
    return {path.name: path.read_text() for path in written}


def _docs(rendered, name) -> list[dict]:
    return [doc for doc in yaml.load_all(rendered[name], Loader=Loader) if doc]


def _one(rendered, name, kind) -> dict:
    [doc] = [doc for doc in _docs(rendered, name) if doc["kind"] == kind]
    return doc


def _cluster_spec(manifest: dict) -> dict:
    return manifest["spec"]["rayClusterSpec"] if manifest["kind"] == "RayJob" else manifest["spec"]


def _pod_specs(cluster_spec: dict):
    yield "head", cluster_spec["headGroupSpec"]["template"]["spec"]
    for group in cluster_spec["workerGroupSpecs"]:
        yield group["groupName"], group["template"]["spec"]


# ---- values in one place -------------------------------------------------------------------


def test_every_user_value_is_named_once_in_values_env_and_nothing_else_is_left_to_edit():
    declared = render.read_values(DEPLOY / "values.env", environ={})
    assert set(declared) == set(EXAMPLE_VALUES) == set(render.FORMATS)
    used = set().union(*(render.placeholders(path.read_text()) for path in render.templates()))
    assert used <= set(declared), used - set(declared)
    for path in render.templates():  # the old scattered example values are gone
        if path.name == "s3-compatible.env":  # MinIO's own default region, an example to copy
            continue
        assert not re.search(r"REPLACE|my-rayshard-bucket|ghcr\.io/rayshard|us-east-1", path.read_text()), path.name


def test_render_refuses_an_impossible_value_and_names_what_a_file_still_needs(tmp_path):
    env = tmp_path / "values.env"
    env.write_text("RAYSHARD_AWS_ACCOUNT_ID=12345\n")
    with pytest.raises(SystemExit, match="12-digit"):
        render.read_values(env, environ={})
    written, skipped = render.render(tmp_path / "out", {"RAYSHARD_AWS_REGION": "us-east-1"}, ["ray-cluster-aws.yaml"])
    assert not written and "RAYSHARD_AMI" in skipped[0]
    rendered = render.render_text("ray start --address=$RAY_HEAD_IP:6379 ${RAYSHARD_AWS_REGION}", {"RAYSHARD_AWS_REGION": "x"})
    assert rendered == "ray start --address=$RAY_HEAD_IP:6379 x"  # shell variables pass through


# ---- KubeRay ------------------------------------------------------------------------------------


def _strict(schema):
    """Kubernetes prunes unknown fields (kubectl's strict field validation rejects them); in
    JSON Schema terms every object with properties gets additionalProperties: false."""
    if isinstance(schema, dict):
        schema = {key: _strict(value) for key, value in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    return schema


@functools.lru_cache(maxsize=None)
def _crd_validator(version: str, kind: str):
    plural = {"RayCluster": "rayclusters", "RayJob": "rayjobs"}[kind]
    with gzip.open(SCHEMAS / f"kuberay-{version}" / f"ray.io_{plural}.yaml.gz", "rt") as handle:
        crd = yaml.load(handle, Loader=Loader)
    assert crd["spec"]["names"]["kind"] == kind
    [served] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _strict(served["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}  # the API server's ObjectMeta, checked below
    return jsonschema.Draft4Validator(schema)


@functools.lru_cache(maxsize=None)
def _service_account_validator():
    schema = json.loads((SCHEMAS / "kubernetes-v1.33.0" / "serviceaccount-v1-strict.json").read_text())
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize("version", KUBERAY_VERSIONS)
@pytest.mark.parametrize("name, kind", [("kuberay-raycluster.yaml", "RayCluster"), ("kuberay-rayjob.yaml", "RayJob")])
def test_kuberay_manifests_validate_against_the_crds(rendered, version, name, kind):
    docs = _docs(rendered, name)
    assert [doc["kind"] for doc in docs] == ["ServiceAccount", kind], "the ServiceAccount is applied first"
    for doc in docs:
        validator = _service_account_validator() if doc["kind"] == "ServiceAccount" else _crd_validator(version, kind)
        errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]
        assert not errors, errors
        assert re.fullmatch(r"[a-z]([-a-z0-9]{0,45}[a-z0-9])?", doc["metadata"]["name"])  # DNS-1035, KubeRay's 47


@pytest.mark.parametrize("name", ["kuberay-raycluster.yaml", "kuberay-rayjob.yaml"])
def test_kuberay_token_auth_is_on_and_left_to_the_operator(rendered, name):
    manifest = next(doc for doc in _docs(rendered, name) if doc["kind"] in ("RayCluster", "RayJob"))
    spec = _cluster_spec(manifest)
    assert spec["authOptions"] == {"mode": "token"}
    version = tuple(map(int, spec["rayVersion"].split(".")))
    assert version >= (2, 52, 0), "KubeRay's token mode needs Ray 2.52 or later"
    for group, pod in _pod_specs(spec):
        for container in pod["containers"]:
            names = {env["name"] for env in container.get("env", [])}
            # KubeRay injects RAY_AUTH_MODE and RAY_AUTH_TOKEN (from its Secret); a second copy
            # here would fight it, and a token in a manifest would be a secret in git.
            assert not names & {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"}, (group, names)


@pytest.mark.parametrize("name", ["kuberay-raycluster.yaml", "kuberay-rayjob.yaml"])
def test_kuberay_pods_name_a_service_account_the_file_creates_with_its_iam_role(rendered, name):
    docs = _docs(rendered, name)
    accounts = {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == "ServiceAccount"}
    spec = _cluster_spec(next(doc for doc in docs if doc["kind"] in ("RayCluster", "RayJob")))
    for group, pod in _pod_specs(spec):
        account = accounts[pod["serviceAccountName"]]
        role = account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"]
        assert role == f"arn:aws:iam::{EXAMPLE_VALUES['RAYSHARD_AWS_ACCOUNT_ID']}:role/rayshard-s3", group


@pytest.mark.parametrize("name", ["kuberay-raycluster.yaml", "kuberay-rayjob.yaml"])
def test_kuberay_pods_get_shm_requests_and_a_scaling_range_that_means_something(rendered, name):
    spec = _cluster_spec(next(doc for doc in _docs(rendered, name) if doc["kind"] in ("RayCluster", "RayJob")))
    for group, pod in _pod_specs(spec):
        [container] = pod["containers"]
        requests = container["resources"]["requests"]
        assert {"cpu", "memory"} <= set(requests), group
        assert container["resources"]["limits"]["memory"] == requests["memory"], group  # no OOM-kill surprises
        mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory", group
    autoscaling = spec.get("enableInTreeAutoscaling", False)
    for group in spec["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert autoscaling or group["minReplicas"] == group["maxReplicas"], \
            f"{group['groupName']}: maxReplicas above minReplicas does nothing without enableInTreeAutoscaling"
        gpus = int(group["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", 0))
        assert gpus == 8


def test_the_rayjob_runs_the_readme_command_on_the_policy_bucket(rendered):
    job = _one(rendered, "kuberay-rayjob.yaml", "RayJob")
    entrypoint = shlex.split(job["spec"]["entrypoint"])
    assert entrypoint[:4] == ["python", "-m", "rayshard", "train"]
    args = build_parser().parse_args(entrypoint[3:])
    assert args.elastic and args.resume == "auto"
    assert args.config.startswith(IMAGE_HOME + "/") and (REPO / args.config[len(IMAGE_HOME) + 1:]).is_file()
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert f"WORKDIR {IMAGE_HOME}" in dockerfile and "COPY --chown=ray:users configs ./configs" in dockerfile
    bucket, prefix = re.fullmatch(r"s3://([^/]+)/(.+)", args.store).groups()
    assert bucket == EXAMPLE_VALUES["RAYSHARD_BUCKET"]
    resources = {r for s in json.loads(rendered["s3-iam-policy.json"])["Statement"] for r in _as_list(s["Resource"])}
    assert {f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/{prefix}/*"} <= resources
    readme = _cluster_guide()
    assert "--resume auto --elastic" in readme and f"--run {args.run}" in readme


def test_every_manifest_uses_one_image_and_the_pinned_ray_version(rendered):
    pyproject = (REPO / "pyproject.toml").read_text()
    ray_pin = re.search(r'"ray\[[a-z,]+\]==([\d.]+)"', pyproject).group(1)  # ray[default,data]==X
    version = re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1)
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert f"FROM rayproject/ray:{ray_pin}-" in dockerfile and "torch==2.13.0" in dockerfile
    images = {yaml.load(rendered["ray-cluster-aws.yaml"], Loader=Loader)["docker"]["image"]}
    for name in ("kuberay-raycluster.yaml", "kuberay-rayjob.yaml"):
        spec = _cluster_spec(next(d for d in _docs(rendered, name) if d["kind"] in ("RayCluster", "RayJob")))
        assert spec["rayVersion"] == ray_pin
        images |= {c["image"] for _, pod in _pod_specs(spec) for c in pod["containers"]}
    assert images == {f"{EXAMPLE_VALUES['RAYSHARD_IMAGE_REGISTRY']}/rayshard:{version}"}


# ---- Ray cluster launcher -------------------------------------------------------------------


def _launcher(rendered) -> dict:
    return yaml.load(rendered["ray-cluster-aws.yaml"], Loader=Loader)


def test_launcher_config_validates_against_rays_schema_and_rays_own_check(rendered):
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = _launcher(rendered)
    schema = json.loads((SCHEMAS / "ray-2.60.0" / "ray-schema.json").read_text())
    jsonschema.validate(config, schema)
    validate_config(prepare_config(copy.deepcopy(config)))  # the installed Ray's defaults and check


def test_vendored_launcher_schema_is_the_installed_rays():
    import ray

    if ray.__version__ != "2.60.0":
        pytest.skip(f"ray {ray.__version__} installed: re-vendor its ray-schema.json (see the schemas README)")
    installed = Path(ray.__file__).parent / "autoscaler" / "ray-schema.json"
    assert installed.read_bytes() == (SCHEMAS / "ray-2.60.0" / "ray-schema.json").read_bytes()


def test_launcher_node_configs_are_valid_run_instances_requests(rendered):
    session = botocore.session.get_session()
    ec2 = session.get_service_model("ec2", api_version="2016-11-15")
    shape = ec2.operation_model("RunInstances").input_shape
    for name, node_type in _launcher(rendered)["available_node_types"].items():
        request = {"MinCount": 1, "MaxCount": 1, **node_type["node_config"]}  # Ray adds the counts
        report = ParamValidator().validate(request, shape)
        assert not report.has_errors(), (name, report.generate_report())


def test_launcher_gives_every_node_the_token_and_keeps_the_dashboard_behind_ssh(rendered):
    config = _launcher(rendered)
    options = dict(o.split(None, 1)[1].split("=", 1) for o in config["docker"]["run_options"] if o.startswith("--env "))
    assert options["RAY_AUTH_MODE"] == "token"
    token_path = options["RAY_AUTH_TOKEN_PATH"]
    assert config["file_mounts"][token_path] == "~/.ray/auth_token"  # copied to the head, then to every worker
    assert options["AWS_DEFAULT_REGION"] == EXAMPLE_VALUES["RAYSHARD_AWS_REGION"]
    commands = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    assert any(c.startswith("ray start --head") for c in commands)
    for command in commands:
        assert "RAY_AUTH" not in command  # nothing overrides the container's token settings
        assert "--dashboard-host" not in command, "8265 stays on the head's localhost; `ray dashboard` tunnels to it"
    readme = _cluster_guide()
    assert "ray get-auth-token --generate" in readme and "ray dashboard deploy/rendered/ray-cluster-aws.yaml" in readme


def test_launcher_head_may_launch_its_workers_and_pass_only_their_role(rendered):
    config = _launcher(rendered)
    account = EXAMPLE_VALUES["RAYSHARD_AWS_ACCOUNT_ID"]
    profiles = {name: t["node_config"]["IamInstanceProfile"]["Arn"] for name, t in config["available_node_types"].items()}
    assert profiles == {"head": f"arn:aws:iam::{account}:instance-profile/rayshard-head",
                        "gpu_8x": f"arn:aws:iam::{account}:instance-profile/rayshard-worker"}
    policy = json.loads(rendered["ray-launcher-head-iam-policy.json"])
    granted = {action for s in policy["Statement"] for action in _as_list(s["Action"])}
    # What Ray's AWS node provider calls on the head (ray/autoscaler/_private/aws/node_provider.py).
    assert granted == {"ec2:RunInstances", "ec2:CreateTags", "ec2:DescribeInstances", "ec2:DescribeInstanceTypes",
                       "ec2:TerminateInstances", "iam:PassRole"}
    [pass_role] = [s for s in policy["Statement"] if "iam:PassRole" in _as_list(s["Action"])]
    assert pass_role["Resource"] == f"arn:aws:iam::{account}:role/rayshard-worker"
    [terminate] = [s for s in policy["Statement"] if "ec2:TerminateInstances" in _as_list(s["Action"])]
    assert terminate["Condition"]["StringEquals"] == {"ec2:ResourceTag/ray-cluster-name": config["cluster_name"]}
    trust = json.loads(rendered["ec2-trust-policy.json"])
    [statement] = trust["Statement"]
    assert statement["Principal"] == {"Service": "ec2.amazonaws.com"} and statement["Action"] == "sts:AssumeRole"


# ---- runtime_env ------------------------------------------------------------------------------


def test_runtime_envs_are_valid_and_the_rayjob_sets_what_the_launcher_path_sets(rendered):
    from ray.runtime_env import RuntimeEnv

    runtime_env = yaml.load(rendered["runtime_env.yaml"], Loader=Loader)
    RuntimeEnv(**runtime_env)
    job_env = yaml.safe_load(_one(rendered, "kuberay-rayjob.yaml", "RayJob")["spec"]["runtimeEnvYAML"])
    RuntimeEnv(**job_env)
    assert job_env["env_vars"] == runtime_env["env_vars"]
    assert runtime_env["env_vars"]["AWS_DEFAULT_REGION"] == EXAMPLE_VALUES["RAYSHARD_AWS_REGION"]
    assert ".venv" in runtime_env["excludes"] and runtime_env["working_dir"] == "."


# ---- IAM ------------------------------------------------------------------------------------------

# The IAM action each S3 API operation is authorized by (AWS Service Authorization Reference,
# "Actions defined by Amazon S3"; HeadObject and HeadBucket are authorized as GetObject and
# ListBucket). An operation added to storage/backends/s3_calls.py and missing here fails the test.
IAM_ACTION_FOR = {
    "ListObjectsV2": "s3:ListBucket",
    "ListObjects": "s3:ListBucket",
    "HeadBucket": "s3:ListBucket",
    "HeadObject": "s3:GetObject",
    "GetObject": "s3:GetObject",
    "PutObject": "s3:PutObject",
    "CreateMultipartUpload": "s3:PutObject",
    "UploadPart": "s3:PutObject",
    "CompleteMultipartUpload": "s3:PutObject",
    "AbortMultipartUpload": "s3:AbortMultipartUpload",
    "ListMultipartUploads": "s3:ListBucketMultipartUploads",
    "ListParts": "s3:ListMultipartUploadParts",
    "DeleteObject": "s3:DeleteObject",
    "DeleteObjects": "s3:DeleteObject",
}
BUCKET_ACTIONS = {"s3:ListBucket", "s3:ListBucketMultipartUploads"}
LAYERS = ("plans", "storage", "actors", "cluster")  # every module is scanned for direct botocore calls


def _as_list(value):
    return [value] if isinstance(value, str) else list(value)


@functools.lru_cache(maxsize=None)
def _parliament():
    # parliament 1.6.4 locates its data with pkg_resources, which setuptools 81+ no longer ships.
    if importlib.util.find_spec("pkg_resources") is None:
        shim = types.ModuleType("pkg_resources")
        shim.resource_filename = lambda package, name: str(importlib.resources.files(package) / name)
        sys.modules["pkg_resources"] = shim
    from parliament import analyze_policy_string

    return analyze_policy_string


@pytest.mark.parametrize("name", ["s3-iam-policy.json", "ray-launcher-head-iam-policy.json", "ecr-pull-iam-policy.json"])
def test_iam_policies_have_no_linter_findings(rendered, name):
    findings = _parliament()(rendered[name]).findings
    assert not findings, [(f.issue, f.detail, f.location) for f in findings]


def test_the_linter_knows_condition_keys_per_action():
    # The policy this issue fixed: s3:prefix is not a condition key of ListBucketMultipartUploads,
    # so the condition never matched and `ckpt gc` got AccessDenied listing pending uploads.
    broken = {"Version": "2012-10-17", "Statement": [{
        "Effect": "Allow", "Action": ["s3:ListBucket", "s3:ListBucketMultipartUploads"],
        "Resource": "arn:aws:s3:::b", "Condition": {"StringLike": {"s3:prefix": ["runs/*"]}}}]}
    issues = {(f.issue, f.detail) for f in _parliament()(json.dumps(broken)).findings}
    assert ("UNKNOWN_CONDITION_FOR_ACTION", "Unknown condition s3:prefix for action s3:ListBucketMultipartUploads") in issues


def test_s3_policy_grants_exactly_the_actions_of_rayshards_s3_calls(rendered):
    needed = {IAM_ACTION_FOR[operation] for operation in S3_OPERATIONS}
    policy = json.loads(rendered["s3-iam-policy.json"])
    bucket = EXAMPLE_VALUES["RAYSHARD_BUCKET"]
    granted = set()
    for statement in policy["Statement"]:
        assert statement["Effect"] == "Allow" and "Condition" not in statement and "NotAction" not in statement
        actions = set(_as_list(statement["Action"]))
        assert all(re.fullmatch(r"s3:[A-Za-z]+", action) for action in actions), actions  # no wildcards
        expected = [f"arn:aws:s3:::{bucket}"] if actions <= BUCKET_ACTIONS else [f"arn:aws:s3:::{bucket}/runs/*"]
        assert _as_list(statement["Resource"]) == expected, statement["Sid"]
        granted |= actions
    assert granted == needed, {"missing": needed - granted, "extra": granted - needed}


def test_s3_call_list_names_real_operations_and_every_direct_call_in_the_code():
    model = botocore.session.get_session().get_service_model("s3")
    operations = set(model.operation_names)
    assert set(S3_OPERATIONS) <= operations and len(set(S3_OPERATIONS)) == len(S3_OPERATIONS)
    by_method = {xform_name(name): name for name in operations}
    listed = {xform_name(name) for name in S3_OPERATIONS}
    seen = set()
    for path in sorted(p for layer in LAYERS for p in (REPO / layer).rglob("*.py")):
        tree = ast.parse(path.read_text())
        literals = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}
        direct = literals & set(by_method)
        assert direct <= listed, f"{path.relative_to(REPO)} calls {sorted(direct - listed)}: add them to storage/backends/s3_calls.py"
        seen |= direct
    assert {"get_object", "put_object", "list_multipart_uploads", "abort_multipart_upload"} <= seen  # the scan sees the calls


# ---- the rest ---------------------------------------------------------------------------------


def test_docker_build_context_leaves_out_local_state_but_not_what_the_image_copies():
    ignored = [line for line in (REPO / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    assert {".venv", ".git", "/runs", "deploy/values.env"} <= set(ignored)
    copied = re.findall(r"^COPY\s+(?:--\S+\s+)*(.+?)\s+\S+$", (DEPLOY / "Dockerfile").read_text(), re.M)
    for source in " ".join(copied).split():
        assert source not in ignored and (REPO / source).exists(), source


def test_s3_compatible_settings_name_the_standard_variables_without_secrets():
    text = (DEPLOY / "s3-compatible.env").read_text()
    names = {line.split("=", 1)[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= names
    assert "<from your secret store>" in text


def _cluster_guide() -> str:
    """The cluster guide (docs/clusters.md), whole: the README links to it."""
    return (REPO / "docs" / "clusters.md").read_text()


def test_cluster_guide_walks_both_paths_in_order_with_the_token_and_the_dashboard():
    section = _cluster_guide()
    kuberay = section.index("### Kubernetes with KubeRay")
    launcher = section.index("### AWS with the Ray cluster launcher")
    steps = {
        0: ["deploy/values.env", "python deploy/render.py", "docker build", "docker push", "### Kubernetes with KubeRay"],
        kuberay: ["eksctl create iamserviceaccount", "kubectl apply -f deploy/rendered/kuberay-raycluster.yaml",
                  "kubectl get secret rayshard", "kubectl port-forward", "ray job submit",
                  "kubectl apply -f deploy/rendered/kuberay-rayjob.yaml", "### AWS with the Ray cluster launcher"],
        launcher: ["ray get-auth-token --generate", "aws iam create-role", "ray-launcher-head-iam-policy.json",
                   "ray up deploy/rendered/ray-cluster-aws.yaml", "ray dashboard deploy/rendered/ray-cluster-aws.yaml",
                   "ray job submit", "ray down"],
    }
    for start, expected in steps.items():
        positions = [section.index(step, start) for step in expected]
        assert positions == sorted(positions), [step for step, _ in sorted(zip(expected, positions), key=lambda p: p[1])]
    for name in re.findall(r"deploy/(?:rendered/)?([\w.-]+\.(?:yaml|json|env|py))", section):
        assert (DEPLOY / name).is_file(), name
