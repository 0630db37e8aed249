"""The decoder's parameters: their shapes, logical axes and initial values.

Parameters are a plain nested dict of arrays; per-layer weights are stacked
on a leading `layers` axis (an MoE model's expert weights over its sparse
layers only, its dense MLP's over its dense layers: `layer_scan`).
`param_axes(config)` gives each leaf's logical axis names; the sharding
module maps them to mesh axes (MaxText-style).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.models import mla, moe
from grpo_jax.models.config import ModelConfig

Params = dict[str, Any]

# ----------------------------------------------------------------------------
# Parameters and their logical axes.
# ----------------------------------------------------------------------------

def param_shapes(model_config: ModelConfig) -> dict[str, Any]:
  """Shape of every parameter, as the same nested dict `init_params` returns."""
  c = model_config
  L, D, H, K, hd, F = (c.num_layers, c.dim, c.num_heads, c.num_kv_heads,
                       c.head_dim, c.mlp_dim)
  layers = {
      "attn_norm": (L, D),
      "wq": (L, D, H, hd), "wk": (L, D, K, hd), "wv": (L, D, K, hd),
      "wo": (L, H, hd, D),
      "mlp_norm": (L, D),
      "w_gate": (L, D, F), "w_up": (L, D, F), "w_down": (L, F, D),
  }
  if c.qkv_bias:
    layers.update(bq=(L, H, hd), bk=(L, K, hd), bv=(L, K, hd))
  if c.qk_norm:
    layers.update(q_norm=(L, hd), k_norm=(L, hd))
  if c.gemma:
    layers.update(post_attn_norm=(L, D), post_mlp_norm=(L, D))
  if c.mla is not None:   # latent attention instead of wq, wk, wv
    for name in ("wq", "wk", "wv", "wo"):
      del layers[name]
    layers.update(mla.param_shapes(c.mla, L, D, H))
  if c.moe is not None:   # the dense MLP on the dense layers only
    dense = len(c.moe.dense_layers)
    for name in ("w_gate", "w_up", "w_down"):
      layers[name] = (dense,) + layers[name][1:]
      if not dense:
        del layers[name]
    layers.update(moe.param_shapes(c.moe, L - dense, D))
  shapes = {"embed": (c.vocab_size, D), "layers": layers, "final_norm": (D,)}
  if not c.tie_embeddings:
    shapes["lm_head"] = (D, c.vocab_size)
  return shapes


_AXES = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "final_norm": ("norm",),
    "attn_norm": ("layers", "norm"), "mlp_norm": ("layers", "norm"),
    "post_attn_norm": ("layers", "norm"), "post_mlp_norm": ("layers", "norm"),
    "wq": ("layers", "embed", "q_heads", "head_dim"),
    "wk": ("layers", "embed", "kv_heads", "head_dim"),
    "wv": ("layers", "embed", "kv_heads", "head_dim"),
    "wo": ("layers", "q_heads", "head_dim", "embed"),
    "bq": ("layers", "q_heads", "head_dim"),
    "bk": ("layers", "kv_heads", "head_dim"),
    "bv": ("layers", "kv_heads", "head_dim"),
    "q_norm": ("layers", "head_dim"), "k_norm": ("layers", "head_dim"),
    "w_gate": ("layers", "embed", "mlp"), "w_up": ("layers", "embed", "mlp"),
    "w_down": ("layers", "mlp", "embed"),
    **moe.AXES,
    **mla.AXES,
}


# The projections LoRA may adapt (models/lora.py): name -> how many of the
# weight's axes after `layers` are its inputs (contracted with x).
PROJECTION_INPUTS = {"wq": 1, "wk": 1, "wv": 1, "wo": 2,
                     "w_gate": 1, "w_up": 1, "w_down": 1}
LORA_KEY = "lora"          # params["layers"]["lora"][name] = {"a", "b"}
LORA_RANK = "lora_rank"    # the adapters' rank axis (replicated by default)


def param_axes(model_config: ModelConfig) -> dict[str, Any]:
  """Logical axis names of every parameter, as a tree shaped like the params."""
  shapes = param_shapes(model_config)
  layer_axes = {k: _AXES[k] for k in shapes["layers"]}
  return {**{k: _AXES[k] for k in shapes if k != "layers"},
          "layers": layer_axes}


def lora_axes(name: str) -> dict[str, tuple]:
  """Logical axes of the adapters of projection `name`: A (layers, in...,
  rank) and B (layers, rank, out...), split like the weight's own axes."""
  axes, k = _AXES[name], 1 + PROJECTION_INPUTS[name]
  return {"a": axes[:k] + (LORA_RANK,), "b": axes[:1] + (LORA_RANK,) + axes[k:]}


def tree_axes(params: Params) -> Params:
  """`param_axes` of any tree of parameters by leaf path: the base's, the
  adapters' alone (lora.init_adapters) or the two attached."""
  def axes(path, _):
    keys = [getattr(k, "key", k) for k in path]
    if LORA_KEY in keys:
      return lora_axes(keys[-2])[keys[-1]]
    return _AXES[keys[-1]]
  return jax.tree_util.tree_map_with_path(axes, params)


def init_params(model_config: ModelConfig, key: jax.Array,
                dtype=jnp.float32) -> Params:
  """Random parameters (normal, std 0.02; norms at 1) for tests and demos."""
  shapes = param_shapes(model_config)
  flat, treedef = jax.tree_util.tree_flatten_with_path(
      shapes, is_leaf=lambda x: isinstance(x, tuple))
  keys = jax.random.split(key, len(flat))
  leaves = []
  for (path, shape), k in zip(flat, keys):
    name = path[-1].key
    if name.endswith("norm"):
      leaves.append(jnp.ones(shape, dtype))
    else:
      leaves.append(0.02 * jax.random.normal(k, shape, dtype))
  return jax.tree_util.tree_unflatten(treedef, leaves)


def cast(params: Params, dtype: str) -> Params:
  """`params` with every leaf in `dtype` (a compute dtype)."""
  return jax.tree.map(lambda x: x.astype(dtype), params)


def count_params(model_config: ModelConfig) -> int:
  leaves = jax.tree_util.tree_leaves(param_shapes(model_config),
                                     is_leaf=lambda x: isinstance(x, tuple))
  return int(sum(np.prod(s) for s in leaves))


