"""LoRA's plan (roles, shapes, tp splits, refusals) and its math on one device.

The adapters on the fused qkv and gate_up weights must act exactly as separate q/k/v and gate/up
adapters: the LoRA model's logits equal the base model's with every target's W replaced by
W + (alpha / r) B A, merged into the fused weight at that projection's own rows.
"""
from __future__ import annotations

import argparse

import pytest
import torch

from rayshard.plans.config import LoraConfig, ModelChoice, TrainConfig
from rayshard.plans.errors import ConfigError
from rayshard.plans.training.model_spec import parameter_shapes, preset
from rayshard.plans.training.converters import parameter_roles, run_plan, run_roles
from rayshard.plans.training.tp_plan import split_dim_under


def test_roles_freeze_the_base_and_store_only_adapters():
    model = preset("tiny")
    roles = parameter_roles(model, LoraConfig(rank=4, targets="q,v,down"))
    base = parameter_shapes(model)
    assert roles.frozen_names == set(base)
    assert roles.trained_names == roles.stored_names
    assert roles.stored_shapes == {f"layers.{i}.{part}.lora.{t}.{ab}": shape
                                   for i in range(4) for part, t, shapes in
                                   (("attention", "q", ((4, 64), (64, 4))), ("attention", "v", ((4, 64), (32, 4))),
                                    ("feed_forward", "down", ((4, 160), (64, 4))))
                                   for ab, shape in zip("ab", shapes)}
    # Without adapters every parameter trains and is stored, as before.
    full = parameter_roles(model, LoraConfig())
    assert full.trained_names == full.stored_names == set(base) and not full.has_frozen


def test_adapters_split_beside_their_base_under_tp():
    config = TrainConfig(lora=LoraConfig(rank=4))
    styles = run_plan(config).tp_styles
    split = {name: split_dim_under(name, styles) for name in run_roles(config).stored_shapes}
    # Column-parallel base (q, k, v, gate, up): B by rows, A whole; row-parallel (o, down): A by columns, B whole.
    for target in ("q", "k", "v"):
        assert (split[f"layers.1.attention.lora.{target}.a"], split[f"layers.1.attention.lora.{target}.b"]) == (None, 0)
    for target in ("gate", "up"):
        assert (split[f"layers.1.feed_forward.lora.{target}.a"], split[f"layers.1.feed_forward.lora.{target}.b"]) == (None, 0)
    assert (split["layers.1.attention.lora.o.a"], split["layers.1.attention.lora.o.b"]) == (1, None)
    assert (split["layers.1.feed_forward.lora.down.a"], split["layers.1.feed_forward.lora.down.b"]) == (1, None)


@pytest.mark.parametrize("lora, message", [
    (LoraConfig(rank=4, targets="q,query"), "names ['query']; the projections that exist are q,k,v,o,gate,up,down"),
    (LoraConfig(rank=40, targets="k"), "exceeds target 'k''s dimension (64 in, 32 out)"),
    (LoraConfig(rank=4, alpha=0), "lora.alpha=0"),
    (LoraConfig(rank=4, dropout=1.0), "lora.dropout=1.0"),
])
def test_bad_lora_input_is_one_line(lora, message):
    with pytest.raises(ConfigError) as error:
        TrainConfig(lora=lora).validate()
    assert message in str(error.value) and "Fix:" in str(error.value) and "\n" not in str(error.value)


def test_the_config_file_section():
    config = TrainConfig.from_dict({"lora": {"rank": 8, "alpha": 32, "targets": "q,v", "base": "base@20"}}).validate()
    assert (config.lora.rank, config.lora.scale, config.lora.target_list, config.lora.base) == (8, 4.0, ("q", "v"), "base@20")
    with pytest.raises(ConfigError, match="lora"):
        TrainConfig.from_dict({"lora": {"rnak": 8}})


def test_lora_refuses_what_it_does_not_run_on_yet():
    with pytest.raises(ConfigError, match="routed experts are not supported") as error:
        TrainConfig(model=ModelChoice.named("moe-tiny"), lora=LoraConfig(rank=4, targets="q,experts")).validate()
    assert "\n" not in str(error.value) and "Fix:" in str(error.value)
    # MoE layers without a shared expert and no dense layer: gate/up/down would adapt nothing.
    routed_only = ModelChoice("moe", preset("moe-tiny", moe_every=1, shared_expert_ffn_dim=0))
    with pytest.raises(ConfigError, match="'down' adapts nothing in qwen2_moe"):
        TrainConfig(model=routed_only, lora=LoraConfig(rank=4, targets="q,down")).validate()
    TrainConfig(model=routed_only, lora=LoraConfig(rank=4, targets="q,k,v,o")).validate()
    # GPT-2's feed-forward is up, GELU, down: the gated feed-forward's adapters do not fit it (they
    # passed the check and failed in the first forward).
    gpt2 = ModelChoice("gpt2", preset("tiny", family="gpt2", position_embedding="learned", norm="layernorm",
                                      mlp="gelu_tanh", qkv_bias=True, wo_bias=True, mlp_bias=True))
    with pytest.raises(ConfigError, match="this gpt2 model's feed-forward is gelu_tanh") as error:
        TrainConfig(model=gpt2, lora=LoraConfig(rank=4, targets="q,up")).validate()
    assert "\n" not in str(error.value) and "Fix: adapt q,k,v,o only" in str(error.value)
    TrainConfig(model=gpt2, lora=LoraConfig(rank=4, targets="q,k,v,o")).validate()


def test_moe_adapters_sit_on_attention_dense_layers_and_the_shared_expert():
    """moe-tiny: layers 1 and 3 MoE (shared expert of 64 hidden units), 0 and 2 dense (160)."""
    model = preset("moe-tiny")
    config = TrainConfig(model=ModelChoice("moe-tiny", model),
                         lora=LoraConfig(rank=4, targets="q,gate,down")).validate()
    roles = run_roles(config)
    assert roles.frozen_names == set(parameter_shapes(model))  # routers and routed experts included
    ffn = {0: "feed_forward", 1: "feed_forward.shared", 2: "feed_forward", 3: "feed_forward.shared"}
    hidden = {0: 160, 1: 64, 2: 160, 3: 64}
    assert roles.stored_shapes == {
        **{f"layers.{i}.attention.lora.q.{ab}": shape for i in range(4) for ab, shape in zip("ab", ((4, 64), (64, 4)))},
        **{f"layers.{i}.{ffn[i]}.lora.gate.{ab}": shape for i in range(4)
           for ab, shape in zip("ab", ((4, 64), (hidden[i], 4)))},
        **{f"layers.{i}.{ffn[i]}.lora.down.{ab}": shape for i in range(4)
           for ab, shape in zip("ab", ((4, hidden[i]), (64, 4)))}}
    styles = run_plan(config).tp_styles
    assert (split_dim_under("layers.1.feed_forward.shared.lora.gate.a", styles),
            split_dim_under("layers.1.feed_forward.shared.lora.gate.b", styles)) == (None, 0)
    assert (split_dim_under("layers.3.feed_forward.shared.lora.down.a", styles),
            split_dim_under("layers.3.feed_forward.shared.lora.down.b", styles)) == (1, None)
    # The rank is checked against every adapted projection: here the shared expert's 32 hidden units.
    narrow = ModelChoice("moe", preset("moe-tiny", shared_expert_ffn_dim=32))
    with pytest.raises(ConfigError, match="exceeds target 'gate''s dimension \\(64 in, 32 out\\)"):
        TrainConfig(model=narrow, lora=LoraConfig(rank=40, targets="gate")).validate()


def test_lora_flags_fill_the_section():
    from rayshard.cluster.cli.config_flags import add_config_flags, config_overrides

    parser = argparse.ArgumentParser()
    add_config_flags(parser, TrainConfig)
    args = parser.parse_args(["--lora-rank", "8", "--lora-alpha", "16", "--lora-targets", "q,v", "--lora-dropout", "0.1"])
    values = config_overrides(args, TrainConfig)
    assert {k: v for k, v in values.items() if k.startswith("lora.") and v is not None} == {
        "lora.rank": 8, "lora.alpha": 16.0, "lora.targets": "q,v", "lora.dropout": 0.1}


def _merged_into_fused(model_config, base: dict, adapters: dict, scale: float) -> dict:
    """The base weights with every adapter merged at its projection's rows of the fused tensors."""
    hd, r = model_config.head_dim, model_config.heads_per_group
    groups = model_config.n_kv_heads
    merged = {name: tensor.clone() for name, tensor in base.items()}
    q_rows = torch.tensor([g * (r + 2) * hd + j * hd + d for g in range(groups) for j in range(r) for d in range(hd)])
    k_rows = torch.tensor([g * (r + 2) * hd + r * hd + d for g in range(groups) for d in range(hd)])
    rows = {"q": q_rows, "k": k_rows, "v": k_rows + hd, "gate": 0, "up": 1}  # gate_up interleaves (gate_j, up_j)
    fused = {"q": "qkv", "k": "qkv", "v": "qkv", "o": "wo", "gate": "gate_up", "up": "gate_up", "down": "down"}
    for name in {name.rsplit(".", 1)[0] for name in adapters}:  # layers.L.<module>.lora.<target>
        module, target = name.split(".lora.")
        delta = scale * adapters[name + ".b"] @ adapters[name + ".a"]
        weight = merged[f"{module}.{fused[target]}.weight"]
        if target in ("gate", "up"):
            weight[rows[target]::2] += delta
        elif target in rows:
            weight[rows[target]] += delta
        else:
            weight += delta
    return merged


@pytest.mark.parametrize("model", ["tiny", "moe-tiny"])
def test_adapters_on_fused_weights_act_as_separate_projections(model):
    """On moe-tiny the feed-forward adapters of its MoE layers sit on the shared expert."""
    from rayshard.actors.model.lora import apply_lora
    from rayshard.actors.model.transformer import Transformer

    torch.manual_seed(0)
    spec = preset(model, n_layers=2)
    lora = LoraConfig(rank=3, alpha=5.0)
    base_model = Transformer(spec)
    with torch.no_grad():
        for param in base_model.parameters():
            param.normal_(0, 0.1)
    base = {name: param.detach().clone() for name, param in base_model.named_parameters()}
    adapted = Transformer(spec)
    adapted.load_state_dict(base)
    apply_lora(adapted, spec, lora)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if ".lora." in name:
                param.normal_(0, 0.3)  # B too: nonzero, so every adapter acts
    adapters = {name: param.detach().clone() for name, param in adapted.named_parameters() if ".lora." in name}
    assert len(adapters) == 2 * 7 * 2
    tokens = torch.randint(0, spec.vocab_size, (2, 12))
    logits = adapted(tokens)
    base_model.load_state_dict(_merged_into_fused(spec, base, adapters, lora.scale))
    expected = base_model(tokens)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    # The base itself is frozen and untouched; only adapters take gradients.
    logits.square().mean().backward()
    assert all((param.grad is not None) == (".lora." in name) for name, param in adapted.named_parameters())
    assert all(torch.equal(param, base[name]) for name, param in adapted.named_parameters() if name in base)


def test_memory_estimate_reads_the_roles():
    """A frozen weight costs its float32 bytes alone; the adapters carry the gradient and moments."""
    from rayshard.plans.layout.chooser import Workload, estimate_memory
    from rayshard.plans.layout.parallel_layout import ParallelLayout
    from rayshard.plans.training.model_spec import parameter_count

    model, layout = preset("small"), ParallelLayout(fsdp=2, tp=2)
    roles = parameter_roles(model, LoraConfig(rank=8))
    full = estimate_memory(model, layout, Workload(8, 64))
    lora = estimate_memory(model, layout, Workload(8, 64, trained_parameters=roles.count(trained=True)))
    assert full.activations == lora.activations
    params, adapters = parameter_count(model), roles.count(trained=True)
    assert full.model_state - lora.model_state == pytest.approx((16 * params - 4 * params - 16 * adapters) / 4)  # over tp2 x fsdp2


def test_flops_read_the_roles():
    """A frozen weight costs 4 FLOPs per token (forward, input gradient), a trained adapter 6."""
    from rayshard.plans.training.flops import active_parameters, flops_per_token

    model = preset("small")
    adapters = parameter_roles(model, LoraConfig(rank=8)).count(trained=True)
    weights = active_parameters(model) - model.vocab_size * model.dim
    assert flops_per_token(model, 64) - flops_per_token(model, 64, adapters) == pytest.approx(2 * weights - 6 * adapters)


def test_a_bf16_run_counts_its_frozen_weights_at_two_bytes():
    from rayshard.plans.layout.chooser import Workload, estimate_memory
    from rayshard.plans.layout.parallel_layout import ParallelLayout
    from rayshard.plans.training.model_spec import parameter_count

    model, layout = preset("small"), ParallelLayout()
    adapters = parameter_roles(model, LoraConfig(rank=8)).count(trained=True)
    fp32 = estimate_memory(model, layout, Workload(8, 64, precision="bf16", trained_parameters=adapters))
    work = Workload(8, 64, precision="fp32", trained_parameters=adapters)
    assert fp32.model_state < estimate_memory(model, layout, work).model_state
    assert estimate_memory(model, layout, work).model_state == pytest.approx(4 * parameter_count(model) + 16 * adapters)


def test_a_user_model_takes_targets_by_module_name_pattern():
    """examples/gpt2: targets are its plan's names (q -> blocks.*.attn.q) or module-name patterns;
    without --lora-targets, every name the plan declares."""
    from rayshard.actors.model.user_model import describe_factory

    gpt2 = ModelChoice("examples.gpt2.model:tiny_gpt2", describe_factory("examples.gpt2.model:tiny_gpt2"))
    config = TrainConfig(model=gpt2, lora=LoraConfig(rank=4, targets="q,blocks.?.mlp.fc")).validate()
    assert run_roles(config).stored_shapes == {
        **{f"blocks.{i}.attn.lora.q.{ab}": shape for i in range(4) for ab, shape in zip("ab", ((4, 64), (64, 4)))},
        **{f"blocks.{i}.mlp.lora.fc.{ab}": shape for i in range(4) for ab, shape in zip("ab", ((4, 64), (256, 4)))}}
    assert run_roles(config).frozen_names == set(gpt2.spec.user.shapes)
    every = run_roles(TrainConfig(model=gpt2, lora=LoraConfig(rank=4)).validate()).stored_shapes
    assert {name.rsplit(".", 1)[0] for name in every} == {
        f"blocks.{i}.{part}" for i in range(4) for part in ("attn.lora.q", "attn.lora.k", "attn.lora.v", "attn.lora.proj",
                                                            "mlp.lora.fc", "mlp.lora.proj")}
    with pytest.raises(ConfigError) as error:
        TrainConfig(model=gpt2, lora=LoraConfig(rank=4, targets="q,blocks.*.attn.c_attn")).validate()
    assert ("lora.targets='blocks.*.attn.c_attn': matches no module of the model; its Linear modules are blocks.*.attn.q, "
            "blocks.*.attn.k, blocks.*.attn.v, blocks.*.attn.proj, blocks.*.mlp.fc, blocks.*.mlp.proj, lm_head") in str(error.value)
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="exceeds module 'blocks.0.attn.q''s dimension"):
        TrainConfig(model=gpt2, lora=LoraConfig(rank=65, targets="q")).validate()
    from rayshard.plans.layout.parallel_layout import ParallelLayout

    # Under tp: adapters beside column- and row-parallel Linears split as the built-in ones do; the
    # vocab-parallel head takes none (one line).
    tp2 = TrainConfig(model=gpt2, layout=ParallelLayout(tp=2), lora=LoraConfig(rank=4)).validate()
    styles = run_plan(tp2).tp_styles
    assert (split_dim_under("blocks.1.attn.lora.q.a", styles), split_dim_under("blocks.1.attn.lora.q.b", styles)) == (None, 0)
    assert (split_dim_under("blocks.1.mlp.lora.proj.a", styles), split_dim_under("blocks.1.mlp.lora.proj.b", styles)) == (1, None)
    with pytest.raises(ConfigError, match="adapts lm_head, which tp splits as 'vocab_head'") as error:
        TrainConfig(model=gpt2, layout=ParallelLayout(tp=2), lora=LoraConfig(rank=4, targets="q,lm_head")).validate()
    assert "\n" not in str(error.value)


def test_offline_planners_see_an_adapter_checkpoint_as_its_adapters():
    """`ckpt reshard` / `ckpt plan` plan a LoRA checkpoint's adapters alone, split under tp as the
    trainer splits them, each in its layer's pipeline stage."""
    from rayshard.plans.checkpoint.regions import pipeline_partition, rank_regions
    from rayshard.plans.layout.parallel_layout import ParallelLayout
    from rayshard.plans.training.lora import adapter_planning_model

    model = preset("tiny")
    view = adapter_planning_model(model, {"rank": 4, "alpha": 8.0, "targets": "q,down"})
    assert parameter_shapes(view) == run_roles(TrainConfig(lora=LoraConfig(rank=4, targets="q,down"))).stored_shapes
    layout = ParallelLayout(tp=2, pp=2)
    regions = {r.name: r for r in rank_regions(view, layout, 1, pipeline_partition(view, layout))}  # pp 0, tp 1
    assert set(regions) == {f"layers.{i}.{m}.{ab}" for i in (0, 1) for m in ("attention.lora.q", "feed_forward.lora.down")
                            for ab in "ab"}
    assert (regions["layers.0.attention.lora.q.b"].offsets, regions["layers.0.attention.lora.q.b"].sizes) == ((32, 0), (32, 4))
    assert regions["layers.0.attention.lora.q.a"].sizes == (4, 64)  # copied over tp
    assert (regions["layers.1.feed_forward.lora.down.a"].offsets, regions["layers.1.feed_forward.lora.down.a"].sizes) == \
        ((0, 80), (4, 80))
