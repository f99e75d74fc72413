"""FSDP2 in a Ray Train v2 TorchTrainer, checkpointed with rayshard.checkpoint (train.py)."""
