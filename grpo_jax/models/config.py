"""The decoder configuration and the named presets.

One family covers Llama 2/3/3.1, Mistral, SmolLM2 (Llama architecture),
Qwen2/2.5 (q/k/v bias) and Qwen3 (q/k RMSNorm): pre-norm RMSNorm blocks,
rotary embeddings, grouped-query attention and a SwiGLU MLP.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from grpo_jax.registry import lookup, names, register

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 frequency-dependent RoPE scaling (`rope_type: llama3`)."""
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


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

  def __post_init__(self):
    if self.architecture not in ARCHITECTURES:
      raise ValueError(f"ModelConfig.architecture={self.architecture!r}; "
                       f"allowed: {ARCHITECTURES}")
    for field in ("vocab_size", "dim", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "mlp_dim"):
      if getattr(self, field) <= 0:
        raise ValueError(f"ModelConfig.{field} must be > 0, "
                         f"got {getattr(self, field)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"ModelConfig.num_heads={self.num_heads} is not a "
                       f"multiple of num_kv_heads={self.num_kv_heads}")

  def replace(self, **kwargs) -> "ModelConfig":
    return dataclasses.replace(self, **kwargs)


def _preset(name: str, **kwargs) -> ModelConfig:
  config = ModelConfig(**kwargs)
  register("model", name)(config)
  return config


def get_preset(name: str) -> ModelConfig:
  """The ModelConfig registered under `name`; unknown names list the presets."""
  return lookup("model", name)


def preset_names() -> list[str]:
  return names("model")


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
