"""The static sampler: G completions per prompt from one prefill, every row
of a call decoding in lockstep.

One jitted pure function, `sample_padded`, in two stages:

  prefill   prompts (B, P), left-padded -> KV cache for B*G rows + first token
            (each prompt is run through the model ONCE; its cache is then
            repeated to its G rows)
  generate  a `lax.while_loop` over decode steps that stops as soon as every
            row has emitted a stop id or `max_new_tokens` is reached; the
            cache never leaves the program, so XLA updates it in place.

Left padding puts the last prompt token of every row in the same column, so
all rows write the cache at the same slot each step (one dynamic_update_slice,
no scatter); per-row rotary positions and a key-validity mask make padding
invisible. Rows of a batch are thus independent: mixing prompt lengths gives
the same completions as sampling each prompt alone.

Settings, `Samples`, token choice and its noise (a function of (key, row,
token), so chunks and schedules give the same samples) and the log-probs'
definition live in `decoding`; the host side (buckets, chunks, continuous
batching's choice of program) in `sampling`.

Sharding (with a `sharding.Layout`): every per-row array - prompts, tokens,
log-probs, done flags, the KV cache and its masks - is split along rows as
the `batch` rule says (data x fsdp by default) and the cache's KV heads as
`kv_heads` says (tensor), pinned inside the jit (`_pin_carry`). Rows are
padded to a multiple of the row shards; the G rows of one prompt may live on
different shards (the cache's repeat to G rows is then a resharding).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from grpo_jax import sharding
from grpo_jax.generate import decoding
from grpo_jax.models import decode, moe, transformer

Layout = Optional[sharding.Layout]    # None: one device, or XLA's choice
CACHE_AXES = (sharding.BATCH, "kv_heads", None, "head_dim")  # (N, K, S, E)


class _Carry(NamedTuple):
  t: jax.Array                      # next column to fill
  tokens_nt: jax.Array
  logp_nt: jax.Array
  done_n: jax.Array
  cache: decode.KVCache
  # record_routes: each column's experts per sparse layer (L_sparse, N,
  # P + T, C), the cache's columns; None otherwise
  routes_lnsc: Optional[jax.Array] = None


def _pin_rows(layout: Layout, x: jax.Array) -> jax.Array:
  """Inside jit: rows (axis 0) split as the `batch` rule says."""
  return x if layout is None else layout.constrain(x, (sharding.BATCH,))


def _pin_carry(layout: Layout, c: _Carry) -> _Carry:
  """Inside jit: the decode state split along rows, KV heads as the rules
  say, so every batch shard holds and decodes only its own rows."""
  if layout is None:
    return c
  rows = functools.partial(_pin_rows, layout)
  kv = lambda x: layout.constrain(x, CACHE_AXES)
  cache = decode.KVCache(
      tuple(map(kv, c.cache.k)), tuple(map(kv, c.cache.v)),
      rows(c.cache.valid_ns), rows(c.cache.pos_ns))
  routes = c.routes_lnsc
  if routes is not None:
    routes = layout.constrain(routes, (None, sharding.BATCH))
  return c._replace(tokens_nt=rows(c.tokens_nt), logp_nt=rows(c.logp_nt),
                    done_n=rows(c.done_n), cache=cache, routes_lnsc=routes)


def prefill(call: decoding.CallSpec, params: transformer.Params,
            prompt_bp: jax.Array, prompt_len_b: jax.Array, key: jax.Array,
            row_offset=0) -> _Carry:
  """Runs each left-padded prompt once and returns the decode loop's start.

  prompt_bp: int32 (B, P) left-padded; prompt_len_b: int32 (B,) real lengths.
  The cache for row i = b*G + g is prompt b's cache; the first token of each
  row is sampled from prompt b's last logits with that row's own noise.
  """
  model_config, sampling = call.model_config, call.sampling
  B = prompt_bp.shape[0]
  G, T = call.num_generations, sampling.max_new_tokens
  pp = decoding.prompt_pass(model_config, params, prompt_bp, prompt_len_b,
                            sampling.record_routes)
  rep = lambda x: jnp.repeat(x, G, axis=0)   # prompt b -> rows b*G..
  grow = lambda x: jnp.pad(rep(x), [(0, 0)] * 2 + [(0, T), (0, 0)])
  L = 0 if decode.latent_only(model_config) else model_config.num_layers
  cache = decode.KVCache(        # MLA: the latent once, as k (no v)
      k=tuple(grow(pp.k[i]) for i in range(model_config.num_layers)),
      v=tuple(grow(pp.v[i]) for i in range(L)),
      valid_ns=jnp.pad(rep(pp.valid_bp), [(0, 0), (0, T)]),
      pos_ns=jnp.pad(rep(pp.pos_bp), [(0, 0), (0, T)]))
  row_n = row_offset + jnp.arange(B * G, dtype=jnp.int32)
  first, logp = decoding.choose_tokens(rep(pp.logits_bv), key, sampling,
                                       row_n, 0)
  tokens_nt = jnp.full((B * G, T), sampling.pad_id,
                       jnp.int32).at[:, 0].set(first)
  logp_nt = jnp.zeros((B * G, T), jnp.float32).at[:, 0].set(logp)
  routes = None
  if sampling.record_routes:        # the prompt's, then T columns to fill
    dtype = moe.routes_dtype(model_config.moe.num_experts)
    routes = jnp.pad(jnp.repeat(pp.routes_lbpc.astype(dtype), G, axis=1),
                     [(0, 0), (0, 0), (0, T), (0, 0)])
  return _Carry(jnp.int32(1), tokens_nt, logp_nt,
                decoding.is_stop(first, sampling.stop_ids), cache, routes)


def generate(call: decoding.CallSpec, params: transformer.Params,
             carry: _Carry, prompt_len_b: jax.Array, key: jax.Array,
             row_offset=0) -> decoding.Samples:
  """Decodes until every row stopped or max_new_tokens is reached."""
  model_config, sampling, layout = call.model_config, call.sampling, call.layout
  N, T = carry.tokens_nt.shape
  P = carry.cache.valid_ns.shape[1] - T
  G = N // prompt_len_b.shape[0]
  len_rows = _pin_rows(layout, jnp.repeat(prompt_len_b, G))
  row_n = row_offset + jnp.arange(N, dtype=jnp.int32)
  layers = decode.unstack_layers(model_config, params)  # once

  def cond(c: _Carry):
    return (c.t < T) & ~jnp.all(c.done_n)

  def feed(c: _Carry):
    """The last token through the model: logits, cache and (recording) the
    routes with its experts written at its column."""
    prev = jax.lax.dynamic_slice_in_dim(c.tokens_nt, c.t - 1, 1, axis=1)[:, 0]
    logits, cache, *taken = decode.decode_step(
        model_config, params, c.cache, prev, len_rows + c.t - 1, P + c.t - 1,
        layers, sampling.record_routes)
    routes = c.routes_lnsc
    if taken:
      routes = jax.lax.dynamic_update_slice(
          routes, taken[0][:, :, None].astype(routes.dtype),
          (0, 0, P + c.t - 1, 0))
    return logits, cache, routes

  def body(c: _Carry):
    logits, cache, routes = feed(c)
    tok, logp = decoding.choose_tokens(logits, key, sampling, row_n, c.t)
    tok = jnp.where(c.done_n, sampling.pad_id, tok)
    logp = jnp.where(c.done_n, 0.0, logp)
    tokens_nt = jax.lax.dynamic_update_slice(c.tokens_nt, tok[:, None], (0, c.t))
    logp_nt = jax.lax.dynamic_update_slice(c.logp_nt, logp[:, None], (0, c.t))
    done = c.done_n | decoding.is_stop(tok, sampling.stop_ids)
    return _pin_carry(layout, _Carry(c.t + 1, tokens_nt, logp_nt, done, cache,
                                      routes))

  with jax.named_scope(decoding.DECODE_SCOPE):
    final = jax.lax.while_loop(cond, body, carry)
  routes_nslc = None
  if sampling.record_routes:    # the last sampled tokens' experts: one more
    routes_nslc = jnp.moveaxis(feed(final)[2], 0, 2)   # step, routes only
  return decoding.finish(final.tokens_nt, final.logp_nt, final.t - carry.t,
                         sampling, routes_nslc)


@functools.partial(jax.jit, static_argnames="call")
def sample_padded(call: decoding.CallSpec, params: transformer.Params,
                  prompt_bp: jax.Array, prompt_len_b: jax.Array, key: jax.Array,
                  row_offset=0) -> decoding.Samples:
  """prefill + generate as ONE jitted program on left-padded prompts.

  The KV cache is born and dies inside this program: XLA updates it in place
  through the while loop, and no cache buffer crosses the host boundary (this
  is what donating it between two jitted stages would buy, minus the copy).
  With a layout, rows are split over the batch shards (module docstring).
  row_offset (int32, traced): this call's rows are rows row_offset.. of a
  call over all rows, and draw those rows' noise (`decoding`).
  """
  layout = call.layout
  prompt_bp, prompt_len_b = (_pin_rows(layout, x)
                             for x in (prompt_bp, prompt_len_b))
  carry = _pin_carry(
      layout, prefill(call, params, prompt_bp, prompt_len_b, key, row_offset))
  out = generate(call, params, carry, prompt_len_b, key, row_offset)
  return decoding.map_rows(lambda x: _pin_rows(layout, x), out)
