"""The algorithm layer: advantages, policy losses and aggregation, KL
estimators, memory-bounded token log-probs, and DAPO dynamic sampling.

Importing this package registers the "advantage", "loss_agg" and
"kl_estimator" names with grpo_jax.registry.
"""
from grpo_jax.algorithms import advantages
from grpo_jax.algorithms import dynamic_sampling
from grpo_jax.algorithms import logprobs
from grpo_jax.algorithms import losses
