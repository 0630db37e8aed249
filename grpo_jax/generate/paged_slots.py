"""Continuous batching over a paged KV cache (`sampling.kv_cache = "paged"`).

`continuous.sample_slots` gives each slot a dense cache of P + T columns
and copies a group's prompt into each of its G slots; every step attends
over every slot up to the longest live row. Here the keys and values live
in a pool of pages per row shard (`models.paged`: (K, W, Z, E) per layer,
the TPU kernel's layout) and each slot has a page table:

  prefill   every prompt once (slots.start); its full pages are
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
            pages and its reference to its prompt's pages. Recording
            routes (MoE replay), each step writes the fed token's experts
            at its column, and a row whose last token is sampled stays
            live one more step as a tail that feeds it for its experts
            only (the dense slots' rule, docs/models.md).

Rows are thus admitted by free pages, not by a P + T reservation per
slot: with more slots than the pool could hold at full length, more rows
decode at once in the same memory. Samples equal the dense sampler's (the
same (key, row, t) noise, the same logits up to float rounding).

The loop's pieces shared with the dense slots (prefill, row assignment,
per-shard reads and writes) are `slots`'; the pools themselves (made,
filled, tails copied, the decode step's placement) are `page_pool`'s.

`PageStats` says what the pool did (tests check the accounting: every
page back at the end, no page writable by two slots). Shape letters as in
`grpo_jax` and `models.paged`; per-shard arrays (a leading R) carry no
suffix.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from grpo_jax import sharding
from grpo_jax.generate import decoding, page_pool, pages, slots
from grpo_jax.models import decode, page_layout, paged, transformer

Layout = Optional[sharding.Layout]


class PageStats(NamedTuple):
  """What the page pool did in one call (int32 scalars)."""
  preempted: jax.Array      # rows preempted (restarted from their first token)
  waited: jax.Array         # slot-steps a live row waited for a page
  peak_pages: jax.Array     # most pages in use at once, summed over shards
  in_use_end: jax.Array     # pages still counted at the end (0: all returned)
  conflicts: jax.Array      # page-steps writable by two slots (0: sound;
                            # counted with check_pages only)


class _Carry(NamedTuple):
  steps: jax.Array
  row_m: jax.Array          # int32: the (global) row each slot holds
  t_m: jax.Array            # int32: tokens chosen so far
  live_m: jax.Array         # bool: decoding
  wait_m: jax.Array         # bool: holds a row that has not started
  next_row: jax.Array       # int32 (R,)
  table_mj: jax.Array       # int32: local page ids (W: none)
  ref: jax.Array            # int32 (R, W): each page's count
  pool: paged.PagePool      # (R,) + pool layout's shape, per layer
  tokens_nt: jax.Array
  logp_nt: jax.Array
  stats: PageStats
  # record_routes: slots whose row's last token is sampled and is fed once
  # more for its experts only (a tail: it decodes, waits and may be
  # preempted as a live row does); each completion column's experts (N, T,
  # L_sparse, C). Else no slot and None.
  tail_m: jax.Array
  routes_ntlc: Optional[jax.Array] = None


def _pin_carry(layout: Layout, pool_layout: page_layout.PoolLayout, c: _Carry
               ) -> _Carry:
  if layout is None:
    return c
  rows = lambda x: layout.constrain(x, (sharding.BATCH,))
  pool = functools.partial(page_pool.pin_pool, layout, pool_layout)
  return c._replace(
      row_m=rows(c.row_m), t_m=rows(c.t_m), live_m=rows(c.live_m),
      wait_m=rows(c.wait_m), table_mj=rows(c.table_mj), ref=rows(c.ref),
      pool=paged.PagePool(tuple(map(pool, c.pool.k)),
                          tuple(map(pool, c.pool.v))),
      tokens_nt=rows(c.tokens_nt), logp_nt=rows(c.logp_nt),
      tail_m=rows(c.tail_m),
      routes_ntlc=None if c.routes_ntlc is None else rows(c.routes_ntlc))


def _victims(live_m, waiting_m, row_m):
  """One shard: the youngest live slot when the oldest live one waits for
  a page (and is not itself the youngest)."""
  big = jnp.iinfo(jnp.int32).max
  oldest = jnp.argmin(jnp.where(live_m, row_m, big))
  youngest = jnp.argmax(jnp.where(live_m, row_m, -1))
  hit = jnp.any(live_m) & waiting_m[oldest] & (youngest != oldest)
  return hit & (jnp.arange(live_m.shape[0]) == youngest)


def _take_rows(c: _Carry, begun: slots.Start, table_bj: jax.Array,
               call: decoding.CallSpec) -> _Carry:
  """REFILL: idle slots take the next rows of their shard and wait, their
  tables the prompt's shared pages. A row whose first token stops (or
  T = 1) ends at once: it drops its reference to its prompt's pages
  (recording routes: it waits as a tail, to feed that token once)."""
  G, T, R = call.num_generations, call.sampling.max_new_tokens, call.shards
  record = call.sampling.record_routes
  take_m, new_row_m, next_row = slots.assign(c.live_m | c.wait_m,
                                             c.next_row, begun.row_limit)
  row_m = jnp.where(take_m, new_row_m, c.row_m)
  table_mj = jnp.where(take_m[:, None],
                       slots.shard_take(table_bj, row_m // G, R), c.table_mj)
  first_m = slots.shard_take(begun.first_n, row_m, R)
  stops_m = take_m & (decoding.is_stop(first_m, call.sampling.stop_ids)
                      | (T <= 1))
  done_m = stops_m & (not record)
  split = functools.partial(slots.per_shard, R)
  ref = jax.vmap(pages.release)(c.ref, split(table_mj), split(done_m),
                                split(jnp.zeros_like(row_m)))
  return c._replace(row_m=row_m, t_m=jnp.where(take_m, 1, c.t_m),
                    wait_m=c.wait_m | (take_m & ~done_m), next_row=next_row,
                    table_mj=jnp.where(done_m[:, None], ref.shape[1],
                                       table_mj), ref=ref,
                    tail_m=c.tail_m | (stops_m & record))


def _pages_step(c: _Carry, prompt_m, full_m, column_m, tails,
                pool_layout: page_layout.PoolLayout, first_tail_m):
  """PAGES (module docstring): grants, tail copies, preemption (a
  preempted row restarts at its first token: a route-recording tail again
  only where that token stops it, first_tail_m). Returns the carry and the
  slots that decode this step."""
  M, J = c.table_mj.shape
  R, W = c.ref.shape
  N = c.tokens_nt.shape[0]
  split = functools.partial(slots.per_shard, R)
  j_m = column_m // paged.page_values(c.pool.k[0]).shape[3]
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
  copy = functools.partial(page_pool.copy_tails, prompt_m=prompt_m,
                           page_m=jnp.where(start_m, page_m, W), R=R,
                           layout=pool_layout)
  pool = paged.PagePool(copy(c.pool.k, tails[0]), copy(c.pool.v, tails[1]))
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
                 ref=ref, pool=pool, stats=stats,
                 tail_m=jnp.where(victim_m, first_tail_m, c.tail_m))
  return c, live_m & ~waiting_m


@functools.partial(jax.jit, static_argnames="call")
def sample_pages(call: decoding.CallSpec, params: transformer.Params,
                 prompt_bp: jax.Array, prompt_len_b: jax.Array, key: jax.Array,
                 real_prompts: jax.Array) -> tuple:
  """G completions of each left-padded prompt (B, P) by continuous batching
  over `call.slots` slots and a pool of `call.pool_pages` pages of
  page_size columns per row shard (module docstring), the pool allocated
  for this call. The pool must hold the shard's prompts' full pages plus
  `page_pool.pages_needed` (the host checks). call.check_pages: count
  `pages.conflicts` every step (tests; O(pool) per step). Returns
  (Samples, PageStats)."""
  return _sample_pages(call, params, prompt_bp, prompt_len_b, key,
                       real_prompts, None)[:2]


@functools.partial(jax.jit, static_argnames="call", donate_argnames="pool")
def sample_pages_reusing(pool: paged.PagePool, call: decoding.CallSpec,
                         params: transformer.Params, prompt_bp: jax.Array,
                         prompt_len_b: jax.Array, key: jax.Array,
                         real_prompts: jax.Array) -> tuple:
  """`sample_pages` in a kept pool (`page_pool.new_pool`'s, or the previous
  call's): donated, so its buffers hold this call's pages, and returned
  (it depends on no row and no weight; a call's page tables and counts
  start afresh, and stale pages are never read: a row reads only its own
  columns, masked by length). Returns (Samples, PageStats, PagePool)."""
  return _sample_pages(call, params, prompt_bp, prompt_len_b, key,
                       real_prompts, pool)


def _check_pool(call: decoding.CallSpec, pool: paged.PagePool, dtype) -> None:
  """Raises unless a kept pool has this call's shape and dtype."""
  c = call.model_config
  want = (call.shards,) + page_pool.pool_layout(call).shape(
      c.num_kv_heads, call.pool_pages, call.sampling.page_size, c.head_dim)
  dtype = jnp.dtype(call.sampling.kv_dtype or dtype)
  have = paged.page_values(pool.k[0])
  if have.shape != want or have.dtype != dtype:
    raise ValueError(f"the kept page pool is {have.dtype}"
                     f"{list(have.shape)}; this call needs "
                     f"{dtype}{list(want)}")


def _sample_pages(call, params, prompt_bp, prompt_len_b, key, real_prompts,
                  pool) -> tuple:
  """The program of both entry points; pool None: zeros of this call."""
  B, P = prompt_bp.shape
  slots.check_shards(call, B)
  model_config, sampling = call.model_config, call.sampling
  G, T, Z = call.num_generations, sampling.max_new_tokens, sampling.page_size
  W, M, R = call.pool_pages, call.slots, call.shards
  J = page_pool.pages_needed(P, T, Z)
  split = functools.partial(slots.per_shard, R)
  pool_layout = page_pool.pool_layout(call)
  record = sampling.record_routes
  if record and T == 1:
    raise ValueError("record_routes with continuous batching needs "
                     "max_new_tokens >= 2")

  # PREFILL: each prompt once into shared pages; first tokens.
  begun = slots.start(call, params, prompt_bp, prompt_len_b, key,
                      real_prompts)
  zero = jnp.int32(0)
  dtype = begun.pp.k.dtype
  if pool is None:
    pool = page_pool.zero_pool(model_config, W, Z, R, dtype, call.layout,
                               pool_layout, sampling.kv_dtype)
  _check_pool(call, pool, dtype)
  if T == 1:
    return (decoding.finish(begun.tokens_nt, begun.logp_nt, zero, sampling),
            PageStats(zero, zero, zero, zero, zero), pool)

  prompt_len_b = begun.prompt_len_b
  real_b = jnp.arange(B) < real_prompts
  full_b = jnp.where(real_b, prompt_len_b // Z, 0)
  table_bj = jax.vmap(lambda f: pages.prompt_tables(f, J, W))(
      split(full_b)).reshape(B, J)
  ref = jax.vmap(lambda t: pages.count(jnp.zeros((W,), jnp.int32), t,
                                       jnp.ones(t.shape, bool), G))(
      split(table_bj))
  pool, tails = page_pool.prefill(call, begun.pp, prompt_len_b, full_b,
                                  table_bj, pool)
  take = functools.partial(_take_rows, begun=begun, table_bj=table_bj,
                           call=call)
  zeros_m, no_m = jnp.zeros((M,), jnp.int32), jnp.zeros((M,), bool)
  pin = functools.partial(_pin_carry, call.layout, pool_layout)
  carry = pin(take(_Carry(
      zero, zeros_m, zeros_m, no_m, no_m, begun.first_row,
      jnp.full((M, J), W, jnp.int32), ref, pool, begun.tokens_nt,
      begun.logp_nt, PageStats(zero, zero, zero, zero, zero), no_m,
      slots.new_routes(call, B * G))))
  weights = decode.weights(model_config, params)

  def running(c: _Carry):
    return (jnp.any(c.live_m | c.wait_m)
            | jnp.any(c.next_row < begun.row_limit))

  def step(c: _Carry):
    prompt_m = c.row_m // G
    full_m = slots.shard_take(full_b, prompt_m, R)
    column_m = slots.shard_take(prompt_len_b, prompt_m, R) + c.t_m - 1
    steps = c.steps + running(c).astype(jnp.int32)
    first_tail_m = record & decoding.is_stop(
        slots.shard_take(begun.first_n, c.row_m, R), sampling.stop_ids)
    # PAGES, then DECODE the slots that have their page.
    c, active_m = _pages_step(c, prompt_m, full_m, column_m, tails,
                              pool_layout, first_tail_m)
    j_m = column_m // Z
    entry_m = jnp.take_along_axis(c.table_mj, jnp.minimum(j_m, J - 1)[:, None],
                                  1)[:, 0]
    prev_m = slots.read(c.tokens_nt, c.row_m, c.t_m - 1, R)
    filled = jnp.max(jnp.where(active_m, j_m + 1, 0))
    logits_mv, pool, *taken = paged.decode_step(
        model_config, weights, c.pool, prev_m,
        paged.RowPages(column_m, jnp.where(active_m, entry_m, W), c.table_mj),
        page_pool.decode_settings(call, filled, J), record)
    routes = c.routes_ntlc
    if record:     # the fed token's experts, at its column t - 1
      routes = slots.write(routes, c.row_m, c.t_m - 1, jnp.moveaxis(
          taken[0], 0, 1).astype(routes.dtype), active_m, R)
    tok_m, logp_m = decoding.choose_tokens(logits_mv, key, sampling, c.row_m,
                                           c.t_m)
    keep_m = active_m & ~c.tail_m        # a tail's step samples nothing
    tokens_nt = slots.write(c.tokens_nt, c.row_m, c.t_m, tok_m, keep_m, R)
    logp_nt = slots.write(c.logp_nt, c.row_m, c.t_m, logp_m, keep_m, R)
    last_m = keep_m & (decoding.is_stop(tok_m, sampling.stop_ids)
                       | (c.t_m + 1 >= T))
    # Recording, a row's last token makes it a tail, which ends a step later.
    ended_m = (active_m & c.tail_m) | (last_m & (not record))
    ref = jax.vmap(pages.release)(c.ref, split(c.table_mj), split(ended_m),
                                  split(jnp.zeros_like(c.row_m)))
    table_mj = jnp.where(ended_m[:, None], W, c.table_mj)
    live_m = c.live_m & ~ended_m
    bad = (jax.vmap(pages.conflicts)(ref, split(table_mj),
                                     split(live_m | c.wait_m), split(full_m))
           if call.check_pages else zero)
    c = c._replace(steps=steps, t_m=jnp.where(active_m, c.t_m + 1, c.t_m),
                   live_m=live_m, table_mj=table_mj, ref=ref, pool=pool,
                   tokens_nt=tokens_nt, logp_nt=logp_nt,
                   stats=c.stats._replace(
                       conflicts=c.stats.conflicts + bad.sum()),
                   tail_m=(c.tail_m & ~ended_m) | (last_m & record),
                   routes_ntlc=routes)
    return pin(take(c))

  with jax.named_scope(decoding.DECODE_SCOPE):
    final = jax.lax.while_loop(
        running, slots.every(step, sampling.stop_check_every), carry)
  stats = final.stats._replace(in_use_end=jnp.sum(final.ref != 0))
  return (slots.finish(call, final.tokens_nt, final.logp_nt, final.steps,
                       begun.pp, final.routes_ntlc), stats, final.pool)
