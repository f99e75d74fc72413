"""How every driver-side command reaches Ray: the cluster `ray job submit` named, or a local one.

One module for the training driver, the elastic controller, offline reshards and `data prepare`,
none of which should import another's machinery to connect.
"""
from __future__ import annotations

import atexit
import os
import secrets
import tempfile
from pathlib import Path

import ray

from rayshard.plans.errors import ResourcesUnavailable

LOCAL_START_WAIT_S = 120.0


def connect_ray(start_timeout_s: float | None = None) -> None:
    """Join the cluster named by RAY_ADDRESS (set by `ray job submit`), else start a local one.

    "local" explicitly: a bare `ray.init()` also joins whatever cluster `ray start` (or a test's
    cluster) last left on this machine, and a run would land on it, its ranks then killed with it
    ("actor creation cancelled"), instead of on its own Ray.

    start_timeout_s (the run's --start-timeout) lengthens a local start's wait, never shortens it
    below LOCAL_START_WAIT_S. A start or join that fails is one line (ResourcesUnavailable), not
    Ray's traceback: under load a local node's start can time out, and the fix is the user's."""
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS") or "local"
    if address == "local":
        # A local start waits 120 s (Ray's default is 30) for its new GCS to come up: on a
        # loaded machine the first start from a fresh environment took longer, and the run died
        # of it. Not when joining a cluster: the same setting is Ray's count of connection
        # retries, and a dead address would then take two minutes to fail instead of 20 s.
        wait = max(LOCAL_START_WAIT_S, start_timeout_s or 0.0)
        os.environ.setdefault("RAY_gcs_server_port_wait_time_s", f"{wait:.0f}")
    try:
        ray.init(address=address, logging_level="WARNING", log_to_driver=True,
                 include_dashboard=False, configure_logging=True)
    except Exception as error:  # Ray raises RuntimeError, ConnectionError or its own kinds here
        detail = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        if address == "local":
            raise ResourcesUnavailable(
                f"a local Ray could not be started ({type(error).__name__}: {detail}). Fix: retry when the machine is "
                "less loaded, pass a longer --start-timeout, or start Ray yourself (`ray start --head`) and set "
                "RAY_ADDRESS") from None
        raise ResourcesUnavailable(
            f"could not join the Ray cluster at RAY_ADDRESS={address} ({type(error).__name__}: {detail}). Fix: check "
            "that the cluster is up and the address is right (`ray status --address ...`), or unset RAY_ADDRESS to "
            "start a local Ray") from None


def ensure_auth_token() -> None:
    """Under RAY_AUTH_MODE=token with no token anywhere, make one for the clusters this process
    starts. A local ray.init writes ~/.ray/auth_token itself, but `ray.cluster_utils.Cluster` (the
    multi-node benches and end-to-end scenarios) and `ray start` do not, and their GCS then refuses
    to start on a fresh machine ("couldn't find an authentication token")."""
    if os.environ.get("RAY_AUTH_MODE") != "token" or os.environ.get("RAY_AUTH_TOKEN") \
            or os.environ.get("RAY_AUTH_TOKEN_PATH") or (Path.home() / ".ray" / "auth_token").exists():
        return
    handle, path = tempfile.mkstemp(prefix="rayshard-auth-token-")
    with os.fdopen(handle, "w") as token:  # mkstemp's file is the owner's alone (0600)
        token.write(secrets.token_hex(32))
    os.environ["RAY_AUTH_TOKEN_PATH"] = path
    atexit.register(os.remove, path)  # its clusters read it as they start; none outlives this process
