"""The items of a DCP `.distcp` file, read without unpickling anything arbitrary.

torch 2.13's FileSystemWriter writes every item with `torch.save` into the rank's file
(`filesystem._write_item`, SerializationFormat.TORCH_SAVE, the default): a tensor item is a zip
archive holding a small pickle (`data.pkl`: `_rebuild_tensor_v2(storage, offset, size, stride,
...)`) and the tensor's storage as an uncompressed entry (`data/0`); a non-tensor item
(BytesStorageMetadata: an int, a float, a string, a BytesIO) is the torch.save of that object.

A tensor's bytes are located, not loaded: the archive's directory is read from the item's byte
range, its `data.pkl` is read by an unpickler that builds only records (it admits
`_rebuild_tensor_v2`, the typed storage classes and OrderedDict, and calls none of them), and the
storage entry's position gives the byte range of the chunk's row-major data in the `.distcp`
file. An import then streams those bytes, a row band at a time, straight into its own buffers.

A non-tensor item is read only when small, by an unpickler that admits no class or function at
all: plain numbers, strings, booleans, None, tuples, lists and dicts come out; anything else (a
BytesIO, a tensor, an object) is left unread and reported as skipped.

Refused in one line each: an item that is not a torch.save archive (DCP's safetensors
serialization, a compressed entry), a tensor that is not a dense little-endian contiguous chunk of
the dtype and size the `.metadata` says.
"""
from __future__ import annotations

import io
import pickle
import struct
import zipfile
from collections import OrderedDict
from dataclasses import dataclass

from rayshard.cluster.checkpoint.dcp_metadata import DcpChunk
from rayshard.plans.checkpoint.safetensors_layout import ITEMSIZE
from rayshard.plans.errors import CheckpointError

# torch's typed storage classes (what data.pkl names) -> dtype
STORAGE_DTYPES = {"FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
                  "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16",
                  "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool"}
MAX_VALUE_BYTES = 1 * 2**20  # non-tensor items larger than this are not read (a value worth importing is tiny)
# A torch.save record holds data.pkl, byteorder, version and its storages: a handful of entries.
# More is not torch's, and a central directory of millions would cost gigabytes to list.
MAX_RECORD_ENTRIES = 64
ZIP_END = struct.Struct("<4s4H2LH")  # end of central directory: signature, disks, entries here, entries, ...


def _small_zip(source) -> zipfile.ZipFile:
    """A torch.save record opened as a zip only after its end record says it lists few entries;
    every entry must then be stored (torch.save never compresses), so nothing read from it can
    decompress to more than its declared size."""
    source.seek(0, io.SEEK_END)
    size = source.tell()
    source.seek(max(0, size - ZIP_END.size))
    tail = source.read(ZIP_END.size)
    # A record with a zip comment or zip64 directory is not torch's: the end record is the last 22 bytes.
    if len(tail) != ZIP_END.size or tail[:4] != b"PK\x05\x06" or ZIP_END.unpack(tail)[4] > MAX_RECORD_ENTRIES:
        raise zipfile.BadZipFile("not a small torch.save record")
    source.seek(0)
    archive = zipfile.ZipFile(source)
    if any(info.compress_type != zipfile.ZIP_STORED for info in archive.infolist()):
        raise zipfile.BadZipFile("a compressed entry")
    return archive
ZIP_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")


class _Slice(io.RawIOBase):
    """A read-only view of bytes [start, start + length) of an open file: what zipfile needs
    (seek, tell, read). Everything zipfile reads of a torch.save record but the storage itself
    lies in its first few hundred bytes (data.pkl, byteorder, the storage's local header) and its
    last (the central directory): both ends are read once, `EDGE_BYTES` each, and its some
    fifteen small reads served from them; anything else is read from the file as asked."""

    EDGE_BYTES = 16 * 2**10

    def __init__(self, handle, start: int, length: int):
        self.handle, self.start, self.length, self.position = handle, start, length, 0
        self.edges: list[tuple[int, bytes]] = []  # (offset in the slice, bytes), read on first use

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = max(0, min(self.length, base + offset))
        return self.position

    def _edges(self) -> list[tuple[int, bytes]]:
        if not self.edges:
            head = min(self.length, self.EDGE_BYTES)
            self.handle.seek(self.start)
            self.edges.append((0, self.handle.read(head)))
            tail_start = max(head, self.length - self.EDGE_BYTES)
            if tail_start < self.length:
                self.handle.seek(self.start + tail_start)
                self.edges.append((tail_start, self.handle.read(self.length - tail_start)))
        return self.edges

    def readinto(self, buffer) -> int:
        count = min(len(buffer), self.length - self.position)
        if count <= 0:
            return 0
        for offset, data in self._edges():
            if offset <= self.position and self.position + count <= offset + len(data):
                within = self.position - offset
                buffer[:count] = data[within:within + count]
                self.position += count
                return count
        self.handle.seek(self.start + self.position)
        data = self.handle.read(count)
        buffer[:len(data)] = data
        self.position += len(data)
        return len(data)


@dataclass(frozen=True)
class _StorageRef:
    dtype: str
    key: str
    numel: int


@dataclass(frozen=True)
class _TensorRecord:
    storage: _StorageRef
    offset: int
    size: tuple
    stride: tuple


def _rebuild_tensor_record(storage, offset, size, stride, *_rest):
    return _TensorRecord(storage, offset, tuple(size), tuple(stride))


class _StorageMarker:
    def __init__(self, dtype: str):
        self.dtype = dtype


class _TensorPickleReader(pickle.Unpickler):
    """data.pkl of one torch.saved tensor, as a _TensorRecord (nothing of torch is called)."""

    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor_record
        if module == "torch" and name in STORAGE_DTYPES:
            return _StorageMarker(STORAGE_DTYPES[name])
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        raise CheckpointError(f"{self.where}: its tensor record names {module}.{name}, which a torch.saved dense tensor "
                              "never does; rayshard does not unpickle it. Fix: import a checkpoint saved from plain or "
                              "DTensor state (no tensor subclasses such as float8)")

    def persistent_load(self, pid):
        if (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageMarker)
                and isinstance(pid[2], str) and isinstance(pid[4], int)):
            return _StorageRef(pid[1].dtype, pid[2], pid[4])
        raise CheckpointError(f"{self.where}: its tensor record refers to {str(pid)[:60]!r}, not a typed storage")


@dataclass(frozen=True)
class ChunkBytes:
    """Where a chunk's row-major bytes lie in its `.distcp` file."""

    file: str
    start: int
    length: int


def locate_chunk(handle, chunk: DcpChunk, dtype: str, where: str) -> ChunkBytes:
    """The byte range of a tensor chunk's data inside its torch.save record (checked against the
    dtype and sizes `.metadata` gives)."""
    def refuse(problem: str) -> CheckpointError:
        return CheckpointError(f"{where}: {problem}. Fix: import a checkpoint written by torch.distributed.checkpoint.save "
                               "with FileSystemWriter's default torch.save serialization, whose save finished")
    view = _Slice(handle, chunk.start, chunk.length)
    try:
        archive = _small_zip(view)
        names = archive.namelist()
        pickles = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pickles) != 1:
            raise refuse(f"its item holds {len(pickles)} tensor records, not one")
        prefix = pickles[0][:-len("data.pkl")]
        if prefix + "byteorder" in names and (archive.getinfo(prefix + "byteorder").file_size > 16
                                              or archive.read(prefix + "byteorder") != b"little"):
            raise refuse("its item was saved big-endian")
        info = archive.getinfo(pickles[0])
        if info.file_size > MAX_VALUE_BYTES:
            raise refuse(f"its tensor record is {info.file_size} bytes, not a tensor's")
        record = _TensorPickleReader(io.BytesIO(archive.read(info)), where).load()
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, KeyError, EOFError, pickle.UnpicklingError, ValueError, TypeError, struct.error) as error:
        raise refuse(f"its item at bytes {chunk.start}+{chunk.length} of {chunk.file} is not a torch.save record "
                     f"({type(error).__name__}: {str(error)[:80]}): a truncated file, or another serialization "
                     "(DCP's safetensors format is not read)") from None
    if not isinstance(record, _TensorRecord):
        raise refuse(f"its item holds a {type(record).__name__}, not a tensor")
    storage = record.storage
    if (not isinstance(storage, _StorageRef) or not isinstance(record.offset, int) or isinstance(record.offset, bool)
            or record.offset < 0
            or not all(isinstance(n, int) for n in (*record.size, *record.stride))):
        raise refuse(f"its item's tensor record is damaged (offset {record.offset!r})")
    if storage.dtype != dtype:
        raise refuse(f"its item holds {storage.dtype} data but .metadata says {dtype}")
    if record.size != chunk.sizes:
        raise refuse(f"its item holds a tensor of size {list(record.size)} but .metadata says {list(chunk.sizes)}")
    if record.stride != _contiguous_strides(chunk.sizes) and _numel(chunk.sizes) > 1:
        raise refuse(f"its item holds a non-contiguous tensor (stride {list(record.stride)})")
    entry_name = f"{prefix}data/{storage.key}"
    try:
        entry = archive.getinfo(entry_name)
    except KeyError:
        raise refuse(f"its item lacks the storage entry {entry_name}") from None
    itemsize = ITEMSIZE[dtype]
    if entry.compress_type != zipfile.ZIP_STORED:
        raise refuse(f"its storage entry is compressed (method {entry.compress_type})")
    if entry.file_size != storage.numel * itemsize or record.offset + _numel(chunk.sizes) > storage.numel:
        raise refuse(f"its storage entry holds {entry.file_size} bytes, not the {_numel(chunk.sizes)} elements of the chunk")
    view.seek(entry.header_offset)
    header = view.read(ZIP_LOCAL_HEADER.size)
    if len(header) != ZIP_LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        raise refuse("its storage entry's header is damaged")
    name_length, extra_length = ZIP_LOCAL_HEADER.unpack(header)[-2:]
    data_start = entry.header_offset + ZIP_LOCAL_HEADER.size + name_length + extra_length + record.offset * itemsize
    length = _numel(chunk.sizes) * itemsize
    if data_start + length > chunk.length:
        raise refuse(f"its storage entry runs past the item's {chunk.length} bytes")
    return ChunkBytes(chunk.file, chunk.start + data_start, length)


class _PlainValueReader(pickle.Unpickler):
    """Admits no class and no function: only pickle's own plain values come out."""

    def find_class(self, module: str, name: str):
        raise _NotPlain(f"{module}.{name}")

    def persistent_load(self, pid):
        raise _NotPlain("a tensor storage")


class _NotPlain(Exception):
    pass


@dataclass(frozen=True)
class PlainValue:
    value: object = None
    skipped: str = ""  # why the value was not read ("" when it was)


def read_plain_value(data: bytes) -> PlainValue:
    """A non-tensor item's value when it is a plain one; else why it was skipped."""
    if len(data) > MAX_VALUE_BYTES:
        return PlainValue(skipped=f"{len(data)} bytes")
    try:
        archive = _small_zip(io.BytesIO(data))
        pickles = [n for n in archive.namelist() if n.endswith("data.pkl")]
        if len(pickles) != 1:
            return PlainValue(skipped="not one torch.save record")
        if archive.getinfo(pickles[0]).file_size > MAX_VALUE_BYTES:
            return PlainValue(skipped=f"a record of {archive.getinfo(pickles[0]).file_size} bytes")
        return PlainValue(_PlainValueReader(io.BytesIO(archive.read(pickles[0]))).load())
    except _NotPlain as what:
        return PlainValue(skipped=f"holds {what}")
    except Exception as error:  # a damaged record: it is skipped, never guessed at
        return PlainValue(skipped=f"unreadable ({type(error).__name__})")


def _numel(sizes) -> int:
    count = 1
    for size in sizes:
        count *= size
    return count


def _contiguous_strides(sizes) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(sizes):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
