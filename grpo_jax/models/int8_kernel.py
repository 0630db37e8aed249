"""Decode attention over int8 pages by a TPU Pallas kernel that reads each
page and its scales where they are: `int8_kernel_attention`.

JAX's own paged kernel (`jax.experimental.pallas.ops.tpu.paged_attention`)
takes int8 pages only with scales as wide as the values (4 bytes of scale
for each byte of value), and the plain-JAX reference (`int8_pages
.int8_attention` over `PoolLayout.gather`) compiles on a TPU to a gather of
each layer's columns into a copy and a transpose of that copy: about five
passes over each column where one is needed (docs/pod.md). This kernel
copies each page a row reads, with its scales, from HBM to VMEM once
(DMA, double-buffered, a block of `pages_per_block` pages at a time), and
skips the pages past the row's length.

The arithmetic is `int8_attention`'s: a column's key scale multiplies its
scores and its value scale its probability, so the dots read int8 values
converted to the query's dtype (exact) and no float copy of a page is made.
Softmax is online (flash-decoding) in float32 over the row's pages.

Grid: rows M, parallel (megacore splits them); one program reads one
row's pages, the chip's K KV heads at once, each head's G = H / K query
heads attending together. Pools pages first, as the reference's
(`page_layout.REFERENCE_LAYOUT`): values (W, K, Z, E) int8, scales
(W, K, Z) float32; a page is one contiguous (K, Z, E) block (and (K, Z)
of scales), so four DMAs move it whole: at page size 128 and 2 heads a
chip, one DMA per 64 columns of a head, where JAX's kernel on bf16 pages
of 16 issues one per 8 (a DMA per page and head, keys and values apart).
Compiled for a v5p chip with the decode step's write
(`PoolLayout.write_step`), the pool keeps one layout at page size 128, no
copy around the kernel (the heads-first layout's (K, W, Z) scales were
copied between two layouts every step: tests/test_aot.py). Shape letters
as in `models.paged`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from grpo_jax.models import attention
from grpo_jax.models.int8_pages import Int8Pages


def int8_kernel_attention(q_mhe: jax.Array, k: Int8Pages, v: Int8Pages,
                          length_m: jax.Array, table_mj: jax.Array, *,
                          pages_per_block: int) -> jax.Array:
  """Row m's query heads over its columns [0, length_m[m]) of the int8
  pools k and v (pages first), found through table_mj (entries in
  [0, W): the caller clips no-page entries; a row reads only the
  ceil(length / Z) pages its length covers). Length 0: no page read,
  output 0. Returns (M, H, E) in q's dtype."""
  M, H, E = q_mhe.shape
  W, K, Z, _ = k.values.shape
  J, G = table_mj.shape[1], H // K
  P = max(1, min(pages_per_block, J))
  table = jnp.pad(table_mj.astype(jnp.int32), [(0, 0), (0, -J % P)])
  row = pl.BlockSpec((None, K, G, E), lambda m, *_: (m, 0, 0, 0))
  pool = pl.BlockSpec(memory_space=pl.ANY)
  kernel = functools.partial(_kernel, pages_per_block=P,
                             table_width=table.shape[1])
  out = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(M,),
          in_specs=[row, pool, pool, pool, pool], out_specs=row,
          scratch_shapes=[pltpu.VMEM((2, P, K, Z, E), jnp.int8),
                          pltpu.VMEM((2, P, K, Z), jnp.float32),
                          pltpu.VMEM((2, P, K, Z, E), jnp.int8),
                          pltpu.VMEM((2, P, K, Z), jnp.float32),
                          pltpu.SemaphoreType.DMA((2,))]),
      out_shape=jax.ShapeDtypeStruct((M, K, G, E), q_mhe.dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel",)),
  )(length_m.astype(jnp.int32), table.reshape(-1),
    q_mhe.reshape(M, K, G, E), k.values, k.scales, v.values, v.scales)
  return out.reshape(M, H, E)


def _kernel(length_ref, table_ref, q_ref, *refs, pages_per_block: int,
            table_width: int):
  """One row: its pages in blocks of P, block b + 1's copies started
  before block b's are waited on. refs: the pools in HBM (keys, their
  scales, values, theirs), the output block, the four VMEM buffers
  (2, P, K, Z, ...) and the two buffers' DMA semaphores."""
  k_hbm, ks_hbm, v_hbm, vs_hbm, o_ref, k_buf, ks_buf, v_buf, vs_buf, sems = refs
  m = pl.program_id(0)
  P, K, Z = pages_per_block, k_buf.shape[2], k_buf.shape[3]
  length = length_ref[m]
  pages = jax.lax.div(length + Z - 1, Z)   # lax.div: lengths are >= 0,
  blocks = jax.lax.div(pages + P - 1, P)   # and jnp's // lowers a sign op

  def each(block, slot, act):
    """act(dma) on block `block`'s DMAs into buffer `slot`: a page's keys,
    values and both scales, all the chip's KV heads at once (a page is
    one contiguous (K, Z, E) block); a page past the row's length is not
    copied."""
    for p in range(P):
      page = table_ref[m * table_width + block * P + p]

      @pl.when(block * P + p < pages)
      def _():
        for src, dst in ((k_hbm, k_buf), (ks_hbm, ks_buf), (v_hbm, v_buf),
                         (vs_hbm, vs_buf)):
          act(pltpu.make_async_copy(src.at[page], dst.at[slot, p],
                                    sems.at[slot]))

  @pl.when(blocks > 0)
  def _():
    each(0, 0, lambda dma: dma.start())

  def block_step(b, carries):
    slot = jax.lax.rem(b, 2)

    @pl.when(b + 1 < blocks)
    def _():
      each(b + 1, 1 - slot, lambda dma: dma.start())
    each(b, slot, lambda dma: dma.wait())
    carries = list(carries)
    for p in range(P):
      for h in range(K):
        page = (k_buf[slot, p, h], ks_buf[slot, p, pl.ds(h, 1)],
                v_buf[slot, p, h], vs_buf[slot, p, pl.ds(h, 1)])
        carries[h] = _attend_page(q_ref[h], page, (b * P + p) * Z, length,
                                  carries[h])
    return tuple(carries)

  G, E = q_ref.shape[1:]
  init = (jnp.full((G, 1), attention.NEG_INF, jnp.float32),
          jnp.zeros((G, 1), jnp.float32), jnp.zeros((G, E), jnp.float32))
  carries = jax.lax.fori_loop(0, blocks, block_step, (init,) * K)
  for h, (_, total, acc) in enumerate(carries):
    o_ref[h] = jnp.where(total > 0, acc / jnp.where(total > 0, total, 1.0),
                         0.0).astype(o_ref.dtype)


def _attend_page(q_ge, page: tuple, first: jax.Array, length: jax.Array,
                 carry: tuple) -> tuple:
  """The online softmax's update by one page of Z columns from column
  `first`, `page` its (keys (Z, E), their scales (1, Z), values, theirs):
  carry (running max (G, 1), running sum (G, 1), unnormalised
  output (G, E)), all float32. Columns at or past `length` are masked
  (their buffers may hold another page's or no data: `where`, not a
  product, keeps them out)."""
  high, total, acc = carry
  k_ze, ks_1z, v_ze, vs_1z = page
  E = q_ge.shape[1]
  scores = jax.lax.dot_general(q_ge, k_ze.astype(q_ge.dtype),
                               (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)
  scores = scores * (ks_1z * (1.0 / np.sqrt(E)))
  valid = first + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1) < length
  scores = jnp.where(valid, scores, attention.NEG_INF)
  new_high = jnp.maximum(high, scores.max(axis=1, keepdims=True))
  fade = jnp.exp(high - new_high)
  probs = jnp.where(valid, jnp.exp(scores - new_high), 0.0)
  weighted = jnp.where(valid, probs * vs_1z, 0.0).astype(q_ge.dtype)
  out = jax.lax.dot_general(weighted, v_ze.astype(q_ge.dtype),
                            (((1,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32)
  return (new_high, fade * total + probs.sum(axis=1, keepdims=True),
          fade * acc + out)
