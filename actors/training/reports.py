"""What a rank reports to the driver, as typed records (they cross the Ray boundary by value).

One step's metrics carry the pipeline's own timings (`StepRecord`, the interpreter's record) when
the rank runs a pipeline; the driver logs the first rank's numbers and feeds every rank's timings
to the simulator's measured costs (`cluster/run/pipeline_timings.py`).
"""
from __future__ import annotations

from dataclasses import dataclass

from rayshard.actors.pipeline.interpreter import StepRecord


@dataclass(frozen=True)
class RankSetup:
    """A rank that joined its process group and built its shard of the model."""

    rank: int
    pid: int
    device: str
    data_fingerprint: str  # of the corpus it read: every rank must have read the same one


@dataclass(frozen=True)
class StepMetrics:
    """One optimizer step as one rank saw it; loss and grad_norm are equal on every rank."""

    step: int  # steps done after this one
    loss: float
    grad_norm: float
    lr: float
    rank_seconds: float
    pipeline: StepRecord | None = None  # a pipeline rank's per-action timings; None without pp
    tokens: int = 0  # tokens this rank's data slice held this step (tp and pp peers count the same ones)
    # The positions the rank's model computed this step (rows x seq_len): tokens plus an SFT or DPO
    # batch's padding. tokens/s counts `tokens`, MFU the FLOPs of these (decision 203).
    computed_tokens: int = 0
    # The rank's peak memory during the step: the CUDA allocator's peak on a GPU; on a CPU rank
    # the process's peak resident set during the step (Linux; elsewhere since the process began).
    peak_memory_bytes: int = 0
    device_name: str = "cpu"  # torch.cuda.get_device_name() on a GPU: the MFU table's key
    # This rank's rows of the step's batch, one short digest per sample in row order; the driver
    # joins the data ranks' into one hash of the global batch (plans/data/batch_hash.py).
    batch_hash: str = ""
    # A mixture-of-experts model: tokens each expert got this step over the global batch, per MoE
    # layer, and the mean load-balancing loss (not part of `loss`, which is the language-model loss).
    expert_tokens: dict[int, list[int]] | None = None
    aux_loss: float | None = None
    # Under ep: bytes of tokens entering the forward's all-to-alls over every rank and MoE layer
    # (dispatch and return; the backward moves as many again), and the part sent to other ranks.
    all_to_all_bytes: int = 0
    all_to_all_peer_bytes: int = 0
    # --objective dpo: rewards_chosen, rewards_rejected, rewards_margin, rewards_accuracy (means over the global batch's pairs).
    rewards: dict[str, float] | None = None
