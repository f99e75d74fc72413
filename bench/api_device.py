"""rayshard.checkpoint against torch DCP from device tensors, one process (issue 38's GPU part).

The same state (a Llama-shaped set of bf16 weights plus fp32 AdamW moments, on the chosen device)
is saved and loaded through `rayshard.checkpoint` and through `torch.distributed.checkpoint` to a
local directory, alternating, `--repeats` times; medians are printed as ratios (DCP time / ours,
so > 1 means rayshard is faster). Also times `async_save`'s blocked part (the copy to pinned host
memory) against the synchronous save. No process group: both libraries run their single-process
path, so this measures the device-to-file and file-to-device paths, not the coordination.

    python3 bench/api_device.py --device cuda --gib 4 --repeats 3
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import rayshard.checkpoint as api  # noqa: E402


def build_state(device: str, gib: float, seed: int = 0) -> dict:
    """Weights in bf16 and two fp32 moments each, 4096-wide layers, until about `gib` GiB."""
    generator = torch.Generator(device=device).manual_seed(seed)
    state, total, layer = {}, 0, 0
    while total < gib * 2**30:
        shape = (4096, 4096) if layer % 3 else (11008, 4096)
        weight = torch.randn(shape, generator=generator, device=device).to(torch.bfloat16)
        state[f"model.layers.{layer}.weight"] = weight
        state[f"optim.layers.{layer}.exp_avg"] = torch.randn(shape, generator=generator, device=device)
        state[f"optim.layers.{layer}.exp_avg_sq"] = torch.rand(shape, generator=generator, device=device)
        total += weight.nbytes + 2 * weight.numel() * 4
        layer += 1
    return state


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, fn) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--root", default=None, help="directory for the checkpoints (default: a temporary one)")
    args = parser.parse_args()
    root = args.root or tempfile.mkdtemp(prefix="rayshard-api-device-")
    state = build_state(args.device, args.gib)
    nbytes = sum(t.nbytes for t in state.values())
    times = {"ours save": [], "dcp save": [], "ours load": [], "dcp load": [], "ours async blocked": []}
    for repeat in range(args.repeats):
        run, dcp_dir = f"{root}/run{repeat}", f"{root}/dcp{repeat}"
        times["ours save"].append(timed(args.device, lambda: api.save(state, run, step=1)))
        times["dcp save"].append(timed(args.device, lambda: dcp.save(state, checkpoint_id=dcp_dir)))
        target = {key: torch.empty_like(tensor) for key, tensor in state.items()}
        times["ours load"].append(timed(args.device, lambda: api.load(target, f"{run}@1")))
        assert all(torch.equal(target[k], state[k]) for k in state), "rayshard load differs from what was saved"
        target = {key: torch.empty_like(tensor) for key, tensor in state.items()}
        times["dcp load"].append(timed(args.device, lambda: dcp.load(target, checkpoint_id=dcp_dir)))
        assert all(torch.equal(target[k], state[k]) for k in state), "DCP load differs from what was saved"
        future = None

        def start_async():
            nonlocal future
            future = api.async_save(state, run, step=2)
        times["ours async blocked"].append(timed(args.device, start_async))
        future.result()
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(dcp_dir, ignore_errors=True)
    median = {name: statistics.median(values) for name, values in times.items()}
    name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    print(f"{nbytes / 2**30:.2f} GiB state on {args.device} ({name}), {args.repeats} repeats, medians; dir {root}")
    for key, values in times.items():
        print(f"  {key:20s} {median[key]:7.3f} s  ({nbytes / 2**30 / median[key]:6.2f} GiB/s)  runs "
              + " ".join(f"{v:.3f}" for v in values))
    print(f"api save vs dcp {median['dcp save'] / median['ours save']:.2f}x, load vs dcp "
          f"{median['dcp load'] / median['ours load']:.2f}x, async blocked / sync save "
          f"{median['ours async blocked'] / median['ours save']:.3f}")
    if args.root is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
