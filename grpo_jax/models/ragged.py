"""Ragged decoding: every row at its own cache column, attention over the
filled columns only.

`decode.decode_step` writes all rows at one column (the static
sampler's rows advance in lockstep) and attends over the whole allocated
cache. The continuous-batching sampler's rows do not: each cache row (a
slot) holds a different sequence, started at a different decode step. Here
row n writes its key and value at its own column `columns_n[n]` (one
scatter), and attention reads key columns only up to `filled`, the largest
filled length of the rows that matter, rounded up to whole blocks of
`BLOCK_S` columns (bucketed: one dense attention per prefix length, chosen
by `lax.switch`). A short row next to a long one pays for the long one's
blocks (masked), but no row pays for the columns nobody has written yet:
the cost of a step grows with the longest live sequence, not with
`max_new_tokens`.

Shapes use the letters of `grpo_jax`: N rows (slots), S cache columns,
K KV heads, H query heads, E head width, D model width, V vocabulary.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from grpo_jax.models import attention, blockwise, decode, transformer
from grpo_jax.models.config import ModelConfig

BLOCK_S = 128          # key columns per block of the decode attention


def filled_attention(q_nqhe: jax.Array, k_nkse: jax.Array, v_nkse: jax.Array,
                     mask: blockwise.MaskInfo, filled: jax.Array,
                     window=None, block: int = BLOCK_S,
                     softcap=None) -> jax.Array:
  """One query per row (Q = 1) against key columns [0, filled), rounded up to
  whole blocks: bucketed, one `lax.switch` branch per prefix length (1, 2,
  ... S/block blocks), each a dense `attention.attention` over its
  prefix. S must be a multiple of `block`. The mask is
  `attention.attention_mask`'s over `mask`'s q_pos (N, 1), k_pos and
  k_valid (N, S) (no segments: decoding): valid keys at positions <= the
  query's (and within the sliding window). Scores soft-capped by
  `softcap` (Gemma 2). Returns (N, 1, H, E).

  Why buckets, not a loop over blocks with an online softmax: on CPU the
  loop's dynamic slices copy every block of every row's cache each step.
  Bucketed, `python benchmarks/ragged.py --slots 0,8,32` went from 1.43x to
  1.57x the static sampler (16 slots), and `--samplers-only --prompts 32
  --slots 64,32` from 1.23x / 1.40x to 1.56x / 1.68x (docs/speed.md)."""
  S = k_nkse.shape[2]
  if S % block:
    raise ValueError(f"{S} cache columns are not a multiple of the block "
                     f"{block}")
  if mask.q_seg is not None or mask.k_seg is not None:
    raise ValueError("decode attention takes no segment ids")
  q_pos_n = mask.q_pos[:, 0]

  def prefix(blocks: int):
    def attend(q, k, v, k_pos, k_valid):
      cut = blocks * block
      diff_ns = q_pos_n[:, None] - k_pos[:, :cut]
      mask_ns = (diff_ns >= 0) & k_valid[:, :cut]
      if window is not None:
        mask_ns &= diff_ns < window
      return attention.attention(q, k[:, :, :cut], v[:, :, :cut],
                                   mask_ns[:, None], softcap)
    return attend

  buckets = S // block
  index = jnp.clip((filled + block - 1) // block, 1, buckets) - 1
  return jax.lax.switch(index, [prefix(b + 1) for b in range(buckets)],
                        q_nqhe, k_nkse, v_nkse, mask.k_pos, mask.k_valid)


def decode_step(model_config: ModelConfig, weights: decode.Weights,
                cache: decode.KVCache, tokens_n: jax.Array,
                positions_n: jax.Array, columns_n: jax.Array,
                filled: jax.Array, record_routes: bool = False) -> tuple:
  """One token per row: row n's key and value go to cache column
  `columns_n[n]`, then it attends over columns [0, filled) (keys it may not
  see are masked by validity and position). `weights` as `decode.weights`
  gives them (sliced once, outside the loop). Returns float32 logits
  (N, V) and the updated cache; record_routes: and the experts each sparse
  layer chose for the token (L_sparse, N, C)."""
  rows = jnp.arange(tokens_n.shape[0])
  valid = cache.valid_ns.at[rows, columns_n].set(True)
  kpos = cache.pos_ns.at[rows, columns_n].set(positions_n)
  keys = blockwise.MaskInfo(positions_n[:, None], kpos, valid)
  x = transformer.embed(weights.params, tokens_n[:, None], model_config)
  ks, vs, routes = list(cache.k), list(cache.v), []
  write = lambda c, new_nke: decode.set_in_bits(
      c, new_nke, lambda c, new: c.at[rows, :, columns_n].set(new))
  for i, lp in enumerate(weights.layers):
    c = model_config.layer_config(i)     # its window and RoPE base
    q, k, v = transformer.qkv(c, lp, x, positions_n[:, None])
    ks[i] = write(ks[i], k[:, :, 0])
    if vs:                       # else the values are the keys (MLA)
      vs[i] = write(vs[i], v[:, :, 0])
    attn = filled_attention(q, ks[i], decode.layer_values(ks, vs, i), keys,
                            filled, c.sliding_window, softcap=c.attn_softcap)
    x, routing = transformer.attn_out_and_routed_mlp(c, lp, x, attn)
    if routing is not None:
      routes.append(routing.experts_nc)
  out = (decode.logits(model_config, weights.params, x),
         decode.KVCache(tuple(ks), tuple(vs), valid, kpos))
  return (*out, jnp.stack(routes)) if record_routes else out
