"""The pipeline interpreter: run one rank's lowered action list, top to bottom, every step.

The plan (`plans/pipeline/plan.py`) arrives once; each step replays it. Actions:
- F: forward one microbatch through one stage; the last stage also computes the loss, scaled by
  1/microbatches so the summed gradients equal one pass over the whole batch.
- B: full backward; I: input gradient only; W: the weight gradients I left behind
  (`actors/pipeline/backward_split.py`); FB: a forward and a full backward of two stages, back to back.
- SEND_*/RECV_*: point-to-point transfers with the peer rank's stage. Consecutive transfers are
  posted together (batch_isend_irecv) and never block when posted: a RECV is waited for right
  before the compute that consumes it, a SEND at the end of the step, so transfers overlap
  compute wherever the plan lets them. Each transfer has its own tag (direction, stage,
  microbatch), so a mismatch can only hang (and then time out, named), never deliver the wrong
  tensor.
- HANDOFF_*: the same move between two stages of this rank, without communication.

Every wait is bounded: a transfer that does not complete within `timeout_s` fails the step with
an error naming the rank, the plan step and the action. The interpreter can time every compute
action, so the simulator can replay the plan with measured costs.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from rayshard.actors.pipeline.backward_split import PendingWeightGrad, backward_input, backward_weight
from rayshard.plans.pipeline.actions import Action, Kind

_FORWARD, _BACKWARD = 0, 1


class PipelineStepError(RuntimeError):
    """A pipeline step failed on this rank; the message names rank, plan step and action."""


def describe(action: Action) -> str:
    """"RECV_B stage 3 microbatch 5 (from rank 2)" — the words the errors and logs use."""
    text = f"{action.kind.value} stage {action.stage} microbatch {action.microbatch}"
    if action.kind is Kind.FB:
        text += f" + B stage {action.backward_stage} microbatch {action.backward_microbatch}"
    if action.kind in (Kind.RECV_F, Kind.RECV_B):
        text += f" (from pipeline rank {action.peer})"
    elif action.kind in (Kind.SEND_F, Kind.SEND_B):
        text += f" (to pipeline rank {action.peer})"
    return text


def wait_or_fail(work, timeout_s: float, who: str, where: str) -> None:
    """Wait for a transfer or collective at most `timeout_s`; fail naming who waited where,
    e.g. "rank 2 waited 60 s at step 37 on RECV_B stage 3 microbatch 5 (from pipeline rank 3)"."""
    started = time.perf_counter()
    try:
        work.wait(timedelta(seconds=timeout_s))
    except Exception as error:
        waited = time.perf_counter() - started
        if waited >= 0.95 * timeout_s or "timed out" in str(error).lower():
            raise PipelineStepError(f"{who} waited {waited:.0f} s {where}: nothing arrived within the pipeline "
                                    f"timeout of {timeout_s:g} s (is a peer stalled or dead?)") from error
        raise PipelineStepError(f"{who} failed after {waited:.1f} s {where}: {error}") from error


@dataclass
class StepRecord:
    """What one step measured: seconds per compute action, keyed like the simulator wants
    ((kind, stage, microbatch); FB by its forward half), and the plan's wall time."""

    action_seconds: dict[tuple[str, int, int], float] = field(default_factory=dict)
    wait_seconds: float = 0.0
    plan_seconds: float = 0.0


@dataclass(eq=False)
class _Transfer:
    work: object
    tensor: torch.Tensor
    step: int
    action: Action


class PipelineRunner:
    """Interprets `actions` (this rank's lowered list) over `stages` (stage index -> module)."""

    def __init__(self, actions: list[Action], stages: dict[int, nn.Module], *, num_stages: int, microbatches: int,
                 rank: int, global_rank_of: Callable[[int], int], activation_shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device, loss_fn: Callable, timeout_s: float,
                 recompute_stages: bool = False):
        self.actions = list(actions)
        self.stages = stages
        self.last_stage = num_stages - 1
        self.microbatches = microbatches
        self.rank = rank
        self.global_rank_of = global_rank_of
        self.activation_shape = activation_shape
        self.dtype, self.device = dtype, device
        self.loss_fn = loss_fn
        self.timeout_s = timeout_s
        # Activation checkpointing at stage granularity (`pipelined.recomputes_stages`): F keeps
        # only the stage input; the first backward action of the microbatch recomputes the stage.
        self.recompute_stages = recompute_stages
        self._reset_step_state()
        # Runs of consecutive transfers, posted together: start index -> end index.
        self._comm_runs: dict[int, int] = {}
        index = 0
        while index < len(self.actions):
            end = index
            while end < len(self.actions) and self.actions[end].kind in _TRANSFER_KINDS:
                end += 1
            if end > index:
                self._comm_runs[index] = end
            index = max(end, index + 1)

    # ---- one step ---------------------------------------------------------------------------

    def run(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> tuple[torch.Tensor, StepRecord]:
        """Run the plan once on these microbatches; returns the summed (scaled) loss of the
        microbatches whose last stage ran here (zero elsewhere) and the step's timings."""
        self._reset_step_state()
        self._inputs, self._targets = inputs, targets
        started = time.perf_counter()
        index = 0
        while index < len(self.actions):
            if index in self._comm_runs:
                end = self._comm_runs[index]
                self._post_transfers(index, end)
                index = end
                continue
            action = self.actions[index]
            try:
                self._run_local(index, action)
            except PipelineStepError:
                raise
            except Exception as error:
                raise PipelineStepError(f"rank {self.rank} failed at step {index} on {describe(action)}: "
                                        f"{type(error).__name__}: {error}") from error
            index += 1
        for transfer in self._outgoing:
            self._wait(transfer)
        leftovers = [key for key in (*self._stage_outputs, *self._pending_weights, *self._incoming)]
        if leftovers:
            raise PipelineStepError(f"rank {self.rank}: the plan left work unfinished for {leftovers[:5]}; "
                                    "a lowered plan from rayshard.plans.pipeline.plan never does (is this the rank's own list?)")
        self._record.plan_seconds = time.perf_counter() - started
        loss, record = self._loss, self._record
        self._reset_step_state()  # drop this step's tensors
        return loss, record

    def _reset_step_state(self) -> None:
        """What one step keeps between actions, keyed by (stage, microbatch)."""
        self._inputs: list[torch.Tensor] = []
        self._targets: list[torch.Tensor] = []
        self._stage_inputs: dict[tuple[int, int], torch.Tensor] = {}
        self._stage_outputs: dict[tuple[int, int], torch.Tensor] = {}  # the loss on the last stage
        self._output_grads: dict[tuple[int, int], torch.Tensor] = {}  # received for B / I
        self._input_grads: dict[tuple[int, int], torch.Tensor] = {}  # to send by SEND_B / HANDOFF_B
        self._pending_weights: dict[tuple[int, int], PendingWeightGrad] = {}  # I done, W to come
        self._incoming: dict[tuple[int, int, int], _Transfer] = {}  # (direction, stage, mb): posted RECVs
        self._outgoing: list[_Transfer] = []
        self._loss = torch.zeros((), dtype=torch.float32, device=self.device)
        self._record = StepRecord()

    # ---- transfers --------------------------------------------------------------------------

    def _tag(self, direction: int, receiving_stage: int, microbatch: int) -> int:
        return (receiving_stage * self.microbatches + microbatch) * 2 + direction

    def _post_transfers(self, start: int, end: int) -> None:
        # Sends that completed since the last batch release their buffers now, not at step end.
        still_sending = []
        for transfer in self._outgoing:
            if transfer.work.is_completed():
                self._wait(transfer)  # returns at once, or raises the send's error
            else:
                still_sending.append(transfer)
        self._outgoing = still_sending
        ops, transfers = [], []
        for index in range(start, end):
            action = self.actions[index]
            kind, stage, mb = action.kind, action.stage, action.microbatch
            peer = self.global_rank_of(action.peer)
            if kind is Kind.SEND_F or kind is Kind.SEND_B:
                forward = kind is Kind.SEND_F
                source = self._stage_outputs[(stage, mb)] if forward else self._input_grads.pop((stage, mb))
                tensor = source.detach().contiguous()
                tag = self._tag(_FORWARD, stage + 1, mb) if forward else self._tag(_BACKWARD, stage - 1, mb)
                ops.append(dist.P2POp(dist.isend, tensor, peer, tag=tag))
                transfers.append((_Transfer(None, tensor, index, action), None))
            else:
                direction = _FORWARD if kind is Kind.RECV_F else _BACKWARD
                tensor = torch.empty(self.activation_shape, dtype=self.dtype, device=self.device)
                ops.append(dist.P2POp(dist.irecv, tensor, peer, tag=self._tag(direction, stage, mb)))
                transfers.append((_Transfer(None, tensor, index, action), (direction, stage, mb)))
        try:
            works = dist.batch_isend_irecv(ops)
        except Exception as error:
            raise PipelineStepError(f"rank {self.rank} failed posting steps {start}..{end - 1} "
                                    f"({describe(self.actions[start])} ...): {error}") from error
        for position, (transfer, key) in enumerate(transfers):
            # A coalescing backend (NCCL) returns one work for the whole batch.
            transfer.work = works[position] if len(works) == len(ops) else works[-1]
            if key is None:
                self._outgoing.append(transfer)
            else:
                self._incoming[key] = transfer

    def _wait(self, transfer: _Transfer) -> None:
        started = time.perf_counter()
        wait_or_fail(transfer.work, self.timeout_s, f"rank {self.rank}",
                     f"at step {transfer.step} on {describe(transfer.action)}")
        self._record.wait_seconds += time.perf_counter() - started

    def _received(self, direction: int, stage: int, mb: int) -> torch.Tensor | None:
        transfer = self._incoming.pop((direction, stage, mb), None)
        if transfer is None:
            return None
        self._wait(transfer)
        return transfer.tensor

    # ---- compute ----------------------------------------------------------------------------

    def _run_local(self, index: int, action: Action) -> None:
        kind = action.kind
        if kind is Kind.HANDOFF_F:
            output = self._stage_outputs[(action.stage, action.microbatch)]
            self._stage_inputs[(action.stage + 1, action.microbatch)] = output.detach().requires_grad_()
            return
        if kind is Kind.HANDOFF_B:
            grad = self._input_grads.pop((action.stage, action.microbatch))
            self._output_grads[(action.stage - 1, action.microbatch)] = grad
            return
        for part in action.parts():  # receive everything first, so timings are compute only
            self._gather_inputs(part)
        started = time.perf_counter()
        for part in action.parts():
            if part.kind is Kind.F:
                self._forward(part.stage, part.microbatch)
            elif part.kind is Kind.W:
                self._run_weight_backward(part.stage, part.microbatch)
            else:
                self._backward(part.stage, part.microbatch, split=part.kind is Kind.I)
        self._record.action_seconds[(kind.value, action.stage, action.microbatch)] = time.perf_counter() - started

    def _gather_inputs(self, part: Action) -> None:
        stage, mb = part.stage, part.microbatch
        if part.kind is Kind.F and stage > 0 and (stage, mb) not in self._stage_inputs:
            received = self._received(_FORWARD, stage, mb)
            if received is None:
                raise PipelineStepError(f"rank {self.rank}: no input for F stage {stage} microbatch {mb}")
            self._stage_inputs[(stage, mb)] = received.requires_grad_()
        elif part.kind in (Kind.B, Kind.I) and stage < self.last_stage and (stage, mb) not in self._output_grads:
            received = self._received(_BACKWARD, stage, mb)
            if received is None:
                raise PipelineStepError(f"rank {self.rank}: no gradient for {part.kind.value} stage {stage} microbatch {mb}")
            self._output_grads[(stage, mb)] = received

    def _forward(self, stage: int, mb: int) -> None:
        if stage == 0:
            inputs = self._inputs[mb]
            self._stage_inputs[(stage, mb)] = inputs
        else:
            inputs = self._stage_inputs[(stage, mb)]
        with torch.no_grad() if self.recompute_stages else contextlib.nullcontext():
            output = self._run_stage(stage, mb, inputs)
        if stage == self.last_stage:
            self._loss += (output.full_tensor() if hasattr(output, "full_tensor") else output).detach()
        self._stage_outputs[(stage, mb)] = output

    def _run_stage(self, stage: int, mb: int, inputs: torch.Tensor) -> torch.Tensor:
        """The stage's output (the microbatch's loss on the last stage)."""
        output = self.stages[stage](inputs)
        return self.loss_fn(output, self._targets[mb]) if stage == self.last_stage else output

    def _run_weight_backward(self, stage: int, mb: int) -> None:
        pending = self._pending_weights.pop((stage, mb), None)
        if pending is None:  # recomputing stages: the first stage's I had nothing to do
            self._backward(stage, mb, split=False)
        else:
            backward_weight(pending)

    def _backward(self, stage: int, mb: int, split: bool) -> None:
        output = self._stage_outputs.pop((stage, mb))
        inputs = self._stage_inputs.pop((stage, mb))
        if self.recompute_stages:
            if split and stage == 0:
                # Token ids have no gradient: I has nothing to compute. Put the input back for W,
                # which recomputes the stage then (one recompute per microbatch either way).
                self._stage_inputs[(stage, mb)], self._stage_outputs[(stage, mb)] = inputs, output
                return
            output = self._run_stage(stage, mb, inputs)  # the one recompute, with the graph kept
        grad = None if stage == self.last_stage else self._output_grads.pop((stage, mb))
        if split:
            input_grads, pending = backward_input([output], None if grad is None else [grad], [inputs])
            self._pending_weights[(stage, mb)] = pending
            input_grad = input_grads[0]
        else:
            torch.autograd.backward([output], None if grad is None else [grad])
            input_grad = inputs.grad if stage > 0 else None
        if stage > 0:
            self._input_grads[(stage, mb)] = input_grad


_TRANSFER_KINDS = frozenset({Kind.SEND_F, Kind.SEND_B, Kind.RECV_F, Kind.RECV_B})
