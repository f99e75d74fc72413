"""The in-memory snapshot's blocked time on one rank's device (issue 41's GPU part).

Trains the same run twice as one `rayshard train` process each, on one rank (its GPU where the
machine has one): without snapshots, then with `--snapshot-every 1`. The snapshot's blocked part
is the rank's copy of its state into the pinned host staging buffers (the async save's path); the
write to the node's keeper runs behind the next steps. Printed: the median blocked time as a share
of the step time (goal <= 2% at K = 1 on the small preset), and the median step time with snapshots
against without (what the write behind the steps costs the step).

    python3 bench/snapshot_device.py [--model small] [--steps 20] [--global-batch 8] [--seq-len 256]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARMUP_STEPS = 3  # the first steps compile kernels and allocate the staging buffers


def train(store: str, run: str, args, *flags: str) -> list[dict]:
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "rayshard", "train", "--store", store, "--run", run, "--model", args.model,
               "--steps", str(args.steps), "--global-batch", str(args.global_batch), "--seq-len", str(args.seq_len),
               "--dp", "1", "--tp", "1", "--ckpt-every", str(args.steps), "--precision", args.precision, *flags]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    with open(os.path.join(store, run, "metrics.jsonl")) as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    return [r for r in records if r.get("step", 0) > WARMUP_STEPS and "step_s" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    args = parser.parse_args()
    store = tempfile.mkdtemp(prefix="rayshard-snapshot-device-")
    plain = train(store, "plain", args)
    snapshots = train(store, "snapshots", args, "--snapshot-every", "1")
    blocked = [r["snapshot_blocked_s"] / r["step_s"] for r in snapshots if r.get("snapshot_blocked_s") is not None]
    plain_step = statistics.median(r["step_s"] for r in plain)
    snapshot_step = statistics.median(r["step_s"] for r in snapshots)
    device = "cpu"
    try:
        import torch
        if torch.cuda.is_available():
            device = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    print(f"{args.model}, {args.precision}, batch {args.global_batch} x {args.seq_len}, 1 rank on {device}, "
          f"steps {WARMUP_STEPS + 1}-{args.steps}, medians")
    print(f"  step without snapshots {plain_step * 1e3:.1f} ms, with --snapshot-every 1 {snapshot_step * 1e3:.1f} ms "
          f"(ratio {snapshot_step / plain_step:.3f})")
    if blocked:
        print(f"snapshot blocked: {100 * statistics.median(blocked):.2f}% of a step (median of {len(blocked)}; "
              f"max {100 * max(blocked):.2f}%)")
    else:
        print("snapshot blocked: no snapshot_blocked_s in metrics.jsonl (no snapshot was taken)")


if __name__ == "__main__":
    main()
