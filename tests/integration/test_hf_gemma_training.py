"""Transformers-made Gemma 2 and Gemma 3 text models (tests/unit/test_hf_gemma.py's: 3 layers, 6 heads
over 2 kv heads of 24, vocabulary 1001, window 8 under 32-token sequences, soft-capping, local/global
RoPE) imported and trained on layouts that cut every Gemma switch: tp splits the GeGLU's gate_up by
hidden unit and Gemma 3's q/k norms see some heads, sequence parallelism runs the four (1 + weight)
norms of each layer on sequence shards (Gemma 2), a pipeline puts the scaled embedding on the first
stage and the capped, tied head on the last. rayshard's first loss is transformers' on the same
batch (1e-6 relative); each layout follows one rank within 1e-5 over 10 steps; the trained export
computes our logits in transformers (eager attention) and reproduces the run's next (11th) loss
within 1e-6 relative; the export with its AdamW moments imports back to the very same checkpoint."""
from __future__ import annotations

import pytest
import torch

from rayshard.cluster.catalog.store import Store
from rayshard.cluster.checkpoint.hf_interop import export_hf, import_hf
from tests.integration.test_hf_family_training import _config, loss_on_rayshards_batch
from tests.integration.test_hf_gpt2_training import _follows
from tests.unit.test_hf_families import assert_same_state, ours_from
from tests.unit.test_hf_gemma import FAMILIES, SIZES, gemma_model


def _tp2_gradients(rank: int, init_method: str, world_size: int, results, sequence_parallel: bool) -> None:
    """One step's loss and whole gradients on tp2, every Gemma switch on (a sliding window under
    the sequence, both caps, q/k norms)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rayshard.actors.model.transformer import build_on_meta
    from rayshard.actors.parallel.init_weights import initialize_parameters
    from rayshard.actors.parallel.parallelize import parallelize
    from torch.distributed.tensor.parallel import loss_parallel

    from rayshard.plans.layout.parallel_layout import MESH_DIM_NAMES
    from rayshard.plans.training.model_spec import preset

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        config = preset("tiny", n_layers=2, family="gemma3", norm="rmsnorm_plus_one", mlp="geglu_tanh", post_norms=True,
                        embedding_scale=True, qk_norm=True, sliding_window=4, rope_local_theta=100.0,
                        layer_types=("sliding_attention", "full_attention"), attn_softcap=2.0, logit_softcap=3.0,
                        query_pre_attn_scalar=20, tie_embeddings=True)
        model = build_on_meta(config)
        parallelize(model, init_device_mesh("cpu", (1, 1, 1, 2), mesh_dim_names=MESH_DIM_NAMES), 2, 1,
                    tie_embeddings=True, sequence_parallel=sequence_parallel)
        model.to_empty(device="cpu")
        model.output.weight = model.tok_embeddings.weight
        initialize_parameters(model, 1, config.n_layers, zero_norms=True)
        with torch.no_grad():  # norms away from their identity start, so that each tells
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.add_(0.1)
        # 16 positions: sequence parallelism splits them over the 2 tp ranks; four windows.
        tokens = torch.randint(0, config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))

        logits = model(tokens[:, :-1])
        with loss_parallel():
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
        whole = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                 for name, p in model.named_parameters() if p.grad is not None}
        results[rank] = (float((loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach()), whole,
                         sorted(name for name, _ in model.named_parameters()))
    finally:
        dist.destroy_process_group()


def test_gemma_norms_on_sequence_shards_give_tp_without_sp_gradients():
    """Under --sp the norms after attention and after the feed-forward take a row-parallel output
    and give back to the residual stream (SequenceParallelToResidual): every parameter gets the
    gradient tp without sp gives."""
    from tests.forked_ranks import run_ranks

    plain, sequence = (run_ranks(_tp2_gradients, 2, sp)[0] for sp in (False, True))
    assert abs(plain[0] - sequence[0]) <= 1e-6 * plain[0]
    assert set(sequence[1]) == set(plain[1]) == set(plain[2])  # every parameter has a gradient
    for name, gradient in plain[1].items():
        torch.testing.assert_close(sequence[1][name], gradient, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("family, sp", [("gemma2", ("--sp",)), ("gemma3", ())], ids=["gemma2-sp", "gemma3"])
def test_an_imported_gemma_follows_one_rank_on_dp2_tp2_and_pp2_and_exports_back(run_training, tmp_path, family, sp):
    gemma_model(family, tied=family == "gemma2").save_pretrained(str(tmp_path / "hf"))
    store = str(tmp_path / "store")
    import_hf(str(tmp_path / "hf"), Store(store), "imported", log=lambda *_: None)

    first = _config(store, "one", "imported@0", 10, "--dp", "1", "--tp", "1")  # (the default layout is dp2 x tp2)
    one = run_training(first)
    assert one.losses[10] < one.losses[1]  # it trains
    # rayshard's first loss is transformers' (eager attention, fp32) on the same batch.
    theirs = loss_on_rayshards_batch(gemma_model(family, tied=family == "gemma2"), first, 1)
    assert abs(one.losses[1] - theirs) <= 1e-6 * theirs, (one.losses[1], theirs)
    split = run_training(_config(store, "split", "imported@0", 10, "--dp", "2", "--tp", "2", *sp))
    _follows(split, one, range(1, 11))
    piped = run_training(_config(store, "piped", "imported@0", 10, "--dp", "1", "--tp", "1", "--pp", "2",
                                       "--microbatches", "2"))
    _follows(piped, one, range(1, 11))

    url = Store(store).resolve("split@10").url
    export_hf(url, str(tmp_path / "out"), log=lambda *_: None)
    model_class = FAMILIES[family][1]
    loaded = model_class.from_pretrained(str(tmp_path / "out"), dtype=torch.float32, attn_implementation="eager").eval()
    _, ours = ours_from(url)
    tokens = torch.randint(0, SIZES["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits, theirs = ours(tokens), loaded(tokens, labels=tokens)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    assert (theirs.logits - logits).abs().max().item() <= 1e-5
    assert abs(loss.item() - theirs.loss.item()) <= 1e-6 * theirs.loss.item()
    # The export reproduces rayshard's next loss: step 11 of the run, on one rank, in transformers.
    following = _config(store, "next", "split@10", 11, "--dp", "1", "--tp", "1")
    step_11 = run_training(following).losses[11]
    theirs_11 = loss_on_rayshards_batch(loaded, following, 11)
    assert abs(step_11 - theirs_11) <= 1e-6 * theirs_11, (step_11, theirs_11)

    assert_same_state(url, import_hf(str(tmp_path / "out"), Store(store), "again", log=lambda *_: None))


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", [
    ("gemma3", ("--dp", "1", "--fsdp", "2", "--tp", "2", "--sp")),
    ("gemma2", ("--dp", "1", "--tp", "2", "--pp", "2", "--microbatches", "2", "--sp")),
], ids=["gemma3-fsdp2xtp2-sp", "gemma2-tp2xpp2-sp"])
def test_an_imported_gemma_follows_one_rank_on_fsdp_and_tp_with_pp(run_training, tmp_path, family, layout):
    """FSDP2 shards the (1 + weight) norms and GeGLU over tp; a pipeline's stages meet sp's
    post-sublayer norms; then a resume of the run on dp2 x tp2 continues it."""
    gemma_model(family, tied=True).save_pretrained(str(tmp_path / "hf"))
    store = str(tmp_path / "store")
    import_hf(str(tmp_path / "hf"), Store(store), "imported", log=lambda *_: None)
    one = run_training(_config(store, "one", "imported@0", 10, "--dp", "1", "--tp", "1"))
    other = run_training(_config(store, "other", "imported@0", 10, *layout))
    _follows(other, one, range(1, 11))
    resumed = run_training(_config(store, "resumed", "other@5", 10, "--dp", "2", "--tp", "2"))
    _follows(resumed, one, range(6, 11))
