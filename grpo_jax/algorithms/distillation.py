"""On-policy distillation's per-token signal (GKD, Agarwal et al. 2024;
Thinking Machines, "On-Policy Distillation", 2025).

The student samples y ~ π_S; the teacher scores the same tokens. The reverse
KL KL(π_S || π_T) = E_{y~π_S}[log π_S(y) - log π_T(y)] has, per sampled token,
the single-sample estimate log π_S(y_t|·) - log π_T(y_t|·); its negative is
the token's reward, and the advantage of token t is that reward itself (no
group baseline: every token has its own teacher-given signal):

    A_t = -(log π_S(y_t | x, y_<t) - log π_T(y_t | x, y_<t)) · m_t

The usual policy-gradient loss then trains on A_t ([n, t], like process
advantages). Both log-probs are of the same temperature-scaled distribution
the sampler draws from.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def reverse_kl_advantages(student_logp_nt: jax.Array, teacher_logp_nt: jax.Array,
                          mask_nt: jax.Array) -> jax.Array:
  """A_t = -(log π_S - log π_T) on valid tokens, 0 elsewhere; [n, t]."""
  diff_nt = student_logp_nt.astype(jnp.float32) - teacher_logp_nt.astype(jnp.float32)
  return jnp.where(mask_nt > 0, -diff_nt, 0.0)


def reverse_kl_metrics(student_logp_nt: jax.Array, teacher_logp_nt: jax.Array,
                       mask_nt: jax.Array) -> dict[str, jax.Array]:
  """The per-token reverse-KL estimate averaged over valid tokens (token
  mean), and the mean per-sequence sum (the sequence's reverse KL)."""
  m = (mask_nt > 0).astype(jnp.float32)
  diff_nt = (student_logp_nt - teacher_logp_nt) * m
  tokens = jnp.maximum(m.sum(), 1.0)
  return {"distill/reverse_kl_token": diff_nt.sum() / tokens,
          "distill/reverse_kl_seq": diff_nt.sum(axis=1).mean()}
