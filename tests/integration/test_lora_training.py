"""LoRA on real Ray ranks and gloo: a frozen base, adapters on every layout, adapter checkpoints.

- One LoRA step on a multi-rank layout equals one rank's: the loss and every adapter gradient,
  within fp32 tolerance (after a first step, so that B is no longer zero and A has gradients).
- After LoRA steps on fsdp2 x tp2 from a base checkpoint, every rank's frozen weights are bit for
  bit the base's (their digests), and the run's checkpoints hold only adapter tensors and their
  moments, name their base, resume on another layout and refuse another base in one line.
- The per-rank-slice test: on fsdp4 each rank fills its shard of every adapter (and moment) with
  its own rank number, saves; loads on tp2 and on one rank (fresh ranks) hold every element where
  it was: their saves have the same digests, tensor by tensor.
"""
from __future__ import annotations

import pytest
import torch

from rayshard.plans.config import LoraConfig
from rayshard.plans.layout.parallel_layout import ParallelLayout
from tests.conftest import small_config
from tests.integration.test_pipeline_numerics import merged_gradients

RTOL, ATOL = 1.3e-6, 1e-5  # assert_close's float32 defaults
LORA = LoraConfig(rank=4, alpha=8.0)


def _config(tmp_path, layout, **overrides):
    values = dict(global_batch=8, seq_len=16, run="l", lora=LORA, steps=3)
    values.update(overrides)
    return small_config(tmp_path, layout, **values)


def _second_step_gradients(rank_pool, config) -> tuple[float, dict[str, torch.Tensor]]:
    """One optimizer step, then the loss and full adapter gradients of the next batch."""
    from rayshard.cluster.run.rank_group import RankGroup

    group = RankGroup(config, rank_pool)
    try:
        group.call("train_step")
        results = group.call("full_gradients")
    finally:
        group.shutdown()
    assert len({round(result["loss"], 6) for result in results}) == 1, "ranks disagree on the loss"
    return results[0]["loss"], merged_gradients(results)


@pytest.fixture(scope="module")
def single_rank(rank_pool, tmp_path_factory):
    return _second_step_gradients(rank_pool, _config(tmp_path_factory.mktemp("one"), ParallelLayout()))


@pytest.mark.parametrize("layout, pipeline", [
    (ParallelLayout(dp=2, tp=2), {}),
    pytest.param(ParallelLayout(tp=2), {"sequence_parallel": True}, id="tp2-sp"),
    pytest.param(ParallelLayout(fsdp=2), {"compile": True}, id="fsdp2-compile", marks=pytest.mark.slow),
    pytest.param(ParallelLayout(tp=2), {"compile": True}, id="tp2-compile", marks=pytest.mark.slow),
    pytest.param(ParallelLayout(fsdp=2, tp=2), {}, marks=pytest.mark.slow),
    pytest.param(ParallelLayout(tp=2, pp=2), {}, marks=pytest.mark.slow),
    # A split backward (I, then W from the graph's own weight leaves) over a frozen base.
    pytest.param(ParallelLayout(fsdp=2, pp=2), {"schedule": "zbh1", "microbatches": 4}, marks=pytest.mark.slow),
    pytest.param(ParallelLayout(pp=2, vpp=2), {"schedule": "interleaved1f1b", "microbatches": 4}, marks=pytest.mark.slow),
], ids=lambda value: str(value) if isinstance(value, ParallelLayout) else "-".join(map(str, value.values())))
def test_one_lora_step_matches_one_rank(rank_pool, tmp_path, single_rank, layout, pipeline):
    loss, gradients = _second_step_gradients(rank_pool, _config(tmp_path, layout, **pipeline))
    expected_loss, expected = single_rank
    # Only adapters have gradients, every one of them, A's included (B moved off zero in step 1).
    assert expected and all(".lora." in name for name in expected)
    assert len(expected) == 4 * 7 * 2
    assert all(gradient.abs().sum() > 0 for gradient in expected.values())
    assert sorted(gradients) == sorted(expected)
    torch.testing.assert_close(torch.tensor(loss), torch.tensor(expected_loss), rtol=RTOL, atol=ATOL)
    for name, gradient in expected.items():
        torch.testing.assert_close(gradients[name], gradient, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def single_rank_with_dropout(rank_pool, tmp_path_factory):
    from dataclasses import replace

    return _second_step_gradients(rank_pool, _config(tmp_path_factory.mktemp("one-dropout"), ParallelLayout(),
                                                     lora=replace(LORA, dropout=0.25)))


@pytest.mark.parametrize("pipeline", [{}, pytest.param({"sequence_parallel": True}, marks=pytest.mark.slow)],
                         ids=["tp2", "tp2-sp"])
def test_lora_dropout_on_tp2_draws_one_ranks_masks(rank_pool, tmp_path, single_rank, single_rank_with_dropout, pipeline):
    """Decision 168: every tp rank of a group draws the same masks, and beside a row-parallel base
    keeps its columns of the whole input's mask, so a dropout step on tp2 is one rank's."""
    from dataclasses import replace

    loss, gradients = _second_step_gradients(rank_pool, _config(tmp_path, ParallelLayout(tp=2),
                                                                lora=replace(LORA, dropout=0.25), **pipeline))
    expected_loss, expected = single_rank_with_dropout
    # The dropout did something: one rank's step with it is not the step without it.
    assert not torch.allclose(torch.tensor(expected_loss), torch.tensor(single_rank[0]), rtol=RTOL, atol=ATOL)
    assert sorted(gradients) == sorted(expected) == sorted(single_rank[1])
    torch.testing.assert_close(torch.tensor(loss), torch.tensor(expected_loss), rtol=RTOL, atol=ATOL)
    for name, gradient in expected.items():
        torch.testing.assert_close(gradients[name], gradient, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


# ---- adapter checkpoints --------------------------------------------------------------------

ADAPTER_NAMES = {f"layers.{i}.{part}.lora.{t}.{ab}" for i in range(4) for ab in "ab"
                 for part, targets in (("attention", "qkvo"), ("feed_forward", ("gate", "up", "down"))) for t in targets}


def test_base_stays_bit_identical_and_checkpoints_hold_only_adapters(run_training, rank_pool, tmp_path):
    from dataclasses import replace

    from rayshard.cluster.catalog.store import Store
    from rayshard.cluster.checkpoint.verify import verify
    from rayshard.cluster.run.lora_base import base_digest
    from rayshard.cluster.run.rank_group import RankGroup
    from rayshard.cluster.run.train import checkpoint_metadata
    from rayshard.plans.checkpoint.chunk_table import ChunkTable
    from rayshard.plans.errors import CheckpointError
    from rayshard.plans.training.converters import run_roles
    from rayshard.storage.manifest_io import read_manifest
    from tests.integration.lora_helpers import save_every_parameter
    from tests.integration.reshard_helpers import digests

    base = run_training(small_config(tmp_path, ParallelLayout(), run="base", steps=1, seq_len=16)).checkpoints[-1]
    base_params = {name: digest for (name, kind), digest in digests(base).items() if kind == "param"}
    layout = ParallelLayout(fsdp=2, tp=2)
    config = _config(tmp_path, layout, run="adapt", lora=replace(LORA, base="base"))

    # In memory: after LoRA steps every rank's frozen weights are the base's, bit for bit.
    store = Store(config.store)
    group = RankGroup(config, rank_pool)
    try:
        group.call("load_base", base)
        for _ in range(3):
            group.call("train_step")
        pending = store.begin("everything", 3)
        rows = group.call_each("__ray_call__", [(save_every_parameter, pending.url, pending.file_for(rank))
                                                for rank in range(layout.world_size)])
        everything = pending.commit(ChunkTable.concat(rows), checkpoint_metadata(config, 3, None, "-"))
    finally:
        group.shutdown()
    after = digests(everything)
    assert {name: after[(name, "param")] for name in base_params} == base_params
    assert {name for name, kind in after if ".lora." in name} == ADAPTER_NAMES

    # On storage: the run's checkpoints hold the adapters, their moments and the step, and name their base.
    run = run_training(config)
    chunks, metadata = read_manifest(run.checkpoints[-1])
    assert {(c.name, c.kind) for c in chunks} == {(n, k) for n in ADAPTER_NAMES for k in ("param", "exp_avg", "exp_avg_sq")}
    adapter_elements = run_roles(config).count(trained=True)
    assert adapter_elements == 4 * 4 * (64 + 64 + 64 + 32 + 64 + 32 + 64 + 64 + 64 + 160 + 64 + 160 + 160 + 64)
    assert sum(c.byte_end - c.byte_start for c in chunks) == 3 * 4 * adapter_elements  # float32, two moments each
    assert metadata["step"] == 3 and metadata["lora"]["rank"] == 4
    assert metadata["lora_base"] == {"url": base, "seed": config.seed, "digest": base_digest(base)}
    report = verify(run.checkpoints[-1], deep=True)  # its model check reads the roles: adapters, not the base
    assert report.ok, report.problems

    # Resumed on tp2 (its adapter settings and base taken from the checkpoint), it continues the run.
    # (Saved in the background, its checkpoint holds the same tensors: async saves read the roles too.)
    uninterrupted = run_training(replace(config, run="whole", steps=5, checkpoint=replace(config.checkpoint, async_save=True)))
    assert {(c.name, c.kind) for c in read_manifest(uninterrupted.checkpoints[-1])[0]} == {(c.name, c.kind) for c in chunks}
    # The base run moves on, so "base" names another checkpoint now; the adapters' base stays the recorded one.
    run_training(small_config(tmp_path, ParallelLayout(), run="base", steps=2, seq_len=16, resume="latest"))
    resumed = run_training(_config(tmp_path, ParallelLayout(tp=2), run="adapt", steps=5, resume="latest",
                                   verify_resume=True, lora=LoraConfig()))  # the loaded adapters' digests proved
    assert resumed.start_step == 3
    for step in (4, 5):
        assert abs(resumed.losses[step] - uninterrupted.losses[step]) <= 1e-5 * abs(uninterrupted.losses[step])

    # Another base is refused in one line, before any rank starts.
    with pytest.raises(CheckpointError) as refused:
        run_training(_config(tmp_path, ParallelLayout(tp=2), run="adapt", steps=7, resume="latest",
                             lora=replace(LORA, base="base")))
    message = str(refused.value)
    assert "\n" not in message and "the adapters resumed were trained on" in message and f"--lora-base {base}" in message


@pytest.mark.parametrize("targets", [{"tp2": ParallelLayout(tp=2), "single": ParallelLayout()},
                                     pytest.param({"tp2xpp2": ParallelLayout(tp=2, pp=2)}, marks=pytest.mark.slow)],
                         ids=lambda t: "+".join(t))
def test_every_adapter_element_returns_where_it_was(rank_pool, tmp_path, targets):
    from rayshard.actors.checkpoint.stored import StoredCheckpoint
    from rayshard.cluster.catalog.store import Store
    from rayshard.cluster.run.rank_group import RankGroup
    from rayshard.cluster.run.train import save_checkpoint
    from tests.integration.lora_helpers import fill_with_rank
    from tests.integration.reshard_helpers import digests, load_and_save

    config = _config(tmp_path, ParallelLayout(fsdp=4), run="slices")
    group = RankGroup(config, rank_pool)
    try:
        group.call("train_step")  # AdamW's moments exist after a step
        assert sorted(group.call("__ray_call__", fill_with_rank)) == [0, 1, 2, 3]
        saved = save_checkpoint(group, Store(config.store), config, 1, None, group.setup_info[0].data_fingerprint)
    finally:
        group.shutdown()
    stored = StoredCheckpoint(saved)
    b = stored.read_region("layers.2.attention.lora.q.b", "exp_avg", (0, 0), (64, 4))  # 16 rows per fsdp rank
    assert torch.equal(b, torch.arange(4.0).repeat_interleave(16)[:, None].expand(64, 4))
    a = stored.read_region("layers.2.feed_forward.lora.down.a", "param", (0, 0), (4, 160))  # one row per rank
    assert torch.equal(a, torch.arange(4.0)[:, None].expand(4, 160))
    expected = digests(saved)
    assert {name for name, _ in expected} == ADAPTER_NAMES
    for name, layout in targets.items():
        again = load_and_save(_config(tmp_path, layout, run=f"on-{name}"), saved, rank_pool)
        assert digests(again) == expected, name


@pytest.mark.slow
def test_lora_trains_in_bf16_with_activation_checkpointing(run_training, tmp_path):
    """bf16 compute over FSDP2's mixed precision with a frozen base, and full AC, on fsdp2 x tp2: the
    losses track the fp32 run's (bf16 rounding apart) and fall."""
    fp32 = run_training(_config(tmp_path, ParallelLayout(fsdp=2, tp=2), run="fp32", steps=6)).losses
    bf16 = run_training(_config(tmp_path, ParallelLayout(fsdp=2, tp=2), run="bf16", steps=6, precision="bf16",
                                ac="full")).losses
    assert bf16[6] < bf16[1] - 0.05
    for step, loss in fp32.items():
        assert abs(bf16[step] - loss) < 0.02 * loss, (step, bf16[step], loss)


@pytest.mark.slow
def test_a_bf16_run_keeps_its_frozen_base_in_bf16(run_training, rank_pool, tmp_path):
    """In a bf16 run the base is held in bf16 (no float32 master: nothing steps it): loaded from the
    float32 base checkpoint and rounded once, then untouched by the steps; the adapters stay float32."""
    from dataclasses import replace

    from rayshard.actors.checkpoint.stored import StoredCheckpoint
    from rayshard.cluster.catalog.store import Store
    from rayshard.cluster.run.rank_group import RankGroup
    from rayshard.cluster.run.train import checkpoint_metadata
    from rayshard.plans.checkpoint.chunk_table import ChunkTable
    from tests.integration.lora_helpers import save_every_parameter

    base = run_training(small_config(tmp_path, ParallelLayout(), run="base", steps=1, seq_len=16)).checkpoints[-1]
    layout = ParallelLayout(fsdp=2, tp=2)
    config = _config(tmp_path, layout, run="adapt", lora=replace(LORA, base="base"), precision="bf16")
    group = RankGroup(config, rank_pool)
    try:
        group.call("load_base", base)
        for _ in range(2):
            group.call("train_step")
        pending = Store(config.store).begin("everything", 2)
        rows = group.call_each("__ray_call__", [(save_every_parameter, pending.url, pending.file_for(rank))
                                                for rank in range(layout.world_size)])
        everything = pending.commit(ChunkTable.concat(rows), checkpoint_metadata(config, 2, None, "-"))
    finally:
        group.shutdown()
    held, source = StoredCheckpoint(everything), StoredCheckpoint(base)
    dtypes = {}
    for (name, kind), tensor in held.index.items():
        shape = tensor.table.chunks_at(tensor.rows[:1])[0].global_shape
        value = held.read_region(name, kind, (0,) * len(shape), shape)
        dtypes[name] = value.dtype
        if ".lora." not in name:
            assert torch.equal(value, source.read_region(name, "param", (0,) * len(shape), shape).to(torch.bfloat16)), name
    assert {dtype for name, dtype in dtypes.items() if ".lora." not in name} == {torch.bfloat16}
    assert {dtype for name, dtype in dtypes.items() if ".lora." in name} == {torch.float32}


@pytest.mark.slow
def test_a_lora_run_resumed_on_tp2_x_pp2_continues_the_uninterrupted_run(run_training, tmp_path):
    """The issue's resume check: dp2 x tp2 for 4 steps, then tp2 x pp2 for 20, every resumed step's
    loss within 2.5e-6 relative of an uninterrupted dp2 x tp2 run's."""
    from rayshard.plans.config import OptimizerConfig
    from tests.integration.reshard_helpers import resume_continuity

    def config(layout, steps, total, run, **overrides):
        optimizer = OptimizerConfig(lr=3e-3, min_lr=3e-4, warmup_steps=3, decay_steps=total)
        return _config(tmp_path, layout, steps=steps, run=run, optimizer=optimizer, seq_len=32, **overrides)

    _, full, resumed = resume_continuity(run_training, tmp_path, config, ParallelLayout(dp=2, tp=2),
                                         ParallelLayout(tp=2, pp=2), 4, 20, 2.5e-6)
    assert full.losses[24] < full.losses[1] - 0.2  # the adapters learn: equal losses are not a frozen model's


@pytest.mark.slow
def test_a_frozen_tied_embedding_across_pipeline_stages(run_training, tmp_path):
    """Tied embeddings on pp2: the frozen embedding and its last-stage copy exchange no gradient,
    and the losses are a single rank's."""
    from rayshard.plans.config import ModelChoice

    tied = ModelChoice.named("tiny", tie_embeddings=True)
    single = run_training(_config(tmp_path, ParallelLayout(), run="one", model=tied)).losses
    piped = run_training(_config(tmp_path, ParallelLayout(pp=2), run="pp", model=tied, microbatches=2)).losses
    for step, loss in single.items():
        assert abs(piped[step] - loss) <= 1e-5 * abs(loss), (step, piped[step], loss)
