"""Flat test keys as the nested state dict a loop passes to `rayshard.checkpoint`."""
from __future__ import annotations


def nested(flat: dict) -> dict:
    """{"model.w": a, "optim.state.w.exp_avg": b} -> {"model": {"w": a}, "optim": {"state": {"w": {"exp_avg": b}}}}"""
    state: dict = {}
    for key, value in flat.items():
        if key.startswith("optim.state."):
            fqn, _, kind = key.removeprefix("optim.state.").rpartition(".")
            state.setdefault("optim", {}).setdefault("state", {}).setdefault(fqn, {})[kind] = value
        else:
            state.setdefault("model", {})[key.removeprefix("model.")] = value
    return state
