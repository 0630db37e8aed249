"""The decoder as pure functions over a parameter pytree.

Parameters are a plain nested dict of arrays. Per-layer weights are stacked
on a leading `layers` axis so the forward pass is one `lax.scan`
(`layer_scan`: fast to compile at any depth, remat per layer).
`param_axes(config)` gives each leaf's logical axis names; the sharding
module maps them to mesh axes (MaxText-style).

Shapes use the letters of `grpo_jax` (upper case for a size): N rows, S a
row's columns (the keys; the KV cache's length when decoding), Q query
columns (the last Q of the S), D model width, H query heads, K KV heads,
E head width (`head_dim`), V vocab, L layers; F is the MLP width and, in the
einsums, r = H // K query heads per KV head.

Cached decoding builds on the layer functions here (`qkv`,
`attn_out_and_mlp`): `decode`, `ragged`, `paged`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.models import blockwise, layer_scan, mla, moe, quant
from grpo_jax.models.attention import apply_rope, rope_frequencies, soft_cap
from grpo_jax.models.config import ModelConfig
from grpo_jax.models.params import _AXES as _AXES  # re-exported
from grpo_jax.models.params import LORA_KEY as LORA_KEY
from grpo_jax.models.params import LORA_RANK as LORA_RANK
from grpo_jax.models.params import PROJECTION_INPUTS as PROJECTION_INPUTS
from grpo_jax.models.params import cast as cast
from grpo_jax.models.params import count_params as count_params
from grpo_jax.models.params import init_params as init_params
from grpo_jax.models.params import lora_axes as lora_axes
from grpo_jax.models.params import param_axes as param_axes
from grpo_jax.models.params import param_shapes as param_shapes
from grpo_jax.models.params import tree_axes as tree_axes

Params = dict[str, Any]
# (array, logical axes) -> the array pinned to the sharding those axes get
# (`sharding.Layout.constrain` inside jit); the model only names the axes.
Constrain = Callable[[jax.Array, tuple], jax.Array]
SEGMENT_MEMBERS = blockwise.SEGMENT_MEMBERS


# ----------------------------------------------------------------------------
# Building blocks.
# ----------------------------------------------------------------------------

def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """RMSNorm in float32, cast back to the input dtype before the scale (as HF)."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight * x32.astype(x.dtype)


# Logical axes of the activations a layer pins when given a `Constrain`:
# rows split like a batch, features like the weight that makes them. Without
# these, GSPMD may keep an FSDP weight split over its `embed` axis and gather
# the rows instead: every chip then computes the whole micro-batch.
# The residual stream between layers (what remat keeps per layer) may also
# split its columns ("length": config.mesh.sequence_parallel).
RESIDUAL_AXES = ("batch", "length", None)              # (N, Q, D)
Q_AXES = ("batch", None, "q_heads", None)              # (N, Q, H, E)
KV_AXES = ("batch", None, "kv_heads", None)            # (N, Q, K, E)
MLP_AXES = ("batch", None, "mlp")                      # (N, Q, F)


def no_constraint(x: jax.Array, logical_axes: tuple) -> jax.Array:
  del logical_axes
  return x


def _project(equation: str, x: jax.Array, lp: Params, name: str) -> jax.Array:
  """x·W for the weight `name` of layer params `lp`, plus the LoRA term
  (x·A)·B where adapters are attached (lora.attach; α/r is folded into A);
  an int8 W (the sampler's, `quant`) runs as an int8 matmul.
  equation: the base einsum, e.g. "nqd,dhe->nqhe"."""
  y = quant.einsum(equation, x, lp[name])
  adapter = lp.get(LORA_KEY, {}).get(name)
  if adapter is None:
    return y
  x_sub, rest = equation.split(",")
  w_sub, out_sub = rest.split("->")
  inputs = [c for c in w_sub if c in x_sub]
  kept = "".join(c for c in x_sub if c not in inputs)
  xa = jnp.einsum(f"{x_sub},{''.join(inputs)}z->{kept}z", x,
                  adapter["a"].astype(x.dtype))
  outputs = "".join(c for c in w_sub if c not in inputs)
  return y + jnp.einsum(f"{kept}z,z{outputs}->{out_sub}", xa,
                        adapter["b"].astype(x.dtype))


def qkv(model_config: ModelConfig, lp: Params, x_nqd: jax.Array,
         positions_nq: jax.Array, constrain: Constrain = no_constraint):
  """Projects the normed input to rotated q (N,Q,H,E), k and v (N,K,Q,E)."""
  h = rms_norm(x_nqd, lp["attn_norm"], model_config.norm_eps)
  if model_config.mla is not None:   # latent attention as one KV head
    return mla.qkv(model_config.mla, lp, h, positions_nq,
                   model_config.rope_theta, model_config.norm_eps, rms_norm)
  q = constrain(_project("nqd,dhe->nqhe", h, lp, "wq"), Q_AXES)
  k = constrain(_project("nqd,dhe->nqhe", h, lp, "wk"), KV_AXES)
  v = constrain(_project("nqd,dhe->nqhe", h, lp, "wv"), KV_AXES)
  if model_config.qkv_bias:
    q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
  if model_config.qk_norm:
    q = rms_norm(q, lp["q_norm"], model_config.norm_eps)
    k = rms_norm(k, lp["k_norm"], model_config.norm_eps)
  if model_config.query_scale is not None:  # scores / sqrt(query_scale)
    q = q * jnp.asarray(np.sqrt(model_config.head_dim
                                / model_config.query_scale), q.dtype)
  inv_freq = rope_frequencies(model_config)
  k = apply_rope(k, positions_nq, inv_freq)
  heads_first = lambda x: jnp.swapaxes(x, 1, 2)
  return apply_rope(q, positions_nq, inv_freq), heads_first(k), heads_first(v)


def _out_projection(attn_nqhe: jax.Array, lp: Params) -> jax.Array:
  """attn · wo summed over heads and head width, as one (H*E, D) matmul;
  wo (H, E, D) and its LoRA A flattened in place (free). The einsum
  "nqhe,hed->nqd" let XLA:CPU copy wo inside every decode step
  (docs/paged.md)."""
  N, Q, H, E = attn_nqhe.shape
  flat = lambda w: w.reshape((H * E,) + w.shape[2:])
  lp_flat = {"wo": flat(lp["wo"])}
  adapter = lp.get(LORA_KEY, {}).get("wo")
  if adapter is not None:
    lp_flat[LORA_KEY] = {"wo": {"a": flat(adapter["a"]), "b": adapter["b"]}}
  return _project("nqf,fd->nqd", attn_nqhe.reshape(N, Q, H * E), lp_flat,
                  "wo")


def attn_out_and_mlp(model_config: ModelConfig, lp: Params, x_nqd: jax.Array,
                      attn_nqhe: jax.Array,
                      constrain: Constrain = no_constraint) -> jax.Array:
  return attn_out_and_routed_mlp(model_config, lp, x_nqd, attn_nqhe,
                                 constrain)[0]


def attn_out_and_routed_mlp(model_config: ModelConfig, lp: Params,
                            x_nqd: jax.Array, attn_nqhe: jax.Array,
                            constrain: Constrain = no_constraint,
                            dispatch: Optional[Callable] = None) -> tuple:
  """The layer after attention: (x, the sparse MLP's `moe.Routing`, None
  for a dense MLP). A sparse layer replays `lp["routes"]` (N, Q, C) when
  given (routing replay) and dispatches its tokens with `dispatch`
  (`moe.sparse_mlp`; None: `moe.experts`)."""
  c = model_config
  post_norm = lambda y, name: (rms_norm(y, lp[name], c.norm_eps) if c.gemma
                               else y)   # Gemma: outputs normed, then added
  if c.mla is not None:
    attn_nqhe = mla.values(c.mla, lp, attn_nqhe)
  x = constrain(x_nqd + post_norm(_out_projection(attn_nqhe, lp),
                                  "post_attn_norm"), RESIDUAL_AXES)
  h = rms_norm(x, lp["mlp_norm"], c.norm_eps)
  if c.moe is not None:
    mlp, routing = moe.sparse_mlp(c.moe, lp, h, lp.get("routes"), dispatch)
    return constrain(x + mlp, RESIDUAL_AXES), routing
  gate = constrain(_project("nqd,df->nqf", h, lp, "w_gate"), MLP_AXES)
  up = constrain(_project("nqd,df->nqf", h, lp, "w_up"), MLP_AXES)
  act = jax.nn.gelu(gate, approximate=True) if c.gemma else jax.nn.silu(gate)
  mlp = _project("nqf,fd->nqd", act * up, lp, "w_down")
  return constrain(x + post_norm(mlp, "post_mlp_norm"), RESIDUAL_AXES), None


def embed(params: Params, tokens_ns: jax.Array,
          model_config: Optional[ModelConfig] = None) -> jax.Array:
  """Token embeddings (N, S, D); Gemma's times sqrt(D) in their dtype."""
  x = quant.take_rows(params["embed"], tokens_ns)
  if model_config is None or not model_config.gemma:
    return x
  return x * jnp.asarray(np.sqrt(model_config.dim), x.dtype)


def unembed(model_config: ModelConfig, params: Params,
            h_nsd: jax.Array) -> jax.Array:
  """Final norm output (N, S, D) -> float32 logits (N, S, V), soft-capped
  where the model says (Gemma 2)."""
  w = params["embed"].T if model_config.tie_embeddings else params["lm_head"]
  return soft_cap(quant.head_logits(h_nsd, w), model_config.final_softcap)


# ----------------------------------------------------------------------------
# Full-sequence forward (training, scoring, prefill).
# ----------------------------------------------------------------------------

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def default_positions_and_valid(tokens_ns: jax.Array,
                                positions_ns: Optional[jax.Array],
                                valid_ns: Optional[jax.Array]):
  """Positions 0..S-1 and every token valid, where not given."""
  if positions_ns is None:
    positions_ns = jnp.broadcast_to(
        jnp.arange(tokens_ns.shape[1], dtype=jnp.int32), tokens_ns.shape)
  if valid_ns is None:
    valid_ns = jnp.ones(tokens_ns.shape, bool)
  return positions_ns, valid_ns


@dataclasses.dataclass(frozen=True)
class ForwardSettings:
  """How a full-sequence pass runs (the values are the same whatever they
  are): remat, one of REMAT_POLICIES; attention, one of ATTENTION
  (`attend_fn`); constrain pins the activations' shardings
  (`RESIDUAL_AXES` ..., `sharding.Layout.constrain`), None leaves them to
  the compiler; dispatch: an MoE layer's token dispatch (`moe.sparse_mlp`;
  None: `moe.experts`; `sharding.Layout.expert_dispatch`)."""
  remat: str = "none"
  attention: str = "auto"
  constrain: Optional[Constrain] = None
  dispatch: Optional[Callable] = None

  def __post_init__(self):
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat={self.remat!r}; allowed: "
                       f"{sorted(REMAT_POLICIES)}")


class Rows(NamedTuple):
  """Token rows (N, S) with their rotary positions and which tokens are
  real (the only keys attended to)."""
  tokens_ns: jax.Array      # int32
  positions_ns: jax.Array   # int32
  valid_ns: jax.Array       # bool


class Routed(NamedTuple):
  """What a full-sequence pass of an MoE model gives besides its states:
  `moe.Stats` summed over its sparse layers and valid tokens, and (when
  asked) the experts each sparse layer used, (L_sparse, N, S, C) int32."""
  stats: moe.Stats
  routes_lnsc: Optional[jax.Array] = None


def _decoder(model_config: ModelConfig, params: Params, rows: Rows,
             segment_ns: Optional[jax.Array], settings: ForwardSettings,
             return_kv: bool, routes_lnsc: Optional[jax.Array] = None,
             return_routes: bool = False):
  """The layers' scan over `rows`: final-normed hidden states (N, S, D),
  (return_kv) every layer's k, v, each (L, N, K, S, E), and for an MoE
  model its `Routed` (None otherwise). routes_lnsc: replay these experts
  (routing replay); return_routes: record the experts used."""
  constrain = settings.constrain or no_constraint
  attend = layer_scan.attends_per_layer(model_config, settings.attention,
                             rows.positions_ns, rows.positions_ns,
                             rows.valid_ns, segment_ns, segment_ns)
  sparse = model_config.moe
  N, S = rows.tokens_ns.shape
  valid_n = rows.valid_ns.reshape(-1)

  def layer(layer_config, carry, lp):
    x, stats = carry if sparse else (carry, None)
    q, k, v = qkv(layer_config, lp, x, rows.positions_ns, constrain)
    x, routing = attn_out_and_routed_mlp(
        layer_config, lp, x, attend[layer_config](q, k, v), constrain,
        settings.dispatch)
    ys = ((k, v) if return_kv else None, None)
    if routing is not None:
      stats = stats + moe.layer_stats(sparse, routing, valid_n)
    if return_routes:      # (N, S, C); zeros in a dense layer, dropped below
      ys = (ys[0], jnp.zeros((N, S, sparse.experts_per_token), jnp.int32)
            if routing is None else routing.experts_nc.reshape(N, S, -1))
    return (x, stats) if sparse else x, ys

  xs = params["layers"]
  if routes_lnsc is not None:
    xs = dict(xs, routes=routes_lnsc)
  x = constrain(embed(params, rows.tokens_ns, model_config), RESIDUAL_AXES)
  carry = (x, moe.Stats.zeros(sparse)) if sparse else x
  carry, (kv, taken) = layer_scan.scan_layers(
      model_config, layer, carry, xs,
      layer_scan.remat(REMAT_POLICIES[settings.remat]))
  x, stats = carry if sparse else (carry, None)
  h = rms_norm(x, params["final_norm"], model_config.norm_eps)
  if not sparse:
    return h, kv, None
  if taken is not None:
    taken = taken[np.asarray(model_config.sparse_layers())]
  return h, kv, Routed(stats, taken)


def hidden_states(
    model_config: ModelConfig, params: Params, tokens_ns: jax.Array,
    positions_ns: Optional[jax.Array] = None,
    valid_ns: Optional[jax.Array] = None,
    segment_ns: Optional[jax.Array] = None,
    settings: ForwardSettings = ForwardSettings()) -> jax.Array:
  """Final-normed hidden states (N, S, D).

  positions_ns defaults to 0..S-1; valid_ns marks real (non-padding) tokens,
  which are the only keys attended to. segment_ns (int, optional) isolates
  examples packed into one row: a token attends only within its segment
  and to its group's shared prompt (`blockwise.segment_mask`; positions
  restart per example). settings: remat, attention and sharding
  constraints (`ForwardSettings`).
  """
  return hidden_states_routed(model_config, params, tokens_ns, positions_ns,
                              valid_ns, segment_ns, settings)[0]


def hidden_states_routed(
    model_config: ModelConfig, params: Params, tokens_ns: jax.Array,
    positions_ns: Optional[jax.Array] = None,
    valid_ns: Optional[jax.Array] = None,
    segment_ns: Optional[jax.Array] = None,
    settings: ForwardSettings = ForwardSettings(),
    routes_lnsc: Optional[jax.Array] = None) -> tuple:
  """`hidden_states` and the MoE `Routed` (None for a dense model), the
  sparse layers replaying `routes_lnsc` (L_sparse, N, S, C) when given."""
  rows = Rows(tokens_ns, *default_positions_and_valid(tokens_ns, positions_ns,
                                                      valid_ns))
  h, _, routed = _decoder(model_config, params, rows, segment_ns, settings,
                          False, routes_lnsc)
  return h, routed


def hidden_states_and_kv(
    model_config: ModelConfig, params: Params, tokens_ns: jax.Array,
    positions_ns: Optional[jax.Array] = None,
    valid_ns: Optional[jax.Array] = None,
    settings: ForwardSettings = ForwardSettings(),
    return_routes: bool = False) -> tuple:
  """`hidden_states` and every layer's k and v stacked over layers, each
  (L, N, K, S, E), for filling a KV cache (or a shared prompt's keys);
  return_routes: also the experts of every sparse layer (L_sparse, N, S,
  C), the sampler's recorded routes (routing replay)."""
  rows = Rows(tokens_ns, *default_positions_and_valid(tokens_ns, positions_ns,
                                                      valid_ns))
  h, kv, routed = _decoder(model_config, params, rows, None, settings, True,
                           return_routes=return_routes)
  return (h, kv, routed.routes_lnsc) if return_routes else (h, kv)


def hidden_states_shared_prompt(model_config: ModelConfig, params: Params,
                                prompt: Rows, continuation: Rows,
                                settings: ForwardSettings = ForwardSettings(),
                                routes: Optional[tuple] = None):
  """`hidden_states` of N = B*G rows [prompt b | continuation n], with each
  of the B prompts (B, P) run through the decoder ONCE instead of G times.

  Row n continues prompt b = n // G. Its continuation tokens (N, T) attend
  to the prompt's keys and values (repeated to the G rows) and causally to
  their own: `hidden_states` of the concatenated rows in fewer FLOPs
  (B*P + N*T tokens instead of N*(P+T)).

  Returns the last prompt column's hidden state per prompt (B, D), which
  predicts the first continuation token, the continuation's (N, T, D), and
  for an MoE model the `Routed` of both passes (each prompt token counted
  once; None for a dense model). routes: (prompt's (L_sparse, B, P, C),
  continuation's (L_sparse, N, T, C)) to replay, or None.
  """
  B, N = prompt.tokens_ns.shape[0], continuation.tokens_ns.shape[0]
  if N % B:
    raise ValueError(f"{N} rows do not split into groups of {B} prompts")
  rep = lambda x: jnp.repeat(x, N // B, axis=0)
  constrain = settings.constrain or no_constraint
  prompt_routes, routes_lntc = (None, None) if routes is None else routes
  h_bpd, (k_lbkpe, v_lbkpe), prompt_routed = _decoder(
      model_config, params, prompt, None, settings, True, prompt_routes)
  positions_nt = continuation.positions_ns
  key_pos_ns = jnp.concatenate([rep(prompt.positions_ns), positions_nt],
                               axis=1)
  key_valid_ns = jnp.concatenate([rep(prompt.valid_ns),
                                  continuation.valid_ns], axis=1)
  attend = layer_scan.attends_per_layer(model_config, settings.attention,
                             positions_nt, key_pos_ns, key_valid_ns)
  sparse = model_config.moe
  valid_n = continuation.valid_ns.reshape(-1)

  def layer(layer_config, carry, xs):
    x, stats = carry if sparse else (carry, None)
    lp, k_prompt, v_prompt = xs
    q, k, v = qkv(layer_config, lp, x, positions_nt, constrain)
    k = jnp.concatenate([rep(k_prompt), k], axis=2)
    v = jnp.concatenate([rep(v_prompt), v], axis=2)
    x, routing = attn_out_and_routed_mlp(
        layer_config, lp, x, attend[layer_config](q, k, v), constrain,
        settings.dispatch)
    if routing is not None:
      stats = stats + moe.layer_stats(sparse, routing, valid_n)
    return ((x, stats) if sparse else x), None

  layers = params["layers"]
  if routes_lntc is not None:
    layers = dict(layers, routes=routes_lntc)
  x = constrain(embed(params, continuation.tokens_ns, model_config),
                RESIDUAL_AXES)
  carry = (x, prompt_routed.stats) if sparse else x
  carry, _ = layer_scan.scan_layers(
      model_config, layer, carry, (layers, k_lbkpe, v_lbkpe),
      layer_scan.remat(REMAT_POLICIES[settings.remat]))
  x, stats = carry if sparse else (carry, None)
  h = rms_norm(x, params["final_norm"], model_config.norm_eps)
  return h_bpd[:, -1], h, None if stats is None else Routed(stats)


def forward(model_config: ModelConfig, params: Params, tokens_ns: jax.Array,
            positions_ns: Optional[jax.Array] = None,
            valid_ns: Optional[jax.Array] = None,
            remat: str = "none") -> jax.Array:
  """Causal logits (N, S, V) in float32 for int32 tokens (N, S)."""
  h = hidden_states(model_config, params, tokens_ns, positions_ns, valid_ns,
                    settings=ForwardSettings(remat=remat))
  return unembed(model_config, params, h)
