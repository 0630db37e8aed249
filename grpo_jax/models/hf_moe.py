"""Mixture-of-experts checkpoints (`Qwen3MoeForCausalLM`): their
config.json <-> `MoeConfig` and their tensors' names, for `hf.py`.

Checkpoints keep one tensor per expert (`mlp.experts.{x}.gate_proj`, as
transformers' save_pretrained writes them); ours stack the X experts on one
axis after the layers' (`TensorSpec.experts`). The expert leaves stack the
sparse layers only, the dense MLP's the dense layers only (`MoeConfig.
dense_layers`: Qwen3-MoE's `mlp_only_layers` and the layers that
`decoder_sparse_step` skips). Both transformers spellings of the expert
count are read (4.x `num_experts`, 5.x `num_local_experts`).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from grpo_jax.models.config import ModelConfig
from grpo_jax.models.layer_scan import DENSE_LEAVES, SPARSE_LEAVES
from grpo_jax.models.moe_config import MoeConfig

CLASSES = {"Qwen3MoeForCausalLM": "qwen3_moe"}
MODEL_TYPES = {"qwen3_moe": "qwen3_moe"}

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
  """Sparse leaf name -> (HF name with {i} and {x}, one tensor's HF shape,
  transposed)."""
  if c.moe is None:
    return {}
  D, X, F = c.dim, c.moe.num_experts, c.moe.expert_dim
  mlp = _LAYER + "mlp."
  expert = mlp + "experts.{x}."
  return {
      "router": (mlp + "gate.weight", (X, D), True),
      "expert_gate": (expert + "gate_proj.weight", (F, D), True),
      "expert_up": (expert + "up_proj.weight", (F, D), True),
      "expert_down": (expert + "down_proj.weight", (D, F), True),
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
