"""The sparse MLP of a mixture-of-experts layer: router, dispatch, experts.

Shapes as in `transformer` plus X experts and C experts chosen per token;
the layer's N*Q tokens are flattened to rows n (their count N here).

Route (float32, whatever the weights' dtype): `route` gives each token's C
experts and their gates by the family's rule (`MoeConfig`). Dispatch: the
N*C (token, expert) pairs are sorted by expert and the three expert
matmuls run as grouped matmuls over the sorted rows (`jax.lax.ragged_dot`:
each expert multiplies only its own rows, no expert's weights are gathered
per token). There is no capacity: every pair is computed, no token is ever
dropped (RL must not change the policy's distribution by dropping), so a
token's output depends on that token alone, never on the batch's others.
The pairs' outputs are unsorted and summed with their gates; shared
experts (DeepSeek-V3) are a dense SwiGLU every token passes through.
That is the default dispatch; `expert_parallel.ExpertParallel` is the
other (`model.moe.dispatch = "all_to_all"`): tokens sent by all-to-all to
the chips holding their experts, the same sums.

Routing replay: given `experts_nc` (the sampler's recorded choice), the
same gates are recomputed from the current router at those experts, so
the router still learns (`route(..., experts_nc=)`).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from grpo_jax.models.moe_config import MoeConfig

Params = dict[str, Any]


def param_shapes(moe: MoeConfig, num_layers: int, dim: int) -> dict:
  """The sparse layers' leaves, stacked over their `num_layers` layers."""
  L, D, X, F = num_layers, dim, moe.num_experts, moe.expert_dim
  shapes = {"router": (L, D, X), "expert_gate": (L, X, D, F),
            "expert_up": (L, X, D, F), "expert_down": (L, X, F, D)}
  if moe.correction_bias:
    shapes["router_bias"] = (L, X)
  if moe.shared_dim:
    S = moe.shared_dim
    shapes.update(shared_gate=(L, D, S), shared_up=(L, D, S),
                  shared_down=(L, S, D))
  return shapes


AXES = {
    "router": ("layers", "embed", None),
    "router_bias": ("layers", None),
    "expert_gate": ("layers", "experts", "embed", "expert_mlp"),
    "expert_up": ("layers", "experts", "embed", "expert_mlp"),
    "expert_down": ("layers", "experts", "expert_mlp", "embed"),
    "shared_gate": ("layers", "embed", "mlp"),
    "shared_up": ("layers", "embed", "mlp"),
    "shared_down": ("layers", "mlp", "embed"),
}


class Routing(NamedTuple):
  """Each token's experts and gates, and what the balancing loss and the
  replay metrics read: `experts_nc` are the ones used (replayed when
  given), `chosen_nc` the router's own choice."""
  experts_nc: jax.Array     # int32
  gates_nc: jax.Array       # float32
  probs_nx: jax.Array       # float32: softmax probs / normalised scores
  chosen_nc: Optional[jax.Array] = None   # int32: this router's top C


def routes_dtype(num_experts: int):
  """The smallest integer type holding an expert index: what recorded
  routes are stored in (uint8 up to 256 experts)."""
  return jnp.uint8 if num_experts <= 256 else jnp.int16


def differ_n(routes_nc: jax.Array, other_nc: jax.Array) -> jax.Array:
  """Per token: whether two choices are different expert sets (the order
  within a token ignored)."""
  return jnp.any(jnp.sort(routes_nc, -1) != jnp.sort(other_nc, -1), -1)


def _choose_grouped(moe: MoeConfig, choice_nx: jax.Array) -> jax.Array:
  """DeepSeek-V3's group-limited choice: the C best of `choice_nx` within
  the topk_groups groups whose two best experts sum highest."""
  N, X = choice_nx.shape
  G = moe.num_groups
  if G > 1:
    grouped = choice_nx.reshape(N, G, X // G)
    group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)
    _, best_groups = jax.lax.top_k(group_score, moe.topk_groups)
    keep = jnp.zeros((N, G), bool).at[
        jnp.arange(N)[:, None], best_groups].set(True)
    keep_nx = jnp.repeat(keep, X // G, axis=1)
    choice_nx = jnp.where(keep_nx, choice_nx, -jnp.inf)
  return jax.lax.top_k(choice_nx, moe.experts_per_token)[1]


def route(moe: MoeConfig, lp: Params, h_nd: jax.Array,
          experts_nc: Optional[jax.Array] = None) -> Routing:
  """The router on tokens (N, D): chosen experts (the top C, or the given
  `experts_nc`: routing replay) and their gates, in float32."""
  logits_nx = jnp.einsum("nd,dx->nx", h_nd.astype(jnp.float32),
                         lp["router"].astype(jnp.float32))
  if moe.router == "softmax":      # Qwen3-MoE
    score_nx = jax.nn.softmax(logits_nx, axis=-1)
    choice_nx, probs_nx = score_nx, score_nx
  else:                            # DeepSeek-V3
    score_nx = jax.nn.sigmoid(logits_nx)
    choice_nx = score_nx
    if moe.correction_bias:
      choice_nx = score_nx + lp["router_bias"].astype(jnp.float32)
    probs_nx = score_nx / score_nx.sum(-1, keepdims=True)
  chosen_nc = _choose_grouped(moe, choice_nx).astype(jnp.int32)
  experts_nc = chosen_nc if experts_nc is None else experts_nc.astype(
      jnp.int32)
  gates_nc = jnp.take_along_axis(score_nx, experts_nc, axis=-1)
  if moe.norm_topk_prob:
    eps = 1e-20 if moe.router == "sigmoid" else 0.0
    gates_nc = gates_nc / (gates_nc.sum(-1, keepdims=True) + eps)
  gates_nc = gates_nc * moe.routed_scaling
  return Routing(experts_nc, gates_nc, probs_nx, chosen_nc)


def grouped_swiglu(x_nd: jax.Array, rows_r: jax.Array, experts_r: jax.Array,
                   w_gate, w_up, w_down) -> jax.Array:
  """SwiGLU_e(x_nd[rows_r[r]]) at expert e = experts_r[r], for each r: (R,
  D), in r's order. The R rows sorted by expert, each expert's rows one
  group of the grouped matmuls (`jax.lax.ragged_dot`); an expert id past
  the weights' experts (an all-to-all buffer's empty row) gives 0."""
  order = jnp.argsort(experts_r, stable=True)
  sizes = jnp.bincount(experts_r, length=w_gate.shape[0]).astype(jnp.int32)
  x_sorted = x_nd[rows_r[order]]
  dot = lambda a, w: jax.lax.ragged_dot(a, w.astype(a.dtype), sizes)
  act_sorted = jax.nn.silu(dot(x_sorted, w_gate)) * dot(x_sorted, w_up)
  y_sorted = dot(act_sorted, w_down)
  return jnp.zeros_like(y_sorted).at[order].set(y_sorted)


def experts(lp: Params, h_nd: jax.Array, routing: Routing) -> jax.Array:
  """Sum over each token's C experts of gate * SwiGLU_expert(h): (N, D),
  the N*C (token, expert) pairs through `grouped_swiglu`."""
  N, C = routing.experts_nc.shape
  y_ncd = grouped_swiglu(
      h_nd, jnp.arange(N * C) // C, routing.experts_nc.reshape(-1),
      lp["expert_gate"], lp["expert_up"], lp["expert_down"]).reshape(N, C, -1)
  gates = routing.gates_nc.astype(h_nd.dtype)
  return jnp.einsum("ncd,nc->nd", y_ncd, gates)


def shared(lp: Params, h_nd: jax.Array) -> jax.Array:
  """The shared experts: one dense SwiGLU every token goes through."""
  w = lambda name: lp[name].astype(h_nd.dtype)
  gate = jnp.einsum("nd,df->nf", h_nd, w("shared_gate"))
  up = jnp.einsum("nd,df->nf", h_nd, w("shared_up"))
  return jnp.einsum("nf,fd->nd", jax.nn.silu(gate) * up, w("shared_down"))


def sparse_mlp(moe: MoeConfig, lp: Params, h_nqd: jax.Array,
               experts_nqc: Optional[jax.Array] = None,
               dispatch: Optional[Callable] = None) -> tuple:
  """The MoE MLP of normed input (N, Q, D): its output (N, Q, D) and the
  `Routing` of its N*Q tokens (replayed at `experts_nqc` when given).
  dispatch: None, `experts`; else a (lp, h_nd, routing) -> (out_nd,
  dropped) dispatch (`expert_parallel.ExpertParallel`, no drops at its
  default capacity)."""
  N, Q, D = h_nqd.shape
  h_nd = h_nqd.reshape(N * Q, D)
  replay = None if experts_nqc is None else experts_nqc.reshape(N * Q, -1)
  routing = route(moe, lp, h_nd, replay)
  out_nd = (experts(lp, h_nd, routing) if dispatch is None
            else dispatch(lp, h_nd, routing)[0])
  if moe.shared_dim:
    out_nd = out_nd + shared(lp, h_nd)
  return out_nd.reshape(N, Q, D), routing


def balance_terms(moe: MoeConfig, routing: Routing,
                  valid_n: jax.Array) -> tuple:
  """One layer's sums for the load-balancing loss over valid tokens:
  (assignments per expert (X,), router probability per expert (X,),
  token count), summed over layers before `balance_loss`."""
  w_n = valid_n.astype(jnp.float32)
  counts_x = jnp.zeros(moe.num_experts, jnp.float32).at[
      routing.experts_nc].add(jnp.broadcast_to(
          w_n[:, None], routing.experts_nc.shape))
  return counts_x, (routing.probs_nx * w_n[:, None]).sum(0), w_n.sum()


class Stats(NamedTuple):
  """What a pass over the sparse layers sums for the balancing loss and the
  replay metric (over valid tokens, every sparse layer): `balance_terms`'
  three sums and `differ`, the (token, layer) pairs whose router would
  have chosen other experts than the ones used (0 without replay)."""
  counts_x: jax.Array
  probs_x: jax.Array
  tokens: jax.Array
  differ: jax.Array

  @classmethod
  def zeros(cls, moe: MoeConfig) -> "Stats":
    zero_x = jnp.zeros(moe.num_experts, jnp.float32)
    return cls(zero_x, zero_x, jnp.float32(0), jnp.float32(0))

  def __add__(self, other: "Stats") -> "Stats":
    return Stats(*(a + b for a, b in zip(self, other)))


def layer_stats(moe: MoeConfig, routing: Routing, valid_n: jax.Array
                ) -> Stats:
  """One sparse layer's `Stats` over its valid tokens."""
  differ = differ_n(routing.experts_nc, routing.chosen_nc)
  return Stats(*balance_terms(moe, routing, valid_n),
               (differ & valid_n).sum().astype(jnp.float32))


def balance_loss(moe: MoeConfig, counts_x: jax.Array, probs_x: jax.Array,
                 tokens: jax.Array) -> jax.Array:
  """Switch Transformer eq. 4-6 as transformers' `load_balancing_loss_func`
  (Qwen3-MoE): X * sum_x f_x * P_x, f_x the mean assignments to expert x
  per token, P_x its mean router probability (sums over layers and tokens,
  divided once). Uniform routing gives C."""
  tokens = jnp.maximum(tokens, 1.0)
  return moe.num_experts * jnp.sum((counts_x / tokens) * (probs_x / tokens))


def loss_terms(moe: MoeConfig, stats: Stats, coef: float, num_micro: int
               ) -> tuple:
  """The update's MoE terms for one of `num_micro` micro-batches: coef
  times its balancing loss (over its tokens and sparse layers) / num_micro,
  so the batch's is the micro-batches' mean; and metrics summed the same
  way: moe/aux_loss (unweighted) and moe/routes_differ, the fraction of
  (token, sparse layer) pairs whose router would choose other experts than
  the replayed ones (0 without replay)."""
  balance = balance_loss(moe, stats.counts_x, stats.probs_x,
                         stats.tokens) / num_micro
  differ = stats.differ / jnp.maximum(stats.tokens, 1.0) / num_micro
  return coef * balance, {"moe/aux_loss": balance,
                          "moe/routes_differ": differ}
