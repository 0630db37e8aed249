"""Per-token policy losses chosen by name (`rl.policy_loss`).

Each loss maps token log-probs to a per-token loss [N, T] that
`losses.policy_loss` then weights (rollout correction) and aggregates over
the GLOBAL normalisers, so every loss is a partial sum under micro-batching
(losses.py's contract). A sequence-level loss (GSPO, GMPO) only reads the
tokens of its own row, and rows are never split between micro-batches.

  name       per-token loss l                                     source
  ppo        -min(ρA, clip(ρ, 1-ε_l, 1+ε_h)A), dual clip for A<0  PPO; DAPO eq. 8
  gspo       -min(sA, clip(s, 1-ε_l, 1+ε_h)A), s the sequence's   GSPO (Zheng et al. 2025)
             geometric-mean ratio, token form lp - sg(lp) + sg(log s)
  cispo      -sg(clip(ρ, 1-ε_l, 1+ε_h))·A·lp  (verl)               CISPO (MiniMax-M1 2025)
  cispo_cap  -sg(min(ρ, cap))·A·lp            (TRL, cap = 5)       CISPO, TRL's form
  gmpo       -Ā·exp(mean_t clip_A(lp - old)), one value per row   GMPO (Zhao et al. 2025)
  sapo       -σ(τ(ρ-1))·4/τ·A, τ = τ₊ if A > 0 else τ₋            SAPO (Gao et al. 2025)

Fixed aggregation: verl always aggregates GSPO and SAPO as
seq-mean-token-mean, and GMPO's loss is a plain mean over sequences (which
seq-mean-token-mean of its per-row value is). `FIXED_AGG` names these; the
config validation rejects any other `rl.loss_agg` with them.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from grpo_jax.registry import register

LOG_RATIO_CLAMP = 20.0   # verl: lp - old clamped to ±20 before exp
GSPO_LOG_CLAMP = 10.0    # verl: log s clamped at 10 (upper side only)
SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"


@dataclasses.dataclass(frozen=True)
class LossParams:
  """The hyper-parameters of every registered loss (each reads its own)."""
  eps_low: float = 0.2
  eps_high: float = 0.2
  dual_clip: Optional[float] = None   # ppo only
  cispo_cap: float = 5.0              # cispo_cap: TRL's epsilon_high
  gmpo_eps: float = 0.4               # gmpo: log-space clip
  sapo_tau_pos: float = 1.0           # sapo: temperature for A > 0
  sapo_tau_neg: float = 1.05          # sapo: temperature for A <= 0


class PolicyLoss(NamedTuple):
  """A registered loss: fn(logp_nt, old_logp_nt, adv_nt, mask_nt, p) ->
  (loss_nt [N, T], flags {name: bool [N, T] or [N, 1]} for clip metrics)."""
  fn: Callable
  fixed_agg: Optional[str]


def log_ratio(logp_nt: jax.Array, old_logp_nt: jax.Array) -> jax.Array:
  """lp - sg(old), clamped to ±20 (verl)."""
  return jnp.clip(logp_nt.astype(jnp.float32)
                  - jax.lax.stop_gradient(old_logp_nt),
                  -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _seq_mean(x_nt: jax.Array, mask_nt: jax.Array) -> jax.Array:
  """Masked mean over each row, [N, 1]; 0 for an all-masked row."""
  count_n1 = jnp.maximum(mask_nt.sum(axis=1, keepdims=True), 1.0)
  return (x_nt * mask_nt).sum(axis=1, keepdims=True) / count_n1


def ratio(logp_nt: jax.Array, old_logp_nt: jax.Array) -> jax.Array:
  """ρ = exp(lp - old), with lp - old clamped to ±20 (verl) so a stale or
  padded token cannot overflow. old is a constant (no gradient flows into
  it), so on-policy updates may pass old_logp_nt = logp_nt: ρ = 1, ∇ρ = ∇lp."""
  return jnp.exp(log_ratio(logp_nt, old_logp_nt))


def clipped_surrogate(ratio_nt: jax.Array, adv_nt: jax.Array, *,
                      eps_low: float, eps_high: float,
                      dual_clip: Optional[float] = None) -> jax.Array:
  """Per-token PPO loss with clip-higher and an optional dual clip, [N, T]."""
  # DAPO eq. 8 (clip-higher): l = -min(ρA, clip(ρ, 1-ε_low, 1+ε_high)·A)
  clipped_nt = jnp.clip(ratio_nt, 1.0 - eps_low, 1.0 + eps_high)
  loss_nt = -jnp.minimum(ratio_nt * adv_nt, clipped_nt * adv_nt)
  if dual_clip is not None:
    # Dual-clip PPO (Ye et al. 2020), as verl: for A < 0, l = min(l, -A·c)
    loss_nt = jnp.where(adv_nt < 0, jnp.minimum(loss_nt, -adv_nt * dual_clip),
                        loss_nt)
  return loss_nt


def ppo_loss(logp_nt, old_logp_nt, adv_nt, mask_nt, p: LossParams):
  del mask_nt
  ratio_nt = ratio(logp_nt, old_logp_nt)
  loss_nt = clipped_surrogate(ratio_nt, adv_nt, eps_low=p.eps_low,
                              eps_high=p.eps_high, dual_clip=p.dual_clip)
  # token flags where a clip is active (its gradient is zero)
  flags = {"clip/low_frac": (adv_nt < 0) & (ratio_nt < 1.0 - p.eps_low),
           "clip/high_frac": (adv_nt > 0) & (ratio_nt > 1.0 + p.eps_high)}
  if p.dual_clip is not None:
    flags["clip/dual_frac"] = (adv_nt < 0) & (ratio_nt > p.dual_clip)
  return loss_nt, flags


def gspo_loss(logp_nt, old_logp_nt, adv_nt, mask_nt, p: LossParams):
  logp_nt = logp_nt.astype(jnp.float32)
  # GSPO eq. 7: log s_i = 1/|y_i| Σ_t (lp - old); the token form has value
  # s_i and the gradient s_i·∇lp_t (verl's "gspo" loss mode).
  log_s_n1 = _seq_mean(logp_nt - jax.lax.stop_gradient(old_logp_nt), mask_nt)
  log_s_nt = (logp_nt - jax.lax.stop_gradient(logp_nt)
              + jax.lax.stop_gradient(log_s_n1))
  s_nt = jnp.exp(jnp.minimum(log_s_nt, GSPO_LOG_CLAMP))
  clipped_nt = jnp.clip(s_nt, 1.0 - p.eps_low, 1.0 + p.eps_high)
  loss_nt = jnp.maximum(-adv_nt * s_nt, -adv_nt * clipped_nt)
  s_n1 = jax.lax.stop_gradient(s_nt[:, :1])
  flags = {"clip/low_frac": (adv_nt < 0) & (s_n1 < 1.0 - p.eps_low),
           "clip/high_frac": (adv_nt > 0) & (s_n1 > 1.0 + p.eps_high)}
  return loss_nt, flags


def _cispo(logp_nt, adv_nt, weight_nt):
  # CISPO (MiniMax-M1 eq. 4): REINFORCE with a clipped, stop-gradient IS weight
  return -jax.lax.stop_gradient(weight_nt) * adv_nt * logp_nt.astype(
      jnp.float32)


def cispo_loss(logp_nt, old_logp_nt, adv_nt, mask_nt, p: LossParams):
  del mask_nt
  ratio_nt = ratio(logp_nt, old_logp_nt)
  weight_nt = jnp.clip(ratio_nt, 1.0 - p.eps_low, 1.0 + p.eps_high)
  flags = {"clip/low_frac": ratio_nt < 1.0 - p.eps_low,
           "clip/high_frac": ratio_nt > 1.0 + p.eps_high}
  return _cispo(logp_nt, adv_nt, weight_nt), flags


def cispo_cap_loss(logp_nt, old_logp_nt, adv_nt, mask_nt, p: LossParams):
  del mask_nt
  ratio_nt = ratio(logp_nt, old_logp_nt)
  weight_nt = jnp.minimum(ratio_nt, p.cispo_cap)
  return _cispo(logp_nt, adv_nt, weight_nt), {
      "clip/high_frac": ratio_nt > p.cispo_cap}


def gmpo_loss(logp_nt, old_logp_nt, adv_nt, mask_nt, p: LossParams):
  x_nt = log_ratio(logp_nt, old_logp_nt)
  sign_nt = jnp.sign(adv_nt)
  # GMPO eq. 5: clip each token's log-ratio to [-ε, ε] on the side that the
  # sign of A makes pessimistic (the min in PPO's objective, in log space)
  x_clip_nt = sign_nt * jnp.minimum(sign_nt * x_nt,
                                    sign_nt * jnp.clip(x_nt, -p.gmpo_eps,
                                                       p.gmpo_eps))
  ratio_n1 = jnp.exp(_seq_mean(x_clip_nt, mask_nt))   # geometric mean ratio
  adv_n1 = _seq_mean(adv_nt, mask_nt)
  loss_nt = jnp.broadcast_to(-adv_n1 * ratio_n1, adv_nt.shape)
  flags = {"clip/low_frac": (adv_nt < 0) & (x_nt < -p.gmpo_eps),
           "clip/high_frac": (adv_nt > 0) & (x_nt > p.gmpo_eps)}
  return loss_nt, flags


def sapo_loss(logp_nt, old_logp_nt, adv_nt, mask_nt, p: LossParams):
  del mask_nt
  ratio_nt = ratio(logp_nt, old_logp_nt)
  tau_nt = jnp.where(adv_nt > 0, p.sapo_tau_pos, p.sapo_tau_neg)
  # SAPO: a soft gate σ(τ(ρ-1))·4/τ in place of the hard clip; its slope at
  # ρ = 1 is 1, so on-policy it has the plain policy gradient
  gate_nt = jax.nn.sigmoid(tau_nt * (ratio_nt - 1.0)) * 4.0 / tau_nt
  return -gate_nt * adv_nt, {}


register("policy_loss", "ppo")(PolicyLoss(ppo_loss, None))
register("policy_loss", "gspo")(PolicyLoss(gspo_loss, SEQ_MEAN_TOKEN_MEAN))
register("policy_loss", "cispo")(PolicyLoss(cispo_loss, None))
register("policy_loss", "cispo_cap")(PolicyLoss(cispo_cap_loss, None))
register("policy_loss", "gmpo")(PolicyLoss(gmpo_loss, SEQ_MEAN_TOKEN_MEAN))
register("policy_loss", "sapo")(PolicyLoss(sapo_loss, SEQ_MEAN_TOKEN_MEAN))


def validate_params(name: str, p: LossParams) -> None:
  """Range checks, naming the parameter."""
  if not 0.0 <= p.eps_low < 1.0 and name not in ("cispo",):
    raise ValueError(f"eps_low={p.eps_low}; allowed: 0 <= eps_low < 1")
  if p.eps_low < 0.0 or p.eps_high < 0.0:
    raise ValueError(f"eps_low/eps_high={p.eps_low}/{p.eps_high}; allowed: "
                     f">= 0")
  if p.dual_clip is not None and p.dual_clip <= 1.0:
    raise ValueError(f"dual_clip={p.dual_clip}; allowed: None or > 1")
  if p.cispo_cap <= 0 or p.gmpo_eps <= 0:
    raise ValueError(f"cispo_cap/gmpo_eps={p.cispo_cap}/{p.gmpo_eps}; "
                     f"allowed: > 0")
  if p.sapo_tau_pos <= 0 or p.sapo_tau_neg <= 0:
    raise ValueError(f"sapo_tau_pos/sapo_tau_neg={p.sapo_tau_pos}/"
                     f"{p.sapo_tau_neg}; allowed: > 0")
