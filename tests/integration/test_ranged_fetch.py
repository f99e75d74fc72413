"""Streaming ranged reads from S3 and Azure Blob Storage (moto and Azurite, each through its fault proxy): every range arrives bit for bit, in
completion order, with never more than the budget fetched and not yet consumed; a failed GET
arrives as a value naming nothing secret; a consumer that stops early leaves nothing hanging."""
from __future__ import annotations

import asyncio
import os
import threading

import fsspec

from rayshard.storage.ranged_fetch import fetch_ranges
from rayshard.cluster.catalog.store import Store
from rayshard.plans.checkpoint.reshard import Request

MiB = 2**20


def _objects(store: Store, sizes: dict[str, int]) -> dict[str, bytes]:
    data = {name: os.urandom(size) for name, size in sizes.items()}
    for name, blob in data.items():
        store.fs.pipe_file(f"{store.root}/ranges/{name}", blob)
    return data


def _requests(data: dict[str, bytes], pieces: int) -> list[Request]:
    out = []
    for name, blob in data.items():
        cut = [len(blob) * i // pieces for i in range(pieces + 1)]
        out += [Request(name, start, end, ()) for start, end in zip(cut, cut[1:]) if end > start]
    return out


def test_ranges_arrive_bit_exact_within_the_budget(object_store):
    store, fault_proxy = Store(object_store.url), object_store.proxy
    data = _objects(store, {"a": 5 * MiB + 3, "b": 3 * MiB - 7})
    requests = _requests(data, 5)
    fault_proxy.add("delay", method="GET", seconds=0.02)  # GETs overlap, finishing out of order
    budget, outstanding, peak, seen = 3 * MiB, [0], [0], {}
    lock = threading.Lock()
    original = store.fs._cat_file

    async def counting(path, start=None, end=None, **kwargs):
        with lock:
            outstanding[0] += end - start
            peak[0] = max(peak[0], outstanding[0])
        return await original(path, start=start, end=end, **kwargs)

    store.fs._cat_file = counting
    try:
        for request, blob in fetch_ranges(store.fs, f"{store.root}/ranges", requests, budget, max_in_flight=3):
            assert not isinstance(blob, BaseException), blob
            assert blob == data[request.file][request.byte_start:request.byte_end]
            seen[request] = True
            with lock:
                outstanding[0] -= len(blob)
    finally:
        del store.fs._cat_file
    assert set(seen) == set(requests)
    assert 0 < peak[0] <= budget


def test_a_failed_get_arrives_as_a_value(object_store):
    store = Store(object_store.url)
    data = _objects(store, {"present": MiB})
    requests = [Request("present", 0, MiB, ()), Request("missing", 0, 10, ())]
    got = dict(fetch_ranges(store.fs, f"{store.root}/ranges", requests, 2 * MiB))
    assert got[requests[0]] == data["present"]
    assert isinstance(got[requests[1]], FileNotFoundError)


def test_a_consumer_that_stops_early_stops_the_fetching(object_store, monkeypatch):
    store = Store(object_store.url)
    data = _objects(store, {"c": 4 * MiB})
    requests = _requests(data, 16)  # 256 KiB each; the 1 MiB budget admits 4 before one is consumed
    started = []
    original = store.fs._cat_file

    async def counting(path, start=None, end=None, **kwargs):
        started.append(start)
        return await original(path, start=start, end=end, **kwargs)

    producers = []  # the fetching coroutine's future, to wait for its end instead of sleeping
    schedule = asyncio.run_coroutine_threadsafe

    def recording(coroutine, loop):
        future = schedule(coroutine, loop)
        if getattr(coroutine, "__qualname__", "").endswith("fetch_all"):
            producers.append(future)
        return future

    monkeypatch.setattr(asyncio, "run_coroutine_threadsafe", recording)
    store.fs._cat_file = counting
    try:
        arrivals = fetch_ranges(store.fs, f"{store.root}/ranges", requests, MiB, max_in_flight=2)
        request, blob = next(arrivals)
        assert blob == data["c"][request.byte_start:request.byte_end]
        arrivals.close()  # returns at once: nothing waits on budget the consumer will never give back
        (producer,) = producers
        producer.result(timeout=120)  # the producer has ended: every GET it was going to start has returned
    finally:
        del store.fs._cat_file
    assert 1 <= len(started) <= 5 < len(requests)


def test_a_body_cut_off_midway_is_fetched_again_bit_exact(object_store):
    """The connection drops after half of a GET's body has arrived: the GET is retried and the
    range arrives whole and intact, never half of it."""
    store, fault_proxy = Store(object_store.url), object_store.proxy
    data = _objects(store, {"f": 6 * MiB + 5})
    requests = _requests(data, 2)
    rule = fault_proxy.add("cut_body", method="GET", path="/ranges/f", times=1)
    got = dict(fetch_ranges(store.fs, f"{store.root}/ranges", requests, 8 * MiB))
    assert rule.injected == 1
    assert all(got[r] == data["f"][r.byte_start:r.byte_end] for r in requests)


def test_a_stalled_get_is_retried_after_the_read_timeout(object_store):
    """The server accepts a GET and never answers: the client's read timeout (3 s in tests) turns
    the hang into a retry, and the range arrives whole."""
    store, fault_proxy = Store(object_store.url), object_store.proxy
    data = _objects(store, {"s": 2 * MiB + 1})
    requests = _requests(data, 2)
    rule = fault_proxy.add("stall", method="GET", path="/ranges/s", times=1, seconds=30)
    got = dict(fetch_ranges(store.fs, f"{store.root}/ranges", requests, 4 * MiB))
    assert rule.injected == 1
    assert all(got[r] == data["s"][r.byte_start:r.byte_end] for r in requests)


def test_filesystems_without_an_async_api_are_read_in_windows(tmp_path):
    fs = fsspec.filesystem("memory")
    blob = os.urandom(100_000)
    fs.pipe_file("/ranges/d", blob)
    requests = [Request("d", start, start + 10_000, ()) for start in range(0, 100_000, 10_000)]
    got = dict(fetch_ranges(fs, "/ranges", requests, 25_000))
    assert all(got[r] == blob[r.byte_start:r.byte_end] for r in requests)
