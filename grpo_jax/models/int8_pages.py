"""Int8 KV pages (`sampling.kv_dtype = int8`): a layer's pool of int8 keys
(or values) with one float32 scale per (page, head, column), the column's
absolute maximum over its E entries / 127 (symmetric, per token and head).
`models/paged.py` writes and gathers them; `column_bytes` is what a column
costs in either dtype (the pool's size, the pod schedule's reads)."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.models import attention

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


def int8_attention(q_mhe: jax.Array, k: Int8Pages, v: Int8Pages,
                   mask_ms: jax.Array, softcap=None) -> jax.Array:
  """Decode attention (`attention.attention`, one query a row) over int8
  columns (M, K, S, E) with their (M, K, S) scales, never dequantised: a
  column's key scale multiplies its scores, its value scale its
  probability (q . (k s) = (q . k) s and sum p (v s) = sum (p s) v), so
  the dots read int8 values (exact in the query's dtype) and no float copy
  of the pages is made. Softmax in float32. Returns (M, H, E)."""
  M, H, E = q_mhe.shape
  K = k.values.shape[1]
  q_mkre = q_mhe.reshape(M, K, H // K, E)
  scores = jnp.einsum("mkre,mkse->mkrs", q_mkre, k.values.astype(q_mhe.dtype),
                      preferred_element_type=jnp.float32)
  scores = attention.soft_cap(scores * (k.scales[:, :, None] / np.sqrt(E)),
                              softcap)
  scores = jnp.where(mask_ms[:, None, None], scores, attention.NEG_INF)
  probs = jax.nn.softmax(scores, axis=-1) * v.scales[:, :, None]
  out = jnp.einsum("mkrs,mkse->mkre", probs.astype(q_mhe.dtype),
                   v.values.astype(q_mhe.dtype))
  return out.reshape(M, H, E)


def page_values(pool) -> jax.Array:
  """A layer's pool as its array of values (int8 pools: without scales)."""
  return pool.values if isinstance(pool, Int8Pages) else pool


def column_bytes(dtype_bytes: int, kv_dtype: str, head_dim: int) -> float:
  """Bytes of one head's key (or value) column in a pool: the compute
  dtype's, or int8 plus its float32 scale."""
  return head_dim + 4.0 if kv_dtype == "int8" else float(dtype_bytes * head_dim)
