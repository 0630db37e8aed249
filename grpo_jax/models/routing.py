"""Routing replay at the model level: a full-sequence pass that records
each sparse layer's chosen experts, or replays given ones.

`forward_routed(..., routes=None)` returns the logits and the routes it
took, (L_sparse, N, S, C) int32 (L_sparse: the layers with experts). Given
`routes`, every sparse layer uses those experts and recomputes their gates
from the current router (`moe.route(..., experts_nc=)`), so the router
still gets gradients. The trainer's passes replay through the same
`lp["routes"]` leaf (`transformer.hidden_states_routed`; the loop's
`model.moe.routing_replay = "rollout"`, docs/models.md).
"""
from __future__ import annotations

from typing import Optional

import jax

from grpo_jax.models import layer_scan, moe, transformer
from grpo_jax.models.config import ModelConfig


def forward_routed(model_config: ModelConfig, params: transformer.Params,
                   tokens_ns: jax.Array, routes: Optional[jax.Array] = None
                   ) -> tuple:
  """Causal float32 logits (N, S, V) and the routes (L_sparse, N, S, C),
  replayed from `routes` when given."""
  N, S = tokens_ns.shape
  positions_ns, valid_ns = transformer.default_positions_and_valid(
      tokens_ns, None, None)
  attend = layer_scan.attends_per_layer(model_config, "auto", positions_ns,
                                        positions_ns, valid_ns)

  def layer(layer_config, x, lp):
    q, k, v = transformer.qkv(layer_config, lp, x, positions_ns)
    x, routing = transformer.attn_out_and_routed_mlp(
        layer_config, lp, x, attend[layer_config](q, k, v))
    return x, (None if routing is None
               else routing.experts_nc.reshape(N, S, -1))

  xs = dict(params["layers"])
  if routes is not None:
    xs["routes"] = routes
  x = transformer.embed(params, tokens_ns, model_config)
  x, routes_taken = layer_scan.scan_layers(model_config, layer, x, xs)
  h = transformer.rms_norm(x, params["final_norm"], model_config.norm_eps)
  return transformer.unembed(model_config, params, h), routes_taken


def routes_differ(routes_a: jax.Array, routes_b: jax.Array) -> jax.Array:
  """Per token and sparse layer (L_sparse, N, S): whether two routings
  chose different expert sets (order within a token ignored)."""
  return moe.differ_n(routes_a, routes_b)
