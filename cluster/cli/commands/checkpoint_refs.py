"""Checkpoint arguments resolved against a store, and the reader leases held while a command reads."""
from __future__ import annotations

import argparse
import contextlib

from rayshard.cluster.catalog import leases
from rayshard.cluster.catalog.store import Store


def resolve_checkpoint(args: argparse.Namespace, name: str = "checkpoint"):
    return Store(args.store).with_bounded_calls().resolve(getattr(args, name))


@contextlib.contextmanager
def reading(args: argparse.Namespace, *names: str, lease_optional: bool = False):
    """Resolve the named checkpoint arguments and hold a reader lease on each while the command
    reads its shards (cluster/catalog/leases.py), so a concurrent `ckpt gc` keeps them. Yields (store,
    refs). A checkpoint given by URL has no run and step in --store (it may be outside any store)
    and is read without a lease. lease_optional: a lease that cannot be written (a full disk) is a
    warning instead of an error."""

    store = Store(args.store).with_bounded_calls()  # the catalog's calls; shard reads have their own bounds
    with contextlib.ExitStack() as held:
        refs = []
        for name in names or ("checkpoint",):
            ref = store.resolve(getattr(args, name))
            held.enter_context(leases.reading(store, ref, optional=lease_optional))
            refs.append(ref)
        yield store, refs
