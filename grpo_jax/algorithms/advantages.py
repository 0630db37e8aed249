"""Advantage estimators, vmapped over groups of G completions of one prompt.

Rewards come grouped: `reward_bg` float32 [B, G] (B prompts, G completions
each; the sampler's flat reward[B*G] is `reward.reshape(B, G)`, groups
contiguous). Each estimator is written for one group and `jax.vmap`-ed over B.

  name           input                           output
  "grpo"         reward_bg [B, G]                adv_bg [B, G]
  "dr_grpo"      reward_bg [B, G]                adv_bg [B, G]
  "rloo"         reward_bg [B, G]                adv_bg [B, G]
  "reinforce_pp" reward_bg, length_bg [B, G]     adv_bg [B, G]
  "reinforce_pp_baseline"  (the same)
  "grpo_process" step_reward_bgt, step_end_bgt   adv_bgt [B, G, T]

Outcome advantages are one value per completion (the loss broadcasts it over
the completion's tokens: pass `adv_bg.reshape(-1)`); process advantages are
per token (pass `adv_bgt.reshape(B * G, T)`).

The outcome estimators take the same keywords `ddof`, `eps` and `length_bg`
(valid tokens per completion) so a config switches them by name:
`lookup("advantage", name)(reward_bg, ddof=..., eps=..., length_bg=...)`.
Dr. GRPO and RLOO divide by no std and ignore ddof/eps; only REINFORCE++
reads length_bg: it whitens over the tokens of the whole batch, so the
trainer computes advantages once per step on the host's global batch,
before any mini- or micro-batching.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from grpo_jax.registry import register

DEFAULT_DDOF = 1      # verl and TRL: the unbiased std
DEFAULT_EPS = 1e-6    # verl's δ; TRL uses 1e-4


def _check_group_size(group_size: int, ddof: int) -> None:
  if group_size <= ddof:
    raise ValueError(f"a group of G={group_size} completions has no std with "
                     f"ddof={ddof}; need G > ddof")


def _zscore_group(r_g: jax.Array, ddof: int, eps: float) -> jax.Array:
  # DeepSeekMath §4.1.2 (outcome supervision): A_i = (r_i - mean r) / (std r + δ)
  return (r_g - r_g.mean()) / (jnp.std(r_g, ddof=ddof) + eps)


@register("advantage", "grpo")
def grpo_advantages(reward_bg: jax.Array, *, ddof: int = DEFAULT_DDOF,
                    eps: float = DEFAULT_EPS, length_bg=None) -> jax.Array:
  """GRPO z-scored outcome advantages, [B, G] -> [B, G]."""
  del length_bg  # per group, not per token
  reward_bg = jnp.asarray(reward_bg, jnp.float32)
  _check_group_size(reward_bg.shape[1], ddof)
  return jax.vmap(functools.partial(_zscore_group, ddof=ddof, eps=eps))(
      reward_bg)


@register("advantage", "dr_grpo")
def dr_grpo_advantages(reward_bg: jax.Array, *, ddof: int = DEFAULT_DDOF,
                       eps: float = DEFAULT_EPS, length_bg=None) -> jax.Array:
  """Dr. GRPO (Liu et al. 2025): A_i = r_i - mean_g r; no std, so no
  difficulty bias from near-uniform groups. [B, G] -> [B, G]."""
  del ddof, eps, length_bg  # no std division
  reward_bg = jnp.asarray(reward_bg, jnp.float32)
  return jax.vmap(lambda r_g: r_g - r_g.mean())(reward_bg)


def _rloo_group(r_g: jax.Array) -> jax.Array:
  # RLOO (Ahmadian et al. 2024): A_i = r_i - 1/(G-1) Σ_{j≠i} r_j
  return r_g - (r_g.sum() - r_g) / (r_g.shape[0] - 1)


@register("advantage", "rloo")
def rloo_advantages(reward_bg: jax.Array, *, ddof: int = DEFAULT_DDOF,
                    eps: float = DEFAULT_EPS, length_bg=None) -> jax.Array:
  """Leave-one-out baseline, [B, G] -> [B, G]; needs G >= 2."""
  del ddof, eps, length_bg  # no std division
  reward_bg = jnp.asarray(reward_bg, jnp.float32)
  _check_group_size(reward_bg.shape[1], 1)
  return jax.vmap(_rloo_group)(reward_bg)


def _whiten_tokens(x_bg: jax.Array, length_bg: jax.Array, ddof: int,
                   eps: float) -> jax.Array:
  """Whitens per-completion values over every valid token of the batch: the
  mean and variance weigh completion i by its token count n_i (verl's
  masked_whiten of a value broadcast over the row; variance with `ddof` over
  the token count). Completions without tokens count for nothing."""
  w_bg = jnp.asarray(length_bg, jnp.float32)
  n = jnp.maximum(w_bg.sum(), 1.0)
  mean = (w_bg * x_bg).sum() / n
  var = (w_bg * (x_bg - mean) ** 2).sum() / jnp.maximum(n - ddof, 1.0)
  return (x_bg - mean) / (jnp.sqrt(var) + eps)


def _require_lengths(name: str, length_bg) -> None:
  if length_bg is None:
    raise ValueError(f"advantage {name!r} whitens over the batch's tokens: "
                     f"pass length_bg (valid tokens per completion)")


@register("advantage", "reinforce_pp")
def reinforce_pp_advantages(reward_bg: jax.Array, *, ddof: int = DEFAULT_DDOF,
                            eps: float = DEFAULT_EPS,
                            length_bg: jax.Array | None = None) -> jax.Array:
  """REINFORCE++ (Hu 2025) with an outcome reward and γ = 1: every token's
  return is r_i, whitened over all valid tokens of the WHOLE batch (so
  compute it on the step's batch, before micro-batching). The KL penalty is
  the loss's β·KL here, not folded into the reward. [B, G] -> [B, G]."""
  _require_lengths("reinforce_pp", length_bg)
  reward_bg = jnp.asarray(reward_bg, jnp.float32)
  return _whiten_tokens(reward_bg, length_bg, ddof, eps)


@register("advantage", "reinforce_pp_baseline")
def reinforce_pp_baseline_advantages(reward_bg: jax.Array, *,
                                     ddof: int = DEFAULT_DDOF,
                                     eps: float = DEFAULT_EPS,
                                     length_bg: jax.Array | None = None
                                     ) -> jax.Array:
  """REINFORCE++-baseline (Hu 2025): subtract the group mean, then whiten
  over all valid tokens of the whole batch (REFERENCE: token-weighted mean,
  ddof over the token count). [B, G] -> [B, G]."""
  _require_lengths("reinforce_pp_baseline", length_bg)
  reward_bg = jnp.asarray(reward_bg, jnp.float32)
  centred_bg = reward_bg - reward_bg.mean(axis=1, keepdims=True)
  return _whiten_tokens(centred_bg, length_bg, ddof, eps)


def _process_group(step_reward_gt: jax.Array, step_end_gt: jax.Array,
                   ddof: int, eps: float) -> jax.Array:
  """One group: z-score the rewards of all its steps, then sum the future ones."""
  r_gt = jnp.where(step_end_gt, step_reward_gt, 0.0)
  num_steps = step_end_gt.sum()
  mean = r_gt.sum() / jnp.maximum(num_steps, 1)
  sq_dev = jnp.where(step_end_gt, (r_gt - mean) ** 2, 0.0).sum()
  std = jnp.sqrt(sq_dev / jnp.maximum(num_steps - ddof, 1))
  # DeepSeekMath §4.1.3: r̃ = (r - mean R) / std R over every step of the group
  norm_gt = jnp.where(step_end_gt, (r_gt - mean) / (std + eps), 0.0)
  # A_{i,t} = Σ_{index(j) >= t} r̃_i^{index(j)}: a reverse cumulative sum over t
  return jax.lax.cumsum(norm_gt, axis=1, reverse=True)


@register("advantage", "grpo_process")
def grpo_process_advantages(step_reward_bgt: jax.Array,
                            step_end_bgt: jax.Array, *,
                            ddof: int = DEFAULT_DDOF,
                            eps: float = DEFAULT_EPS) -> jax.Array:
  """GRPO with process supervision, per-token advantages [B, G, T].

  step_reward_bgt: float [B, G, T]; the reward of a reasoning step sits at
    the token that ends the step, other entries are ignored (may be any value).
  step_end_bgt: bool [B, G, T]; True at the last token of each step.
  The rewards of all steps of all G completions of a prompt are z-scored
  together (ddof over the number of steps; a group with <= ddof steps gets
  std 0, so its advantages are 0). Token t of completion i gets the sum of
  the normalised rewards of i's steps that end at or after t, so tokens after
  the last step end (and padding) get 0.
  """
  step_reward_bgt = jnp.asarray(step_reward_bgt, jnp.float32)
  step_end_bgt = jnp.asarray(step_end_bgt, bool)
  fn = functools.partial(_process_group, ddof=ddof, eps=eps)
  return jax.vmap(fn)(step_reward_bgt, step_end_bgt)
