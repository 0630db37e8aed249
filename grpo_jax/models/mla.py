"""DeepSeek's multi-head latent attention (MLA), run as multi-query
attention over the latent.

transformers' DeepseekV3Attention: the query (through a low-rank `wq_a`,
its norm and `wq_b`, or one `wq`) splits per head into a no-rope part
(nope) and a rope part; `wkv_a` gives each token a latent c (R wide,
normed) and one rope key shared by the heads; `wkv_b` expands c to every
head's no-rope key and its value. Here the key expansion is absorbed into
the queries (q_nope · W_uk, R wide per head), so the scores are

    [q_nope W_uk, q_rope] · [c, k_rope]     (width R + rope_dim)

and the attention weights average the latents c, expanded to values once
per query (W_uv) after attention. Keys and values are therefore one head
of width R + rope_dim (values: the same array; its rope columns are
dropped after attention), every attention path (dense, blockwise, the
decode steps, the page pool) runs unchanged, and a cache holds the latent
and the rope key per token, not H heads' keys and values. The scale stays
1/sqrt(nope_dim + rope_dim) (the queries are rescaled for the width).

Shapes as in `transformer`; P the no-rope width, U the value width, A the
query's low rank (letters local to these einsums).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.models.attention import apply_rope
from grpo_jax.models.moe_config import MlaConfig

Params = dict[str, Any]


def param_shapes(mla: MlaConfig, L: int, D: int, H: int) -> dict:
  """The attention leaves of an MLA model (replacing wq, wk, wv, wo)."""
  P, R, U = mla.nope_dim, mla.kv_lora_rank, mla.v_head_dim
  shapes = {"wkv_a": (L, D, R + mla.rope_dim), "kv_a_norm": (L, R),
            "wkv_b": (L, R, H, P + U), "wo": (L, H, U, D)}
  if mla.q_lora_rank:
    A = mla.q_lora_rank
    shapes.update(wq_a=(L, D, A), q_a_norm=(L, A),
                  wq_b=(L, A, H, P + mla.rope_dim))
  else:
    shapes["wq"] = (L, D, H, P + mla.rope_dim)
  return shapes


AXES = {
    "wkv_a": ("layers", "embed", None), "kv_a_norm": ("layers", None),
    "wkv_b": ("layers", None, "q_heads", "head_dim"),
    "wq_a": ("layers", "embed", None), "q_a_norm": ("layers", None),
    "wq_b": ("layers", None, "q_heads", "head_dim"),
}


def rope_frequencies(mla: MlaConfig, theta: float) -> np.ndarray:
  return 1.0 / (theta ** (np.arange(0, mla.rope_dim, 2) / mla.rope_dim))


def qkv(mla: MlaConfig, lp: Params, h_nqd: jax.Array, positions_nq,
        theta: float, eps: float, norm) -> tuple:
  """Normed input (N, Q, D) -> q (N, Q, H, R + rope), k = v (N, 1, Q,
  R + rope): the latent attention as one-head attention."""
  P, R = mla.nope_dim, mla.kv_lora_rank
  w = lambda name: lp[name].astype(h_nqd.dtype)
  if mla.q_lora_rank:
    a = norm(jnp.einsum("nqd,da->nqa", h_nqd, w("wq_a")), lp["q_a_norm"], eps)
    q = jnp.einsum("nqa,ahe->nqhe", a, w("wq_b"))
  else:
    q = jnp.einsum("nqd,dhe->nqhe", h_nqd, w("wq"))
  inv_freq = rope_frequencies(mla, theta)
  q_rope = apply_rope(q[..., P:], positions_nq, inv_freq)
  q_lat = jnp.einsum("nqhp,rhp->nqhr", q[..., :P], w("wkv_b")[..., :P])
  kv = jnp.einsum("nqd,dr->nqr", h_nqd, w("wkv_a"))
  c = norm(kv[..., :R], lp["kv_a_norm"], eps)
  k_rope = apply_rope(kv[:, :, None, R:], positions_nq, inv_freq)[:, :, 0]
  scale = np.sqrt(mla.cache_dim / (P + mla.rope_dim))
  q = jnp.concatenate([q_lat, q_rope], -1) * jnp.asarray(scale, q.dtype)
  k = jnp.concatenate([c, k_rope], -1)[:, None]          # (N, 1, Q, E)
  return q, k, k


def values(mla: MlaConfig, lp: Params, attn_nqhe: jax.Array) -> jax.Array:
  """Attention over the latents (N, Q, H, R + rope) -> each head's values
  (N, Q, H, U): the latent part times W_uv."""
  P, R = mla.nope_dim, mla.kv_lora_rank
  w_uv = lp["wkv_b"][..., P:].astype(attn_nqhe.dtype)   # (R, H, U)
  return jnp.einsum("nqhr,rhu->nqhu", attn_nqhe[..., :R], w_uv)


def cache_values_per_token(model_config) -> dict:
  """Numbers a KV cache holds per token per layer: MLA's latent, against
  the same model with its heads' keys and values (GQA with K = H)."""
  mla, H = model_config.mla, model_config.num_heads
  return {"mla": 2 * mla.cache_dim,   # k and v are one array; see docs
          "latent": mla.cache_dim,
          "per_head": H * (mla.nope_dim + mla.rope_dim + mla.v_head_dim)}
