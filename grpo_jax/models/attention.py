"""Attention as pure functions: rotary embeddings, grouped-query attention
(dense reference, softmax in float32), its mask (causal, sliding window,
padding, packed segments) and the choice of implementation
(`attend_fn`: dense, or blockwise from `BLOCKWISE_FROM` key columns).

Shapes as in transformer.py: N rows, Q query columns (the last Q of the S
key columns), H query heads, K KV heads, E head width; r = H // K.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.models import blockwise
from grpo_jax.models.config import ModelConfig

NEG_INF = -1e30  # finite, so a fully masked (padding) query row gives no NaN


def rope_frequencies(model_config: ModelConfig) -> np.ndarray:
  """Inverse frequencies [hd/2], with Llama-3 (or linear) scaling when
  configured."""
  hd = model_config.head_dim
  inv_freq = 1.0 / (model_config.rope_theta ** (np.arange(0, hd, 2) / hd))
  s = model_config.rope_scaling
  if s is None:
    return inv_freq
  if s.kind == "linear":
    return inv_freq / s.factor
  low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
  high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
  wavelen = 2 * np.pi / inv_freq
  scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
  smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
            / (s.high_freq_factor - s.low_freq_factor))
  smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(medium, smoothed, scaled)


def apply_rope(x_nqhe: jax.Array, positions_nq: jax.Array,
               inv_freq: np.ndarray) -> jax.Array:
  """Rotary embedding, HF's rotate-half layout (first half / second half).
  x: (N, Q, H, E) queries, or keys with K heads."""
  angles = positions_nq[..., None].astype(jnp.float32) * inv_freq  # (N, Q, E/2)
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x = x_nqhe.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_nqhe.dtype)


def soft_cap(x: jax.Array, cap: Optional[float]) -> jax.Array:
  """Gemma 2's logit soft-capping, cap * tanh(x / cap) (None: x)."""
  return x if cap is None else cap * jnp.tanh(x / cap)


def attention(q_nqhe: jax.Array, k_nkse: jax.Array, v_nkse: jax.Array,
              mask_nqs: jax.Array, softcap: Optional[float] = None
              ) -> jax.Array:
  """Grouped-query attention; softmax in float32. Returns (N, Q, H, E).
  softcap: the scores soft-capped (`soft_cap`) before the mask.

  Keys and values are (N, K, S, E): heads before positions, the KV cache's
  layout, so the decode step's dots need no transpose of the cache.
  """
  N, Q, H, E = q_nqhe.shape
  K = k_nkse.shape[1]
  q = q_nqhe.reshape(N, Q, K, H // K, E)
  scores = jnp.einsum("nqkre,nkse->nkrqs", q, k_nkse,
                      preferred_element_type=jnp.float32) / np.sqrt(E)
  scores = soft_cap(scores, softcap)
  scores = jnp.where(mask_nqs[:, None, None], scores, NEG_INF)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_nkse.dtype)
  # Heads-first output, then one transpose: asking the dot for (n, q, k, r, e)
  # directly made XLA:CPU pick an (n, k)-batched dot whose N is H // K (3 for
  # SmolLM2), 3.5x slower for decode attention (benchmarks/sampler.py).
  out = jnp.einsum("nkrqs,nkse->nkrqe", probs, v_nkse)
  return jnp.moveaxis(out, 3, 1).reshape(N, Q, H, E)


def attention_mask(model_config: ModelConfig, q_pos_nq: jax.Array,
                   k_pos_ns: jax.Array, k_valid_ns: jax.Array,
                   q_seg_nq: Optional[jax.Array] = None,
                   k_seg_ns: Optional[jax.Array] = None) -> jax.Array:
  """Causal (+ sliding window) mask over positions, and padding. (N, Q, S).

  With segment ids (packed rows), a query sees only keys of its own segment
  and of its group's shared prompt (`blockwise.segment_mask`).
  """
  diff = q_pos_nq[:, :, None] - k_pos_ns[:, None, :]
  mask = (diff >= 0) & k_valid_ns[:, None, :]
  if model_config.sliding_window is not None:
    mask &= diff < model_config.sliding_window
  if q_seg_nq is not None:
    mask &= blockwise.segment_mask(q_seg_nq, k_seg_ns)
  return mask


# hidden_states' attention: "dense" builds the (N, K, H // K, Q, S) scores (the
# reference; fastest for short rows on CPU), "blockwise" never does
# (models/blockwise.py), "auto" is blockwise from BLOCKWISE_FROM key columns.
ATTENTION = ("auto", "dense", "blockwise")
BLOCKWISE_FROM = 2048


def attend_fn(model_config: ModelConfig, impl: str, q_pos_nq: jax.Array,
              k_pos_ns: jax.Array, k_valid_ns: jax.Array,
              q_seg_nq: Optional[jax.Array] = None,
              k_seg_ns: Optional[jax.Array] = None):
  """(q, k, v) -> attention output under the mask these inputs define,
  with the `impl` attention; queries are the last Q of the S key columns."""
  if impl not in ATTENTION:
    raise ValueError(f"attention={impl!r}; allowed: {ATTENTION}")
  if impl == "auto":
    impl = "blockwise" if k_pos_ns.shape[1] >= BLOCKWISE_FROM else "dense"
  if impl == "blockwise":
    return functools.partial(
        blockwise.attention,
        mask=blockwise.MaskInfo(q_pos_nq, k_pos_ns, k_valid_ns, q_seg_nq,
                                k_seg_ns),
        sliding_window=model_config.sliding_window,
        softcap=model_config.attn_softcap)
  mask = attention_mask(model_config, q_pos_nq, k_pos_ns, k_valid_ns, q_seg_nq,
                        k_seg_ns)
  return lambda q, k, v: attention(q, k, v, mask, model_config.attn_softcap)
