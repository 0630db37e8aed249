"""The parked engine's device programs, run by `parked.Engine` from the
host: PREFILL (`prefill`: the rows admitted since the last call, their new
tokens onto their pages, each row's first token) and DECODE
(`decode_steps`: at most steps_per_call steps over the slots); what they
are compiled for (`EngineSpec`) and the slots DECODE carries (`Slots`).
Shape letters as in `parked`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import sharding
from grpo_jax.generate import decoding, page_pool
from grpo_jax.models import attention, decode, moe, page_layout, paged, transformer
from grpo_jax.models.config import ModelConfig

LAYOUT = page_layout.REFERENCE_LAYOUT


@dataclasses.dataclass(frozen=True)
class EngineSpec:
  """What the engine's programs are compiled for: the model, the sampler
  settings (max_new_tokens is a turn's budget), M slots, W pages of
  sampling.page_size columns, at most `context` columns per row, at most
  `steps_per_call` decode steps per call, a call left once `return_after`
  turns have ended."""
  model_config: ModelConfig
  sampling: decoding.SamplingConfig
  slots: int
  pages: int
  context: int
  steps_per_call: int = 16
  return_after: int = 1
  max_buckets: int = page_pool.MAX_BUCKETS   # attention branches a layer

  def __post_init__(self):
    J = self.table_width
    if self.pages < J:
      raise ValueError(f"a pool of {self.pages} pages cannot hold one row of "
                       f"{self.context} columns ({J} pages)")
    if min(self.slots, self.steps_per_call, self.return_after,
           self.max_buckets) < 1:
      raise ValueError("slots, steps_per_call, return_after and max_buckets "
                       "must be >= 1")

  @property
  def table_width(self) -> int:
    """J: page-table entries of a row."""
    return -(-self.context // self.sampling.page_size)

  @property
  def block(self) -> int:
    """Key columns per bucket of the decode's attention
    (`page_pool.bucket_block`)."""
    return page_pool.bucket_block(self.table_width, self.sampling.page_size,
                              self.max_buckets)


class Slots(NamedTuple):
  """The slots as the decode loop carries them (host numpy between calls)."""
  noise_m: np.ndarray       # int32: the noise number of the slot's turn
  t0_m: np.ndarray          # int32: the turn's tokens before this admission
  t_m: np.ndarray           # int32: tokens chosen since this admission
  column_m: np.ndarray      # int32: the column of the last chosen token
  limit_m: np.ndarray       # int32: this turn's token budget
  live_m: np.ndarray        # bool: decoding
  table_mj: np.ndarray      # int32 page ids (W: none)
  tokens_mt: np.ndarray     # int32 this turn's tokens
  logp_mt: np.ndarray       # float32 their log-probs
  routes_mtlc: np.ndarray   # token t's experts when fed (parked_routes)


def pool_maker(spec: EngineSpec, dtype, layout: sharding.Layout | None):
  """The jitted maker of an engine's pool of zeros: on the default device,
  or on `layout`'s devices with its KV heads split as the layout's rules
  split them (tensor, as the weights' heads: each chip holds its heads'
  keys and values only), the rest replicated."""
  c, cfg = spec.model_config, spec.sampling
  return jax.jit(functools.partial(
      page_pool.zero_pool, c, spec.pages, cfg.page_size, 1, dtype, layout,
      LAYOUT, cfg.kv_dtype))


@functools.partial(jax.jit, static_argnames="spec", donate_argnames="pool")
def prefill(spec: EngineSpec, params, pool: paged.PagePool, tokens_al,
             start_a, count_a, table_aj, noise_a, t0_a, key) -> tuple:
  """Row a's count_a[a] new tokens at columns start_a[a]... written onto its
  pages, each attending over its columns up to itself; the turn's first
  token chosen from the last one's logits. Returns (pool, first_a, logp_a,
  the new tokens' experts (A, L, L_sparse, C) or None: record_routes)."""
  mc, Z = spec.model_config, spec.sampling.page_size
  A, L = tokens_al.shape
  W, J = spec.pages, table_aj.shape[1]
  col_al = start_a[:, None] + jnp.arange(L)[None]
  real_al = jnp.arange(L)[None] < count_a[:, None]
  page_al = jnp.where(real_al, jnp.take_along_axis(
      table_aj, jnp.minimum(col_al // Z, J - 1), 1), W)
  write = lambda pool, new: jax.vmap(LAYOUT.write)(
      pool, new.reshape(1, A * L, *new.shape[2:]), page_al.reshape(1, -1),
      (col_al % Z).reshape(1, -1))
  key_s = jnp.arange(J * Z)
  weights = decode.weights(mc, params)
  x = transformer.embed(params, tokens_al, mc)
  ks, vs, routes = list(pool.k), list(pool.v), []
  for i, lp in enumerate(weights.layers):
    c = mc.layer_config(i)
    q, k, v = transformer.qkv(c, lp, x, col_al)       # k, v: (A, K, L, E)
    ks[i] = write(ks[i], jnp.swapaxes(k, 1, 2))
    if vs:                             # else the values are the keys (MLA)
      vs[i] = write(vs[i], jnp.swapaxes(v, 1, 2))
    gather = lambda p: jax.vmap(lambda p, t: LAYOUT.gather(p, t, q.dtype))(
        p, table_aj[None])[0]                       # (A, K, J*Z, E)
    mask_als = key_s[None, None] <= col_al[:, :, None]
    if c.sliding_window is not None:
      mask_als &= key_s[None, None] > col_al[:, :, None] - c.sliding_window
    k_gathered = gather(ks[i])
    attn = attention.attention(
        q, k_gathered, gather(vs[i]) if vs else k_gathered, mask_als,
        c.attn_softcap)
    x, routing = transformer.attn_out_and_routed_mlp(c, lp, x, attn)
    if routing is not None:
      routes.append(routing.experts_nc.reshape(A, L, -1))
  last = jnp.take_along_axis(x, jnp.maximum(count_a - 1, 0)[:, None, None], 1)
  first_a, logp_a = decoding.choose_tokens(
      decode.logits(mc, params, last), key, spec.sampling, noise_a, t0_a)
  routes_allc = (jnp.stack(routes, 2).astype(moe.routes_dtype(
      mc.moe.num_experts)) if spec.sampling.record_routes else None)
  return paged.PagePool(tuple(ks), tuple(vs)), first_a, logp_a, routes_allc


@functools.partial(jax.jit, static_argnames="spec", donate_argnames="pool")
def decode_steps(spec: EngineSpec, params, pool: paged.PagePool, s: Slots, key
            ) -> tuple:
  """DECODE: at most spec.steps_per_call steps, left once return_after
  turns have ended or nothing is live. Returns (pool, slots, steps)."""
  mc, cfg = spec.model_config, spec.sampling
  Z, W = cfg.page_size, spec.pages
  M, J = s.table_mj.shape
  m = jnp.arange(M)
  weights = decode.weights(mc, params)

  def step(carry):
    i, ended, pool, s = carry
    j_m = s.column_m // Z
    page_m = jnp.where(s.live_m, s.table_mj[m, jnp.minimum(j_m, J - 1)], W)
    filled = jnp.max(jnp.where(s.live_m, j_m + 1, 0))
    settings = paged.DecodeSettings(
        paged.reference_fn(mc, filled, LAYOUT, spec.block), 1, LAYOUT)
    logits_mv, pool, *taken = paged.decode_step(
        mc, weights, pool, s.tokens_mt[m, s.t_m - 1],
        paged.RowPages(s.column_m, page_m, s.table_mj), settings,
        cfg.record_routes)
    if taken:                          # the fed token's (t_m - 1) experts
      s = s._replace(routes_mtlc=s.routes_mtlc.at[
          m, jnp.where(s.live_m, s.t_m - 1, s.tokens_mt.shape[1])].set(
              jnp.moveaxis(taken[0], 0, 1).astype(s.routes_mtlc.dtype),
              mode="drop"))
    tok_m, logp_m = decoding.choose_tokens(logits_mv, key, cfg, s.noise_m,
                                           s.t0_m + s.t_m)
    at_m = jnp.where(s.live_m, s.t_m, s.tokens_mt.shape[1])    # dead: drop
    end_m = s.live_m & (decoding.is_stop(tok_m, cfg.stop_ids)
                        | (s.t_m + 1 >= s.limit_m))
    s = s._replace(
        t_m=s.t_m + s.live_m, column_m=s.column_m + s.live_m,
        live_m=s.live_m & ~end_m,
        tokens_mt=s.tokens_mt.at[m, at_m].set(tok_m, mode="drop"),
        logp_mt=s.logp_mt.at[m, at_m].set(logp_m, mode="drop"))
    return i + 1, ended + end_m.sum(), pool, s

  def going(carry):
    i, ended, _, s = carry
    return ((i < spec.steps_per_call) & (ended < spec.return_after)
            & jnp.any(s.live_m))

  with jax.named_scope(decoding.DECODE_SCOPE):
    steps, _, pool, s = jax.lax.while_loop(
        going, step, (jnp.int32(0), jnp.int32(0), pool, s))
  return pool, s, steps
