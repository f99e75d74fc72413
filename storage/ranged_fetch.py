"""Ranged reads from object storage, handed over as they complete, with bounded memory.

A load's requests used to be fetched a window at a time (`cat_ranges`, concurrent inside the
window) and the next window waited until the last GET of the previous one had been verified and
copied. Here GETs run on fsspec's event loop, up to `max_in_flight` at once and at most
`budget_bytes` fetched but not yet consumed; the caller's thread consumes each blob as soon as
it arrives (checksum, copy into place) while the next ones download. Memory stays bounded by
the budget, storage never idles between windows, and the first pieces are in place early —
which is what lets a read-once load hand them to its replicas while it is still reading.

Filesystems without an async API (memory://, local) are read window by window as before.

Every range read from a store, here or one window at a time by `read_range` (a chunk larger than
the fetch budget), is bounded as a whole by `storage.stall_timeout_s`, retries included.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Iterator, Sequence

from fsspec.asyn import AsyncFileSystem, sync
from fsspec.exceptions import FSTimeoutError

from rayshard.plans.checkpoint.reshard import Request
from rayshard.storage.options import upload_options

MAX_IN_FLIGHT = 8


class _ByteBudget:
    """Bytes that may be fetched and not yet consumed. Lives on the event loop."""

    def __init__(self, limit: int):
        self.free = limit
        self.changed = asyncio.Condition()

    async def take(self, nbytes: int) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: self.free >= nbytes)
            self.free -= nbytes

    async def give(self, nbytes: int) -> None:
        async with self.changed:
            self.free += nbytes
            self.changed.notify_all()


def _windows(requests: Sequence[Request], window_bytes: int) -> Iterator[list[Request]]:
    batch, size = [], 0
    for request in requests:
        if batch and size + request.nbytes > window_bytes:
            yield batch
            batch, size = [], 0
        batch.append(request)
        size += request.nbytes
    if batch:
        yield batch


def fetch_ranges(fs, base: str, requests: Sequence[Request], budget_bytes: int,
                 max_in_flight: int = MAX_IN_FLIGHT) -> Iterator[tuple[Request, bytes | BaseException]]:
    """(request, its bytes or the exception that fetching it raised), in completion order. Each
    request must fit the budget. Requests start in the order given. A consumer that stops early
    (an exception, a generator closed) stops the fetching; GETs already in flight finish first."""
    if not isinstance(fs, AsyncFileSystem) or fs.asynchronous:  # no loop of fsspec's own to run on
        yield from _fetch_in_windows(fs, base, requests, budget_bytes)
        return
    loop = fs.loop
    deadline_s = upload_options().stall_timeout_s
    arrived: queue.Queue = queue.Queue()
    stop = threading.Event()
    budget_box: list[_ByteBudget] = []

    async def fetch_all() -> None:
        budget_box.append(_ByteBudget(budget_bytes))
        budget, slots = budget_box[0], asyncio.Semaphore(max_in_flight)

        async def fetch_one(request: Request) -> None:
            try:
                # Bounded as a whole: s3fs retries a failed read itself on top of the client's own
                # retries, so a stalled range took ~50x the configured attempts x read timeout.
                blob = await asyncio.wait_for(fs._cat_file(f"{base}/{request.file}", start=request.byte_start,
                                                           end=request.byte_end), timeout=deadline_s)
            except asyncio.TimeoutError:
                blob = TimeoutError(_stalled(deadline_s))
            except Exception as error:  # handed to the consumer, which names the file and range
                blob = error
            finally:
                slots.release()
            arrived.put((request, blob))

        tasks = []
        for request in requests:
            await budget.take(request.nbytes)
            await slots.acquire()
            if stop.is_set():
                slots.release()
                break
            tasks.append(asyncio.ensure_future(fetch_one(request)))
        await asyncio.gather(*tasks)

    fetching = asyncio.run_coroutine_threadsafe(fetch_all(), loop)
    finished = False
    try:
        for _ in range(len(requests)):
            request, blob = _next_arrival(arrived, fetching)
            yield request, blob
            asyncio.run_coroutine_threadsafe(budget_box[0].give(request.nbytes), loop)
        finished = True
    finally:
        stop.set()
        if budget_box:  # unblock a producer waiting for budget, so it sees `stop`
            asyncio.run_coroutine_threadsafe(budget_box[0].give(sum(r.nbytes for r in requests)), loop)
        if finished:
            fetching.result()
        else:  # the consumer's own error is the one to report; GETs in flight finish in the background
            fetching.add_done_callback(lambda future: future.exception())


def read_range(fs, path: str, start: int, end: int) -> bytes:
    """Bytes [start, end) of one object, bounded as each range of `fetch_ranges` is: a
    TimeoutError (an OSError) once storage.stall_timeout_s passes, retries included."""
    if not isinstance(fs, AsyncFileSystem) or fs.asynchronous:
        return fs.cat_file(path, start=start, end=end)
    deadline_s = upload_options().stall_timeout_s
    try:
        return sync(fs.loop, fs._cat_file, path, start=start, end=end, timeout=deadline_s)
    except FSTimeoutError:
        raise TimeoutError(_stalled(deadline_s)) from None


def _stalled(deadline_s: float) -> str:
    return f"no bytes within {deadline_s:g} s, retries included (storage.stall_timeout_s: RAYSHARD_S3_STALL_TIMEOUT_S)"


def _next_arrival(arrived: queue.Queue, fetching) -> tuple[Request, bytes | BaseException]:
    """The next finished GET; a producer that died (a bug, not a failed GET: those arrive as
    values) raises here instead of leaving the consumer waiting forever."""
    while True:
        try:
            return arrived.get(timeout=1.0)
        except queue.Empty:
            if fetching.done():
                fetching.result()
                raise RuntimeError("ranged fetch ended before every request arrived")


def _fetch_in_windows(fs, base: str, requests: Sequence[Request], window_bytes: int):
    for batch in _windows(requests, window_bytes):
        paths = [f"{base}/{r.file}" for r in batch]
        blobs = fs.cat_ranges(paths, [r.byte_start for r in batch], [r.byte_end for r in batch], on_error="return")
        yield from zip(batch, blobs)
