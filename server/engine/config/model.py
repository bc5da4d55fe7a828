"""ModelConfig: what the executor needs from a Hugging Face config.json (the checkpoint's, not a flag)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# SUPPORTED_ARCHS: importable from server.engine.config as before the registry (server.engine.architectures).
from server.engine.architectures import ARCHITECTURES, SUPPORTED_ARCHS, architecture_refusal  # noqa: F401
from server.engine.gemma_config import GEMMA_ARCHS, GemmaConfigError, gemma_fields, split_layer_ropes
from server.engine.kv_groups import KvGroups
from server.engine.moe_config import MOE_ARCHS, MoeConfigError, moe_fields
from server.engine.sliding_window import SlidingWindowError, kv_window, layer_windows, window_of

# Per-head RMSNorm of the queries and keys before rope.
QK_NORM_ARCHS = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


class ModelConfigError(ValueError):
    """The checkpoint's config.json describes something loraplex cannot run exactly."""


@dataclass(frozen=True)
class ModelConfig:
    """What the executor needs from a Hugging Face config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    checkpoint_dtype: str
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None  # the config's window (Gemma's: None); each layer's is in layer_windows
    qk_norm: bool = False  # q_norm/k_norm per head before rope (Qwen3, Gemma 3)
    # Gemma's (server.engine.gemma_config): RMSNorm gains stored as w - 1, norms after attention and the
    # MLP too, the MLP's activation, embeddings times sqrt(hidden), soft-capped attention scores and
    # logits, the attention scale's denominator, each layer's window (None: global), sliding layers' rope base.
    norm_plus_one: bool = False
    sandwich_norms: bool = False
    hidden_act: str = "silu"
    scale_embeddings: bool = False
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    layer_windows: tuple[int | None, ...] | None = None
    local_rope_theta: float | None = None
    # Mixture of experts (server.engine.moe_config): experts per layer (0: a dense MLP), experts each
    # token uses, one expert's intermediate width, and whether the top-k router weights are renormalised.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    dense_layers: tuple[int, ...] = ()  # an MoE model's layers with a dense MLP instead (Qwen3-MoE's)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}"
            )

    @property
    def kv_window(self) -> int | None:
        """Where every layer is windowed, the widest window: KV further back than that from a sequence's
        next query is never read again (server.engine.sliding_window). None with a global layer."""
        return kv_window(self.layer_windows)

    @property
    def kv_groups(self) -> KvGroups | None:
        """With windowed layers interleaved with global ones, the KV layer groups (server.engine.kv_groups)."""
        return KvGroups.of(self.layer_windows)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer` routes to experts (else: a dense MLP)."""
        return self.is_moe and layer not in self.dense_layers

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"{path} not found: --model must be a Hugging Face model directory")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in ARCHITECTURES:
            raise ModelConfigError(architecture_refusal(arch))
        heads = cfg["num_attention_heads"]
        # Transformers 5 writes rope_parameters (with rope_theta inside); 4.x writes rope_theta + rope_scaling.
        rope, local_rope = split_layer_ropes(dict(cfg.get("rope_parameters") or {}))
        scaling = cfg.get("rope_scaling") or (rope if rope else None)
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind == "default":
                scaling = None
            elif kind not in ("llama3", "linear", "yarn"):
                raise ModelConfigError(f"rope scaling type {kind!r} is not supported (default, linear, llama3, yarn)")
            if kind == "yarn":  # as transformers: a top-level pretraining length wins (Phi-3 writes one there)
                old_len = cfg.get("original_max_position_embeddings")
                scaling = {"original_max_position_embeddings": cfg.get("max_position_embeddings", 2048), **scaling}
                scaling |= {"original_max_position_embeddings": old_len} if old_len is not None else {}
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        if partial != 1.0:  # Phi-4-mini's 0.75
            raise ModelConfigError(f"partial_rotary_factor {partial} is not supported (rope over the whole head only)")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        try:
            window = window_of(cfg, arch)
            extra = (gemma_fields(cfg, arch, local_rope) if arch in GEMMA_ARCHS
                     else {"qk_norm": arch in QK_NORM_ARCHS, "layer_windows": layer_windows(cfg, arch)})
            extra |= moe_fields(cfg, arch) if arch in MOE_ARCHS else {}
        except (GemmaConfigError, MoeConfigError, SlidingWindowError) as e:
            raise ModelConfigError(str(e)) from None
        if cfg.get("hidden_act", "silu") != "silu" and arch not in GEMMA_ARCHS:
            raise ModelConfigError(f"hidden_act {cfg['hidden_act']!r} is not supported for {arch} (silu)")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            checkpoint_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            eos_token_ids=eos_ids,
            **{"sliding_window": window, **extra},
        )
