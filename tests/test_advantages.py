"""Advantage estimators: REFERENCE.md golden numbers and hand-computed cases."""
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import registry
from grpo_jax.algorithms import advantages as adv_lib

GOLDEN_R = [[1.0, 0.0, 0.0, 1.0]]  # one group, G = 4


def test_grpo_golden_delta_1e6():
  # REFERENCE: std (ddof=1) = 0.577350; A (δ=1e-6) = ±0.866024
  assert float(jnp.std(jnp.array(GOLDEN_R), ddof=1)) == pytest.approx(
      0.577350, abs=1e-6)
  adv = adv_lib.grpo_advantages(jnp.array(GOLDEN_R))
  np.testing.assert_allclose(adv, [[0.866024, -0.866024, -0.866024, 0.866024]],
                             atol=1e-6)


def test_grpo_golden_delta_1e4():
  adv = adv_lib.grpo_advantages(jnp.array(GOLDEN_R), eps=1e-4)
  np.testing.assert_allclose(adv, [[0.865875, -0.865875, -0.865875, 0.865875]],
                             atol=1e-6)


def test_dr_grpo_golden():
  adv = adv_lib.dr_grpo_advantages(jnp.array(GOLDEN_R))
  np.testing.assert_allclose(adv, [[0.5, -0.5, -0.5, 0.5]], atol=1e-7)


def test_grpo_ddof_is_used():
  # population std of [1, 0, 0, 1] is 0.5, so A = ±0.5 / (0.5 + δ)
  adv = adv_lib.grpo_advantages(jnp.array(GOLDEN_R), ddof=0, eps=0.0)
  np.testing.assert_allclose(adv, [[1.0, -1.0, -1.0, 1.0]], atol=1e-6)


def test_grpo_is_per_group():
  # three groups, each normalised on its own; a group without variance gets 0
  reward_bg = jnp.array([[1.0, 0.0, 0.0, 1.0],
                         [3.0, 3.0, 3.0, 3.0],
                         [0.0, 0.0, 0.0, 2.0]])
  adv = adv_lib.grpo_advantages(reward_bg)
  np.testing.assert_allclose(adv[0], [0.866024, -0.866024, -0.866024,
                                      0.866024], atol=1e-6)
  np.testing.assert_array_equal(adv[1], np.zeros(4))
  # group 3: mean 0.5, std (ddof 1) = 1 -> A = r - 0.5
  np.testing.assert_allclose(adv[2], [-0.5, -0.5, -0.5, 1.5], atol=1e-5)


def test_rloo_hand_computed():
  adv = adv_lib.rloo_advantages(jnp.array([[1.0, 2.0, 3.0, 6.0],
                                           [1.0, 0.0, 0.0, 1.0]]))
  # r_0 - (2+3+6)/3, r_1 - (1+3+6)/3, r_2 - (1+2+6)/3, r_3 - (1+2+3)/3
  np.testing.assert_allclose(adv[0], [-8 / 3, -4 / 3, 0.0, 4.0], atol=1e-6)
  np.testing.assert_allclose(adv[1], [2 / 3, -2 / 3, -2 / 3, 2 / 3], atol=1e-6)


def test_process_supervision_hand_computed():
  # group 0: completion 0 ends steps at t=1 (r=1) and t=3 (r=0.25);
  # completion 1 at t=0 (r=0) and t=4 (r=0.75). Non-step entries are junk.
  junk = 99.0
  step_reward_bgt = jnp.array([
      [[junk, 1.0, junk, 0.25, junk], [0.0, junk, junk, junk, 0.75]],
      [[junk, 5.0, junk, junk, junk], [junk] * 5]])
  step_end_bgt = jnp.array([
      [[0, 1, 0, 1, 0], [1, 0, 0, 0, 1]],
      [[0, 1, 0, 0, 0], [0, 0, 0, 0, 0]]], bool)
  adv = adv_lib.grpo_process_advantages(step_reward_bgt, step_end_bgt)
  # mean 0.5; deviations .5, -.25, -.5, .25; std = sqrt(0.625 / 3) = 0.456435
  z = np.array([0.5, -0.25, -0.5, 0.25]) / (np.sqrt(0.625 / 3) + 1e-6)
  np.testing.assert_allclose(z, [1.095443, -0.547721, -1.095443, 0.547721],
                             atol=1e-6)
  expected_0 = [z[0] + z[1], z[0] + z[1], z[1], z[1], 0.0]
  expected_1 = [z[2] + z[3], z[3], z[3], z[3], z[3]]
  np.testing.assert_allclose(adv[0, 0], expected_0, atol=1e-5)
  np.testing.assert_allclose(adv[0, 1], expected_1, atol=1e-5)
  # group 1 has one step: no std with ddof=1, advantages are 0 (not NaN)
  np.testing.assert_array_equal(adv[1], np.zeros((2, 5)))


def test_registered_with_uniform_keywords():
  assert {"grpo", "dr_grpo", "rloo", "grpo_process"} <= set(
      registry.names("advantage"))
  r = jnp.array(GOLDEN_R)
  for name in ("grpo", "dr_grpo", "rloo"):
    adv = registry.lookup("advantage", name)(r, ddof=1, eps=1e-6)
    assert adv.shape == (1, 4)
    assert abs(float(adv.sum())) < 1e-6  # all three are centred per group


def test_group_too_small_is_an_error():
  with pytest.raises(ValueError, match="ddof"):
    adv_lib.grpo_advantages(jnp.ones((3, 1)))
