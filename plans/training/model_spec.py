"""Shapes of the reference Llama-style model, without building it.

Planners (resharding, layout choice, memory estimates) need every parameter's global name and
shape for models far too large to instantiate; this module is that single source of truth and
`actors/model/transformer.py` builds exactly these parameters.

Fused tensors are stored so that contiguous row blocks are whole units, which is what makes the
global tensor independent of the tensor-parallel degree:
- attention.qkv.weight rows are grouped per kv head g = 0..n_kv_heads-1:
  [q heads g*r .. g*r+r-1 (r = n_heads/n_kv_heads), then k head g, then v head g], each head
  head_dim rows. A TP rank holding rows [a, b) holds whole groups.
- feed_forward.gate_up.weight rows interleave gate and up per hidden unit j:
  row 2j is gate_j, row 2j+1 is up_j.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from rayshard.plans.errors import ConfigError
from rayshard.plans.training.model_plan import ModelPlan, UserModel
from rayshard.plans.training.rope_scaling import RopeScaling
from rayshard.plans.training.special_tokens import SpecialTokens
from rayshard.plans.training.tp_plan import DEFAULT_TP_STYLES, SEQUENCE_PARALLEL_ADDITIONS


FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "qwen2_moe", "qwen3_moe", "mixtral", "gpt2", "gemma2", "gemma3")
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral")  # families whose Hugging Face class has mixture-of-experts layers
ROUTER_SCORES = ("softmax", "sigmoid")
# The decoder's switches beyond Llama's (GPT-2's; decision 132): where positions come from, which
# norm wraps each sublayer, which feed-forward the dense layers run.
POSITION_EMBEDDINGS = ("rope", "learned")
# rmsnorm_plus_one: Gemma's RMSNorm, scaled by (1 + weight) in float32 (decision 143).
NORMS = ("rmsnorm", "layernorm", "rmsnorm_plus_one")
# geglu_tanh: Gemma's gated feed-forward, gelu_pytorch_tanh(gate) * up, in SwiGLU's fused gate_up.
MLPS = ("swiglu", "gelu_tanh", "gelu", "geglu_tanh")
GATED_MLPS = ("swiglu", "geglu_tanh")  # the fused, interleaved gate_up (actors/model/swiglu.py)
LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' names for a layer's attention
USER_FAMILY = "user"  # a model built by the user's factory (`--model-factory`); see plans/training/model_plan.py


@dataclass(frozen=True)
class ModelConfig:
    """One decoder with the features of the families it can express (Hugging Face's names):
    llama: the base; qwen2: q/k/v biases; qwen3: per-head RMSNorm of q and k, an explicit head
    size; mistral: sliding-window attention; gpt2 and gemma2 / gemma3: the switches below.
    `family` names which Hugging Face class exports it."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 128
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    family: str = "llama"
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None  # a query sees itself and the window - 1 keys before it
    head_size: int | None = None  # None: dim / n_heads
    # Mixture of experts (n_experts > 0): layer i is an MoE layer when (i + 1) % moe_every == 0
    # (Qwen2-MoE's decoder_sparse_step). A top-k router (softmax or sigmoid scores over the
    # experts; norm_topk rescales the k chosen weights to sum to 1) sends each token to k SwiGLU
    # experts of expert_ffn_dim hidden units; an optional shared expert (shared_expert_ffn_dim > 0)
    # sees every token, its output scaled by sigmoid(shared_gate(x)) as Qwen2-MoE does. The
    # load-balancing loss (Switch / Mixtral: E * sum_e f_e * P_e) is taken per sequence and MoE
    # layer, averaged, times aux_loss_coef (actors/model/moe.py says why per sequence).
    n_experts: int = 0
    experts_per_token: int = 2
    expert_ffn_dim: int = 0
    moe_every: int = 1
    router_scores: str = "softmax"
    norm_topk: bool = False
    shared_expert_ffn_dim: int = 0
    aux_loss_coef: float = 0.01
    # RoPE past the trained context (llama3, yarn, linear, dynamic; plans/training/rope_scaling.py);
    # None: plain RoPE of rope_theta.
    rope_scaling: RopeScaling | None = None
    # bos / eos / pad ids as the model's users know them (plans/training/special_tokens.py): what
    # an export writes into config.json and generation_config.json; nothing computes with them.
    special_tokens: SpecialTokens | None = None
    # GPT-2's switches (decision 132). position_embedding "learned": a [max_seq_len, dim] table
    # (pos_embeddings) added to the token embedding, no RoPE. norm "layernorm": LayerNorm with a
    # bias everywhere RMSNorm would be. mlp "gelu_tanh" / "gelu": up (dim -> ffn_dim), GELU (tanh
    # approximation, GPT-2's gelu_new, or exact), down; no gate. wo_bias: the attention output
    # projection's bias; mlp_bias: up's and down's (GELU MLPs only).
    position_embedding: str = "rope"
    norm: str = "rmsnorm"
    mlp: str = "swiglu"
    wo_bias: bool = False
    mlp_bias: bool = False
    # Gemma's switches (decision 143). post_norms: a norm after attention and after the
    # feed-forward, before each residual add (post_attention_norm, post_ffn_norm).
    # embedding_scale: the token embedding times sqrt(dim), rounded to the embedding's dtype.
    # query_pre_attn_scalar: attention scores scaled by its -1/2 power instead of head_dim's.
    # attn_softcap / logit_softcap: scores (before the mask) and final logits become
    # cap * tanh(x / cap). layer_types: per layer "sliding_attention" (sliding_window applies) or
    # "full_attention"; None: every layer slides where sliding_window is set. rope_local_theta:
    # the RoPE base of the sliding layers, which take no rope_scaling (Gemma 3's local layers);
    # the full layers keep rope_theta and rope_scaling.
    post_norms: bool = False
    embedding_scale: bool = False
    query_pre_attn_scalar: float | None = None
    attn_softcap: float | None = None
    logit_softcap: float | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None
    # A user's model (family "user"): its factory, plan and recorded parameters. The sizes above
    # then say only what the rest of rayshard asks of any model: vocab_size, dim (what pipeline
    # stages exchange), n_layers (blocks) and max_seq_len; the attention fields are unused.
    user: UserModel | None = None

    def __post_init__(self):
        if isinstance(self.user, dict):  # from JSON metadata
            object.__setattr__(self, "user", UserModel(**self.user))
        if self.rope_scaling is not None:  # from JSON metadata or a config file
            object.__setattr__(self, "rope_scaling", RopeScaling.from_dict(self.rope_scaling))
        if self.special_tokens is not None:
            object.__setattr__(self, "special_tokens", SpecialTokens.from_dict(self.special_tokens))
        if self.layer_types is not None:  # JSON metadata gives a list
            object.__setattr__(self, "layer_types", tuple(self.layer_types))

    @property
    def plan(self) -> ModelPlan:
        """The model's parallelize plan: a user's, or the built-in families' (`REFERENCE_PLAN`)."""
        if self.user is not None:
            return self.user.plan
        return replace(REFERENCE_PLAN, hidden_size=self.dim, vocab_size=self.vocab_size, max_seq_len=self.max_seq_len)

    @property
    def tp_styles(self) -> tuple[tuple[str, str], ...]:
        """The model's tensor-parallel plan as ordered (pattern, style) pairs."""
        return self.user.plan.tp_styles if self.user is not None else REFERENCE_PLAN.tp_styles

    @property
    def head_dim(self) -> int:
        return self.head_size if self.head_size is not None else self.dim // self.n_heads

    @property
    def heads_per_group(self) -> int:
        return self.n_heads // self.n_kv_heads

    def is_sliding_layer(self, layer: int) -> bool:
        """Whether layer `layer` attends through the sliding window (when one is set)."""
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[layer] == "sliding_attention"

    def layer_rope(self, layer: int) -> str:
        """Which RoPE tables the layer takes: "local" (rope_local_theta, no scaling) or "global"."""
        return "local" if self.rope_local_theta is not None and self.is_sliding_layer(layer) else "global"

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_experts > 0 and (layer + 1) % self.moe_every == 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(layer for layer in range(self.n_layers) if self.is_moe_layer(layer))

    def validate(self) -> "ModelConfig":
        positive = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len")
        for field in positive:
            if getattr(self, field) < 1:
                raise ConfigError(f"model.{field}", getattr(self, field), "must be positive",
                                  f"set model.{field} to 1 or more")
        if self.user is not None or self.family == USER_FAMILY:
            if self.user is None or self.family != USER_FAMILY:
                raise ConfigError("model.family", self.family, "a user model needs family 'user' and its factory record",
                                  "build the model with --model-factory package.module:function")
            return self
        if self.family not in FAMILIES:
            raise ConfigError("model.family", self.family, f"must be one of {list(FAMILIES)}",
                              "pick the family whose Hugging Face class computes this model")
        self._validate_experts()
        self._validate_switches()
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError("model.sliding_window", self.sliding_window, "must be positive (or unset)",
                              "set it to the number of keys a query sees, or leave it unset")
        if self.head_size is not None and self.head_size < 1:
            raise ConfigError("model.head_size", self.head_size, "must be positive (or unset for dim / n_heads)",
                              "set it to the per-head size, or leave it unset")
        if self.head_size is None and self.dim % self.n_heads:
            raise ConfigError("model.n_heads", self.n_heads, f"must divide model.dim={self.dim}",
                              "choose n_heads so that dim / n_heads is a whole head size")
        if self.head_dim % 2 and self.position_embedding == "rope":
            raise ConfigError("model.dim", self.dim, f"head_dim={self.head_dim} must be even for RoPE",
                              "choose dim and n_heads so dim / n_heads is even")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError("model.n_kv_heads", self.n_kv_heads,
                              f"must divide model.n_heads={self.n_heads} (grouped-query attention)",
                              "pick n_kv_heads among the divisors of n_heads")
        if self.rope_scaling is not None:
            self.rope_scaling.validate(self.max_seq_len, self.head_dim)
        if self.special_tokens is not None:
            self.special_tokens.validate()
        return self

    def _validate_switches(self) -> None:
        for field, known in (("position_embedding", POSITION_EMBEDDINGS), ("norm", NORMS), ("mlp", MLPS)):
            if getattr(self, field) not in known:
                raise ConfigError(f"model.{field}", getattr(self, field), f"must be one of {list(known)}",
                                  f"pick one of {list(known)}")
        if self.mlp_bias and self.mlp in GATED_MLPS:
            raise ConfigError("model.mlp_bias", True, "is for the GELU feed-forward (the fused gate_up has no bias)",
                              "set model.mlp to gelu_tanh or gelu, or drop mlp_bias")
        if self.is_moe and self.mlp != "swiglu":
            raise ConfigError("model.mlp", self.mlp, "mixture-of-experts layers are SwiGLU experts",
                              "set model.mlp to swiglu, or n_experts to 0")
        if self.rope_scaling is not None and self.position_embedding != "rope":
            raise ConfigError("model.rope_scaling", self.rope_scaling.rope_type, "scales RoPE, which learned positions do "
                              "not use", "drop rope_scaling, or set position_embedding to rope")
        theta = self.rope_theta
        if self.position_embedding == "rope" and (isinstance(theta, bool) or not isinstance(theta, (int, float))
                                                  or not 0 < theta < float("inf")):
            raise ConfigError("model.rope_theta", theta, "must be a positive finite number (RoPE's base; 0 or less gives "
                              "NaN logits)", "set it to the base the model was trained with, e.g. 10000 or 500000")
        self._validate_gemma_switches()

    def _validate_gemma_switches(self) -> None:
        for field in ("query_pre_attn_scalar", "attn_softcap", "logit_softcap", "rope_local_theta"):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise ConfigError(f"model.{field}", value, "must be a positive number (or unset)",
                                  f"set model.{field} to a positive number, or leave it unset")
        if self.layer_types is not None:
            if len(self.layer_types) != self.n_layers or set(self.layer_types) - set(LAYER_TYPES):
                raise ConfigError("model.layer_types", list(self.layer_types),
                                  f"must list {self.n_layers} entries (one per layer), each one of {list(LAYER_TYPES)}",
                                  "give each layer full_attention or sliding_attention, or leave it unset")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ConfigError("model.layer_types", list(self.layer_types), "names sliding layers but "
                                  "model.sliding_window is unset", "set model.sliding_window, or make every layer full_attention")
        if self.rope_local_theta is not None and self.position_embedding != "rope":
            raise ConfigError("model.rope_local_theta", self.rope_local_theta, "is a RoPE base; learned positions use none",
                              "drop it, or set position_embedding to rope")

    def _validate_experts(self) -> None:
        if self.family in MOE_FAMILIES and not self.is_moe:
            raise ConfigError("model.n_experts", self.n_experts, f"family {self.family} is a mixture of experts",
                              "set model.n_experts (e.g. 8), or pick the dense family")
        if not self.is_moe:
            return
        checks = (("experts_per_token", 1 <= self.experts_per_token <= self.n_experts,
                   f"must be between 1 and model.n_experts ({self.n_experts})", "set it to the k of top-k routing, e.g. 2"),
                  ("expert_ffn_dim", self.expert_ffn_dim >= 1, "must be positive for an MoE model",
                   "set it to each expert's hidden size"),
                  ("moe_every", self.moe_every >= 1, "must be 1 or more", "1: every layer is MoE; 2: every second"),
                  ("router_scores", self.router_scores in ROUTER_SCORES, f"must be one of {list(ROUTER_SCORES)}",
                   "use softmax (Mixtral, Qwen-MoE) or sigmoid (DeepSeek-V3)"),
                  ("shared_expert_ffn_dim", self.shared_expert_ffn_dim >= 0, "must be 0 (none) or positive",
                   "set 0 for no shared expert"),
                  ("aux_loss_coef", self.aux_loss_coef >= 0, "must be 0 or positive", "e.g. 0.01"))
        for field, ok, problem, fix in checks:
            if not ok:
                raise ConfigError(f"model.{field}", getattr(self, field), problem, fix)
        if not self.moe_layers:
            raise ConfigError("model.moe_every", self.moe_every, f"leaves none of the {self.n_layers} layers MoE",
                              f"set model.moe_every to {self.n_layers} or less")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


# The built-in families' plan, the same record a user's factory returns (sizes come from the config).
REFERENCE_PLAN = ModelPlan(tp_styles=DEFAULT_TP_STYLES, sequence_parallel=SEQUENCE_PARALLEL_ADDITIONS, blocks="layers",
                           first_stage=("tok_embeddings", "pos_embeddings"), last_stage=("norm", "output"),
                           # Qwen3: one q and one k norm weight serve every head; a tp rank holds some heads.
                           tp_partial_gradients=("layers.*.attention.q_norm.weight", "layers.*.attention.k_norm.weight"))


def model_differences(saved: ModelConfig, named: ModelConfig) -> list[str]:
    """Each field where two models differ, as "field (saved -> named)"; a user model by its
    factory, plan and parameters (their values would fill the line). The special tokens are not
    compared: they change nothing the model computes (a resume keeps the checkpoint's)."""
    differences = []
    for name in saved.__dataclass_fields__:
        value, other = getattr(saved, name), getattr(named, name)
        if value == other or name == "special_tokens":
            continue
        if name == "user":
            differences += _user_differences(value, other)
        else:
            differences.append(f"{name} ({value!r} -> {other!r})")
    return differences


def _trained_part(plan: ModelPlan) -> ModelPlan:
    """The plan without its Hugging Face export: adding or fixing a mapping changes no training,
    so a run resumed naming its factory picks the new mapping up instead of being refused."""
    return replace(plan, hf_mapping=None, hf_config=None)


def _user_differences(saved: UserModel | None, named: UserModel | None) -> list[str]:
    if saved is None or named is None:
        return [f"factory ({saved and saved.factory!r} -> {named and named.factory!r})"]
    differences = [f"factory ({saved.factory!r} -> {named.factory!r})"] if saved.factory != named.factory else []
    if _trained_part(saved.plan) != _trained_part(named.plan):
        differences.append("plan")
    changed = sorted(set(saved.parameters) ^ set(named.parameters))
    if changed:
        differences.append(f"parameters ({len(changed)} differ, e.g. {changed[0][0]})")
    return differences


PRESETS: dict[str, ModelConfig] = {
    # Tests: 4 layers so pp=4 works; asymmetric head counts exercise GQA grouping.
    "tiny": ModelConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=160,
                        max_seq_len=256),
    # Benchmarks: about 27M parameters.
    "small": ModelConfig(vocab_size=256, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1536,
                         max_seq_len=1024),
    # Benchmarks at a size where bandwidth rather than fixed per-call costs decides (checkpoint
    # I/O): about 150M parameters, 1.7 GiB with AdamW moments.
    "medium": ModelConfig(vocab_size=256, dim=1024, n_layers=12, n_heads=16, n_kv_heads=4, ffn_dim=3072,
                          max_seq_len=1024),
    # GPU benchmarks (bench/throughput.py --device cuda): Llama 3.2 1B's shape, about 1.24B
    # parameters with the tied embedding; never built on the CPU machines.
    "1b": ModelConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                      max_seq_len=8192, rope_theta=500000.0, tie_embeddings=True),
    # Mixture of experts (Qwen2-MoE's layout: shared expert, dense and MoE layers alternating).
    # Tests: 8 experts, top-2, layers 1 and 3 MoE, so every pp2 stage holds one MoE layer.
    "moe-tiny": ModelConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=160, max_seq_len=256,
                            family="qwen2_moe", qkv_bias=True, n_experts=8, experts_per_token=2, expert_ffn_dim=32,
                            moe_every=2, shared_expert_ffn_dim=64),
    # Benchmarks: every layer MoE, 8 experts of 512 hidden units, top-2, a shared expert.
    "moe-small": ModelConfig(vocab_size=256, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1536, max_seq_len=1024,
                             family="qwen2_moe", qkv_bias=True, n_experts=8, experts_per_token=2, expert_ffn_dim=512,
                             moe_every=1, shared_expert_ffn_dim=1024),
    # Planning only: a 405B-shaped model (never instantiated here).
    "405b": ModelConfig(vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                        ffn_dim=53248, max_seq_len=8192, rope_theta=500000.0),
}


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError("model", name, f"unknown preset; known presets are {', '.join(PRESETS)}",
                          "pass --model tiny, small or medium")
    return replace(PRESETS[name], **overrides).validate()


def parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Global name -> global shape of every trainable parameter, in module order."""
    if config.user is not None:
        return config.user.shapes
    hd, qkv_rows = config.head_dim, (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (config.vocab_size, config.dim)}
    if config.position_embedding == "learned":
        shapes["pos_embeddings.weight"] = (config.max_seq_len, config.dim)
    norm_shapes = {"weight": (config.dim,), **({"bias": (config.dim,)} if config.norm == "layernorm" else {})}
    post_norms = ("post_attention_norm", "post_ffn_norm") if config.post_norms else ()
    for layer in range(config.n_layers):
        prefix = f"layers.{layer}."
        shapes.update({prefix + f"attention_norm.{leaf}": shape for leaf, shape in norm_shapes.items()})
        shapes[prefix + "attention.qkv.weight"] = (qkv_rows, config.dim)
        if config.qkv_bias:
            shapes[prefix + "attention.qkv.bias"] = (qkv_rows,)
        if config.qk_norm:
            shapes[prefix + "attention.q_norm.weight"] = (hd,)
            shapes[prefix + "attention.k_norm.weight"] = (hd,)
        shapes[prefix + "attention.wo.weight"] = (config.dim, config.n_heads * hd)
        if config.wo_bias:
            shapes[prefix + "attention.wo.bias"] = (config.dim,)
        for norm in (*post_norms[:1], "ffn_norm", *post_norms[1:]):  # the module order of TransformerBlock
            shapes.update({prefix + f"{norm}.{leaf}": shape for leaf, shape in norm_shapes.items()})
        if config.is_moe_layer(layer):
            shapes.update(moe_shapes(config, prefix + "feed_forward."))
            continue
        if config.mlp not in GATED_MLPS:  # actors/model/gelu_mlp.py
            shapes[prefix + "feed_forward.up.weight"] = (config.ffn_dim, config.dim)
            if config.mlp_bias:
                shapes[prefix + "feed_forward.up.bias"] = (config.ffn_dim,)
            shapes[prefix + "feed_forward.down.weight"] = (config.dim, config.ffn_dim)
            if config.mlp_bias:
                shapes[prefix + "feed_forward.down.bias"] = (config.dim,)
            continue
        shapes[prefix + "feed_forward.gate_up.weight"] = (2 * config.ffn_dim, config.dim)
        shapes[prefix + "feed_forward.down.weight"] = (config.dim, config.ffn_dim)
    shapes.update({f"norm.{leaf}": shape for leaf, shape in norm_shapes.items()})
    if not config.tie_embeddings:
        shapes["output.weight"] = (config.vocab_size, config.dim)
    return shapes


# The stacked expert tensors: dim 0 is the global expert index.
EXPERT_TENSORS = "*.feed_forward.experts.*"


def moe_shapes(config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """An MoE layer's parameters (`actors/model/moe.py` builds them in this order). Experts are
    stacked: row e of dim 0 is global expert e whatever rank holds it, so a checkpoint stores
    every expert under its global index and ep is one more cut of dim 0. Within an expert,
    gate_up rows interleave (gate_j, up_j) as the dense feed-forward does."""
    experts, ffn, dim = config.n_experts, config.expert_ffn_dim, config.dim
    shapes = {prefix + "router.weight": (experts, dim),
              prefix + "experts.gate_up.weight": (experts, 2 * ffn, dim),
              prefix + "experts.down.weight": (experts, dim, ffn)}
    if config.shared_expert_ffn_dim:
        shared = config.shared_expert_ffn_dim
        shapes.update({prefix + "shared.gate_up.weight": (2 * shared, dim), prefix + "shared.down.weight": (dim, shared),
                       prefix + "shared_gate.weight": (1, dim)})
    return shapes


def parameter_count(config: ModelConfig) -> int:
    total = 0
    for shape in parameter_shapes(config).values():
        count = 1
        for size in shape:
            count *= size
        total += count
    return total


def check_experts_fit(config: ModelConfig, layout) -> None:
    """What a layout must meet to hold an MoE model's experts (and ep needs experts to split)."""
    if not config.is_moe:
        if layout.ep > 1:
            raise ConfigError("ep", layout.ep, "expert parallelism needs a mixture-of-experts model",
                              "set --ep 1, or train an MoE model (--model moe-tiny)")
        return
    if config.n_experts % layout.ep:
        divisors = [d for d in range(1, config.n_experts + 1) if config.n_experts % d == 0]
        raise ConfigError("ep", layout.ep, f"must divide the number of experts ({config.n_experts})",
                          f"use ep (and fsdp) in {divisors}")
    # tp splits each expert's hidden units: plans/training/tp_fit.py checks that with every other size.
