"""`ckpt verify`: is a committed checkpoint whole? Every file its manifest names exists and is
long enough; with deep=True every chunk's bytes and every file's header are read back and their
CRC32 compared with the manifest — the check that catches a truncated or replaced shard that
still has the right name.

Deep reads go through the same streamed ranged reads as a load (`storage/ranged_fetch.py`:
concurrent on S3, at most `window_bytes` fetched and not yet checked), so memory stays bounded
whatever the checkpoint size.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import fsspec

from rayshard.storage.checksums import running_like
from rayshard.storage.manifest_io import read_manifest
from rayshard.storage.backends.registry import backend_for
from rayshard.storage.ranged_fetch import read_range
from rayshard.plans.errors import CheckpointError, StoreUnavailable, first_line
from rayshard.plans.checkpoint.model_check import check_against_own_model
from rayshard.plans.interop.model_description import check_recorded_description
from rayshard.plans.checkpoint.reshard import Request, check_chunks_disjoint_and_complete
from rayshard.cluster.progress import advance, set_total

WINDOW_BYTES = 64 * 2**20


@dataclass
class VerifyReport:
    url: str
    files: int = 0
    chunks: int = 0
    bytes_checked: int = 0
    deep: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(url: str, deep: bool = False, progress=None, window_bytes: int = WINDOW_BYTES) -> VerifyReport:
    """progress: a bar (cluster/progress.py) advanced by the bytes read back (deep only)."""
    chunks, metadata = read_manifest(url)
    report = VerifyReport(url, chunks=len(chunks), deep=deep)
    # The manifest itself: its chunks tile every tensor once, and it lists every tensor of the
    # model it records (a manifest that lost rows would otherwise verify "ok": what it lists is fine).
    for check in (lambda: check_chunks_disjoint_and_complete(chunks),
                  lambda: check_against_own_model(chunks, metadata, url) if "model" in metadata else None,
                  lambda: check_recorded_description(chunks, metadata, url)):
        try:
            check()
        except CheckpointError as error:
            report.problems.append(f"manifest: {error}")
    fs, base = fsspec.core.url_to_fs(url)
    # Column-wise: per file, how many chunks and how far they reach (no record per chunk).
    extents, counts = chunks.file_extents(), chunks.file_counts()
    report.files = len(extents)
    sizes = {path[len(base) + 1:]: info["size"] for path, info in fs.find(base, detail=True).items()}
    readable = []
    for file, needed in sorted(extents.items()):  # read_manifest refused keys outside the checkpoint
        if file not in sizes:
            report.problems.append(f"{file}: missing ({counts[file]} chunks, {needed} bytes expected)")
        elif sizes[file] < needed:
            report.problems.append(f"{file}: truncated: {sizes[file]} bytes, the manifest needs {needed}")
        else:
            readable.append(file)
    if deep:
        # Each file's header (the bytes before its first chunk) and every chunk are read back.
        rows = chunks.rows_by_file()
        readable = [(file, chunks.chunks_at(rows[file])) for file in readable]
        set_total(progress, sum(_ranges_bytes(_ranges(members)) for _, members in readable))
        for file, members in readable:
            _check_file(fs, f"{base}/{file}", file, members, report, progress, window_bytes)
    return report


def _check_file(fs, path: str, file: str, members: list, report: VerifyReport, progress, window_bytes: int) -> None:
    expected_header = next((c.file_header for c in members if getattr(c, "file_header", "")), "")
    ranges = _ranges(members)
    base, name = path.rsplit("/", 1)
    small = {Request(name, start, end, ()): chunk for start, end, chunk in ranges if end - start <= window_bytes}
    refused = None  # the store's first refusal: raised once every GET in flight has answered (no task left behind)
    with contextlib.closing(backend_for(fs).fetch_ranges(base, list(small), window_bytes)) as arrivals:  # concurrent, streamed
        for request, blob in arrivals:
            chunk, start, end = small[request], request.byte_start, request.byte_end
            if not isinstance(blob, BaseException) and len(blob) == end - start:
                report.bytes_checked += len(blob)
                advance(progress, len(blob))
                blob = running_like(_recorded(chunk, expected_header), path).update(blob).text()
            try:
                _compare(file, start, end, chunk, blob, expected_header, report)
            except StoreUnavailable as error:
                refused = refused or error
    if refused is not None:
        raise refused
    for start, end, chunk in (r for r in ranges if r[1] - r[0] > window_bytes):
        running, outcome = running_like(_recorded(chunk, expected_header), path), None
        for offset in range(start, end, window_bytes):  # a big chunk in pieces, CRC carried along
            try:
                data = read_range(fs, path, offset, min(offset + window_bytes, end))
            except OSError as error:
                outcome = error
                break
            running.update(data)
            report.bytes_checked += len(data)
            advance(progress, len(data))
        _compare(file, start, end, chunk, outcome or running.text(), expected_header, report)


def _recorded(chunk, expected_header: str) -> str:
    """The checksum a range is held to: its chunk's, or the file header's (chunk None)."""
    return chunk.checksum if chunk is not None else expected_header


def _ranges(members: list) -> list[tuple[int, int, object]]:
    """(start, end, chunk) of what a deep check reads of one file: its header (chunk None) when
    the manifest records one, then every chunk."""
    members = sorted(members, key=lambda c: c.byte_start)
    header = any(getattr(c, "file_header", "") for c in members)
    return ([(0, members[0].byte_start, None)] if header else []) + [(c.byte_start, c.byte_end, c) for c in members]


def _ranges_bytes(ranges: list) -> int:
    return sum(end - start for start, end, _ in ranges)


def _compare(file: str, start: int, end: int, chunk, actual, expected_header: str, report: VerifyReport) -> None:
    """actual: the checksum of bytes [start, end), the short blob that was read, or the error."""
    what = f"{chunk.name} ({chunk.kind})" if chunk is not None else "the safetensors header"
    if isinstance(actual, BaseException) and not isinstance(actual, FileNotFoundError):
        # A refusal or failure of the store (403, 500 after the retries, a timeout) says nothing
        # about the checkpoint: the verification stops, as a storage error, and names no file to restore.
        raise StoreUnavailable(f"{file}: reading bytes [{start}, {end}) of {what} failed "
                               f"({type(actual).__name__}: {first_line(actual)}); "
                               "the store did not serve them, so the checkpoint could not be verified. Fix: check the "
                               "store's credentials, permissions and network, then verify again")
    if isinstance(actual, BaseException):
        report.problems.append(f"{file}: could not read bytes [{start}, {end}) of {what}: {actual}")
    elif not isinstance(actual, str):
        report.problems.append(f"{file}: bytes [{start}, {end}) of {what}: got only {len(actual)} bytes")
    elif actual != _recorded(chunk, expected_header):
        report.problems.append(f"{file}: checksum mismatch in {what} at bytes [{start}, {end}): "
                               f"manifest {_recorded(chunk, expected_header)}, file {actual}")
