"""DAPO dynamic sampling and overlong filtering (host-side numpy)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.algorithms import dynamic_sampling as ds

G = 4


def test_group_has_signal():
  reward_bg = np.array([[0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 0, 0],
                        [-1, -1, 1, -1], [0.5, 0.5, 0.5, 0.5000001]])
  np.testing.assert_array_equal(ds.group_has_signal(reward_bg),
                                [False, False, True, True, True])


def _generator(patterns):
  """generate(i) -> batch i: rewards from a list of 0/1 patterns per group,
  plus payloads that let a test check the groups stay aligned."""
  def generate(i):
    reward_bg = np.array(patterns[i], np.float32)
    n = len(reward_bg)
    group_id = 100 * i + np.arange(n)
    return {"reward_bg": reward_bg, "group_id_b": group_id,
            "tokens_bgt": np.broadcast_to(group_id[:, None, None], (n, G, 3))}
  return generate


ALL, NONE, MIX, MIX2 = [1] * G, [0] * G, [1, 0, 0, 0], [1, 1, 0, 1]


def test_returns_exactly_b_groups_all_with_variance():
  patterns = [[ALL, MIX, NONE, NONE],        # 1 kept of 4
              [NONE, MIX2, NONE, ALL],       # 1 kept
              [MIX, MIX, MIX2, NONE]]        # 3 kept: 2 surplus
  batch, info = ds.sample_until_full(_generator(patterns), 4,
                                     max_gen_batches=10)
  assert len(batch["reward_bg"]) == 4
  assert np.all(batch["reward_bg"].std(axis=1) > 0)
  # the first 4 kept groups, in order, with their payloads alongside
  np.testing.assert_array_equal(batch["group_id_b"], [1, 101, 200, 201])
  np.testing.assert_array_equal(batch["tokens_bgt"][:, 0, 0], [1, 101, 200, 201])
  assert info["dynamic/num_gen_batches"] == 3
  assert info["dynamic/kept_fraction"] == pytest.approx(5 / 12)
  assert info["dynamic/cap_hit"] == 0 and not info["filler_b"].any()


def test_stops_as_soon_as_full():
  calls = []
  def generate(i):
    calls.append(i)
    return {"reward_bg": np.array([MIX, MIX, NONE], np.float32)}
  batch, info = ds.sample_until_full(generate, 2, max_gen_batches=5)
  assert calls == [0] and len(batch["reward_bg"]) == 2
  assert info["dynamic/kept_fraction"] == pytest.approx(2 / 3)


def test_cap_fill_keeps_the_shape_and_marks_fillers():
  patterns = [[NONE, MIX, ALL], [ALL, NONE, NONE]]
  batch, info = ds.sample_until_full(_generator(patterns), 3,
                                     max_gen_batches=2, on_cap="fill")
  assert len(batch["reward_bg"]) == 3
  np.testing.assert_array_equal(info["filler_b"], [False, True, True])
  assert info["dynamic/cap_hit"] == 1 and info["dynamic/num_filler"] == 2
  # the real group first, then no-signal fillers (GRPO advantage 0)
  assert batch["group_id_b"][0] == 1
  assert not ds.group_has_signal(batch["reward_bg"][1:]).any()
  assert info["dynamic/kept_fraction"] == pytest.approx(1 / 6)


def test_cap_fewer_and_raise():
  patterns = [[NONE, MIX, ALL], [ALL, MIX2, NONE]]
  batch, info = ds.sample_until_full(_generator(patterns), 3,
                                     max_gen_batches=2, on_cap="fewer")
  np.testing.assert_array_equal(batch["group_id_b"], [1, 101])
  assert info["dynamic/cap_hit"] == 1 and len(info["filler_b"]) == 2
  with pytest.raises(RuntimeError, match="2 < 3"):
    ds.sample_until_full(_generator(patterns), 3, max_gen_batches=2,
                         on_cap="raise")
  with pytest.raises(ValueError, match="allowed"):
    ds.sample_until_full(_generator(patterns), 3, max_gen_batches=2,
                         on_cap="pad")


def test_accumulator_is_immutable():
  acc0 = ds.GroupAccumulator()
  acc1 = ds.add_generation_batch(acc0, {"reward_bg": np.array([MIX, NONE])})
  assert ds.num_kept(acc0) == 0 and acc0.num_groups_seen == 0
  assert ds.num_kept(acc1) == 1 and acc1.num_groups_seen == 2


def test_overlong_filter_numpy_and_jax():
  mask_nt = np.array([[1, 1, 0], [1, 1, 1], [1, 0, 0]], bool)
  truncated_n = np.array([False, True, False])
  expected = [[1, 1, 0], [0, 0, 0], [1, 0, 0]]
  np.testing.assert_array_equal(ds.overlong_filter(mask_nt, truncated_n),
                                expected)
  got = jax.jit(ds.overlong_filter)(jnp.asarray(mask_nt, jnp.float32),
                                    jnp.asarray(truncated_n))
  np.testing.assert_array_equal(got, expected)
  assert got.dtype == jnp.float32
