"""The algorithm layer: advantages, policy losses and aggregation, KL
estimators, rollout correction, memory-bounded token log-probs, and DAPO
dynamic sampling.

Importing this package registers the "advantage", "policy_loss", "loss_agg"
and "kl_estimator" names with grpo_jax.registry.
"""
from grpo_jax.algorithms import advantages
from grpo_jax.algorithms import dynamic_sampling
from grpo_jax.algorithms import logprobs
from grpo_jax.algorithms import losses
from grpo_jax.algorithms import policy_losses
from grpo_jax.algorithms import rollout_correction
