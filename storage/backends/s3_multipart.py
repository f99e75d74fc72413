"""Writing one object to S3 as a stream: parallel multipart uploads with bounded memory and a
bound on how long a stalled upload can hang.

On S3 the bytes are cut into parts of `part_size`. The memory budget of one upload is
(max_concurrency + 1) * part_size: an object that ends within it goes as one PUT (one request,
no multipart bookkeeping on either side); a bigger one becomes a multipart upload with up to
`max_concurrency` parts in flight (sent on fsspec's event loop while the writer produces the next
part), so memory stays within the budget whatever the shard size. A part that has not completed
`stall_timeout_s` after it was sent — retries and backoff included — fails the write with an
error naming the rank and the object, and the multipart upload is aborted (gc aborts any that a
dead process leaves behind).

The sizes and the stall bound are the driver's `StorageOptions` (`storage/options.py`), shipped to
each actor; the defaults there apply where none were shipped.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import io
import re
import time
from collections import deque

from rayshard.plans.errors import CheckpointError
from rayshard.storage.options import upload_options

def describe(path: str, protocol: str = "s3") -> str:
    """'rank 3 (s3://bucket/.../rank-00003.safetensors)': who was writing what."""
    match = re.search(r"rank-(\d+)", path)
    url = f"{protocol}://{path}" if "://" not in path else path
    return f"rank {int(match.group(1))} ({url})" if match else url


class MultipartWriter:
    protocol = "s3"  # the scheme errors name the object with (a subclass speaks another store's API)

    def __init__(self, fs, path: str, part_size: int, max_concurrency: int, stall_timeout_s: float):
        self.fs, self.path = fs, path
        self.bucket, self.key, _ = fs.split_path(path)
        self.part_size, self.max_concurrency, self.stall_timeout_s = part_size, max_concurrency, stall_timeout_s
        self.buffer = bytearray()
        self.held: list[bytearray] = []  # full parts kept while the object still fits one PUT
        self.upload_id: str | None = None
        self.in_flight: deque = deque()  # (part number, future, sent at)
        self.parts: list[dict] = []
        self.written = 0

    # ---- file-like --------------------------------------------------------------------------

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        count = len(view)
        while len(view):
            take = min(len(view), self.part_size - len(self.buffer))
            self.buffer += view[:take]
            view = view[take:]
            if len(self.buffer) == self.part_size:
                self._part_full(self.buffer)  # handed over whole: a fresh buffer takes the next bytes
                self.buffer = bytearray()
        self.written += count
        return count

    def close(self) -> None:
        if self.upload_id is None:  # the whole object fit the budget: a single PUT
            body = self.buffer if not self.held else ChunksReader([*self.held, self.buffer])  # no joined copy
            self._wait(self._submit("put_object", Body=body), "the object", time.monotonic())
            self.held.clear()
            return
        if self.buffer:
            self._send_part(self.buffer)
            self.buffer = bytearray()
        while self.in_flight:
            self._finish_oldest()
        self._wait(self._submit("complete_multipart_upload", UploadId=self.upload_id,
                                MultipartUpload={"Parts": sorted(self.parts, key=lambda p: p["PartNumber"])}),
                   "completing the multipart upload", time.monotonic())

    def abort(self) -> None:
        """Best effort: cancel what is in flight and abort the upload (gc aborts it otherwise)."""
        for _, future, _ in self.in_flight:
            future.cancel()
        self.in_flight.clear()
        if self.upload_id is not None:
            with contextlib.suppress(Exception):
                self._submit("abort_multipart_upload", UploadId=self.upload_id).result(timeout=30)

    # ---- parts ------------------------------------------------------------------------------

    def _submit(self, method: str, **kwargs) -> concurrent.futures.Future:
        call = self.fs._call_s3(method, Bucket=self.bucket, Key=self.key, **kwargs)
        return asyncio.run_coroutine_threadsafe(call, self.fs.loop)

    def _part_full(self, part: bytearray) -> None:
        if self.upload_id is not None:
            self._send_part(part)
            return
        self.held.append(part)
        if len(self.held) > self.max_concurrency:  # the budget is full and bytes keep coming: go multipart
            held, self.held = self.held, []
            for body in held:
                self._send_part(body)

    def _send_part(self, body: bytearray) -> None:
        if self.upload_id is None:
            started = time.monotonic()
            self.upload_id = self._wait(self._submit("create_multipart_upload"), "starting a multipart upload",
                                        started)["UploadId"]
        while len(self.in_flight) >= self.max_concurrency:  # the memory bound: wait for the oldest part
            self._finish_oldest()
        number = len(self.parts) + len(self.in_flight) + 1
        future = self._submit("upload_part", UploadId=self.upload_id, PartNumber=number, Body=body)
        self.in_flight.append((number, future, time.monotonic()))

    def _finish_oldest(self) -> None:
        number, future, sent = self.in_flight.popleft()
        response = self._wait(future, f"part {number}", sent)
        self.parts.append({"PartNumber": number, "ETag": response["ETag"]})

    def _wait(self, future: concurrent.futures.Future, what: str, sent: float):
        remaining = self.stall_timeout_s - (time.monotonic() - sent)
        try:
            return future.result(timeout=max(0.0, remaining))
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise CheckpointError(
                f"{describe(self.path, self.protocol)}: upload stalled: {what} did not complete within {self.stall_timeout_s:g}s "
                f"(retries included) after {self.written} bytes were handed over. The save is abandoned and "
                "the last committed checkpoint stays LATEST. Fix: check the object store's health and the "
                "network, or raise RAYSHARD_S3_STALL_TIMEOUT_S for very slow links") from None
        except Exception as error:
            raise CheckpointError(f"{describe(self.path, self.protocol)}: upload failed on {what}: {error}. The save is abandoned "
                                  "and the last committed checkpoint stays LATEST") from error


class ChunksReader(io.RawIOBase):
    """Several buffers read as one seekable stream (botocore rewinds a body to retry it)."""

    def __init__(self, chunks: list):
        self.chunks = [memoryview(chunk).cast("B") for chunk in chunks]
        self.size = sum(len(chunk) for chunk in self.chunks)
        self.position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.position = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence] + offset
        return self.position

    def readinto(self, target) -> int:
        target = memoryview(target).cast("B")
        filled, start = 0, 0
        for chunk in self.chunks:
            end = start + len(chunk)
            if start <= self.position < end and filled < len(target):
                offset = self.position - start
                take = min(len(chunk) - offset, len(target) - filled)
                target[filled:filled + take] = chunk[offset:offset + take]
                filled += take
                self.position += take
            start = end
        return filled


@contextlib.contextmanager
def streamed(writer_class: type[MultipartWriter], fs, path: str):
    """A backend's `open_writer`: a writer of `writer_class` under the upload options; the object
    exists once the block exits, and its staged parts are discarded when the block raises."""
    options = upload_options()
    writer = writer_class(fs, path, options.part_size, options.max_concurrency, options.stall_timeout_s)
    try:
        yield writer
        writer.close()
    except BaseException:
        writer.abort()
        raise
