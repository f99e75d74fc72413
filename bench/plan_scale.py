"""The reshard planner at 405B scale, on metadata alone (no torch.distributed, no tensor bytes).

Builds the manifest a 1024-rank job (dp8 x tp8 x pp16) would commit for a 405B-shaped model with
AdamW moments — every chunk from the layout rules (`plans/checkpoint/regions.py`: tp splits qkv,
gate_up, the embedding and the head by rows, wo and down by columns; fsdp cuts dim 0 after tp;
dp replicas write once, spread by bytes), with byte ranges from the real safetensors layout —
encodes it as the Parquet manifest, and plans loading it onto 768 ranks (dp6 x tp8 x pp16).

    .venv/bin/python bench/plan_scale.py [--source dp=8,tp=8,pp=16] [--target dp=6,tp=8,pp=16]

    .venv/bin/python bench/plan_scale.py --case fsdp    # 16,384 -> 12,288 ranks, FSDP-heavy (issue 24)
    .venv/bin/python bench/plan_scale.py --case mixed   # dp8 x fsdp8 x tp8 x pp32 -> dp6 x fsdp8 x tp8 x pp32

Prints, each against its goal: the save's gather of every rank's chunk table plus the encode
(< 2 s), the manifest size (< 20 MiB), decode (< 1 s), one rank's own plan including its decode
and index (< 0.2 s), planning every target rank with the coverage proof (< 10 s), and peak RSS
(< 2 GiB; it includes the synthetic build, so it overstates a driver's).
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
from plans.checkpoint.chunk_table import ChunkTable  # noqa: E402
from plans.checkpoint.reshard import header_checks, index_chunks, plan_layout, plan_rank  # noqa: E402
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


CASES = {  # --case NAME: the 16k-rank shapes of issue 24 (source -> target)
    "fsdp": ("fsdp=64,tp=8,pp=32", "fsdp=48,tp=8,pp=32"),
    "mixed": ("dp=8,fsdp=8,tp=8,pp=32", "dp=6,fsdp=8,tp=8,pp=32"),
    "dp": ("dp=8,tp=8,pp=16", "dp=6,tp=8,pp=16"),
}
GOALS = {"decode": 1.0, "rank": 0.2, "all": 10.0, "encode": 2.0, "rss_gib": 2.0}


def _peak_rss_gib() -> float:
    import resource  # Linux: ru_maxrss in KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _verdict(value: float, goal: float) -> str:
    return f"goal < {goal:g}: {'met' if value < goal else 'MISSED'}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="405b")
    parser.add_argument("--case", choices=sorted(CASES), help="a named source/target pair (overrides --source/--target)")
    parser.add_argument("--source", default="dp=8,tp=8,pp=16")
    parser.add_argument("--target", default="dp=6,tp=8,pp=16")
    parser.add_argument("--skip-all-ranks", action="store_true", help="skip planning every target rank (the dry run)")
    args = parser.parse_args(argv)
    if args.case:
        args.source, args.target = CASES[args.case]
    model = preset(args.model)
    source, target = ParallelLayout.parse(args.source), ParallelLayout.parse(args.target)
    print(f"model {args.model}: {parameter_count(model) / 1e9:.1f}B parameters, {model.n_layers} layers, "
          f"dim {model.dim}, {model.n_heads} heads / {model.n_kv_heads} kv heads, vocab {model.vocab_size}; "
          f"state = params + 2 AdamW moments (float32)")

    started = time.perf_counter()
    chunks = synthetic_manifest(model, source)
    build_s = time.perf_counter() - started
    metadata = {"run": "bench", "step": 1000, "layout": source.to_dict(), "model": model.to_dict(), "model_preset": args.model}
    # The save side: each rank's chunk list as columns (what a rank ships), gathered and encoded.
    per_file: dict[str, list[Chunk]] = {}
    for chunk in chunks:
        per_file.setdefault(chunk.file, []).append(chunk)
    rank_tables = [ChunkTable.from_chunks(group) for group in per_file.values()]
    del per_file
    started = time.perf_counter()
    gathered = ChunkTable.concat(rank_tables)
    manifest = encode_manifest(gathered, metadata)
    encode_s = time.perf_counter() - started
    started = time.perf_counter()
    encode_manifest(chunks, metadata)
    encode_records_s = time.perf_counter() - started
    del rank_tables, gathered
    started = time.perf_counter()
    decoded, decoded_metadata = decode_manifest(manifest)
    decode_s = time.perf_counter() - started
    total = decoded.total_bytes()
    print(f"source {source.describe()} ({source.world_size} ranks): {len(chunks):,} chunks in "
          f"{len(decoded.file_names())} files, {total / GiB:,.0f} GiB of state (synthetic manifest built in {build_s:.2f}s)")
    print(f"  manifest {len(manifest) / MiB:.2f} MiB (goal < 20 MiB: {'met' if len(manifest) < 20 * MiB else 'MISSED'})")
    print(f"  save: gather {source.world_size} ranks' chunk tables + encode {encode_s:.2f}s ({_verdict(encode_s, GOALS['encode'])}); "
          f"from one record per chunk {encode_records_s:.2f}s")
    print(f"  decode {decode_s:.3f}s ({_verdict(decode_s, GOALS['decode'])})")
    del chunks

    partition = pipeline_partition(model, target)
    targets = layout_targets(model, target, STATE_KINDS, partition)
    # One rank at load time: decode the manifest the driver handed it, index it, plan its own reads.
    timings = []
    for rank in (0, target.world_size // 2, target.world_size - 1):
        started = time.perf_counter()
        own, _ = decode_manifest(manifest)
        stored_index, headers = index_chunks(own), header_checks(own)
        one = plan_rank(stored_index, targets[rank], rank, headers)
        timings.append((time.perf_counter() - started, len(one.requests)))
    worst = max(t for t, _ in timings)
    print(f"  one rank's own plan incl. decode and index (what each rank does at load time): "
          f"{', '.join(f'{t:.3f}s ({n} requests)' for t, n in timings)} ({_verdict(worst, GOALS['rank'])})")

    if not args.skip_all_ranks:
        # Planning every rank: what a dry run (`ckpt plan`) does, coverage proof included.
        started = time.perf_counter()
        plan = plan_layout(decoded, targets)
        plan_s = time.perf_counter() - started
        reads = [r.bytes_read for r in plan.ranks]
        requests = [len(r.requests) for r in plan.ranks]
        print(f"target {target.describe()} ({target.world_size} ranks): planned every rank in {plan_s:.2f}s "
              f"({_verdict(plan_s, GOALS['all'])}), metadata only")
        print(f"  {plan.regions:,} target regions; {plan.proof()}")
        print(f"  storage reads {plan.bytes_read / GiB:,.0f} GiB = {plan.bytes_read / total:.3f}x the checkpoint "
              f"(needed {plan.bytes_needed / GiB:,.0f} GiB); {plan.bytes_received / GiB:,.0f} GiB more by broadcast to dp replicas "
              f"(every replica reading its own copy would read {(plan.bytes_read + plan.bytes_received) / total:.1f}x the checkpoint)")
        print(f"  per rank: read GiB min {min(reads) / GiB:.2f} median {statistics.median(reads) / GiB:.2f} max {max(reads) / GiB:.2f}; "
              f"requests min {min(requests)} median {statistics.median(requests):g} max {max(requests)}")
    rss = _peak_rss_gib()
    print(f"peak RSS of this process {rss:.2f} GiB ({_verdict(rss, GOALS['rss_gib'])}; includes the synthetic build)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
