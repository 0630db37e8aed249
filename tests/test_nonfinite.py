"""Non-finite is an error, never a number (issue 31, item 1).

NaN/inf in the config is refused before any work, naming the field; a
non-finite update is not applied, the run stops with one line naming the step
and the quantity (or skips it, counted); non-finite parameters are never
saved; non-finite metrics are logged as such.
"""
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import tiny
from grpo_jax import checkpoint, errors, validation
from grpo_jax.harness import cli, metrics
from grpo_jax.rl import nonfinite, train, update
from grpo_jax.rl.update import init_state

NAN, INF = float("nan"), float("inf")


def _set(config, path, value):
  *groups, key = path.split(".")
  node = config
  for g in groups:
    node = node[g]
  node[key] = value
  return config


@pytest.mark.parametrize("path, value, says", [
    ("rl.adv_eps", 0.0, "'rl.adv_eps' = 0.0 must be > 0: rl.advantage = 'grpo'"),
    ("optim.learning_rate", NAN, "'optim.learning_rate' = nan is not a finite"),
    ("sampling.temperature", INF, "'sampling.temperature' = inf is not a fin"),
    ("rewards.last_number", NAN, "'rewards.last_number' = nan is not a finite"),
    ("rl.kl_beta", NAN, "'rl.kl_beta' = nan is not a finite number"),
    ("optim.grad_clip", INF, "'optim.grad_clip' = inf is not a finite number"),
    ("optim.grad_clip", 0.0, "'optim.grad_clip' = 0.0 must be > 0"),
    ("optim.eps", 0.0, "'optim.eps' = 0.0 must be > 0"),
    ("optim.b2", 1.0, "'optim.b2' = 1.0 must be in [0, 1)"),
    ("rl.rollout_correction.band", (0.5, INF),
     "'rl.rollout_correction.band[1]' = inf"),
    ("eval.top_p", NAN, "'eval.top_p' = nan"),
    ("train.on_non_finite", "ignore",
     "'train.on_non_finite' = 'ignore'; allowed: ('stop', 'skip')"),
])
def test_config_with_a_non_finite_or_dividing_value_is_refused(path, value, says):
  with pytest.raises(errors.ConfigError, match="config field " + re.escape(says)):
    validation.validate(_set(tiny.get_config(), path, value))


def test_zero_eps_is_kept_where_nothing_divides_and_greedy_eval_is_allowed():
  config = _set(tiny.get_config(), "rl.advantage", "dr_grpo")
  config.rl.adv_eps = 0.0        # Dr. GRPO divides by no std
  config.eval.temperature = 0.0  # documented: greedy
  validation.validate(config)
  # the defaults are finite, the rollout correction's ±1e30 bounds too
  validation.validate(tiny.get_config())


def test_metrics_with_nan_and_inf_round_trip_through_the_writer(tmp_path):
  writer = metrics.MetricWriter(str(tmp_path))
  writer.write(1, {"loss": NAN, "grad_norm": INF, "reward/mean": 0.5,
                   "eval/x": -INF})
  writer.close()
  line = (tmp_path / "metrics.jsonl").read_text().strip()
  assert json.loads(line)["reward/mean"] == 0.5
  [row] = metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert math.isnan(row["loss"]) and row["grad_norm"] == INF
  assert row["eval/x"] == -INF
  tb = {tag: v for _, tag, v in
        metrics.read_tensorboard(str(tmp_path / "tensorboard"))}
  assert tb == {"reward/mean": 0.5, "nonfinite/loss": 1.0,
                "nonfinite/grad_norm": 1.0, "nonfinite/eval/x": 1.0}


def test_checkpointer_refuses_a_state_with_a_nan(tmp_path):
  state = {"params": {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)},
           "step": jnp.int32(1)}
  with checkpoint.Checkpointer(checkpoint.checkpoint_dir(tmp_path),
                               save_every=1, async_save=False) as ckpt:
    assert ckpt.save(1, state)
    state["params"]["w"] = state["params"]["w"].at[2, 1].set(NAN)
    with pytest.raises(errors.NonFiniteError,
                       match=r"refusing to save checkpoint step 2 in .*: "
                             r"'params/w' holds a NaN or inf; the latest "
                             r"checkpoint stays step 1"):
      ckpt.save(2, state)
    assert ckpt.all_steps() == [1]


def test_update_whose_parameters_would_turn_nan_is_not_applied():
  """apply_gradients, the RL update's and STaR's SFT step's optimizer step:
  a finite loss and gradient whose update makes a NaN parameter."""
  params = {"b": jnp.zeros(2), "w": jnp.ones((2, 3))}
  optimizer = optax.sgd(NAN)
  state = init_state(params, optimizer, 0)
  grads = {"b": jnp.zeros(2), "w": jnp.full((2, 3), 0.5)}   # 0 * NaN is NaN
  new, checked = jax.jit(update.apply_gradients, static_argnums=(3, 4))(
      state, grads, jnp.float32(1.0), optimizer, None)
  code = int(checked[nonfinite.CODE])
  assert float(checked["grad_norm"]) == pytest.approx(math.sqrt(1.5))
  assert nonfinite.describe(code, nonfinite.leaf_names(params)) == (
      "parameter 'b' is not finite after the update")
  assert int(new.step) == 1
  for a, b in zip(jax.tree.leaves((new.params, new.opt_state)),
                  jax.tree.leaves((state.params, state.opt_state))):
    np.testing.assert_array_equal(a, b)
  loss_code = jax.jit(nonfinite.first_nonfinite)(jnp.float32(NAN),
                                                 jnp.float32(INF), params)
  assert int(loss_code) == 1     # the loss is named first


def _nan_advantages_at_step(monkeypatch, bad_step: int):
  """The RL loop's advantages turn NaN at (1-based) step `bad_step`."""
  real_learn, real_advantages = train.learn, train.advantages
  now = {}

  def learn(r, state, groups, metrics, step):
    now["step"] = step + 1
    return real_learn(r, state, groups, metrics, step)

  def advantages(*args, **kwargs):
    adv = real_advantages(*args, **kwargs)
    return adv * np.nan if now["step"] == bad_step else adv

  monkeypatch.setattr(train, "learn", learn)
  monkeypatch.setattr(train, "advantages", advantages)


def test_nan_at_step_2_stops_with_step_1_saved_then_skip_resumes_from_it(
    tmp_path, monkeypatch):
  _nan_advantages_at_step(monkeypatch, 2)
  config = tiny.get_config()
  config.train.update(steps=2, checkpoint_every=1, keep_checkpoints=3,
                      eval_at_start=False, eval_at_end=False)
  workdir = str(tmp_path)
  with pytest.raises(errors.NonFiniteError) as stopped:
    train.run(config, workdir)
  message = cli.describe(stopped.value, workdir)
  assert message == str(stopped.value) and "\n" not in message
  assert message.startswith("step 2/2: the loss is not finite, so its update "
                            "was not applied and the run stopped")
  ckpt_dir = checkpoint.checkpoint_dir(workdir)
  assert checkpoint.finalized_steps(ckpt_dir) == [1]
  rows = metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert [r["step"] for r in rows] == [1, 2]
  assert rows[0]["update/skipped"] == 0 and math.isfinite(rows[0]["loss"])
  assert rows[1]["update/skipped"] == 1 and math.isnan(rows[1]["loss"])

  # skip: resumes from the intact step-1 checkpoint (checksums verified)
  # and skips step 2's update (parameters and optimizer state unchanged)
  config.train.on_non_finite = "skip"
  summary = train.run(config, workdir)
  assert int(summary["state"].step) == 2
  rows = metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert [(r["step"], r["update/skipped"]) for r in rows] == [(1, 0), (2, 1)]
  sums = [json.loads((ckpt_dir / str(s) / "meta" / "metadata").read_text())[
      "checksums"] for s in (1, 2)]
  changed = sorted(k for k in sums[0] if sums[0][k] != sums[1][k])
  assert changed == ["key", "step"]   # optimizer count and all else kept
