"""az:// and abfs://: Azure Blob Storage (and Azurite, its emulator), through adlfs.

Create-only and compare-and-replace are conditional Put Blob requests (If-None-Match: * and
If-Match: <ETag>), evaluated by the service atomically with the write. Objects stream as staged
block uploads in bounded memory: the S3 writer's buffering, concurrency and stall bound
(`s3_multipart.MultipartWriter`) with Put Block for parts and Put Block List for the commit. A
writer that dies leaves uncommitted blocks under a blob name that no listing shows; Azure keeps
them for 7 days after the last Put Block, and `pending_uploads` finds them sooner (a listing with
include=uncommittedblobs, minus the plain listing), so `ckpt gc` aborts them like S3's multipart
uploads: an empty Put Block List that only succeeds where no blob is committed (If-None-Match: *)
discards the blocks, and a Delete Blob conditioned on that empty blob's ETag removes the name.

Credentials come from the usual Azure sources, resolved in each process (never shipped through
Ray, never printed): AZURE_STORAGE_CONNECTION_STRING; AZURE_STORAGE_ACCOUNT_NAME with
AZURE_STORAGE_ACCOUNT_KEY (or the Azure CLI's AZURE_STORAGE_KEY) or AZURE_STORAGE_SAS_TOKEN; a
service principal (AZURE_STORAGE_CLIENT_ID / _SECRET / TENANT_ID); else DefaultAzureCredential
(managed identity, workload identity, `az login`). The client's retry policy is bounded from the
same `StorageOptions` as S3's: `max_attempts` tries with exponential backoff on 500/503 (server
busy), timeouts and connection resets, and connect/read timeouts per request.

Every Blob REST operation made here, and the Azure RBAC data action it needs, is listed in
`azure_calls.py`. The filesystem class (`azure_filesystem.py`) is registered with fsspec by name
in `registry.py`, so adlfs and the storage SDK load on the first az:// URL; this module (the
backend) loads once `backend_for` first meets an az:// filesystem.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib

from azure.core import MatchConditions
from azure.core.exceptions import (ResourceExistsError, ResourceModifiedError,  # light: not the storage SDK
                                   ResourceNotFoundError)
from fsspec.asyn import sync

from rayshard.storage.backends.fsspec_generic import FsspecBackend
from rayshard.storage.backends.protocol import PendingUpload, PreconditionFailed, refuse_missing_container
from rayshard.storage.backends.s3_multipart import ChunksReader, MultipartWriter, streamed



class AzureBackend(FsspecBackend):
    scheme = "az"

    def url(self, path: str) -> str:
        return f"az://{path}"

    def create_only(self, path: str, data: bytes) -> None:
        try:
            self._call(path, "upload_blob", data, overwrite=True, match_condition=MatchConditions.IfMissing)
        except ResourceExistsError:
            # A retried PUT whose first try landed (the reply was lost) also fails its
            # condition: the object is then ours, byte for byte.
            if self.read_versioned(path)[0] != data:
                raise FileExistsError(path) from None

    def read_versioned(self, path: str) -> tuple[bytes | None, str | None]:
        try:
            return sync(self.fs.loop, _get_with_etag, self.fs, path)
        except ResourceNotFoundError:
            return None, None

    def replace_if(self, path: str, data: bytes, token: str | None) -> None:
        condition = ({"match_condition": MatchConditions.IfMissing} if token is None
                     else {"etag": token, "match_condition": MatchConditions.IfNotModified})
        try:
            self._call(path, "upload_blob", data, overwrite=True, **condition)
        except (ResourceExistsError, ResourceModifiedError, ResourceNotFoundError) as error:
            if self.read_versioned(path)[0] == data:
                return  # our own write landed on an earlier try of a retried request
            if isinstance(error, ResourceNotFoundError):
                refuse_missing_container(self, path)  # not a lost swap: there is no container to write in
            raise PreconditionFailed(path) from None

    def missing_container(self, root: str) -> str | None:
        return sync(self.fs.loop, _missing_container, self.fs, root)

    def open_writer(self, path: str):
        return streamed(BlockBlobWriter, self.fs, path)

    def pending_uploads(self, root: str) -> list[PendingUpload]:
        return sync(self.fs.loop, _uncommitted_blobs, self.fs, root)

    def abort_upload(self, upload: PendingUpload) -> None:
        sync(self.fs.loop, _discard_uncommitted, self.fs, upload.path)

    def _call(self, path: str, method: str, *args, **kwargs):
        return sync(self.fs.loop, _blob_call, self.fs, path, method, *args, **kwargs)


class BlockBlobWriter(MultipartWriter):
    """The S3 writer's buffering, bounded concurrency and stall bound, speaking Blob REST: one Put
    Blob for an object within the memory budget, else Put Block per part and Put Block List."""

    protocol = "az"

    def _submit(self, method: str, **kwargs) -> concurrent.futures.Future:
        if method == "create_multipart_upload":  # Azure needs no call to start staging blocks
            started: concurrent.futures.Future = concurrent.futures.Future()
            started.set_result({"UploadId": "staged-blocks"})
            return started
        return _run_on(self.fs, _WRITER_CALLS[method](self, **kwargs))

    def _put(self, Body):
        body = _stream(Body)
        return _blob_call(self.fs, self.path, "upload_blob", body, length=body.size, overwrite=True)

    async def _stage(self, UploadId, PartNumber, Body):
        body = _stream(Body)
        await _blob_call(self.fs, self.path, "stage_block", _block_id(PartNumber), body, length=body.size)
        return {"ETag": _block_id(PartNumber)}

    def _commit(self, UploadId, MultipartUpload):
        block_ids = [part["ETag"] for part in MultipartUpload["Parts"]]  # plain ids: the latest version of each
        return _blob_call(self.fs, self.path, "commit_block_list", block_ids)

    def _abort(self, UploadId):
        return _discard_uncommitted(self.fs, self.path)


_WRITER_CALLS = {
    "put_object": BlockBlobWriter._put,
    "upload_part": BlockBlobWriter._stage,
    "complete_multipart_upload": BlockBlobWriter._commit,
    "abort_multipart_upload": BlockBlobWriter._abort,
}


def _stream(body) -> ChunksReader:
    """The SDK takes a bytearray for an iterable of ints: buffers go as a seekable stream (no copy),
    which it also rewinds to retry."""
    return body if isinstance(body, ChunksReader) else ChunksReader([body])


def _block_id(part_number: int) -> str:
    return f"{part_number:08d}"  # one length for every block of a blob, as Put Block List requires


def _run_on(fs, coroutine) -> concurrent.futures.Future:
    return asyncio.run_coroutine_threadsafe(coroutine, fs.loop)


async def _blob_call(fs, path: str, method: str, *args, **kwargs):
    container, blob, _ = fs.split_path(path)
    async with fs.service_client.get_blob_client(container=container, blob=blob) as client:
        return await getattr(client, method)(*args, **kwargs)


async def _get_with_etag(fs, path: str) -> tuple[bytes, str]:
    container, blob, _ = fs.split_path(path)
    async with fs.service_client.get_blob_client(container=container, blob=blob) as client:
        stream = await client.download_blob()
        return await stream.readall(), stream.properties.etag


async def _uncommitted_blobs(fs, root: str) -> list[PendingUpload]:
    """Blob names that hold only uncommitted blocks: listed with include=uncommittedblobs and
    missing from the plain listing. (Blocks staged on top of a committed blob are not found: a
    save writes each object once under a fresh name, so only an overwrite leaves those, and Azure
    discards them 7 days after their last Put Block.)"""
    container, prefix, _ = fs.split_path(root)
    prefix = f"{prefix.rstrip('/')}/" if prefix else ""
    async with fs.service_client.get_container_client(container) as client:
        try:
            committed = {blob.name async for blob in client.list_blobs(name_starts_with=prefix)}
            return [PendingUpload(f"{container}/{blob.name}", "uncommitted-blocks",
                                  (blob.last_modified or blob.creation_time).timestamp())
                    async for blob in client.list_blobs(name_starts_with=prefix, include=["uncommittedblobs"])
                    if blob.name not in committed]
        except ResourceNotFoundError:
            return []  # no container, so nothing staged in it


async def _missing_container(fs, root: str) -> str | None:
    """The container holding root when Azure says it does not exist; None when it exists or the
    answer is another refusal (an identity without the container-read permission cannot tell, and
    its writes then fail on their own)."""
    container = fs.split_path(root)[0]
    async with fs.service_client.get_container_client(container) as client:
        try:
            await client.get_container_properties()
        except ResourceNotFoundError:
            return container
        except Exception:  # noqa: BLE001 - not known to be missing
            return None
    return None


async def _discard_uncommitted(fs, path: str) -> None:
    """Put Block List with no blocks discards every uncommitted block and leaves an empty blob;
    If-None-Match: * keeps it from replacing a blob that got committed meanwhile, and the delete is
    conditioned on the empty blob's ETag, so only what this call made is removed."""
    try:
        empty = await _blob_call(fs, path, "commit_block_list", [], match_condition=MatchConditions.IfMissing)
    except ResourceExistsError:
        return  # committed by now: its uncommitted blocks went with that commit
    with contextlib.suppress(ResourceNotFoundError, ResourceModifiedError):
        await _blob_call(fs, path, "delete_blob", etag=empty["etag"], match_condition=MatchConditions.IfNotModified)

