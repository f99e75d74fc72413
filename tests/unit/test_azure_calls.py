"""deploy/azure-blob-role.json grants exactly the permissions of the Blob operations rayshard makes
(storage/backends/azure_calls.py), and every Blob SDK method the Azure backend calls itself is
one of those operations: a new direct call missing from the list fails here."""
from __future__ import annotations

import json
import re
from pathlib import Path

from rayshard.storage.backends.azure_calls import AZURE_OPERATIONS, READ_CONTAINER
from tests.unit.test_deploy_manifests import EXAMPLE_VALUES, render

REPO = Path(__file__).resolve().parents[2]


def test_the_role_grants_exactly_the_permissions_of_the_listed_operations(tmp_path):
    written, skipped = render.render(tmp_path, EXAMPLE_VALUES, ["azure-blob-role.json"])
    assert not skipped, skipped
    role = json.loads(written[0].read_text())
    needed = {permission for _, _, permission in AZURE_OPERATIONS}
    assert set(role["Actions"]) == {p for p in needed if p == READ_CONTAINER}
    assert set(role["DataActions"]) == {p for p in needed if p != READ_CONTAINER}
    assert not role["NotActions"] and not role["NotDataActions"]
    [scope] = role["AssignableScopes"]  # one container, not the account or the subscription
    assert scope.endswith(f"/storageAccounts/{EXAMPLE_VALUES['RAYSHARD_AZURE_STORAGE_ACCOUNT']}/blobServices/default"
                          f"/containers/{EXAMPLE_VALUES['RAYSHARD_AZURE_CONTAINER']}")


def test_every_blob_call_the_backend_makes_itself_is_listed():
    source = (REPO / "storage" / "backends" / "azure.py").read_text()
    through_helper = set(re.findall(r'_blob_call\([^,]+, [^,]+, "(\w+)"', source))
    on_a_client = set(re.findall(r"\bclient\.(\w+)\(", source))
    called = (through_helper | on_a_client) - {"get_blob_client", "get_container_client"}
    assert {"upload_blob", "stage_block", "commit_block_list", "delete_blob", "download_blob", "list_blobs"} <= called
    listed = {method for _, method, _ in AZURE_OPERATIONS}
    assert called <= listed, f"storage/backends/azure.py calls {sorted(called - listed)}: add them to azure_calls.py"
