"""How every driver-side command reaches Ray: the cluster `ray job submit` named, or a local one.

One module for the training driver, the elastic controller, offline reshards and `data prepare`,
none of which should import another's machinery to connect.
"""
from __future__ import annotations

import os

import ray


def connect_ray() -> None:
    """Join the cluster named by RAY_ADDRESS (set by `ray job submit`), else start a local one.

    "local" explicitly: a bare `ray.init()` also joins whatever cluster `ray start` (or a test's
    cluster) last left on this machine, and a run would land on it, its ranks then killed with it
    ("actor creation cancelled"), instead of on its own Ray."""
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS") or "local"
        if address == "local":
            # A local start waits 120 s (Ray's default is 30) for its new GCS to come up: on a
            # loaded machine the first start from a fresh environment took longer, and the run died
            # of it. Not when joining a cluster: the same setting is Ray's count of connection
            # retries, and a dead address would then take two minutes to fail instead of 20 s.
            os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")
        ray.init(address=address, logging_level="WARNING", log_to_driver=True,
                 include_dashboard=False, configure_logging=True)
