"""The mixture-of-experts settings of a decoder (`ModelConfig.moe`).

Two routers cover the families (docs/models.md):
- "softmax" (Qwen3-MoE): softmax over the X experts' logits, the top C,
  renormalised to sum to one when `norm_topk_prob`.
- "sigmoid" (DeepSeek-V3): sigmoid scores; the experts are chosen on the
  scores plus a per-expert correction bias (auxiliary-loss-free balancing),
  within the `topk_groups` best of `num_groups` expert groups (a group's
  score: the sum of its two best); the gates are the chosen experts' plain
  scores, renormalised when `norm_topk_prob`, times `routed_scaling`.
Layers in `dense_layers` have a dense MLP of `ModelConfig.mlp_dim` instead
(Qwen3-MoE's `mlp_only_layers`, DeepSeek-V3's `first_k_dense_replace`).
"""
from __future__ import annotations

import dataclasses

ROUTERS = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class MoeConfig:
  """A sparse MLP of X experts, C chosen per token; frozen (hashable)."""
  num_experts: int              # X
  experts_per_token: int        # C
  expert_dim: int               # one expert's SwiGLU width
  router: str = "softmax"
  norm_topk_prob: bool = False
  num_groups: int = 1           # DeepSeek-V3 n_group
  topk_groups: int = 1          # DeepSeek-V3 topk_group
  routed_scaling: float = 1.0   # gates times this (DeepSeek-V3: 2.5)
  correction_bias: bool = False  # DeepSeek-V3 e_score_correction_bias
  shared_dim: int = 0           # shared experts' total width; 0: none
  dense_layers: tuple = ()      # layer indices with a dense MLP
  aux_loss_coef: float = 0.0    # the checkpoint's load-balancing coefficient

  def __post_init__(self):
    if not isinstance(self.dense_layers, tuple):
      object.__setattr__(self, "dense_layers",
                         tuple(sorted(int(i) for i in self.dense_layers)))
    if self.router not in ROUTERS:
      raise ValueError(f"MoeConfig.router={self.router!r}; allowed: "
                       f"{ROUTERS}")
    for name in ("num_experts", "experts_per_token", "expert_dim",
                 "num_groups", "topk_groups"):
      if getattr(self, name) <= 0:
        raise ValueError(f"MoeConfig.{name} must be > 0, got "
                         f"{getattr(self, name)}")
    if self.experts_per_token > self.num_experts:
      raise ValueError(f"MoeConfig.experts_per_token="
                       f"{self.experts_per_token} > num_experts="
                       f"{self.num_experts}")
    self._check_groups()

  def _check_groups(self):
    X, G = self.num_experts, self.num_groups
    if X % G or (G > 1 and X // G < 2):
      raise ValueError(f"MoeConfig.num_groups={G} must split num_experts="
                       f"{X} into groups of at least 2 experts")
    if self.topk_groups > G:
      raise ValueError(f"MoeConfig.topk_groups={self.topk_groups} > "
                       f"num_groups={G}")
    if self.topk_groups * (X // G) < self.experts_per_token:
      raise ValueError(f"MoeConfig.topk_groups={self.topk_groups} groups of "
                       f"{X // G} experts hold fewer than experts_per_token="
                       f"{self.experts_per_token}")

  def is_dense(self, layer: int) -> bool:
    return layer in self.dense_layers


@dataclasses.dataclass(frozen=True)
class MlaConfig:
  """DeepSeek's multi-head latent attention (`ModelConfig.mla`, models/mla.py).

  Keys and values come from one latent of `kv_lora_rank` per token (plus a
  rope part of `rope_dim` shared by the heads): the cache holds those
  R + rope_dim numbers per token. The decoder runs MLA as multi-query
  attention over that latent (the key up-projection absorbed into the
  queries), so the `ModelConfig` of an MLA model has num_kv_heads=1 and
  head_dim = kv_lora_rank + rope_dim.
  """
  kv_lora_rank: int             # R
  nope_dim: int                 # qk_nope_head_dim
  rope_dim: int                 # qk_rope_head_dim
  v_head_dim: int
  q_lora_rank: int = 0          # 0: a plain query projection

  def __post_init__(self):
    for name in ("kv_lora_rank", "nope_dim", "rope_dim", "v_head_dim"):
      if getattr(self, name) <= 0:
        raise ValueError(f"MlaConfig.{name} must be > 0, got "
                         f"{getattr(self, name)}")
    if self.rope_dim % 2 or self.q_lora_rank < 0:
      raise ValueError(f"MlaConfig.rope_dim={self.rope_dim} must be even "
                       f"and q_lora_rank={self.q_lora_rank} >= 0")

  @property
  def cache_dim(self) -> int:
    return self.kv_lora_rank + self.rope_dim
