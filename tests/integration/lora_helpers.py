"""Run on LoRA training ranks by the tests (`actor.__ray_call__`): importable by the actors, which
cannot import a test module by its pytest name."""
from __future__ import annotations


def save_every_parameter(actor, checkpoint_url: str, file: str):
    """Run on a rank (`__ray_call__`): its share of every parameter, frozen ones included."""
    from rayshard.actors.checkpoint.save import save_rank_shard

    trainer = actor.trainer
    return save_rank_shard(trainer.model, trainer.optimizer, trainer.coord_map, checkpoint_url, file,
                           trainer.pipeline_copies, None)


def fill_with_rank(actor):
    """Run on a rank: its piece of every stored tensor (adapters and their moments) set to its rank."""
    from rayshard.actors.checkpoint.rank_pieces import state_tensors
    from rayshard.actors.parallel.shards import local_tensor

    trainer = actor.trainer
    for _, _, tensor in state_tensors(trainer.model, trainer.optimizer, only=trainer.stored_names):
        local_tensor(tensor).fill_(float(trainer.rank))
    return trainer.rank
