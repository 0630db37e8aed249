"""Continuous batching over a paged KV cache (`sampling.kv_cache = "paged"`).

`continuous.sample_slots` gives each slot a dense cache of P + T columns
and copies a group's prompt into each of its G slots; every step attends
over every slot up to the longest live row. Here the keys and values live
in a pool of pages per row shard (`models.paged`: (K, W, Z, E) per layer,
the TPU kernel's layout) and each slot has a page table:

  prefill   every prompt once (decoding.prompt_pass); its full pages are
            written into the pool ONCE, without the left padding, and
            shared by reference by the G rows of its group (a count per
            page, `pages`); the partly-filled last page (the tail, fewer
            than Z columns) is kept aside and copied into a page of the
            row's own when the row starts (copy-on-write of that one page:
            the row's next columns continue it, so its columns stay
            [0, length) for the kernel, which masks by length only).
  refill    idle slots take the next rows (prompt-major) and wait.
  pages     each step, before decoding: waiting rows start when a page is
            free for their tail, leaving one free page per live row of the
            shard; live rows whose next column opens a page take one.
            Pages are granted oldest row (lowest index) first. A row that
            gets no page waits (skips the step, nothing written); if the
            oldest live row waits, the youngest live row is preempted: its
            own pages return to the pool and it starts again from its first
            token later (recompute; the noise of (key, row, t) makes the
            recomputed tokens the same). The oldest row is never preempted
            and always gets the next free page, and the pool holds at least
            the prompts' pages plus one whole row (checked on the host), so
            some row always finishes: no deadlock.
  decode    one token for every live row that has its page
            (models/paged.decode_step); a row that ends returns its own
            pages and its reference to its prompt's pages.

Rows are thus admitted by free pages, not by a P + T reservation per
slot: with more slots than the pool could hold at full length, more rows
decode at once in the same memory. Samples equal the dense sampler's (the
same (key, row, t) noise, the same logits up to float rounding).

`PageStats` says what the pool did (tests check the accounting: every
page back at the end, no page writable by two slots). Shape letters as in
`grpo_jax` and `models.paged`; per-shard arrays (a leading R) carry no
suffix.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from grpo_jax import sharding
from grpo_jax.generate import continuous, decoding, pages
from grpo_jax.models import paged, transformer
from grpo_jax.models.config import ModelConfig

Layout = Optional[sharding.Layout]
TAIL_AXES = (sharding.BATCH, "kv_heads", None, "head_dim")        # (B,K,Z,E)


class PageStats(NamedTuple):
  """What the page pool did in one call (int32 scalars)."""
  preempted: jax.Array      # rows preempted (restarted from their first token)
  waited: jax.Array         # slot-steps a live row waited for a page
  peak_pages: jax.Array     # most pages in use at once, summed over shards
  in_use_end: jax.Array     # pages still counted at the end (0: all returned)
  conflicts: jax.Array      # page-steps writable by two slots (0: sound;
                            # counted with check_pages only)


class PagePool(NamedTuple):
  """The keys' and values' pools of a paged call, one array per layer,
  (R,) + `paged.pool_layout(impl).shape(K, W, Z, E)`. Kept across calls
  (`sample_pages_reusing` donates it and returns it, so XLA writes the next
  call's pages into the same buffers): it depends on no row and no weight.
  A call's page tables and counts start afresh; stale pages are never read
  (a row reads only its own columns, masked by length)."""
  k: tuple
  v: tuple


class _Carry(NamedTuple):
  steps: jax.Array
  row_m: jax.Array          # int32: the (global) row each slot holds
  t_m: jax.Array            # int32: tokens chosen so far
  live_m: jax.Array         # bool: decoding
  wait_m: jax.Array         # bool: holds a row that has not started
  next_row: jax.Array       # int32 (R,)
  table_mj: jax.Array       # int32: local page ids (W: none)
  ref: jax.Array            # int32 (R, W): each page's count
  k: tuple                  # (R, K, W, Z, E) per layer
  v: tuple
  tokens_nt: jax.Array
  logp_nt: jax.Array
  stats: PageStats


def pages_needed(prompt_len: int, max_new_tokens: int, page_size: int) -> int:
  """Table entries of a row: its columns are at most P + T - 1."""
  return -(-(prompt_len + max_new_tokens) // page_size)


def pool_axes(pool_layout: paged.PoolLayout) -> tuple:
  """Logical axes of the (R, ...) pools: R over the batch axes."""
  return (sharding.BATCH,) + pool_layout.axes


def _pin_carry(layout: Layout, pool_layout: paged.PoolLayout, c: _Carry
               ) -> _Carry:
  if layout is None:
    return c
  rows = lambda x: layout.constrain(x, (sharding.BATCH,))
  pool = lambda x: layout.constrain(x, pool_axes(pool_layout))
  return c._replace(
      row_m=rows(c.row_m), t_m=rows(c.t_m), live_m=rows(c.live_m),
      wait_m=rows(c.wait_m), table_mj=rows(c.table_mj), ref=rows(c.ref),
      k=tuple(map(pool, c.k)), v=tuple(map(pool, c.v)),
      tokens_nt=rows(c.tokens_nt), logp_nt=rows(c.logp_nt))


def _compact(kv_bkpe: jax.Array, prompt_len_b: jax.Array, Z: int) -> jax.Array:
  """Left-padded prompt keys -> pages without the padding: (B, K, C, Z, E),
  C = P // Z + 1 (column c of prompt b is its position c; zeros past it)."""
  B, K, P, E = kv_bkpe.shape
  C = P // Z + 1
  col = jnp.arange(C * Z)
  src = jnp.minimum(col[None] + (P - prompt_len_b)[:, None], P - 1)
  kept = jnp.take_along_axis(kv_bkpe, src[:, None, :, None], axis=2)
  kept = jnp.where((col[None] < prompt_len_b[:, None])[:, None, :, None],
                   kept, 0)
  return kept.reshape(B, K, C, Z, E)


def zero_pool(model_config: ModelConfig, W: int, Z: int, R: int, dtype,
              layout: Layout, pool_layout: paged.PoolLayout) -> PagePool:
  """A PagePool of zeros (inside jit: pinned to the layout's shards)."""
  c = model_config
  shape = (R,) + pool_layout.shape(c.num_kv_heads, W, Z, c.head_dim)
  pin = (lambda x: x) if layout is None else (
      lambda x: layout.constrain(x, pool_axes(pool_layout)))
  layers = lambda: tuple(pin(jnp.zeros(shape, dtype))
                         for _ in range(c.num_layers))
  return PagePool(layers(), layers())


def _prefill_pool(pp: decoding.PromptPass, prompt_len_b, full_b, table_bj,
                  pool: PagePool, Z: int, R: int, layout: Layout,
                  pool_layout: paged.PoolLayout):
  """`pool` with every prompt's full pages written at its table's pages,
  and the tails (B, K, Z, E) per layer, for keys and values."""
  L = pp.k.shape[0]
  C = pp.k.shape[3] // Z + 1

  def layer(kv_bkpe, pool):
    pages_bkjze = _compact(kv_bkpe, prompt_len_b, Z)
    tail = jnp.take_along_axis(
        pages_bkjze, full_b[:, None, None, None, None], axis=2)[:, :, 0]
    pool = jax.vmap(pool_layout.put)(
        pool, continuous._per_shard(R, jnp.moveaxis(pages_bkjze, 2, 1)),
        continuous._per_shard(R, table_bj[:, :C]))
    pin = (lambda x, a: x) if layout is None else layout.constrain
    return pin(pool, pool_axes(pool_layout)), pin(tail, TAIL_AXES)

  ks, k_tails = zip(*(layer(pp.k[i], pool.k[i]) for i in range(L)))
  vs, v_tails = zip(*(layer(pp.v[i], pool.v[i]) for i in range(L)))
  return ks, vs, k_tails, v_tails


def _copy_tails(pools: tuple, tails: tuple, prompt_m, page_m, R: int,
                pool_layout: paged.PoolLayout) -> tuple:
  """Prompt prompt_m[m]'s tail into page page_m[m] of slot m's shard
  (W, no page: nowhere), every layer."""
  split = functools.partial(continuous._per_shard, R)
  return tuple(jax.vmap(pool_layout.put)(
      pool, split(continuous._shard_take(tail, prompt_m, R)), split(page_m))
               for pool, tail in zip(pools, tails))


def decode_constrain(layout: Layout, slots: int, dim: int
                     ) -> transformer.Constrain:
  """The decode step's activation constraints. Where the rows of a group of
  chips that split the weights' `embed` axis (fsdp) are fewer than the model
  width D, the residual stream (M, 1, D) gets D split as the weights' is
  and its rows over the other batch axes only: the projections' contracting
  dimension is then split as the weights' is, so each chip multiplies its
  own weight slice and exchanges activations (rows x D), not weights
  (D x F). Left to itself, XLA all-gathered the weights at every decode
  step once those rows were many: the paper config's 128 slots per row
  shard on v5p:8x8x4 (1,024 rows per fsdp group, D = 5,120) moved 16.2 GB
  per chip per step; so constrained, 1.3 GB (docs/paged.md). Otherwise
  (small models, many rows) XLA chooses."""
  if layout is None:
    return transformer.no_constraint
  rules = dict(layout.rules)
  embed = [a for a in rules.get("embed", ()) if layout.mesh.shape[a] > 1]
  group_rows = slots // layout.batch_shards * math.prod(
      layout.mesh.shape[a] for a in embed)
  if not embed or group_rows >= dim:
    return transformer.no_constraint
  rows = tuple(a for a in rules.get(sharding.BATCH, ()) if a not in embed)
  residual = sharding.Layout(layout.mesh, tuple(
      (k, rows if k == sharding.BATCH else v) for k, v in layout.rules))

  def constrain(x: jax.Array, axes: tuple) -> jax.Array:
    if tuple(axes) == transformer.RESIDUAL_AXES:
      return residual.constrain(x, axes[:-1] + ("embed",))
    return layout.constrain(x, axes)
  return constrain


def _kernel_fn(layout: Layout):
  """The kernel over R shards' pools: one shard per device (Mosaic kernels
  are not partitioned automatically), rows over the batch axes and KV
  heads (and their query heads) as the rules split the pool."""
  one = lambda q, k, v, n, t: paged.kernel_attention(
      q[0], k[0], v[0], n[0], t[0])[None]
  if layout is None:
    return one

  def attend(q, k, v, n, t):
    spec = sharding.spec_for(pool_axes(paged.KERNEL_LAYOUT), k.shape,
                             layout.mesh, layout.rules)
    rows, heads = (tuple(spec) + (None, None))[:2]
    pool = PartitionSpec(rows, heads)
    f = jax.shard_map(one, mesh=layout.mesh,
                      in_specs=(PartitionSpec(rows, None, heads), pool, pool,
                                PartitionSpec(rows), PartitionSpec(rows)),
                      out_specs=PartitionSpec(rows, None, heads),
                      check_vma=False)
    return f(q, k, v, n, t)
  return attend


def _victims(live_m, waiting_m, row_m):
  """One shard: the youngest live slot when the oldest live one waits for
  a page (and is not itself the youngest)."""
  big = jnp.iinfo(jnp.int32).max
  oldest = jnp.argmin(jnp.where(live_m, row_m, big))
  youngest = jnp.argmax(jnp.where(live_m, row_m, -1))
  hit = jnp.any(live_m) & waiting_m[oldest] & (youngest != oldest)
  return hit & (jnp.arange(live_m.shape[0]) == youngest)


def _take_rows(c: _Carry, first_n, row_limit, table_bj, G, T, cfg, R):
  """REFILL: idle slots take the next rows of their shard and wait, their
  tables the prompt's shared pages. A row whose first token stops (or
  T = 1) ends at once: it drops its reference to its prompt's pages."""
  take_m, new_row_m, next_row = continuous._assign(c.live_m | c.wait_m,
                                                   c.next_row, row_limit)
  row_m = jnp.where(take_m, new_row_m, c.row_m)
  table_mj = jnp.where(take_m[:, None],
                       continuous._shard_take(table_bj, row_m // G, R),
                       c.table_mj)
  first_m = continuous._shard_take(first_n, row_m, R)
  done_m = take_m & (decoding.is_stop(first_m, cfg.stop_ids) | (T <= 1))
  split = functools.partial(continuous._per_shard, R)
  ref = jax.vmap(pages.release)(c.ref, split(table_mj), split(done_m),
                                split(jnp.zeros_like(row_m)))
  return c._replace(row_m=row_m, t_m=jnp.where(take_m, 1, c.t_m),
                    wait_m=c.wait_m | (take_m & ~done_m), next_row=next_row,
                    table_mj=jnp.where(done_m[:, None], ref.shape[1],
                                       table_mj), ref=ref)


def _pages_step(c: _Carry, prompt_m, full_m, column_m, tails, R: int,
                pool_layout: paged.PoolLayout):
  """PAGES (module docstring): grants, tail copies, preemption. Returns the
  carry and the slots that decode this step."""
  M, J = c.table_mj.shape
  W = c.ref.shape[1]
  N = c.tokens_nt.shape[0]
  split = functools.partial(continuous._per_shard, R)
  j_m = column_m // c.k[0].shape[3]
  entry_m = jnp.take_along_axis(c.table_mj, jnp.minimum(j_m, J - 1)[:, None],
                                1)[:, 0]
  grow_m = c.live_m & (entry_m >= W)
  order_m = jnp.where(c.live_m, c.row_m, c.row_m + N)
  n_live = split(c.live_m).sum(1, keepdims=True)
  keep_m = jnp.where(c.wait_m, jnp.repeat(n_live, M // R), 0)
  ref, page_m, got_m = jax.vmap(pages.grant)(
      c.ref, split(grow_m | c.wait_m), split(order_m), split(keep_m.reshape(-1)))
  page_m, got_m = page_m.reshape(M), got_m.reshape(M)
  start_m = c.wait_m & got_m
  table_mj = pages.set_entry(c.table_mj, jnp.where(start_m, full_m, j_m),
                             page_m, got_m)
  copy = functools.partial(_copy_tails, prompt_m=prompt_m,
                           page_m=jnp.where(start_m, page_m, W), R=R,
                           pool_layout=pool_layout)
  k, v = copy(c.k, tails[0]), copy(c.v, tails[1])
  waiting_m = grow_m & ~got_m
  victim_m = jax.vmap(_victims)(split(c.live_m), split(waiting_m),
                                split(c.row_m)).reshape(M)
  ref = jax.vmap(pages.release)(ref, split(table_mj), split(victim_m),
                                split(full_m))
  own_mj = jnp.arange(J)[None] >= full_m[:, None]
  table_mj = jnp.where(victim_m[:, None] & own_mj, W, table_mj)
  live_m = (c.live_m | start_m) & ~victim_m
  stats = c.stats._replace(
      preempted=c.stats.preempted + victim_m.sum(),
      waited=c.stats.waited + waiting_m.sum(),
      peak_pages=jnp.maximum(c.stats.peak_pages, jnp.sum(ref > 0)))
  c = c._replace(t_m=jnp.where(victim_m, 1, c.t_m), live_m=live_m,
                 wait_m=(c.wait_m & ~start_m) | victim_m, table_mj=table_mj,
                 ref=ref, k=k, v=v, stats=stats)
  return c, live_m & ~waiting_m


_STATIC = ("model_config", "cfg", "num_generations", "slots", "pool_pages",
           "layout", "check_pages")


@functools.partial(jax.jit, static_argnames=_STATIC)
def sample_pages(model_config: ModelConfig, params: transformer.Params,
                 prompt_bp: jax.Array, prompt_len_b: jax.Array, key: jax.Array,
                 cfg: decoding.SamplingConfig, num_generations: int,
                 slots: int, pool_pages: int, real_prompts: jax.Array,
                 layout: Layout = None, check_pages: bool = False) -> tuple:
  """G completions of each left-padded prompt (B, P) by continuous batching
  over `slots` slots and a pool of `pool_pages` pages of cfg.page_size
  columns per row shard (module docstring), the pool allocated for this
  call. The pool must hold the shard's prompts' full pages plus
  `pages_needed` (the host checks). check_pages: count `pages.conflicts`
  every step (tests; O(pool) per step). Returns (Samples, PageStats)."""
  return _sample_pages(model_config, params, prompt_bp, prompt_len_b, key,
                       cfg, num_generations, slots, pool_pages, real_prompts,
                       layout, check_pages, None)[:2]


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames="pool")
def sample_pages_reusing(pool: PagePool, model_config: ModelConfig,
                         params: transformer.Params, prompt_bp: jax.Array,
                         prompt_len_b: jax.Array, key: jax.Array,
                         cfg: decoding.SamplingConfig, num_generations: int,
                         slots: int, pool_pages: int, real_prompts: jax.Array,
                         layout: Layout = None, check_pages: bool = False
                         ) -> tuple:
  """`sample_pages` in a kept pool (`new_pool`'s, or the previous call's):
  donated, so its buffers hold this call's pages, and returned. Returns
  (Samples, PageStats, PagePool)."""
  return _sample_pages(model_config, params, prompt_bp, prompt_len_b, key,
                       cfg, num_generations, slots, pool_pages, real_prompts,
                       layout, check_pages, pool)


def pool_dtype(params: transformer.Params):
  """The dtype of a call's keys and values: the weights'."""
  return params["embed"].dtype


@functools.partial(jax.jit, static_argnames=("model_config", "cfg",
                                             "pool_pages", "layout", "dtype"))
def new_pool(model_config: ModelConfig, cfg: decoding.SamplingConfig,
             pool_pages: int, dtype, layout: Layout = None) -> PagePool:
  """A zero PagePool for `sample_pages_reusing` (made once per run; the
  layout's row shards each hold their own)."""
  R = 1 if layout is None else layout.batch_shards
  impl = paged.resolve(cfg.paged_kernel, model_config)
  return zero_pool(model_config, pool_pages, cfg.page_size, R, dtype, layout,
                   paged.pool_layout(impl))


def _sample_pages(model_config, params, prompt_bp, prompt_len_b, key, cfg,
                  num_generations, slots, pool_pages, real_prompts, layout,
                  check_pages, pool) -> tuple:
  """The program of both entry points; pool None: zeros of this call."""
  B, P = prompt_bp.shape
  G, T, Z, W = num_generations, cfg.max_new_tokens, cfg.page_size, pool_pages
  N, M = B * G, slots
  R = 1 if layout is None else layout.batch_shards
  if B % R or M % R:
    raise ValueError(f"{B} prompts and {M} slots must be multiples of the "
                     f"{R} row shards")
  J = pages_needed(P, T, Z)
  split = functools.partial(continuous._per_shard, R)
  impl = paged.resolve(cfg.paged_kernel, model_config)
  pool_layout = paged.pool_layout(impl)

  # PREFILL: each prompt once into shared pages; first tokens.
  prompt_bp, prompt_len_b = (continuous._pin(layout, x)
                             for x in (prompt_bp, prompt_len_b))
  pp = decoding.prompt_pass(model_config, params, prompt_bp, prompt_len_b)
  row_n = jnp.arange(N, dtype=jnp.int32)
  first_n, logp_n = decoding.choose_tokens(
      continuous._pin(layout, jnp.repeat(pp.logits_bv, G, axis=0)), key, cfg,
      row_n, 0)
  tokens_nt = jnp.full((N, T), cfg.pad_id, jnp.int32).at[:, 0].set(first_n)
  logp_nt = jnp.zeros((N, T), jnp.float32).at[:, 0].set(logp_n)
  zero = jnp.int32(0)
  if pool is None:
    pool = zero_pool(model_config, W, Z, R, pp.k.dtype, layout, pool_layout)
  want = (R,) + pool_layout.shape(model_config.num_kv_heads, W, Z,
                                  model_config.head_dim)
  if pool.k[0].shape != want or pool.k[0].dtype != pp.k.dtype:
    raise ValueError(f"the kept page pool is {pool.k[0].dtype}"
                     f"{list(pool.k[0].shape)}; this call needs "
                     f"{pp.k.dtype}{list(want)}")
  if T == 1:
    return (decoding.finish(tokens_nt, logp_nt, zero, cfg),
            PageStats(zero, zero, zero, zero, zero), pool)

  real_b = jnp.arange(B) < real_prompts
  full_b = jnp.where(real_b, prompt_len_b // Z, 0)
  table_bj = jax.vmap(lambda f: pages.prompt_tables(f, J, W))(
      split(full_b)).reshape(B, J)
  ref = jax.vmap(lambda t: pages.count(jnp.zeros((W,), jnp.int32), t,
                                       jnp.ones(t.shape, bool), G))(
      split(table_bj))
  ks, vs, k_tails, v_tails = _prefill_pool(pp, prompt_len_b, full_b, table_bj,
                                           pool, Z, R, layout, pool_layout)
  N_local = N // R
  first_row = jnp.arange(R, dtype=jnp.int32) * N_local
  row_limit = first_row + jnp.clip(real_prompts * G - first_row, 0, N_local)
  take = functools.partial(_take_rows, first_n=first_n, row_limit=row_limit,
                           table_bj=table_bj, G=G, T=T, cfg=cfg, R=R)
  zeros_m, no_m = jnp.zeros((M,), jnp.int32), jnp.zeros((M,), bool)
  pin = functools.partial(_pin_carry, layout, pool_layout)
  carry = pin(take(_Carry(
      zero, zeros_m, zeros_m, no_m, no_m, first_row,
      jnp.full((M, J), W, jnp.int32), ref, ks, vs, tokens_nt, logp_nt,
      PageStats(zero, zero, zero, zero, zero))))
  layers = transformer.unstack_layers(params, model_config.num_layers)
  constrain = decode_constrain(layout, M, model_config.dim)

  def running(c: _Carry):
    return jnp.any(c.live_m | c.wait_m) | jnp.any(c.next_row < row_limit)

  def step(c: _Carry):
    prompt_m = c.row_m // G
    full_m = continuous._shard_take(full_b, prompt_m, R)
    column_m = continuous._shard_take(prompt_len_b, prompt_m, R) + c.t_m - 1
    steps = c.steps + running(c).astype(jnp.int32)
    # PAGES, then DECODE the slots that have their page.
    c, active_m = _pages_step(c, prompt_m, full_m, column_m,
                              (k_tails, v_tails), R, pool_layout)
    j_m = column_m // Z
    entry_m = jnp.take_along_axis(c.table_mj, jnp.minimum(j_m, J - 1)[:, None],
                                  1)[:, 0]
    prev_m = continuous._read(c.tokens_nt, c.row_m, c.t_m - 1, R)
    filled = jnp.max(jnp.where(active_m, j_m + 1, 0))
    attend = (paged.reference_fn(model_config, filled) if impl == "reference"
              else _kernel_fn(layout))
    logits_mv, k, v = paged.decode_step(
        model_config, params, c.k, c.v, prev_m, column_m,
        jnp.where(active_m, entry_m, W), c.table_mj, attend, layers, R,
        pool_layout, constrain)
    tok_m, logp_m = decoding.choose_tokens(logits_mv, key, cfg, c.row_m, c.t_m)
    tokens_nt = continuous._write(c.tokens_nt, c.row_m, c.t_m, tok_m, active_m,
                                  R)
    logp_nt = continuous._write(c.logp_nt, c.row_m, c.t_m, logp_m, active_m, R)
    ended_m = active_m & (decoding.is_stop(tok_m, cfg.stop_ids)
                          | (c.t_m + 1 >= T))
    ref = jax.vmap(pages.release)(c.ref, split(c.table_mj), split(ended_m),
                                  split(jnp.zeros_like(c.row_m)))
    table_mj = jnp.where(ended_m[:, None], W, c.table_mj)
    live_m = c.live_m & ~ended_m
    bad = (jax.vmap(pages.conflicts)(ref, split(table_mj),
                                     split(live_m | c.wait_m), split(full_m))
           if check_pages else zero)
    c = c._replace(steps=steps, t_m=jnp.where(active_m, c.t_m + 1, c.t_m),
                   live_m=live_m, table_mj=table_mj, ref=ref, k=k, v=v,
                   tokens_nt=tokens_nt, logp_nt=logp_nt,
                   stats=c.stats._replace(
                       conflicts=c.stats.conflicts + bad.sum()))
    return pin(take(c))

  with jax.named_scope(decoding.DECODE_SCOPE):
    final = jax.lax.while_loop(
        running, continuous.every(step, cfg.stop_check_every), carry)
  out = decoding.finish(final.tokens_nt, final.logp_nt, final.steps, cfg)
  stats = final.stats._replace(in_use_end=jnp.sum(final.ref != 0))
  return (decoding.Samples(*(continuous._pin(layout, x) for x in out[:-1]),
                           steps=out.steps), stats,
          PagePool(final.k, final.v))
