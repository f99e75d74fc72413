"""A checkpoint opened for the offline tools (`ckpt plan / reshard / export`) as a rayshard model's
state: the trainer's checkpoints as they are, a `rayshard.checkpoint` one through its model
description (`plans/interop/model_description.py`, decision 128).

- A trainer's, import's or reshard's checkpoint records its `model`: opened as is.
- An API checkpoint under rayshard's names: the same `StoredCheckpoint`, restricted to the
  parameters' weights and AdamW moments (`SelectedCheckpoint`), with the model in its metadata.
  Per-parameter AdamW steps, other tensors and JSON values stay in the source; a tool's output
  carries the checkpoint's one step.
- An API checkpoint under torchtitan's names: `MappedCheckpoint` reads our tensors through the
  torchtitan mapping's inverse a row band at a time (`row_bands.py`, as a DCP import does), from
  the stored torchtitan-named rows; it answers the reads the tools make (`read`, `read_region`)
  as a `StoredCheckpoint` does, and verifies the stored chunks it read in parts the same way.

Every shape is checked against the model before anything is read.
"""
from __future__ import annotations

import torch

from rayshard.actors.checkpoint.read_executor import WINDOW_BYTES, Destination
from rayshard.actors.checkpoint.stored import StoredCheckpoint, verify_parts
from rayshard.cluster.checkpoint.row_bands import Buffers, fill_band, row_origins
from rayshard.plans.checkpoint.chunk_table import ChunkTable, as_table
from rayshard.plans.checkpoint.chunks import Chunk
from rayshard.plans.interop.model_description import MANIFEST_KEY, ModelDescription, check_shapes, selected
from rayshard.plans.checkpoint.reshard import Target, header_checks
from rayshard.plans.errors import CheckpointError
from rayshard.plans.interop.torchtitan import torchtitan_mapping
from rayshard.plans.training.model_spec import parameter_shapes
from rayshard.plans.transforms.mapping import Meta
from rayshard.storage.manifest_io import read_manifest

API_WRITER = "rayshard.checkpoint"  # the manifest's `writer` of rayshard.checkpoint.save


def is_api_checkpoint(metadata: dict) -> bool:
    return metadata.get("writer") == API_WRITER and "model" not in metadata


def description_for(url: str, metadata: dict, given: ModelDescription | None) -> ModelDescription | None:
    """The description to open `url` with: None for a checkpoint that records its own model; for
    an API checkpoint the one given (command line), else the one recorded at save; else refused in
    one line naming the fix."""
    if not is_api_checkpoint(metadata):
        if given is not None:
            raise CheckpointError(f"checkpoint {url} records its own model ({(metadata.get('model') or {}).get('family', '?')}"
                                  f"); {given.source} applies only to checkpoints saved by rayshard.checkpoint. Fix: leave "
                                  "--model/--hf-config/--config/--names out")
        return None
    if given is not None:
        return given
    if MANIFEST_KEY in metadata:
        return ModelDescription.from_record(metadata[MANIFEST_KEY], url)
    raise CheckpointError(f"checkpoint {url} was saved by rayshard.checkpoint without a model description, which this "
                          "command needs (each tensor's role and shape). Fix: pass the model it holds with --model PRESET, "
                          "--hf-config DIR or --config FILE (and --names torchtitan for torchtitan's module names), or save "
                          "with rayshard.checkpoint.save(..., model={'preset': ...})")


def open_source(url: str, given: ModelDescription | None = None, chunks=None, metadata: dict | None = None):
    """The checkpoint at `url` as a rayshard model's state: a `StoredCheckpoint`, a
    `SelectedCheckpoint` or a `MappedCheckpoint` (see the module doc)."""
    if chunks is None:
        chunks, metadata = read_manifest(url)
    description = description_for(url, metadata, given)
    if description is None:
        return StoredCheckpoint(url, chunks, metadata, keys_checked=True)
    shapes = description.shapes()
    chunks = as_table(chunks)
    kept = [chunk for chunk in chunks if selected(chunk.name, chunk.kind, shapes)]
    found = {(c.name, c.kind): (c.global_shape, c.dtype) for c in kept}
    kinds = check_shapes(description, found, url)
    model_metadata = dict(metadata, model=description.model.to_dict(), model_preset=description.preset,
                          model_names=description.names)
    if description.names == "rayshard":
        return SelectedCheckpoint(url, chunks, kept, model_metadata)
    return MappedCheckpoint(SelectedCheckpoint(url, chunks, kept, model_metadata), description, kinds)


class SelectedCheckpoint(StoredCheckpoint):
    """Some of a checkpoint's tensors, read exactly as `StoredCheckpoint` reads them; the file
    header checks still come from every chunk of each file (a header is the bytes before the
    file's first chunk, whichever tensor that is)."""

    def __init__(self, url: str, every_chunk: ChunkTable, kept: list[Chunk] | ChunkTable, metadata: dict):
        super().__init__(url, kept, metadata, keys_checked=True)
        self.every_chunk = every_chunk
        self.headers = header_checks(every_chunk)


class MappedCheckpoint:
    """Our tensors, read from a checkpoint that holds them under torchtitan's names: a target's
    rows come from the stored rows the mapping's inverse names (`row_origins`), read with the
    stored checkpoint's own planned, checksummed reads. Whole rows are read, then the target's
    columns taken."""

    def __init__(self, stored: SelectedCheckpoint, description: ModelDescription, kinds: list[str]):
        self.stored, self.url, self.metadata = stored, stored.url, stored.metadata
        self.description, self.kinds = description, kinds
        model = description.model
        ours = parameter_shapes(model)
        inverse = torchtitan_mapping(model).inverse()
        self.origins, self.sources, chunks = {}, {}, []
        for kind in kinds:
            metas = {name: Meta(index.chunks[0].global_shape, index.chunks[0].dtype)
                     for (name, k), index in stored.index.items() if k == kind}
            plan = inverse.plan(metas)
            for group in plan.groups:
                origins = row_origins(group, metas)
                for name in group.outputs:
                    self.origins[(name, kind)] = origins[name]
                    self.sources[(name, kind)] = {source: metas[source] for source in group.sources}
                    meta = plan.outputs[name]
                    if tuple(meta.shape) != tuple(ours[name]):  # check_shapes makes this unreachable
                        raise CheckpointError(f"{name}: maps to {list(meta.shape)}, the model has {list(ours[name])}")
                    # One whole-tensor chunk per tensor: what the tools' model checks and plans look at.
                    chunks.append(Chunk(name, kind, meta.dtype, tuple(meta.shape), (0,) * len(meta.shape),
                                        tuple(meta.shape), "", 0, 0, ""))
        self.chunks = ChunkTable.from_chunks(chunks)
        self.whole = {(c.name, c.kind): [c] for c in chunks}
        self.index = dict.fromkeys(self.whole)  # (name, kind) keys, as StoredCheckpoint.index has
        self.buffers = Buffers()

    def tensors(self) -> dict[tuple[str, str], list[Chunk]]:
        return dict(self.whole)

    def _read_rows(self, kind: str):
        def read_rows(source: str, first: int, end: int, into: torch.Tensor) -> None:
            offsets = (first,) + (0,) * (into.dim() - 1) if into.dim() else ()
            self.stats["bytes_read"] += self.stored.read({Target(source, kind, offsets, tuple(into.shape)):
                                                          Destination(into, offsets)})["bytes_read"]
            self.stats["requests"] += 1
        return read_rows

    def read(self, destinations: dict[Target, Destination], window_bytes: int = WINDOW_BYTES, **_) -> dict:
        self.stats = {"bytes_read": 0, "requests": 0}
        needed = 0
        for target, destination in destinations.items():
            key = (target.name, target.kind)
            if key not in self.origins:
                raise CheckpointError(f"{target.name} ({target.kind}) is not in {self.url}")
            sources = self.sources[key]
            first = target.offsets[0] if target.offsets else 0
            end = first + target.sizes[0] if target.sizes else 1
            chunk = self.whole[key][0]
            shape, dtype = chunk.global_shape, getattr(torch, chunk.dtype)
            band = self.buffers.take("band", (end - first, *shape[1:]) if shape else (), dtype)
            fill_band(self.origins[key], first, end, band, {n: m.shape for n, m in sources.items()},
                      {n: getattr(torch, m.dtype) for n, m in sources.items()}, self._read_rows(target.kind),
                      self.buffers.take)
            region = band[(slice(None), *(slice(o, o + s) for o, s in zip(target.offsets[1:], target.sizes[1:])))] \
                if shape else band
            place = tuple(slice(o - d, o - d + s) for o, d, s in zip(target.offsets, destination.offsets, target.sizes))
            destination.tensor[place].copy_(region)
            needed += region.numel() * region.element_size()
        return {"bytes_read": self.stats["bytes_read"], "bytes_needed": needed, "requests": self.stats["requests"],
                "files": len(self.stored.chunks.file_names())}

    def read_region(self, name: str, kind: str, offsets: tuple, sizes: tuple) -> torch.Tensor:
        chunk = self.whole[(name, kind)][0]
        tensor = torch.empty(sizes, dtype=getattr(torch, chunk.dtype))
        self.read({Target(name, kind, tuple(offsets), tuple(sizes)): Destination(tensor, tuple(offsets))})
        return tensor

    def take_partial_reads(self):
        return self.stored.take_partial_reads()

    def check_partial_reads(self) -> int:
        return verify_parts(self.take_partial_reads(), self.url, lambda: self.stored)


def reopened(source):
    """Another reader of the same checkpoint and view, for a parallel writer (partial reads and
    band buffers are per reader)."""
    if isinstance(source, MappedCheckpoint):
        return MappedCheckpoint(reopened(source.stored), source.description, source.kinds)
    if isinstance(source, SelectedCheckpoint):
        return SelectedCheckpoint(source.url, source.every_chunk, source.chunks, source.metadata)
    return StoredCheckpoint(source.url, source.chunks, source.metadata, keys_checked=True)
