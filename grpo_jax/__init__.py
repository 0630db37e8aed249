"""grpo_jax: STaR, GRPO and DAPO post-training of language-model reasoners in JAX."""
__version__ = "0.1.0"
