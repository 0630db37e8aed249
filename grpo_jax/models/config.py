"""The decoder configuration and the named presets.

One family covers Llama 2/3/3.1, Mistral, SmolLM2 (Llama architecture),
Qwen2/2.5 (q/k/v bias) and Qwen3 (q/k RMSNorm): pre-norm RMSNorm blocks,
rotary embeddings, grouped-query attention and a SwiGLU MLP.

Gemma 2 and 3 are the same decoder with a few switches (docs/models.md):
norms also after attention and the MLP, a GELU-tanh gated MLP, embeddings
times sqrt(D), `query_scale`, soft-capped scores and logits (Gemma 2), and
per-layer attention (`layer_types`: sliding or full, each kind with its own
RoPE base). `layer_config(i)` is layer i's config with one window and one
RoPE base, so everything below a layer reads the same fields as before.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from grpo_jax.models.moe_config import MlaConfig, MoeConfig
from grpo_jax.registry import lookup, names, register

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3",
                 "qwen3_moe", "deepseek_v3")
# Blocks with norms after attention and the MLP too, a GELU-tanh MLP and
# embeddings scaled by sqrt(D). Their RMSNorm is x * (1 + w) in transformers:
# the loader stores 1 + w (hf.py), so the norm here is the same function.
GEMMA = ("gemma2", "gemma3")
MOE = ("qwen3_moe", "deepseek_v3")   # sparse MLPs (`moe`; a dense layer's config has none)
LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 frequency-dependent RoPE scaling (`rope_type: llama3`), or
  `kind="linear"` (Gemma 3 global layers): every frequency / factor."""
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192
  kind: str = "llama3"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of one decoder; frozen so it can be a static jit argument."""
  architecture: str
  vocab_size: int
  dim: int                       # hidden size D
  num_layers: int                # L
  num_heads: int                 # H query heads
  num_kv_heads: int              # K key/value heads (GQA: H % K == 0)
  head_dim: int                  # hd
  mlp_dim: int                   # F, SwiGLU inner size
  rope_theta: float = 10_000.0
  rope_scaling: Optional[RopeScaling] = None
  norm_eps: float = 1e-5
  qkv_bias: bool = False         # Qwen2/2.5
  qk_norm: bool = False          # Qwen3
  tie_embeddings: bool = False
  sliding_window: Optional[int] = None   # Mistral v0.1 style local attention
  max_seq_len: int = 4096
  # Per-layer attention (Gemma): LAYER_TYPES per layer, sliding ones use
  # `sliding_window`; None: every layer uses `sliding_window` (or none).
  layer_types: Optional[tuple] = None
  rope_local_theta: Optional[float] = None  # Gemma 3: sliding layers' base
  attn_softcap: Optional[float] = None      # Gemma 2: c * tanh(score / c)
  final_softcap: Optional[float] = None     # Gemma 2: on the logits
  query_scale: Optional[float] = None       # scores / sqrt(this), not sqrt(E)
  moe: Optional[MoeConfig] = None           # sparse MLPs (moe_config.py)
  mla: Optional[MlaConfig] = None           # latent attention (mla.py)

  def __post_init__(self):
    if self.architecture not in ARCHITECTURES:
      raise ValueError(f"ModelConfig.architecture={self.architecture!r}; "
                       f"allowed: {ARCHITECTURES}")
    for field in ("vocab_size", "dim", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "mlp_dim"):
      if getattr(self, field) <= 0:
        raise ValueError(f"ModelConfig.{field} must be > 0, "
                         f"got {getattr(self, field)}")
    if self.moe is not None and self.architecture not in MOE:
      raise ValueError(f"ModelConfig.moe is set but architecture="
                       f"{self.architecture!r} has no experts; one of {MOE}")
    if self.mla is not None and (self.num_kv_heads, self.head_dim) != (
        1, self.mla.cache_dim):
      raise ValueError(f"ModelConfig of an MLA model: num_kv_heads must be 1 "
                       f"and head_dim kv_lora_rank + rope_dim = "
                       f"{self.mla.cache_dim}, got {self.num_kv_heads}, "
                       f"{self.head_dim}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"ModelConfig.num_heads={self.num_heads} is not a "
                       f"multiple of num_kv_heads={self.num_kv_heads}")

    self._check_layer_types()
    if self.moe is not None and any(not 0 <= i < self.num_layers
                                    for i in self.moe.dense_layers):
      raise ValueError(f"ModelConfig.moe.dense_layers="
                       f"{self.moe.dense_layers} must be layer indices "
                       f"below num_layers={self.num_layers}")

  def _check_layer_types(self):
    if self.layer_types is None:
      return
    if not isinstance(self.layer_types, tuple):  # hashable: a jit static arg
      object.__setattr__(self, "layer_types", tuple(self.layer_types))
    bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
    if bad or len(self.layer_types) != self.num_layers:
      raise ValueError(f"ModelConfig.layer_types must list one of "
                       f"{LAYER_TYPES} per layer ({self.num_layers}); got "
                       f"{len(self.layer_types)} entries, unknown {bad}")
    if "sliding_attention" in self.layer_types and not self.sliding_window:
      raise ValueError("ModelConfig.sliding_window must be set when "
                       "layer_types has sliding_attention layers")

  @property
  def gemma(self) -> bool:
    return self.architecture in GEMMA

  def replace(self, **kwargs) -> "ModelConfig":
    return dataclasses.replace(self, **kwargs)

  def layer_config(self, i: int) -> "ModelConfig":
    """Layer i's config: its own window (None for a full layer) and RoPE
    base, and no `layer_types`; no `moe` for an MoE model's dense layers;
    the config itself when layers are alike."""
    c = self._attention_config(i)
    if self.moe is not None and self.moe.is_dense(i):
      return c.replace(moe=None)
    return c

  def _attention_config(self, i: int) -> "ModelConfig":
    if self.layer_types is None:
      return self
    if self.layer_types[i] == "full_attention":
      return self.replace(layer_types=None, sliding_window=None)
    local = self.rope_local_theta
    return self.replace(
        layer_types=None,
        rope_theta=self.rope_theta if local is None else local,
        rope_scaling=self.rope_scaling if local is None else None)

  def layer_period(self, start: int = 0, stop: Optional[int] = None) -> int:
    """The smallest P with layer_config(i) == layer_config(start + (i -
    start) % P) for the layers in [start, stop): the forward scans groups
    of P layers (1: plain scan)."""
    stop = self.num_layers if stop is None else stop
    kinds = [self.layer_config(i) for i in range(start, stop)]
    for period in range(1, len(kinds) + 1):
      if all(kinds[i] == kinds[i % period] for i in range(len(kinds))):
        return period
    return len(kinds)

  def sparse_layers(self) -> tuple[int, ...]:
    """The layers with experts, in order (their leaves' axis 0)."""
    if self.moe is None:
      return ()
    return tuple(i for i in range(self.num_layers) if not self.moe.is_dense(i))

  def mlp_segments(self) -> list[tuple[int, int]]:
    """[start, stop) runs of layers with the same MLP kind (dense or
    sparse): their weights stack separately (`layer_scan`)."""
    dense = [self.moe is None or self.moe.is_dense(i)
             for i in range(self.num_layers)]
    starts = [i for i in range(self.num_layers)
              if i == 0 or dense[i] != dense[i - 1]]
    return list(zip(starts, starts[1:] + [self.num_layers]))


def _preset(name: str, **kwargs) -> ModelConfig:
  config = ModelConfig(**kwargs)
  register("model", name)(config)
  return config


def get_preset(name: str) -> ModelConfig:
  """The ModelConfig registered under `name`; unknown names list the presets."""
  return lookup("model", name)


def preset_names() -> list[str]:
  return names("model")


# Presets without weights: experiments initialise them at random (config.seed)
# and read them with the byte tokenizer.
RANDOM_PRESETS = ("tiny", "tiny-gemma", "tiny-gemma2", "tiny-moe",
                  "tiny-deepseek")

# A random model for tests: small enough to compile and run in seconds.
_preset("tiny", architecture="llama", vocab_size=256, dim=64, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
        tie_embeddings=True, max_seq_len=512)

# HuggingFaceTB/SmolLM2-135M-Instruct: Llama architecture, 134.5M parameters.
_preset("smollm2-135m-instruct", architecture="llama", vocab_size=49152,
        dim=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
        mlp_dim=1536, rope_theta=100_000.0, norm_eps=1e-5,
        tie_embeddings=True, max_seq_len=8192)

_QWEN25 = dict(architecture="qwen2", rope_theta=1_000_000.0, norm_eps=1e-6,
               qkv_bias=True, max_seq_len=32768)
_preset("qwen2.5-0.5b", vocab_size=151936, dim=896, num_layers=24,
        num_heads=14, num_kv_heads=2, head_dim=64, mlp_dim=4864,
        tie_embeddings=True, **_QWEN25)
_preset("qwen2.5-1.5b", vocab_size=151936, dim=1536, num_layers=28,
        num_heads=12, num_kv_heads=2, head_dim=128, mlp_dim=8960,
        tie_embeddings=True, **_QWEN25)
_preset("qwen2.5-7b", vocab_size=152064, dim=3584, num_layers=28,
        num_heads=28, num_kv_heads=4, head_dim=128, mlp_dim=18944, **_QWEN25)
_preset("qwen2.5-32b", vocab_size=152064, dim=5120, num_layers=64,
        num_heads=40, num_kv_heads=8, head_dim=128, mlp_dim=27648, **_QWEN25)
_preset("qwen2.5-math-7b", **{**_QWEN25, "rope_theta": 10_000.0,
                              "max_seq_len": 4096},
        vocab_size=152064, dim=3584, num_layers=28, num_heads=28,
        num_kv_heads=4, head_dim=128, mlp_dim=18944)

_preset("llama-3.1-8b", architecture="llama", vocab_size=128256, dim=4096,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        mlp_dim=14336, rope_theta=500_000.0, rope_scaling=RopeScaling(),
        norm_eps=1e-5, max_seq_len=131072)

_QWEN3 = dict(architecture="qwen3", vocab_size=151936, head_dim=128,
              rope_theta=1_000_000.0, norm_eps=1e-6, qk_norm=True,
              max_seq_len=40960)
_preset("qwen3-0.6b", dim=1024, num_layers=28, num_heads=16, num_kv_heads=8,
        mlp_dim=3072, tie_embeddings=True, **_QWEN3)
_preset("qwen3-8b", dim=4096, num_layers=36, num_heads=32, num_kv_heads=8,
        mlp_dim=12288, **_QWEN3)

# Gemma 2 (google/gemma-2-*): local (4096) and global layers alternate, the
# first local; soft-capped attention scores (50) and logits (30).
_GEMMA2 = dict(architecture="gemma2", vocab_size=256000, head_dim=256,
               norm_eps=1e-6, tie_embeddings=True, sliding_window=4096,
               attn_softcap=50.0, final_softcap=30.0, query_scale=256.0,
               max_seq_len=8192)
_gemma2_layers = lambda n: ("sliding_attention", "full_attention") * (n // 2)
_preset("gemma-2-2b", dim=2304, num_layers=26, num_heads=8, num_kv_heads=4,
        mlp_dim=9216, layer_types=_gemma2_layers(26), **_GEMMA2)
_preset("gemma-2-9b", dim=3584, num_layers=42, num_heads=16, num_kv_heads=8,
        mlp_dim=14336, layer_types=_gemma2_layers(42), **_GEMMA2)
_preset("gemma-2-27b", **{**_GEMMA2, "head_dim": 128, "query_scale": 144.0},
        dim=4608, num_layers=46, num_heads=32, num_kv_heads=16,
        mlp_dim=36864, layer_types=_gemma2_layers(46))


def _gemma3_layers(n: int) -> tuple:
  """Five sliding layers, then a full one (transformers' Gemma3 pattern)."""
  return tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
               for i in range(n))


# Gemma 3 text decoders (google/gemma-3-*-pt/it; 4B and up are the text part
# of Gemma3ForConditionalGeneration): q/k-norm, RoPE 1M on global layers
# (linear x8 from 4B) and 10k on local ones.
_GEMMA3 = dict(architecture="gemma3", vocab_size=262144, head_dim=256,
               norm_eps=1e-6, qk_norm=True, tie_embeddings=True,
               sliding_window=512, rope_theta=1_000_000.0,
               rope_local_theta=10_000.0, query_scale=256.0,
               max_seq_len=32768)
_GEMMA3_BIG = dict(_GEMMA3, vocab_size=262208, sliding_window=1024,
                   rope_scaling=RopeScaling(factor=8.0, kind="linear"),
                   max_seq_len=131072)
_preset("gemma-3-270m", dim=640, num_layers=18, num_heads=4, num_kv_heads=1,
        mlp_dim=2048, layer_types=_gemma3_layers(18), **_GEMMA3)
_preset("gemma-3-1b", dim=1152, num_layers=26, num_heads=4, num_kv_heads=1,
        mlp_dim=6912, layer_types=_gemma3_layers(26), **_GEMMA3)
_preset("gemma-3-4b", dim=2560, num_layers=34, num_heads=8, num_kv_heads=4,
        mlp_dim=10240, layer_types=_gemma3_layers(34), **_GEMMA3_BIG)
_preset("gemma-3-12b", dim=3840, num_layers=48, num_heads=16,
        num_kv_heads=8, mlp_dim=15360, layer_types=_gemma3_layers(48),
        **_GEMMA3_BIG)
_preset("gemma-3-27b", **{**_GEMMA3_BIG, "head_dim": 128,
                          "query_scale": 168.0},
        dim=5376, num_layers=62, num_heads=32, num_kv_heads=16,
        mlp_dim=21504, layer_types=_gemma3_layers(62))

# A random Gemma 3 for tests: a window shorter than test rows, 3 layers so
# the 2-layer period leaves one over (sliding, full, sliding).
_preset("tiny-gemma", architecture="gemma3", vocab_size=256, dim=64,
        num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
        norm_eps=1e-6, qk_norm=True, tie_embeddings=True, sliding_window=4,
        layer_types=("sliding_attention", "full_attention",
                     "sliding_attention"),
        rope_theta=1_000_000.0, rope_local_theta=10_000.0, query_scale=8.0,
        max_seq_len=512)
# Its Gemma 2 twin: soft-caps (attention and final) that bind on random
# weights, no q/k-norm, one RoPE base.
_preset("tiny-gemma2", architecture="gemma2", vocab_size=256, dim=64,
        num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
        norm_eps=1e-6, tie_embeddings=True, sliding_window=4,
        layer_types=("sliding_attention", "full_attention",
                     "sliding_attention"),
        rope_theta=10_000.0, attn_softcap=2.0, final_softcap=3.0,
        query_scale=8.0, max_seq_len=512)

# Qwen/Qwen3-30B-A3B and Qwen3-235B-A22B: Qwen3 attention, every layer a
# mixture of 128 experts, 8 chosen (softmax, renormalised).
_QWEN3_MOE = dict(_QWEN3, architecture="qwen3_moe")
_preset("qwen3-30b-a3b", dim=2048, num_layers=48, num_heads=32,
        num_kv_heads=4, mlp_dim=6144, moe=MoeConfig(
            num_experts=128, experts_per_token=8, expert_dim=768,
            norm_topk_prob=True, aux_loss_coef=0.001), **_QWEN3_MOE)
_preset("qwen3-235b-a22b", dim=4096, num_layers=94, num_heads=64,
        num_kv_heads=4, mlp_dim=12288, moe=MoeConfig(
            num_experts=128, experts_per_token=8, expert_dim=1536,
            norm_topk_prob=True, aux_loss_coef=0.001), **_QWEN3_MOE)
# A random Qwen3-MoE for tests: 8 experts, 2 chosen, the first layer dense.
_preset("tiny-moe", architecture="qwen3_moe", vocab_size=256, dim=64,
        num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
        qk_norm=True, norm_eps=1e-6, tie_embeddings=True, max_seq_len=512,
        moe=MoeConfig(num_experts=8, experts_per_token=2, expert_dim=32,
                      norm_topk_prob=True, dense_layers=(0,),
                      aux_loss_coef=0.001))

# A random DeepSeek-V3 for tests: latent attention (R 16 + rope 8: one KV
# head of 24), 8 experts, 2 chosen within 2 of 4 groups (sigmoid + bias),
# one shared, the first layer dense.
_preset("tiny-deepseek", architecture="deepseek_v3", vocab_size=256, dim=64,
        num_layers=3, num_heads=4, num_kv_heads=1, head_dim=24, mlp_dim=128,
        norm_eps=1e-6, tie_embeddings=True, max_seq_len=512,
        moe=MoeConfig(num_experts=8, experts_per_token=2, expert_dim=32,
                      router="sigmoid", norm_topk_prob=True, num_groups=4,
                      topk_groups=2, routed_scaling=2.5,
                      correction_bias=True, shared_dim=32,
                      dense_layers=(0,)),
        mla=MlaConfig(kv_lora_rank=16, nope_dim=8, rope_dim=8, v_head_dim=8,
                      q_lora_rank=24))

# deepseek-ai/DeepSeek-V3 (and R1): latent attention, 256 routed experts
# (8 chosen within 4 of 8 groups, sigmoid + bias) and one shared, the first
# 3 layers dense. Its YaRN rope scaling (x40 past 4096) is not modelled:
# positions up to 4096 are exact (docs/models.md).
_preset("deepseek-v3", architecture="deepseek_v3", vocab_size=129280,
        dim=7168, num_layers=61, num_heads=128, num_kv_heads=1,
        head_dim=576, mlp_dim=18432, norm_eps=1e-6, max_seq_len=4096,
        moe=MoeConfig(num_experts=256, experts_per_token=8, expert_dim=2048,
                      router="sigmoid", norm_topk_prob=True, num_groups=8,
                      topk_groups=4, routed_scaling=2.5,
                      correction_bias=True, shared_dim=2048,
                      dense_layers=(0, 1, 2)),
        mla=MlaConfig(kv_lora_rank=512, nope_dim=128, rope_dim=64,
                      v_head_dim=128, q_lora_rank=1536))
