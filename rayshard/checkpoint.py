"""`rayshard.checkpoint`: checkpoints from any torch.distributed training loop, shaped like
torch.distributed.checkpoint (DCP).

    import rayshard.checkpoint as ckpt
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "data": {"next_step": 21}}
    ckpt.save(state, "s3://bucket/runs/my-run", step=20)        # -> CheckpointRef, committed
    future = ckpt.async_save(state, "s3://bucket/runs/my-run", step=30)   # returns once staged
    ckpt.load(state, "s3://bucket/runs/my-run")                 # LATEST, any layout; "...@20" for a step
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

Every rank of the process group calls each function (the world by default; no process group at
all for one process). docs/api.md has the details; the implementation is
`rayshard.cluster.api.checkpoint`.
"""
from rayshard.cluster.api.checkpoint import LoadedCheckpoint, LoadPlan, RankPlan, async_save, load, plan, save

__all__ = ["save", "async_save", "load", "plan", "LoadedCheckpoint", "LoadPlan", "RankPlan"]
