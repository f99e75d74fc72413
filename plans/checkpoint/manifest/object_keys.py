"""Which object keys a manifest may name: files inside its own checkpoint directory, nothing else.

A manifest is data from storage, possibly written by someone else. A `file` such as
`../../other-run/...`, `/etc/passwd` or `s3://other-bucket/key` would make a load read (and a
gc delete) outside the checkpoint, so every key is checked before any byte is fetched. Pure:
applied by `rayshard.storage.manifest_io.read_manifest`, the one function every reader of a manifest
(driver, rank actors, CLI) goes through, and by StoredCheckpoint for chunks decoded elsewhere.
"""
from __future__ import annotations

import re

from rayshard.plans.errors import CheckpointError

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")  # s3:, file:, C: (a Windows drive)


def escape_reason(key: str) -> str | None:
    """Why key escapes its checkpoint directory, or None when it is a plain relative key."""
    if not key:
        return "it is empty"
    if any(ord(c) < 32 for c in key):
        return "it contains control characters"
    if "\\" in key:
        return "it contains a backslash"
    if key.startswith("/"):
        return "it is an absolute path"
    if _SCHEME.match(key):
        return "it names another filesystem or bucket"
    segments = key.split("/")
    if ".." in segments:
        return "it climbs out with '..'"
    if "" in segments or "." in segments:
        return "it has an empty or '.' path segment"
    return None


def check_object_keys(keys, where: str) -> None:
    """Raise CheckpointError naming the first key that escapes the checkpoint directory."""
    for key in sorted(set(keys)):
        reason = escape_reason(key)
        if reason:
            raise CheckpointError(
                f"{where}: manifest names object {key!r}, which is outside the checkpoint directory ({reason}); "
                "refusing to read it. A manifest may only name files under its own checkpoint directory "
                "(e.g. attempt-<id>/rank-00000.safetensors): re-create the manifest, or do not load a "
                "checkpoint from an untrusted source")
