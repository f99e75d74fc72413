"""The reshard planner at 405B scale, on metadata alone (no torch.distributed, no tensor bytes).

Builds the manifest a 1024-rank job (dp8 x tp8 x pp16) would commit for a 405B-shaped model with
AdamW moments — every chunk from the layout rules (`plans/checkpoint/regions.py`: tp splits qkv,
gate_up, the embedding and the head by rows, wo and down by columns; fsdp cuts dim 0 after tp;
dp replicas write once, spread by bytes), with byte ranges from the real safetensors layout —
encodes it as the Parquet manifest, and plans loading it onto 768 ranks (dp6 x tp8 x pp16).

    .venv/bin/python bench/plan_scale.py [--source dp=8,tp=8,pp=16] [--target dp=6,tp=8,pp=16]

    .venv/bin/python bench/plan_scale.py --case fsdp    # 16,384 -> 12,288 ranks, FSDP-heavy (issue 24)
    .venv/bin/python bench/plan_scale.py --case mixed   # dp8 x fsdp8 x tp8 x pp32 -> dp6 x fsdp8 x tp8 x pp32

Prints, each against its goal: the save's gather of every rank's chunk table (unpickled, as Ray
hands them to the driver) plus the tiling check and the encode (< 2 s), the manifest size
(< 20 MiB), decode (< 1 s), one rank's own plan including its decode and index (< 0.2 s), and,
against a local-directory store holding the manifest (shard files sparse, of the right sizes),
the commands a person runs, each in a fresh process timed from start to exit: `ckpt plan` over
every target rank with the coverage proof (< 10 s) and its peak RSS (< 2 GiB), `ckpt ls`,
`ckpt show`, `ckpt verify` (shallow) (each < 5 s), and `ckpt diff`'s work before its first read
(opening both checkpoints and cutting every tensor into row blocks; < 5 s; the reads themselves
are bandwidth: 2 x 4.5 TiB here).
"""
from __future__ import annotations

import argparse
import os
import pickle
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rayshard.plans.checkpoint.manifest.codec import FORMAT_VERSION, chunk_key, decode_manifest, encode_manifest  # noqa: E402
from rayshard.storage.checksums import checksum  # noqa: E402
from rayshard.plans.checkpoint.chunks import STATE_KINDS, Chunk  # noqa: E402
from rayshard.plans.layout.parallel_layout import ParallelLayout  # noqa: E402
from rayshard.plans.training.model_spec import parameter_count, preset  # noqa: E402
from rayshard.plans.checkpoint.chunk_table import ChunkTable  # noqa: E402
from rayshard.cluster.checkpoint.digest import _tensors, row_blocks  # noqa: E402
from rayshard.cluster.catalog.pending import PendingCheckpoint  # noqa: E402
from rayshard.cluster.catalog.store import Store  # noqa: E402
from rayshard.actors.checkpoint.stored import StoredCheckpoint  # noqa: E402
from rayshard.plans.checkpoint.reshard import header_checks, index_chunks, plan_rank  # noqa: E402
from rayshard.plans.checkpoint.safetensors_layout import Entry, file_layout  # noqa: E402
from rayshard.plans.checkpoint.writers import predicted_writes  # noqa: E402
from rayshard.plans.checkpoint.regions import layout_targets, pipeline_partition  # noqa: E402

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
GOALS = {"decode": 1.0, "rank": 0.2, "all": 10.0, "encode": 2.0, "rss_gib": 2.0, "command": 5.0}
RUN, STEP, OTHER_STEP = "bench", 1000, 2000


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def _verdict(value: float, goal: float) -> str:
    return f"goal < {goal:g}: {'met' if value < goal else 'MISSED'}"


def _gather_and_encode(shipped: list[bytes], metadata: dict) -> bytes:
    """What the driver does with every rank's answer to save_shard: Ray unpickles each rank's
    table, the driver concatenates the columns, checks the tiling and encodes (cluster/run/train.py)."""
    tables = [pickle.loads(blob) for blob in shipped]
    return PendingCheckpoint(None, RUN, STEP, "", "").manifest(ChunkTable.concat(tables), metadata)


def _sparse_store(root: str, manifest: bytes, extents: dict[str, int]) -> Store:
    """A local store with the manifest committed twice (two steps, for diff), every shard file
    present at its length but sparse: no tensor bytes exist."""
    store = Store(root)
    for step in (STEP, OTHER_STEP):
        url = store.commit(RUN, step, manifest)
        for file, length in extents.items():
            path = os.path.join(url, file)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as handle:
                handle.truncate(length)
    return store


# A fresh process running the CLI, reporting its own peak RSS (VmHWM: the high-water mark of its
# own memory, which, unlike ru_maxrss, does not carry over the forked parent's across exec).
COMMAND = """
import sys
from rayshard.cluster.cli.main import main
code = main(sys.argv[1:])
peak = [line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")][0]
print(f"peak_rss_gib={int(peak) / 2**20:.3f}", flush=True)
sys.exit(code if code in (0, 1) else 2)
"""
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _command(argv: list[str]) -> tuple[float, float, str]:
    """(seconds from start to exit, the process's peak RSS in GiB, its output) of
    `rayshard ARGV` in a fresh Python process."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", COMMAND, *argv], capture_output=True, text=True, check=False, cwd=REPO)
    seconds = time.perf_counter() - started
    if done.returncode not in (0, 1):
        raise RuntimeError(f"rayshard {' '.join(argv)} failed:\n{done.stdout}\n{done.stderr}")
    output, _, rss = done.stdout.rpartition("peak_rss_gib=")
    return seconds, float(rss), output


def _diff_until_first_read(store: Store) -> float:
    """Seconds `ckpt diff` spends before its first read: both checkpoints opened (decode, index,
    headers), their tensors listed, each cut into the row blocks it will stream."""
    started = time.perf_counter()
    sides = [StoredCheckpoint(store.checkpoint_url(RUN, step)) for step in (STEP, OTHER_STEP)]
    for side in sides:
        for name, kind in _tensors(side):
            row_blocks(side.index[(name, kind)], 64 * 2**20)
    return time.perf_counter() - started


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="405b")
    parser.add_argument("--case", choices=sorted(CASES), help="a named source/target pair (overrides --source/--target)")
    parser.add_argument("--source", default="dp=8,tp=8,pp=16")
    parser.add_argument("--target", default="dp=6,tp=8,pp=16")
    parser.add_argument("--skip-all-ranks", action="store_true", help="skip the commands (dry run, ls, show, verify, diff)")
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
    metadata = {"run": RUN, "step": STEP, "layout": source.to_dict(), "model": model.to_dict(), "model_preset": args.model}
    # The save side: each rank's chunks as a table, pickled as Ray ships a rank's answer.
    per_file: dict[str, list[Chunk]] = {}
    for chunk in chunks:
        per_file.setdefault(chunk.file, []).append(chunk)
    shipped = [pickle.dumps(ChunkTable.from_chunks(group), protocol=5) for group in per_file.values()]
    del per_file
    started = time.perf_counter()
    manifest = _gather_and_encode(shipped, metadata)
    encode_s = time.perf_counter() - started
    del shipped
    started = time.perf_counter()
    encode_manifest(chunks, metadata)
    encode_records_s = time.perf_counter() - started
    started = time.perf_counter()
    decoded, decoded_metadata = decode_manifest(manifest)
    decode_s = time.perf_counter() - started
    total = decoded.total_bytes()
    print(f"source {source.describe()} ({source.world_size} ranks): {len(chunks):,} chunks in "
          f"{len(decoded.file_names())} files, {total / GiB:,.0f} GiB of state (synthetic manifest built in {build_s:.2f}s)")
    print(f"  manifest {len(manifest) / MiB:.2f} MiB (goal < 20 MiB: {'met' if len(manifest) < 20 * MiB else 'MISSED'})")
    print(f"  save: gather {source.world_size} ranks' chunk tables + tiling check + encode {encode_s:.2f}s "
          f"({_verdict(encode_s, GOALS['encode'])}); the old path, encoding one record per chunk: {encode_records_s:.2f}s")
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
    del targets, own, stored_index, headers, one

    if not args.skip_all_ranks:
        with tempfile.TemporaryDirectory(prefix="plan-scale-") as root:
            store = _sparse_store(root, manifest, decoded.file_extents())
            del decoded
            ref = f"{RUN}@{STEP}"
            # The dry run every target rank, coverage proof included, as a person runs it.
            plan_s, plan_rss, output = _command(["ckpt", "plan", ref, "--store", root, "--to", args.target])
            planned = next((line.strip() for line in output.splitlines() if "planned in" in line), "")
            print(f"target {target.describe()} ({target.world_size} ranks): `ckpt plan` {plan_s:.2f}s start to exit "
                  f"({_verdict(plan_s, GOALS['all'])}; {planned}); its peak RSS {plan_rss:.2f} GiB "
                  f"({_verdict(plan_rss, GOALS['rss_gib'])})")
            for line in output.splitlines():
                if any(key in line for key in ("total:", "coverage proven", "heaviest")):
                    print(f"  {line.strip()}")
            for name, command in (("ls", ["ckpt", "ls", "--store", root]),
                                  ("show", ["ckpt", "show", ref, "--store", root]),
                                  ("verify (shallow)", ["ckpt", "verify", ref, "--store", root])):
                seconds, rss, output = _command(command)
                last = output.strip().splitlines()[-1] if output.strip() else ""
                print(f"  `ckpt {name}` {seconds:.2f}s start to exit ({_verdict(seconds, GOALS['command'])}), "
                      f"peak RSS {rss:.2f} GiB: {last[:110]}")
            diff_s = _diff_until_first_read(store)
            print(f"  `ckpt diff` before its first read (both sides opened, every tensor cut into row blocks): "
                  f"{diff_s:.2f}s ({_verdict(diff_s, GOALS['command'])})")
    rss = _peak_rss_gib()
    print(f"peak RSS of this process {rss:.2f} GiB (the synthetic build: one record per chunk, on purpose)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
