"""The catalog: what a store holds — runs, whole checkpoints, leftovers of failed saves.

Built from the store itself (one listing per run plus each manifest's metadata), never from a
separate index that could disagree with it: a checkpoint is whole when its manifest exists and
every file the manifest names is present and long enough. Everything else under `checkpoints/`
is a leftover — an attempt no manifest references (a crashed or losing save), or a step
directory without a manifest (a save in progress, or one that died) — which `ckpt gc` removes.

For notebooks: `Catalog(url).dataset()` is a pyarrow dataset with one row per checkpoint, and
`Catalog(url).chunks_dataset()` one row per stored chunk over every committed manifest.
"""
from __future__ import annotations

import datetime as dt
import time
from dataclasses import asdict, dataclass, field

import pyarrow as pa
import pyarrow.dataset as ds
from pyarrow.fs import FSSpecHandler, PyFileSystem

from rayshard.plans.checkpoint.manifest.codec import decode_manifest
from rayshard.plans.checkpoint.manifest.codec import MANIFEST
from rayshard.cluster.catalog import leases
from rayshard.cluster.catalog.store import STEP_DIR, Store, resumed_step
from rayshard.plans.errors import CheckpointError
from rayshard.plans.run_names import check_run_name
from rayshard.plans.layout.parallel_layout import LAYOUT_DEGREES, PARALLEL_DEGREES
from rayshard.plans.checkpoint.manifest.object_keys import escape_reason


@dataclass(frozen=True)
class CheckpointEntry:
    run: str
    step: int
    url: str
    status: str  # "ok", or what is wrong ("2 files missing", "unreadable manifest: ...")
    latest: bool
    layout: str
    world_size: int
    model_preset: str
    size_bytes: int  # manifest plus the shard files it names
    files: int
    chunks: int
    parent: str | None
    created_unix: float | None
    format_version: str
    readers: int  # unexpired reader leases

    @property
    def whole(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True)
class Leftover:
    run: str
    step: int
    path: str  # an attempt directory, or a step directory without a manifest
    kind: str  # "orphaned attempt" | "incomplete save"
    size_bytes: int
    objects: int
    newest_unix: float  # the most recent write inside it: young leftovers may be saves in progress


@dataclass
class RunListing:
    """One listing of {run}/checkpoints: object sizes and times, grouped by step directory."""
    run: str
    steps: dict[str, dict[str, dict]] = field(default_factory=dict)  # step dir -> {relative path: info}


def modified_unix(info: dict) -> float:
    for key in ("LastModified", "mtime", "created", "last_modified"):
        value = info.get(key)
        if isinstance(value, dt.datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return dt.datetime.fromisoformat(value).timestamp()
            except ValueError:
                continue
    return time.time()  # unknown: treat as new, so nothing is deleted on a guess


class Catalog:
    def __init__(self, store: Store | str):
        self.store = store if isinstance(store, Store) else Store(store)
        self.fs, self.root = self.store.fs, self.store.root

    # ---- listing ------------------------------------------------------------------------------

    def runs(self) -> list[str]:
        return self.store.runs()

    def runs_named(self, run: str | None) -> list[str]:
        """[run] (a run name: never a path out of the store), or every run when run is None."""
        return self.runs() if run is None else [check_run_name(run)]

    def listing(self, run: str) -> RunListing:
        base = f"{self.root}/{run}/checkpoints"
        listing = RunListing(run)
        if not self.fs.exists(base):
            return listing
        for path, info in self.fs.find(base, detail=True).items():
            relative = path[len(base) + 1:] if path.startswith(base + "/") else path.split("/checkpoints/", 1)[-1]
            step_dir, _, rest = relative.partition("/")
            if STEP_DIR.match(step_dir) and rest:
                listing.steps.setdefault(step_dir, {})[rest] = info
        return listing

    def checkpoints(self, run: str | None = None) -> list[CheckpointEntry]:
        """Every committed checkpoint (whole or damaged), oldest first per run."""
        entries = []
        for name in self.runs_named(run):
            entries.extend(self._run_checkpoints(name, self.listing(name)))
        return entries

    def _run_checkpoints(self, run: str, listing: RunListing) -> list[CheckpointEntry]:
        committed = {d: files for d, files in listing.steps.items() if MANIFEST in files}
        manifests = self._read_manifests(run, sorted(committed))
        # The step a resume takes (LATEST's, or the newest where LATEST cannot say): gc keeps it.
        latest = resumed_step(self.store.latest_step(run), sorted(int(STEP_DIR.match(d).group(1)) for d in committed))
        readers = leases.active(self.store, run)
        entries = []
        for step_dir in sorted(committed):
            step = int(STEP_DIR.match(step_dir).group(1))
            files = committed[step_dir]
            url = self.store.checkpoint_url(run, step)
            decoded = manifests.get(step_dir)
            if isinstance(decoded, Exception):
                entries.append(CheckpointEntry(run, step, url, f"unreadable manifest: {decoded}", step == latest, "", 0, "",
                                               files[MANIFEST]["size"], 0, 0, None, None, "", len(readers.get(step, []))))
                continue
            chunks, metadata = decoded
            needed = chunks.file_extents()  # column-wise: no record per chunk
            status = _file_status(needed, {name: info["size"] for name, info in files.items()})
            layout = metadata.get("layout") or {}
            world = 1
            for dim in PARALLEL_DEGREES:
                world *= int(layout.get(dim, 1)) if isinstance(layout, dict) else 1
            if isinstance(layout, dict) and isinstance(layout.get("world_size"), int):  # rayshard.checkpoint's record
                world = layout["world_size"]
            size = files[MANIFEST]["size"] + sum(files[f]["size"] for f in needed if f in files)
            entries.append(CheckpointEntry(
                run, step, url, status, step == latest, _describe_layout(layout), world,
                str(metadata.get("model_preset", "")), size, len(needed), len(chunks), metadata.get("parent"),
                metadata.get("created_unix"), str(metadata.get("format_version", "")), len(readers.get(step, []))))
        return entries

    def _read_manifests(self, run: str, step_dirs: list[str]) -> dict[str, tuple | Exception]:
        base = f"{self.root}/{run}/checkpoints"
        paths = {f"{base}/{d}/{MANIFEST}": d for d in step_dirs}
        blobs = self.fs.cat(list(paths), on_error="return") if paths else {}
        decoded = {}
        for path, data in blobs.items():
            step_dir = paths.get(path) or paths.get(path.split("://", 1)[-1])
            try:
                if isinstance(data, BaseException):
                    raise data
                decoded[step_dir] = decode_manifest(data, f"{path}")
            except (CheckpointError, OSError) as error:
                decoded[step_dir] = error
        return decoded

    def leftovers(self, run: str | None = None) -> list[Leftover]:
        """Attempts no manifest references, and step directories without a manifest."""
        found = []
        for name in self.runs_named(run):
            listing = self.listing(name)
            manifests = self._read_manifests(name, sorted(d for d, files in listing.steps.items() if MANIFEST in files))
            for step_dir, files in sorted(listing.steps.items()):
                step = int(STEP_DIR.match(step_dir).group(1))
                decoded = manifests.get(step_dir)
                if any(relative.startswith(f"{MANIFEST}/") for relative in files) or (
                        MANIFEST in files and _damaged(decoded)):
                    continue  # a damaged manifest is reported by ls/verify, never collected by guesswork
                if MANIFEST not in files:
                    referenced, kind = set(), "incomplete save"
                else:
                    referenced, kind = {f.split("/", 1)[0] for f in decoded[0].file_names()}, "orphaned attempt"
                groups: dict[str, list[dict]] = {}
                for relative, info in files.items():
                    top = relative.split("/", 1)[0]
                    if relative != MANIFEST and top not in referenced:
                        groups.setdefault(top, []).append(info)
                base = f"{self.root}/{name}/checkpoints/{step_dir}"
                for top, infos in sorted(groups.items()):
                    found.append(Leftover(name, step, f"{base}/{top}", kind, sum(i["size"] for i in infos), len(infos),
                                          max(modified_unix(i) for i in infos)))
        return found

    # ---- tables for notebooks ---------------------------------------------------------------

    def table(self, run: str | None = None) -> pa.Table:
        rows = [asdict(entry) for entry in self.checkpoints(run)]
        schema = pa.schema([("run", pa.string()), ("step", pa.int64()), ("url", pa.string()), ("status", pa.string()),
                            ("latest", pa.bool_()), ("layout", pa.string()), ("world_size", pa.int64()),
                            ("model_preset", pa.string()), ("size_bytes", pa.int64()), ("files", pa.int64()),
                            ("chunks", pa.int64()), ("parent", pa.string()), ("created_unix", pa.float64()),
                            ("format_version", pa.string()), ("readers", pa.int64())])
        return pa.Table.from_pylist(rows, schema=schema)

    def dataset(self, run: str | None = None):
        """One row per checkpoint, as a pyarrow dataset (filter, project, to_table, to_pandas)."""
        return ds.dataset(self.table(run))

    def chunks_dataset(self, run: str | None = None):
        """One row per stored chunk over every committed manifest, with `run` and `checkpoint`
        columns from the paths; read lazily through the store's filesystem."""
        paths = [f"{self.root}/{e.run}/checkpoints/{e.url.rsplit('/', 1)[-1]}/{MANIFEST}" for e in self.checkpoints(run)]
        partitioning = ds.DirectoryPartitioning(pa.schema([("run", pa.string()), ("_", pa.string()),
                                                           ("checkpoint", pa.string())]))
        dataset = ds.dataset(paths, filesystem=PyFileSystem(FSSpecHandler(self.fs)), format="parquet",
                             partitioning=partitioning, partition_base_dir=self.root)
        return dataset.replace_schema(dataset.schema.remove(dataset.schema.get_field_index("_")))


def _file_status(needed: dict[str, int], sizes: dict[str, int]) -> str:
    escaping = sorted(f for f in needed if escape_reason(f))
    missing = sorted(f for f in needed if f not in sizes and f not in escaping)
    short = sorted(f for f in needed if f in sizes and sizes[f] < needed[f])
    problems = []
    if escaping:
        problems.append(f"{len(escaping)} file(s) outside the checkpoint")
    if missing:
        problems.append(f"{len(missing)} file(s) missing")
    if short:
        problems.append(f"{len(short)} file(s) truncated")
    return "; ".join(problems) or "ok"


def _describe_layout(layout) -> str:
    if not isinstance(layout, dict):
        return str(layout)
    if isinstance(layout.get("mesh"), dict):  # rayshard.checkpoint's record: the mesh dims of any program
        parts = [f"{name}{size}" for name, size in layout["mesh"].items()]
        return "x".join(parts) or ("single" if layout.get("world_size", 1) == 1 else f"{layout['world_size']} ranks")
    parts = [f"{dim}{layout[dim]}" for dim in LAYOUT_DEGREES if int(layout.get(dim, 1)) > 1]
    return "x".join(parts) or "single"



def _damaged(decoded) -> bool:
    """A manifest that failed to decode, lists nothing, or names files outside its checkpoint:
    which attempts it references cannot be trusted, so none of them is a leftover."""
    if isinstance(decoded, Exception):
        return True
    names = decoded[0].file_names()
    return not len(decoded[0]) or any(escape_reason(name) is not None for name in names)
