"""Engine and model configuration: frozen, validated at construction."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kernels.int4_weights import check_group_size
from server.engine.cpu_threads import AUTO, parse_cpu_threads, resolve_cpu_threads
# SUPPORTED_ARCHS: importable from here as before the registry (server.engine.architectures).
from server.engine.architectures import ARCHITECTURES, SUPPORTED_ARCHS, architecture_refusal  # noqa: F401
from server.engine.gemma_config import GEMMA_ARCHS, GemmaConfigError, gemma_fields, split_layer_ropes
from server.engine.kv_cache_dtype import check_kv_cache_dtype_name
from server.engine.kv_groups import KvGroups
from server.engine.lora.paging import check_page_rows
from server.engine.moe_config import MOE_ARCHS, MoeConfigError, moe_fields
from server.engine.sliding_window import SlidingWindowError, kv_window, layer_windows, window_of
from server.engine.speculative_config import SpeculativeConfig, parse_speculative_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Per-head RMSNorm of the queries and keys before rope.
QK_NORM_ARCHS = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# One step's tokens at most. Kernel offsets are int64, so this is not about overflow: it bounds one
# step's activations (Llama-3-8B's gate_up output alone is 3.8 GB at this many bf16 tokens) and the
# LoRA scratch allocated up front ([3, tokens, max_lora_rank]), and keeps every launch grid's y and z
# within CUDA's 65535. Prefill is chunked, so a larger budget buys nothing: a few thousand tokens per
# step already saturate an H100.
MAX_NUM_BATCHED_TOKENS = 65536
# Base-weight quantizations served (kernels.int8_weights, kernels.int4_weights, kernels.fp8_weights);
# None serves the checkpoint's floats. Which device serves which: EngineConfig.check_quantization.
QUANTIZATIONS = ("int8", "int4", "fp8")
# vLLM's names for serving a GPTQ checkpoint in its 4 bits: int4 here, on a checkpoint that must be GPTQ.
GPTQ_QUANTIZATIONS = ("gptq", "gptq_marlin")
# fp8 products on tensor cores: Ada (8.9) and Hopper (9.0) on.
FP8_MIN_CAPABILITY = (8, 9)


def check_quantization_name(name: str | None) -> None:
    """Raises ValueError, naming the supported values, for a quantization loraplex does not serve."""
    if name is not None and name not in QUANTIZATIONS + GPTQ_QUANTIZATIONS:
        raise ValueError(f"quantization {name!r} is not supported; supported: {', '.join(QUANTIZATIONS)} or none "
                         f"({' and '.join(GPTQ_QUANTIZATIONS)}: int4 on a GPTQ checkpoint)")


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


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs; names mirror the CLI flags (DESIGN.md)."""

    model: str
    device: str = "auto"
    dtype: str = "auto"
    # Adapter slots; None: sized from memory on CUDA (server.engine.lora.slot_budget), 8 elsewhere.
    max_loras: int | None = None
    max_lora_rank: int = 64
    # Adapter memory by rank (server.engine.lora.paging): pages of this many rank rows, an adapter holding
    # ceil(rank / rows) of them in max_loras slots' worth of memory; None: slots of max_lora_rank rows.
    lora_page_rows: int | None = None
    # KV blocks and adapter pages from one pool (server.engine.unified_memory); needs lora_page_rows.
    unified_memory: bool = False
    # Adapters one tenant may pin on the device (never evicted: LLMEngine.pin_adapter).
    max_pinned_adapters_per_tenant: int = 4
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # Prompt tokens one step may compute while other sequences decode (server.engine.scheduler); None:
    # no cap beyond max_num_batched_tokens.
    max_prefill_tokens_while_decoding: int | None = None
    # Under that cap, a step with prompt work costs at most this times a decode-only step, from measured step
    # times (server.engine.step_latency; `auto` on a CPU); None: the cap alone.
    max_prefill_step_ratio: float | None = None
    kv_cache_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int | None = None  # the CPU KV pool; None: a share of memory (server.engine.kv_cache)
    max_cpu_lora_bytes: int | None = None  # host-tier budget for adapters loaded on demand; None = unbounded
    # The most bytes (float32) of an adapter's parts of embed_tokens and lm_head (adapters.vocab_format);
    # None: no bound below two full copies of the base's.
    max_lora_vocab_bytes: int | None = None
    block_size: int = 16
    kernels: str = "auto"
    seed: int = 0
    # Prefix caching (server.engine.block_manager): full prompt blocks are reused across requests of one
    # tenant, adapter version and cache_salt. Sharing unsalted base-model blocks across tenants lets one
    # tenant learn from time to first token whether another sent a prompt: off unless the operator opts in.
    enable_prefix_caching: bool = True
    share_base_prefix_cache: bool = False
    # Intra-op threads for the CPU device: "auto" (the affinity mask, less a core for the HTTP side
    # on larger machines; server.engine.cpu_threads says why), an int, or None to leave torch's alone.
    cpu_threads: int | str | None = AUTO
    # The cores the step loop runs on (its thread, and the torch threads it starts), or the whole engine-core
    # process; None: not pinned. `loraplex serve` sets it from --engine-cpus (server.cpu_placement); with it,
    # cpu_threads auto is one thread per such core (the front end has cores of its own).
    cpu_affinity: tuple[int, ...] | None = None
    # vLLM's flag: no CUDA graphs, every step eager and unpadded. Off: on CUDA with the Triton kernels,
    # decode-only steps are padded to a bucket and replay a graph captured at start-up
    # (server.engine.decode_graphs); CPU devices have no graphs and always run eager.
    enforce_eager: bool = False
    # The decoder projections' weights: None (float, the activation dtype), "int8" (weight-only,
    # per-output-channel symmetric scales; LoRA stays in the activation dtype), "int4" (weight-only,
    # a scale and an offset per group of inputs: a GPTQ checkpoint's own 4-bit weights, else
    # round-to-nearest in groups of int4_group_size) or "fp8" (Ada, Hopper).
    quantization: str | None = None
    # The lm_head in int8 as well (needs quantization "int8"): per-vocabulary-row scales, the same
    # kernel as the projections. Off by default: the logits are where rounding shows most, and a
    # tied lm_head gets an int8 copy beside the float embedding (the gather needs float rows).
    quantize_lm_head: bool = False
    # int4's input channels per group when quantizing a float checkpoint (a multiple of 32; None: 32,
    # kernels.int4_weights.DEFAULT_GROUP_SIZE says why). Smaller groups cost 8 bytes per group and row
    # and round less (eval-quantized.md).
    # A GPTQ checkpoint keeps its own groups, so giving one there is refused (server.engine.weights).
    int4_group_size: int | None = None
    # Set from quantization "gptq"/"gptq_marlin" (vLLM's names, served as "int4"): the checkpoint must be
    # GPTQ, or loading refuses it (server.engine.weights) rather than quantize a float one.
    require_gptq_checkpoint: bool = False
    # vLLM's --kv-cache-dtype: what the KV pool stores (server.engine.kv_cache_dtype); auto: the model dtype.
    kv_cache_dtype: str = "auto"
    # vLLM's --async-scheduling: the host schedules and prepares decode step N+1 while step N runs
    # (server.engine.async_step says which steps overlap); off: every step synchronous.
    async_scheduling: bool = False
    # vLLM's --speculative-config (a dict, its JSON text, or parsed; server.engine.speculative_config): drafts
    # verified by the target each step, the output exactly the plain engine's; None: one token per step.
    # Annotated as what it holds after __post_init__ (the engine-core process decodes it by this type).
    speculative_config: SpeculativeConfig | None = None
    # Structured output's mask budget per constrained request (server.engine.mask_lane): the CPU time one
    # token's mask may take, and all its choices' masks together; past either, the request ends with an error
    # naming its constraint. Masks are filled off the step either way: these bound what one request costs.
    max_mask_fill_seconds: float = 1.0
    max_mask_seconds_per_request: float = 60.0
    # vLLM's --tensor-parallel-size: the base split across this many processes joined by torch.distributed
    # (gloo, CPU devices; server.engine.parallel), each with its heads, intermediate columns and vocabulary
    # rows; 1: one process, as without it.
    tensor_parallel_size: int = 1
    # vLLM's --fully-sharded-loras: under tensor parallel, LoRA's A split by rank rows too (S-LoRA), a small
    # all_gather/all_reduce of the shrink output per layer (server.engine.parallel.sharded_lora).
    fully_sharded_loras: bool = False

    def __post_init__(self) -> None:
        check_quantization_name(self.quantization)
        if self.quantization in GPTQ_QUANTIZATIONS:
            object.__setattr__(self, "quantization", "int4")
            object.__setattr__(self, "require_gptq_checkpoint", True)
        check_kv_cache_dtype_name(self.kv_cache_dtype)
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.kernels not in ("auto", "triton", "torch"):
            raise ValueError(f"kernels must be auto, triton or torch, got {self.kernels!r}")
        for name in ("max_loras", "max_lora_rank", "max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_num_batched_tokens > MAX_NUM_BATCHED_TOKENS:
            raise ValueError(f"max_num_batched_tokens must be <= {MAX_NUM_BATCHED_TOKENS}")
        if self.max_lora_rank > 512:
            raise ValueError("max_lora_rank must be <= 512")
        if self.lora_page_rows is not None:
            check_page_rows(self.lora_page_rows, self.max_lora_rank)
        if self.unified_memory and self.lora_page_rows is None:
            raise ValueError("unified_memory needs lora_page_rows: adapter pages are what shares the pool with KV")
        if self.max_pinned_adapters_per_tenant < 0:
            raise ValueError("max_pinned_adapters_per_tenant must be >= 0")
        if self.max_cpu_lora_bytes is not None and self.max_cpu_lora_bytes < 0:
            raise ValueError("max_cpu_lora_bytes must be >= 0")
        if self.max_lora_vocab_bytes is not None and self.max_lora_vocab_bytes < 0:
            raise ValueError("max_lora_vocab_bytes must be >= 0")
        if not (self.max_mask_fill_seconds > 0 and self.max_mask_seconds_per_request > 0):
            raise ValueError("max_mask_fill_seconds and max_mask_seconds_per_request must be > 0")
        if self.max_prefill_tokens_while_decoding is not None and self.max_prefill_tokens_while_decoding < 1:
            raise ValueError("max_prefill_tokens_while_decoding must be >= 1")
        if self.max_prefill_step_ratio is not None and not (
                self.max_prefill_step_ratio > 1 and self.max_prefill_tokens_while_decoding is not None):
            raise ValueError("max_prefill_step_ratio must be > 1, under a max_prefill_tokens_while_decoding")
        if self.kv_cache_blocks is not None and self.kv_cache_blocks < 1:
            raise ValueError("kv_cache_blocks must be >= 1")
        if self.cpu_kv_cache_bytes is not None and self.cpu_kv_cache_bytes < 1:
            raise ValueError("cpu_kv_cache_bytes must be >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        for name in ("enable_prefix_caching", "share_base_prefix_cache", "enforce_eager", "quantize_lm_head",
                     "async_scheduling", "fully_sharded_loras"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false")
        if self.quantize_lm_head and self.quantization != "int8":
            raise ValueError(f"quantize_lm_head needs quantization 'int8', not {self.quantization!r}")
        if self.int4_group_size is not None:
            if self.quantization != "int4":
                raise ValueError(f"int4_group_size needs quantization 'int4', not {self.quantization!r}")
            check_group_size(self.int4_group_size, 16)
        object.__setattr__(self, "cpu_threads", parse_cpu_threads(self.cpu_threads))  # "4" -> 4; raises
        if self.cpu_affinity is not None:
            object.__setattr__(self, "cpu_affinity", tuple(sorted(set(self.cpu_affinity))))
            if not self.cpu_affinity or min(self.cpu_affinity) < 0:
                raise ValueError(f"cpu_affinity must name one or more cores, got {self.cpu_affinity!r}")
        object.__setattr__(self, "speculative_config", parse_speculative_config(self.speculative_config))
        if self.speculative_config is not None and self.async_scheduling:
            # A step prepared ahead assumes one token per sequence; drafts change how far each gets.
            raise ValueError("speculative_config does not combine with async_scheduling yet")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size!r}")
        if self.fully_sharded_loras and self.tensor_parallel_size == 1:
            raise ValueError("fully_sharded_loras needs tensor_parallel_size > 1 (one process has nothing to shard)")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")

    def resolve_cpu_threads(self) -> int | None:
        """torch's intra-op thread count for a CPU device; None leaves it as it is."""
        if self.cpu_affinity is not None and self.cpu_threads == AUTO:
            return len(self.cpu_affinity)
        return resolve_cpu_threads(self.cpu_threads)

    def resolve_device(self) -> torch.device:
        """cpu, or cuda with an explicit index: "cuda" means this thread's current device, named so
        that the engine's other threads bind the same one (server.engine.cuda_device)."""
        if self.device == "cpu" or (self.device == "auto" and not torch.cuda.is_available()):
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} needs CUDA, which this machine does not have")
        device = torch.device(self.device if self.device != "auto" else "cuda")
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise ValueError(f"device cuda:{index} does not exist: {torch.cuda.device_count()} CUDA device(s)")
        return torch.device("cuda", index)

    def check_quantization(self, device: torch.device, dtype: torch.dtype = torch.float32,
                           capability: tuple[int, int] | None = None) -> None:
        """Refuses a quantization the resolved device and activation dtype cannot serve.
        capability: the CUDA device's (major, minor), read from the device when None."""
        if self.quantization != "fp8":  # int8 and int4 run everywhere: kernels.int8_triton/int4_triton on a GPU
            return
        if device.type != "cuda":
            raise ValueError(f"quantization 'fp8' needs an NVIDIA GPU of compute capability >= 8.9 (Ada, Hopper), "
                             f"not {device}: on a CPU use --quantization int8")
        capability = capability or torch.cuda.get_device_capability(device)
        if tuple(capability) < FP8_MIN_CAPABILITY:
            raise ValueError(f"quantization 'fp8' needs compute capability >= 8.9 (Ada, Hopper); {device} has "
                             f"{capability[0]}.{capability[1]}: serve float weights there (no --quantization)")
        if dtype != torch.bfloat16:
            raise ValueError(f"quantization 'fp8' computes in bfloat16 (torch._scaled_mm's row-wise scaling), "
                             f"not {str(dtype).removeprefix('torch.')}: pass --dtype bfloat16")

    def resolve_dtype(self, model: ModelConfig, device: torch.device) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if device.type == "cpu":
            return torch.float32  # CPU matmuls in half precision are slow and not what users expect
        return DTYPES.get(model.checkpoint_dtype, torch.bfloat16)
