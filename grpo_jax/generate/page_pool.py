"""The paged sampler's pools of keys and values (`paged_slots`): made,
filled with the prompts' pages, a prompt's tail copied into a row's own
page; and how a decode step over them is placed on a mesh (the TPU kernel
in `jax.shard_map`, the residual stream's constraints).

A pool is per row shard: one (R,) + `page_layout.PoolLayout.shape(K, W, Z, E)`
array per layer (`sampling.kv_dtype = int8`: a `paged.Int8Pages`, its
scales without E), shard r's rows reading and writing only pool r. Shape
letters as in `grpo_jax` and `models.paged`; per-shard arrays (a leading R)
carry no suffix.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from grpo_jax import sharding
from grpo_jax.generate import decoding, slots
from grpo_jax.models import decode, int8_pages, page_layout, paged, transformer
from grpo_jax.models.config import ModelConfig

Layout = Optional[sharding.Layout]
TAIL_AXES = (sharding.BATCH, "kv_heads", None, "head_dim")        # (B,K,Z,E)


def pages_needed(prompt_len: int, max_new_tokens: int, page_size: int) -> int:
  """Table entries of a row: its columns are at most P + T - 1."""
  return -(-(prompt_len + max_new_tokens) // page_size)


def token_bytes(model_config: ModelConfig, itemsize: int, kv_dtype: str = ""
                ) -> float:
  """Bytes one token takes in a pool, every layer: MLA's latent once
  (kv_lora_rank + rope_dim values per layer, `decode.cache_arrays`), else
  the K heads' keys and values; int8 pages with their scales
  (`int8_pages.column_bytes`)."""
  c = model_config
  return (decode.cache_arrays(c) * c.num_layers * c.num_kv_heads
          * int8_pages.column_bytes(itemsize, kv_dtype, c.head_dim))


def pool_axes(pool_layout: page_layout.PoolLayout) -> tuple:
  """Logical axes of the (R, ...) pools: R over the batch axes."""
  return (sharding.BATCH,) + pool_layout.axes


def pool_layout(call: decoding.CallSpec) -> page_layout.PoolLayout:
  """The pools' layout of a call: the resolved kernel's."""
  return page_layout.pool_layout(resolve(call), call.sampling.kv_dtype)


def resolve(call: decoding.CallSpec) -> str:
  """The call's paged decode attention, "reference" or "pallas"."""
  return paged.resolve(call.sampling.paged_kernel, call.model_config)


def pin_pool(layout: Layout, pool_layout: page_layout.PoolLayout, pool):
  """One layer's pool pinned to the layout's shards (int8: values and
  scales, the scales without head_dim)."""
  if layout is None:
    return pool
  axes = pool_axes(pool_layout)
  if isinstance(pool, paged.Int8Pages):
    return paged.Int8Pages(layout.constrain(pool.values, axes),
                           layout.constrain(pool.scales, axes[:-1]))
  return layout.constrain(pool, axes)


def pool_dtype(params: transformer.Params):
  """The dtype of a call's keys and values: the weights'."""
  return params["embed"].dtype


def zero_pool(model_config: ModelConfig, W: int, Z: int, R: int, dtype,
              layout: Layout, pool_layout: page_layout.PoolLayout,
              kv_dtype: str = "") -> paged.PagePool:
  """A PagePool of zeros (inside jit: pinned to the layout's shards);
  kv_dtype int8: `paged.Int8Pages` (scales 1). MLA: the latent's pools
  only, no value pools (`decode.latent_only`)."""
  c = model_config
  shape = (R,) + pool_layout.shape(c.num_kv_heads, W, Z, c.head_dim)

  def one():
    if kv_dtype == "int8":
      return paged.Int8Pages(jnp.zeros(shape, jnp.int8),
                             jnp.ones(shape[:-1], jnp.float32))
    return jnp.zeros(shape, dtype)
  layers = lambda n: tuple(pin_pool(layout, pool_layout, one())
                          for _ in range(n))
  L = c.num_layers
  return paged.PagePool(layers(L),
                        layers(0 if decode.latent_only(c) else L))


@functools.partial(jax.jit, static_argnames=("call", "dtype"))
def new_pool(call: decoding.CallSpec, dtype) -> paged.PagePool:
  """A zero pool of `call.pool_pages` pages per row shard, for
  `paged_slots.sample_pages_reusing` (made once per run; the layout's row
  shards each hold their own)."""
  return zero_pool(call.model_config, call.pool_pages,
                   call.sampling.page_size, call.shards, dtype, call.layout,
                   pool_layout(call), call.sampling.kv_dtype)


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


def prefill(call: decoding.CallSpec, pp: decoding.PromptPass,
            prompt_len_b: jax.Array, full_b: jax.Array, table_bj: jax.Array,
            pool: paged.PagePool) -> tuple:
  """`pool` with every prompt's full pages written at its table's pages,
  and the tails (B, K, Z, E) per layer: (pool, (k tails, v tails); no v
  tails without value pools)."""
  Z, R, layout = call.sampling.page_size, call.shards, call.layout
  where = pool_layout(call)
  L = pp.k.shape[0]
  C = pp.k.shape[3] // Z + 1

  def layer(kv_bkpe, pool):
    pages_bkjze = _compact(kv_bkpe, prompt_len_b, Z)
    tail = jnp.take_along_axis(
        pages_bkjze, full_b[:, None, None, None, None], axis=2)[:, :, 0]
    pool = jax.vmap(where.put)(
        pool, slots.per_shard(R, jnp.moveaxis(pages_bkjze, 2, 1)),
        slots.per_shard(R, table_bj[:, :C]))
    pin = (lambda x, a: x) if layout is None else layout.constrain
    return pin_pool(layout, where, pool), pin(tail, TAIL_AXES)

  ks, k_tails = zip(*(layer(pp.k[i], pool.k[i]) for i in range(L)))
  vs, v_tails = tuple(zip(*(layer(pp.v[i], v) for i, v in enumerate(pool.v)
                            ))) or ((), ())    # MLA: no value pools
  return paged.PagePool(ks, vs), (k_tails, v_tails)


def copy_tails(pools: tuple, tails: tuple, prompt_m, page_m, R: int,
               layout: page_layout.PoolLayout) -> tuple:
  """Prompt prompt_m[m]'s tail into page page_m[m] of slot m's shard
  (W, no page: nowhere), every layer."""
  split = functools.partial(slots.per_shard, R)
  return tuple(jax.vmap(layout.put)(
      pool, split(slots.shard_take(tail, prompt_m, R)), split(page_m))
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


def kernel_fn(layout: Layout, where: page_layout.PoolLayout):
  """The kernel over R shards' pools of layout `where` (int8: values and
  scales alike): one shard per device (Mosaic kernels are not partitioned
  automatically), rows over the batch axes and KV heads (and their query
  heads) as the rules split the pool."""
  first = lambda x: jax.tree.map(lambda a: a[0], x)    # the one shard
  one = lambda q, k, v, n, t: paged.kernel_attention(
      *map(first, (q, k, v, n, t)))[None]
  if layout is None:
    return one

  def attend(q, k, v, n, t):
    head_axis = where.axes.index("kv_heads") + 1
    spec = tuple(sharding.spec_for(pool_axes(where), paged.page_values(k).shape,
                                   layout.mesh, layout.rules)) + (None,) * 5
    rows, heads = spec[0], spec[head_axis]
    pool = PartitionSpec(*spec[:head_axis + 1])    # values and scales alike
    f = jax.shard_map(one, mesh=layout.mesh,
                      in_specs=(PartitionSpec(rows, None, heads), pool, pool,
                                PartitionSpec(rows), PartitionSpec(rows)),
                      out_specs=PartitionSpec(rows, None, heads),
                      check_vma=False)
    return f(q, k, v, n, t)
  return attend


# Buckets a layer of the reference has at most (`bucket_block`).
MAX_BUCKETS = 16


def bucket_block(table_width: int, page_size: int,
                 max_buckets: int = MAX_BUCKETS) -> int:
  """Key columns per bucket of the reference (`paged.Buckets.block`) for
  rows of `table_width` pages: `paged.BLOCK_S`, or coarser so a layer has
  at most `max_buckets` `lax.switch` branches (a step reads up to a bucket
  past its longest row). Each branch is traced per layer: 656 of 32
  columns at the paper config's 20,992 (Qwen2.5-32B, 64 layers) had not
  traced after 15 CPU-minutes, nor 512 at a 7B's 16K context after 16
  (aot.py)."""
  pages = max(paged.BLOCK_S // page_size, -(-table_width // max_buckets), 1)
  return pages * page_size


def decode_settings(call: decoding.CallSpec, filled: jax.Array,
                    table_width: int) -> paged.DecodeSettings:
  """The paged decode step's settings of a call whose rows of
  `table_width` pages read at most `filled` pages: the reference (bucketed
  by `filled`, `bucket_block`) or the kernel, and the activations'
  constraints (`decode_constrain`)."""
  impl, where = resolve(call), pool_layout(call)
  block = bucket_block(table_width, call.sampling.page_size)
  attend = (paged.reference_fn(call.model_config, filled, block=block)
            if impl == "reference" else kernel_fn(call.layout, where))
  return paged.DecodeSettings(
      attend, call.shards, where,
      decode_constrain(call.layout, call.slots, call.model_config.dim))
