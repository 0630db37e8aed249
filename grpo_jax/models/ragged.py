"""Ragged decoding: every row at its own cache column, attention over the
filled columns only.

`transformer.decode_step` writes all rows at one column (the static
sampler's rows advance in lockstep) and attends over the whole allocated
cache. The continuous-batching sampler's rows do not: each cache row (a
slot) holds a different sequence, started at a different decode step. Here
row n writes its key and value at its own column `columns_n[n]` (one
scatter), and attention visits key blocks of `BLOCK_S` columns only up to
`filled`, the largest filled length of the rows that matter, with the online
softmax of models/blockwise.py (Dao et al. 2022, Alg. 1). A short row next
to a long one pays for the long one's blocks (masked), but no row pays for
the columns nobody has written yet: the cost of a step grows with the
longest live sequence, not with `max_new_tokens`.

Shapes use the letters of `grpo_jax`: N rows (slots), S cache columns,
K KV heads, H query heads, E head width, D model width, V vocabulary.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.models import transformer
from grpo_jax.models.config import ModelConfig

BLOCK_S = 128          # key columns per block of the decode attention
_NEG_INF = -1e30


def filled_attention(q_nqhe: jax.Array, k_nkse: jax.Array, v_nkse: jax.Array,
                     q_pos_n: jax.Array, k_pos_ns: jax.Array,
                     k_valid_ns: jax.Array, filled: jax.Array,
                     window=None, block: int = BLOCK_S) -> jax.Array:
  """One query per row (Q = 1) against key columns [0, filled), rounded up to
  whole blocks; S must be a multiple of `block`. The mask is
  `transformer.attention_mask`'s: valid keys at positions <= the query's
  (and within the sliding window). Returns (N, 1, H, E)."""
  N, _, H, E = q_nqhe.shape
  K = k_nkse.shape[1]
  q_grouped = q_nqhe.reshape(N, K, H // K, E)
  scale = 1.0 / np.sqrt(E)

  def block_j(j, carry):
    run_max, run_sum, acc = carry
    cut = lambda x: jax.lax.dynamic_slice_in_dim(x, j * block, block, 2)
    k_blk, v_blk = cut(k_nkse), cut(v_nkse)
    diff_ns = q_pos_n[:, None] - jax.lax.dynamic_slice_in_dim(
        k_pos_ns, j * block, block, 1)
    mask_ns = (diff_ns >= 0) & jax.lax.dynamic_slice_in_dim(
        k_valid_ns, j * block, block, 1)
    if window is not None:
      mask_ns &= diff_ns < window
    scores = jnp.einsum("nkre,nkse->nkrs", q_grouped, k_blk,
                        preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask_ns[:, None, None], scores, _NEG_INF)
    m_new = jnp.maximum(run_max, scores.max(-1))
    probs = jnp.exp(scores - m_new[..., None])
    corr = jnp.exp(run_max - m_new)
    pv = jnp.einsum("nkrs,nkse->nkre", probs.astype(v_blk.dtype), v_blk,
                    preferred_element_type=jnp.float32)
    return (m_new, run_sum * corr + probs.sum(-1),
            acc * corr[..., None] + pv)

  r = H // K
  init = (jnp.full((N, K, r), _NEG_INF, jnp.float32),
          jnp.zeros((N, K, r), jnp.float32),
          jnp.zeros((N, K, r, E), jnp.float32))
  blocks = jnp.minimum((filled + block - 1) // block, k_nkse.shape[2] // block)
  _, run_sum, acc = jax.lax.fori_loop(0, blocks, block_j, init)
  out = acc / jnp.maximum(run_sum, 1e-30)[..., None]
  return out.astype(v_nkse.dtype).reshape(N, 1, H, E)


def decode_step(config: ModelConfig, params: transformer.Params,
                cache: transformer.KVCache, tokens_n: jax.Array,
                positions_n: jax.Array, columns_n: jax.Array,
                filled: jax.Array, layers: list) -> tuple:
  """One token per row: row n's key and value go to cache column
  `columns_n[n]`, then it attends over columns [0, filled) (keys it may not
  see are masked by validity and position). `layers` as
  `transformer.unstack_layers` gives them (sliced once, outside the loop).
  Returns float32 logits (N, V) and the updated cache."""
  rows = jnp.arange(tokens_n.shape[0])
  valid = cache.valid_ns.at[rows, columns_n].set(True)
  kpos = cache.pos_ns.at[rows, columns_n].set(positions_n)
  x = transformer.embed(params, tokens_n[:, None])
  ks, vs = list(cache.k), list(cache.v)
  for i, lp in enumerate(layers):
    # pylint: disable-next=protected-access
    q, k, v = transformer._qkv(config, lp, x, positions_n[:, None])
    ks[i] = ks[i].at[rows, :, columns_n].set(k[:, :, 0].astype(ks[i].dtype))
    vs[i] = vs[i].at[rows, :, columns_n].set(v[:, :, 0].astype(vs[i].dtype))
    attn = filled_attention(q, ks[i], vs[i], positions_n, kpos, valid, filled,
                            config.sliding_window)
    # pylint: disable-next=protected-access
    x = transformer._attn_out_and_mlp(config, lp, x, attn)
  h = transformer.rms_norm(x, params["final_norm"], config.norm_eps)
  logits = transformer.unembed(config, params, h)[:, 0]
  return logits, transformer.KVCache(tuple(ks), tuple(vs), valid, kpos)
