"""Cached decoding: the dense KV cache, the weights as a decode loop reads
them, and the lockstep decode step (the static sampler's: every row writes
the same cache column).

`ragged.decode_step` (dense slots, each row at its own column) and
`paged.decode_step` (a pool of pages) are the continuous-batching
samplers' steps over the same layers (`transformer.qkv`,
`transformer.attn_out_and_mlp`) and the same `Weights`. Shapes as in
`transformer`.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp

from grpo_jax.models import attention, layer_scan, transformer
from grpo_jax.models.config import ModelConfig

Params = transformer.Params


class KVCache(NamedTuple):
  """Keys and values, one (N, K, S, E) array per layer in a tuple of L;
  `valid_ns` marks written, non-padding slots and `pos_ns` their rotary
  positions. Separate per-layer buffers let the decode loop update each in
  place without slicing a stacked (L, ...) array. An empty `v` (MLA): the
  values are the keys, the latent stored once (`latent_only`,
  `layer_values`)."""
  k: tuple
  v: tuple
  valid_ns: jax.Array
  pos_ns: jax.Array


def init_cache(model_config: ModelConfig, batch: int, length: int,
               dtype=jnp.float32) -> KVCache:
  """Zeros; MLA: no value arrays (`latent_only`)."""
  shape = (batch, model_config.num_kv_heads, length, model_config.head_dim)
  zeros = lambda n: tuple(jnp.zeros(shape, dtype) for _ in range(n))
  L = model_config.num_layers
  return KVCache(zeros(L), zeros(0 if latent_only(model_config) else L),
                 jnp.zeros((batch, length), bool),
                 jnp.zeros((batch, length), jnp.int32))


def latent_only(model_config: ModelConfig) -> bool:
  """Whether a cache may hold the keys only: MLA's keys and values are one
  array (the latent and the rope key, models/mla.py)."""
  return model_config.mla is not None


def cache_arrays(model_config: ModelConfig) -> int:
  """Arrays per layer of every sampler's cache (lockstep, dense slots,
  page pools): 1 (MLA's latent) or 2 (keys and values)."""
  return 1 if latent_only(model_config) else 2


def layer_values(ks: Sequence, vs: Sequence, i: int):
  """Layer i's values in a cache (or page pool) of per-layer key and value
  arrays: its v array, or its keys where there are no values (MLA's
  latent is both)."""
  return vs[i] if vs else ks[i]


def unstack_layers(model_config: ModelConfig, params: Params) -> list[Params]:
  """Per-layer weight dicts, sliced from the stacked (L, ...) arrays (an
  MoE model's expert and dense-MLP weights from their own stacks)."""
  return [layer_scan.take_layer(model_config, params["layers"], i)
          for i in range(model_config.num_layers)]


def set_in_bits(cache: jax.Array, new: jax.Array, set_) -> jax.Array:
  """set_(cache, new) (a scatter of `new`, cast to the cache's dtype, into
  `cache`), done on the bits of a 16-bit float cache: both as uint16, the
  result bitcast back. For the decode steps' writes of keys and values:
  XLA:CPU has no bf16 scatter, and converted the whole bf16 cache to
  float32 and back around each write, two passes over every layer's cache
  per decode step (docs/paged.md). Bitcasts cost nothing on any backend;
  other dtypes are scattered as they are."""
  new = new.astype(cache.dtype)
  if cache.dtype.itemsize != 2 or not jnp.issubdtype(cache.dtype,
                                                     jnp.floating):
    return set_(cache, new)
  bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint16)
  return jax.lax.bitcast_convert_type(set_(bits(cache), bits(new)),
                                      cache.dtype)


class Weights(NamedTuple):
  """The weights as a decode loop reads them: the tree (embedding, final
  norm, head) and each layer's weights sliced once, before the loop
  (`decode_step` says why)."""
  params: Params
  layers: list


def weights(model_config: ModelConfig, params: Params) -> Weights:
  return Weights(params, unstack_layers(model_config, params))


def logits(model_config: ModelConfig, params: Params, x: jax.Array
           ) -> jax.Array:
  """The last layer's output (N, 1, D) -> float32 logits (N, V)."""
  h = transformer.rms_norm(x, params["final_norm"], model_config.norm_eps)
  return transformer.unembed(model_config, params, h)[:, 0]


def decode_step(model_config: ModelConfig, params: Params, cache: KVCache,
                tokens_n: jax.Array, positions_n: jax.Array,
                index: jax.Array, layers: Optional[list[Params]] = None,
                record_routes: bool = False) -> tuple:
  """One token per row: writes its k, v at cache slot `index` (the same slot
  for every row, so the write is one in-place dynamic_update_slice) and
  returns float32 logits (N, V) and the updated cache; record_routes: and
  the experts each sparse layer chose for the token (L_sparse, N, C).

  The layers are unrolled rather than scanned. Inside the sampler's while
  loop, a scan slices each layer's weights and cache out of the stacked
  arrays with dynamic-slice copies every step, and XLA on CPU does not hoist
  even static slices out of the loop; so the sampler passes `layers` (from
  `unstack_layers`, sliced ONCE before the loop) and each layer's cache is a
  separate buffer updated and read in place. On CPU this removed about a
  model's worth of weight copies per decode step.
  """
  if layers is None:
    layers = unstack_layers(model_config, params)
  pos_nq = positions_n[:, None]                      # Q = 1 query column

  valid = jax.lax.dynamic_update_slice(
      cache.valid_ns, jnp.ones((tokens_n.shape[0], 1), bool), (0, index))
  kpos = jax.lax.dynamic_update_slice(cache.pos_ns, pos_nq, (0, index))
  configs = [model_config.layer_config(i) for i in range(len(layers))]
  masks = {c: attention.attention_mask(c, pos_nq, kpos, valid)
           for c in set(configs)}                  # one per layer kind
  x = transformer.embed(params, tokens_n[:, None], model_config)
  ks, vs, routes = list(cache.k), list(cache.v), []
  write = lambda buf, new: jax.lax.dynamic_update_slice(
      buf, new.astype(buf.dtype), (0, 0, index, 0))
  for i, lp in enumerate(layers):
    c = configs[i]
    q, k, v = transformer.qkv(c, lp, x, pos_nq)
    ks[i] = write(ks[i], k)
    if vs:                       # else the values are the keys (latent_only)
      vs[i] = write(vs[i], v)
    x, routing = transformer.attn_out_and_routed_mlp(
        c, lp, x, attention.attention(q, ks[i], layer_values(ks, vs, i),
                                      masks[c], c.attn_softcap))
    if routing is not None:
      routes.append(routing.experts_nc)
  out = logits(model_config, params, x), KVCache(tuple(ks), tuple(vs), valid,
                                                 kpos)
  return (*out, jnp.stack(routes)) if record_routes else out
