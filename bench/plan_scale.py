"""The reshard planner at 405B scale, on metadata alone (no torch.distributed, no tensor bytes).

Builds the manifest a 1024-rank job (dp8 x tp8 x pp16) would commit for a 405B-shaped model with
AdamW moments — every chunk from the layout rules (`plans/checkpoint/regions.py`: tp splits qkv,
gate_up, the embedding and the head by rows, wo and down by columns; fsdp cuts dim 0 after tp;
dp replicas write once, spread by bytes), with byte ranges from the real safetensors layout —
encodes it as the Parquet manifest, and plans loading it onto 768 ranks (dp6 x tp8 x pp16).

    .venv/bin/python bench/plan_scale.py [--source dp=8,tp=8,pp=16] [--target dp=6,tp=8,pp=16]

Prints planning time (goal < 5 s) and manifest size (goal < 20 MiB), with the bytes and requests
per target rank the plan asks for.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from plans.checkpoint.manifest import FORMAT_VERSION, chunk_key, decode_manifest, encode_manifest  # noqa: E402
from actors.checkpoint.checksums import checksum  # noqa: E402
from plans.checkpoint.chunks import STATE_KINDS, Chunk  # noqa: E402
from plans.layout.parallel_layout import ParallelLayout  # noqa: E402
from plans.training.model_spec import parameter_count, preset  # noqa: E402
from plans.checkpoint.reshard import plan_layout  # noqa: E402
from plans.checkpoint.safetensors_layout import Entry, file_layout  # noqa: E402
from plans.checkpoint.writers import predicted_writes  # noqa: E402
from plans.checkpoint.regions import layout_targets, pipeline_partition  # noqa: E402

GiB, MiB = 2**30, 2**20


def synthetic_manifest(model, layout, dtype: str = "float32") -> list[Chunk]:
    """The chunks a save in `layout` writes, byte-exact except for checksums (made up: no bytes exist)."""
    chunks = []
    for rank, pieces in enumerate(predicted_writes(model, layout, pipeline_partition(model, layout), STATE_KINDS, dtype)):
        if not pieces:
            continue
        file = f"attempt-000000000000/rank-{rank:05d}.safetensors"
        entries = [Entry(chunk_key(p.region.name, p.kind, p.region.offsets), dtype, p.region.sizes) for p in pieces]
        header, ranges = file_layout(entries, {"format": "rayshard", "version": FORMAT_VERSION, "nonce": f"{rank:032x}"})
        header_checksum = checksum(header)
        for piece, entry, (start, end) in zip(pieces, entries, ranges):
            fake = checksum(entry.key.encode() + file.encode())  # the real format's width, of stand-in bytes
            chunks.append(Chunk(piece.region.name, piece.kind, dtype, piece.region.global_shape, piece.region.offsets,
                                piece.region.sizes, file, start, end, fake, header_checksum))
    return chunks


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="405b")
    parser.add_argument("--source", default="dp=8,tp=8,pp=16")
    parser.add_argument("--target", default="dp=6,tp=8,pp=16")
    args = parser.parse_args(argv)
    model = preset(args.model)
    source, target = ParallelLayout.parse(args.source), ParallelLayout.parse(args.target)
    print(f"model {args.model}: {parameter_count(model) / 1e9:.1f}B parameters, {model.n_layers} layers, "
          f"dim {model.dim}, {model.n_heads} heads / {model.n_kv_heads} kv heads, vocab {model.vocab_size}; "
          f"state = params + 2 AdamW moments (float32)")

    started = time.perf_counter()
    chunks = synthetic_manifest(model, source)
    build_s = time.perf_counter() - started
    metadata = {"run": "bench", "step": 1000, "layout": source.to_dict(), "model": model.to_dict(), "model_preset": args.model}
    started = time.perf_counter()
    manifest = encode_manifest(chunks, metadata)
    encode_s = time.perf_counter() - started
    started = time.perf_counter()
    decoded, decoded_metadata = decode_manifest(manifest)
    decode_s = time.perf_counter() - started
    total = sum(c.byte_end - c.byte_start for c in chunks)
    print(f"source {source.describe()} ({source.world_size} ranks): {len(chunks):,} chunks in "
          f"{len({c.file for c in chunks})} files, {total / GiB:,.0f} GiB of state")
    print(f"  manifest {len(manifest) / MiB:.2f} MiB (goal < 20 MiB: {'met' if len(manifest) < 20 * MiB else 'MISSED'}); "
          f"built in {build_s:.2f}s, encoded in {encode_s:.2f}s, decoded in {decode_s:.2f}s")

    # Planning: what a dry run does (the loader plans only its own rank, far less).
    started = time.perf_counter()
    partition = pipeline_partition(model, target)
    targets = layout_targets(model, target, STATE_KINDS, partition)
    plan = plan_layout(decoded, targets)
    plan_s = time.perf_counter() - started
    reads = [r.bytes_read for r in plan.ranks]
    requests = [len(r.requests) for r in plan.ranks]
    print(f"target {target.describe()} ({target.world_size} ranks): planned every rank in {plan_s:.2f}s "
          f"(goal < 5 s: {'met' if plan_s < 5 else 'MISSED'}), metadata only")
    print(f"  {plan.regions:,} target regions; {plan.proof()}")
    print(f"  storage reads {plan.bytes_read / GiB:,.0f} GiB = {plan.bytes_read / total:.3f}x the checkpoint "
          f"(needed {plan.bytes_needed / GiB:,.0f} GiB); {plan.bytes_received / GiB:,.0f} GiB more by broadcast to dp replicas "
          f"(every replica reading its own copy would read {(plan.bytes_read + plan.bytes_received) / total:.1f}x the checkpoint)")
    print(f"  per rank: read GiB min {min(reads) / GiB:.2f} median {statistics.median(reads) / GiB:.2f} max {max(reads) / GiB:.2f}; "
          f"requests min {min(requests)} median {statistics.median(requests):g} max {max(requests)}")
    started = time.perf_counter()
    one = plan_layout(decoded, [targets[0]], check_sources=False)
    print(f"  one rank's own plan (what each rank does at load time): {time.perf_counter() - started:.3f}s, "
          f"{len(one.ranks[0].requests)} requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
