"""Continuous batching: the call's rows take turns in a fixed set of slots.

The static sampler (`padded.sample_padded`) decodes all N rows of a call
in lockstep until its longest row ends: with long-tailed lengths most of
its row-steps decode padding. Here M < N cache slots decode; when a row
ends (stop id or max_new_tokens) its slot takes the next row at once, so
the slots stay busy until the call's work runs out. One jitted program:

  prefill   every prompt (B, P) through the model ONCE (slots.start);
            its keys and values stay in a (B, K, P, E) buffer per layer, and
            the first token of all N = B*G rows is chosen from its logits
  refill    each idle slot takes the next row (prompt-major order): its
            prompt's keys and values are copied into the slot's first P
            cache columns (a loop over the slots taken, so a step copies
            only what changed) and the row's first token becomes its input
  decode    a `lax.while_loop`: one token for every slot
            (models/ragged.decode_step: each slot writes its own column and
            attends over the filled key blocks only, up to the longest live
            row), the token written to (row, t) of the (N, T) outputs, the
            slots whose rows ended refilled; it runs until no row is left.

Slot m holds row `row_m[m]` at token `t_m[m]`; `live_m` marks the slots
decoding a row. The noise of row r's token t is `decoding.token_uniforms`'s
(key, r, t), the static sampler's, so both give the same samples for the
same key wherever their logits agree (float rounding of different matmul
shapes aside: tests/test_continuous.py). Rows come back in the static
sampler's layout (prompt-major, `Samples`), so callers need no change.

Sharding (with a `sharding.Layout` of R row shards): slots, rows and
prompts are split in R contiguous parts along the `batch` rule, and shard
r's slots take only shard r's rows (its prompts' rows, B/R prompts each),
so refilling, copying a prompt's cache and writing outputs stay on the
shard (per-shard code is vmapped over a leading R axis; `slots` holds
what this and the paged sampler share). The host pads the prompts to a
multiple of R; padded prompts' rows are never decoded.

Shape letters as in `grpo_jax` (m: slots); per-shard arrays (a leading axis
of R row shards) carry no suffix.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from grpo_jax import sharding
from grpo_jax.generate import decoding, slots
from grpo_jax.models import decode, ragged, transformer

Layout = Optional[sharding.Layout]
CACHE_AXES = (sharding.BATCH, "kv_heads", None, "head_dim")  # (M, K, S, E)


class _Carry(NamedTuple):
  steps: jax.Array          # decode iterations run
  row_m: jax.Array          # int32: the (global) row each slot holds
  t_m: jax.Array            # int32: tokens chosen so far = next column
  live_m: jax.Array         # bool: decoding a row
  next_row: jax.Array       # int32 (R,): the next (global) row of each shard
  cache: decode.KVCache   # (M, K, S, E) per layer; (M, S) masks
  tokens_nt: jax.Array
  logp_nt: jax.Array
  # record_routes: slots whose row ended and whose last token is fed once
  # more for its experts only; each completion column's experts (N, T,
  # L_sparse, C). Else no slot and None.
  tail_m: jax.Array
  routes_ntlc: Optional[jax.Array] = None


def _pin_carry(layout: Layout, c: _Carry) -> _Carry:
  """Inside jit: every per-slot and per-row array split along its first
  axis, the cache's KV heads as the rules say."""
  if layout is None:
    return c
  pin = functools.partial(slots.pin, layout)
  kv = functools.partial(slots.pin, layout, axes=CACHE_AXES)
  cache = decode.KVCache(tuple(map(kv, c.cache.k)),
                              tuple(map(kv, c.cache.v)),
                              pin(c.cache.valid_ns), pin(c.cache.pos_ns))
  routes = None if c.routes_ntlc is None else pin(c.routes_ntlc)
  return _Carry(c.steps, pin(c.row_m), pin(c.t_m), pin(c.live_m),
                c.next_row, cache, pin(c.tokens_nt), pin(c.logp_nt),
                pin(c.tail_m), routes)


def _copy_prompts(cache: decode.KVCache, pp: decoding.PromptPass,
                  take_m: jax.Array, prompt_m: jax.Array, R: int
                  ) -> decode.KVCache:
  """Copies prompt prompt_m[m]'s keys, values, validity and positions into
  the first P columns of each slot m that took a row; the slot's other
  columns become invalid. Keys and values move one taken slot per shard
  per iteration, so a step copies only the slots that changed."""
  P, S = pp.valid_bp.shape[1], cache.valid_ns.shape[1]
  pad = lambda x: jnp.pad(x, [(0, 0), (0, S - P)])
  valid = jnp.where(take_m[:, None], pad(pp.valid_bp[prompt_m]), cache.valid_ns)
  pos = jnp.where(take_m[:, None], pad(pp.pos_bp[prompt_m]), cache.pos_ns)

  take_by_shard = slots.per_shard(R, take_m)
  taken_by_shard = take_by_shard.sum(1)
  order_by_shard = jnp.argsort(~take_by_shard, axis=1, stable=True)   # taken slots first
  B_local = pp.valid_bp.shape[0] // R
  prompt_by_shard = slots.per_shard(R, prompt_m) - (
      jnp.arange(R)[:, None] * B_local)

  def copy_one(cache_mkse, prompt_bkpe, m, b, do):                 # one shard
    src = jnp.where(do, prompt_bkpe[b], cache_mkse[m, :, :P])
    return jax.lax.dynamic_update_slice(cache_mkse, src[None], (m, 0, 0, 0))

  def body(i, kv):
    slot_by_shard = order_by_shard[:, i]
    prompt_of_slot = jnp.take_along_axis(prompt_by_shard, slot_by_shard[:, None], 1)[:, 0]
    one = lambda c, p: jax.vmap(copy_one)(
        slots.per_shard(R, c), slots.per_shard(R, p), slot_by_shard,
        prompt_of_slot, i < taken_by_shard).reshape(c.shape)
    sources = tuple(pp.k) + (tuple(pp.v) if cache.v else ())  # MLA: no v
    return tuple(one(c, p) for c, p in zip(kv, sources, strict=True))

  L = len(cache.k)
  kv = jax.lax.fori_loop(0, jnp.max(taken_by_shard), body, cache.k + cache.v)
  return decode.KVCache(kv[:L], kv[L:], valid, pos)


def _refill(c: _Carry, begun: slots.Start, call: decoding.CallSpec
            ) -> _Carry:
  """Idle slots take the next rows: prompt cache copied, first token in.
  A row whose first token already stops (or T = 1) leaves its slot idle
  (recording routes: after one step feeding that token, as a tail)."""
  G, T, R = call.num_generations, call.sampling.max_new_tokens, call.shards
  take_m, new_row_m, next_row = slots.assign(c.live_m | c.tail_m, c.next_row,
                                             begun.row_limit)
  row_m = jnp.where(take_m, new_row_m, c.row_m)
  cache = _copy_prompts(c.cache, begun.pp, take_m, row_m // G, R)
  starts = take_m & ~decoding.is_stop(slots.shard_take(begun.first_n, row_m, R),
                                      call.sampling.stop_ids) & (T > 1)
  tail_m = c.tail_m | (take_m & ~starts & call.sampling.record_routes)
  return c._replace(row_m=row_m, t_m=jnp.where(take_m, 1, c.t_m),
                    live_m=starts | (c.live_m & ~take_m), next_row=next_row,
                    cache=cache, tail_m=tail_m)


@functools.partial(jax.jit, static_argnames="call")
def sample_slots(call: decoding.CallSpec, params: transformer.Params,
                 prompt_bp: jax.Array, prompt_len_b: jax.Array, key: jax.Array,
                 real_prompts: jax.Array) -> decoding.Samples:
  """G completions of each left-padded prompt (B, P) by continuous batching
  over `call.slots` cache slots (module docstring). Only the first
  real_prompts (int32, traced) prompts' rows are decoded; the rest come
  back with their first token only. B and the slots must be multiples of
  the row shards."""
  B, P = prompt_bp.shape
  slots.check_shards(call, B)
  model_config, sampling = call.model_config, call.sampling
  G, T = call.num_generations, sampling.max_new_tokens
  M, R = call.slots, call.shards
  S = -(-(P + T) // ragged.BLOCK_S) * ragged.BLOCK_S
  record = sampling.record_routes
  if record and T == 1:
    raise ValueError("record_routes with continuous batching needs "
                     "max_new_tokens >= 2")

  # PREFILL: each prompt once; every row's first token from its logits.
  begun = slots.start(call, params, prompt_bp, prompt_len_b, key,
                      real_prompts)
  if T == 1:
    return decoding.finish(begun.tokens_nt, begun.logp_nt, jnp.int32(0),
                           sampling)
  cache = decode.init_cache(model_config, M, S, begun.pp.k.dtype)
  refill = functools.partial(_refill, begun=begun, call=call)
  zeros_m = jnp.zeros((M,), jnp.int32)
  no_m = jnp.zeros((M,), bool)
  carry = _pin_carry(call.layout, refill(_Carry(
      jnp.int32(0), zeros_m, zeros_m, no_m, begun.first_row, cache,
      begun.tokens_nt, begun.logp_nt, no_m,
      slots.new_routes(call, B * G))))
  weights = decode.weights(model_config, params)             # sliced once

  # DECODE: every slot one token per iteration; ended rows' slots refilled.
  def cond(c: _Carry):
    return (jnp.any(c.live_m | c.tail_m)
            | jnp.any(c.next_row < begun.row_limit))

  def body(c: _Carry):
    t_m = jnp.maximum(c.t_m, 1)           # never-used slots: a harmless column
    prev_m = slots.read(c.tokens_nt, c.row_m, t_m - 1, R)
    pos_m = slots.shard_take(begun.prompt_len_b, c.row_m // G, R) + t_m - 1
    filled = P + jnp.max(jnp.where(c.live_m | c.tail_m, t_m, 0))
    logits_mv, cache, *taken = ragged.decode_step(
        model_config, weights, c.cache, prev_m, pos_m, P + t_m - 1, filled,
        record)
    routes = c.routes_ntlc
    if record:     # the fed token's experts, at its column t - 1
      routes = slots.write(routes, c.row_m, t_m - 1, jnp.moveaxis(
          taken[0], 0, 1).astype(routes.dtype), c.live_m | c.tail_m, R)
    tok_m, logp_m = decoding.choose_tokens(logits_mv, key, sampling, c.row_m,
                                           t_m)
    tokens_nt = slots.write(c.tokens_nt, c.row_m, t_m, tok_m, c.live_m, R)
    logp_nt = slots.write(c.logp_nt, c.row_m, t_m, logp_m, c.live_m, R)
    ended = decoding.is_stop(tok_m, sampling.stop_ids) | (t_m + 1 >= T)
    c = c._replace(steps=c.steps + cond(c).astype(jnp.int32), t_m=t_m + 1,
                   live_m=c.live_m & ~ended,
                   cache=cache, tokens_nt=tokens_nt, logp_nt=logp_nt,
                   tail_m=c.live_m & ended & record, routes_ntlc=routes)
    return _pin_carry(call.layout, refill(c))

  with jax.named_scope(decoding.DECODE_SCOPE):
    final = jax.lax.while_loop(
        cond, slots.every(body, sampling.stop_check_every), carry)
  return slots.finish(call, final.tokens_nt, final.logp_nt, final.steps,
                      begun.pp, final.routes_ntlc)
