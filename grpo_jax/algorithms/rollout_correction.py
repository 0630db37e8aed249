"""Rollout correction: the sampler's policy π_rollout is not quite the
trainer's π_old (bf16 sampling kernels, another backend, top-p), so the
samples are off-policy for the loss. Config group `rl.rollout_correction`.

Per token, ρ_t = π_old / π_rollout = exp(old - roll) (log-ratio clamped to
±20 as verl); per sequence ρ_seq = exp(Σ_t m·(old - roll)).

  is_level     none | token | sequence    the IS weight w (a constant: no
                                          gradient flows through it)
  is_mode      truncate: w = min(ρ, C)    (verl TIS, C = 2)
               mask:     w = ρ·[ρ <= C]   (TRL's sequence masking, C = 3)
  band         (lo, hi): tokens with ρ_t outside [lo, hi] are dropped
               (IcePop: 0.5, 5.0); (0, 0) is off
  reject       none | k1_sum | k1_mean | k3_mean: drop whole sequences whose
               statistic is outside [reject_min, reject_max];
               k1 = -log ρ (KL(π_rollout‖π_old), summed or averaged over the
               row's tokens), k3 = ρ - 1 - log ρ (averaged)
  denominator  "verl": dropped tokens and sequences leave the loss mask, so
               the token-mean / seq-mean normalisers shrink (verl's rollout
               rejection edits response_mask); "trl": their weight is 0 but
               they stay in the normalisers.

Two ways to get π_old (`rl.old_logp`):
  recompute  "decoupled" (three policies): the trainer scores π_old before
             the update; ρ is a constant of the step, so `correct` runs once
             on the whole step's batch (exact under any micro-batching).
  sampler    "bypass": π_old := π_rollout, so the PPO ratio itself is
             π_θ/π_rollout; the correction then uses ρ = exp(sg(lp) - roll),
             known only inside the loss, per micro-batch: dropped rows keep
             their place in the normalisers (denominator "trl" only,
             checked by the config).

Metrics (before truncation/masking, over the valid tokens): ratio mean / max
/ min, sequence-ratio max / min, fractions truncated / masked / rejected,
KL(π_rollout‖π_old) by k1 and k3, the χ² divergence E[(ρ - 1)²], the
fraction of tokens with ρ outside [0.9, 1.1], and max |old - roll|. They are partial
sums over the given normalisers (losses.accumulate_metrics combines them).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

LOG_RATIO_CLAMP = 20.0
IS_LEVELS = ("none", "token", "sequence")
IS_MODES = ("truncate", "mask")
REJECT_STATS = ("none", "k1_sum", "k1_mean", "k3_mean")
DENOMINATORS = ("verl", "trl")


@dataclasses.dataclass(frozen=True)
class CorrectionSettings:
  is_level: str = "none"
  is_mode: str = "truncate"
  is_threshold: float = 2.0
  band: tuple = (0.0, 0.0)
  reject: str = "none"
  reject_min: float = -1e30
  reject_max: float = 1e30
  denominator: str = "verl"

  @property
  def active(self) -> bool:
    return (self.is_level != "none" or self.reject != "none"
            or self.band[1] > 0)

  @classmethod
  def from_config(cls, rc) -> "CorrectionSettings":
    return cls(is_level=rc.is_level, is_mode=rc.is_mode,
               is_threshold=float(rc.is_threshold),
               band=tuple(float(x) for x in rc.band), reject=rc.reject,
               reject_min=float(rc.reject_min),
               reject_max=float(rc.reject_max), denominator=rc.denominator)


def _token_mean(x_nt, mask_nt, num_tokens):
  return (x_nt * mask_nt).sum() / num_tokens


def _seq_mean(x_nt, mask_nt):
  return (x_nt * mask_nt).sum(axis=1) / jnp.maximum(mask_nt.sum(axis=1), 1.0)


def sequence_statistic(name: str, log_rho_nt: jax.Array, mask_nt: jax.Array
                       ) -> jax.Array:
  """The per-row rejection statistic [N] (see the module docstring)."""
  k1_nt = -log_rho_nt                           # log π_rollout - log π_old
  if name == "k1_sum":
    return (k1_nt * mask_nt).sum(axis=1)
  if name == "k1_mean":
    return _seq_mean(k1_nt, mask_nt)
  if name == "k3_mean":
    return _seq_mean(jnp.exp(log_rho_nt) - 1.0 - log_rho_nt, mask_nt)
  raise ValueError(f"rollout_correction.reject={name!r}; allowed: "
                   f"{REJECT_STATS}")


def is_weights(log_rho_nt: jax.Array, mask_nt: jax.Array,
               correction: CorrectionSettings) -> tuple[jax.Array, jax.Array]:
  """(w [N, T], bound [N, T] bool: where the threshold changed ρ)."""
  if correction.is_level == "token":
    rho_nt = jnp.exp(log_rho_nt)
  else:   # sequence: ρ_seq = Π_t ρ_t, the same on every token of the row
    log_seq_n1 = jnp.clip((log_rho_nt * mask_nt).sum(axis=1, keepdims=True),
                          -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    rho_nt = jnp.broadcast_to(jnp.exp(log_seq_n1), log_rho_nt.shape)
  bound_nt = rho_nt > correction.is_threshold
  if correction.is_mode == "truncate":
    return jnp.minimum(rho_nt, correction.is_threshold), bound_nt
  return jnp.where(bound_nt, 0.0, rho_nt), bound_nt


def correct(old_logp_nt: jax.Array, roll_logp_nt: jax.Array,
            mask_nt: jax.Array, correction: CorrectionSettings,
            num_tokens: Optional[jax.Array] = None, num_seqs=None):
  """(weight_nt, mask_nt, metrics): multiply the per-token loss by sg(weight)
  and aggregate it with the returned mask (see `denominator`).
  num_tokens / num_seqs: normalisers of the metrics (default: this batch's
  valid tokens / rows), for partial sums over micro-batches."""
  mask_nt = jnp.asarray(mask_nt, jnp.float32)
  log_rho_nt = jax.lax.stop_gradient(jnp.clip(
      old_logp_nt.astype(jnp.float32) - roll_logp_nt, -LOG_RATIO_CLAMP,
      LOG_RATIO_CLAMP))
  valid_nt = mask_nt > 0
  nonempty_n = mask_nt.sum(axis=1) > 0
  if num_tokens is None:
    num_tokens = jnp.maximum(mask_nt.sum(), 1.0)
  if num_seqs is None:
    num_seqs = jnp.maximum(nonempty_n.sum(dtype=jnp.float32), 1.0)
  rho_nt = jnp.exp(log_rho_nt)
  log_seq_n = (log_rho_nt * mask_nt).sum(axis=1)
  frac = lambda b: _token_mean(b.astype(jnp.float32), mask_nt, num_tokens)
  metrics = {
      "rollout_is/ratio/mean": _token_mean(rho_nt, mask_nt, num_tokens),
      "rollout_is/ratio/max": jnp.where(valid_nt, rho_nt, -jnp.inf).max(),
      "rollout_is/ratio/min": jnp.where(valid_nt, rho_nt, jnp.inf).min(),
      "rollout_is/seq_log_ratio/max": jnp.where(nonempty_n, log_seq_n,
                                                -jnp.inf).max(),
      "rollout_is/seq_log_ratio/min": jnp.where(nonempty_n, log_seq_n,
                                                jnp.inf).min(),
      "rollout_kl/k1": _token_mean(-log_rho_nt, mask_nt, num_tokens),
      "rollout_kl/k3": _token_mean(rho_nt - 1.0 - log_rho_nt, mask_nt,
                                   num_tokens),
      # χ²(π_old‖π_rollout) = E_rollout[(ρ - 1)²], and how many tokens'
      # ratios leave [0.9, 1.1]: the mismatch a low-precision sampler adds
      "rollout_chi2": _token_mean(jnp.square(rho_nt - 1.0), mask_nt,
                                  num_tokens),
      "rollout_is/outside_0.9_1.1_frac": frac((rho_nt < 0.9) | (rho_nt > 1.1)),
      "rollout_logp_diff/max": jnp.where(
          valid_nt, jnp.abs(old_logp_nt - roll_logp_nt), 0.0).max(),
  }
  weight_nt = jnp.ones_like(mask_nt)
  if correction.is_level != "none":
    weight_nt, bound_nt = is_weights(log_rho_nt, mask_nt, correction)
    metrics["rollout_is/truncated_frac" if correction.is_mode == "truncate"
            else "rollout_is/masked_frac"] = frac(bound_nt)
  keep_nt = jnp.ones_like(valid_nt)
  if correction.band[1] > 0:
    # IcePop: tokens whose ρ leaves the band get no gradient at all
    keep_nt = (rho_nt >= correction.band[0]) & (rho_nt <= correction.band[1])
    metrics["rollout_is/band_masked_frac"] = frac(~keep_nt)
  if correction.reject != "none":
    stat_n = sequence_statistic(correction.reject, log_rho_nt, mask_nt)
    ok_n = (stat_n >= correction.reject_min) & (stat_n <= correction.reject_max)
    keep_nt = keep_nt & ok_n[:, None]
    metrics["rollout_is/rejected_seq_frac"] = (
        (nonempty_n & ~ok_n).sum(dtype=jnp.float32) / num_seqs)
  keep = keep_nt.astype(jnp.float32)
  if correction.denominator == "verl":
    mask_nt = mask_nt * keep
  else:
    weight_nt = weight_nt * keep
  return weight_nt * (mask_nt > 0), mask_nt, metrics


def validate(correction: CorrectionSettings, old_logp: str) -> None:
  """Choices and ranges of `rl.rollout_correction`, naming the field."""
  for field, value, allowed in (("is_level", correction.is_level, IS_LEVELS),
                                ("is_mode", correction.is_mode, IS_MODES),
                                ("reject", correction.reject, REJECT_STATS),
                                ("denominator", correction.denominator, DENOMINATORS)):
    if value not in allowed:
      raise ValueError(f"config field 'rl.rollout_correction.{field}' = "
                       f"{value!r}; allowed: {allowed}")
  if correction.is_threshold <= 0:
    raise ValueError(f"config field 'rl.rollout_correction.is_threshold' = "
                     f"{correction.is_threshold} must be > 0")
  lo, hi = correction.band
  if len(correction.band) != 2 or not (hi == 0 and lo == 0 or 0 <= lo < 1 < hi):
    raise ValueError(f"config field 'rl.rollout_correction.band' = {correction.band}:"
                     f" (0, 0) for off, else 0 <= lo < 1 < hi")
  if correction.reject_min > correction.reject_max:
    raise ValueError(f"config fields 'rl.rollout_correction.reject_min/max' "
                     f"= {correction.reject_min}/{correction.reject_max}: need min <= max")
  if old_logp == "sampler" and correction.active and correction.denominator == "verl" and (
      correction.reject != "none" or correction.band[1] > 0):
    raise ValueError(
        "config field 'rl.rollout_correction.denominator' = 'verl' with "
        "rl.old_logp = 'sampler': the bypass correction is computed inside "
        "each micro-batch, so dropped tokens cannot leave the global "
        "normalisers; use denominator='trl' or rl.old_logp='recompute'")
