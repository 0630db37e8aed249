"""Mixture-of-experts checkpoints (`Qwen3MoeForCausalLM`,
`DeepseekV3ForCausalLM` with its latent attention): their
config.json <-> `MoeConfig` and their tensors' names, for `hf.py`.

Checkpoints keep one tensor per expert (`mlp.experts.{x}.gate_proj`, as
transformers' save_pretrained writes them); ours stack the X experts on one
axis after the layers' (`TensorSpec.experts`). The expert leaves stack the
sparse layers only, the dense MLP's the dense layers only (`MoeConfig.
dense_layers`: Qwen3-MoE's `mlp_only_layers` and the layers that
`decoder_sparse_step` skips). Both transformers spellings of the expert
count are read (4.x `num_experts`, 5.x `num_local_experts`).

DeepSeek-V3 lays each head's rope columns out in interleaved pairs
(`rope_interleave`); the loader permutes those columns of the query and
latent projections to the first-half/second-half layout the decoder's
rotary embedding uses (`rope_perm`; queries and keys permuted alike leave
every score unchanged) and the writer permutes them back.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from grpo_jax.models.config import ModelConfig
from grpo_jax.models.layer_scan import DENSE_LEAVES, SPARSE_LEAVES
from grpo_jax.models.moe_config import MlaConfig, MoeConfig

CLASSES = {"Qwen3MoeForCausalLM": "qwen3_moe",
           "DeepseekV3ForCausalLM": "deepseek_v3"}
MODEL_TYPES = {"qwen3_moe": "qwen3_moe", "deepseek_v3": "deepseek_v3"}

_LAYER = "model.layers.{i}."


def moe_from_hf(hf: dict[str, Any],
                unsupported: Callable[[str], Exception]) -> MoeConfig:
  """A Qwen3-MoE config dict's `MoeConfig`."""
  L = hf["num_hidden_layers"]
  X = hf.get("num_experts") or hf.get("num_local_experts")
  if not X:
    raise unsupported("a qwen3_moe config without num_experts")
  step = hf.get("decoder_sparse_step") or 1
  only = set(hf.get("mlp_only_layers") or ())
  dense = tuple(i for i in range(L) if i in only or (i + 1) % step)
  return MoeConfig(
      num_experts=X, experts_per_token=hf["num_experts_per_tok"],
      expert_dim=hf["moe_intermediate_size"],
      norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
      dense_layers=dense,
      aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)))


def moe_to_hf(c: ModelConfig) -> dict[str, Any]:
  """The MoE keys of a Qwen3-MoE config.json (transformers 4.x and 5.x)."""
  moe = c.moe
  return {
      "model_type": "qwen3_moe", "num_experts": moe.num_experts,
      "num_local_experts": moe.num_experts,
      "num_experts_per_tok": moe.experts_per_token,
      "moe_intermediate_size": moe.expert_dim,
      "norm_topk_prob": moe.norm_topk_prob, "decoder_sparse_step": 1,
      "mlp_only_layers": list(moe.dense_layers),
      "router_aux_loss_coef": moe.aux_loss_coef,
      "output_router_logits": False,
  }


def layout(c: ModelConfig) -> dict[str, tuple[str, tuple[int, ...], bool]]:
  """Sparse (and latent attention) leaf name -> (HF name with {i} and {x},
  one tensor's HF shape, transposed)."""
  if c.moe is None:
    return {}
  D, X, F = c.dim, c.moe.num_experts, c.moe.expert_dim
  mlp = _LAYER + "mlp."
  expert = mlp + "experts.{x}."
  out = {
      "router": (mlp + "gate.weight", (X, D), True),
      "router_bias": (mlp + "gate.e_score_correction_bias", (X,), False),
      "expert_gate": (expert + "gate_proj.weight", (F, D), True),
      "expert_up": (expert + "up_proj.weight", (F, D), True),
      "expert_down": (expert + "down_proj.weight", (D, F), True),
  }
  S = c.moe.shared_dim
  for leaf, name, shape in (("shared_gate", "gate_proj", (S, D)),
                            ("shared_up", "up_proj", (S, D)),
                            ("shared_down", "down_proj", (D, S))):
    out[leaf] = (mlp + f"shared_experts.{name}.weight", shape, True)
  return out | _mla_layout(c)


def _mla_layout(c: ModelConfig) -> dict:
  m = c.mla
  if m is None:
    return {}
  D, H, R, A = c.dim, c.num_heads, m.kv_lora_rank, m.q_lora_rank
  qk, attn = m.nope_dim + m.rope_dim, _LAYER + "self_attn."
  return {
      "wq": (attn + "q_proj.weight", (H * qk, D), True),
      "wq_a": (attn + "q_a_proj.weight", (A, D), True),
      "q_a_norm": (attn + "q_a_layernorm.weight", (A,), False),
      "wq_b": (attn + "q_b_proj.weight", (H * qk, A), True),
      "wkv_a": (attn + "kv_a_proj_with_mqa.weight", (R + m.rope_dim, D), True),
      "kv_a_norm": (attn + "kv_a_layernorm.weight", (R,), False),
      "wkv_b": (attn + "kv_b_proj.weight", (H * (m.nope_dim + m.v_head_dim),
                                            R), True),
      "wo": (attn + "o_proj.weight", (D, H * m.v_head_dim), True),
  }


def rope_perm(c: ModelConfig, leaf: str) -> Optional[tuple]:
  """The column order taking DeepSeek's interleaved rope pairs to halves."""
  m = c.mla
  if m is None or leaf not in ("wq", "wq_b", "wkv_a"):
    return None
  start = m.kv_lora_rank if leaf == "wkv_a" else m.nope_dim
  rope = list(range(start, start + m.rope_dim))
  return tuple(range(start)) + tuple(rope[0::2] + rope[1::2])


def deepseek_from_hf(hf: dict[str, Any],
                     unsupported: Callable[[str], Exception]) -> dict:
  """ModelConfig fields (but the rope) of a DeepSeek-V3 config dict."""
  if not hf.get("rope_interleave", True):
    raise unsupported("rope_interleave=false")
  mla = MlaConfig(kv_lora_rank=hf["kv_lora_rank"],
                  nope_dim=hf["qk_nope_head_dim"],
                  rope_dim=hf["qk_rope_head_dim"],
                  v_head_dim=hf["v_head_dim"],
                  q_lora_rank=hf.get("q_lora_rank") or 0)
  F = hf["moe_intermediate_size"]
  moe = MoeConfig(
      num_experts=hf.get("n_routed_experts") or hf["num_local_experts"],
      experts_per_token=hf["num_experts_per_tok"], expert_dim=F,
      router="sigmoid", norm_topk_prob=bool(hf.get("norm_topk_prob")),
      num_groups=hf.get("n_group") or 1, topk_groups=hf.get("topk_group") or 1,
      routed_scaling=float(hf.get("routed_scaling_factor", 1.0)),
      correction_bias=True, shared_dim=F * (hf.get("n_shared_experts") or 0),
      dense_layers=tuple(range(hf.get("first_k_dense_replace") or 0)))
  return dict(
      architecture="deepseek_v3", vocab_size=hf["vocab_size"],
      dim=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
      num_heads=hf["num_attention_heads"], num_kv_heads=1,
      head_dim=mla.cache_dim, mlp_dim=hf["intermediate_size"],
      norm_eps=hf.get("rms_norm_eps", 1e-6),
      max_seq_len=hf.get("max_position_embeddings") or 4096,
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      moe=moe, mla=mla)


def deepseek_to_hf(c: ModelConfig) -> dict[str, Any]:
  """The DeepSeek-V3 keys of config.json (after the common ones)."""
  moe, m = c.moe, c.mla
  if moe.dense_layers != tuple(range(len(moe.dense_layers))):
    raise ValueError("DeepSeek-V3's dense layers must be the first k "
                     f"(first_k_dense_replace), got {moe.dense_layers}")
  return {
      "model_type": "deepseek_v3", "num_key_value_heads": c.num_heads,
      "head_dim": m.rope_dim, "n_routed_experts": moe.num_experts,
      "num_local_experts": moe.num_experts,
      "num_experts_per_tok": moe.experts_per_token,
      "moe_intermediate_size": moe.expert_dim,
      "n_shared_experts": moe.shared_dim // moe.expert_dim,
      "routed_scaling_factor": moe.routed_scaling, "n_group": moe.num_groups,
      "topk_group": moe.topk_groups, "norm_topk_prob": moe.norm_topk_prob,
      "first_k_dense_replace": len(moe.dense_layers),
      "kv_lora_rank": m.kv_lora_rank, "q_lora_rank": m.q_lora_rank or None,
      "qk_nope_head_dim": m.nope_dim, "qk_rope_head_dim": m.rope_dim,
      "v_head_dim": m.v_head_dim, "rope_interleave": True,
  }


def stacking(c: ModelConfig, leaf: str) -> tuple[Optional[tuple], int]:
  """(the HF layers a layer leaf stacks, None: all; experts on axis 1)."""
  if c.moe is None:
    return None, 0
  if leaf in DENSE_LEAVES:
    return c.moe.dense_layers, 0
  if leaf not in SPARSE_LEAVES:
    return None, 0
  sparse = tuple(i for i in range(c.num_layers) if not c.moe.is_dense(i))
  return sparse, (c.moe.num_experts if leaf.startswith("expert_") else 0)
