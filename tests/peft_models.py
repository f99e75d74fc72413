"""What the PEFT interop tests share: random transformers models and PEFT adapters of them, and
rayshard's own logits for a base checkpoint plus an adapter checkpoint."""
from __future__ import annotations

import torch
import transformers

from rayshard.actors.checkpoint.stored import StoredCheckpoint
from rayshard.actors.model.lora import apply_lora
from rayshard.actors.model.transformer import Transformer
from rayshard.plans.checkpoint.model_check import check_against_own_model
from rayshard.plans.config import LoraConfig
from rayshard.plans.training.model_spec import ModelConfig
from rayshard.storage.manifest_io import read_manifest

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 16}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 8}),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, {"pad_token_id": None}),
    # Mixtures of experts: Qwen2-MoE as the built-in moe-tiny is laid out (layer 0 dense, layer 1
    # MoE with a shared expert), Mixtral (every layer MoE, no shared expert).
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                   "shared_expert_intermediate_size": 40, "decoder_sparse_step": 2, "norm_topk_prob": True}),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, {"num_local_experts": 4, "num_experts_per_tok": 2}),
}
ATTENTION_MODULES = ALL_MODULES[:4]
SMALL = dict(vocab_size=250, hidden_size=48, intermediate_size=88, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)


def hf_model(family: str = "llama", seed: int = 11, **sizes):
    """A random model of the family (every tensor off its default, biases and norms too)."""
    config_class, model_class, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_class(config_class(**{**SMALL, **extra, **sizes}))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    return model.eval()


def peft_adapter(model, modules=ALL_MODULES, rank: int = 4, alpha: float = 8, seed: int = 3, **settings):
    """A PEFT LoRA model over `model` whose A and B are all random (B nonzero: every adapter acts)."""
    import peft

    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(modules), **settings)
    adapted = peft.get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return adapted.eval()


def our_model(adapter_url: str):
    """rayshard's model of a LoRA checkpoint: its base (the checkpoint it names) with its adapters,
    built and filled from the two checkpoints, in eval mode."""
    adapters = StoredCheckpoint(adapter_url)
    metadata = read_manifest(adapter_url)[1]
    spec = check_against_own_model(adapters.chunks, metadata, adapter_url)
    base = StoredCheckpoint(metadata["lora_base"]["url"])
    model = Transformer(ModelConfig.from_dict(metadata["model"]))
    lora = metadata["lora"]
    apply_lora(model, spec, LoraConfig(rank=lora["rank"], alpha=lora["alpha"], targets=lora["targets"]))
    state = {name: (adapters if ".lora." in name else base).read_region(name, "param", (0,) * param.dim(), tuple(param.shape))
             for name, param in model.named_parameters()}
    model.load_state_dict(state, strict=not spec.tie_embeddings)
    return model.eval()
