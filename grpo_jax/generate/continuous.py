"""Continuous batching: the call's rows take turns in a fixed set of slots.

The static sampler (`sampling.sample_padded`) decodes all N rows of a call
in lockstep until its longest row ends: with long-tailed lengths most of
its row-steps decode padding. Here M < N cache slots decode; when a row
ends (stop id or max_new_tokens) its slot takes the next row at once, so
the slots stay busy until the call's work runs out. One jitted program:

  prefill   every prompt (B, P) through the model ONCE (decoding.prompt_pass);
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
shard (per-shard code is vmapped over a leading R axis). The host pads the
prompts to a multiple of R; padded prompts' rows are never decoded.

Shape letters as in `grpo_jax` (m: slots); per-shard arrays (a leading axis
of R row shards) carry no suffix.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from grpo_jax import sharding
from grpo_jax.generate import decoding
from grpo_jax.models import ragged, transformer
from grpo_jax.models.config import ModelConfig

Layout = Optional[sharding.Layout]
CACHE_AXES = (sharding.BATCH, "kv_heads", None, "head_dim")  # (M, K, S, E)


class _Carry(NamedTuple):
  steps: jax.Array          # decode iterations run
  row_m: jax.Array          # int32: the (global) row each slot holds
  t_m: jax.Array            # int32: tokens chosen so far = next column
  live_m: jax.Array         # bool: decoding a row
  next_row: jax.Array       # int32 (R,): the next (global) row of each shard
  cache: transformer.KVCache   # (M, K, S, E) per layer; (M, S) masks
  tokens_nt: jax.Array
  logp_nt: jax.Array


def _pin(layout: Layout, x: jax.Array, axes=(sharding.BATCH,)) -> jax.Array:
  return x if layout is None else layout.constrain(x, axes)


def _pin_carry(layout: Layout, c: _Carry) -> _Carry:
  """Inside jit: every per-slot and per-row array split along its first
  axis, the cache's KV heads as the rules say."""
  if layout is None:
    return c
  pin = functools.partial(_pin, layout)
  kv = functools.partial(_pin, layout, axes=CACHE_AXES)
  cache = transformer.KVCache(tuple(map(kv, c.cache.k)),
                              tuple(map(kv, c.cache.v)),
                              pin(c.cache.valid_ns), pin(c.cache.pos_ns))
  return _Carry(c.steps, pin(c.row_m), pin(c.t_m), pin(c.live_m),
                c.next_row, cache, pin(c.tokens_nt), pin(c.logp_nt))


def _per_shard(R: int, x: jax.Array) -> jax.Array:
  """(R * X, ...) -> (R, X, ...): shard r's part on axis 0 (a local
  reshape: the first axis is split in R contiguous parts)."""
  return x.reshape(R, x.shape[0] // R, *x.shape[1:])


def _assign(live_m: jax.Array, next_row: jax.Array, row_limit: jax.Array):
  """Idle slots take the next rows of their shard, in order. Returns which
  slots took a row (M,), the row each took (M,; meaningless where not
  taken) and the shards' next rows."""
  R = next_row.shape[0]
  idle = ~_per_shard(R, live_m)                      # (R, M/R)
  row = next_row[:, None] + jnp.cumsum(idle, axis=1) - 1
  take = idle & (row < row_limit[:, None])
  return take.reshape(-1), row.reshape(-1), next_row + take.sum(1)


def _copy_prompts(cache: transformer.KVCache, pp: decoding.PromptPass,
                  take_m: jax.Array, prompt_m: jax.Array, R: int
                  ) -> transformer.KVCache:
  """Copies prompt prompt_m[m]'s keys, values, validity and positions into
  the first P columns of each slot m that took a row; the slot's other
  columns become invalid. Keys and values move one taken slot per shard
  per iteration, so a step copies only the slots that changed."""
  P, S = pp.valid_bp.shape[1], cache.valid_ns.shape[1]
  pad = lambda x: jnp.pad(x, [(0, 0), (0, S - P)])
  valid = jnp.where(take_m[:, None], pad(pp.valid_bp[prompt_m]), cache.valid_ns)
  pos = jnp.where(take_m[:, None], pad(pp.pos_bp[prompt_m]), cache.pos_ns)

  take_by_shard = _per_shard(R, take_m)
  taken_by_shard = take_by_shard.sum(1)
  order_by_shard = jnp.argsort(~take_by_shard, axis=1, stable=True)   # taken slots first
  B_local = pp.valid_bp.shape[0] // R
  prompt_by_shard = _per_shard(R, prompt_m) - (
      jnp.arange(R)[:, None] * B_local)

  def copy_one(cache_mkse, prompt_bkpe, m, b, do):                 # one shard
    src = jnp.where(do, prompt_bkpe[b], cache_mkse[m, :, :P])
    return jax.lax.dynamic_update_slice(cache_mkse, src[None], (m, 0, 0, 0))

  def body(i, kv):
    slot_by_shard = order_by_shard[:, i]
    prompt_of_slot = jnp.take_along_axis(prompt_by_shard, slot_by_shard[:, None], 1)[:, 0]
    one = lambda c, p: jax.vmap(copy_one)(
        _per_shard(R, c), _per_shard(R, p), slot_by_shard, prompt_of_slot, i < taken_by_shard
    ).reshape(c.shape)
    return tuple(one(c, p) for c, p in zip(kv, tuple(pp.k) + tuple(pp.v)))

  L = len(cache.k)
  kv = jax.lax.fori_loop(0, jnp.max(taken_by_shard), body, cache.k + cache.v)
  return transformer.KVCache(kv[:L], kv[L:], valid, pos)


def _local_rows(row_m: jax.Array, N: int, R: int) -> jax.Array:
  """(R, M/R): each slot's row as an index into its shard's N/R rows."""
  return _per_shard(R, row_m) - jnp.arange(R)[:, None] * (N // R)


def _shard_take(x: jax.Array, index_m: jax.Array, R: int) -> jax.Array:
  """x[index_m] for a per-prompt or per-row array x (split in R contiguous
  parts over the row shards), each shard reading its own part: a slot of
  shard r holds only shard r's rows, so no read crosses row shards. Indexed
  globally, XLA gathered every shard's part onto every chip at each decode
  step: for the paged sampler's prompt tails of the paper config on
  v5p:8x8x4 (512 prompts), 537 MB per chip per step over ICI
  (docs/paged.md). Slots that never took a row read a clipped index
  (unused)."""
  take = lambda part, i: jnp.take(part, i, axis=0, mode="clip")
  return jax.vmap(take)(_per_shard(R, x),
                        _local_rows(index_m, x.shape[0], R)).reshape(
                            index_m.shape + x.shape[1:])


def _read(x_nt: jax.Array, row_m: jax.Array, t_m: jax.Array, R: int
          ) -> jax.Array:
  """x_nt[row_m, t_m], each shard reading its own rows."""
  one = lambda x, r, t: x[r, t]
  return jax.vmap(one)(_per_shard(R, x_nt), _local_rows(row_m, x_nt.shape[0], R),
                       _per_shard(R, t_m)).reshape(row_m.shape)


def _write(x_nt: jax.Array, row_m: jax.Array, t_m: jax.Array,
           value_m: jax.Array, live_m: jax.Array, R: int) -> jax.Array:
  """x_nt[row_m, t_m] = value_m for live slots, each shard writing its own
  rows (vmapped over shards; dead slots write nowhere)."""
  local = jnp.where(_per_shard(R, live_m),
                    _local_rows(row_m, x_nt.shape[0], R),
                    x_nt.shape[0] // R)                       # out of range

  def one(x, r, t, val):
    return x.at[r, t].set(val, mode="drop")
  return jax.vmap(one)(_per_shard(R, x_nt), local, _per_shard(R, t_m),
                       _per_shard(R, value_m)).reshape(x_nt.shape)


def every(step, k: int):
  """A while loop's body of `k` steps: the loop checks its condition (an
  all-reduce of the slots' live flags when they are sharded) once per k
  steps. A step must be a no-op once nothing is left to decode (slots
  that finished stay masked), so any k gives the same samples; k = 1 is
  the step itself."""
  if k == 1:
    return step
  return lambda c: jax.lax.fori_loop(0, k, lambda _, c: step(c), c)


def _refill(c: _Carry, pp: decoding.PromptPass, first_n: jax.Array,
            row_limit: jax.Array, G: int, T: int, cfg, R: int) -> _Carry:
  """Idle slots take the next rows: prompt cache copied, first token in.
  A row whose first token already stops (or T = 1) leaves its slot idle."""
  take_m, new_row_m, next_row = _assign(c.live_m, c.next_row, row_limit)
  row_m = jnp.where(take_m, new_row_m, c.row_m)
  cache = _copy_prompts(c.cache, pp, take_m, row_m // G, R)
  starts = take_m & ~decoding.is_stop(_shard_take(first_n, row_m, R),
                                      cfg.stop_ids) & (T > 1)
  return c._replace(row_m=row_m, t_m=jnp.where(take_m, 1, c.t_m),
                    live_m=starts | (c.live_m & ~take_m), next_row=next_row,
                    cache=cache)


@functools.partial(jax.jit, static_argnames=("model_config", "cfg",
                                             "num_generations", "slots",
                                             "layout"))
def sample_slots(model_config: ModelConfig, params: transformer.Params,
                 prompt_bp: jax.Array, prompt_len_b: jax.Array, key: jax.Array,
                 cfg: decoding.SamplingConfig, num_generations: int,
                 slots: int, real_prompts: jax.Array,
                 layout: Layout = None) -> decoding.Samples:
  """G completions of each left-padded prompt (B, P) by continuous batching
  over `slots` cache slots (module docstring). Only the first real_prompts
  (int32, traced) prompts' rows are decoded; the rest come back with their
  first token only. B and slots must be multiples of the row shards."""
  B, P = prompt_bp.shape
  G, T = num_generations, cfg.max_new_tokens
  N, M = B * G, slots
  R = 1 if layout is None else layout.batch_shards
  if B % R or M % R:
    raise ValueError(f"{B} prompts and {M} slots must be multiples of the "
                     f"{R} row shards")
  S = -(-(P + T) // ragged.BLOCK_S) * ragged.BLOCK_S

  # PREFILL: each prompt once; every row's first token from its logits.
  prompt_bp, prompt_len_b = (_pin(layout, x) for x in (prompt_bp, prompt_len_b))
  pp = decoding.prompt_pass(model_config, params, prompt_bp, prompt_len_b)
  row_n = jnp.arange(N, dtype=jnp.int32)
  first_n, logp_n = decoding.choose_tokens(
      _pin(layout, jnp.repeat(pp.logits_bv, G, axis=0)), key, cfg, row_n, 0)
  tokens_nt = jnp.full((N, T), cfg.pad_id, jnp.int32).at[:, 0].set(first_n)
  logp_nt = jnp.zeros((N, T), jnp.float32).at[:, 0].set(logp_n)
  if T == 1:
    return decoding.finish(tokens_nt, logp_nt, jnp.int32(0), cfg)

  N_local = N // R
  first_row = jnp.arange(R, dtype=jnp.int32) * N_local
  row_limit = first_row + jnp.clip(real_prompts * G - first_row, 0, N_local)
  dtype = pp.k.dtype
  cache = transformer.init_cache(model_config, M, S, dtype)
  refill = functools.partial(_refill, pp=pp, first_n=first_n,
                             row_limit=row_limit, G=G, T=T, cfg=cfg, R=R)
  zeros_m = jnp.zeros((M,), jnp.int32)
  carry = _pin_carry(layout, refill(_Carry(
      jnp.int32(0), zeros_m, zeros_m, jnp.zeros((M,), bool), first_row, cache,
      tokens_nt, logp_nt)))
  layers = transformer.unstack_layers(params, model_config.num_layers)  # once

  # DECODE: every slot one token per iteration; ended rows' slots refilled.
  def cond(c: _Carry):
    return jnp.any(c.live_m) | jnp.any(c.next_row < row_limit)

  def body(c: _Carry):
    t_m = jnp.maximum(c.t_m, 1)           # never-used slots: a harmless column
    prev_m = _read(c.tokens_nt, c.row_m, t_m - 1, R)
    pos_m = _shard_take(prompt_len_b, c.row_m // G, R) + t_m - 1
    filled = P + jnp.max(jnp.where(c.live_m, t_m, 0))
    logits_mv, cache = ragged.decode_step(model_config, params, c.cache, prev_m,
                                          pos_m, P + t_m - 1, filled, layers)
    tok_m, logp_m = decoding.choose_tokens(logits_mv, key, cfg, c.row_m, t_m)
    tokens_nt = _write(c.tokens_nt, c.row_m, t_m, tok_m, c.live_m, R)
    logp_nt = _write(c.logp_nt, c.row_m, t_m, logp_m, c.live_m, R)
    ended = decoding.is_stop(tok_m, cfg.stop_ids) | (t_m + 1 >= T)
    c = c._replace(steps=c.steps + cond(c).astype(jnp.int32), t_m=t_m + 1,
                   live_m=c.live_m & ~ended,
                   cache=cache, tokens_nt=tokens_nt, logp_nt=logp_nt)
    return _pin_carry(layout, refill(c))

  with jax.named_scope(decoding.DECODE_SCOPE):
    final = jax.lax.while_loop(cond, every(body, cfg.stop_check_every),
                               carry)
  out = decoding.finish(final.tokens_nt, final.logp_nt, final.steps, cfg)
  return decoding.Samples(*(_pin(layout, x) for x in out[:-1]),
                          steps=out.steps)
