"""Decoding over a paged KV cache: every row's keys and values live in pages
of a shared pool, found through the row's page table.

Layout (one row shard): per layer, keys (and values) are a pool of W pages
of Z columns each, (K, W, Z, E) for the TPU kernel (the layout of
`jax.experimental.pallas.ops.tpu.paged_attention`'s `k_pages`, so the
kernel reads the pool as it is) and (W, K, Z, E) for the plain-JAX
reference (`page_layout.PoolLayout`: a page's heads contiguous, so
gathering a row's pages copies whole blocks). Row m's column c lives in
page `table_mj[m, c // Z]` at offset `c % Z`. Columns are the row's
positions: prompts are stored without their left padding, so a row's keys
are its columns [0, length) and no validity or position arrays exist. A
table entry of W (past the pool, `PoolLayout.pages`) is no page: writes to
it are dropped, reads of it clipped and masked.

`paged_attention_reference` is the plain-JAX decode attention (CPU, GPU, and
the check of the kernel): it gathers the row's pages through its table and
masks columns at or past its length. A sliding layer (`window_attention`)
gathers only the pages holding the row's window, so the pages behind it
are not read (they stay the row's until it ends: a full layer reads them). `kernel_attention` is the same by the
TPU Pallas kernel (one shard; `paged_slots` wraps it in `jax.shard_map`),
chosen by `sampling.paged_kernel` (KERNELS, `resolve`). `decode_step` is
`ragged.decode_step` over pages: each row writes its new key and value at
one (page, offset), its whole page written back (`PoolLayout.write_step`),
and attends over its own pages, up to the longest row's page count
(bucketed like `ragged.filled_attention`, so short calls do not read empty
pages).

With `sampling.kv_dtype = int8` a layer's pool is `Int8Pages`
(`models/int8_pages.py`): int8 keys (or values) and one float32 scale per
(page, head, column), pages first in either implementation. Writes
quantise; the reference reads them as int8 (`int8_attention`, the scales
folded into scores and probabilities); on a TPU `kernel_attention` reads
them with this codebase's kernel (`models/int8_kernel.py`: JAX's takes
scales as wide as the values, more bytes than bf16), each page and its
scales copied to VMEM once.

Shapes use the letters of `grpo_jax`: M rows (slots), K KV heads, H query
heads, E head width, W pages in the pool, Z columns per page, J page-table
entries per row; per-shard arrays add a leading R (row shards).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import paged_attention as tpu_paged

from grpo_jax.errors import ConfigError
from grpo_jax.models import attention, decode, ragged, transformer
from grpo_jax.models.config import ModelConfig
from grpo_jax.models.int8_kernel import int8_kernel_attention
from grpo_jax.models.int8_pages import Int8Pages, int8_attention, page_values
from grpo_jax.models.page_layout import KERNEL_LAYOUT, REFERENCE_LAYOUT, PoolLayout

# sampling.paged_kernel: the decode attention over pages. auto: the TPU kernel
# on TPU (where the model has no sliding window), else the reference.
KERNELS = ("auto", "reference", "pallas")

# Key columns per bucket of the reference (`bucketed_attention`): finer than
# the dense slots' ragged.BLOCK_S, since its gather and dots cost what the
# bucket reads.
BLOCK_S = 32


KERNEL_LANES = 128   # the TPU kernel's blocks hold head_dim on 128 lanes


def kernel_refuses(model_config: ModelConfig, backend: str) -> str:
  """Why the TPU kernel (JAX's, or for int8 pages `int8_kernel`) cannot
  attend for this model on `backend` ("" when it can). The head_dim limit
  is Mosaic's (the TPU lowering; both kernels' blocks hold head_dim on the
  lanes); interpreted on a CPU (tests) any head_dim runs."""
  if model_config.sliding_window is not None:
    return "has no sliding window"
  if model_config.attn_softcap is not None:
    return "has no attention soft-cap here"
  if backend == "tpu" and model_config.head_dim % KERNEL_LANES:
    return (f"needs head_dim a multiple of {KERNEL_LANES} on a TPU (its "
            f"blocks' lanes); this model's is {model_config.head_dim}")
  return ""


def resolve(impl: str, model_config: ModelConfig, backend: str = "") -> str:
  """"reference" or "pallas" for `impl` (one of KERNELS) on `backend`
  (default: this process's). auto: the TPU kernel on a TPU when it can
  take the model (`kernel_refuses`): SmolLM2-135M's head_dim of 64 it
  cannot (Pallas refuses to lower it), so auto gives the reference."""
  if impl not in KERNELS:
    raise ValueError(f"sampling.paged_kernel {impl!r}; allowed: {KERNELS}")
  backend = backend or jax.default_backend()
  why = kernel_refuses(model_config, backend)
  if impl == "pallas" and why:
    raise ConfigError(f"config field 'sampling.paged_kernel' = 'pallas': the TPU "
                     f"paged-attention kernel {why}; use 'reference' (or "
                     "'auto', which picks it)")
  if impl == "auto":
    return "pallas" if backend == "tpu" and not why else "reference"
  return impl


@dataclasses.dataclass(frozen=True)
class Buckets:
  """How `bucketed_attention` reads: a sliding `window` (None: none), in
  buckets of `block` key columns, from pools of `layout`."""
  window: Optional[int] = None
  block: int = BLOCK_S
  layout: PoolLayout = KERNEL_LAYOUT
  softcap: Optional[float] = None


def paged_attention_reference(q_mhe: jax.Array, k_pool: jax.Array,
                              v_pool: jax.Array, length_m: jax.Array,
                              table_mj: jax.Array, window=None,
                              layout: PoolLayout = KERNEL_LAYOUT,
                              softcap=None) -> jax.Array:
  """Decode attention (one query per row) over row m's first length_m[m]
  columns, read through its page table from pools of `layout`;
  grouped-query (H a multiple of K), softmax in float32
  (`attention.attention` over the gathered columns). The query is at
  column length_m - 1 (its own key written); with a sliding window it sees
  the last `window` columns. The kernel's contract (`paged_attention(q,
  k_pages, v_pages, lengths, page_indices)`) plus the window and a
  soft-cap of the scores (Gemma 2). Returns (M, H, E)."""
  first_m = jnp.zeros_like(length_m)
  return _attend_pages(q_mhe, k_pool, v_pool, length_m, table_mj, first_m,
                       Buckets(window, layout=layout, softcap=softcap))


def window_pages(window: int, Z: int) -> int:
  """Pages that hold `window` consecutive columns wherever they start."""
  return -(-(window - 1) // Z) + 1


def window_attention(q_mhe, k_pool, v_pool, length_m, table_mj,
                     buckets: Buckets) -> jax.Array:
  """`paged_attention_reference` with `buckets.window` (not None), reading
  only the pages that hold each row's window: row m's columns
  [length_m - window, length_m) lie in the `window_pages` table entries
  from (length_m - window) // Z on, so a step gathers that many pages per
  row however long the row is; pages behind the window are not read."""
  Z, J = page_values(k_pool).shape[2], table_mj.shape[1]
  n = min(J, window_pages(buckets.window, Z))
  first_m = jnp.clip((length_m - buckets.window) // Z, 0, J - n)
  table_mn = jnp.take_along_axis(table_mj, first_m[:, None] + jnp.arange(n),
                                 axis=1)
  return _attend_pages(q_mhe, k_pool, v_pool, length_m, table_mn, first_m,
                       buckets)


def _attend_pages(q_mhe, k_pool, v_pool, length_m, table_mj, first_m,
                  buckets: Buckets) -> jax.Array:
  """Attention over the pages of `table_mj` (MLA: the latent pages, once;
  int8: `int8_attention`), whose first entry is row m's page first_m[m]
  (columns from first_m * Z on), masked to [0, length_m) and the window."""
  k_mkse = buckets.layout.gather(k_pool, table_mj)
  v_mkse = k_mkse if v_pool is k_pool else buckets.layout.gather(v_pool, table_mj)
  Z = page_values(k_pool).shape[2]
  col_ms = first_m[:, None] * Z + jnp.arange(page_values(k_mkse).shape[2])
  mask_ms = col_ms < length_m[:, None]
  if buckets.window is not None:
    mask_ms &= col_ms > length_m[:, None] - 1 - buckets.window
  if isinstance(k_mkse, Int8Pages):
    return int8_attention(q_mhe, k_mkse, v_mkse, mask_ms, buckets.softcap)
  return attention.attention(q_mhe[:, None], k_mkse, v_mkse, mask_ms[:, None],
                             buckets.softcap)[:, 0]


def bucketed_attention(q_mhe, k_pool, v_pool, length_m, table_mj,
                       filled_pages: jax.Array,
                       buckets: Buckets = Buckets()) -> jax.Array:
  """`paged_attention_reference` over the first `filled_pages` table entries
  only, rounded up to whole blocks of `buckets.block` columns: one
  `lax.switch` branch per prefix (as `ragged.filled_attention`), so a step
  reads the pages up to the longest row's, not the table's width. With a
  window, prefixes longer than the window's pages are one branch,
  `window_attention`: a sliding layer reads at most `window_pages` pages
  per row."""
  Z, J = page_values(k_pool).shape[2], table_mj.shape[1]
  per_block = max(1, buckets.block // Z)
  cuts = sorted({min(J, per_block * (i + 1))
                 for i in range(-(-J // per_block))})

  def prefix(cut: int):
    return lambda q, k, v, n, t: _attend_pages(
        q, k, v, n, t[:, :cut], jnp.zeros_like(n), buckets)

  most = J if buckets.window is None else window_pages(buckets.window, Z)
  branches = [prefix(c) for c in cuts if c <= most]
  if len(branches) < len(cuts):
    branches.append(lambda q, k, v, n, t: window_attention(
        q, k, v, n, t, buckets))
  index = jnp.clip(-(-filled_pages // per_block) - 1, 0, len(branches) - 1)
  return jax.lax.switch(index, branches, q_mhe, k_pool, v_pool, length_m,
                        table_mj)


# Bytes of a TPU core's scalar memory (SMEM) the kernel's page table may
# take: the kernel prefetches the whole table of its call into SMEM (1 MiB
# on v5p: 256 slots of 1,312 pages, the paper config's, were refused at
# 1.34 MB), so a call takes at most this many bytes of table, the rest of
# SMEM left to its lengths and scalars.
KERNEL_TABLE_BYTES = 3 << 18    # 768 KiB


def kernel_slots(pages_per_row: int, table_bytes: int = KERNEL_TABLE_BYTES
                 ) -> int:
  """The most slots one kernel call takes: their int32 page tables fit in
  `table_bytes`."""
  return max(1, table_bytes // (4 * pages_per_row))


# Key columns an int8 kernel program copies to VMEM at a time (4 pages of
# 128: 64 KiB of int8 keys and as much of values a KV head, double-buffered).
INT8_BLOCK = 512


def kernel_attention(q_mhe: jax.Array, k_pool, v_pool, length_m: jax.Array,
                     table_mj: jax.Array,
                     table_bytes: int = KERNEL_TABLE_BYTES) -> jax.Array:
  """`paged_attention_reference` (no window) by a TPU Pallas kernel, one
  row shard: JAX's over (K, W, Z, E) pools (heads first), or over
  `Int8Pages` (pages first) `int8_kernel_attention`. A slot holding no row
  (its first entry no page) gets length 0, which both kernels skip: it
  reads nothing, and its output (unused) is 0. No-page entries point at a
  real page (never read past the row's length). The slots go through the
  kernel in as few equal calls as keep each call's table within
  `table_bytes` (`kernel_slots`: both kernels prefetch it into SMEM); each
  slot reads only its own pages, so the calls read what one call would."""
  int8 = isinstance(k_pool, Int8Pages)
  W, Z, E = ((k_pool.values.shape[0],) + k_pool.values.shape[2:] if int8
             else k_pool.shape[1:])
  M, J = table_mj.shape
  length_m = jnp.where(table_mj[:, 0] < W, length_m, 0).astype(jnp.int32)
  table_mj = jnp.minimum(table_mj, W - 1).astype(jnp.int32)
  if int8:
    block = max(1, INT8_BLOCK // Z)
    one = lambda q, n, t: int8_kernel_attention(q, k_pool, v_pool, n, t,
                                                pages_per_block=block)
  else:
    # JAX's kernel reads whole compute blocks of pages, its table padded
    # to whole blocks; it does not scale the scores, so q is scaled here
    block = min(J, max(1, ragged.BLOCK_S // Z))
    table_mj = jnp.pad(table_mj, [(0, 0), (0, -J % block)])
    q_mhe = (q_mhe / np.sqrt(E)).astype(k_pool.dtype)
    one = lambda q, n, t: tpu_paged.paged_attention(
        q, k_pool, v_pool, n, t, pages_per_compute_block=block)
  calls = -(-M // kernel_slots(table_mj.shape[1], table_bytes))
  size = -(-M // calls)
  return jnp.concatenate([
      one(q_mhe[i:i + size], length_m[i:i + size], table_mj[i:i + size])
      for i in range(0, M, size)])


def reference_fn(model_config: ModelConfig, filled_pages: jax.Array,
                 layout: PoolLayout = REFERENCE_LAYOUT, block: int = BLOCK_S):
  """The reference over R shards' pools of `layout`: `DecodeSettings`'s
  `attend`; `layer` (a `layer_config`) gives a layer's window and
  soft-cap where layers differ (Gemma); `block`: `Buckets.block`."""
  def attend(q, k, v, n, t, layer: ModelConfig = model_config):
    buckets = Buckets(layer.sliding_window, block, layout,
                      layer.attn_softcap)
    return jax.vmap(lambda q, k, v, n, t: bucketed_attention(
        q, k, v, n, t, filled_pages, buckets))(q, k, v, n, t)
  return attend


class PagePool(NamedTuple):
  """The keys' and values' pools of a paged call, one array per layer,
  (R,) + `pool_layout(impl).shape(K, W, Z, E)` (int8: an `Int8Pages`; MLA:
  no v, `decode.layer_values`). A run keeps one across calls."""
  k: tuple
  v: tuple


class RowPages(NamedTuple):
  """Where each row of a decode step is: its column (its position), the
  page its new key and value go to (W: none, it writes nowhere) and its
  page table."""
  column_m: jax.Array       # int32
  page_m: jax.Array         # int32 local page ids
  table_mj: jax.Array       # int32 local page ids (W: none)


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
  """How a paged decode step attends and where its work lives: `attend`
  ((q (R, M/R, H, E), k pool, v pool, lengths (R, M/R), tables
  (R, M/R, J)) -> (R, M/R, H, E): `reference_fn` or the kernel per
  shard), R row shards, the pools' layout, and the activations'
  constraints."""
  attend: Callable
  shards: int
  pool_layout: PoolLayout
  constrain: transformer.Constrain = transformer.no_constraint


def decode_step(model_config: ModelConfig, weights: decode.Weights,
                pool: PagePool, tokens_m: jax.Array, rows: RowPages,
                settings: DecodeSettings, record_routes: bool = False
                ) -> tuple:
  """One token per row: row m (at position column_m[m]) writes its key and
  value at (page_m[m], column_m[m] % Z) of its shard's pool (no page, W: it
  writes nowhere), then attends over its columns [0, column_m + 1).

  pool: one pool per layer, (R,) + pool_layout.shape (the page axis as
  `attend` reads it); rows (M) and their tables are split in R contiguous
  parts, shard r's rows reading and writing only pool r. `weights` as
  `decode.weights` gives them. Returns float32 logits (M, V) and the
  updated pool; record_routes: and the experts each sparse layer chose
  for the token (L_sparse, M, C)."""
  M, R = tokens_m.shape[0], settings.shards
  Z = page_values(pool.k[0]).shape[3]
  constrain = settings.constrain
  split = lambda x: x.reshape(R, M // R, *x.shape[1:])
  page, offset = split(rows.page_m), split(rows.column_m % Z)
  length, table = split(rows.column_m + 1), split(rows.table_mj)
  write = jax.vmap(settings.pool_layout.write_step)
  x = constrain(transformer.embed(weights.params, tokens_m[:, None],
                                model_config), transformer.RESIDUAL_AXES)
  ks, vs, routes = list(pool.k), list(pool.v), []
  for i, lp in enumerate(weights.layers):
    c = model_config.layer_config(i)   # Gemma: this layer's window, RoPE
    per_layer = {} if c is model_config else {"layer": c}
    q, k, v = transformer.qkv(c, lp, x, rows.column_m[:, None], constrain)
    ks[i] = write(ks[i], split(k[:, :, 0]), page, offset)
    if vs:                             # else the values are the keys (MLA)
      vs[i] = write(vs[i], split(v[:, :, 0]), page, offset)
    attn = settings.attend(split(q[:, 0]), ks[i],
                           decode.layer_values(ks, vs, i), length, table,
                           **per_layer)
    x, routing = transformer.attn_out_and_routed_mlp(
        c, lp, x, attn.reshape(M, 1, *attn.shape[2:]), constrain)
    if routing is not None:
      routes.append(routing.experts_nc)
  out = (decode.logits(model_config, weights.params, x),
         PagePool(tuple(ks), tuple(vs)))
  return (*out, jnp.stack(routes)) if record_routes else out
