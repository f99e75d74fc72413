"""`rayshard plan layout`: which layout rayshard would run on N ranks, and why."""
from __future__ import annotations

import argparse

from rayshard.plans.layout.chooser import PINNABLE_DEGREES, Workload, choose_layout
from rayshard.plans.training.model_spec import preset


def run_layout(args: argparse.Namespace) -> int:
    pinned = {name: getattr(args, name) for name in PINNABLE_DEGREES if getattr(args, name)}
    choice = choose_layout(args.ranks, preset(args.model), Workload(args.global_batch, args.seq_len, args.microbatches,
                                                                       args.precision, args.ac,
                                                                       snapshots=args.snapshot_every > 0, host_budget=False),
                           args.memory_gib * 2 ** 30, ranks_per_node=args.ranks_per_node, pinned=pinned)
    print(choice.explain())
    return 0
