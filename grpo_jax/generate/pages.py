"""The page pool's bookkeeping for one row shard: reference counts, page
tables, grants in priority order, release. Pure functions of small int
arrays (the keys and values themselves live in `models.paged`'s pools);
`paged_slots` vmaps them over the row shards.

A page is free when its count is 0. A prompt's full pages are counted once
per row of its group that has not ended (G at the start), a row's own pages
(the copy of its prompt's partly-filled last page, then one page per Z
columns it writes) once. So a group's prompt pages return to the pool when
its last row ends, and a row's own pages when it ends or is preempted.

Shapes: W pages in the shard's pool, M the shard's slots, J page-table
entries per slot, B the shard's prompts.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def prompt_tables(full_b: jax.Array, J: int, W: int) -> jax.Array:
  """(B, J) page tables of the shard's prompts, laid out one after the
  other from page 0: prompt b's full pages j < full_b[b]; W elsewhere."""
  start_b = jnp.cumsum(full_b) - full_b
  j = jnp.arange(J)
  return jnp.where(j[None] < full_b[:, None], start_b[:, None] + j[None], W)


def count(ref_w: jax.Array, table_mj: jax.Array, do_mj: jax.Array,
          delta: int) -> jax.Array:
  """ref_w[table_mj[m, j]] += delta where do_mj (and the entry is a page)."""
  W = ref_w.shape[0]
  idx = jnp.where(do_mj & (table_mj < W), table_mj, W)
  return ref_w.at[idx.reshape(-1)].add(delta, mode="drop")


def release(ref_w: jax.Array, table_mj: jax.Array, do_m: jax.Array,
            from_m: jax.Array) -> jax.Array:
  """Slots do_m drop their references to table entries j >= from_m[m]
  (0: the whole row, a row that ended; the prompt's page count: its own
  pages only, a row preempted)."""
  j = jnp.arange(table_mj.shape[1])
  return count(ref_w, table_mj, do_m[:, None] & (j[None] >= from_m[:, None]),
               -1)


def grant(ref_w: jax.Array, want_m: jax.Array, order_m: jax.Array,
          keep_m: jax.Array) -> tuple:
  """Free pages to the slots that want one, lowest order_m first: the i-th
  such slot gets the i-th free page if i < free pages - keep_m[m] (pages it
  must leave for others). Returns the new counts, each slot's page (W where
  none) and whether it got one."""
  W, M = ref_w.shape[0], want_m.shape[0]
  free_w = ref_w == 0
  ids_m = jnp.nonzero(free_w, size=M, fill_value=W)[0]
  key_m = jnp.where(want_m, order_m, jnp.iinfo(jnp.int32).max)
  rank_m = jnp.argsort(jnp.argsort(key_m, stable=True), stable=True)
  got_m = want_m & (rank_m < jnp.sum(free_w) - keep_m)
  page_m = jnp.where(got_m, ids_m[jnp.minimum(rank_m, M - 1)], W)
  return ref_w.at[page_m].add(1, mode="drop"), page_m, got_m


def set_entry(table_mj: jax.Array, j_m: jax.Array, page_m: jax.Array,
              do_m: jax.Array) -> jax.Array:
  """table_mj[m, j_m[m]] = page_m[m] where do_m."""
  hit_mj = do_m[:, None] & (jnp.arange(table_mj.shape[1])[None] == j_m[:, None])
  return jnp.where(hit_mj, page_m[:, None], table_mj)


def conflicts(ref_w: jax.Array, table_mj: jax.Array, holds_m: jax.Array,
              own_from_m: jax.Array) -> jax.Array:
  """Pages two slots could write, as a count (0 when sound): a slot's own
  page (entries j >= own_from_m) referenced by another slot as its own or
  as a shared prompt page, or a page whose count is below its slots'
  references (freed while in use)."""
  W = ref_w.shape[0]
  j = jnp.arange(table_mj.shape[1])
  own_mj = holds_m[:, None] & (j[None] >= own_from_m[:, None])
  shared_mj = holds_m[:, None] & ~own_mj
  zeros = jnp.zeros((W,), jnp.int32)
  own_w = count(zeros, table_mj, own_mj, 1)
  shared_w = count(zeros, table_mj, shared_mj, 1)
  bad_w = (own_w > 1) | ((own_w > 0) & (shared_w > 0)) | (
      ref_w < own_w + shared_w) | (ref_w < 0)
  return jnp.sum(bad_w)
