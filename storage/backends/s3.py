"""s3://: Amazon S3 and S3-compatible servers (MinIO, moto), through s3fs.

Create-only and compare-and-replace are conditional PUTs (If-None-Match: * and If-Match: <ETag>);
objects stream as parallel multipart uploads in bounded memory (`s3_multipart.py`); gc lists and
aborts the multipart uploads a dead process left behind. Every operation made here, and the IAM
action it needs, is listed in `s3_calls.py`.
"""
from __future__ import annotations

import asyncio

from fsspec.asyn import sync

from rayshard.storage.backends.fsspec_generic import FsspecBackend
from rayshard.storage.backends.protocol import PendingUpload, PreconditionFailed, refuse_missing_container
from rayshard.storage.backends.s3_multipart import MultipartWriter, streamed


class S3Backend(FsspecBackend):
    scheme = "s3"

    def create_only(self, path: str, data: bytes) -> None:
        try:
            self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            # A retried PUT whose first try landed (the reply was lost) also fails its
            # condition: the object is then ours, byte for byte.
            if self.fs.cat_file(path) != data:
                raise

    def read_versioned(self, path: str) -> tuple[bytes | None, str | None]:
        try:
            return sync(self.fs.loop, _get_with_etag, self.fs, path)
        except FileNotFoundError:
            return None, None

    def replace_if(self, path: str, data: bytes, token: str | None) -> None:
        try:
            if token is None:
                self.fs.pipe_file(path, data, mode="create")
            else:
                self.fs.pipe_file(path, data, IfMatch=token)
        except (FileExistsError, OSError) as error:
            if isinstance(error, FileNotFoundError) or _precondition_failed(error):
                if self.read_versioned(path)[0] == data:
                    return  # our own write landed on an earlier try of a retried request
                if isinstance(error, FileNotFoundError):
                    refuse_missing_container(self, path)  # not a lost swap: there is no bucket to write in
                raise PreconditionFailed(path) from None
            raise

    def open_writer(self, path: str):
        return streamed(MultipartWriter, self.fs, path)

    def pending_uploads(self, root: str) -> list[PendingUpload]:
        bucket, prefix, _ = self.fs.split_path(root)
        found, markers = [], {}
        while True:
            page = self.fs.call_s3("list_multipart_uploads", Bucket=bucket,
                                   Prefix=f"{prefix.rstrip('/')}/" if prefix else "", **markers)
            for upload in page.get("Uploads", []) or []:
                found.append(PendingUpload(f"{bucket}/{upload['Key']}", upload["UploadId"],
                                           upload["Initiated"].timestamp()))
            if not page.get("IsTruncated"):
                return found
            markers = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}

    def abort_upload(self, upload: PendingUpload) -> None:
        bucket, key, _ = self.fs.split_path(upload.path)
        self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload.upload_id)

    def missing_container(self, root: str) -> str | None:
        bucket = root.split("/", 1)[0]
        try:
            self.fs.call_s3("head_bucket", Bucket=bucket)
        except FileNotFoundError:  # s3fs's translation of 404 NoSuchBucket
            return bucket
        return None


def _precondition_failed(error: BaseException) -> bool:
    cause = error.__cause__ or error.__context__
    text = f"{error} {cause}"
    return isinstance(error, FileExistsError) or "PreconditionFailed" in text or "412" in text


BODY_READ_ATTEMPTS = 5  # a reply cut short mid-body is not retried by botocore: the read is


def _body_broke_off(error: BaseException) -> bool:
    """A reply cut short after its headers: aiohttp's ClientPayloadError (named, so that importing
    this module does not import aiohttp for every command), or the connection reset under it."""
    return type(error).__name__ == "ClientPayloadError" or isinstance(error, (ConnectionError, asyncio.IncompleteReadError))


async def _get_with_etag(fs, path: str) -> tuple[bytes, str]:
    """The object and its ETag. botocore retries a request that fails, but not a body that breaks
    off after the headers (a reset mid-reply: aiohttp's ClientPayloadError); found by the storage
    soak, where it stopped a trainer at its metrics append. The GET is made again, a bounded number
    of times, with backoff."""
    bucket, key, _ = fs.split_path(path)
    for attempt in range(BODY_READ_ATTEMPTS):
        response = await fs._call_s3("get_object", Bucket=bucket, Key=key)
        try:
            return await response["Body"].read(), response["ETag"]
        except Exception as error:
            if not _body_broke_off(error) or attempt == BODY_READ_ATTEMPTS - 1:
                raise
            await asyncio.sleep(min(2.0, 0.1 * 2**attempt))
        finally:
            response["Body"].close()
    raise AssertionError("unreachable")
