"""`rayshard-snapshot://`: an fsspec filesystem whose files live in the nodes' snapshot keepers.

A snapshot is an ordinary rayshard checkpoint (manifest, safetensors shards, checksums, LATEST)
written here instead of to a store, so the save, the reshard planner and the verified reads are the
same code as for a durable checkpoint: recovery from memory is `load` from a URL of this scheme.
Each file written goes to two keepers on different nodes (`snapshot_holders`): the writer's own and
the next one in the ring. A shard file (`SnapshotBackend.open_writer`) is put once into the
writer node's object store and only its reference is sent: each keeper fetches it and copies it
into its heap (docs/decisions.md 180); small files go as bytes. A read asks the keepers that hold
the file, first the one on the reader's node; a keeper that does not answer within RAYSHARD_SNAPSHOT_TIMEOUT_S is taken as lost, and the
read moves to the next copy or fails naming every keeper it tried.

Registered with fsspec through the `fsspec.specs` entry point (pyproject.toml), so any process of
the job (driver, rank, a Ray task) opens these URLs; it needs a connected Ray with keepers started
(`keepers.start_keepers`).
"""
from __future__ import annotations

import contextlib
import io
import os
import posixpath
import time

import numpy as np
import ray
import fsspec
from fsspec.spec import AbstractFileSystem
from ray.exceptions import GetTimeoutError

from rayshard.actors.snapshot.keeper import KEEPER_PREFIX, PreconditionFailedHere
from rayshard.plans.checkpoint.snapshot_holders import snapshot_holders
from rayshard.storage.backends.fsspec_generic import FsspecBackend
from rayshard.storage.backends.protocol import PreconditionFailed
from rayshard.storage.backends.registry import register_backend

PROTOCOL = "rayshard-snapshot"


def timeout_s() -> float:
    """How long one keeper may take to answer before it counts as lost."""
    return float(os.environ.get("RAYSHARD_SNAPSHOT_TIMEOUT_S", "60"))


# A keeper that let a call run out its bound is passed over by every filesystem instance in this
# process for a while: a recovery opens many files (fsspec makes an instance per URL here), and
# waiting the bound again for each one would turn one silent peer into minutes of silence.
# Keyed by the actor, not the node, so a replacement keeper on that node is asked at once.
SILENT_MEMORY_S = 300.0
_silent_until: dict[str, float] = {}  # keeper actor id -> monotonic time it may be asked again


def _actor_id(keeper) -> str:
    return keeper._actor_id.hex()


def _is_silent(keeper) -> bool:
    return _silent_until.get(_actor_id(keeper), 0.0) > time.monotonic()


class SnapshotKeeperLost(OSError):
    """No keeper holding a file answered: every copy of it is gone (or unreachable)."""


class SnapshotFileSystem(AbstractFileSystem):
    protocol = PROTOCOL
    root_marker = ""
    cachable = False  # the keepers change as nodes come and go: look them up per instance

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._keepers: dict[str, object] = {}  # node id -> actor handle
        self._where: dict[str, list[str]] = {}  # path -> node ids whose keeper has it

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = path[len(PROTOCOL) + 3:] if path.startswith(f"{PROTOCOL}://") else path
        return path.rstrip("/")

    # ---- keepers ------------------------------------------------------------------------------

    def keepers(self) -> dict[str, object]:
        """The live keepers by node id, looked up once per instance (and again after a loss)."""
        if not ray.is_initialized():  # never let a call below start a Ray of its own (Ray's auto-init)
            raise SnapshotKeeperLost(f"{PROTOCOL}:// needs the job's Ray: connect to it (ray.init) before reading "
                                     "or writing snapshots")
        if not self._keepers:
            names = [name for name in ray.util.list_named_actors() if name.startswith(KEEPER_PREFIX)]
            handles = {}
            for name in names:  # a keeper that died after the listing is no keeper (Ray raises ValueError)
                with contextlib.suppress(ValueError):
                    handles[name[len(KEEPER_PREFIX):]] = ray.get_actor(name)
            self._keepers = {node: keeper for node, keeper in handles.items() if not _is_silent(keeper)}
            if handles and not self._keepers:
                raise SnapshotKeeperLost(f"every snapshot keeper ({len(handles)}) let a call run out its "
                                         f"{timeout_s():.0f} s bound in the last {SILENT_MEMORY_S:.0f} s: taken as lost")
            if not self._keepers:
                raise SnapshotKeeperLost("no snapshot keeper runs in this Ray namespace: start them with "
                                         "rayshard.actors.snapshot.keepers.start_keepers()")
        return self._keepers

    def _lose(self, node: str, error: BaseException) -> None:
        """Stop asking node's keeper: for this instance, and for a while in this whole process
        when it was silent (rather than dead, which Ray reports at once)."""
        keeper = self._keepers.get(node)
        if keeper is not None and isinstance(error, GetTimeoutError):
            _silent_until[_actor_id(keeper)] = time.monotonic() + SILENT_MEMORY_S
        self._forget(node)

    def _forget(self, node: str) -> None:
        self._keepers.pop(node, None)
        for holders in self._where.values():
            if node in holders:
                holders.remove(node)

    def _answers(self, calls: dict[str, object]) -> tuple[dict[str, object], dict[str, BaseException]]:
        """Each keeper's answer to its call, within the bound; (answers, failures) by node."""
        answers, failures = {}, {}
        if not calls:  # ray.wait refuses an empty list
            return answers, failures
        ready, _ = ray.wait(list(calls.values()), num_returns=len(calls), timeout=timeout_s())
        ready = set(ready)
        for node, ref in calls.items():
            if ref not in ready:
                failures[node] = GetTimeoutError(f"snapshot keeper on node {node[:12]} did not answer in {timeout_s():.0f} s")
                continue
            try:
                answers[node] = ray.get(ref)
            except Exception as error:  # noqa: BLE001 - handed back per node
                failures[node] = error
        return answers, failures

    def _holders_of(self, path: str) -> list[str]:
        """Nodes whose keeper has path, the reader's own first."""
        if path not in self._where:
            directory = posixpath.dirname(path)
            answers, lost = self._answers({node: keeper.listing.remote(directory + "/")
                                           for node, keeper in self.keepers().items()})
            for node, error in lost.items():
                self._lose(node, error)
            for name in {name for listing in answers.values() for name in listing}:
                self._where[name] = sorted((node for node, listing in answers.items() if name in listing),
                                           key=lambda node: node != _this_node())
        return list(self._where.get(path, []))

    # ---- writes -------------------------------------------------------------------------------

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        path = self._strip_protocol(path)
        self._write(path, lambda node, keeper: keeper.put.remote(path, value))

    def put_segments(self, path: str, segments: list) -> None:
        """Write path as the concatenation of segments (byte buffers) with one copy in this
        process: a single `ray.put` into this node's object store (a list of uint8 arrays, which
        Ray serialises out of band, without a Python `bytes` of the file), whose reference both
        holders get; each copies the object into its own heap (the other node's keeper after Ray
        moved it there). This process owns the object until every holder has its copy, which is
        when this returns: a file outlives its writer from then on (docs/decisions.md 180)."""
        path = self._strip_protocol(path)
        arrays = [np.frombuffer(segment, dtype=np.uint8) for segment in segments]
        size = sum(array.size for array in arrays)
        self.keepers()  # first: it refuses when Ray is not connected
        try:
            ref = ray.put(arrays)
        except Exception as error:  # noqa: BLE001 - the object store is full (and cannot spill), or gone
            raise SnapshotKeeperLost(f"{PROTOCOL}://{path}: this node's object store did not take it "
                                     f"({_first({'': error})}); the snapshot is incomplete and will not be used") from error
        try:
            self._write(path, lambda node, keeper: keeper.copy.remote(path, [ref], size, timeout_s()))
        finally:
            del ref  # the object goes now: each holder has a copy, or the write failed

    def _write(self, path: str, call) -> None:
        """`call(node, keeper)` on each keeper that is to hold path; a refusal (exists, changed) is
        raised as the keeper raised it, a keeper that failed otherwise is lost."""
        keepers = self.keepers()  # first: it refuses when Ray is not connected
        holders = snapshot_holders(_this_node(), list(keepers))
        answers, failures = self._answers({node: call(node, keepers[node]) for node in holders})
        for node, error in failures.items():
            if isinstance(_cause(error), (FileExistsError, PreconditionFailedHere)):
                raise _cause(error)
            self._lose(node, error)
        if failures:
            raise SnapshotKeeperLost(f"{PROTOCOL}://{path}: the keeper(s) on node(s) "
                                     f"{', '.join(n[:12] for n in failures)} did not take it ({_first(failures)}); "
                                     "the snapshot is incomplete and will not be used")
        self._where[path] = sorted(answers, key=lambda node: node != _this_node())

    def create_only(self, path: str, data: bytes) -> None:
        self._write(path, lambda node, keeper: keeper.create_only.remote(path, data))

    def replace_if(self, path: str, data: bytes, expected: bytes | None) -> None:
        self._write(path, lambda node, keeper: keeper.replace_if.remote(path, data, expected))

    def _open(self, path, mode="rb", block_size=None, autocommit=True, cache_options=None, **kwargs):
        path = self._strip_protocol(path)
        if "r" in mode:
            return io.BytesIO(self.cat_file(path))
        return _WriteOnClose(self, path)

    def mkdir(self, path, create_parents=True, **kwargs):
        """Directories exist only as the prefixes of files."""

    def makedirs(self, path, exist_ok=False):
        """Directories exist only as the prefixes of files."""

    def rm_file(self, path):
        self.rm(path)

    def rm(self, path, recursive=False, maxdepth=None):
        for one in path if isinstance(path, list) else [path]:
            one = self._strip_protocol(one)
            prefix = one + "/" if recursive else one
            answers, lost = self._answers({node: keeper.remove.remote(prefix)
                                           for node, keeper in self.keepers().items()})
            for node, error in lost.items():
                self._lose(node, error)
            for name in [name for name in self._where if name == one or name.startswith(one + "/")]:
                del self._where[name]

    # ---- reads --------------------------------------------------------------------------------

    def cat_file(self, path, start=None, end=None, **kwargs):
        path = self._strip_protocol(path)
        data = self._read_many([(path, start, end)])[0]
        return data if isinstance(data, bytes) else data.tobytes()  # fsspec's callers expect bytes

    def cat_ranges(self, paths, starts, ends, max_gap=None, on_error="return", **kwargs):
        """Like fsspec's, but a range of a shard file comes as a read-only memoryview of the
        keeper's reply in this node's object store, not a `bytes` copy of it: a load's reads
        (`storage/ranged_fetch.py`, the read executor and `ckpt verify` take any buffer) copy it
        once, into place (docs/decisions.md 205)."""
        requests = [(self._strip_protocol(p), s, e) for p, s, e in zip(paths, starts, ends)]
        results = self._read_many(requests, raise_errors=on_error != "return")
        return [memoryview(r) if isinstance(r, np.ndarray) else r for r in results]

    def _read_many(self, requests, raise_errors: bool = True) -> list:
        """Ranged reads, one keeper call per file carrying all of that file's ranges, all calls in
        flight at once; a file whose keeper is lost is asked of its next copy."""
        results: list = [None] * len(requests)
        by_path: dict[str, list[int]] = {}
        for index, (path, _, _) in enumerate(requests):
            by_path.setdefault(path, []).append(index)
        tried: dict[str, list[str]] = {path: [] for path in by_path}
        pending = list(by_path)
        while pending:
            calls = {}
            for path in pending:
                holders = [node for node in self._holders_of(path) if node not in tried[path]]
                if not holders:
                    error = (SnapshotKeeperLost(f"{PROTOCOL}://{path}: no surviving snapshot keeper holds it "
                                                f"(tried {', '.join(n[:12] for n in tried[path]) or 'none'})")
                             if tried[path] else FileNotFoundError(path))
                    for index in by_path[path]:
                        results[index] = error
                    continue
                tried[path].append(holders[0])
                indices = by_path[path]
                calls[path] = (holders[0], self.keepers()[holders[0]].read_ranges.remote(
                    path, [requests[i][1] for i in indices], [requests[i][2] for i in indices]))
            answers, failures = self._answers({path: ref for path, (_, ref) in calls.items()})
            for path, (data, lengths) in answers.items():
                _split_into(results, by_path[path], data, lengths)
            pending = []
            for path, error in failures.items():
                cause = _cause(error)
                if isinstance(cause, FileNotFoundError):
                    for index in by_path[path]:
                        results[index] = cause
                    continue
                self._lose(calls[path][0], error)
                pending.append(path)
        errors = [result for result in results if isinstance(result, BaseException)]
        if raise_errors and errors:
            raise errors[0]
        return results

    def info(self, path, **kwargs):
        path = self._strip_protocol(path)
        sizes = self._listing(path)
        if path in sizes:
            return {"name": path, "size": sizes[path], "type": "file"}
        if any(name.startswith(path + "/") for name in sizes):
            return {"name": path, "size": 0, "type": "directory"}
        raise FileNotFoundError(path)

    def _listing(self, prefix: str) -> dict[str, int]:
        """Every file under prefix that a live keeper holds, with its size."""
        answers, lost = self._answers({node: keeper.listing.remote(prefix) for node, keeper in self.keepers().items()})
        for node, error in lost.items():
            self._lose(node, error)
        return {name: size for listing in answers.values() for name, size in listing.items()}

    def ls(self, path, detail=True, **kwargs):
        path = self._strip_protocol(path)
        prefix = path + "/" if path else ""
        sizes = self._listing(prefix)
        entries: dict[str, dict] = {}
        for name, size in sizes.items():
            child = name[len(prefix):].split("/", 1)
            full = prefix + child[0]
            entries[full] = ({"name": full, "size": size, "type": "file"} if len(child) == 1
                             else {"name": full, "size": 0, "type": "directory"})
        if not entries and path:
            exact = self._listing(path)
            if path in exact:
                entries[path] = {"name": path, "size": exact[path], "type": "file"}
        listed = sorted(entries.values(), key=lambda entry: entry["name"])
        return listed if detail else [entry["name"] for entry in listed]


class _WriteOnClose(io.BytesIO):
    """A file opened for writing: its bytes go to the keepers when it is closed without an error."""

    def __init__(self, fs: SnapshotFileSystem, path: str):
        super().__init__()
        self.fs, self.path = fs, path

    def __exit__(self, kind, error, trace):
        if kind is None:
            self.fs.pipe_file(self.path, self.getvalue())
        super().close()
        return False

    def close(self):
        if not self.closed:
            self.fs.pipe_file(self.path, self.getvalue())
        super().close()


class _KeptSegments:
    """A shard file being written (`SnapshotBackend.open_writer`): `write` copies what it is given
    (a caller may reuse its buffer), `write_kept` keeps a reference to a buffer its caller leaves
    unchanged until the writer closes (the shard writer's staged blocks), so the file's bytes are
    copied once in the writer's process, into the object store, by `put_segments`."""

    def __init__(self):
        self.segments: list = []

    def write(self, data) -> int:
        self.segments.append(bytes(data))
        return len(self.segments[-1])

    def write_kept(self, data) -> int:
        self.segments.append(data)
        return memoryview(data).nbytes


class SnapshotBackend(FsspecBackend):
    """The storage backend for snapshot URLs: create-only and compare-and-swap run inside each
    keeper (one actor, one lock), so they hold across the job's processes."""

    scheme = PROTOCOL
    short_ranges_are_cheap = True  # a file's ranges go to its keeper in one call (`read_ranges`)

    @contextlib.contextmanager
    def open_writer(self, path: str):
        handle = _KeptSegments()
        yield handle
        self.fs.put_segments(path, handle.segments)  # only when the block exits without an error

    def create_only(self, path: str, data: bytes) -> None:
        self.fs.create_only(path, data)

    def replace_if(self, path: str, data: bytes, token: str | None) -> None:
        expected = bytes.fromhex(token) if token is not None else None
        try:
            self.fs.replace_if(path, data, expected)
        except PreconditionFailedHere as error:
            raise PreconditionFailed(path) from error


register_backend(PROTOCOL, __name__, "SnapshotBackend")
# The `fsspec.specs` entry point serves an installed rayshard; a source tree on PYTHONPATH (the lent
# GPU machine's, a developer's checkout) has no entry point, so the module registers itself too,
# and the processes that open snapshots (the driver's snapshots.py, every rank) import it.
fsspec.register_implementation(PROTOCOL, SnapshotFileSystem, clobber=True)


def _this_node() -> str:
    return ray.get_runtime_context().get_node_id()  # keepers() has checked Ray is connected


def _split_into(results: list, indices: list[int], data, lengths: list[int]) -> None:
    """A keeper's `read_ranges` reply, cut back into one result per range (views, no copy)."""
    start = 0
    for index, length in zip(indices, lengths):
        results[index] = data[start:start + length]
        start += length


def _cause(error: BaseException) -> BaseException:
    """The keeper's own exception inside Ray's wrapper."""
    return getattr(error, "cause", None) or error


def _first(failures: dict) -> str:
    return str(next(iter(failures.values()))).strip().splitlines()[0][:200]
