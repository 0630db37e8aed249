"""The policy loss composed: a registered per-token loss (policy_losses.py:
ppo, gspo, cispo, cispo_cap, gmpo, sapo) times the rollout-correction weights
(rollout_correction.py), aggregation, KL to the reference, and the metrics of
one update.

Shapes: N sequences (B*G completions, or one micro-batch of them), T tokens.
Every per-token array is [N, T]; `mask_nt` is 1 on completion tokens that get
a gradient (0 on padding and on overlong-filtered completions).

Exact gradient accumulation. Every aggregation mode is written as
`sum over this batch / normaliser of the GLOBAL batch`:

  token-mean               Σ m·x / num_tokens                        (DAPO eq. 8)
  seq-mean-token-mean      Σ_i (Σ_t m·x / Σ_t m) / num_seqs          (GRPO)
  seq-mean-token-sum       Σ m·x / num_seqs
  seq-mean-token-sum-norm  Σ m·x / (num_seqs · max_len)              (Dr. GRPO)

where `Normalisers(num_tokens, num_seqs, max_len)` is computed ONCE from the
mask of the whole mini-batch (`normalisers(mask_nt)` over all micro-batches,
all devices, all hosts) and passed to every micro-batch. Then each
micro-batch's loss is a partial sum of the global loss: summing the losses
(and the gradients) of the micro-batches gives exactly the loss (and the
gradient) of the whole batch, however it is split. Do not average
micro-batch losses; add them. Under `jax.jit` with a sharded global batch the
sums are already global, so devices need nothing extra.

The metrics follow the same rule: keys ending in "/max" or "/min" combine by
max / min, every other key is a partial sum (already divided by the global
normalisers) and combines by addition: `accumulate_metrics`.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from grpo_jax.algorithms import policy_losses, rollout_correction
from grpo_jax.registry import lookup, register

LOG_RATIO_CLAMP = policy_losses.LOG_RATIO_CLAMP
K3_CLAMP = 10.0          # verl: low_var_kl clamped to [-10, 10]


# ----------------------------------------------------------------------------
# Per-token pieces.
# ----------------------------------------------------------------------------

# The PPO pieces live with the other registered losses; the names stay here.
ratio = policy_losses.ratio
clipped_surrogate = policy_losses.clipped_surrogate


# ----------------------------------------------------------------------------
# KL to the reference policy (Schulman's estimators), d = lp - ref; the
# reference log-probs are constants.
# ----------------------------------------------------------------------------

def _log_ratio_to_ref(logp_nt: jax.Array, ref_logp_nt: jax.Array) -> jax.Array:
  return logp_nt.astype(jnp.float32) - jax.lax.stop_gradient(ref_logp_nt)


@register("kl_estimator", "k1")
def kl_k1(logp_nt: jax.Array, ref_logp_nt: jax.Array) -> jax.Array:
  """k1 = d: unbiased for KL(π‖π_ref), high variance, can be negative."""
  return _log_ratio_to_ref(logp_nt, ref_logp_nt)


@register("kl_estimator", "k2")
def kl_k2(logp_nt: jax.Array, ref_logp_nt: jax.Array) -> jax.Array:
  """k2 = d²/2: biased, low variance, always >= 0."""
  return 0.5 * jnp.square(_log_ratio_to_ref(logp_nt, ref_logp_nt))


@register("kl_estimator", "k3")
def kl_k3(logp_nt: jax.Array, ref_logp_nt: jax.Array) -> jax.Array:
  """k3 = exp(-d) + d - 1 (DeepSeekMath eq. 4, verl "low_var_kl"): unbiased
  and >= 0; d clamped to ±20 and the result to [-10, 10] as verl does."""
  d = jnp.clip(_log_ratio_to_ref(logp_nt, ref_logp_nt),
               -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
  return jnp.clip(jnp.exp(-d) + d - 1.0, -K3_CLAMP, K3_CLAMP)


def kl_beta_schedule(step, *, beta: float, start_step: int = 0,
                     ramp_steps: int = 0) -> jax.Array:
  """β at `step` (int or traced): 0 before `start_step`, then rising linearly
  from 0 to `beta` over `ramp_steps` steps (at once when 0), then `beta`."""
  since = jnp.asarray(step, jnp.float32) - start_step
  frac = jnp.clip(since / ramp_steps, 0.0, 1.0) if ramp_steps > 0 else 1.0
  return jnp.where(since >= 0, beta * frac, 0.0).astype(jnp.float32)


# ----------------------------------------------------------------------------
# Aggregation: partial sums over global normalisers (see the module docstring).
# ----------------------------------------------------------------------------

class Normalisers(NamedTuple):
  """Denominators of the WHOLE batch that one update step sees."""
  num_tokens: jax.Array   # Σ m over all sequences
  num_seqs: jax.Array     # sequences with at least one valid token
  max_len: float          # T_max, the constant of seq-mean-token-sum-norm


def normalisers(mask_nt: jax.Array, max_len: Optional[int] = None
                ) -> Normalisers:
  """Normalisers from the mask of the whole batch; max_len defaults to T.
  Counts are floored at 1 so an all-masked batch gives loss 0, not NaN."""
  m = jnp.asarray(mask_nt, jnp.float32)
  num_tokens = jnp.maximum(m.sum(), 1.0)
  num_seqs = jnp.maximum((m.sum(axis=1) > 0).sum(dtype=jnp.float32), 1.0)
  return Normalisers(num_tokens, num_seqs,
                     float(m.shape[1] if max_len is None else max_len))


@register("loss_agg", "token-mean")
def token_mean(x_nt: jax.Array, mask_nt: jax.Array,
               norm: Normalisers) -> jax.Array:
  # DAPO eq. 8: every token of the global batch weighs the same
  return (x_nt * mask_nt).sum() / norm.num_tokens


@register("loss_agg", "seq-mean-token-mean")
def seq_mean_token_mean(x_nt: jax.Array, mask_nt: jax.Array,
                        norm: Normalisers) -> jax.Array:
  # DeepSeekMath eq. 3: 1/G Σ_i 1/|o_i| Σ_t
  seq_len_n = jnp.maximum(mask_nt.sum(axis=1), 1.0)
  return ((x_nt * mask_nt).sum(axis=1) / seq_len_n).sum() / norm.num_seqs


@register("loss_agg", "seq-mean-token-sum")
def seq_mean_token_sum(x_nt: jax.Array, mask_nt: jax.Array,
                       norm: Normalisers) -> jax.Array:
  return (x_nt * mask_nt).sum() / norm.num_seqs


@register("loss_agg", "seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(x_nt: jax.Array, mask_nt: jax.Array,
                            norm: Normalisers) -> jax.Array:
  # Dr. GRPO: a constant normaliser, no per-sequence length division
  return (x_nt * mask_nt).sum() / (norm.num_seqs * norm.max_len)


# ----------------------------------------------------------------------------
# Metrics (partial sums like the loss; combine with accumulate_metrics).
# ----------------------------------------------------------------------------

def ratio_metrics(ratio_nt: jax.Array, mask_nt: jax.Array,
                  norm: Normalisers) -> dict[str, jax.Array]:
  """Token-mean, max and min of ρ over valid tokens."""
  valid_nt = mask_nt > 0
  return {"ratio/mean": token_mean(ratio_nt, mask_nt, norm),
          "ratio/max": jnp.where(valid_nt, ratio_nt, -jnp.inf).max(),
          "ratio/min": jnp.where(valid_nt, ratio_nt, jnp.inf).min()}


def accumulate_metrics(total: Optional[dict], new: dict) -> dict:
  """Combines the metrics of two micro-batches (or starts with total=None)."""
  if total is None:
    return dict(new)
  def combine(key):
    if key.endswith("/max"):
      return jnp.maximum(total[key], new[key])
    if key.endswith("/min"):
      return jnp.minimum(total[key], new[key])
    return total[key] + new[key]
  return {key: combine(key) for key in new}


# ----------------------------------------------------------------------------
# The composed loss.
# ----------------------------------------------------------------------------

def _token_advantages(adv: jax.Array, shape: tuple[int, int]) -> jax.Array:
  """[N] per completion or [N, T] per token -> [N, T] float32."""
  adv = jnp.asarray(adv, jnp.float32)
  if adv.ndim == 1:
    adv = adv[:, None]
  if adv.ndim != 2 or adv.shape[0] != shape[0]:
    raise ValueError(f"advantages of shape {adv.shape} do not fit tokens "
                     f"{shape}; pass [N] or [N, T]")
  return jnp.broadcast_to(adv, shape)


@dataclasses.dataclass(frozen=True)
class PolicyLossSpec:
  """The static settings of `policy_loss`, each value once, checked here.

  name: a "policy_loss" (policy_losses.py); params: its hyper-parameters
  (clip ranges, caps, temperatures); agg: a "loss_agg" name, applied to the
  policy and the KL terms alike (a loss with a fixed aggregation must be
  given it); kl_estimator: a "kl_estimator" name; bypass_correction:
  rollout correction with π_old = π_rollout (rl.old_logp = sampler),
  ρ = exp(sg(lp) - old) computed inside the loss.
  """
  name: str = "ppo"
  params: policy_losses.LossParams = policy_losses.LossParams()
  agg: str = "token-mean"
  kl_estimator: str = "k3"
  bypass_correction: Optional[rollout_correction.CorrectionSettings] = None

  def __post_init__(self):
    policy_losses.validate_params(self.name, self.params)
    fixed = lookup("policy_loss", self.name).fixed_agg
    if fixed is not None and self.agg != fixed:
      raise ValueError(f"policy loss {self.name!r} aggregates {fixed!r} "
                       f"only; got agg={self.agg!r}")
    lookup("loss_agg", self.agg)
    lookup("kl_estimator", self.kl_estimator)

  @classmethod
  def from_config(cls, rl) -> "PolicyLossSpec":
    """config.rl's policy loss (ValueError naming the bad parameter)."""
    return cls(
        name=rl.policy_loss, agg=rl.loss_agg, kl_estimator=rl.kl_estimator,
        params=policy_losses.LossParams(
            eps_low=rl.eps_low, eps_high=rl.eps_high,
            dual_clip=rl.dual_clip or None, cispo_cap=rl.cispo_cap,
            gmpo_eps=rl.gmpo_eps, sapo_tau_pos=rl.sapo_tau_pos,
            sapo_tau_neg=rl.sapo_tau_neg),
        bypass_correction=(
            rollout_correction.CorrectionSettings.from_config(
                rl.rollout_correction)
            if rl.old_logp == "sampler" else None))


def policy_loss(logp_nt: jax.Array, old_logp_nt: jax.Array, adv: jax.Array,
                mask_nt: jax.Array, ref_logp_nt: Optional[jax.Array] = None,
                *, spec: PolicyLossSpec = PolicyLossSpec(), kl_beta=0.0,
                norm: Optional[Normalisers] = None,
                entropy_nt: Optional[jax.Array] = None,
                is_weight_nt: Optional[jax.Array] = None):
  """The policy loss `spec` names (+ β·KL), and its metrics.

  logp_nt, old_logp_nt, ref_logp_nt: [N, T] token log-probs under the current,
  sampling and reference policies (ref None: no KL term, β must be 0).
  adv: [N] (outcome) or [N, T] (process) advantages. mask_nt: [N, T].
  kl_beta: a float or a traced scalar (e.g. kl_beta_schedule(step, ...)).
  norm: normalisers of the whole batch for micro-batching (module docstring);
  None computes them from this batch. entropy_nt: [N, T], a metric only.
  is_weight_nt: [N, T] rollout-correction weights (constants) multiplying the
  per-token policy loss (rollout_correction.correct, decoupled mode).
  Returns (loss scalar, metrics dict of scalars).
  """
  if ref_logp_nt is None and isinstance(kl_beta, (int, float)) and kl_beta:
    raise ValueError(f"kl_beta={kl_beta} needs ref_logp_nt")
  loss_fn = lookup("policy_loss", spec.name).fn
  bypass_correction = spec.bypass_correction
  mask_nt = jnp.asarray(mask_nt, jnp.float32)
  norm = normalisers(mask_nt) if norm is None else norm
  aggregate = lookup("loss_agg", spec.agg)
  adv_nt = _token_advantages(adv, logp_nt.shape)
  pg_nt, flags = loss_fn(logp_nt, old_logp_nt, adv_nt, mask_nt, spec.params)
  metrics = {}
  if bypass_correction is not None:   # metrics always, weights when active
    weight_nt, _, corr = rollout_correction.correct(
        jax.lax.stop_gradient(logp_nt), old_logp_nt, mask_nt,
        bypass_correction, norm.num_tokens, norm.num_seqs)
    metrics.update(corr)
    if bypass_correction.active:
      is_weight_nt = weight_nt if is_weight_nt is None else (
          is_weight_nt * weight_nt)
  if is_weight_nt is not None:
    pg_nt = pg_nt * jax.lax.stop_gradient(is_weight_nt)
  pg_loss = aggregate(pg_nt, mask_nt, norm)
  frac = lambda b: token_mean(
      jnp.broadcast_to(b, mask_nt.shape).astype(jnp.float32), mask_nt, norm)
  metrics.update({"loss/pg": pg_loss,
                  **{k: frac(v) for k, v in flags.items()},
                  **ratio_metrics(ratio(logp_nt, old_logp_nt), mask_nt, norm)})
  total = pg_loss
  if ref_logp_nt is not None:
    kl_nt = lookup("kl_estimator", spec.kl_estimator)(logp_nt, ref_logp_nt)
    kl_loss = aggregate(kl_nt, mask_nt, norm)
    total = total + kl_beta * kl_loss
    metrics.update({"loss/kl": kl_loss, "kl": token_mean(kl_nt, mask_nt, norm)})
  if entropy_nt is not None:
    metrics["entropy"] = token_mean(entropy_nt, mask_nt, norm)
  metrics["loss"] = total
  return total, jax.lax.stop_gradient(metrics)
