"""Batches for the update step that tests share (pytest puts tests/ on sys.path)."""
import jax.numpy as jnp
import numpy as np

from grpo_jax.rl import update


def random_update_batch(n=8, prompt=6, comp=5, seed=0) -> update.UpdateBatch:
  """n rows of random tokens: `prompt` prompt columns, then completions of
  random lengths 1..comp (the mask), sampler log-probs near -2, no
  reference, random advantages."""
  rng = np.random.RandomState(seed)
  lengths = rng.randint(1, comp + 1, n)
  mask = (np.arange(comp)[None] < lengths[:, None]).astype(np.float32)
  tokens = rng.randint(1, 256, (n, prompt + comp)).astype(np.int32)
  pos = np.broadcast_to(np.arange(prompt + comp), (n, prompt + comp))
  return update.UpdateBatch(
      jnp.asarray(tokens), jnp.asarray(pos, jnp.int32),
      jnp.ones((n, prompt + comp), bool), jnp.asarray(mask),
      jnp.asarray(rng.randn(n, comp).astype(np.float32) * 0.1 - 2.0),
      jnp.zeros((n, comp)), jnp.asarray(rng.randn(n).astype(np.float32)))
