"""Int8 KV pages (`sampling.kv_dtype = int8`): a layer's pool of int8 keys
(or values) with one float32 scale per (page, head, column), the column's
absolute maximum over its E entries / 127 (symmetric, per token and head).
`models/paged.py` writes and gathers them; `column_bytes` is what a column
costs in either dtype (the pool's size, the pod schedule's reads)."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

# sampling.kv_dtype: "" (the compute dtype) or int8 pages with scales.
KV_DTYPES = ("", "int8")
_INT8_MAX = 127.0


class Int8Pages(NamedTuple):
  """One layer's int8 pool: `values` the layout's shape (int8), `scales`
  the same without E (float32), value x stored as round(x / scale)."""
  values: jax.Array
  scales: jax.Array


def quantize_columns(x_e: jax.Array) -> tuple:
  """Symmetric int8 over the last axis: (int8 values, float32 scales of
  the other axes), scale = max |x| / 127 (1 where a column is all 0)."""
  x_e = x_e.astype(jnp.float32)
  scale = jnp.max(jnp.abs(x_e), axis=-1) / _INT8_MAX
  scale = jnp.where(scale > 0, scale, 1.0)
  q = jnp.clip(jnp.round(x_e / scale[..., None]), -_INT8_MAX, _INT8_MAX)
  return q.astype(jnp.int8), scale


def dequantize_columns(values_e: jax.Array, scales: jax.Array, dtype
                       ) -> jax.Array:
  return (values_e.astype(jnp.float32) * scales[..., None]).astype(dtype)


def page_values(pool) -> jax.Array:
  """A layer's pool as its array of values (int8 pools: without scales)."""
  return pool.values if isinstance(pool, Int8Pages) else pool


def column_bytes(dtype_bytes: int, kv_dtype: str, head_dim: int) -> float:
  """Bytes of one head's key (or value) column in a pool: the compute
  dtype's, or int8 plus its float32 scale."""
  return head_dim + 4.0 if kv_dtype == "int8" else float(dtype_bytes * head_dim)
