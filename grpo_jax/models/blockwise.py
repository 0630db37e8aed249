"""Blockwise (flash-style) attention in plain JAX: no [Q, S] score tensor.

`attention.attention` builds the (N, K, R, Q, S) float32 scores; at 20k
tokens that is ~16 GiB per row per layer. Here queries run in blocks of
`block_q`, keys in blocks of `block_k`, with the online softmax (running
max m, normaliser l, output accumulator) of Dao et al. 2022 (FlashAttention,
Alg. 1): temporaries are O(block_q * block_k) per head. Shapes as in
`transformer`: N rows, Q query and S key columns, H query heads, K KV heads,
R = H // K, E head width.


The mask is computed per block from positions, validity and segment ids,
exactly as `attention.attention_mask` computes it. Blocks the causal mask
(and the sliding window) hides are never computed: key block j is visited
by query block i only if some key column in it is <= the block's last query
column. This relies on what every caller here guarantees: within a segment,
a later column holds a later position (left-padded rows, packed rows whose
positions restart per segment, [prompt | completion] rows), and a group's
shared prompt precedes its members in the row (`segment_mask`). Query row i is
key column `q_offset + i` (q_offset = S - Q: queries are the last Q
columns).

Gradients: a `jax.custom_vjp` recomputes each block's probabilities from
the saved log-normaliser (FlashAttention Alg. 2) instead of letting
autodiff keep every block of the loops. Fully masked query rows (padding)
give some finite output, as the dense path's do; nothing reads them.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

_NEG_INF = -1e30
# Segment ids of packed rows: group * SEGMENT_MEMBERS + member. A query sees
# keys of its own segment and of member 0 of its group (a shared prompt).
SEGMENT_MEMBERS = 1 << 16


def segment_mask(q_seg: jax.Array, k_seg: jax.Array) -> jax.Array:
  """(N, Q, S): key in the query's segment, or in its group's member 0."""
  same = q_seg[:, :, None] == k_seg[:, None, :]
  shared = ((k_seg % SEGMENT_MEMBERS == 0)[:, None, :]
            & (q_seg[:, :, None] // SEGMENT_MEMBERS
               == k_seg[:, None, :] // SEGMENT_MEMBERS))
  return same | shared


class MaskInfo(NamedTuple):
  """What the mask is computed from, per row: (N, Q) queries, (N, S) keys
  (`attention.attention_mask`'s inputs); segment ids None: unpacked rows."""
  q_pos: jax.Array
  k_pos: jax.Array
  k_valid: jax.Array
  q_seg: Optional[jax.Array] = None
  k_seg: Optional[jax.Array] = None


def _pad_to(x: jax.Array, axis: int, multiple: int, value=0) -> jax.Array:
  size = x.shape[axis]
  extra = -size % multiple
  if not extra:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, extra)
  return jnp.pad(x, pad, constant_values=value)


def _block_mask(info: MaskInfo, i, j, block_q: int, block_k: int,
                window: Optional[int]) -> jax.Array:
  """(N, bq, bk) mask of query block i against key block j."""
  q_pos = jax.lax.dynamic_slice_in_dim(info.q_pos, i * block_q, block_q, 1)
  k_pos = jax.lax.dynamic_slice_in_dim(info.k_pos, j * block_k, block_k, 1)
  k_valid = jax.lax.dynamic_slice_in_dim(info.k_valid, j * block_k, block_k, 1)
  diff = q_pos[:, :, None] - k_pos[:, None, :]
  mask = (diff >= 0) & k_valid[:, None, :]
  if window is not None:
    mask &= diff < window
  if info.q_seg is not None:
    q_seg = jax.lax.dynamic_slice_in_dim(info.q_seg, i * block_q, block_q, 1)
    k_seg = jax.lax.dynamic_slice_in_dim(info.k_seg, j * block_k, block_k, 1)
    mask &= segment_mask(q_seg, k_seg)
  return mask


def _key_blocks(i, block_q: int, block_k: int, q_offset: int,
                num_k_blocks: int, window: Optional[int]):
  """[lo, hi): the key blocks query block i can see (by column)."""
  last_col = q_offset + (i + 1) * block_q - 1
  hi = jnp.minimum(last_col // block_k + 1, num_k_blocks)
  lo = 0
  if window is not None:
    first_col = q_offset + i * block_q
    lo = jnp.maximum(first_col - window + 1, 0) // block_k
  return lo, hi


class _Static(NamedTuple):
  block_q: int
  block_k: int
  q_offset: int
  window: Optional[int]
  softcap: Optional[float] = None


def _scores(q_blk, k_blk, mask, scale, softcap=None):
  """(N, K, R, bq, bk) float32 scores of one block pair, soft-capped
  (Gemma 2: cap * tanh(s / cap)) when `softcap`, masked."""
  s = jnp.einsum("nkrqe,nkse->nkrqs", q_blk, k_blk,
                 preferred_element_type=jnp.float32) * scale
  if softcap is not None:
    s = softcap * jnp.tanh(s / softcap)
  return jnp.where(mask[:, None, None], s, _NEG_INF)


def _softcap_slope(s, softcap):
  """d(capped)/d(raw) from the capped scores: 1 - (s / cap)^2; 0 where
  masked (s = _NEG_INF), 1 without a cap."""
  if softcap is None:
    return 1.0
  return jnp.where(jnp.abs(s) <= softcap, 1 - jnp.square(s / softcap), 0.0)


def _forward(st: _Static, q, k, v, info: MaskInfo):
  """q (N, K, R, Qp, E), k/v (N, K, Sp, E), padded to whole blocks.
  Returns out (N, K, R, Qp, E) float32 and log-normaliser (N, K, R, Qp)."""
  N, K, R, Qp, E = q.shape
  nq, nk = Qp // st.block_q, k.shape[2] // st.block_k
  scale = 1.0 / np.sqrt(E)

  def q_block(i):
    q_blk = jax.lax.dynamic_slice_in_dim(q, i * st.block_q, st.block_q, 3)
    lo, hi = _key_blocks(i, st.block_q, st.block_k, st.q_offset, nk,
                         st.window)

    def body(j, carry):
      m, l, acc = carry
      k_blk = jax.lax.dynamic_slice_in_dim(k, j * st.block_k, st.block_k, 2)
      v_blk = jax.lax.dynamic_slice_in_dim(v, j * st.block_k, st.block_k, 2)
      s = _scores(q_blk, k_blk, _block_mask(info, i, j, st.block_q,
                                            st.block_k, st.window), scale,
                  st.softcap)
      m_new = jnp.maximum(m, s.max(-1))
      p = jnp.exp(s - m_new[..., None])
      corr = jnp.exp(m - m_new)
      pv = jnp.einsum("nkrqs,nkse->nkrqe", p.astype(v.dtype), v_blk,
                      preferred_element_type=jnp.float32)
      return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

    shape = (N, K, R, st.block_q)
    init = (jnp.full(shape, -jnp.inf, jnp.float32),
            jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape + (E,), jnp.float32))
    m, l, acc = jax.lax.fori_loop(lo, hi, body, init)
    return acc / l[..., None], m + jnp.log(l)

  out, lse = jax.lax.map(q_block, jnp.arange(nq))   # (nq, N, K, R, bq, ...)
  out = jnp.moveaxis(out, 0, 3).reshape(N, K, R, Qp, E)
  lse = jnp.moveaxis(lse, 0, 3).reshape(N, K, R, Qp)
  return out, lse


class _Residuals(NamedTuple):
  """What the forward pass keeps for the backward: its inputs, its float32
  output and log-normaliser (`_forward`)."""
  q: jax.Array
  k: jax.Array
  v: jax.Array
  info: MaskInfo
  out: jax.Array
  lse: jax.Array


def _backward(st: _Static, res: _Residuals, dout):
  """FlashAttention-2 backward: per query block, recompute p from lse."""
  q, k, v, info, out, lse = res
  N, K, R, Qp, E = q.shape
  nq, nk = Qp // st.block_q, k.shape[2] // st.block_k
  scale = 1.0 / np.sqrt(E)
  delta = jnp.sum(dout.astype(jnp.float32) * out, axis=-1)   # (N, K, R, Qp)

  def q_block(carry, i):
    dk, dv = carry
    sl = lambda x, axis: jax.lax.dynamic_slice_in_dim(
        x, i * st.block_q, st.block_q, axis)
    q_blk, do_blk = sl(q, 3), sl(dout, 3)
    lse_blk, delta_blk = sl(lse, 3), sl(delta, 3)
    lo, hi = _key_blocks(i, st.block_q, st.block_k, st.q_offset, nk,
                         st.window)

    def body(j, inner):
      dq, dk, dv = inner
      k_blk = jax.lax.dynamic_slice_in_dim(k, j * st.block_k, st.block_k, 2)
      v_blk = jax.lax.dynamic_slice_in_dim(v, j * st.block_k, st.block_k, 2)
      s = _scores(q_blk, k_blk, _block_mask(info, i, j, st.block_q,
                                            st.block_k, st.window), scale,
                  st.softcap)
      p = jnp.exp(s - lse_blk[..., None])                    # (N,K,R,bq,bk)
      dv_blk = jnp.einsum("nkrqs,nkrqe->nkse", p.astype(dout.dtype), do_blk,
                          preferred_element_type=jnp.float32)
      dp = jnp.einsum("nkrqe,nkse->nkrqs", do_blk, v_blk,
                      preferred_element_type=jnp.float32)
      ds = (p * (dp - delta_blk[..., None]) * scale
            * _softcap_slope(s, st.softcap))
      dq = dq + jnp.einsum("nkrqs,nkse->nkrqe", ds.astype(k.dtype), k_blk,
                           preferred_element_type=jnp.float32)
      dk_blk = jnp.einsum("nkrqs,nkrqe->nkse", ds.astype(q.dtype), q_blk,
                          preferred_element_type=jnp.float32)
      add = lambda acc, blk: jax.lax.dynamic_update_slice_in_dim(
          acc, jax.lax.dynamic_slice_in_dim(acc, j * st.block_k, st.block_k,
                                            2) + blk, j * st.block_k, 2)
      return dq, add(dk, dk_blk), add(dv, dv_blk)

    dq0 = jnp.zeros(q_blk.shape, jnp.float32)
    dq, dk, dv = jax.lax.fori_loop(lo, hi, body, (dq0, dk, dv))
    return (dk, dv), dq

  zeros = jnp.zeros(k.shape, jnp.float32)
  (dk, dv), dq = jax.lax.scan(q_block, (zeros, zeros), jnp.arange(nq))
  dq = jnp.moveaxis(dq, 0, 3).reshape(N, K, R, Qp, E)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(st: _Static, q, k, v, info: MaskInfo):
  return _forward(st, q, k, v, info)[0].astype(q.dtype)


def _attend_fwd(st: _Static, q, k, v, info: MaskInfo):
  out, lse = _forward(st, q, k, v, info)
  return out.astype(q.dtype), _Residuals(q, k, v, info, out, lse)


def _attend_bwd(st: _Static, res: _Residuals, dout):
  dq, dk, dv = _backward(st, res, dout)
  zero_info = jax.tree.map(
      lambda x: np.zeros(x.shape, jax.dtypes.float0), res.info)
  return dq, dk, dv, zero_info


_attend.defvjp(_attend_fwd, _attend_bwd)


def attention(q_nqhe: jax.Array, k_nkse: jax.Array, v_nkse: jax.Array,
              mask: MaskInfo, *, sliding_window: Optional[int] = None,
              softcap: Optional[float] = None, block_q: int = 512,
              block_k: int = 512) -> jax.Array:
  """`attention.attention(q, k, v, attention.attention_mask(...))` for
  queries that are the last Q of the S key columns. Returns (N, Q, H, E).

  q (N, Q, H, E); k, v (N, K, S, E) as the dense path takes them; the
  mask's inputs (`MaskInfo`: q_pos (N, Q), k_pos and k_valid (N, S),
  segment ids) as `attention.attention_mask` takes them.
  """
  N, Q, H, E = q_nqhe.shape
  K, S = k_nkse.shape[1], k_nkse.shape[2]
  bq, bk = min(block_q, Q), min(block_k, S)
  q = jnp.moveaxis(q_nqhe.reshape(N, Q, K, H // K, E), 1, 3)  # (N,K,R,Q,E)
  q = _pad_to(q, 3, bq)
  k, v = _pad_to(k_nkse, 2, bk), _pad_to(v_nkse, 2, bk)
  # Padded queries sit after the last column; padded keys are invalid.
  seg = lambda x, n, m: None if x is None else _pad_to(x, 1, m, -1)
  info = MaskInfo(_pad_to(mask.q_pos, 1, bq), _pad_to(mask.k_pos, 1, bk),
                  _pad_to(mask.k_valid, 1, bk, False),
                  seg(mask.q_seg, Q, bq), seg(mask.k_seg, S, bk))
  st = _Static(bq, bk, S - Q, sliding_window, softcap)
  out = _attend(st, q, k, v, info)[:, :, :, :Q]
  return jnp.moveaxis(out, 3, 1).reshape(N, Q, H, E)
