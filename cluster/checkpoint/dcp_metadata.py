"""A torch.distributed.checkpoint (DCP) directory's `.metadata`, read without trusting it.

DCP's `.metadata` is a pickle (`FileSystemWriter.finish`: `pickle.dump(Metadata)`), and unpickling
runs whatever callables the file names. It is read here with a restricted unpickler that admits
only what torch's FileSystemWriter pickles (checked by saving one and listing its globals with
pickletools, torch 2.13): DCP's metadata records, torch dtypes, layouts (by name), torch.Size, the
memory-format enum, and the `pathlib` path a checkpoint_id may be. Any other class or function is
refused in one line naming it, before anything is built from it.

What comes out is checked field by field and returned as plain records (`DcpContents`): every
tensor's dtype, global shape and chunks (offsets, sizes, and the byte range of the item holding
them), and the byte ranges of the non-tensor items. Refused in one line each: a DCP version other
than the one read here, storage transforms (DCP's experimental compression extensions), a file
name that leaves the directory, planner or storage data of an unexpected shape.
"""
from __future__ import annotations

import io
import pathlib
import pickle
import pickletools
import re
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

from rayshard.plans.errors import CheckpointError

METADATA_FILE = ".metadata"
# The DCP versions this reader knows (torch 2.4 and later write 1.0.0; 2.13 still does).
KNOWN_VERSIONS = ("1.0.0",)
# The largest `.metadata` read: 16k ranks of a 405B model's chunks stay far below it; a damaged
# size is refused before it is read into memory.
MAX_METADATA_BYTES = 2 * 2**30

_ADMITTED = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by its name, e.g. "torch.strided"
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "pathlib._local": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},  # Python 3.13's spelling
    "collections": {"OrderedDict"},
}
# A plain file name inside the checkpoint directory, as DCP writes them (`__0_0.distcp`).
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*\Z")


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str):
        if name in _ADMITTED.get(module, ()):
            return getattr(pathlib if module.startswith("pathlib") else _module(module), name)
        if module == "torch" and isinstance(torch.__dict__.get(name), torch.dtype):  # no lazy submodule import
            return getattr(torch, name)
        raise CheckpointError(f"{self.where}: names {module}.{name}, which is not one of DCP's metadata classes; the file "
                              "is not a DCP checkpoint's .metadata (or was tampered with), and rayshard does not unpickle "
                              "it. Fix: import a directory written by torch.distributed.checkpoint.save")

    def persistent_load(self, pid):
        raise CheckpointError(f"{self.where}: holds a persistent reference ({str(pid)[:40]!r}), which DCP's .metadata "
                              "never does. Fix: import a directory written by torch.distributed.checkpoint.save")


def _module(name: str):
    return {"torch.distributed.checkpoint.metadata": dcp_metadata, "torch.distributed.checkpoint.filesystem": dcp_filesystem,
            "torch.serialization": torch.serialization, "torch": torch, "collections": __import__("collections")}[name]


@dataclass(frozen=True)
class DcpChunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # relative to the checkpoint directory
    start: int  # the item's byte range in it (a torch.save record holding the chunk)
    length: int


@dataclass(frozen=True)
class DcpTensor:
    key: str
    dtype: str  # "float32", ...
    shape: tuple[int, ...]
    chunks: tuple[DcpChunk, ...]


@dataclass(frozen=True)
class DcpValue:
    """A non-tensor item (DCP torch.saves it: a pickle, read only as plain values)."""

    key: str
    file: str
    start: int
    length: int


@dataclass(frozen=True)
class DcpContents:
    directory: str
    version: str
    tensors: dict[str, DcpTensor]
    values: dict[str, DcpValue]


def read_dcp_metadata(fs, base: str, directory: str) -> DcpContents:
    path = f"{base}/{METADATA_FILE}"
    where = f"{directory.rstrip('/')}/{METADATA_FILE}"
    if not fs.exists(path):
        raise CheckpointError(f"{directory}: has no {METADATA_FILE}, so it is not a torch.distributed.checkpoint directory "
                              "(or its save did not finish). Fix: import the directory dcp.save wrote")
    info = fs.info(path)
    if info.get("type") != "file":  # a FIFO or a device reports size 0 and may never end
        raise CheckpointError(f"{where}: is not a regular file ({info.get('type')}), so not the .metadata dcp.save "
                              "writes. Fix: import the directory dcp.save wrote")
    size = info.get("size") or 0
    if size > MAX_METADATA_BYTES:
        raise CheckpointError(f"{where}: is {size} bytes, more than any DCP .metadata rayshard reads "
                              f"({MAX_METADATA_BYTES}); it is not DCP's. Fix: import the directory dcp.save wrote")
    with fs.open(path, "rb") as handle:
        # Once: the scan and the unpickler read the same bytes (one GET on a store). At most one byte
        # past the bound: a path that is no regular file (a FIFO, /dev/zero) reports size 0 and never ends.
        data = handle.read(MAX_METADATA_BYTES + 1)
    if len(data) > MAX_METADATA_BYTES:
        raise CheckpointError(f"{where}: holds more than {MAX_METADATA_BYTES} bytes, more than any DCP .metadata rayshard "
                              "reads; it is not DCP's. Fix: import the directory dcp.save wrote")
    try:
        _scan(io.BytesIO(data), len(data), where)
        return _checked(_MetadataUnpickler(io.BytesIO(data), where).load(), where, directory)
    except CheckpointError:
        raise
    except Exception as error:  # truncated or garbled: EOFError, UnpicklingError, a bad record's TypeError, ...
        raise CheckpointError(f"{where}: cannot be read as DCP metadata ({type(error).__name__}: "
                              f"{str(error)[:120] or 'no detail'}); it is truncated or damaged. Fix: import a "
                              "checkpoint whose save finished, or save it again") from None


# A crafted pickle is refused before it builds anything. A pickle can turn each byte into an
# object (EMPTY_DICT is one byte for a 64-byte dict), and dict keys that are multiples of
# 2**61 - 1 all hash alike, so one dict of them takes quadratic time to build. DCP's own metadata
# spends well over a hundred bytes per chunk on a few containers and records, and its integers
# (offsets, sizes, byte ranges) stay far below 2**61. So: at most one container or object
# construction per 16 bytes of file (memory then stays within a few times the file's size), no
# integer of 2**61 or more.
BYTES_PER_OBJECT = 16
LARGEST_INTEGER = 2**61
_BUILDS = {"EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE", "EMPTY_SET", "DICT", "LIST", "TUPLE", "TUPLE1", "TUPLE2",
           "TUPLE3", "FROZENSET", "NEWOBJ", "NEWOBJ_EX", "REDUCE", "BUILD", "OBJ", "INST"}


def _scan(handle, size: int, where: str) -> None:
    budget, built = 10_000 + size // BYTES_PER_OBJECT, 0
    for opcode, argument, _ in pickletools.genops(handle):
        built += opcode.name in _BUILDS
        if built > budget:
            raise CheckpointError(f"{where}: builds more than {budget} objects in its {size} bytes, more than DCP's "
                                  "metadata ever does; rayshard does not unpickle it. Fix: import a directory written "
                                  "by torch.distributed.checkpoint.save")
        if isinstance(argument, int) and not isinstance(argument, bool) and abs(argument) >= LARGEST_INTEGER:
            raise CheckpointError(f"{where}: holds the integer {argument}, larger than any offset or size DCP writes; "
                                  "rayshard does not unpickle it. Fix: import a directory written by "
                                  "torch.distributed.checkpoint.save")


def _checked(metadata, where: str, directory: str) -> DcpContents:
    def refuse(problem: str) -> CheckpointError:
        return CheckpointError(f"{where}: {problem}. Fix: import a directory written by torch.distributed.checkpoint.save "
                               f"of torch 2.4 to 2.13 with its FileSystemWriter defaults")
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise refuse(f"holds a {type(metadata).__name__}, not DCP's Metadata")
    version = getattr(metadata, "version", None)
    if version not in KNOWN_VERSIONS:
        raise refuse(f"is DCP version {version!r}, which rayshard does not read (it reads {', '.join(KNOWN_VERSIONS)})")
    storage_meta = getattr(metadata, "storage_meta", None)
    if storage_meta is not None and not isinstance(storage_meta, dcp_metadata.StorageMeta):
        raise refuse(f"has storage_meta of type {type(storage_meta).__name__}, not DCP's StorageMeta")
    planner_data = getattr(metadata, "planner_data", None)
    if planner_data is not None and not (isinstance(planner_data, dict) and all(
            isinstance(k, str) and isinstance(v, (tuple, list)) and all(isinstance(p, (str, int)) for p in v)
            for k, v in planner_data.items())):
        raise refuse(f"has planner_data of an unexpected shape ({type(planner_data).__name__}): not the key paths "
                     "DCP's default planner records")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise refuse(f"has storage_data of type {type(storage).__name__}, not a dict of item locations")
    if not isinstance(metadata.state_dict_metadata, dict):
        raise refuse("has no state_dict_metadata dict")
    locations = {}
    for index, info in storage.items():
        if not isinstance(index, dcp_metadata.MetadataIndex) or not isinstance(info, dcp_filesystem._StorageInfo):
            raise refuse(f"has a storage entry {type(index).__name__} -> {type(info).__name__}, not MetadataIndex -> "
                         "_StorageInfo (another storage writer's format)")
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors:
            raise refuse(f"item {index.fqn} is stored through the transform(s) {list(descriptors)}, which rayshard does not "
                         "read; save without DCP's storage extensions (compression)")
        if not (isinstance(info.relative_path, str) and _FILE_NAME.match(info.relative_path)):
            raise refuse(f"item {index.fqn} names the file {str(info.relative_path)[:80]!r}, not a file of the checkpoint "
                         "directory")
        if not all(isinstance(n, int) and n >= 0 for n in (info.offset, info.length)):
            raise refuse(f"item {index.fqn} has the byte range {info.offset!r}+{info.length!r}")
        locations[(index.fqn, None if index.offset is None else tuple(index.offset))] = info
    tensors, values = {}, {}
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(key, str):
            raise refuse(f"has a key of type {type(key).__name__}")
        if isinstance(entry, dcp_metadata.BytesStorageMetadata):
            info = locations.get((key, None))
            if info is None:
                raise refuse(f"lists {key} but records no storage for it")
            values[key] = DcpValue(key, info.relative_path, info.offset, info.length)
        elif isinstance(entry, dcp_metadata.TensorStorageMetadata):
            tensors[key] = _tensor(key, entry, locations, refuse)
        else:
            raise refuse(f"describes {key} with a {type(entry).__name__}, not a tensor or bytes record")
    return DcpContents(directory, version, tensors, values)


def _tensor(key: str, entry, locations: dict, refuse) -> DcpTensor:
    properties = entry.properties
    dtype = getattr(properties, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise refuse(f"gives {key} the dtype {dtype!r}")
    if getattr(properties, "layout", torch.strided) != torch.strided:
        raise refuse(f"stores {key} with layout {properties.layout}; rayshard reads dense (strided) tensors")
    shape = _whole_numbers(entry.size, key, "size", refuse)
    chunks = []
    if not isinstance(entry.chunks, (list, tuple)) or not entry.chunks:
        raise refuse(f"lists no chunks for {key}")
    for chunk in entry.chunks:
        offsets = _whole_numbers(chunk.offsets, key, "chunk offsets", refuse)
        sizes = _whole_numbers(chunk.sizes, key, "chunk sizes", refuse)
        if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                o + s > n for o, s, n in zip(offsets, sizes, shape)):
            raise refuse(f"has a chunk of {key} at {list(offsets)} of size {list(sizes)}, outside its shape {list(shape)}")
        info = locations.get((key, offsets))
        if info is None:
            raise refuse(f"records no storage for the chunk of {key} at {list(offsets)}")
        chunks.append(DcpChunk(offsets, sizes, info.relative_path, info.offset, info.length))
    return DcpTensor(key, str(dtype).removeprefix("torch."), shape, tuple(chunks))


def _whole_numbers(value, key: str, what: str, refuse) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value):
        raise refuse(f"gives {key} the {what} {value!r}")
    return tuple(value)
