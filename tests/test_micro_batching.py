"""Micro-batches chosen by a token budget; scoring split into strided
micro-batches like the update gives the same log-probs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.models import get_preset, init_params
from grpo_jax.rl import update

CONFIG = get_preset("tiny")


@pytest.mark.parametrize("mini,seq,size,budget,want", [
    (512, 20992, 0, 0, 512),          # nothing set: the whole mini-batch
    (512, 20992, 64, 10 ** 9, 64),    # micro_batch_size wins
    (512, 20992, 0, 64 * 20992, 64),  # 64 rows of 20,992 tokens
    (48, 100, 0, 1700, 16),           # 17 rows fit; 16 divides 48
    (48, 100, 0, 50, 1),              # not even one row: one row
])
def test_micro_batch_rows(mini, seq, size, budget, want):
  assert update.micro_batch_rows(mini, seq, size, budget) == want


@pytest.mark.parametrize("num_micro,group_size", [
    (2, 1), pytest.param(4, 4, marks=pytest.mark.slow), (2, 4)])
def test_scoring_in_micro_batches_equals_one_pass(num_micro, group_size):
  params = init_params(CONFIG, jax.random.key(0))
  B, G, P, T = 2, 4, 5, 6
  rng = np.random.default_rng(0)
  prompt = np.repeat(rng.integers(1, 200, (B, P)), G, axis=0)
  tokens = jnp.asarray(np.concatenate(
      [prompt, rng.integers(1, 200, (B * G, T))], axis=1), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(P + T), tokens.shape)
  valid = jnp.asarray(np.arange(P + T)[None] < P + 3 + np.arange(B * G)[:, None] % 4)
  s = update.LossSettings(chunk=4)
  rows = update.UpdateBatch(tokens, positions, valid)
  program = lambda k: update.UpdateProgram(
      CONFIG, s, num_micro=k, group_size=group_size, logp_shape=(B * G, T))
  one = update.score_logprobs(update.Policy(params), rows, program(1))
  split = update.score_logprobs(update.Policy(params), rows,
                                program(num_micro))
  np.testing.assert_allclose(split, one, rtol=1e-5, atol=1e-5)
