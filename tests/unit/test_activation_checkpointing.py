"""Activation checkpointing: what it keeps, what it recomputes, and that it changes no number.

Counts come from forward hooks on each block's inner modules (a hook fires on the forward and on
every recompute) and from saved-tensor hooks (the bytes autograd keeps for the backward).
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rayshard.actors.parallel.block_wrappers import wrap_blocks
from rayshard.actors.model.stage import build_stage_on_meta
from rayshard.actors.model.transformer import Transformer
from rayshard.actors.pipeline.interpreter import PipelineRunner
from rayshard.actors.training.pipelined import recomputes_stages
from rayshard.actors.training.step_runner import microbatch_loss
from rayshard.plans.config import ModelChoice, NumericsConfig, PipelineConfig, TrainConfig
from rayshard.plans.pipeline.lowering import lower
from rayshard.plans.pipeline.schedules import build_schedule
from rayshard.plans.training.model_spec import preset
from tests.saved_activations import kept_for_backward

CONFIG = preset("tiny")
BATCH, SEQ = 2, 16


def _model(ac: str) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(CONFIG)
    wrap_blocks(model, ac)
    return model


def _count_attention_calls(model: torch.nn.Module) -> dict[str, int]:
    counts = {name: 0 for name in model.layers}
    for name, block in model.layers.items():
        def count(module, args, name=name):
            counts[name] += 1
        block.attention.register_forward_pre_hook(count)
    return counts


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


class _CountMatmuls(TorchDispatchMode):
    """Matmuls that really run (selective AC serves its saved ones from a cache below this mode)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _step(model) -> tuple[torch.Tensor, dict[str, torch.Tensor], int, int]:
    """Loss, gradients, the bytes autograd kept outside checkpointed regions (distinct storages,
    parameters left out), and matmuls run."""
    inputs, targets = _tokens()
    with _CountMatmuls() as matmuls:
        with kept_for_backward(model.parameters()) as kept:
            loss = microbatch_loss(model(inputs), targets, 1)
        loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}, kept.total, matmuls.count


def test_each_mode_recomputes_as_stated_and_changes_no_bit():
    results = {}
    for ac in ("none", "full", "selective"):
        model = _model(ac)
        counts = _count_attention_calls(model)
        results[ac] = _step(model)
        expected = 1 if ac == "none" else 2  # the forward, plus one recompute in the backward
        assert set(counts.values()) == {expected}, (ac, counts)
    for ac in ("full", "selective"):
        assert torch.equal(results[ac][0], results["none"][0])
        for name, grad in results["none"][1].items():
            assert torch.equal(results[ac][1][name], grad), (ac, name)
    # Full keeps only block inputs (checkpointed regions keep nothing autograd can see); the
    # blocks' matmuls run again in its backward. Selective re-runs the blocks but no matmul:
    # their outputs were saved.
    kept = {ac: result[2] for ac, result in results.items()}
    assert kept["full"] < kept["none"] / 4, kept
    matmuls = {ac: result[3] for ac, result in results.items()}
    # qkv, wo and gate_up's two halves (actors/model/swiglu.py) again; not down: the recompute
    # stops early once every tensor the backward needs exists, and nothing keeps the block's
    # last matmul output.
    recomputed_matmuls = 4 * CONFIG.n_layers
    assert matmuls["full"] == matmuls["none"] + recomputed_matmuls, matmuls
    assert matmuls["selective"] == matmuls["none"], matmuls


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="'partial' is not none, full or selective"):
        wrap_blocks(Transformer(CONFIG), "partial")


def test_zero_bubble_schedules_recompute_whole_stages_not_blocks():
    def config(ac: str, schedule: str) -> TrainConfig:
        return TrainConfig(model=ModelChoice(spec=CONFIG), numerics=NumericsConfig(ac=ac),
                           pipeline=PipelineConfig(schedule=schedule))

    assert recomputes_stages(config("full", "zbh1"))
    assert recomputes_stages(config("selective", "dualpipev"))
    assert not recomputes_stages(config("full", "1f1b"))
    assert not recomputes_stages(config("none", "zbv"))


def _stages() -> dict[int, torch.nn.Module]:
    """The tiny model cut in two stages (layers 0-1 with the embedding, 2-3 with the head), both
    on one rank as ZB-V places them for pp=1, with the reference model's weights."""
    reference = _model("none")
    stages = {}
    for stage, (layers, first, last) in enumerate([(range(0, 2), True, False), (range(2, 4), False, True)]):
        module = build_stage_on_meta(CONFIG, layers, first, last).to_empty(device="cpu")
        module.load_state_dict({name: value for name, value in reference.state_dict().items()
                                if name in dict(module.named_parameters())})
        stages[stage] = module
    return stages


def _run_zero_bubble(recompute: bool):
    stages = _stages()
    counts = {stage: _count_attention_calls(module) for stage, module in stages.items()}
    actions = lower(build_schedule("zbv", 1, 2, 2)).ranks[0]
    runner = PipelineRunner(actions, stages, num_stages=2, microbatches=2, rank=0, global_rank_of=lambda pp: 0,
                            activation_shape=(1, SEQ, CONFIG.dim), dtype=torch.float32, device=torch.device("cpu"),
                            loss_fn=lambda logits, targets: microbatch_loss(logits, targets, 2), timeout_s=30,
                            recompute_stages=recompute)
    inputs, targets = _tokens()
    loss, _ = runner.run(list(inputs.chunk(2)), list(targets.chunk(2)))
    grads = {(stage, name): p.grad.clone() for stage, module in stages.items() for name, p in module.named_parameters()}
    return loss, grads, counts


def test_zero_bubble_stage_recompute_runs_each_forward_once_more_and_changes_no_bit():
    """W must reuse what I's recompute built: every block runs twice per microbatch (F, then the
    one recompute), never a third time for W."""
    plain_loss, plain_grads, plain_counts = _run_zero_bubble(recompute=False)
    loss, grads, counts = _run_zero_bubble(recompute=True)
    assert {n for stage in plain_counts.values() for n in stage.values()} == {2}  # 2 microbatches
    assert {n for stage in counts.values() for n in stage.values()} == {4}  # 2 microbatches x (F + recompute)
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain_grads.keys()
    for key, grad in plain_grads.items():
        assert torch.equal(grads[key], grad), key
