"""The algorithm layer: advantages, policy losses and aggregation, KL
estimators, rollout correction, on-policy distillation's per-token signal,
memory-bounded token log-probs, and DAPO
dynamic sampling.

Importing this package registers the "advantage", "policy_loss", "loss_agg"
and "kl_estimator" names with grpo_jax.registry.
"""
from grpo_jax.algorithms import (
    advantages,
    distillation,
    dynamic_sampling,
    logprobs,
    losses,
    policy_losses,
    rollout_correction,
)
