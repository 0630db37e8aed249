"""Where a paged pool's pages are (`PoolLayout`) and how whole pages and
single columns are put, written and gathered; `models/paged.py` reads the
pools through it. Shape letters as in `models.paged`.

With `sampling.kv_dtype = int8` a pool is `Int8Pages` (values and
scales): each operation applies to both."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from grpo_jax.models import decode
from grpo_jax.models.int8_pages import Int8Pages, dequantize_columns, quantize_columns


def _each(pool, new: jax.Array, set_):
  """set_(pool, new) on a pool of the compute dtype; on an `Int8Pages`,
  `new` quantised and set_ applied to the values and to the scales."""
  if isinstance(pool, Int8Pages):
    values, scales = quantize_columns(new)
    return Int8Pages(set_(pool.values, values), set_(pool.scales, scales))
  return set_(pool, new)


@dataclasses.dataclass(frozen=True)
class PoolLayout:
  """Where a pool's page axis is. heads_first: (K, W, Z, E), the TPU
  kernel's `k_pages` (the kernel reads the pool as it is). Else pages first,
  (W, K, Z, E): every page one contiguous block of K * Z * E, so the
  reference's gather of a row's pages is a copy of whole blocks; on CPU its
  attention then costs what the dense slots' does, where the heads-first
  gather made it 2.4x slower (`python benchmarks/decode_step.py`,
  docs/paged.md). Per-shard pools; `paged_slots` adds a leading R."""
  heads_first: bool

  def shape(self, K: int, W: int, Z: int, E: int) -> tuple:
    return (K, W, Z, E) if self.heads_first else (W, K, Z, E)

  @property
  def axes(self) -> tuple:
    """Logical axes of a pool (without R): KV heads as the rules say."""
    heads = ("kv_heads", None) if self.heads_first else (None, "kv_heads")
    return heads + (None, "head_dim")

  def pages(self, pool: jax.Array) -> int:
    """W; also the table entry that means no page (one past the pool)."""
    return pool.shape[1 if self.heads_first else 0]

  def put(self, pool, pages_xkze: jax.Array, ids_x: jax.Array):
    """pool[page ids_x] = pages_xkze (any index shape x; ids W: nowhere)."""
    return _each(pool, pages_xkze, lambda p, new: self._put(p, new, ids_x))

  def _put(self, pool: jax.Array, pages_x: jax.Array, ids_x: jax.Array
           ) -> jax.Array:
    if self.heads_first:
      return decode.set_in_bits(
          pool, jnp.moveaxis(pages_x, ids_x.ndim, 0),
          lambda p, new: p.at[:, ids_x].set(new, mode="drop"))
    return decode.set_in_bits(
        pool, pages_x, lambda p, new: p.at[ids_x].set(new, mode="drop"))

  def write(self, pool, new_mke: jax.Array, page_m: jax.Array,
            offset_m: jax.Array):
    """Column offset_m[m] of page page_m[m] = new_mke[m] (no page:
    nowhere)."""
    return _each(pool, new_mke,
                 lambda p, new: self._write(p, new, page_m, offset_m))

  def _write(self, pool: jax.Array, new_m: jax.Array, page_m: jax.Array,
             offset_m: jax.Array) -> jax.Array:
    if self.heads_first:
      return decode.set_in_bits(
          pool, jnp.swapaxes(new_m, 0, 1),
          lambda p, new: p.at[:, page_m, offset_m].set(new, mode="drop"))
    return decode.set_in_bits(
        pool, new_m,
        lambda p, new: p.at[page_m, :, offset_m].set(new, mode="drop"))

  def write_step(self, pool, new_mke: jax.Array, page_m: jax.Array,
                 offset_m: jax.Array):
    """`write` for a decode step, whose rows each write one column into a
    page no other row writes (its own; W: none): each row's page is read,
    its column set and the page written back whole. A scatter of whole
    pages keeps the pool in the layout its gathers (or the TPU kernel)
    read; one of (K, E) columns made XLA:TPU keep a second layout of it
    and copy the pool between the two every layer and step (pages first,
    int8: that layout pads the 2 heads a chip to 4, twice the pool's
    bytes; docs/pod.md)."""
    return _each(pool, new_mke,
                 lambda p, new: self._write_pages(p, new, page_m, offset_m))

  def _write_pages(self, pool: jax.Array, new_m: jax.Array,
                   page_m: jax.Array, offset_m: jax.Array) -> jax.Array:
    axis = 1 if self.heads_first else 0          # the page axis
    M, Z = page_m.shape[0], pool.shape[2]
    new = jnp.swapaxes(new_m, 0, 1) if self.heads_first else new_m
    old = jnp.take(pool, page_m, axis=axis, mode="clip")   # W -> M
    at_mz = jnp.arange(Z)[None] == offset_m[:, None]
    at = at_mz.reshape((1,) * axis + (M,) + (1,) * (1 - axis) + (Z,)
                       + (1,) * (pool.ndim - 3))
    pages = jnp.where(at, new[:, :, None].astype(pool.dtype), old)
    index = (slice(None), page_m) if self.heads_first else page_m
    return decode.set_in_bits(
        pool, pages, lambda p, new: p.at[index].set(new, mode="drop"))

  def gather(self, pool, table_mj: jax.Array, dtype=None):
    """Row m's pages in table order as the dense cache's (M, K, J * Z, E)
    columns (int8: `Int8Pages`, or dequantised to a `dtype` given); past
    the pool, its last page (clipped; the caller masks them)."""
    if not isinstance(pool, Int8Pages):
      return self._gather(pool, table_mj)
    pages = Int8Pages(*(self._gather(p, table_mj) for p in pool))
    return pages if dtype is None else dequantize_columns(*pages, dtype)

  def _gather(self, pool: jax.Array, table_mj: jax.Array) -> jax.Array:
    M, J = table_mj.shape
    axis = 1 if self.heads_first else 0
    pages = jnp.take(pool, table_mj, axis=axis, mode="clip")
    # heads first: (K, M, J, Z, ...); pages first: (M, J, K, Z, ...)
    pages = jnp.moveaxis(pages, 0, 1) if self.heads_first else jnp.moveaxis(
        pages, 2, 1)
    K, Z = pages.shape[1], pages.shape[3]
    return pages.reshape(M, K, J * Z, *pages.shape[4:])


KERNEL_LAYOUT = PoolLayout(heads_first=True)
REFERENCE_LAYOUT = PoolLayout(heads_first=False)


def pool_layout(impl: str, kv_dtype: str = "") -> PoolLayout:
  """The pools' layout for a resolved `impl` ("reference" or "pallas")
  and `sampling.kv_dtype`: JAX's kernel reads heads first; int8 pages are
  pages first for either (`int8_kernel`: a (page, head) block is what its
  DMAs copy, and the heads-first scales were copied between two layouts
  around each step's write on a TPU)."""
  return KERNEL_LAYOUT if impl == "pallas" and not kv_dtype else REFERENCE_LAYOUT
